"""Workloads of the benchmark: requests, their arrival times and multi-turn chats (all seeded, nothing
downloaded).

* :func:`offline_workload`: built-in chat prompts (:mod:`engine.prompts`) with right-skewed output
  lengths (:func:`skewed_max_tokens`), all at time 0;
* :func:`load_workload`: a W64-style JSON file (the reference workload ``bench/w64.json``);
* :func:`poisson_arrivals`: the same requests arriving as a Poisson process (online runs);
* :class:`MultiTurn`: C chats of T turns, each turn resending its whole history.

Chat messages become token ids in one place only, :func:`render_chat` (the tokenizer's chat template with
the generation prompt, exactly as :meth:`engine.core.EngineCore.tokenize` renders a list of messages).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from engine.prompts import chat_prompts


@dataclass
class BenchRequest:
    """One request of a workload.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt, already tokenized (chat template applied).
        max_tokens: tokens to generate (EOS is ignored, so exactly this many).
        arrival: arrival time after the start of the run (seconds); 0 for offline workloads.
        conversation: conversation index (multi-turn workloads), else None.
        turn: turn index within the conversation (0 = first).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: float = 0.0
    conversation: int | None = None
    turn: int = 0


def skewed_max_tokens(n: int, low: int = 16, high: int = 256, seed: int = 20261129) -> list[int]:
    """``n`` output lengths (tokens) in ``[low, high]``, right-skewed like chat answers: many short, a
    long tail (``low + (high - low) * u**2`` with ``u`` uniform: median about ``low + 0.25 (high - low)``,
    mean ``low + (high - low) / 3``). Deterministic for a ``seed``."""
    rng = random.Random(seed)
    return [low + int(round((high - low) * rng.random() ** 2)) for _ in range(n)]


def chat_text(tokenizer, messages: list[dict]) -> str:
    """``messages`` rendered as text with the tokenizer's chat template, generation prompt added."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template (generation prompt added),
    the same ids as :meth:`engine.core.EngineCore.tokenize` gives for a list of messages."""
    return tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"]


def offline_workload(tokenizer, n: int = 64, low: int = 16, high: int = 256, seed: int = 0) -> list[BenchRequest]:
    """``n`` built-in chat requests (varied topics and phrasings) with :func:`skewed_max_tokens` lengths
    (tokens), all arriving at time 0."""
    lengths = skewed_max_tokens(n, low, high)
    return [BenchRequest(f"r{i}", render_chat(tokenizer, msgs), mt)
            for i, (msgs, mt) in enumerate(zip(chat_prompts(n, seed), lengths))]


def load_workload(path: str, n: int | None = None, max_tokens_cap: int | None = None) -> list[BenchRequest]:
    """Requests of a W64-style JSON file (``{"requests": [{"prompt_token_ids", "max_tokens"}, ...]}``).

    Args:
        path: the file.
        n: keep the first ``n`` requests (all when None).
        max_tokens_cap: clamp every ``max_tokens`` to this (quick runs); None keeps them.
    """
    with open(path) as f:
        reqs = json.load(f)["requests"]
    if n is not None:
        reqs = reqs[:n]
    out = []
    for i, r in enumerate(reqs):
        mt = int(r["max_tokens"]) if max_tokens_cap is None else min(int(r["max_tokens"]), max_tokens_cap)
        out.append(BenchRequest(f"w{r.get('id', i)}", list(r["prompt_token_ids"]), mt))
    return out


def poisson_arrivals(requests: Sequence[BenchRequest], rate: float, seed: int = 0) -> list[BenchRequest]:
    """Copies of ``requests`` arriving as a Poisson process of ``rate`` requests/s (exponential gaps,
    first arrival after one gap), in order."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for r in requests:
        t += rng.expovariate(rate)
        out.append(BenchRequest(r.request_id, list(r.prompt_token_ids), r.max_tokens, t, r.conversation, r.turn))
    return out


FOLLOW_UPS = [
    "Tell me more.", "Can you give an example?", "Why is that?", "Summarise that in one sentence.",
    "What else should I know?", "How does that compare to something familiar?",
]


class MultiTurn:
    """``conversations`` chats of ``turns`` turns; each turn resends its whole history.

    Turn ``t + 1``'s prompt is, token for token, turn ``t``'s prompt + its generated tokens + the
    template's end-of-turn and the next user message (as a server keeping token histories would send
    it), so a prefix cache can reuse everything but the new message.

    Args:
        tokenizer: renders the first turn and the turn separators with its chat template.
        conversations: C, chats running at once.
        turns: T, turns per chat.
        max_tokens: tokens generated per turn.
        seed: picks topics and follow-up questions.
    """

    def __init__(self, tokenizer, conversations: int = 16, turns: int = 4, max_tokens: int = 64, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.conversations = conversations
        self.turns = turns
        self.max_tokens = max_tokens
        rng = random.Random(seed)
        self.first = chat_prompts(conversations, seed)
        self.follow = [[rng.choice(FOLLOW_UPS) for _ in range(turns - 1)] for _ in range(conversations)]

    def _separator(self, message: str) -> list[int]:
        """Tokens between an assistant answer and the next generation prompt, for a user ``message``."""
        marker = "\x00ANSWER\x00"
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker},
                {"role": "user", "content": message}]
        text = chat_text(self.tokenizer, msgs)
        return self.tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]

    def first_turns(self) -> list[BenchRequest]:
        """The first turn of every conversation (arrival 0)."""
        return [BenchRequest(f"c{c}t0", render_chat(self.tokenizer, self.first[c]), self.max_tokens, 0.0, c, 0)
                for c in range(self.conversations)]

    def next_turn(self, done: BenchRequest, output_token_ids: list[int]) -> BenchRequest | None:
        """The turn after ``done`` (which generated ``output_token_ids``), or None after the last."""
        c, t = done.conversation, done.turn + 1
        if c is None or t >= self.turns:
            return None
        ids = list(done.prompt_token_ids) + list(output_token_ids) + self._separator(self.follow[c][t - 1])
        return BenchRequest(f"c{c}t{t}", ids, self.max_tokens, 0.0, c, t)
