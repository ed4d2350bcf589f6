"""bench/load/replay.py and bench/load/loadgen: the seeded trace and its aiperf formats, the summary's arithmetic,
the runner against a fake streaming endpoint (history, bounds, errors, cancellation), and a small run
against a real server whose numbers must agree with the server's usage and its /metrics counters."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from bench.load import replay
from bench.load.loadgen import plots, report, runner, summary, trace

# ---- trace ----------------------------------------------------------------------------------------


def test_synthetic_trace_is_seeded_and_has_the_stated_shape() -> None:
    spec = trace.SyntheticSpec(num_conversations=300, num_turns=6, seed=3, max_context_tokens=10**6)
    convs = trace.synthetic_trace(spec)
    assert convs == trace.synthetic_trace(spec)
    assert convs != trace.synthetic_trace(trace.SyntheticSpec(num_conversations=300, num_turns=6, seed=4))
    assert len(convs) == 300 and all(len(c.turns) == 6 for c in convs)
    assert len({c.system for c in convs}) == 1  # one shared system prompt
    firsts = [c.turns[0] for c in convs]
    assert all(
        t.kind == "user" and t.delay_s == 0 and t.content.startswith(f"Task {i}: ")
        for i, t in enumerate(firsts)
    )
    later = [t for c in convs for t in c.turns[1:]]
    tools = [t for t in later if t.kind == "tool"]
    assert abs(len(tools) / len(later) - spec.tool_fraction) < 0.05
    user_words = [
        len(t.content.split()) - (2 if t in firsts else 0) for c in convs for t in c.turns if t.kind == "user"
    ]
    assert abs(statistics.mean(user_words) / spec.user_tokens - 1) < 0.1
    assert abs(statistics.mean(t.max_tokens for t in later) / spec.output_tokens - 1) < 0.1
    assert max(t.max_tokens for t in later) <= 4 * spec.output_tokens
    user_delays = [t.delay_s for t in later if t.kind == "user"]
    assert abs(statistics.mean(user_delays) / spec.think_s - 1) < 0.15
    assert abs(statistics.mean(t.delay_s for t in tools) / spec.tool_latency_s - 1) < 0.2


def test_context_cap_ends_conversations() -> None:
    spec = trace.SyntheticSpec(num_conversations=20, num_turns=8, tool_tokens=800, max_context_tokens=2048)
    convs = trace.synthetic_trace(spec)
    assert any(len(c.turns) < 8 for c in convs) and all(c.turns for c in convs)
    uncapped = trace.synthetic_trace(replace(spec, max_context_tokens=10**6))
    assert all(len(c.turns) == 8 for c in uncapped)
    # a capped conversation is a prefix of the same draws
    assert all(c.turns == u.turns[: len(c.turns)] for c, u in zip(convs, uncapped))


@pytest.mark.parametrize("fmt", ["pdserve", "multi_turn", "mooncake_trace"])
def test_trace_formats_round_trip(tmp_path: Path, fmt: str) -> None:
    convs = trace.synthetic_trace(
        trace.SyntheticSpec(num_conversations=4, num_turns=3, tool_fraction=0.5, seed=1)
    )
    path = tmp_path / "t.jsonl"
    trace.write_trace(path, convs, fmt)
    back = trace.read_trace(path)
    if fmt == "mooncake_trace":  # no system prompt in the format: it leads the first message
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert [set(x) for x in lines[:2]] == [
            {"session_id", "text_input", "output_length"},
            {"session_id", "text_input", "output_length", "delay"},
        ]
        assert back[0].turns[0].content == f"{convs[0].system}\n\n{convs[0].turns[0].content}"
        back = [
            trace.Conversation(
                b.id, (replace(b.turns[0], content=c.turns[0].content), *b.turns[1:]), c.system
            )
            for b, c in zip(back, convs)
        ]
    if fmt == "multi_turn":
        first = json.loads(path.read_text().splitlines()[0])
        assert first["session_id"] == convs[0].id and first["turns"][0] == {
            "role": "system",
            "text": convs[0].system,
        }
        assert first["turns"][1] == {
            "text": convs[0].turns[0].content,
            "output_length": convs[0].turns[0].max_tokens,
        }
        assert first["turns"][2]["delay"] == pytest.approx(convs[0].turns[1].delay_s * 1000)
    assert back == convs


# ---- summary --------------------------------------------------------------------------------------


def _rec(turn: int, status: str = "ok", **kw: object) -> object:
    r = runner.RequestRecord("c", turn, "user", 4, status=status)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_summary_counts_percentiles_goodput_and_hit_rate() -> None:
    recs = [
        _rec(
            0,
            start_s=0.0,
            ttft_s=0.1,
            e2e_s=0.4,
            itl_s=[0.1, 0.1, 0.1],
            num_chunks=4,
            prompt_tokens=100,
            cached_tokens=0,
            completion_tokens=4,
        ),
        _rec(
            1,
            start_s=1.0,
            ttft_s=0.3,
            e2e_s=1.0,
            itl_s=[0.2, 0.3, 0.2],
            num_chunks=4,
            prompt_tokens=200,
            cached_tokens=100,
            completion_tokens=4,
        ),
        _rec(2, "error", start_s=2.0, error="HTTP 500"),
        _rec(3, "skipped"),
    ]
    s = summary.summarize(recs, slo_ttft_ms=200, slo_itl_ms=150)
    counts = ("num_planned", "num_sent", "num_ok", "num_errors", "num_skipped")
    assert [s[k] for k in counts] == [4, 3, 2, 1, 1]
    assert s["duration_s"] == pytest.approx(2.0)  # first send to last ok end
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["p99"] == pytest.approx(298)
    assert s["itl_ms"]["mean"] == pytest.approx(1000 * 1.0 / 6)
    assert s["tpot_ms"]["p50"] == pytest.approx(1000 * (0.1 + 0.7 / 3) / 2)
    assert (s["prompt_tokens"], s["cached_tokens"], s["completion_tokens"]) == (300, 100, 8)
    assert s["output_tokens_per_s"] == pytest.approx(4.0) and s["requests_per_s"] == pytest.approx(1.0)
    # only the first meets both SLOs
    assert s["goodput_fraction"] == 0.5 and s["goodput_requests_per_s"] == pytest.approx(0.5)
    assert s["prefix_cache_hit_rate"] == pytest.approx(1 / 3)
    assert summary.summarize(recs)["goodput_fraction"] == 1.0  # no SLO: every ok request is good
    table = report.format_table([("x", s)])
    assert "200 / " in table and "33.3%" in table and "0.50 (50%)" in table


def test_gaps_split_by_overlap_with_long_prefills() -> None:
    long_one = _rec(  # 900 new prompt tokens: prefilled from 1.0 to 3.0
        0,
        start_s=1.0,
        ttft_s=2.0,
        e2e_s=2.5,
        itl_s=[0.5],
        num_chunks=2,
        prompt_tokens=1000,
        cached_tokens=100,
    )
    short = _rec(  # 50 new tokens: not a long prefill
        1, start_s=0.0, ttft_s=0.2, e2e_s=0.3, itl_s=[0.1], num_chunks=2, prompt_tokens=50, cached_tokens=0
    )
    # first token at 0.5; gaps end at 0.7, 2.9 (stalled across 0.7..2.9, inside the prefill), 3.0, 3.1
    streaming = _rec(
        2,
        start_s=0.0,
        ttft_s=0.5,
        e2e_s=3.1,
        itl_s=[0.2, 2.2, 0.1, 0.1],
        num_chunks=5,
        prompt_tokens=40,
        cached_tokens=0,
    )
    recs = [long_one, short, streaming]
    assert summary.long_prefills(recs, 512) == [(1.0, 3.0)]
    spans = [t for span in summary.gap_spans(streaming) for t in span]
    assert spans == pytest.approx([0.5, 0.7, 0.7, 2.9, 2.9, 3.0, 3.0, 3.1])
    inside, outside = summary.split_gaps(recs, summary.long_prefills(recs, 512))
    # the long request's own gap (3.0..3.5) starts at its first token, after its prefill
    assert sorted(inside) == pytest.approx([0.1, 2.2]) and sorted(outside) == pytest.approx(
        [0.1, 0.1, 0.2, 0.5]
    )
    s = summary.summarize(recs, long_prompt_tokens=512)
    assert s["num_long_prefills"] == 1 and s["itl_in_long_prefill_ms"]["max"] == pytest.approx(2200)
    assert s["itl_outside_long_prefill_ms"]["max"] == pytest.approx(500)
    assert summary.summarize(recs, long_prompt_tokens=10)["num_long_prefills"] == 3
    none = summary.summarize(recs, long_prompt_tokens=5000)
    assert none["num_long_prefills"] == 0 and none["itl_in_long_prefill_ms"]["p50"] is None
    assert "1 (>= 512 new)" in report.format_itl_split([("x", s)])


# ---- the runner against a fake endpoint -----------------------------------------------------------


class FakeEndpoint:
    """Streams max_tokens one-word chunks, then usage (prompt tokens = words in the messages). With
    phase_s set, /metrics counts each answer's TTFT phases as a P/D coordinator's would; with spec set
    (drafts, draft tokens, accepted tokens per answer), vLLM's spec_decode counters as a speculating
    server's two ranks would (each answer counted on rank 0 and once more on rank 1)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.phase_s: dict[str, float] = {}
        self.phase_totals: dict[str, list[float]] = {}
        self.spec: tuple[int, int, int] | None = None
        self.spec_totals: list[int] | None = None

    async def metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE pdserve_ttft_phase_seconds histogram"]
        for phase, (total, count) in self.phase_totals.items():
            lines.append(f'pdserve_ttft_phase_seconds_sum{{phase="{phase}"}} {total}')
            lines.append(f'pdserve_ttft_phase_seconds_count{{phase="{phase}"}} {count}')
        names = ("drafts", "draft_tokens", "accepted_tokens")
        for name, total in zip(names, self.spec_totals or ()):
            lines.append(f"# TYPE vllm:spec_decode_num_{name} counter")
            for engine in (0, 1):
                lines.append(f'vllm:spec_decode_num_{name}_total{{engine="{engine}",model_name="m"}} {total}')
        return web.Response(text="\n".join(lines) + "\n")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        for phase, seconds in self.phase_s.items():
            t = self.phase_totals.setdefault(phase, [0.0, 0.0])
            t[0] += seconds
            t[1] += 1
        if self.spec is not None:
            self.spec_totals = [a + b for a, b in zip(self.spec_totals or [0, 0, 0], self.spec)]
        text = body["messages"][-1]["content"]
        if "FAIL" in text:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        delay = 5.0 if "SLOW" in text else 0.002
        num_tokens = 0 if "EMPTY" in text else body["max_tokens"]
        if not num_tokens:  # EOS first: one chunk with a finish reason and no text
            chunk = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": "stop"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        for i in range(num_tokens):
            await asyncio.sleep(delay)
            delta = {"role": "assistant", "content": f" w{i}"} if i == 0 else {"content": f" w{i}"}
            chunk = {
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "finish_reason": "length" if i == body["max_tokens"] - 1 else None,
                    }
                ]
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        num_prompt = sum(len(m["content"].split()) for m in body["messages"])
        usage = {
            "prompt_tokens": num_prompt,
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": 1},
        }
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp


@pytest.fixture
async def fake():
    from aiohttp.test_utils import TestServer

    ep = FakeEndpoint()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", ep.chat)
    app.router.add_get("/metrics", ep.metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    ep.url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    yield ep
    await server.close()


def _conv(cid: str, *texts: str, max_tokens: int = 3) -> object:
    return trace.Conversation(
        cid, tuple(trace.Turn(t, max_tokens, 0.01 if k else 0) for k, t in enumerate(texts)), "sys"
    )


async def test_runner_sends_history_and_counts(fake) -> None:
    cfg = runner.LoadConfig(fake.url, "m", concurrency=2, extra_body={"ignore_eos": True})
    convs = [_conv("a", "one two", "three"), _conv("b", "four", "five six", "seven")]
    run = await runner.run_load(cfg, convs)
    assert [(r.conversation, r.turn, r.status) for r in run.requests] == [
        ("a", 0, "ok"),
        ("a", 1, "ok"),
        ("b", 0, "ok"),
        ("b", 1, "ok"),
        ("b", 2, "ok"),
    ]
    last = next(b for b in fake.bodies if b["messages"][-1]["content"] == "seven")
    assert last["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "four"},
        {"role": "assistant", "content": " w0 w1 w2"},
        {"role": "user", "content": "five six"},
        {"role": "assistant", "content": " w0 w1 w2"},
        {"role": "user", "content": "seven"},
    ]
    assert last["stream"] and last["stream_options"] == {"include_usage": True} and last["ignore_eos"]
    assert last["temperature"] == 0 and last["max_tokens"] == 3
    for r in run.requests:
        assert r.num_chunks == 3 and len(r.itl_s) == 2 and r.completion_tokens == 3 and r.cached_tokens == 1
        assert 0 < r.ttft_s <= r.e2e_s and r.ttft_s + sum(r.itl_s) <= r.e2e_s
    assert run.requests[-1].prompt_tokens == 1 + 1 + 3 + 2 + 3 + 1


async def test_runner_bounds_errors_and_cancellation(fake) -> None:
    base = runner.LoadConfig(fake.url, "m", concurrency=4)
    run = await runner.run_load(replace(base, max_requests=3), [_conv("a", "x", "y"), _conv("b", "x", "y")])
    assert sorted(r.status for r in run.requests) == ["ok", "ok", "ok", "skipped"]
    run = await runner.run_load(base, [_conv("a", "x", "FAIL", "z"), _conv("b", "x")])
    assert [r.status for r in run.requests] == ["ok", "error", "skipped", "ok"]
    assert run.requests[1].http_status == 500 and "boom" in run.requests[1].error
    run = await runner.run_load(
        replace(base, duration_s=0.3, grace_s=0.2), [_conv("a", "SLOW"), _conv("b", "x", "y")]
    )
    assert [r.status for r in run.requests] == ["cancelled", "ok", "ok"]
    s = summary.summarize(run.requests)
    assert (s["num_planned"], s["num_ok"], s["num_cancelled"]) == (3, 2, 1)
    run = await runner.run_load(base, [_conv("e", "EMPTY")])
    (r,) = run.requests
    assert r.status == "ok" and r.num_chunks == 0 and 0 < r.ttft_s <= r.e2e_s and r.finish_reason == "stop"
    rate = await runner.run_load(
        runner.LoadConfig(fake.url, "m", request_rate=50.0), [_conv(str(i), "x") for i in range(5)]
    )
    assert [r.status for r in rate.requests] == ["ok"] * 5


@pytest.mark.smoke  # matplotlib and pytest-asyncio at their lower bounds
async def test_outputs_json_table_and_plots(fake, tmp_path: Path) -> None:
    runs = []
    for c in (1, 2):
        cfg = runner.LoadConfig(fake.url, "m", concurrency=c, label=f"c={c}")
        runs.append(await runner.run_load(cfg, [_conv("a", "x", "y"), _conv("b", "z")]))
    doc = report.results_doc(runs, {"source": "test"}, 1000.0, None, ["replay.py"])
    table = report.write_outputs(tmp_path, doc, {"fake": doc["runs"]})
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["schema"] == report.SCHEMA and [r["label"] for r in saved["runs"]] == ["c=1", "c=2"]
    assert saved["runs"][1]["load"] == {"concurrency": 2, "request_rate": None}
    assert saved["runs"][0]["summary"]["num_ok"] == 3 and len(saved["runs"][0]["requests"]) == 3
    assert (tmp_path / "summary.txt").read_text().strip() == table
    for name in ("distributions.png", "throughput.png", "sweep.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    tokens = sum(n for r in saved["runs"][0]["requests"] for _, n in plots.token_times(r))
    assert tokens == saved["runs"][0]["summary"]["completion_tokens"]


async def test_a_pd_endpoints_ttft_phases_are_in_the_report(fake, tmp_path: Path) -> None:
    """The run's own requests' TTFT phases (the /metrics difference over the run), in results.json and
    the table; none for an endpoint that exports none."""
    cfg = runner.LoadConfig(fake.url, "m", concurrency=1, label="pd")
    plain = await runner.run_load(cfg, [_conv("a", "x")])
    assert plain.ttft_phases_ms is None
    fake.phase_s = {"prefill": 1.0, "transfer": 0.5, "transfer_after_prefill": 0.25}
    await runner.run_load(cfg, [_conv("a", "x", "y")])  # counted before the next run: not in its means
    fake.phase_s = {"prefill": 0.2, "transfer": 0.1, "transfer_after_prefill": 0.01}
    run = await runner.run_load(cfg, [_conv("a", "x", "y"), _conv("b", "z")])
    want = {"prefill": 200.0, "transfer": 100.0, "transfer_after_prefill": 10.0}
    assert run.ttft_phases_ms == pytest.approx(want)
    doc = report.results_doc([plain, run], {"source": "test"}, None, None, ["replay.py"])
    table = report.write_outputs(tmp_path, doc, plots=False)
    saved = json.loads((tmp_path / "results.json").read_text())["runs"][1]["summary"]["ttft_phases_ms"]
    assert saved["prefill"] == pytest.approx(200.0)
    phases = table.split("TTFT phases")[1].splitlines()
    assert "transfer after prefill ms" in phases[1]
    assert [c.strip() for c in phases[-1].split("|")][:5] == ["pd", "-", "200.0", "100.0", "10.0"]


async def test_a_speculating_endpoints_acceptance_is_in_the_report(fake, tmp_path: Path) -> None:
    """The run's own drafts (the /metrics difference over the run, every rank summed): the mean accepted
    length 1 + accepted / drafts and the acceptance rate accepted / draft tokens, in results.json and the
    table; none for an endpoint that does not speculate."""
    cfg = runner.LoadConfig(fake.url, "m", concurrency=1, label="spec")
    plain = await runner.run_load(cfg, [_conv("a", "x")])
    assert plain.speculation is None
    fake.spec = (1, 3, 3)
    await runner.run_load(cfg, [_conv("a", "x")])  # counted before the next run: not in its numbers
    fake.spec = (4, 12, 6)
    run = await runner.run_load(cfg, [_conv("a", "x", "y"), _conv("b", "z")])
    # 3 answers x 2 ranks: 24 drafts, 72 draft tokens, 36 accepted
    assert run.speculation == {
        "num_drafts": 24, "num_draft_tokens": 72, "num_accepted_tokens": 36,
        "mean_accepted_length": 2.5, "acceptance_rate": 0.5,
    }  # fmt: skip
    fake.spec = (0, 0, 0)
    idle = await runner.run_load(cfg, [_conv("a", "x")])  # speculating, but nothing drafted
    assert idle.speculation == {
        "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
        "mean_accepted_length": None, "acceptance_rate": None,
    }  # fmt: skip
    doc = report.results_doc([plain, run, idle], {"source": "test"}, None, None, ["replay.py"])
    table = report.write_outputs(tmp_path, doc, plots=False)
    saved = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert saved[0]["summary"]["speculation"] is None
    assert saved[1]["summary"]["speculation"]["mean_accepted_length"] == 2.5
    lines = table.split("Speculative decoding")[1].splitlines()
    assert "mean accepted length" in lines[1] and "acceptance rate" in lines[1]
    assert [c.strip() for c in lines[3].split("|")] == ["spec", "-", "-", "-", "-", "-"]
    assert [c.strip() for c in lines[4].split("|")] == ["spec", "24", "72", "36", "2.50", "50.0%"]
    assert [c.strip() for c in lines[5].split("|")] == ["spec", "0", "0", "0", "-", "-"]


@pytest.fixture
def fake_in_thread():
    """The fake endpoint on its own event loop in a thread, for the command lines (they call asyncio.run)."""
    import threading

    from aiohttp.test_utils import TestServer

    ep, loop, ready = FakeEndpoint(), asyncio.new_event_loop(), threading.Event()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", ep.chat)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    app.router.add_get("/v1/models", models)
    server = TestServer(app, host="127.0.0.1", loop=loop)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start_server())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    ep.url = f"http://127.0.0.1:{server.port}"
    yield ep
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


SMALL = "--conversations 3 --turns 2 --output-tokens 4 --output-sigma 0 --think-s 0.01 --tool-latency-s 0.01"


def test_load_command_line_sweep(fake_in_thread, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    flags = f'--url {fake_in_thread.url}/v1 --out {out} --concurrency 1,3 --warmup 2 --extra-body {{"x":1}} {SMALL}'
    assert replay.main(flags.split()) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["c=1", "c=3"] and doc["runs"][0]["model"] == "fake-model"
    assert all(r["summary"]["num_ok"] == r["summary"]["num_planned"] == 6 for r in doc["runs"])
    assert (out / "sweep.png").exists() and "c=3" in capsys.readouterr().out
    bodies = fake_in_thread.bodies
    assert len(bodies) == 2 + 12 and all(b["x"] == 1 and b["model"] == "fake-model" for b in bodies)
    # each point of a sweep starts its conversations with its own marker: no cache hits across runs
    firsts = {b["messages"][1]["content"].split("]")[0] for b in bodies[2:] if len(b["messages"]) == 2}
    assert len(firsts) == 2


def test_turns_of_a_conversation_move_between_the_endpoints_of_a_cluster() -> None:
    from bench.load.loadgen import cli

    urls = cli.chat_url("http://a:1, http://b:2/v1")
    assert urls == "http://a:1/v1/chat/completions,http://b:2/v1/chat/completions"
    cfg = runner.LoadConfig(urls, "m", concurrency=1)
    turns = [runner.url_for(cfg, runner.RequestRecord("conv-1", t, "user", 4)) for t in range(4)]
    assert turns[0] != turns[1] and turns[0] == turns[2] and turns[1] == turns[3]
    firsts = {runner.url_for(cfg, runner.RequestRecord(f"c{i}", 0, "user", 4)) for i in range(20)}
    assert firsts == set(urls.split(","))  # conversations start on either
    one = runner.LoadConfig("http://a:1/v1/chat/completions", "m", concurrency=1)
    assert runner.url_for(one, runner.RequestRecord("c", 3, "user", 4)) == one.url


def test_compare_two_targets_side_by_side(fake_in_thread, tmp_path: Path) -> None:
    from bench.load import compare
    out = tmp_path / "cmp"
    url = fake_in_thread.url
    flags = (
        f'--target a={url} --target b={url}/v1 --extra b={{"prefix_cache":false}} --concurrency 2 --warmup 0'
    )
    assert compare.main([*flags.split(), "--out", str(out), *SMALL.split()]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [(r["label"], r["target"]) for r in doc["runs"]] == [("a c=2", "a"), ("b c=2", "b")]
    assert doc["runs"][1]["config"]["extra_body"] == {"prefix_cache": False}
    assert sum(b.get("prefix_cache") is False for b in fake_in_thread.bodies) == 6
    for name in ("compare.png", "distributions.png", "throughput.png", "summary.txt", "itl_timeline.png"):
        assert (out / name).exists()


def test_compare_interleaves_points_with_setup_and_teardown(fake_in_thread, tmp_path: Path) -> None:
    from bench.load import compare
    out, log = tmp_path / "cmp", tmp_path / "hooks.log"
    url = fake_in_thread.url
    args = [
        *f"--target a={url} --target b={url} --concurrency 1,2 --warmup 0 --interleave --out {out}".split(),
        *("--setup", f"b=echo setup >> {log}", "--teardown", f"b=echo teardown >> {log}"),
        *SMALL.split(),
    ]
    assert compare.main(args) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["a c=1", "b c=1", "a c=2", "b c=2"]
    assert all(r["summary"]["num_ok"] == 6 for r in doc["runs"])
    # around each of b's runs, not a's; no warm-up requests asked for, but the warm-up step is hooked too
    assert log.read_text().split() == ["setup", "teardown"] * 3
    assert "ITL in long prefill" in (out / "summary.txt").read_text()
    failing = [*args[: args.index("--setup")], "--setup", "b=exit 3", *SMALL.split()]
    with pytest.raises(subprocess.CalledProcessError):
        compare.main(failing)


def test_aiperf_records_pair_with_load_records(tmp_path: Path) -> None:
    from bench.load import aiperf_vs_load as pair
    reqs = [
        runner.RequestRecord(
            "conv-0000",
            0,
            "user",
            3,
            "ok",
            start_s=0.0,
            ttft_s=0.5,
            e2e_s=0.7,
            itl_s=[0.1, 0.1],
            num_chunks=3,
            prompt_tokens=100,
            cached_tokens=0,
            completion_tokens=3,
        ),
        runner.RequestRecord(
            "conv-0000",
            1,
            "tool",
            3,
            "ok",
            start_s=1.0,
            ttft_s=0.2,
            e2e_s=0.6,
            itl_s=[0.1, 0.3],
            num_chunks=3,
            prompt_tokens=300,
            cached_tokens=128,
            completion_tokens=3,
        ),
        runner.RequestRecord("conv-0001", 0, "user", 3, "error", start_s=0.0, error="HTTP 500"),
    ]
    doc = report.results_doc(
        [runner.RunResult(runner.LoadConfig("u", "m", concurrency=1), 0.0, reqs)], {}, None, None, []
    )
    (tmp_path / "load.json").write_text(json.dumps(doc))

    def line(turn: int, ttft_ms: float, cached: int, gaps: list[float]) -> str:
        metrics = {
            "time_to_first_token": ttft_ms,
            "inter_token_latency": sum(gaps) / len(gaps),
            "inter_chunk_latency": gaps,
            "usage_prompt_tokens": [100, 300][turn],
            "usage_prompt_cache_read_tokens": cached,
            "usage_completion_tokens": 3,
        }
        meta = {"conversation_id": "conv-0000", "turn_index": turn}
        return json.dumps({"metadata": meta, "metrics": {k: {"value": v} for k, v in metrics.items()}})

    failed = json.dumps({"metadata": {"conversation_id": "conv-0001", "turn_index": 0}, "metrics": {}})
    lines = [line(0, 1000.0, 0, [100.0, 100.0]), line(1, 200.0, 0, [200.0, 200.0]), failed]
    (tmp_path / "aiperf.jsonl").write_text("\n".join(lines) + "\n")
    mine, theirs = pair.read_load(tmp_path / "load.json"), pair.read_aiperf(tmp_path / "aiperf.jsonl")
    assert set(mine) == set(theirs) == {("conv-0000", 0), ("conv-0000", 1)}
    assert (
        mine[("conv-0000", 1)].mean_gap_ms == pytest.approx(200) and theirs[("conv-0000", 0)].ttft_ms == 1000
    )
    table = pair.compare([("replay.py #1", mine), ("aiperf #1", theirs)])
    # the second turn's cached tokens differ (128 vs 0): 1 of the 2 paired requests is the same
    assert "2 of 2 (1)" in table.splitlines()[-1] and "2 of 2 (2)" in table.splitlines()[-2]
    assert table.splitlines()[-1].endswith("1.50 (1.10-1.90)")  # TTFT ratios 2.0 and 1.0


# ---- a real server --------------------------------------------------------------------------------


@pytest.mark.slow
def test_small_trace_against_a_real_server(tmp_path: Path) -> None:
    from pd.tools.server_process import ServerProcess, rank_metrics, wait_idle

    args = ("--model", "smollm2-135m-instruct", "--max-model-len", "2048", "--kv-cache-gb", "0.25")
    with ServerProcess(*args, log_path=tmp_path / "server.log") as server:
        before = rank_metrics(server.port)
        flags = (
            "--trace synthetic --conversations 3 --turns 2 --output-tokens 8 --output-sigma 0 --system-tokens 40"
            " --user-tokens 10 --tool-fraction 0 --think-s 0.05 --concurrency 3 --ignore-eos --logprobs"
            " --warmup 0 --slo-ttft-ms 60000 --slo-itl-ms 60000"
        )
        rc = replay.main(["--url", server.url, "--out", str(tmp_path / "out"), *flags.split()])
        after = wait_idle(server.port)
    assert rc == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    (run,) = doc["runs"]
    reqs, s = run["requests"], run["summary"]
    assert doc["trace"]["num_turns"] == len(reqs) == 6 and s["num_ok"] == 6 and s["num_errors"] == 0
    assert [(r["conversation"], r["turn"]) for r in reqs] == [
        (f"conv-{c:04d}", k) for c in range(3) for k in range(2)
    ]
    for r in reqs:  # streamed tokens, the usage and max_tokens agree
        assert r["completion_tokens"] == r["stream_tokens"] == r["num_chunks"] == 8 and len(r["itl_s"]) == 7
        assert r["finish_reason"] == "length" and 0 < r["ttft_s"] <= r["e2e_s"]
    for first, second in zip(reqs[::2], reqs[1::2]):  # turn 2 carries turn 1, its answer and a new message
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
        assert second["start_s"] >= first["start_s"] + first["e2e_s"]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert s["prompt_tokens"] == sum(r["prompt_tokens"] for r in reqs) == delta("pdserve_prompt_tokens_total")
    assert s["completion_tokens"] == 48 == delta("pdserve_generation_tokens_total")
    assert s["cached_tokens"] == delta("pdserve_cached_prompt_tokens_total")
    assert s["prefix_cache_hit_rate"] == pytest.approx(s["cached_tokens"] / s["prompt_tokens"])
    assert s["goodput_fraction"] == 1.0
    assert s["output_tokens_per_s"] == pytest.approx(48 / s["duration_s"])
    assert all(
        (tmp_path / "out" / f).exists() for f in ("distributions.png", "throughput.png", "summary.txt")
    )


async def test_a_run_prints_its_progress(fake, capsys: pytest.CaptureFixture[str]) -> None:
    """progress_s: a line on stderr while the run goes (a slow answer keeps it going) and one at its end."""
    cfg = runner.LoadConfig(fake.url, "m", concurrency=2, label="p", progress_s=0.05, duration_s=0.4, grace_s=0.1)
    await runner.run_load(cfg, [_conv("a", "x", "y"), _conv("b", "SLOW")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) >= 3 and all(line.startswith("[p] ") for line in lines)
    assert "1 in flight" in lines[0]
    assert "2 ok, 0 errors, 0 in flight, 0 turns to go; 6 output tokens" in lines[-1]  # the SLOW one cut off
    quiet = replace(cfg, progress_s=0.0)
    await runner.run_load(quiet, [_conv("a", "x")])
    assert capsys.readouterr().err == ""
