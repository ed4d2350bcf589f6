"""`pdserve bench serve` (bench/load/serve.py, loadgen/datasets.py, loadgen/serving.py): vLLM's datasets drawn
with SmolLM2's tokenizer, and runs against a real server started with --api-key (a tiny random Llama with
SmolLM2's tokenizer): the report's counts are the requests and tokens asked for, the key's absence is 8
failures (401), a ShareGPT file works on the chat endpoint; the plot (serve_plot.py) is an SVG whose marks are
the report's median and p99."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.load import serve
from bench.load.loadgen import datasets, serve_plot, serving, summary
from pd.tools.cli import main as pdserve

SERVED = "tiny-serve"
API_KEY = "sk-bench-serve-key"


@pytest.fixture(scope="module")
def tokenizer_folder() -> Path:
    from engine.checkpoints import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder: Path):  # noqa: ANN201 - a transformers tokenizer
    from pd.frontend.coordinator import load_tokenizer

    return load_tokenizer(str(tokenizer_folder))


# ---- datasets -------------------------------------------------------------------------------------


def test_random_prompts_have_the_lengths_asked_and_a_shared_prefix(tokenizer) -> None:
    reqs = datasets.random_requests(tokenizer, 20, 30, 7, 0.5, 5, seed=1, as_text=False)
    assert reqs == datasets.random_requests(tokenizer, 20, 30, 7, 0.5, 5, seed=1, as_text=False)
    assert reqs != datasets.random_requests(tokenizer, 20, 30, 7, 0.5, 5, seed=2, as_text=False)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(5 + 15 <= r.prompt_len <= 5 + 45 and 3 <= r.expected_output_len <= 11 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1  # --random-range-ratio spreads them
    assert len({tuple(r.prompt[:5]) for r in reqs}) == 1  # --random-prefix-len: one prefix for all
    special = set(tokenizer.all_special_ids)
    assert not special & {t for r in reqs for t in r.prompt}
    fixed = datasets.random_requests(tokenizer, 4, 30, 7, 0.0, 0, seed=1, as_text=True)
    assert all(isinstance(r.prompt, str) and (r.prompt_len, r.expected_output_len) == (30, 7) for r in fixed)


def test_prefix_repetition_shares_each_prefix_among_its_prompts(tokenizer) -> None:
    reqs = datasets.prefix_repetition_requests(tokenizer, 12, 16, 4, 3, 5, seed=0, as_text=False)
    assert len(reqs) == 12 and all(r.prompt_len == 20 and r.expected_output_len == 5 for r in reqs)
    prefixes = [tuple(r.prompt[:16]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    with pytest.raises(ValueError, match="num-prompts"):
        datasets.prefix_repetition_requests(tokenizer, 2, 16, 4, 3, 5, seed=0, as_text=False)


def sharegpt_file(folder: Path) -> Path:
    entries = [
        {"conversations": [{"from": "human", "value": "What is the capital of France? Answer in a sentence."},
                           {"from": "gpt", "value": "The capital of France is Paris, on the Seine."}]},
        {"conversations": [{"from": "human", "value": "Name three primary colours, please, in a list."},
                           {"from": "gpt", "value": "Red, yellow and blue are the three primary colours."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello there, friend!"}]},
        {"conversations": [{"from": "human", "value": "A lone question without an answer"}]},
    ]  # fmt: skip
    path = folder / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt_filters_as_vllm_and_samples_again(tmp_path: Path, tokenizer) -> None:
    path = sharegpt_file(tmp_path)
    reqs = datasets.sharegpt_requests(path, tokenizer, 5, None, seed=0)
    # "hi" is under 4 tokens and the lone question has no answer: two entries, drawn again to make 5
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {
        "What is the capital of France? Answer in a sentence.",
        "Name three primary colours, please, in a list.",
    }
    paris = next(r for r in reqs if "France" in str(r.prompt))
    assert paris.expected_output_len == len(tokenizer("The capital of France is Paris, on the Seine.").input_ids)
    assert {r.expected_output_len for r in datasets.sharegpt_requests(path, tokenizer, 2, 9, seed=0)} == {9}
    with pytest.raises(ValueError, match="dataset-path"):
        datasets.sharegpt_requests(tmp_path / "missing.json", tokenizer, 2, None, seed=0)


def test_report_has_vllms_rows_and_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = serving.ServeConfig("http://x/v1/completions", "m")
    rec = serving.RequestRecord("p", 0, "serve", 3, status="ok", ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1],
                                prompt_tokens=5, completion_tokens=3)  # fmt: skip
    result = serving.ServeResult([rec], ["abc"], duration_s=0.5)
    req = datasets.SampleRequest([1, 2, 3, 4, 5], 5, 3)
    doc = serving.serving_metrics(result, [req], ["ttft", "tpot", "e2el"], [50, 99.9])
    assert (doc["completed"], doc["total_input_tokens"], doc["total_output_tokens"]) == (1, 5, 3)
    assert doc["request_throughput"] == 2.0 and doc["output_throughput"] == 6.0
    assert doc["mean_tpot_ms"] == pytest.approx(100.0) and doc["p99.9_e2el_ms"] == pytest.approx(300.0)
    text = serving.format_report(doc, ["ttft", "tpot", "e2el"], [50, 99.9], cfg)
    for label, value in (("Successful requests:", "1"), ("Total generated tokens:", "3"), ("Mean TTFT (ms):", "100.00"),
                         ("P99.9 E2EL (ms):", "300.00"), ("Request rate configured (RPS):", "inf")):  # fmt: skip
        assert f"{label:<40} {value}" in text.splitlines(), text
    assert text.splitlines()[0] == "{:=^50}".format(" Serving Benchmark Result ")
    assert "-----Time per Output Token (excl. 1st token)------" in text
    assert serving.request_body(serving.ServeConfig("http://x/v1/chat/completions", "m", ignore_eos=True), req)[
        "max_completion_tokens"
    ] == 3
    for bad, what in ((["--percentile-metrics", "ttft,foo"], "foo"), (["--header", "novalue"], "KEY=VALUE"),
                      (["--metric-percentiles", "100"], "metric-percentiles"),
                      (["--endpoint", "/v1/models", "--model", "m"], "endpoint")):  # fmt: skip
        assert serve.main(["--base-url", "http://127.0.0.1:9", *bad]) == 2
        assert what in capsys.readouterr().err


SVG = "{http://www.w3.org/2000/svg}"


def svg_panels(text: str) -> dict[str, ET.Element]:
    """The panels of a plot (it must parse as XML, an <svg> at the root): metric -> its <g>."""
    root = ET.fromstring(text)
    assert root.tag == SVG + "svg"
    return {g.attrib["id"]: g for g in root.iter(SVG + "g") if g.attrib.get("class") == "panel"}


def marks(panel: ET.Element) -> dict[str, float]:
    return {m.attrib["data-quantile"]: float(m.attrib["data-ms"]) for m in panel.iter(SVG + "line")
            if m.attrib.get("class") == "mark"}  # fmt: skip


def test_the_plot_is_an_svg_of_each_metrics_cdf_with_its_median_and_p99() -> None:
    values = {"ttft": [0.010, 0.030, 0.020, 0.040], "tpot": [0.0025], "itl": [], "e2el": [0.5, 1.5]}
    text = serve_plot.serve_svg({k: [v * 1e3 for v in vs] for k, vs in values.items()}, "m<&>, random")
    panels = svg_panels(text)
    assert list(panels) == ["ttft", "tpot", "itl", "e2el"]
    assert "m&lt;&amp;&gt;, random" in text
    for name, vs in values.items():
        lines = panels[name].findall(SVG + "polyline")
        if not vs:
            assert lines == [] and "no samples" in "".join(panels[name].itertext())
            continue
        want = summary.percentiles(vs, [50, 99])  # what the report prints, in ms
        assert marks(panels[name]) == pytest.approx({"p50": want["p50"], "p99": want["p99"]}, rel=1e-5)
        (cdf,) = lines
        points = [tuple(map(float, p.split(","))) for p in cdf.attrib["points"].split()]
        assert len(points) == 2 * len(vs) + 2
        xs, ys = [x for x, _ in points], [y for _, y in points]
        assert xs == sorted(xs) and ys == sorted(ys, reverse=True)  # rightwards and upwards (SVG's y grows down)
        assert ys[0] > ys[-1]
    assert [serve_plot.nice_ceiling(x) for x in (0, 0.7, 1, 3, 40, 41, 501)] == [1, 1, 1, 5, 50, 50, 1000]
    many = [float(i % 997) for i in range(50_000)]  # an ITL's many samples: drawn through MAX_STEPS quantiles
    (cdf,) = svg_panels(serve_plot.serve_svg({"itl": many}, "x"))["itl"].findall(SVG + "polyline")
    assert len(cdf.attrib["points"].split()) == serve_plot.MAX_STEPS + 3


async def test_arrivals_at_a_rate_are_gamma_gaps() -> None:
    import time

    t0 = time.perf_counter()
    assert [i async for i in serving.arrivals(5, math.inf, 1.0, 0)] == [0, 1, 2, 3, 4]
    assert time.perf_counter() - t0 < 0.05
    t0 = time.perf_counter()
    assert [i async for i in serving.arrivals(6, 50.0, 1.0, 0)] == list(range(6))
    assert 0.02 < time.perf_counter() - t0 < 1.0  # 5 gaps of 20 ms on average


# ---- a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tokenizer_folder: Path) -> Iterator:
    from pd.tools.server_process import ServerProcess
    from tests.tiny_models import make_servable

    folder = make_servable("llama", tmp_path_factory.mktemp("tiny-serve"), tokenizer_folder)
    args = ("--model", str(folder), "--served-model-name", SERVED, "--max-model-len", "512",
            "--kv-cache-gb", "0.05", "--api-key", API_KEY)  # fmt: skip
    with ServerProcess(*args, log_path=tmp_path_factory.mktemp("server") / "server.log") as s:
        yield s


@pytest.mark.slow
def test_random_run_completes_with_the_tokens_asked(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The key from $OPENAI_API_KEY; the model and its tokenizer from /v1/models (its root: the folder)."""
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    args = ["bench", "serve", "--base-url", server.url, "--dataset-name", "random", "--num-prompts", "8",
            "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos", "--max-concurrency", "4",
            "--request-rate", "200", "--metric-percentiles", "50,99", "--header", "X-Request-Tag=bench",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json"]  # fmt: skip
    assert pdserve(args) == 0
    out = capsys.readouterr().out
    assert "Successful requests:                     8" in out and "Failed requests:                         0" in out
    assert "Total generated tokens:                  32" in out and "Median ITL (ms):" in out
    doc = json.loads((tmp_path / "out.json").read_text())
    assert (doc["completed"], doc["failed"], doc["model_id"]) == (8, 0, SERVED)
    assert doc["output_lens"] == [4] * 8 and doc["total_output_tokens"] == 32
    assert doc["input_lens"] == [16] * 8 and doc["total_input_tokens"] == 128  # token-id prompts: exact
    assert all(len(itls) == 3 for itls in doc["itls"]) and doc["max_concurrency"] == 4
    assert doc["p50_ttft_ms"] <= doc["p99_ttft_ms"] and doc["mean_tpot_ms"] > 0 and doc["request_rate"] == 200
    panels = svg_panels((tmp_path / "out.svg").read_text())  # the plot beside the JSON
    assert list(panels) == ["ttft", "tpot", "itl", "e2el"]
    for name in panels:
        assert marks(panels[name]) == pytest.approx({"p50": doc[f"p50_{name}_ms"], "p99": doc[f"p99_{name}_ms"]}, rel=1e-5)


@pytest.mark.slow
def test_without_the_key_every_request_fails_401(
    server, tokenizer_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    args = ["--base-url", server.url, "--model", SERVED, "--tokenizer", str(tokenizer_folder), "--num-prompts", "8",
            "--random-input-len", "8", "--random-output-len", "2"]  # fmt: skip
    assert serve.main(args) == 1
    out, err = capsys.readouterr()
    assert "Successful requests:                     0" in out and "Failed requests:                         8" in out
    assert "HTTP 401" in err and "invalid_api_key" in err
    # without --model it cannot ask /v1/models either: said, not raised
    assert serve.main(["--base-url", server.url, "--num-prompts", "1"]) == 2
    assert "/v1/models answered 401" in capsys.readouterr().err


@pytest.mark.slow
def test_a_sharegpt_file_on_the_chat_endpoint(
    server, tmp_path: Path, tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    path = sharegpt_file(tmp_path)
    args = ["--base-url", server.url, "--endpoint", "/v1/chat/completions", "--api-key", API_KEY,
            "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3", "--ignore-eos",
            "--save-result", "--result-dir", str(tmp_path), "--no-plot"]  # fmt: skip
    assert serve.main(args) == 0
    (saved,) = tmp_path.glob("pdserve-infqps-tiny-serve-*.json")
    assert list(tmp_path.glob("*.svg")) == []  # --no-plot
    doc = json.loads(saved.read_text())
    asked = [r.expected_output_len for r in datasets.sharegpt_requests(path, tokenizer, 3, None, seed=0)]
    assert doc["completed"] == 3 and doc["endpoint_type"] == "openai-chat"
    assert doc["output_lens"] == asked and doc["total_output_tokens"] == sum(asked)
    assert all(n > 10 for n in doc["input_lens"])  # the chat template's tokens around the question
    assert "Successful requests:                     3" in capsys.readouterr().out
