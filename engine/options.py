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
    """

    name: str
    type: type
    default: object
    help: str
    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False

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
    Option("num_blocks", int, None, "physical KV blocks (default: sized from --kv-cache-memory; the playground "
                                    "app: 384 when neither is given)", low=1),
    Option("kv_cache_memory", str, None, 'KV cache budget instead of --num-blocks: bytes, "256MiB", "2GiB", '
                                         "or a fraction of free device memory such as 0.5 (default without "
                                         "--num-blocks: 512MiB)"),
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


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option],
                env: Mapping[str, str] | None = None, defaults: Mapping[str, object] | None = None) -> None:
    """Add ``options`` to ``parser``.

    Args:
        parser: the parser to extend.
        options: the :class:`Option` declarations to add.
        env: when given, each option defaults to its ``CBP_*`` variable there (then to its default).
        defaults: per-name defaults that replace the declared ones (e.g. :data:`PLAYGROUND_DEFAULTS`).
    """
    defaults = defaults or {}
    for opt in options:
        default = defaults.get(opt.name, opt.default)
        if env is not None:
            from_env = opt.from_env(env)
            if from_env is not None:
                default = from_env
        shown = "" if default is None else f" (default: {default})"
        if opt.type is bool:
            parser.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction, default=default,
                                help=opt.help + shown)
        else:
            parser.add_argument(opt.flag, dest=opt.name, type=opt._argparse_type, default=default,
                                metavar="{" + ",".join(opt.choices) + "}" if opt.choices else opt.name.upper(),
                                help=opt.help + shown)


def add_engine_options(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None,
                       defaults: Mapping[str, object] | None = None) -> None:
    """Add :data:`ENGINE_OPTIONS` to ``parser`` (see :func:`add_options`)."""
    add_options(parser, ENGINE_OPTIONS, env=env, defaults=defaults)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """:class:`EngineConfig` keyword arguments from a namespace parsed with :func:`add_engine_options`
    (None values are left to the engine's defaults by ``EngineConfig.from_kwargs``)."""
    return {opt.name: getattr(args, opt.name) for opt in ENGINE_OPTIONS if hasattr(args, opt.name)}
