"""Parallel sampling (``n > 1``) at the front: a parent request fans out into n child sequences, and their
outputs are merged back into one :class:`engine.request.RequestOutput` per step, as vLLM's front end does
(``vllm/v1/engine/parallel_sampling.py``).

The engine core knows only sequences. :meth:`engine.input_processor.InputProcessor.process` builds the
children (ids ``<parent>#<i>``, seeds ``seed + i``); the first one carries the others in
``pending_forks``, so that after its prompt is computed they fork off it in the KV cache (they share
the prompt's blocks, and the last, partly filled block is copied on write: the one place of that is
:meth:`engine.kv_cache.KVCacheManager.fork`). The core reports each child under its own id;
:class:`engine.async_engine.AsyncEngine` and :class:`engine.llm.LLM` merge them with :class:`ParentRequest`.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.request import CompletionOutput, Request, RequestOutput

SEPARATOR = "#"  # child ids are "<parent id>#<index>"; a caller's request id may not contain it


def child_ids(request: Request) -> list[str]:
    """The ids of all sequences of ``request`` (a first child with its ``pending_forks``, or an n=1 request)."""
    return [request.request_id] + [s.request_id for s in request.pending_forks]


class ParentRequest:
    """One ``n > 1`` request at the front: merges its children's outputs (any thread that owns it).

    Args:
        first: the first child as the input processor returned it (``pending_forks`` holds the others).

    Attributes:
        request_id: the caller's request id (the children's ``group_id``).
        n: number of children.
    """

    def __init__(self, first: Request) -> None:
        self.request_id = first.group_id
        self.children = child_ids(first)
        self.n = len(self.children)
        self._latest = [CompletionOutput(i, "", []) for i in range(self.n)]
        self._finished: set[int] = set()
        self._first: RequestOutput | None = None  # the first child's newest output (prompt, metrics)
        self._error: str | None = None
        self._states: dict[int, RequestOutput] = {}  # child index -> its newest output

    @property
    def finished(self) -> bool:
        """True once every child has finished."""
        return len(self._finished) == self.n

    def merge(self, outputs: list[RequestOutput]) -> RequestOutput:
        """The parent's output after one step, from the outputs its children got in that step.

        Children without an output in ``outputs`` keep their text and tokens with an empty ``delta``;
        ``finished`` is True once all children have finished; ``error`` is the first child error seen;
        ``metrics`` are the first child's; ``state`` too, until the first child ends while others run (then
        the state of the lowest-index child still running).
        """
        updated = set()
        for out in outputs:
            for c in out.outputs:  # one completion per child output
                self._latest[c.index] = c
                updated.add(c.index)
                if out.finished:
                    self._finished.add(c.index)
                if c.index == 0 or self._first is None:
                    self._first = out
            self._error = self._error or out.error
        for out in outputs:
            self._states[out.outputs[0].index if out.outputs else 0] = out
        first = self._first if self._first is not None else outputs[0]
        # where the parent stands: its first child's state until that one ends, then a running child's
        live = [o for i, o in sorted(self._states.items()) if i not in self._finished]
        state = first.state if self.finished or not live or 0 not in self._finished else live[0].state
        completions = [c if i in updated else dataclasses.replace(c, delta="") for i, c in enumerate(self._latest)]
        return RequestOutput(request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                             outputs=completions, finished=self.finished, error=self._error,
                             metrics=dict(first.metrics), state=state)


def add_fork_rows(logits: torch.Tensor, sampling: list[Request]) -> tuple[torch.Tensor, list[Request]]:
    """The core's side, in the step that computes a first child's prompt: it lends its logits row to each
    sibling about to fork off it, so each draws its own first token.

    Args:
        logits: ``[len(sampling), vocab]`` float logits of the rows that sample this step.
        sampling: the requests of those rows, in order.

    Returns:
        ``logits`` with one copied row per forking sibling appended (``[len(sampling) + k, vocab]``) and
        ``sampling`` with those siblings appended.
    """
    extra = [(i, sib) for i, r in enumerate(sampling) for sib in r.pending_forks if not sib.is_finished]
    if not extra:
        return logits, sampling
    rows = torch.tensor([i for i, _ in extra], device=logits.device)
    return torch.cat([logits, logits.index_select(0, rows)]), sampling + [sib for _, sib in extra]
