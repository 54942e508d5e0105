"""The one stop rule (engine/stopping.py): EOS or a stop token id first, then a stop string (which wins over
max_tokens on the same token), then the length; the scheduler applies it once."""

from __future__ import annotations

from engine.request import Request, RequestStatus, SamplingParams
from engine.stopping import Stop, check_token, resolve

EOS = 2


def _req(tokens, **kw) -> Request:
    r = Request("r", [5, 6, 7], SamplingParams(**kw), frozenset({EOS}), max_model_len=64)
    r.output_token_ids = list(tokens)
    return r


def test_token_level_stops():
    assert check_token(_req([9, EOS], max_tokens=8), 64) == Stop(RequestStatus.FINISHED_STOPPED)
    assert check_token(_req([9, 11], max_tokens=8, stop_token_ids=[11]), 64) == Stop(RequestStatus.FINISHED_STOPPED, 11)
    assert check_token(_req([9, 10], max_tokens=2), 64) == Stop(RequestStatus.FINISHED_LENGTH)
    assert check_token(_req([9, 10], max_tokens=8), 5) == Stop(RequestStatus.FINISHED_LENGTH)  # context length
    assert check_token(_req([9, 10], max_tokens=8), 64) is None
    assert check_token(_req([EOS], max_tokens=8, min_tokens=2), 64) is None  # before min_tokens: EOS goes on
    assert check_token(_req([9, EOS], max_tokens=8, ignore_eos=True), 64) is None


def test_precedence_token_then_stop_string_then_length():
    eos, length = Stop(RequestStatus.FINISHED_STOPPED), Stop(RequestStatus.FINISHED_LENGTH)
    assert resolve(eos, "END") is eos and eos.by_token
    assert resolve(length, "END") == Stop(RequestStatus.FINISHED_STOPPED, "END")
    assert not resolve(None, "END").by_token
    assert resolve(length, None) is length and resolve(None, None) is None


def test_the_scheduler_finishes_once_what_the_hook_decides(tiny_model, tokenizer):
    """A stop string on the token that also reaches max_tokens: finished once, as stopped by the string."""
    from engine.core import EngineCore

    core = EngineCore(model=tiny_model, tokenizer=tokenizer, max_num_seqs=2, num_blocks=32)
    calls = []
    real = core.scheduler.finish
    core.scheduler.finish = lambda req, status, error=None: calls.append((req.request_id, status)) or real(req, status, error)
    probe = core.add_request("probe", "hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    text = probe.output_text
    assert calls == [("probe", RequestStatus.FINISHED_LENGTH)]
    assert text.strip(), "the greedy probe must produce visible text"
    stop = text.rstrip()[-1]  # a character of the last tokens: completes no later than the 3rd token
    calls.clear()
    req = core.add_request("again", "hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, stop=[stop]))
    while core.has_unfinished_requests():
        core.step()
    assert calls == [("again", RequestStatus.FINISHED_STOPPED)]
    assert req.stop_reason == stop and req.status == RequestStatus.FINISHED_STOPPED
