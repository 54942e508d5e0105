"""Soak test on loopback: 200 streamed chat requests through the OpenAI API from a local asyncio
script, 32 at a time, about a third of the clients going away at random moments (before their first
token: while waiting for a slot or during a chunked prefill; or mid-answer). Afterwards no request is
left running or waiting, every KV block is free (or free and cached), and every request that was not
cut got exactly the greedy answer it gets when run alone. Tiny random model; bounded in time.
"""

from __future__ import annotations

import asyncio
import random
import time

import openai

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from server import ServerThread, create_api

MODEL = "tiny-soak"
NUM_REQUESTS = 200
CONCURRENCY = 32
CUT_FRACTION = 1 / 3
MAX_TOKENS = (8, 24)
TIME_LIMIT_S = 120.0
CUT_WITHIN_S = 1.5  # a timed cut comes within this many seconds of sending

_WORDS = ["engine", "block", "slot", "token", "cache", "prefix", "batch", "stream", "chunk", "prompt", "decode",
          "prefill", "queue", "scheduler", "kernel", "paged", "attention", "sampler", "detokenizer", "lighthouse",
          "river", "mountain"]


def _prompts() -> list[list[dict]]:
    """Eight chats of 38 to about 840 tokens (the long ones take several prefill chunks)."""
    rng = random.Random(7)
    out = []
    for i, words in enumerate((4, 12, 30, 60, 150, 300, 500, 700)):
        text = " ".join(rng.choice(_WORDS) for _ in range(words))
        out.append([{"role": "user", "content": f"Request {i}: {text}"}])
    return out


async def _soak(url: str, engine: AsyncEngine) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    prompts = _prompts()
    rng = random.Random(20261130)

    async def run(messages, max_tokens, salt, cut_after=None):
        """Stream one request; ``cut_after`` = close after that many content chunks. Returns
        (text, finish_reason, cut). Each request has its own cache salt, so every prompt is really
        prefilled (no prefix-cache hit from an earlier identical one) and the KV pool fills up."""
        text, reason, n = "", None, 0
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True, extra_body={"cache_salt": salt})
        async with stream:
            async for chunk in stream:
                if not chunk.choices:
                    continue
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
                if chunk.choices[0].delta.content:
                    n += 1
                    if cut_after is not None and n >= cut_after and reason is None:
                        return text, None, True  # leaving the context closes the connection
        return text, reason, False

    # references: each (prompt, max_tokens) alone, through the same server and engine
    ref = {}
    for p in range(len(prompts)):
        for m in MAX_TOKENS:
            text, reason, _ = await run(prompts[p], m, f"alone-{p}-{m}")
            ref[p, m] = (text, reason)

    sem = asyncio.Semaphore(CONCURRENCY)
    results = []

    holds = [0]  # prefill cuts holding the engine paused (they may overlap)

    def hold() -> None:
        holds[0] += 1
        engine.pause()

    def release() -> None:
        holds[0] -= 1
        if holds[0] == 0:
            engine.resume()

    async def settled() -> None:
        """Wait until the paused engine has finished the step it was running."""
        n = -1
        while n != engine.step_count:
            n = engine.step_count
            await asyncio.sleep(0.02)

    async def prefilling(marker: str) -> str:
        """Return, with the engine held paused (:func:`release` lets it go), once the request whose prompt
        starts with ``marker`` is part way through its prefill (a test-side oracle: the client itself
        cannot see that). Pausing makes the cut land inside the prefill however fast the steps run."""
        while True:
            snap = engine.telemetry.latest()
            for s in snap.batch_slots if snap else ():
                if s.phase != "prefill" or s.request_id is None:
                    continue
                req = engine.core.scheduler.requests.get(s.request_id)
                messages = getattr(req.prompt, "messages", None) if req is not None else None
                if not messages or not messages[0]["content"].startswith(marker):
                    continue
                hold()
                try:
                    await settled()
                except asyncio.CancelledError:  # the stream ended first: the cut is called off
                    release()
                    raise
                if not req.is_finished and 0 < req.num_computed_tokens < req.num_prompt_tokens:
                    return req.request_id
                release()  # the step in flight finished its prefill: look again
            await asyncio.sleep(0.002)

    async def aborted(request_id: str) -> None:
        """Wait (up to 10 s) until the engine has dropped ``request_id``, then release the engine."""
        try:
            end = time.monotonic() + 10
            while time.monotonic() < end:
                req = engine.core.scheduler.requests.get(request_id)
                if req is None or req.is_finished:
                    return
                await asyncio.sleep(0.005)
        finally:
            release()

    async def one(i: int):
        p, m = rng.randrange(len(prompts)), rng.choice(MAX_TOKENS)
        kind = None
        if rng.random() < CUT_FRACTION:  # cut at a random time (waiting, prefilling or decoding),
            kind = rng.choice(("timed", "mid", "prefill"))  # after some chunks, or inside a prefill
        messages = prompts[p]
        if kind == "prefill":  # a long prompt, marked so the oracle can find it; never compared
            p = rng.randrange(len(prompts) - 3, len(prompts))
            messages = [{"role": "user", "content": f"[{i}] " + prompts[p][0]["content"]}]
        delay = rng.uniform(0.0, CUT_WITHIN_S)
        cut_after = rng.randint(1, m - 1) if kind == "mid" else None
        async with sem:
            task = asyncio.create_task(run(messages, m, f"soak-{i}", cut_after))
            if kind in ("timed", "prefill"):
                trigger = asyncio.create_task(asyncio.sleep(delay) if kind == "timed" else prefilling(f"[{i}] "))
                await asyncio.wait({task, trigger}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
                trigger.cancel()
                if not task.done():
                    task.cancel()
            try:
                text, reason, was_cut = await task
            except asyncio.CancelledError:
                text, reason, was_cut = "", None, True
            if kind == "prefill" and trigger.done() and not trigger.cancelled():
                await aborted(trigger.result())
            results.append(dict(i=i, prompt=p, max_tokens=m, text=text, reason=reason, cut=was_cut, kind=kind))

    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))), TIME_LIMIT_S)
    elapsed = time.monotonic() - t0
    await client.close()
    return dict(ref=ref, results=results, elapsed=elapsed)


def test_soak_disconnects_leak_nothing_and_survivors_match_alone(tiny_model, tokenizer):
    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=160, block_size=16, max_num_seqs=16,
                                                 max_num_batched_tokens=128, prefill_chunk_tokens=16,
                                                 telemetry_capacity=100_000),
                                    model=tiny_model, tokenizer=tokenizer))
    server = ServerThread(create_api(engine, MODEL)).start()
    try:
        out = asyncio.run(_soak(server.url, engine))
        end = time.monotonic() + 10
        sched, pool = engine.core.scheduler, engine.core.kv.pool
        while time.monotonic() < end and (engine.num_pending or sched.running or sched.waiting or pool.num_used_blocks):
            time.sleep(0.01)
        left_running, left_waiting = len(sched.running), len(sched.waiting)
        pending, leaked = engine.num_pending, pool.num_used_blocks
        cached_free = len(pool.cached_free_blocks())
        snaps = engine.telemetry.snapshots()
        records = engine.telemetry.finished_requests()
    finally:
        server.stop()
        engine.shutdown()

    results, ref = out["results"], out["ref"]
    cut = [r for r in results if r["cut"]]
    whole = [r for r in results if not r["cut"] and r["kind"] != "prefill"]
    aborted = [r for r in records if r.finish_reason == "abort"]
    prefilling = {s.request_id for snap in snaps for s in snap.batch_slots if s.phase == "prefill"}
    cut_before_token = [r for r in aborted if r.num_output_tokens == 0]
    cut_in_prefill = [r for r in cut_before_token if r.request_id in prefilling]
    mismatches = [r for r in whole if (r["text"], r["reason"]) != ref[r["prompt"], r["max_tokens"]]]
    kinds = {k: sum(r["kind"] == k for r in cut) for k in ("timed", "mid", "prefill")}
    print(f"\nsoak: {len(results)} streamed requests in {out['elapsed']:.1f} s, {CONCURRENCY} at a time; "
          f"{len(cut)} client disconnects ({kinds['timed']} at a random time, {kinds['mid']} mid-answer, "
          f"{kinds['prefill']} inside a prefill); "
          f"{len(aborted)} aborted in the engine ({len(cut_before_token)} before their first token, "
          f"{len(cut_in_prefill)} of them during a chunked prefill); {len(whole)} completed, "
          f"{len(mismatches)} differing from their run alone; {engine.core.scheduler.num_preemptions} preemptions; "
          f"left running {left_running}, waiting {left_waiting}, pending {pending}; leaked blocks {leaked} "
          f"(of {pool.num_blocks}; {cached_free} free and cached)")

    assert len(results) == NUM_REQUESTS
    assert NUM_REQUESTS * 0.2 < len(cut) < NUM_REQUESTS * 0.5
    assert left_running == left_waiting == pending == 0
    assert leaked == 0 and pool.num_free_blocks == pool.num_blocks
    # a cut can land after the engine sent its last token (the client reads behind): nothing to abort then
    assert len(cut) * 0.5 <= len(aborted) <= len(cut)
    # each prefill cut holds the engine paused mid-prefill until its abort, so all of them land there
    assert kinds["prefill"] > 0 and len(cut_in_prefill) >= kinds["prefill"], (len(cut_in_prefill), kinds)
    assert not mismatches, mismatches[:3]
    assert out["elapsed"] < 60
