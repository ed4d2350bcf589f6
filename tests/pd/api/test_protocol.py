"""The server's pure parts, no engine: request checks, wire messages, routing, SSE, metrics."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass

import msgpack
import pytest
import torch

from engine.codec import WireError, to_wire
from engine.config import ForwardConfig
from engine.errors import InvalidRequestError
from engine.request import RequestOutput, SamplingParams, TokenLogprob
from pd.api.protocol import UNSUPPORTED_VLLM_FIELDS, parse_chat_request, parse_completion_request
from pd.api.sse import DONE, sse_event
from pd.config import ServerConfig
from pd.errors import ApiError
from pd.flags import parser_for
from pd.frontend.metrics import RankSnapshot, ServerMetrics
from pd.frontend.router import AffinityRouter, LeastLoadedRouter, make_router
from pd.http.io import parse_json
from pd.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    MessageError,
    RankFatal,
    RankReady,
    RankStats,
    RequestRejected,
    Shutdown,
    StepOutputs,
    decode,
    encode,
)
from pd.rank.restart_policy import RestartPolicy
from pd.rank.worker import engine_config as rank_engine_config
from pd.rank.worker import read_configs
from transfer.config import TransferConfig

USER = [{"role": "user", "content": "hi"}]
ASSISTANT_LAST = [*USER, {"role": "assistant", "content": "The answer is"}]
CRITIC = [{"role": "critic", "content": "x"}]


def _bad(fn, body, param):
    with pytest.raises(ApiError) as e:
        fn(body)
    assert e.value.status == 400, e.value.message
    assert e.value.param == param, (e.value.param, e.value.message)
    err = e.value.to_dict()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


# ---- chat request checks ------------------------------------------------------------------------------


def test_chat_defaults_and_fields():
    r = parse_chat_request({"model": "m", "messages": USER})
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.n, s.stream, s.use_prefix_cache) == (
        None,
        1.0,
        1.0,
        0,
        1,
        False,
        True,
    )
    r = parse_chat_request(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                *USER,
            ],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 3,
            "stop": "x",
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "prefix_cache": False,
            "presence_penalty": 0,
            "unknown_field": {"ignored": True},
        }
    )
    s = r.sampling
    assert r.messages[0] == {"role": "system", "content": "a\nb"}
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.n) == (
        7,
        0.0,
        0.5,
        0,
        3,
        ("x",),
        2,
    )
    assert (s.stream, s.include_usage, s.use_prefix_cache, r.logprobs) == (True, True, False, 2)
    p1 = s.params(10, r.logprobs, 1)
    assert isinstance(p1, SamplingParams) and (p1.seed, p1.max_tokens, p1.logprobs, p1.stop) == (
        4,
        10,
        2,
        ("x",),
    )



def test_penalties_logit_bias_min_p_and_min_tokens_reach_the_engine():
    for parse, body in (
        (parse_chat_request, {"messages": USER}),
        (parse_completion_request, {"prompt": "hi"}),
    ):
        r = parse(
            {
                **body,
                "presence_penalty": -0.5,
                "frequency_penalty": 1.5,
                "repetition_penalty": 1.1,
                "logit_bias": {"42": -100, "7": 2.5},
                "min_p": 0.05,
                "min_tokens": 3,
            }
        )
        p = r.sampling.params(8, None, 0)
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (
            -0.5,
            1.5,
            1.1,
            0.05,
            3,
        )
        assert p.logit_bias == ((7, 2.5), (42, -100.0)) and p.has_penalties
        with pytest.raises(InvalidRequestError, match="min_tokens"):  # more than max_tokens: a 400
            r.sampling.params(2, None, 0)


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "user", "content": "x", "reasoning": "y"}]}, "messages[0].reasoning"),
        ({"messages": [{"role": "assistant", "reasoning_content": 5}]}, "messages[0].reasoning_content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"messages": USER, "model": 3}, "model"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": "5"}, "max_tokens"),
        ({"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": USER, "max_tokens": 2.5}, "max_tokens"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "n": True}, "n"),
        ({"messages": USER, "temperature": -1}, "temperature"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "top_p": 1.5}, "top_p"),
        ({"messages": USER, "top_k": -2}, "top_k"),
        ({"messages": USER, "seed": 2**63}, "seed"),
        ({"messages": USER, "seed": -(2**63) - 1}, "seed"),
        ({"messages": USER, "seed": 1.5}, "seed"),
        ({"messages": USER, "seed": "1"}, "seed"),
        ({"messages": USER, "stop": 3}, "stop"),
        ({"messages": USER, "stop": ["a", 3]}, "stop"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": USER, "stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
        (
            {"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
        (
            {"messages": ASSISTANT_LAST, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        ({"messages": USER, "add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"messages": USER, "add_special_tokens": 1}, "add_special_tokens"),
        ({"messages": USER, "use_beam_search": True}, "use_beam_search"),
        ({"messages": USER, "skip_special_tokens": False}, "skip_special_tokens"),
        ({"messages": USER, "length_penalty": True}, "length_penalty"),
        ({"messages": USER, "echo": True}, "echo"),
        ({"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": USER, "logprobs": 1}, "logprobs"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "tools": {}}, "tools"),
        (
            {"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]},
            "tools[0].function.name",
        ),
        ({"messages": USER, "tools": [{"type": "code"}]}, "tools[0]"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"messages": USER, "prefix_cache": "no"}, "prefix_cache"),
        ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": USER, "frequency_penalty": "1"}, "frequency_penalty"),
        ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": USER, "repetition_penalty": 1e-50}, "repetition_penalty"),
        ({"messages": USER, "min_p": 1.5}, "min_p"),
        ({"messages": USER, "min_tokens": -1}, "min_tokens"),
        ({"messages": USER, "logit_bias": [1, 5]}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"a": 5}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"1": 101}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"1": 1, "01": 2}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"messages": USER, "response_format": {"type": "grammar"}}, "response_format.type"),
        ({"messages": USER, "structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"messages": USER, "structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
        ({"messages": USER, "guided_json": "{not json"}, "guided_json"),
    ],
)
def test_chat_bad_input(body, param):
    _bad(parse_chat_request, body, param)


def test_body_must_be_an_object():
    _bad(parse_chat_request, [1, 2], None)
    _bad(parse_completion_request, "prompt", None)


def test_assistant_tool_calls_and_tool_messages():
    r = parse_chat_request(
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    assert r.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert r.messages[2] == {"role": "tool", "content": "ok", "tool_call_id": "c"}
    assert r.uses_tools and r.tool_choice == {"type": "function", "function": {"name": "f"}}


def test_generation_prompt_custom_roles_and_seed_range():
    r = parse_chat_request({"messages": USER})
    assert (r.add_generation_prompt, r.continue_final_message, r.add_special_tokens) == (True, False, False)
    r = parse_chat_request({"messages": ASSISTANT_LAST, "continue_final_message": True})
    assert (r.add_generation_prompt, r.continue_final_message) == (False, True)  # no generation prompt
    r = parse_chat_request({"messages": USER, "add_generation_prompt": False, "add_special_tokens": True})
    assert (r.add_generation_prompt, r.continue_final_message, r.add_special_tokens) == (False, False, True)
    r = parse_chat_request({"messages": [*CRITIC, {"role": "developer", "content": ""}]})
    assert [m["role"] for m in r.messages] == ["critic", "system"]  # any role reaches the template
    for seed, engine_seed in ((-1, 2**63 - 1), (-(2**63), 0), (2**63 - 1, 2**63 - 1)):  # vLLM's int64 range
        r = parse_chat_request({"messages": USER, "seed": seed})
        assert r.sampling.params(1, None, 0).seed == engine_seed
    for raw in (b"18446744073709551616", b"-9223372036854775809"):  # past 64 bits: the JSON parser's float
        body = parse_json(b'{"messages": [{"role": "user", "content": ""}], "seed": %s}' % raw)
        with pytest.raises(ApiError, match="'seed' must be an integer between") as e:
            parse_chat_request(body)
        assert e.value.param == "seed" and "float" not in str(e.value)
    with pytest.raises(ApiError, match="'seed' must be an integer, got float"):
        parse_chat_request({"messages": USER, "seed": 1.5})
    assert parse_chat_request({"messages": USER, "top_logprobs": 0}).logprobs is None  # asks for nothing


def test_vllm_fields_that_ask_for_nothing_pass():
    """UNSUPPORTED_VLLM_FIELDS at vLLM's defaults (or null), as clients written for vLLM send them."""
    defaults = {key: neutral[0] if neutral else None for key, neutral in UNSUPPORTED_VLLM_FIELDS.items()}
    parse_chat_request({"messages": USER, **defaults, "length_penalty": 1})
    parse_completion_request({"prompt": "a", **defaults, "echo": True})


# ---- completion request checks ------------------------------------------------------------------------


def test_completion_prompts():
    assert parse_completion_request({"prompt": "a"}).prompts == ("a",)
    assert parse_completion_request({"prompt": [1, 2]}).prompts == ((1, 2),)
    assert parse_completion_request({"prompt": ["a", "b"], "n": 2}).prompts == ("a", "b")
    assert parse_completion_request({"prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))
    r = parse_completion_request({"prompt": "a", "logprobs": 3, "echo": True, "max_tokens": 4})
    assert (r.logprobs, r.echo, r.sampling.max_tokens, r.add_special_tokens) == (3, True, 4, True)
    assert not parse_completion_request({"prompt": "a", "add_special_tokens": False}).add_special_tokens


def test_echo_with_logprobs_asks_for_the_prompts_logprobs():
    """vLLM's: echo with logprobs N computes prompt logprobs N (unless prompt_logprobs says otherwise);
    max_tokens 0 is taken with echo alone."""
    parse = lambda **kw: parse_completion_request({"prompt": "a", **kw}).sampling  # noqa: E731
    assert parse(echo=True, logprobs=2).prompt_logprobs == 2
    assert parse(echo=True, logprobs=2, prompt_logprobs=5).prompt_logprobs == 5
    assert parse(logprobs=2).prompt_logprobs is None and parse(echo=True).prompt_logprobs is None
    assert parse(echo=True, logprobs=1, stream=True).prompt_logprobs == 1  # streamed in the echo
    assert parse(echo=True, max_tokens=0).max_tokens == 0
    chat = parse_chat_request({"messages": USER, "prompt_logprobs": 3})
    assert chat.sampling.params(4, None, 0).prompt_logprobs == 3


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "logprobs": 30}, "logprobs"),
        ({"prompt": "a", "echo": "yes"}, "echo"),
        ({"prompt": "a", "suffix": "b"}, "suffix"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
        ({"prompt": "a", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"prompt": "a", "bad_words": ["b"]}, "bad_words"),
        ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ({"prompt": "a", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ],
)
def test_completion_bad_input(body, param):
    _bad(parse_completion_request, body, param)


# ---- messages ----------------------------------------------------------------------------------------


def test_messages_round_trip():
    msgs = [
        AddRequest(
            "r1",
            (1, 2, 3),
            SamplingParams(max_tokens=5, temperature=0.0, stop=("a", "b"), seed=7, logprobs=2),
            False,
        ),
        AbortRequests(("r1", "r2")),
        Shutdown(),
        RankReady(0, 123, "m", 2048, (2, 3), "cpu", {"kv_usage": 0.0}),
        RequestRejected("r1", "too long", "max_tokens"),
        RankStats({"num_running": 1}),
        RankFatal("boom"),
    ]
    for m in msgs:
        assert decode(encode(m)) == m
    out = RequestOutput(
        "r1", [5], "hi", [TokenLogprob(5, -0.1, ((5, -0.1), (6, -2.0)))], True, "stop", 3, 1, 1
    )
    got = decode(encode(StepOutputs((out,), {"kv_usage": 0.5}, {"r1": 0.01})))
    assert isinstance(got, StepOutputs) and got.outputs == (out,) and got.stats == {"kv_usage": 0.5}
    assert got.queue_times_s == {"r1": 0.01}


def test_messages_refuse_other_versions_and_garbage():
    data = msgpack.unpackb(encode(Shutdown()))
    assert data == {"v": PROTOCOL_VERSION, "type": "shutdown"}
    with pytest.raises(MessageError):
        decode(msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "shutdown"}))
    with pytest.raises(MessageError):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "nope"}))
    with pytest.raises(MessageError):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "add"}))
    with pytest.raises(MessageError) as e:
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "shutdown", "now": True}))
    assert e.value.field == "now"  # an unknown field is refused, not dropped
    with pytest.raises(MessageError):
        decode(b"\xc1")


# ---- routing -----------------------------------------------------------------------------------------


@dataclass
class _Rank:
    index: int
    is_up: bool = True
    num_inflight: int = 0


def test_affinity_is_sticky_and_spreads():
    ranks = [_Rank(i) for i in range(4)]
    r = AffinityRouter()
    picks = {k: r.pick(f"conversation {k}", ranks).index for k in range(200)}
    assert all(r.pick(f"conversation {k}", ranks).index == v for k, v in picks.items())
    assert len(set(picks.values())) == 4
    ranks[1].is_up = False  # only rank 1's conversations move
    for k, v in picks.items():
        now = r.pick(f"conversation {k}", ranks).index
        assert now != 1 and (now == v or v == 1)
    assert r.pick(None, ranks).index == 0


def test_least_loaded_and_all_down():
    ranks = [_Rank(0, num_inflight=3), _Rank(1, num_inflight=1), _Rank(2, is_up=False)]
    assert LeastLoadedRouter().pick("x", ranks).index == 1
    for name in ("affinity", "least-loaded"):
        assert make_router(name).pick("x", [_Rank(0, is_up=False)]) is None
    with pytest.raises(ValueError):
        make_router("random")


# ---- SSE, metrics, config ----------------------------------------------------------------------------


def test_sse_format():
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_metrics_render_per_rank():
    snap = [
        RankSnapshot(
            0,
            True,
            2,
            {
                "num_running": 1,
                "num_waiting": 0,
                "kv_usage": 0.25,
                "num_free_blocks": 3,
                "num_total_blocks": 4,
                "x_new": 7,
            },
        ),
        RankSnapshot(1, False, 0, {}, num_restarts=2),
    ]
    m = ServerMetrics(lambda: snap, "served-name")
    m.ttft_s.labels("served-name", "0").observe(0.1)
    m.prompt_tokens.labels("served-name", "0").inc(5)
    text = m.render().decode()
    for line in (
        'pdserve_rank_up{rank="0"} 1.0',
        'pdserve_rank_up{rank="1"} 0.0',
        'pdserve_rank_restarts_total{rank="0"} 0.0',
        'pdserve_rank_restarts_total{rank="1"} 2.0',
        'pdserve_kv_cache_usage_ratio{rank="0"} 0.25',
        'pdserve_num_requests_running{rank="0"} 1.0',
        'pdserve_engine_x_new{rank="0"} 7.0',
        'pdserve_prompt_tokens_total{model_name="served-name",rank="0"} 5.0',
        'pdserve_time_to_first_token_seconds_count{model_name="served-name",rank="0"} 1.0',
    ):
        assert line in text, line


def test_server_config_cli():
    cfg = ServerConfig.from_argv(
        ["--dp", "2", "--port", "9000", "--deterministic", "--routing", "least-loaded"]
    )
    assert (cfg.dp, cfg.http_port, cfg.engine.is_deterministic, cfg.routing, cfg.engine.model) == (
        2,
        9000,
        True,
        "least-loaded",
        "smollm2-135m-instruct",
    )
    with pytest.raises(ValueError):
        ServerConfig(dp=0)


# Every flag README.md, deploy/ and the tests pass, with the default it has always had.
USER_FLAGS: dict[str, object] = {
    "--model": "smollm2-135m-instruct", "--role": "single", "--served-model-name": None,
    "--host": "127.0.0.1", "--port": None, "--dp": 1, "--device": "auto", "--deterministic": False,
    "--enforce-eager": False, "--routing": "affinity", "--chat-template": None, "--max-model-len": None,
    "--max-num-seqs": 64, "--max-num-batched-tokens": 2048, "--block-size": 128, "--kv-cache-gb": None,
    "--hicache-gb": None, "--hicache-size-gb": None, "--hicache-state-slots": None, "--dtype": "auto",
    "--gpu-memory-utilization": 0.9, "--load-format": "auto", "--seed": 0, "--max-body-bytes": 4 << 20,
    "--rank-start-timeout-s": 600.0, "--log-level": "info", "--prefill-url": "http://127.0.0.1:8889",
    "--kv-host": "127.0.0.1", "--kv-advertise-host": None, "--kv-port-base": 8900, "--transport": "tcp",
    "--ipc-arena-gb": 4.0, "--handoff-lease-s": 30.0, "--prefill-timeout-s": 600.0,
    "--fallback-local-prefill": False, "--max-queued-requests": 256, "--queue-timeout-s": 120.0,
    "--cluster-token-file": None, "--quantization": None, "--tp": 1,
}  # fmt: skip


def _settings(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """The leaf fields of a settings dataclass by path ("engine.forward.prefill_sdpa")."""
    hints = typing.get_type_hints(cls)
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_settings(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f
    return out


def test_flags_are_the_settings_fields():
    """One flag per field of ServerConfig and of the EngineConfig and TransferConfig it nests, named,
    defaulted and explained by the field; the flags users pass keep their defaults; from no flags, the
    dataclasses' own defaults."""
    parser = parser_for(ServerConfig, "pd.server", "")
    actions = [a for a in parser._actions if a.dest != "help"]
    fields = _settings(ServerConfig)
    assert sorted(a.dest for a in actions) == sorted(fields)  # one to one
    for a in actions:
        f = fields[a.dest]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert a.default == default, a.dest
        assert f.metadata["help"] and a.help == f.metadata["help"]
        name = f.metadata.get("flag", a.dest.rpartition(".")[2].replace("_", "-"))
        assert a.option_strings[0] == f"--{name}", a.dest
    by_flag = {s: a for a in actions for s in a.option_strings}
    for flag, default in USER_FLAGS.items():
        assert by_flag[flag].default == default, flag
    assert by_flag["--hicache-size-gb"] is by_flag["--hicache-gb"]
    assert ServerConfig.from_argv([]) == ServerConfig()
    cfg = ServerConfig.from_argv(
        "--hicache-size-gb 2 --prefill-sdpa off --prefill-sdpa-min-pairs 7 --no-chain-residuals "
        "--accept-transports tcp,ipc --ipc-time-copies --idle-timeout-s 3 --num-swa-slots 5 --nixl-copy-in "
        "--ipc-copy-in".split()
    )
    assert (cfg.engine.hicache_gb, cfg.engine.num_swa_slots, cfg.engine.forward) == (
        2.0,
        5,
        ForwardConfig(prefill_sdpa="off", prefill_sdpa_min_pairs=7, chain_residuals=False),
    )
    assert cfg.transfer == TransferConfig(
        accept_transports=("tcp", "ipc"), ipc_time_copies=True, idle_timeout_s=3.0, nixl_copy_in=True,
        ipc_copy_in=True,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-num-seq", "3"],  # an abbreviation is not taken either
        ["--determinstic"],
        ["--deterministic=yes"],
        ["--prefill-sdpa", "fast"],
        ["--accept-transports", "tcp,udp"],
        ["--dp", "two"],
        ["--quantization", "int8"],
    ],
)
def test_a_misspelled_flag_is_an_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ServerConfig.from_argv(argv)
    assert "error" in capsys.readouterr().err


def test_a_bad_value_is_an_error():
    for argv in (["--max-model-len", "1"], ["--ipc-arena-gb", "-1"], ["--prefill-sdpa-min-pairs", "0"]):
        with pytest.raises(ValueError):
            ServerConfig.from_argv(argv)


def test_rank_configs_are_typed_and_strict():
    """What a rank is told (--engine-config, --role-config): the codec's encoding of EngineConfig and
    RoleConfig, decoded as it was sent; an unknown, renamed or mistyped key is an error."""
    cfg = ServerConfig.from_argv(
        ["--role", "ce", "--deterministic", "--prefill-sdpa", "off", "--kv-cache-gb", "1", "--quantization", "fp8"]
    )
    assert cfg.engine.quantization == "fp8"
    engine_json, role_json = json.dumps(to_wire(cfg.engine)), json.dumps(to_wire(cfg.role_config(1)))
    assert read_configs(engine_json, role_json) == (cfg.engine, cfg.role_config(1))
    assert read_configs(engine_json, None) == (cfg.engine, None)
    good = to_wire(cfg.engine)
    for bad in (
        {**good, "max_num_seq": 3},
        {**good, "deterministic": True},  # the old name of is_deterministic
        {**good, "max_num_seqs": "3"},
        {**good, "forward": {"prefill_sdpa": "fast"}},
        {**good, "forward": {"chain_residual": False}},
    ):
        with pytest.raises(WireError):
            read_configs(json.dumps(bad), None)
    with pytest.raises(WireError):
        read_configs(engine_json, json.dumps({**to_wire(cfg.role_config(0)), "transport": "tcp"}))
    threads = torch.get_num_threads()
    try:
        device = f"cuda:{1 % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
        assert rank_engine_config(cfg.engine, 1, 2) == dataclasses.replace(cfg.engine, device=device)
    finally:
        torch.set_num_threads(threads)


def test_restart_policy_backs_off_and_stops_at_the_window_limit() -> None:
    p = RestartPolicy(max_restarts=3, window_s=600.0, backoff_s=1.0, max_backoff_s=3.0)
    assert [p.next_delay_s(t) for t in (0.0, 10.0, 20.0)] == [1.0, 2.0, 3.0]  # doubling, capped
    assert p.next_delay_s(30.0) is None  # 3 restarts within 600 s: stays down
    assert p.next_delay_s(599.0) is None and p.num_recent(599.0) == 3  # a refusal is not counted
    assert p.next_delay_s(600.0) == 3.0  # the restart at 0 s left the window: 2 recent, backoff 4 capped
    assert p.next_delay_s(5000.0) == 1.0  # a quiet window: the backoff starts over
    assert RestartPolicy(0, 600.0, 1.0, 30.0).next_delay_s(0.0) is None  # 0: never restart
    with pytest.raises(ValueError):
        RestartPolicy(1, 600.0, 10.0, 5.0)
    cfg = ServerConfig.from_argv(["--rank-restart-max", "2", "--rank-restart-backoff-s", "0.5"])
    assert RestartPolicy.of(cfg) == RestartPolicy(2, 600.0, 0.5, 30.0)
    with pytest.raises(ValueError):
        ServerConfig.from_argv(["--rank-restart-backoff-s", "60"])
