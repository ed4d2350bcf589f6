"""A P/D pair handing off over NIXL (SmolLM2-135M; `--transport nixl` on the PE, the CE accepting it as
by default): NIXL's UCX backend writes the PE's export into the CE's receive buffers (host memory on
this machine: UCX's shared-memory or TCP transports), and bench/check_pd.py finds the pair's tokens
identical to a single engine's, both --deterministic; a long prompt streams its pages over nixl while
the PE prefills it; then test_pair_faults.py's faults on this pair: an abort
while the PE prefills, the PE's lease running out on a receiver that never acks, an abort while the KV is in
transfer, the PE killed mid-request and restarted. Skipped where the nixl extra is not installed."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import time
import urllib.request
from typing import Any

import aiohttp
import orjson
import pytest

from pd.tools.server_process import PDPair, rank_metrics, signed_headers
from tests.pd.conftest import PE_CHUNK_TOKENS
from tests.pd.disagg import test_pair_faults as faults
from tests.pd.disagg.test_pair_stream import streams_a_long_prompt
from tests.server_fixtures import SMALL_DETERMINISTIC, run_check_pd, serving, wait_pair_idle
from transfer.config import NIXL_MODULES
from transfer.nixl import NixlTransport

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not any(importlib.util.find_spec(m) is not None for m in NIXL_MODULES),
        reason="the nixl extra (pip install 'pdserve[nixl]') is not installed",
    ),
]

ARGS = ("--model", "smollm2-135m-instruct", *SMALL_DETERMINISTIC)


@pytest.fixture(scope="module")
def servers(smollm_servers, tmp_path_factory: pytest.TempPathFactory):
    """The session's single engine (the same model and flags) and a pair whose PE hands off over nixl,
    prefilling in chunks of PE_CHUNK_TOKENS, so a long prompt streams (--kv-stream auto: on for nixl)."""
    ref, _ = smollm_servers
    pe_args = ("--transport", "nixl", "--max-num-batched-tokens", str(PE_CHUNK_TOKENS))
    pair = PDPair(*ARGS, log_dir=tmp_path_factory.mktemp("nixl"), pe_args=pe_args)
    with serving(pair):
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
    # written straight into the reservations' pages: a delta handoff after a held prefix too
    in_place = rank_metrics(pair.ce.port)["pdserve_engine_handoffs_in_place_total"]
    assert in_place == handoffs["nixl"], (in_place, handoffs)


def test_a_long_prompt_streams_over_nixl(servers) -> None:
    """Its pages written one-sided into the CE's buffer for the stream as each chunk completes."""
    streams_a_long_prompt(*servers)


# ---- the pair's faults over nixl (tests/pd/disagg/test_pair_faults.py's, on this pair) ------------------


def stalling_nixl_receiver(pair: PDPair) -> Any:
    return faults.stalling_receiver(pair, faults.stalled(NixlTransport), "nixl")


def test_abort_while_the_pe_prefills(servers) -> None:
    _, pair = servers
    time.sleep(1.5)  # an idle rank's stats are at most a heartbeat (1 s) old
    sent = rank_metrics(pair.pe.port)["pdserve_engine_handoffs_sent_total"]
    s = faults.RawStream(pair.url, [{"role": "user", "content": "Over nixl. " + faults.LONG}], 8, temperature=0)
    faults.wait_for(lambda: faults.pe_has_it(pair), 60, "the PE to take the request")
    s.close()
    faults.idle(pair.ce.port, pair.pe.port)
    time.sleep(1.5)
    assert rank_metrics(pair.pe.port)["pdserve_engine_handoffs_sent_total"] == sent
    assert faults.ask(pair.url)


async def test_pe_lease_expires_on_a_receiver_that_never_acks(servers) -> None:
    """The PE's nixl write lands in the stalled receiver's buffers; no ack comes, the lease (3 s) runs
    out: a 502 timeout, the PE's sequence freed."""
    _, pair = servers
    async with stalling_nixl_receiver(pair) as (r, stall):
        data = orjson.dumps(faults.prefill_body(r.address, 3.0))
        async with aiohttp.ClientSession() as s:
            async with s.post(pair.pe.url + "/prefill", data=data, headers=signed_headers(pair.token, data)) as resp:
                body = await resp.json()
            assert stall.pulling.is_set()
            assert resp.status == 502 and body["error"]["code"] == "timeout", body
    await asyncio.to_thread(faults.idle, pair.pe.port)
    assert rank_metrics(pair.pe.port)["pdserve_engine_handoff_failures_total"] >= 1


async def test_abort_while_the_kv_is_in_transfer(servers) -> None:
    _, pair = servers
    async with stalling_nixl_receiver(pair) as (r, stall):
        data = orjson.dumps(faults.prefill_body(r.address, 600.0))
        async with aiohttp.ClientSession() as s:
            post = asyncio.create_task(
                s.post(pair.pe.url + "/prefill", data=data, headers=signed_headers(pair.token, data))
            )
            await asyncio.wait_for(stall.pulling.wait(), 120)
            await asyncio.to_thread(  # the rank's metrics are as old as its last heartbeat
                faults.wait_for, lambda: rank_metrics(pair.pe.port)["pdserve_engine_num_handoffs_inflight"] == 1, 30,
                "the PE's metrics to show the handoff in flight",
            )
            post.cancel()  # the caller goes away mid-transfer
            with contextlib.suppress(asyncio.CancelledError):
                await post
        await asyncio.to_thread(faults.idle, pair.pe.port)  # the PE freed the sequence without an ack


def test_pe_killed_during_a_request_then_back(servers) -> None:
    """Last in the module: the PE is killed mid-request and restarted; the pair serves over nixl again."""
    ref, pair = servers
    s = faults.RawStream(pair.url, [{"role": "user", "content": "Killed over nixl. " + faults.LONG}], 8, temperature=0)
    faults.wait_for(lambda: faults.pe_has_it(pair), 60, "the PE to take the request")
    assert pair.pe.proc is not None
    os.killpg(pair.pe.proc.pid, signal.SIGKILL)
    resp = s.response()  # an error, not a hang
    assert resp.status in (502, 503), resp.status
    s.close()
    faults.idle(pair.ce.port)
    pair.restart_pe()
    before = _handoffs_by_transport(pair.url).get("nixl", 0)
    assert faults.ask(pair.url, "Back over nixl?") == faults.ask(ref.url, "Back over nixl?")
    assert _handoffs_by_transport(pair.url).get("nixl", 0) == before + 1
    faults.idle(pair.ce.port, pair.pe.port)
