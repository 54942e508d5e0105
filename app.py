"""Continuous Batching Playground: one engine for the whole process, many browser chats on it.

Run ``python app.py`` (no argument needed: the embedded SmolLM2-135M-Instruct, 16 batch slots). Every
option can also be set by an environment variable (``CBP_`` + the option name in capitals with
underscores, e.g. ``CBP_MAX_NUM_SEQS=32``); a command-line option wins over its variable. On Hugging Face
Spaces the file runs as is: Gradio reads ``GRADIO_SERVER_NAME`` / ``GRADIO_SERVER_PORT`` there.

The options are declared once: the engine's in :mod:`engine.options` (with the playground's defaults,
:data:`engine.options.PLAYGROUND_DEFAULTS`), the server's in :mod:`server.options`, the page's below.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import NoReturn

from engine import options
from engine.options import PLAYGROUND_DEFAULTS, TALK_PRESET, Option
from server.options import add_server_options, server_kwargs

UI_OPTIONS: tuple[Option, ...] = (
    Option("refresh", float, 0.2, "seconds between two polls of the live panels by each visible tab", low=0.05),
    Option("host_key", str, "", "talk mode in a shared demo: when set, only a page opened with ?host=<key> may "
           "pause, step or slow the engine (on a Space, set CBP_HOST_KEY as a secret); empty: every page may"),
    Option("talk", bool, False, "the talk preset, a picture a room can read: 4 batch slots, 96 KV blocks, MRU "
           "free-block order and a 32-step window (options given explicitly still win)"),
)

# Remote mode (``--backend-url``): the page drives a remote OpenAI-compatible server instead of a local engine.
# The URL options may be repeated or hold several URLs separated by commas or spaces (:func:`split_urls`).
REMOTE_OPTIONS: tuple[Option, ...] = (
    Option("backend_url", str, "", "remote mode: run no local model; chats and the load generator go to the "
           "OpenAI-compatible server at the first URL (a vLLM/SGLang deployment or its router), and every URL's "
           "/metrics is scraped (one per replica or engine); repeatable, or several separated by commas/spaces"),
    Option("backend_model", str, None, "remote mode: the model name sent (default: the first of the server's "
           "/v1/models)"),
    Option("backend_api_key", str, None, "remote mode: sent as 'Authorization: Bearer <key>' (better set "
           "CBP_BACKEND_API_KEY than the flag)"),
    Option("kv_events_url", str, "", "remote mode: a ZMQ PUB endpoint of vLLM-format KV cache events to map "
           "(tcp://host:5557); repeatable (one per replica or data-parallel rank)"),
    Option("kv_replay_url", str, "", "remote mode: the ZMQ replay (ROUTER) endpoint of each --kv-events-url, "
           "paired by position (tcp://host:5558); fills sequence gaps and catches up on the events published before "
           "the page joined; repeatable"),
    Option("kv_events_topic", str, "", "remote mode: topic prefix of the KV events to subscribe to (default: all; "
           "vLLM's examples publish 'kv-events')"),
)
_REPEATABLE = frozenset({"backend_url", "kv_events_url", "kv_replay_url"})


class _Repeatable(argparse.Action):
    """A string option given several times: the values joined by commas (the first one replaces the default)."""

    def __call__(self, parser, namespace, values, option_string=None):
        mark = f"_given_{self.dest}"
        before = getattr(namespace, self.dest, None) if getattr(namespace, mark, False) else None
        setattr(namespace, self.dest, f"{before},{values}" if before else values)
        setattr(namespace, mark, True)


def _add_remote_options(p: argparse.ArgumentParser, env: Mapping[str, str] | None) -> None:
    group = p.add_argument_group("remote mode (no local model)")
    for opt in REMOTE_OPTIONS:
        default = opt.default
        if env is not None and (from_env := opt.from_env(env)) is not None:
            default = from_env
        shown = "" if not default else " (set)" if opt.name == "backend_api_key" else f" (default: {default})"
        group.add_argument(opt.flag, dest=opt.name, type=opt._argparse_type, default=default,
                           metavar=opt.name.upper(), action=_Repeatable if opt.name in _REPEATABLE else "store",
                           help=opt.help + shown)


def split_urls(text: str | None) -> list[str]:
    """The URLs of a remote-mode option: separated by commas or white space, empty parts dropped."""
    return [u for u in re.split(r"[,\s]+", text or "") if u]


# num_blocks is the playground's default only when no KV size is given at all (--num-blocks and
# --kv-cache-memory are exclusive): it is applied after parsing, not as the flag's default.
_PARSER_DEFAULTS = {**PLAYGROUND_DEFAULTS, "num_blocks": None}
_SHOWN_DEFAULTS = {"num_blocks": f"{PLAYGROUND_DEFAULTS['num_blocks']} when --kv-cache-memory is not given",
                   "kv_cache_memory": f"unset: the pool is --num-blocks {PLAYGROUND_DEFAULTS['num_blocks']}"}


def build_parser(env: Mapping[str, str] | None = None, talk: bool = False) -> argparse.ArgumentParser:
    """The app's parser: the engine's options (playground defaults, or with ``talk`` the talk preset's,
    :data:`engine.options.TALK_PRESET`), the server's, the page's, remote mode's, each in its own group of
    ``--help``; each defaulting to its ``CBP_*`` variable in ``env`` when given.

    Raises:
        ValueError: a ``CBP_*`` variable holds an invalid value.
    """
    p = argparse.ArgumentParser(
        description="Continuous Batching Playground: many browser chats on one LLM engine.",
        epilog="Every option also reads CBP_<OPTION> from the environment, e.g. CBP_PORT=7860. The runtime "
               "switches (kernel paths, the kernel build): --help-switches.",
    )
    options.add_help_switches(p)
    talk_defaults = {k: v for k, v in TALK_PRESET.items() if k != "num_blocks"} if talk else {}
    options.add_engine_options(p, env=env, defaults={**_PARSER_DEFAULTS, **talk_defaults},
                               title="engine (the local model)", shown=_SHOWN_DEFAULTS)
    add_server_options(p, env=env, title="server (one port: the page, the OpenAI API, /metrics)")
    options.add_options(p, UI_OPTIONS, env=env, title="page")
    _add_remote_options(p, env)
    return p


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Options from ``argv`` (default: ``sys.argv[1:]``), each defaulting to its ``CBP_*`` variable in ``env``
    (default: ``os.environ``), then to the built-in default. Exits (``SystemExit``, as argparse does) on a
    bad option or variable, or when both ``--num-blocks`` and ``--kv-cache-memory`` are given."""
    env = os.environ if env is None else env
    try:
        p = build_parser(env, talk=_talk_given(argv, env))
    except ValueError as e:  # a CBP_* variable that does not parse
        argparse.ArgumentParser(prog=os.path.basename(__file__)).error(str(e))
    args = p.parse_args(argv)
    if args.num_blocks is not None and args.kv_cache_memory is not None:
        p.error("give --num-blocks or --kv-cache-memory, not both")
    if args.num_blocks is None and args.kv_cache_memory is None:
        args.num_blocks = (TALK_PRESET if args.talk else PLAYGROUND_DEFAULTS)["num_blocks"]
    from server.kv_publisher import parse_kv_events_config
    from server.options import cors_settings

    try:
        parse_kv_events_config(args.kv_events_config)
        cors_settings(args)
    except ValueError as e:
        p.error(str(e))
    return args


def _talk_given(argv: Sequence[str] | None, env: Mapping[str, str]) -> bool:
    """Whether ``--talk`` (or ``CBP_TALK``) asks for the talk preset: read before the full parse, since the
    preset changes the engine options' defaults (the command line and their own variables still win)."""
    pre = argparse.ArgumentParser(add_help=False)
    opt = next(o for o in UI_OPTIONS if o.name == "talk")
    try:
        default = opt.from_env(env)
    except ValueError:  # reported by the full parse
        default = None
    pre.add_argument("--talk", action=argparse.BooleanOptionalAction, default=bool(default))
    known, _rest = pre.parse_known_args(argv)
    return bool(known.talk)


def talk_line(args: argparse.Namespace) -> str:
    """The start-up line about the talk preset: what it set, or how to get it."""
    from ui.talk import TALK_WINDOW

    preset = (f"{TALK_PRESET['max_num_seqs']} slots, {TALK_PRESET['num_blocks']} KV blocks, "
              f"{TALK_PRESET['free_block_order']} free-block order, a {TALK_WINDOW}-step window")
    if args.talk:
        return f"talk     preset on ({preset}); Pause, Step and the run-to buttons are above the panels, slow motion below them"
    return f"talk     for a room, start with --talk ({preset}) or press the page's Talk preset button"


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``AsyncEngine.from_args`` from the parsed options (unset ones left out,
    so the engine's own defaults apply)."""
    return {k: v for k, v in options.engine_kwargs(args).items() if v is not None or k == "model"}


def on_zerogpu(env: Mapping[str, str] | None = None) -> bool:
    """Whether this runs on a ZeroGPU Space (``SPACES_ZERO_GPU`` set by Hugging Face): there the GPU exists
    only inside ``@spaces.GPU`` calls (a forked worker per call), so a persistent engine loop cannot hold it."""
    env = os.environ if env is None else env
    return env.get("SPACES_ZERO_GPU", "").strip().lower() in ("1", "true", "yes")


ZEROGPU_NOTICE = ("ZeroGPU Space: the engine runs on the CPU (a ZeroGPU GPU exists only inside short "
                  "`@spaces.GPU` calls, which a continuously stepping engine cannot hold)")


def _declare_zerogpu_function() -> None:
    """ZeroGPU refuses to start a Space that declares no ``@spaces.GPU`` function: declare one that is
    never called (it costs no GPU time). ``spaces`` exists only on Spaces; elsewhere nothing happens."""
    try:
        import spaces  # type: ignore[import-not-found]
    except ImportError:
        return

    @spaces.GPU(duration=1)
    def _unused_gpu_function() -> None:  # never called: the engine runs on the CPU there
        return None


def apply_zerogpu(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str | None:
    """On a ZeroGPU Space, run the engine on the CPU (unless ``--device`` names another non-CUDA device) and
    return the notice the page header shows; elsewhere change nothing and return None."""
    if not on_zerogpu(env):
        return None
    _declare_zerogpu_function()
    if args.device is None or str(args.device).startswith("cuda"):
        args.device = "cpu"
    return ZEROGPU_NOTICE


class _PlainFormatter(logging.Formatter):
    """Start-up and run-time lines as plain text; warnings and errors say so."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


def configure_logging(level: str) -> None:
    """Plain lines at ``info`` (no timestamps, no library progress bars, uvicorn's start-up lines hidden);
    ``debug`` shows timestamps, logger names, library detail and tracebacks."""
    debug = level == "debug"
    if not debug:  # tqdm reads its TQDM_* defaults when first imported (transformers' GGUF progress bar)
        os.environ.setdefault("TQDM_DISABLE", "1")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s") if debug
                         else _PlainFormatter("%(message)s"))
    logging.basicConfig(level=logging.INFO if debug else getattr(logging, level.upper()), handlers=[handler],
                        force=True)
    if not debug:  # a CUDA build of torch on a machine without CUDA warns at every start; the engine uses the CPU
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    for name in ("engine", "kernels", "server", "ui"):  # our own detail; libraries stay at INFO
        logging.getLogger(name).setLevel(getattr(logging, level.upper()))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not debug:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def startup_lines(engine, args: argparse.Namespace, seconds: float, notice: str | None = None) -> list[str]:
    """What the start did, in a few plain lines: model, dtype and why, kernels, pool; ``seconds`` is the
    engine's start time (model load, kernel build or load, pool allocation)."""
    from engine.model_loader import describe_source, dtype_reason

    core, cfg = engine.core, engine.config
    runner = core.runner
    dtype = str(runner.dtype).removeprefix("torch.")
    lines = [f"model    {describe_source(args.model)}; engine ready in {seconds:.1f} s",
             f"dtype    {dtype} on {runner.device} ({dtype_reason(args.dtype, runner.device)})"]
    if runner.device.type == "cpu":
        import torch

        import kernels
        from kernels.cpu_linear import F32_MIN_ROWS
        from kernels.cpu_ops import LOAD_INFO, unavailable_reason

        if kernels.cpp_available() and LOAD_INFO:
            how = (f"compiled in {LOAD_INFO['seconds']:.0f} s (first start on this CPU; cached in "
                   f"{LOAD_INFO.get('directory') or 'the torch extensions folder'})" if LOAD_INFO["compiled"]
                   else f"loaded from the build cache in {LOAD_INFO['seconds']:.1f} s")
            if LOAD_INFO.get("waited"):
                how += f" after waiting {LOAD_INFO['waited']:.0f} s for another process's build"
            attention = f"C++ paged attention {how}, {LOAD_INFO['isa']}"
        else:
            attention = f"torch paged attention (C++ kernel unavailable: {unavailable_reason()})"
        packed = getattr(runner, "num_prepacked_linears", 0)
        forward = "the engine's own forward" if getattr(runner, "own_forward", None) is not None else \
            "transformers' modules"
        f32 = getattr(runner, "num_float32_linears", 0)
        f32_note = f" ({f32} of them in float32 from {F32_MIN_ROWS} rows)" if f32 else ""
        own = getattr(runner, "num_own_gemm_linears", 0)
        linears = f"{packed} linear layers on oneDNN-packed weights{f32_note}"
        if own:
            gemm = str(getattr(runner, "dtype", "")).removeprefix("torch.")
            linears = f"{own} linear layers on the engine's own {gemm} GEMM" + (f", {linears}" if packed else "")
        lines.append(f"kernels  {forward}; {attention}; {linears}; {torch.get_num_threads()} threads")
    else:
        lines.append("kernels  Triton paged attention")
    if notice:
        lines.append(f"note     {notice}")
    tokens = cfg.num_blocks * cfg.block_size
    lines.append(f"pool     {cfg.num_blocks} KV blocks x {cfg.block_size} tokens ({tokens:,} tokens), "
                 f"{cfg.max_num_seqs} batch slots, context {cfg.max_model_len:,} tokens, policy {cfg.policy}")
    return lines


@contextlib.contextmanager
def _still(doing: str, every: float = 10.0) -> Iterator[None]:
    """A line every ``every`` seconds while the block runs ("still importing (20 s)"), so that a slow start on
    a busy machine is never silent. (The engine's own phases, the model load and the kernel build, have
    theirs: :func:`kernels.cpu_build.heartbeat`, which needs torch imported.)"""
    done = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not done.wait(every):
            print(f"starting: still {doing} ({time.monotonic() - t0:.0f} s)", flush=True)

    thread = threading.Thread(target=beat, name="cbp-start-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _fail(message: str) -> NoReturn:
    """End the start with one line on stderr and exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def bind_port(args: argparse.Namespace) -> socket.socket | None:
    """The listening socket, bound now, before anything heavy loads (:func:`server.address.bind`): a port in use
    ends the start at once with one line and exit status 2. With ``--share`` Gradio binds its own socket: the
    port, when given, is only checked (None is returned)."""
    from server.address import DEFAULT_HOST, PortInUseError, bind, port_free

    if args.share:
        if args.port and not port_free(args.host or DEFAULT_HOST, args.port):
            _fail(f"port {args.port} on {args.host or DEFAULT_HOST} is in use; choose another with --port (or "
                  f"CBP_PORT), or stop the process that holds it")
        return None
    try:
        return bind(args.host, args.port)
    except PortInUseError as exc:
        _fail(str(exc))


def main(argv: Sequence[str] | None = None) -> None:
    """Parse options, start one engine, serve the Gradio app and the OpenAI-compatible API on one port
    until interrupted (Ctrl-C or SIGTERM: every stream ends with an error event, then the process exits).
    The port and a local ``--model`` path are checked first, in well under a second. A start that cannot go
    on (port in use, no such model, a model that does not load, a bad switch) ends with one line naming the
    fixes and exit status 2 (a traceback only with ``--log-level debug``)."""
    args = parse_args(argv)
    try:
        _main(args)
    except KeyboardInterrupt:  # Ctrl-C before the server runs (model load, kernel build)
        if args.log_level == "debug":
            raise
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _main(args: argparse.Namespace) -> None:
    remote = bool(split_urls(args.backend_url))
    sock = bind_port(args)
    missing = None if remote else options.missing_model_path(args.model)
    if missing is not None:
        if args.log_level == "debug":
            from engine.errors import ModelLoadError

            raise ModelLoadError(missing)
        _fail(missing)
    print("starting: importing torch, transformers and gradio" + ("" if remote else ", then the model and the "
          "kernels"), flush=True)
    with _still("importing"):
        configure_logging(args.log_level)
        from kernels import envs

        try:
            envs.check_all()
        except ValueError as exc:
            _fail(f"{exc} (see --help-switches)")
        if not remote:
            import engine.async_engine  # noqa: F401  (torch, transformers: timed here, under the heartbeat)
            import ui.layout  # noqa: F401  (gradio, plotly)
    if remote:
        main_remote(args, sock)
        return
    from engine.async_engine import AsyncEngine
    from engine.errors import ModelLoadError
    from server import build_server, serve
    from ui.layout import build_app, launch, mount_kwargs
    from ui.queue_polling import quiet_queue

    notice = apply_zerogpu(args)
    t0 = time.perf_counter()
    try:
        engine = AsyncEngine.from_args(**engine_kwargs(args))
    except ModelLoadError as exc:
        if args.log_level == "debug":
            raise
        _fail(str(exc))
    atexit.register(engine.shutdown)
    for line in startup_lines(engine, args, time.perf_counter() - t0, notice):
        print(line, flush=True)
    print(talk_line(args), flush=True)
    print("page     building the page", flush=True)
    from ui.talk import TALK_WINDOW

    demo = build_app(engine, model_name=args.model, refresh_s=args.refresh, host_key=args.host_key or None,
                     notice=notice, **({"window": TALK_WINDOW} if args.talk else {}))
    if args.share:  # a gradio.live link needs demo.launch(); the OpenAI API is not served then
        engine.max_pending = args.max_pending
        launch(demo, server_name=args.host, server_port=args.port, share=True)
        return
    # one port for both: the OpenAI-compatible API routes first, the Gradio app mounted at /
    import zmq

    try:
        app = build_server(engine, demo, **server_kwargs(args), mount_kwargs=mount_kwargs(demo))
    except zmq.ZMQError as exc:  # a KV event endpoint that cannot be bound (in use, bad address)
        _fail(f"--kv-events-config: {exc}")
    quiet_queue(demo)  # after build_server's demo.queue(): Gradio's 1 ms polling off the engine's cores
    serve(app, log_level="info" if args.log_level == "debug" else "warning", sock=sock,
          on_exit=lambda: engine.close("the server is shutting down"))
    print("stopped", flush=True)


def main_remote(args: argparse.Namespace, sock: socket.socket | None = None) -> None:
    """Remote mode: no engine; the remote page (``ui.remote.page``) on FastAPI + uvicorn on ``sock`` (bound by
    :func:`bind_port`; None with ``--share``), until interrupted. Exits with status 2 (one line) when more
    --kv-replay-url than --kv-events-url are given. A server that does not answer yet is no error: the page's
    header and notice follow it as it comes up."""
    import asyncio

    from ui.queue_polling import quiet_queue
    from ui.remote.backend import RemoteBackend
    from ui.remote.client import RemoteClient
    from ui.remote.kv import KVMap, start_subscribers
    from ui.remote.metrics import MetricsScraper
    from ui.remote.page import build_remote_app, launch_remote, remote_mount_kwargs

    urls, kv_urls, replay_urls = (split_urls(args.backend_url), split_urls(args.kv_events_url),
                                  split_urls(args.kv_replay_url))
    if len(replay_urls) > len(kv_urls):
        _fail("more --kv-replay-url than --kv-events-url (they pair by position)")
    client = RemoteClient(urls[0], args.backend_model or None, api_key=args.backend_api_key or None)
    backend = RemoteBackend(client)
    state = asyncio.run(backend.probe(timeout=10))
    scraper = MetricsScraper(urls)
    kv_map = KVMap() if kv_urls else None
    subscribers = start_subscribers(kv_urls, replay_urls, args.kv_events_topic, kv_map) if kv_map else []
    atexit.register(lambda: [s.stop() for s in subscribers])
    refresh = max(args.refresh, 1.0)
    print(f"remote   chats and load to {client.base_url} (model {client.model or '?'}); /metrics of "
          f"{len(urls)} server(s); KV events: {', '.join(kv_urls) or 'off'}; panels every {refresh:g} s", flush=True)
    if state.error:
        print(f"remote   {state.error}", flush=True)
    demo = build_remote_app(client, scraper, kv_map, subscribers, refresh_s=refresh, backend=backend)
    if args.share:
        demo.queue(max_size=args.queue_size)
        quiet_queue(demo)
        launch_remote(demo, share=True, server_name=args.host, server_port=args.port)
        demo.block_thread()
        return
    import gradio as gr
    from fastapi import FastAPI

    from server.options import http_limits
    from server.serving import serve

    app = FastAPI()
    app.include_router(demo.cbp_router)  # the chat's live channel, ahead of the mounted page
    demo.queue(max_size=args.queue_size)
    quiet_queue(demo)
    gr.mount_gradio_app(app, demo, path="/", **remote_mount_kwargs(demo))
    serve(app, log_level="info" if args.log_level == "debug" else "warning", sock=sock,
          banner="(remote mode: UI at /; no local model, no API)", limits=http_limits(args))
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
