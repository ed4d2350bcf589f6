"""A real engine's sequence handed off over TCP on loopback: exported after its prefill on one engine,
imported into a second, decoded there; the tokens must equal an uninterrupted run."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.engine import LLMEngine
from engine.handoff import PoolPages, SequenceExport
from engine.request import SamplingParams
from pd.rank.decode_role import _EnginePool
from tests.engine_utils import small_engine
from transfer.config import TransferConfig, nixl_installed
from transfer.header import HandoffHeader, allocate_payload, model_fingerprint
from transfer.receiver import KVReceiver
from transfer.sender import KVSender

TOKEN = b"test-cluster-token-0123456789"


def prefill_and_export(
    pe: LLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[SequenceExport, list]:
    """What the PE does: prefill, sample the first token, export, free its copy."""
    pe.add_request(rid, prompt, params, use_prefix_cache=False)
    seq = pe.scheduler.find(rid)
    assert seq is not None
    while not seq.output_token_ids:
        pe.step()
    exp = pe.export_sequence(rid)
    logprobs = list(seq.output_logprobs)
    pe.abort(rid)
    pe.step()
    return exp, logprobs


@pytest.mark.parametrize(
    "family, params",
    [
        ("llama", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
        (
            "qwen3_hybrid",
            SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=7, ignore_eos=True, logprobs=2),
        ),
    ],
)
async def test_engine_handoff_continues_like_an_uninterrupted_run(
    tiny_model_dir, family: str, params: SamplingParams
) -> None:
    folder = tiny_model_dir(family)
    pe, ce = small_engine(folder, hicache_gb=0), small_engine(folder, hicache_gb=0)
    model = model_fingerprint(folder)
    prompt = [
        random.Random(1).randrange(3, 500) for _ in range(41)
    ]  # > the hybrid's SWA window (24): the ring wraps

    (reference,) = pe.generate([prompt], params)
    exp, logprobs = prefill_and_export(pe, "h1", prompt, params)
    assert exp.output_token_ids == reference.output_token_ids[:1]

    headers: list[HandoffHeader] = []

    def on_handoff(h: HandoffHeader):
        headers.append(h)
        return (
            allocate_payload(h) if ce.handoffs.can_import(len(h.prompt_token_ids) + len(h.output_token_ids)) else None
        )

    def on_complete(h: HandoffHeader, export: SequenceExport) -> None:
        ce.import_sequence(export)

    config = TransferConfig(idle_timeout_s=10.0)
    async with KVReceiver(TOKEN, ce.layout, on_handoff, on_complete, model=model, config=config) as r:
        ack = await KVSender(TOKEN, pe.layout, model=model, config=config).send(
            r.address, exp, output_logprobs=logprobs
        )
    assert ack.payload_bytes == headers[0].payload_bytes > 0

    tokens: list[int] = []
    while ce.has_unfinished():
        for out in ce.step():
            tokens += out.new_token_ids
    assert tokens == reference.output_token_ids
    assert headers[0].output_logprobs == tuple(logprobs)
    assert (params.logprobs is not None) == bool(logprobs)
    if ce.arch.has_sliding:
        assert headers[0].swa_fill == ce.layout.window and headers[0].state_bytes > 0
    pe.check_idle()
    ce.check_idle()


@pytest.mark.skipif(not nixl_installed(), reason="the nixl extra is not installed")
async def test_engine_handoff_lands_in_place_over_nixl(tiny_model_dir) -> None:
    """Over nixl into a reservation (as a decode rank takes one): the PE writes the pages straight into
    the reservation's own blocks and the SWA ring into its slot; the import copies nothing and the CE
    decodes exactly the uninterrupted run (the hybrid: its ring has wrapped)."""
    folder = tiny_model_dir("qwen3_hybrid")
    pe, ce = small_engine(folder, hicache_gb=0), small_engine(folder, hicache_gb=0)
    model = model_fingerprint(folder)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    prompt = [random.Random(2).randrange(3, 500) for _ in range(41)]
    (reference,) = pe.generate([prompt], params)
    exp, _ = prefill_and_export(pe, "h1", prompt, params)
    ce.handoffs.enqueue("h1", len(prompt) + 1, len(prompt) + params.max_tokens, 30.0)
    assert [g.request_id for g in ce.handoffs.grant()] == ["h1"]
    config = TransferConfig(transport="nixl", idle_timeout_s=10.0)
    delivered: list[SequenceExport] = []

    pool = _EnginePool(ce)  # the decode rank's own adapter of its engine's pool

    def on_handoff(h: HandoffHeader):
        assert ce.handoffs.begin_receive(h.request_id, len(h.prompt_token_ids) + len(h.output_token_ids))
        return r.receive_buffers(h, "cpu", pool)

    def on_complete(h: HandoffHeader, export: SequenceExport) -> None:
        ce.handoffs.landed(h.request_id)
        delivered.append(export)
        ce.import_sequence(export)

    async with KVReceiver(TOKEN, ce.layout, on_handoff, on_complete, model=model, config=config) as r:
        sender = KVSender(TOKEN, pe.layout, model=model, config=config)
        try:
            await sender.send(r.address, exp)
        finally:
            sender.close()
        assert r.transports["nixl"].counters["in_place_receives"] == 1  # type: ignore[attr-defined]
    (got,) = delivered
    seq = ce.scheduler.find("h1")
    assert isinstance(got.pages, PoolPages) and seq is not None
    assert list(got.pages.block_ids) == seq.block_ids[: len(got.pages)]  # the blocks it was written into
    tokens: list[int] = []
    while ce.has_unfinished():
        for out in ce.step():
            tokens += out.new_token_ids
    assert tokens == reference.output_token_ids
    pe.check_idle()
    ce.check_idle()


def test_a_streamed_parts_pages_are_gathered_where_alloc_says(tiny_model_dir) -> None:
    """export_pages(alloc=...): a prefilling sequence's completed pages gathered into the memory alloc
    gives (nixl: its registered export arena, so a part's write registers nothing), equal to a plain gather."""
    eng = small_engine(tiny_model_dir("llama"), hicache_gb=0, max_num_batched_tokens=32)
    eng.add_request("s", list(range(3, 103)), SamplingParams(max_tokens=2), use_prefix_cache=False)
    eng.step()
    eng.step()  # 64 of 100 tokens computed: pages 0-3 complete
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    asked: list[tuple[int, ...]] = []

    def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        asked.append(shape)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return arena[:n].view(dtype).view(shape)

    got = eng.export_pages("s", 1, alloc)
    plain = eng.export_pages("s", 1)
    assert got is not None and plain is not None
    assert got[0].data_ptr() == arena.data_ptr() and asked == [tuple(plain[0].shape)] and plain[0].shape[0] == 3
    assert torch.equal(got[0], plain[0])
    eng.abort("s")
    eng.step()
    eng.check_idle()
