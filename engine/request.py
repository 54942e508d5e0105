"""Requests, their sampling parameters and their outputs.

Names follow vLLM v1: a :class:`Request` holds ``prompt_token_ids``, ``output_token_ids``,
``num_computed_tokens`` (tokens whose K/V are in the paged cache) and ``block_ids`` (its block table).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import RequestError

if TYPE_CHECKING:
    import torch

MAX_N = 16  # most parallel completions of one request
MAX_STOP_STRINGS = 64  # stop strings per request: each is matched against every new token's text
MAX_LOGPROBS = 20  # most top logprobs per token (vLLM's default max_logprobs, OpenAI's top_logprobs limit)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # seeds are signed 64-bit integers (as OpenAI's and vLLM's)


class RequestStatus(enum.IntEnum):
    """Life cycle of a request. ``WAITING`` -> ``RUNNING`` -> one of the ``FINISHED_*`` states;
    a preempted request goes back to ``WAITING`` (recompute preemption)."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI/vLLM finish reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or None."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; the meanings are vLLM's.

    Attributes:
        n: number of completions (1..MAX_N). The n sequences share the prompt's KV blocks; a shared,
            partly filled block is copied before one of them writes into it (copy-on-write).
        temperature: 0 means greedy (argmax); > 0 scales the logits.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; -1 (or 0) disables it.
        min_p: drop tokens whose probability is below ``min_p`` x the top probability; 0 disables.
        repetition_penalty: in [0.01, 100]; 1 disables. Applied to tokens of the prompt and of the output
            (CTRL paper, Keskar et al. 2019, as in vLLM and transformers).
        seed: per-request seed; the same seed gives the same tokens whatever else is in the batch.
        max_tokens: maximum number of generated tokens (>= 1); None means up to the context length.
        stop: strings that end the completion (at most ``MAX_STOP_STRINGS``); they are not included in the text.
        stop_token_ids: extra token ids that end the completion (the token is kept in ``token_ids``).
        ignore_eos: keep generating after EOS (benchmarks).
        skip_special_tokens: drop special tokens from the text.
        presence_penalty / frequency_penalty: in [-2, 2], OpenAI's meanings (vLLM's): the logit of every
            token already in the *output* is lowered by ``presence_penalty`` once and by ``frequency_penalty``
            per occurrence.
        min_tokens: the end-of-sequence token and ``stop_token_ids`` cannot be sampled (their logits are
            -inf) and stop strings are not looked for until this many tokens exist (vLLM's rule).
        logprobs: None (off) or how many top alternatives (0..``MAX_LOGPROBS``) to return with the logprob
            of every sampled token. Logprobs are those of the raw model output (log-softmax of the logits
            before penalties, biases, temperature and truncation: vLLM's default ``raw_logprobs``).
        logit_bias: token id -> value in [-100, 100] added to its logit before sampling (OpenAI's).
        allowed_token_ids: when set, only these token ids can be sampled (vLLM's).
        include_stop_str_in_output: keep the matched stop string, or the text of the EOS / stop token, in
            the text (vLLM's); by default they are left out.
        truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last ``max_model_len``), as
            vLLM does; None keeps the whole prompt.

    Raises:
        ValueError: from :meth:`validate` when a value is out of range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Check every field.

        Raises:
            engine.errors.RequestError: for the first bad field, with ``param`` its name.
        """
        if not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {self.n!r}", "n")
        if self.n > MAX_N:
            raise RequestError(f"n must be at most {MAX_N}, got {self.n}", "n")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0.0):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0.01 <= self.repetition_penalty <= 100.0):
            raise RequestError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}", "repetition_penalty")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(f"seed must be an integer in the signed 64-bit range [{SEED_MIN}, {SEED_MAX}], "
                               f"got {self.seed!r}", "seed")
        stop, stop_token_ids = self.stop, self.stop_token_ids
        assert stop is not None and stop_token_ids is not None  # lists since __post_init__
        if any((not isinstance(s, str)) or s == "" for s in stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
        if any((not isinstance(t, int)) or t < 0 for t in stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2.0 <= v <= 2.0):
                raise RequestError(f"{name} must be in [-2, 2], got {v!r}", name)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise RequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}", "min_tokens")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}", "logprobs")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise RequestError("logit_bias must map token ids to numbers", "logit_bias")
            for t, v in self.logit_bias.items():
                if not isinstance(t, int) or t < 0:
                    raise RequestError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}", "logit_bias")
                if not (isinstance(v, (int, float)) and -100.0 <= v <= 100.0):
                    raise RequestError(f"logit_bias values must be in [-100, 100], got {v!r} for token {t}", "logit_bias")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise RequestError("allowed_token_ids must be a non-empty list of token ids (integers >= 0)", "allowed_token_ids")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int)
            or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)
        ):
            raise RequestError(f"truncate_prompt_tokens must be -1 or an integer >= 1, "
                               f"got {self.truncate_prompt_tokens!r}", "truncate_prompt_tokens")

    def needs_logits_processing(self, num_output_tokens: int) -> bool:
        """True when sampling the next token after ``num_output_tokens`` must change the logits before the
        argmax / draw for reasons other than the repetition penalty: logit bias, allowed token ids,
        presence / frequency penalties, or min_tokens not reached yet."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.presence_penalty
                    or self.frequency_penalty or num_output_tokens < self.min_tokens)


@dataclass
class ChatPrompt:
    """A chat to render with the model's chat template, and how (the flags of vLLM's chat endpoint).

    Attributes:
        messages: ``{"role", "content"}`` dicts of strings.
        add_generation_prompt: end with the header that opens a new assistant turn.
        continue_final_message: leave the last message open (no end-of-turn token after it), so the model
            continues it (transformers' ``apply_chat_template(..., continue_final_message=True)``); not
            together with ``add_generation_prompt``.
        add_special_tokens: let the tokenizer add its special tokens (BOS...) on top of the template's.
        chat_template_kwargs: extra variables for the template.
        special_tokens_in_messages: read special-token strings in the messages' text (``<|im_end|>``...) as the
            control tokens they name, as a plain render would (a user may then forge turns, a system message
            included); False (the default): the messages' text is tokenized as text, only the template's own
            markup yields special tokens (see :mod:`engine.chat_tokens`).
    """

    messages: list[dict[str, str]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    special_tokens_in_messages: bool = False


@dataclass
class TextPrompt:
    """A plain text prompt and whether the tokenizer adds its special tokens (BOS...) to it (default yes,
    as a plain string prompt)."""

    text: str
    add_special_tokens: bool = True


class Request:
    """One sequence being served.

    Attributes:
        request_id: unique id (str).
        prompt_token_ids: prompt tokens (list[int]).
        output_token_ids: generated tokens so far (list[int]).
        num_computed_tokens: tokens of ``prompt + output`` whose K/V are in the cache (tokens).
        block_ids: the block table: physical block ids holding this request's K/V, in order.
        batch_slot: batch slot (row of the batch, and of the occupancy panel) while running, else None.
            Not to be confused with a KV-cache slot (``slot_mapping``: a token position in the paged cache).
        eos_token_ids: token ids that finish the request unless ``ignore_eos``.
        max_tokens: effective generation limit (tokens), after clamping to the context length.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        arrival_time: float | None = None,
        prompt: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.batch_slot: int | None = None
        self.num_preemptions = 0
        self.error: str | None = None
        self.stop_reason: str | int | None = None
        limit = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - len(self.prompt_token_ids)
            limit = room if limit is None else min(limit, room)
        self.max_tokens: int = max(limit if limit is not None else 1, 0)
        # timings (seconds, time.monotonic())
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # per-request state owned by other components
        self.generator: torch.Generator | None = None  # for seeded sampling (sampler)
        # with sampling_params.logprobs: one (token id, logprob, [(top id, logprob), ...]) per output token,
        # written by the sampler when it picks the token (position = its index in output_token_ids)
        self.output_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.detokenizer = None  # IncrementalDetokenizer (engine core)
        self.output_text = ""  # text emitted so far (stop strings removed)
        self.output_text_offsets: list[int] = []  # with logprobs: where each token's text begins (characters)
        self.pending_text = ""  # text produced since the last RequestOutput
        self.cache_salt: str | None = None  # keeps prefix-cache entries apart (per session)
        # parallel sampling (n > 1): the user-facing id, this sequence's completion index, and, on the
        # first sequence until its prompt is computed, the siblings that fork from it then
        self.group_id = request_id
        self.index = 0
        self.pending_forks: list[Request] = []
        self.num_hit_blocks = 0  # leading blocks taken from the prefix cache at admission

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens (tokens)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token (seconds), None before it."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: ``(finish - first token) / (tokens - 1)`` (seconds);
        None until the request finished with at least two tokens."""
        n = len(self.output_token_ids)
        if self.first_token_time is None or self.finish_time is None or n < 2:
            return None
        return (self.finish_time - self.first_token_time) / (n - 1)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``).

    Attributes:
        index: completion index (0 for n=1).
        text: full text so far (stop strings removed).
        token_ids: generated token ids so far.
        delta: text new since the previous output of this request (streaming).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or None while running.
        stop_reason: the stop string or stop token id that ended it (None for EOS, length, ...).
        logprobs: when the request asked for them, one ``(token_id, logprob, top)`` per token of
            ``token_ids`` (``top``: the best ``(token_id, logprob)`` pairs, most likely first), else None.
        text_offsets: with ``logprobs``, one per token of ``token_ids``: the character offset in the decoded text
            at which the token's text begins (a token that only begins a character shares the offset of the
            token that completes it; the tokens of a stop string that was cut off point at or past the end of
            ``text``), else None.
    """

    index: int
    text: str
    token_ids: list[int]
    delta: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    text_offsets: list[int] | None = None


@dataclass(frozen=True)
class RequestState:
    """Where a request stands after a step: what a chat's status line shows, carried by its outputs.

    Attributes:
        kind: ``"queued"`` (in the waiting queue), ``"prefilling"`` (prompt tokens still to compute),
            ``"decoding"`` or ``"finished"``.
        position, waiting: queued: its 1-based place in the waiting queue and the queue's length.
        computed, prompt: prefilling: prompt tokens in the KV cache and in the prompt (tokens).
        preempted: it has been preempted at least once (queued again, or recomputing its prompt).
    """

    kind: str
    position: int | None = None
    waiting: int | None = None
    computed: int | None = None
    prompt: int | None = None
    preempted: bool = False


@dataclass
class RequestOutput:
    """What the engine returns for a request: the whole state so far plus the newest delta.

    ``text``, ``token_ids``, ``delta`` and ``finish_reason`` are those of ``outputs[0]``.
    ``error`` is set (and ``finish_reason == "error"``) when this request failed alone.
    ``metrics`` holds timings in seconds: ``arrival_time``, ``first_token_time``, ``finish_time``,
    ``ttft`` (wall clock: what the client waited), ``paused_time`` (the part of that wait before the first
    token during which the engine was held by Pause; the panels' TTFT leaves it out), and counts
    (``num_preemptions``). ``state`` says where the request stands after the step
    (:class:`RequestState`): the engine also sends an output without new text when only that changed
    (its place in the queue, a prompt chunk computed, a preemption).
    """

    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    state: RequestState | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def delta(self) -> str:
        return self.outputs[0].delta

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
