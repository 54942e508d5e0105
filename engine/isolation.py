"""Fault isolation inside one engine step: a failure that belongs to one request fails that request alone.

:class:`engine.core.EngineCore` runs each per-request stage of a step through these helpers:

- :func:`execute_isolated`: the forward. A forward that raises is retried once on the whole batch
  (nothing is committed before the step's results are applied, and a rerun writes the same K/V slots
  again); if it raises again the batch is split in halves, recursively, so the requests that do not
  trigger the fault complete and only a request that fails on its own is failed.
- :func:`reject_non_finite`: a logits row holding NaN or an infinity fails its request (greedy argmax
  would silently pick token 0).
- :func:`sample_isolated`: the sampler runs vectorised over the batch; if it raises, each row is
  sampled alone and only the rows that raise fail.

Each returns the failed requests with their error message; the caller finishes them
(``FINISHED_ERROR``, blocks freed). Stop handling, detokenizing and output building are guarded per
request where they run (``Scheduler.update_from_output``, ``OutputProcessor.process_tokens``,
``EngineCore._outputs``).
"""

from __future__ import annotations

import logging

import torch

import kernels
from engine.request import CompletionOutput, Request, RequestOutput

log = logging.getLogger(__name__)

Failed = list[tuple[Request, str]]


def execute_isolated(runner, scheduled: list[tuple[Request, int]], blocks_to_copy: list[tuple[int, int]]
                     ) -> tuple[torch.Tensor | None, list[Request], Failed]:
    """The step's forward, retried once, then narrowed by splitting the batch.

    Args:
        runner: the :class:`engine.model_runner.ModelRunner`.
        scheduled: the step's ``(request, num_new_tokens)`` pairs, in packing order.
        blocks_to_copy: copy-on-write ``(src, dst)`` block copies to make before the forward.

    Returns:
        ``(logits [S, vocab] or None, sampling requests [S], failed)``: the logits rows of the requests
        whose forward succeeded (in ``scheduled`` order) and the ``(request, error)`` pairs of those
        whose forward failed even alone.

    Raises:
        Exception: only when the copy-on-write copies themselves fail before the batch is split (the
            KV cache cannot be trusted: an engine-level fault).
    """
    try:
        logits, sampling = runner.execute_model(scheduled, blocks_to_copy)
        return logits, sampling, []
    except Exception as e:
        log.warning("model forward failed (%r); retrying once", e)
    try:  # a transient fault: the same batch again (its K/V slots are simply written again)
        logits, sampling = runner.execute_model(scheduled, blocks_to_copy)
        return logits, sampling, []
    except Exception as e:
        if len(scheduled) == 1:
            log.exception("model forward failed twice for %s", scheduled[0][0].request_id)
            return None, [], [(scheduled[0][0], f"model forward failed: {e!r}")]
        log.warning("model forward failed again (%r); splitting the batch of %d", e, len(scheduled))
    # the copies are made once more now (a failed attempt may have written into their destinations),
    # and never again: a later half must not overwrite what an earlier half wrote into a copied block
    runner.copy_blocks(list(blocks_to_copy))
    parts: list[tuple[torch.Tensor | None, list[Request]]] = []
    failed: Failed = []
    _narrow(runner, scheduled, parts, failed)
    rows: list[torch.Tensor] = []
    for lg, s in parts:
        if s:
            assert lg is not None  # execute_model returns logits whenever a request samples
            rows.append(lg)
    sampling = [r for _, s in parts for r in s]
    logits = torch.cat(rows) if rows else None
    return logits, sampling, failed


def _narrow(runner, group: list[tuple[Request, int]], parts: list, failed: Failed) -> None:
    """Run ``group``'s two halves separately; a half that fails is split again, down to one request."""
    mid = len(group) // 2
    for half in (group[:mid], group[mid:]):
        try:
            parts.append(runner.execute_model(half, ()))
        except Exception as e:
            if len(half) == 1:
                req = half[0][0]
                log.error("model forward failed for %s alone: %r", req.request_id, e)
                failed.append((req, f"model forward failed: {e!r}"))
            else:
                _narrow(runner, half, parts, failed)


def reject_non_finite(logits: torch.Tensor | None, sampling: list[Request]
                      ) -> tuple[torch.Tensor | None, list[Request], Failed]:
    """Drop the logits rows that hold NaN or an infinity and fail their requests.

    Args:
        logits: ``[S, vocab]`` (any floating dtype) or None; row i belongs to ``sampling[i]``.
        sampling: the requests of the rows.

    Returns:
        ``(logits [S', vocab] or None, requests [S'], failed)`` with only the finite rows kept.
    """
    if logits is None or not sampling:
        return logits, sampling, []
    ok = kernels.logits_argmax(logits)[1].tolist()  # one pass per row (C++ on CPU)
    if all(ok):
        return logits, sampling, []
    keep = [i for i, good in enumerate(ok) if good]
    failed = [(r, "the model produced non-finite logits (NaN or infinity) for this request")
              for r, good in zip(sampling, ok) if not good]
    for r, _ in failed:
        log.error("non-finite logits for request %s", r.request_id)
    if not keep:
        return None, [], failed
    rows = torch.tensor(keep, device=logits.device)
    return logits.index_select(0, rows), [sampling[i] for i in keep], failed


def sample_isolated(sampler, logits: torch.Tensor | None, sampling: list[Request]) -> tuple[dict[str, int], Failed]:
    """Sample every row at once; if that raises, each row alone, failing only the rows that raise.

    Args:
        sampler: the :class:`engine.sampler.Sampler`.
        logits: ``[S, vocab]`` or None (nothing samples).
        sampling: the requests of the rows.

    Returns:
        ``(request id -> token id, failed)``.
    """
    if logits is None or not sampling:
        return {}, []
    # a request's generator is advanced once per step; a batch that raises after some rows drew must not
    # make their retry draw again (a seeded request would no longer reproduce its solo tokens)
    states = [(g, g.get_state()) for r in sampling if (g := r.generator) is not None]
    try:
        tokens = sampler.sample(logits, sampling)
        return {r.request_id: t for r, t in zip(sampling, tokens)}, []
    except Exception as e:
        log.warning("sampling the batch failed (%r); sampling each request alone", e)
    for g, state in states:
        g.set_state(state)
    sampled: dict[str, int] = {}
    failed: Failed = []
    for i, req in enumerate(sampling):
        try:
            sampled[req.request_id] = sampler.sample(logits[i:i + 1], [req])[0]
        except Exception as e:
            log.exception("sampling failed for request %s", req.request_id)
            failed.append((req, f"sampling failed: {e!r}"))
    return sampled, failed


def error_output(seq: Request) -> RequestOutput:
    """A minimal final :class:`RequestOutput` of a failed sequence whose own output could not be built:
    no new text, its finish reason and error."""
    completion = CompletionOutput(seq.index, seq.output_text, list(seq.output_token_ids), "", seq.status.finish_reason)
    return RequestOutput(request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
                         outputs=[completion], finished=seq.is_finished, error=seq.error or "request failed",
                         metrics={})
