"""``AsyncEngine.reconfigure``: the talk preset from the page restarts the engine with new settings on the same
loaded model; requests in flight end with a clear error and the engine serves new ones at once."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.options import TALK_PRESET
from engine.request import SamplingParams
from ui import talk


def test_reconfigure_ends_requests_in_flight_and_serves_new_ones(tiny_model, tokenizer):
    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8), model=tiny_model,
                                 tokenizer=tokenizer))
    try:
        assert not talk.is_talk_config(eng.config)
        old_core = eng.core

        async def run():
            eng.pause()  # one request waits in the old core when it is replaced
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            waiting = asyncio.create_task(eng.generate_text("Hello", params))
            while not old_core.has_unfinished_requests():
                await asyncio.sleep(0.01)
            cfg = await asyncio.to_thread(eng.reconfigure, **TALK_PRESET)
            ended = await asyncio.wait_for(waiting, 10)
            fresh = await asyncio.wait_for(eng.generate_text("Hi again", params), 30)
            return cfg, ended, fresh

        cfg, ended, fresh = asyncio.run(run())
        assert ended.finished and ended.outputs[0].finish_reason == "error"
        assert "restarted with new settings" in (ended.error or "")
        assert (cfg.max_num_seqs, cfg.num_blocks, cfg.free_block_order) == (4, 96, "mru") and eng.config is cfg
        assert eng.core is not old_core and eng.core.model is tiny_model and eng.telemetry is eng.core.telemetry
        assert not eng.paused and len(fresh.outputs[0].token_ids) == 8
        assert talk.is_talk_config(eng.config) and talk.apply_preset(eng) is False  # already the preset
        with pytest.raises(TypeError):
            eng.reconfigure(no_such_setting=1)
        with pytest.raises(ValueError):
            eng.reconfigure(free_block_order="fifo")
        assert eng.config is cfg  # a refused change leaves the engine as it was
    finally:
        eng.shutdown()
