"""The engine's output step: sampled token ids -> text deltas, stop strings, :class:`RequestOutput`.

It runs after :meth:`engine.scheduler.Scheduler.update_from_output` in every step. The scheduler stops
requests on token-level conditions (EOS, stop token ids, ``max_tokens``, the context length); this step
turns each new token into UTF-8-safe text with the request's :class:`IncrementalDetokenizer` and finds
stop *strings*, which only the text can show; the requests they end are handed back to the caller,
which finishes them in the scheduler (so their blocks return to the pool in the same step). vLLM v1
splits the work the same way (its detokenizer and stop-string check live in the output processor).
"""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.request import CompletionOutput, Request, RequestOutput, RequestStatus, SamplingParams


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

    def process_tokens(self, changed: list[Request]) -> list[Request]:
        """Turn the newest token of each request in ``changed`` into text (``request.pending_text``).

        A request that the scheduler already finished (EOS, stop token, length) gets its held-back text
        flushed. A stop string that completes sets ``request.stop_reason`` to it; a request that hit
        ``max_tokens`` on the same token becomes ``FINISHED_STOPPED`` (the stop string wins, as in vLLM).

        vLLM's rules: the text of the EOS or stop token that ended a request is left out of its text
        (kept with ``include_stop_str_in_output``; the token stays in ``token_ids``), and stop strings are
        looked for only once the request has more than ``min_tokens`` tokens.

        Returns:
            The still running requests whose stop string matched: the caller must finish them with
            ``FINISHED_STOPPED``.
        """
        stopped: list[Request] = []
        for req in changed:
            detok = req.detokenizer
            if detok is None:
                continue
            sp = req.sampling_params
            check = len(req.output_token_ids) > sp.min_tokens
            if req.status == RequestStatus.FINISHED_STOPPED and not sp.include_stop_str_in_output:
                delta, stop_str = "", None  # ended by EOS or a stop token id (the scheduler): no text for it
            else:
                delta, stop_str = detok.update(req.output_token_ids[-1], check_stop=check)
            req.pending_text += delta
            if stop_str is not None:
                if not req.is_finished:
                    req.stop_reason = stop_str
                    stopped.append(req)
                elif req.status == RequestStatus.FINISHED_LENGTH:
                    req.status = RequestStatus.FINISHED_STOPPED
                    req.stop_reason = stop_str
                # finished by EOS or a stop token on this very token: the token-level stop stays
            elif req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                req.pending_text += detok.flush(check_stop=check)
        return stopped

    @staticmethod
    def make_output(req: Request, seqs: list[Request]) -> RequestOutput:
        """The :class:`RequestOutput` of user request ``req`` whose sequences are ``seqs`` (``n`` of
        them for parallel sampling); moves each sequence's pending text into its delta."""
        completions = []
        for seq in seqs:
            delta, seq.pending_text = seq.pending_text, ""
            seq.output_text += delta
            tokens = list(seq.output_token_ids)
            logprobs = seq.output_logprobs[:len(tokens)] if seq.sampling_params.logprobs is not None else None
            completions.append(CompletionOutput(seq.index, seq.output_text, tokens, delta,
                                                seq.status.finish_reason, seq.stop_reason, logprobs))
        first = seqs[0]
        return RequestOutput(
            request_id=req.group_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=all(seq.is_finished for seq in seqs),
            error=next((seq.error for seq in seqs if seq.error), None),
            metrics={
                "arrival_time": first.arrival_time,
                "first_token_time": first.first_token_time,
                "finish_time": first.finish_time,
                "num_preemptions": first.num_preemptions,
                "ttft": first.ttft,
            },
        )
