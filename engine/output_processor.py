"""The engine's output step: sampled token ids -> text deltas, stop strings, :class:`RequestOutput`.

:meth:`OutputProcessor.process_tokens` is the text step of :meth:`engine.core.EngineCore.step`: it runs after
the scheduler has appended the step's tokens (:meth:`engine.scheduler.Scheduler.update_from_output`, which
returns their token-level stops as data), turns each new token into UTF-8-safe text with its sequence's
:class:`IncrementalDetokenizer`, finds stop *strings* (only the text can show them) and returns each
sequence's stop by the one rule of :mod:`engine.stopping`, as data again; the core then ends those requests
(:meth:`engine.scheduler.Scheduler.apply_stops`), so the blocks of a request that ends return to the pool in
the same step. Nothing here calls back into the scheduler. vLLM v1 also keeps the detokenizer and the
stop-string check in its output processor.
"""

from __future__ import annotations

import logging

from engine.detokenizer import IncrementalDetokenizer
from engine.request import CompletionOutput, Request, RequestOutput, RequestStatus, SamplingParams
from engine.stopping import Stop, resolve

log = logging.getLogger(__name__)


class OutputProcessor:
    """Detokenizes generated tokens, applies stop strings and builds :class:`RequestOutput` objects.

    Args:
        tokenizer: the model's transformers tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def new_detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        """The incremental detokenizer of one sequence (any thread).

        Raises:
            ValueError: a stop string is empty or not a string.
        """
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
                                      params.include_stop_str_in_output)

    def process_tokens(self, changed: list[Request], token_stops: dict[str, Stop]) -> dict[str, Stop]:
        """The text step: :meth:`detokenize` the newest token of each sequence of ``changed`` (in order) with
        its token-level stop from ``token_stops`` (request id -> :class:`engine.stopping.Stop`).

        Returns:
            request id -> the :class:`engine.stopping.Stop` of each sequence that ends. A fault while
            detokenizing one sequence ends it alone (``FINISHED_ERROR``, "detokenizing failed: ...").
        """
        stops: dict[str, Stop] = {}
        for req in changed:
            try:
                stop = self.detokenize(req, token_stops.get(req.request_id))
            except Exception as e:
                log.exception("detokenizing failed for request %s", req.request_id)
                stop = Stop(RequestStatus.FINISHED_ERROR, error=f"detokenizing failed: {e!r}")
            if stop is not None:
                stops[req.request_id] = stop
        return stops

    def detokenize(self, req: Request, token_stop: Stop | None) -> Stop | None:
        """Turn ``req``'s newest token into text (``request.pending_text``) and return its stop
        (:func:`engine.stopping.resolve` of ``token_stop``, the token-level stop, and the stop string this
        token completed, if any).

        vLLM's rules: the text of the EOS or stop token that ended a request is left out of its text
        (kept with ``include_stop_str_in_output``; the token stays in ``token_ids``), stop strings are
        looked for only once the request has more than ``min_tokens`` tokens, and a request ended by a
        token or by its length gets the text its detokenizer held back.
        """
        detok = req.detokenizer
        if detok is None:
            return token_stop
        sp = req.sampling_params
        if sp.logprobs is not None:  # where this token's text begins in the decoded text (completions' text_offset)
            req.output_text_offsets.append(detok.decoded_chars)
        check = len(req.output_token_ids) > sp.min_tokens
        if token_stop is not None and token_stop.by_token and not sp.include_stop_str_in_output:
            delta, stop_str = "", None  # no text for the EOS or stop token that ended it
        else:
            delta, stop_str = detok.update(req.output_token_ids[-1], check_stop=check)
        req.pending_text += delta
        if stop_str is None and token_stop is not None:
            req.pending_text += detok.flush(check_stop=check)
            stop_str = detok.stop_reason  # a stop string the held-back text completed (it cut the text too)
        return resolve(token_stop, stop_str)

    @staticmethod
    def make_output(seq: Request) -> RequestOutput:
        """The :class:`RequestOutput` of one sequence (one completion, index ``seq.index``); moves its pending
        text into the delta. The children of an n > 1 request are merged at the front
        (:class:`engine.parallel_sampling.ParentRequest`)."""
        delta, seq.pending_text = seq.pending_text, ""
        seq.output_text += delta
        tokens = list(seq.output_token_ids)
        logprobs = offsets = None
        if seq.sampling_params.logprobs is not None:
            logprobs, offsets = seq.output_logprobs[:len(tokens)], seq.output_text_offsets[:len(tokens)]
        completion = CompletionOutput(seq.index, seq.output_text, tokens, delta, seq.status.finish_reason,
                                      seq.stop_reason, logprobs, offsets)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            error=seq.error,
            metrics={
                "arrival_time": seq.arrival_time,
                "first_token_time": seq.first_token_time,
                "finish_time": seq.finish_time,
                "num_preemptions": seq.num_preemptions,
                "ttft": seq.ttft,
            },
        )
