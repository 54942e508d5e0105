"""Command-line options are declared once (``engine.options``, ``server.options``, the page's in
``app.py``): ``app.py``'s parser and ``python -m engine``'s have the same engine flags with the same
defaults (the app's differ only by ``PLAYGROUND_DEFAULTS``), every option reads its ``CBP_*`` variable
in the app, and the command line wins over the variable."""

from __future__ import annotations

import argparse

import pytest

import app
from engine.__main__ import build_parser as engine_parser
from engine.options import ENGINE_OPTIONS, PLAYGROUND_DEFAULTS, Option
from server.http_edge import HTTPLimits
from server.options import SERVER_OPTIONS, CORSSettings, server_kwargs

_SAMPLE = {int: "3", float: "0.25", str: "x"}


def _given(opt: Option) -> tuple[list[str], object]:
    """A command line setting ``opt`` and the value it must parse to."""
    if opt.type is bool:
        return [opt.flag] if not opt.default else ["--no-" + opt.flag[2:]], not opt.default
    raw = opt.choices[-1] if opt.choices else _SAMPLE[opt.type]
    if opt.type is float and opt.low is not None and float(raw) <= opt.low:  # a value inside the bounds
        raw = str(opt.low + 1.5)
    return [opt.flag, str(raw)], opt.type(raw)


def _check_declared(parser: argparse.ArgumentParser, opt: Option, default: object) -> None:
    """``parser`` has ``opt``'s flag (same name, type, switch form) with ``default``."""
    assert parser.get_default(opt.name) == default, opt.name
    argv, value = _given(opt)
    parsed, _rest = parser.parse_known_args(argv)
    assert getattr(parsed, opt.name) == value and type(getattr(parsed, opt.name)) is opt.type, opt.name


def test_option_names_are_unique():
    names = [o.name for o in (*ENGINE_OPTIONS, *SERVER_OPTIONS, *app.UI_OPTIONS)]
    assert len(names) == len(set(names))
    assert set(PLAYGROUND_DEFAULTS) <= {o.name for o in ENGINE_OPTIONS}


def test_app_and_engine_parsers_share_the_engine_declarations():
    app_parser, cli_parser = app.build_parser(env={}), engine_parser()
    for opt in ENGINE_OPTIONS:
        _check_declared(cli_parser, opt, opt.default)
        expected = PLAYGROUND_DEFAULTS.get(opt.name, opt.default)
        if opt.name == "num_blocks":  # the playground's 384 is applied after parsing (see below)
            expected = None
        _check_declared(app_parser, opt, expected)
    for opt in (*SERVER_OPTIONS, *app.UI_OPTIONS):
        _check_declared(app_parser, opt, opt.default)
    defaults = app.parse_args([], env={})
    for name, value in PLAYGROUND_DEFAULTS.items():
        assert getattr(defaults, name) == value, name


def test_kv_size_options_are_exclusive_and_384_blocks_only_without_either():
    assert app.parse_args([], env={}).num_blocks == PLAYGROUND_DEFAULTS["num_blocks"]
    by_memory = app.parse_args(["--kv-cache-memory", "1GiB"], env={})
    assert by_memory.num_blocks is None and by_memory.kv_cache_memory == "1GiB"
    assert "num_blocks" not in app.engine_kwargs(by_memory)
    from_env = app.parse_args([], env={"CBP_KV_CACHE_MEMORY": "0.5"})
    assert from_env.num_blocks is None and from_env.kv_cache_memory == "0.5"
    assert app.parse_args(["--num-blocks", "64"], env={}).num_blocks == 64
    for argv, env in ((["--num-blocks", "64", "--kv-cache-memory", "1GiB"], {}),
                      ([], {"CBP_NUM_BLOCKS": "64", "CBP_KV_CACHE_MEMORY": "1GiB"}),
                      (["--num-blocks", "64"], {"CBP_KV_CACHE_MEMORY": "1GiB"})):
        with pytest.raises(SystemExit):
            app.parse_args(argv, env=env)


def test_environment_variables_and_command_line_precedence():
    env = {"CBP_MAX_NUM_SEQS": "32", "CBP_ENABLE_PREFIX_CACHING": "false", "CBP_SHARE": "1",
           "CBP_RATE_LIMIT": "5", "CBP_RATE_PERIOD": "10", "CBP_REFRESH": "2", "CBP_POLICY": "static",
           "CBP_SERVED_MODEL_NAME": "m", "CBP_DTYPE": " "}
    a = app.parse_args([], env=env)
    assert (a.max_num_seqs, a.enable_prefix_caching, a.share, a.rate_limit, a.rate_period, a.refresh, a.policy) == (
        32, False, True, 5, 10.0, 2.0, "static")
    assert a.dtype is None  # an empty variable is unset
    assert app.engine_kwargs(a)["max_num_seqs"] == 32 and app.engine_kwargs(a)["enable_prefix_caching"] is False
    assert server_kwargs(a) == {"model_name": "m", "max_pending": 256, "rate_limit": 5, "rate_period": 10.0,
                                "queue_size": 256, "max_request_body_bytes": 4 * 1024 * 1024,
                                "kv_events_config": None, "http_limits": HTTPLimits(), "cors": CORSSettings(),
                                "special_tokens_in_messages": False}
    b = app.parse_args(["--max-num-seqs", "8", "--enable-prefix-caching", "--no-share", "--policy", "continuous"],
                       env=env)
    assert (b.max_num_seqs, b.enable_prefix_caching, b.share, b.policy) == (8, True, False, "continuous")
    assert server_kwargs(app.parse_args([], env={}))["rate_limit"] is None  # 0 = no limit
    for bad in ({"CBP_MAX_NUM_SEQS": "many"}, {"CBP_POLICY": "bogus"}, {"CBP_PORT": "80.5"}):
        with pytest.raises(SystemExit):
            app.parse_args([], env=bad)


def test_engine_command_line_reads_cbp_variables(monkeypatch):
    from engine.__main__ import build_parser

    monkeypatch.setenv("CBP_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("CBP_ENABLE_PREFIX_CACHING", "off")
    args = build_parser().parse_args([])
    assert args.max_num_seqs == 3 and args.enable_prefix_caching is False
    assert build_parser().parse_args(["--max-num-seqs", "5"]).max_num_seqs == 5  # the command line wins
    monkeypatch.setenv("CBP_PREFILL_CHUNK_TOKENS", "0")
    with pytest.raises(ValueError, match="CBP_PREFILL_CHUNK_TOKENS"):
        build_parser()


def test_http_limits_cors_and_special_tokens_options():
    """The edge's limits, vLLM's CORS flags (a JSON list or commas) and the role-forgery switch reach
    ``build_server``; credentials with origin '*' and a malformed list stop the app with a usage error."""
    a = app.parse_args(["--max-header-bytes", "1000", "--max-header-fields", "10", "--max-url-bytes", "500",
                        "--timeout-request-head", "2.5", "--timeout-request-body", "4", "--timeout-keep-alive", "3",
                        "--allowed-origins", '["http://a.example", "http://b.example"]', "--allowed-methods", "GET,POST",
                        "--special-tokens-in-messages"], env={"CBP_ALLOWED_HEADERS": "content-type"})
    kw = server_kwargs(a)
    assert kw["http_limits"] == HTTPLimits(max_header_bytes=1000, max_header_fields=10, max_url_bytes=500,
                                           timeout_request_head=2.5, timeout_request_body=4.0, timeout_keep_alive=3)
    assert kw["cors"] == CORSSettings(("http://a.example", "http://b.example"), ("GET", "POST"), ("content-type",))
    assert kw["special_tokens_in_messages"] is True
    for argv in (["--allowed-origins", "*", "--allow-credentials"], ["--allowed-origins", '["a", 3]'],
                 ["--timeout-request-head", "0"]):
        with pytest.raises(SystemExit):
            app.parse_args(argv, env={})


def test_talk_preset_sets_a_configuration_a_room_can_read_and_explicit_options_win():
    from engine.options import TALK_PRESET

    talk = app.parse_args(["--talk"], env={})
    assert talk.talk and (talk.max_num_seqs, talk.num_blocks, talk.free_block_order) == (4, 96, "mru")
    assert {k: getattr(talk, k) for k in TALK_PRESET} == TALK_PRESET
    assert app.parse_args([], env={"CBP_TALK": "1"}).num_blocks == 96  # the variable asks for it too
    mine = app.parse_args(["--talk", "--max-num-seqs", "6", "--num-blocks", "128"], env={"CBP_FREE_BLOCK_ORDER": "lru"})
    assert (mine.max_num_seqs, mine.num_blocks, mine.free_block_order) == (6, 128, "lru")
    by_memory = app.parse_args(["--talk", "--kv-cache-memory", "64MiB"], env={})
    assert by_memory.num_blocks is None and by_memory.max_num_seqs == 4
    plain = app.parse_args([], env={})
    assert not plain.talk and plain.max_num_seqs == PLAYGROUND_DEFAULTS["max_num_seqs"]
    assert app.talk_line(plain).startswith("talk     for a room, start with --talk (4 slots, 96 KV blocks")
    assert app.talk_line(talk).startswith("talk     preset on (4 slots, 96 KV blocks, mru free-block order, a 32")


def test_help_groups_the_options_and_shows_the_defaults_the_app_applies(monkeypatch):
    """``app.py --help``: one group each for the engine, the server, the page and remote mode, every declared
    option in its group; no empty "(default: )"; the KV size as the app applies it (384 blocks unless
    --kv-cache-memory), while ``python -m engine`` shows the engine's own (512MiB)."""
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help at hyphens: one line per option here
    parser = app.build_parser(env={})
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    titles = list(groups)
    engine_t, server_t, page_t, remote_t = (next(t for t in titles if t.startswith(w))
                                           for w in ("engine", "server", "page", "remote"))
    assert {o.name for o in ENGINE_OPTIONS} == groups[engine_t]
    assert {o.name for o in SERVER_OPTIONS} == groups[server_t]
    assert {o.name for o in app.UI_OPTIONS} == groups[page_t]
    assert {o.name for o in app.REMOTE_OPTIONS} == groups[remote_t]
    text = " ".join(parser.format_help().split())
    assert "(default: )" not in text and "--help-switches" in text
    assert "physical KV blocks (default: 384 when --kv-cache-memory is not given)" in text
    assert "(default: unset: the pool is --num-blocks 384)" in text and "512MiB" not in text
    engine_text = " ".join(engine_parser().format_help().split())
    assert "(default: 512MiB when --num-blocks is not given)" in engine_text
    assert "(default: sized from --kv-cache-memory)" in engine_text
    assert "(default: 64)" in " ".join(app.build_parser(env={"CBP_NUM_BLOCKS": "64"}).format_help().split())
