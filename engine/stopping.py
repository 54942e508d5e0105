"""When a request stops: the one rule for every generated token.

After a token is appended, :func:`check_token` gives the token-level stop (an end-of-sequence token, a
stop token id, ``max_tokens`` or the context length); the output processor detokenizes the token and may
find a stop *string*; :func:`resolve` combines the two with vLLM's precedence: an EOS or stop token id
ends the request (its text left out unless ``include_stop_str_in_output``), else a stop string (it
wins over ``max_tokens`` reached on the same token), else the length. Each stage returns its stops as
data (:meth:`engine.scheduler.Scheduler.update_from_output`, then
:meth:`engine.output_processor.OutputProcessor.process_tokens`); the engine core applies the result once
(:meth:`engine.scheduler.Scheduler.apply_stops` finishes the request and frees its blocks). Aborts and
per-request faults end requests through the same ``Scheduler.finish``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class Stop:
    """Why a request ends after its newest token.

    Attributes:
        status: ``FINISHED_STOPPED``, ``FINISHED_LENGTH`` or ``FINISHED_ERROR``.
        reason: the stop token id or stop string that ended it (None: EOS, the length, an error).
        error: the message of a ``FINISHED_ERROR`` (a fault while handling this request's token).
    """

    status: RequestStatus
    reason: str | int | None = None
    error: str | None = None

    @property
    def by_token(self) -> bool:
        """Ended by an EOS token or a stop token id (the token's text is left out of the output)."""
        return self.status == RequestStatus.FINISHED_STOPPED and not isinstance(self.reason, str)


def check_token(req: Request, max_model_len: int) -> Stop | None:
    """The token-level stop after ``req``'s newest token was appended (None: it goes on).

    Before ``min_tokens`` tokens exist, EOS and stop token ids do not stop (the sampler masks them too).
    ``max_model_len``: the engine's context length (tokens)."""
    sp = req.sampling_params
    tok = req.output_token_ids[-1]
    if len(req.output_token_ids) >= sp.min_tokens:
        if not sp.ignore_eos and tok in req.eos_token_ids:
            return Stop(RequestStatus.FINISHED_STOPPED)
        stop_token_ids = sp.stop_token_ids
        assert stop_token_ids is not None  # a list since SamplingParams.__post_init__
        if tok in stop_token_ids:
            return Stop(RequestStatus.FINISHED_STOPPED, tok)
    if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= max_model_len:
        return Stop(RequestStatus.FINISHED_LENGTH)
    return None


def resolve(token_stop: Stop | None, stop_string: str | None) -> Stop | None:
    """The request's stop, from :func:`check_token`'s result and the stop string the newest token
    completed (None when none did): an EOS or stop token id first, then the stop string, then the length."""
    if token_stop is not None and token_stop.by_token:
        return token_stop
    if stop_string is not None:
        return Stop(RequestStatus.FINISHED_STOPPED, stop_string)
    return token_stop
