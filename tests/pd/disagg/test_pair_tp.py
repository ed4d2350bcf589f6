"""The P/D handoff between tensor-parallel sizes, through real servers on loopback (CPU, gloo): a PE
at --tp 1 hands off to a CE at --tp 2 over tcp, a PE at --tp 2 to a CE at --tp 1 and to one at --tp 2
over nixl where the extra is installed (the --tp 1 CE takes it in place, into its reservation's pages;
the --tp 2 CE in its arena, then re-sharded), over tcp otherwise. A handoff
carries every KV head of the model and each group's first process re-shards them (engine/handoff/kv_shards.py).
The model: a tiny Gemma 3 (2 KV heads, split at --tp 2; sliding-window layers, whose SWA state travels
per head too) with SmolLM2's tokenizer and chat template. bench/check_pd.py finds each pair's tokens
identical to a single engine at the PE's --tp (the prompt logprobs, which the PE computes, bit for bit),
long prompts, seeded sampling, conversations whose later turns hit the PE's prefix cache and the CE's
decode cache (a delta handoff), and conversations at once; the PEs prefill in small chunks, so the long
prompts' handoffs stream (--kv-stream)."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator

import pytest

from pd.tools.server_process import ServerProcess, free_port, wait_idle
from tests.server_fixtures import SMALL_DETERMINISTIC, serving
from tests.tiny_models import make_servable
from transfer.config import nixl_installed

pytestmark = pytest.mark.slow

TOKEN = "pd-test-cluster-token-0123456789"
# what the handoff between TP sizes changes (the rest of check_pd's cases: tests/pd/disagg/test_pair_e2e.py)
ONLY = "chat seeded sampling,chat prompt_logprobs,conversation greedy,concurrent conversations"
PE2_TRANSPORT = "nixl" if nixl_installed() else "tcp"  # the --tp 2 PE's


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    from engine.checkpoints import resolve_model

    root = tmp_path_factory.mktemp("pair-tp")
    model = str(make_servable("gemma3_hybrid", root / "model", resolve_model("smollm2-135m-instruct")))
    args = ("--model", model, *SMALL_DETERMINISTIC, "--block-size", "16")  # several pages: delta handoffs, cache hits
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": TOKEN}
    env.pop("PDSERVE_CLUSTER_TOKEN_FILE", None)

    def server(name: str, *more: str) -> ServerProcess:
        return ServerProcess(*args, *more, log_path=root / f"{name}.log", env=env)

    s = {"ref1": server("ref1"), "ref2": server("ref2", "--tp", "2")}
    # the PEs prefill in chunks of 64 tokens: a long prompt's handoff streams (--kv-stream), its pages
    # merged from the group's heads after each chunk, from the first page the CE lacks, cache hits included
    chunked = ("--role", "pe", "--max-num-batched-tokens", "64")
    s["pe1"], s["pe2"] = server("pe1", *chunked), server("pe2", *chunked, "--tp", "2", "--transport", PE2_TRANSPORT)
    for name, pe, tp in (("ce12", "pe1", "2"), ("ce21", "pe2", "1"), ("ce22", "pe2", "2")):
        s[name] = server(
            name, "--role", "ce", "--tp", tp, "--accept-transports", "tcp,nixl" if nixl_installed() else "tcp",
            "--prefill-url", s[pe].url, "--kv-port-base", str(free_port()),
        )  # fmt: skip
    with serving(*s.values()):
        yield s


def _metric(port: int, name: str, label: str = "") -> float:
    """A server's sample of name, labels summed (only samples with label, if given, e.g. transport="tcp")."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith((name + "{", name + " ")) and label in line.rsplit(" ", 1)[0]
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pe_tp, ce_tp", [(1, 2), (2, 1), (2, 2)])
def test_check_pd_across_tp_sizes(servers: dict[str, ServerProcess], pe_tp: int, ce_tp: int, capsys) -> None:
    from bench import check_pd

    ref, ce, pe = servers[f"ref{pe_tp}"], servers[f"ce{pe_tp}{ce_tp}"], servers[f"pe{pe_tp}"]
    code = check_pd.main(
        ["--ref", ref.url, "--pd", ce.url, "--max-tokens", "8", "--concurrency", "2", "--only", ONLY, "--parallel", "4"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "DIFF" not in out and "FAIL" not in out and "4/4 cases identical" in out, out
    assert wait_idle(ce.port, timeout_s=60)["pdserve_engine_handoffs_imported_total"] >= 9  # every request of the 4 cases
    assert _metric(ce.port, "pdserve_handoff_skipped_tokens_total") > 0  # the CE group's decode cache
    assert _metric(ce.port, "pdserve_handoff_streamed_pages_total") > 0  # pages sent while the PE prefilled
    assert wait_idle(pe.port, timeout_s=60)["pdserve_engine_cache_hit_tokens_total"] > 0  # the PE group's prefix cache
    handoffs = _metric(ce.port, "pdserve_handoffs_total")
    transport = PE2_TRANSPORT if pe_tp == 2 else "tcp"
    assert _metric(ce.port, "pdserve_handoffs_total", f'transport="{transport}"') == handoffs > 0, transport
    in_place = _metric(ce.port, "pdserve_engine_handoffs_in_place_total")
    assert in_place == (handoffs if transport == "nixl" and ce_tp == 1 else 0)  # a --tp CE re-shards: no
