"""One declaration of every command-line option: name, type, default, help and environment variable.

``app.py``, ``python -m engine`` and the bench all build their parsers from these tables, so a flag
means the same thing and has the same default everywhere (``tests/test_options.py`` checks it).
The engine's options are :data:`ENGINE_OPTIONS` (fields of :class:`engine.config.EngineConfig`);
other front ends declare their own tables of :class:`Option` (the server's live in ``server/``).

Every option also reads ``CBP_<NAME>`` from the environment when a parser is built with
``env=os.environ`` (the app does; the command line wins over the variable).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

from engine.config import FORWARDS, FREE_BLOCK_ORDERS, POLICIES, STATIC_DECODE, EngineConfig

ENV_PREFIX = "CBP_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Option:
    """One option.

    Attributes:
        name: Python name (``max_num_seqs``); the flag is ``--max-num-seqs``, the variable
            ``CBP_MAX_NUM_SEQS``.
        type: ``int``, ``float``, ``str`` or ``bool`` (a ``--name/--no-name`` switch).
        default: value when neither the flag nor the variable is given (None = "the engine decides").
        help: one line for ``--help``.
        choices: allowed values, or None.
        low, high: inclusive bounds of a number (None = unbounded); ``low_open`` makes ``low`` exclusive.
        shown_default: what ``--help`` says the default is, where the value alone would not say it (None:
            the value; nothing for None or an empty string).
    """

    name: str
    type: type
    default: object
    help: str
    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    shown_default: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def parse(self, text: str):
        """``text`` as a value of this option.

        Raises:
            ValueError: not of the option's type, not one of its choices, or out of its bounds.
        """
        text = text.strip()
        if self.type is bool:
            word = text.lower()
            if word not in _TRUE | _FALSE:
                raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}, got {text!r}")
            return word in _TRUE
        try:
            value = self.type(text)
        except ValueError:
            raise ValueError(f"expected {self.type.__name__}, got {text!r}") from None
        self.check(value)
        return value

    def check(self, value) -> None:
        """Raise ``ValueError`` when ``value`` is outside the option's choices or bounds."""
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"must be one of {self.choices}, got {value!r}")
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            raise ValueError(f"must be {'>' if self.low_open else '>='} {self.low:g}, got {value!r}")
        if self.high is not None and value > self.high:
            raise ValueError(f"must be <= {self.high:g}, got {value!r}")

    def from_env(self, env: Mapping[str, str]):
        """The value of ``CBP_<NAME>`` in ``env`` (see :meth:`parse`), or None when unset or empty.

        Raises:
            ValueError: the variable's text is not a valid value; the message names the variable.
        """
        raw = env.get(self.env_var)
        if raw is None or raw.strip() == "":
            return None
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.env_var}: {e}") from None

    def _argparse_type(self, text: str):
        try:
            return self.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None


_CFG = {f.name: f.default for f in fields(EngineConfig)}

ENGINE_OPTIONS: tuple[Option, ...] = (
    Option("model", str, None, "model folder, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)"),
    Option("dtype", str, None, "bfloat16, float16 or float32 (default: auto: bfloat16 on CUDA and on CPUs "
                               "with native bf16, else float32)"),
    Option("device", str, None, "cpu or cuda (default: auto)"),
    Option("policy", str, _CFG["policy"], "continuous batching, or static batches for comparison",
           choices=POLICIES),
    Option("max_num_seqs", int, _CFG["max_num_seqs"], "batch slots: requests computed together", low=1),
    Option("max_num_batched_tokens", int, _CFG["max_num_batched_tokens"],
           "token budget of one engine step (tokens); longer prompts are prefilled in chunks", low=1),
    Option("prefill_chunk_tokens", int, _CFG["prefill_chunk_tokens"],
           "while any request decodes, a prompt part way through its prefill computes at most this many "
           "tokens per step; a step holds this many per prompt that can progress, new prompts first come "
           "first served", low=1),
    Option("prefill_step_target", float, None,
           "instead of a fixed chunk: while any request decodes, size a step's prompt tokens so that the step "
           "takes about this many times its decode rows alone (a ratio > 1, e.g. 3; learned from the steps run)",
           low=1.0, low_open=True, high=1e6),
    Option("block_size", int, _CFG["block_size"], "tokens per KV block", low=1),
    Option("num_blocks", int, None, "physical KV blocks", low=1, shown_default="sized from --kv-cache-memory"),
    Option("kv_cache_memory", str, None, 'KV cache budget instead of --num-blocks: bytes, "256MiB", "2GiB", '
                                         "or a fraction of free device memory such as 0.5",
           shown_default="512MiB when --num-blocks is not given"),
    Option("enable_prefix_caching", bool, _CFG["enable_prefix_caching"],
           "reuse the KV blocks of identical prompt prefixes"),
    Option("free_block_order", str, _CFG["free_block_order"],
           "which free KV block a request takes first: lru = the least recently freed (vLLM's; cached prefixes "
           "live longest), mru = the most recently freed (talk mode: a waiting request takes exactly the blocks "
           "a finished one freed a step before; evicts the freshest cached prefixes first, so fewer prefix hits)",
           choices=FREE_BLOCK_ORDERS),
    Option("forward", str, _CFG["forward"],
           "auto = the engine's own Llama-family forward (fused norms, RoPE and SiLU, merged projections) "
           "where it owns the architecture; transformers = transformers' modules with our attention",
           choices=FORWARDS),
    Option("batch_invariant", bool, _CFG["batch_invariant"],
           "a request's tokens do not depend on the rest of the batch, on chunking or on prefix-cache hits "
           "(linears in fixed row tiles; slower, see docs/performance.md)"),
    Option("static_decode", str, _CFG["static_decode"],
           "decode steps on static buffers padded to a few batch sizes, replayed from CUDA graphs on a GPU: "
           "auto = on CUDA only, on = on any device (CPU: eager, for tests), off = never (vLLM's --enforce-eager)",
           choices=STATIC_DECODE),
)

# The playground's own defaults: a small pool and few slots, so that the panels show slots being
# handed over and blocks being recycled. Everything else is the engine's default.
PLAYGROUND_DEFAULTS: dict[str, object] = {"max_num_seqs": 16, "num_blocks": 384}

# The talk preset (``python app.py --talk``, or the page's Talk preset button): a configuration a room can
# read on a projector: 4 slot rows of about 45 px, a 96-block map of large cells, and MRU free-block order, so
# that a waiting request takes exactly the blocks a finished one freed a step before ("A's blocks went to
# D"). The page's window for it is ``ui.talk.TALK_WINDOW``.
TALK_PRESET: dict[str, object] = {"max_num_seqs": 4, "num_blocks": 96, "free_block_order": "mru"}


DEFAULT_NAMES = ("default", "embedded", "smollm2")  # --model values that name the embedded default model
# a Hugging Face hub id: "name" or "org/name", word characters, dots and dashes (huggingface_hub's rule)
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


def missing_model_path(model: str | None) -> str | None:
    """The one-line error for a ``--model`` that names a local file or folder that does not exist, else None.
    A value is a local path when it starts with ``/``, ``.`` or ``~``, ends with ``.gguf``, or cannot be a
    hub id (``name`` or ``org/name``); a hub id that is also an existing path is a local path. Checked before
    anything loads, so a typo fails at once instead of after the hub client's retries."""
    if model is None or model in DEFAULT_NAMES:
        return None
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return None
    if model.startswith(("/", ".", "~")) or model.endswith(".gguf") or not _HUB_ID.match(model) \
            or "--" in model or ".." in model:
        return (f"model {model!r}: no such file or folder. Fix: pass --model / CBP_MODEL with an existing local "
                f"folder, a .gguf file or a hub id (org/name, needs network), or leave it unset for the embedded "
                f"model")
    return None


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option],
                env: Mapping[str, str] | None = None, defaults: Mapping[str, object] | None = None,
                title: str | None = None, shown: Mapping[str, str] | None = None) -> None:
    """Add ``options`` to ``parser``.

    Args:
        parser: the parser to extend.
        options: the :class:`Option` declarations to add.
        env: when given, each option defaults to its ``CBP_*`` variable there (then to its default).
        defaults: per-name defaults that replace the declared ones (e.g. :data:`PLAYGROUND_DEFAULTS`).
        title: when given, the options go into an argument group of that title (``--help`` lists them apart).
        shown: per-name text of the default in ``--help``, where the front end applies its own (e.g. the app's
            pool of 384 blocks); a value from ``env`` is shown as it is.
    """
    defaults = defaults or {}
    shown = shown or {}
    target = parser.add_argument_group(title) if title else parser
    for opt in options:
        default = defaults.get(opt.name, opt.default)
        text = shown.get(opt.name, opt.shown_default)
        if env is not None:
            from_env = opt.from_env(env)
            if from_env is not None:
                default, text = from_env, None
        if text is None and default is not None and default != "":
            text = str(default)
        suffix = "" if text is None else f" (default: {text})"
        if opt.type is bool:
            target.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction, default=default,
                                help=opt.help + suffix)
        else:
            target.add_argument(opt.flag, dest=opt.name, type=opt._argparse_type, default=default,
                                metavar="{" + ",".join(opt.choices) + "}" if opt.choices else opt.name.upper(),
                                help=opt.help + suffix)


class _HelpSwitches(argparse.Action):
    """``--help-switches``: print the runtime switches (:mod:`kernels.envs`) and exit, as ``--help`` does."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from kernels import envs  # imports torch (kernels' package): only when asked

        print(envs.help_table())
        parser.exit()


def add_help_switches(parser: argparse.ArgumentParser) -> None:
    """Add ``--help-switches``: list the runtime switches (environment variables that choose kernel paths and
    the kernel build, :data:`kernels.envs.SWITCHES`) and exit."""
    parser.add_argument("--help-switches", action=_HelpSwitches,
                        help="list the runtime switches (CBP_* environment variables that choose kernel paths and "
                             "the kernel build) and exit")


def add_engine_options(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None,
                       defaults: Mapping[str, object] | None = None, title: str | None = None,
                       shown: Mapping[str, str] | None = None) -> None:
    """Add :data:`ENGINE_OPTIONS` to ``parser`` (see :func:`add_options`)."""
    add_options(parser, ENGINE_OPTIONS, env=env, defaults=defaults, title=title, shown=shown)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """:class:`EngineConfig` keyword arguments from a namespace parsed with :func:`add_engine_options`
    (None values are left to the engine's defaults by ``EngineConfig.from_kwargs``)."""
    return {opt.name: getattr(args, opt.name) for opt in ENGINE_OPTIONS if hasattr(args, opt.name)}
