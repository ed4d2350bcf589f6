"""A P/D pair handing off over NIXL (SmolLM2-135M; `--transport nixl` on the PE, the CE accepting it as
by default): NIXL's UCX backend writes the PE's export into the CE's receive buffers (host memory on
this machine: UCX's shared-memory or TCP transports), and bench/check_pd.py finds the pair's tokens
identical to a single engine's, both --deterministic. Skipped where the nixl extra is not installed."""

from __future__ import annotations

import importlib.util
import urllib.request

import pytest

from pd.tools.server_process import PDPair, ServerProcess
from tests.server_fixtures import SMALL_DETERMINISTIC, run_check_pd, serving, wait_pair_idle
from transfer.config import NIXL_MODULES

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not any(importlib.util.find_spec(m) is not None for m in NIXL_MODULES),
        reason="the nixl extra (pip install 'pdserve[nixl]') is not installed",
    ),
]

ARGS = ("--model", "smollm2-135m-instruct", *SMALL_DETERMINISTIC)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("nixl")
    ref = ServerProcess(*ARGS, log_path=logs / "ref.log")
    pair = PDPair(*ARGS, log_dir=logs, pe_args=("--transport", "nixl"))
    with serving(ref, pair):
        yield ref, pair


def _handoffs_by_transport(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve_handoffs_total{"):
            transport = line.split('transport="', 1)[1].split('"', 1)[0]
            out[transport] = out.get(transport, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.timeout(1800)
def test_check_pd_over_nixl(servers, capsys) -> None:
    ref, pair = servers
    # greedy short and long, a conversation (delta handoffs) and conversations at once (writes in flight
    # together); the API's other cases run on the tcp pair (tests/pd/disagg/test_pair_e2e.py)
    only = "chat short greedy,chat long greedy,conversation greedy,concurrent"
    code = run_check_pd(ref, pair, "--concurrency", "4", "--only", only, "--parallel", "4")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "DIFF" not in out and "FAIL" not in out, out
    wait_pair_idle(pair)
    handoffs = _handoffs_by_transport(pair.url)
    assert handoffs.get("nixl", 0) >= 9 and set(handoffs) == {"nixl"}, handoffs
