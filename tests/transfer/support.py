"""What the transfer tests share: a small hybrid KV layout and a latent (MLA) one, a synthetic export of
either, the cluster token, and a KVReceiver around a recording sink (a CE stand-in), or one with a KV
pool that handoffs land in place in (PoolSink)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from engine.handoff import KVLayout, PoolPages, SequenceExport
from engine.request import SamplingParams
from transfer.config import TransferConfig
from transfer.errors import HandoffError
from transfer.header import HandoffHeader, allocate_payload
from transfer.receiver import KVReceiver

LAYOUT_SWA = KVLayout(
    num_full_layers=2,
    num_swa_layers=2,
    block_size=16,
    window=24,
    num_kv_heads=2,
    head_dim=8,
    dtype=torch.float32,
)


# DeepSeek-V3's kind of pages at toy size: one latent of kv_lora_rank 32 + rotary 8 per token and layer
LAYOUT_LATENT = KVLayout(
    num_full_layers=3,
    num_swa_layers=0,
    block_size=16,
    window=0,
    num_kv_heads=1,
    head_dim=40,
    dtype=torch.float32,
    page_kind="latent",
)


def make_export(layout: KVLayout = LAYOUT_SWA, num_prompt: int = 37, seed: int = 0) -> SequenceExport:
    g = torch.Generator().manual_seed(seed)
    pages = torch.randn(layout.page_shape(layout.num_pages(num_prompt)), generator=g)
    state = torch.randn(layout.state_shape(), generator=g) if layout.num_swa_layers else None
    params = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=11,
        stop=("\n\n", "END"),
        stop_token_ids=(7,),
        logprobs=2,
    )
    return SequenceExport(
        "req-1",
        list(range(3, 3 + num_prompt)),
        [42],
        num_prompt,
        params,
        1234,
        pages.to(layout.dtype),
        None if state is None else state.to(layout.dtype),
    )


TOKEN = b"test-cluster-token-0123456789"
FAST = TransferConfig(idle_timeout_s=5.0, handshake_timeout_s=5.0, send_timeout_s=20.0)


class Sink:
    """A CE stand-in: expects the request ids it is told to, records what it gets."""

    def __init__(self, *expected: str) -> None:
        self.expected = set(expected)
        self.offered: list[str] = []
        self.delivered: dict[str, SequenceExport] = {}
        self.errors: list[HandoffError] = []
        self.failed = asyncio.Event()

    def on_handoff(self, header: HandoffHeader) -> list[torch.Tensor] | None:
        self.offered.append(header.request_id)
        return allocate_payload(header) if header.request_id in self.expected else None

    def on_complete(self, header: HandoffHeader, export: SequenceExport) -> None:
        self.delivered[header.request_id] = export

    def on_error(self, header: HandoffHeader, err: HandoffError) -> None:
        self.errors.append(err)
        self.failed.set()


def receiver(
    sink: Sink, layout: KVLayout = LAYOUT_SWA, config: TransferConfig = FAST, **kw: Any
) -> KVReceiver:
    return KVReceiver(
        TOKEN, layout, sink.on_handoff, sink.on_complete, on_error=sink.on_error, config=config, **kw
    )


class PoolSink(Sink):
    """A CE stand-in with a KV pool (pages and SWA slots, as engine/core/kv_cache.py lays them out) that lets
    each handoff land in place: its pages in the blocks `blocks` (scattered, out of order), its state in
    slot 1, through KVReceiver.receive_buffers as a decode rank does."""

    def __init__(self, layout: KVLayout, blocks: list[int], *expected: str) -> None:
        super().__init__(*expected)
        self.layout, self.blocks = layout, blocks
        self.pages = torch.zeros(layout.page_shape(16), dtype=layout.dtype)
        self.swa = torch.zeros(layout.state_shape(3), dtype=layout.dtype)
        self.receiver: KVReceiver | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.pages, self.swa

    def target(self, header: HandoffHeader, hold_s: float) -> list:
        first, n = header.first_page, header.page_shape[0]
        out: list = [PoolPages(self.pages, self.blocks[first : first + n])]
        return out + ([self.swa[1]] if header.has_state else [])

    def on_handoff(self, header: HandoffHeader) -> list | None:
        self.offered.append(header.request_id)
        if header.request_id not in self.expected:
            return None
        assert self.receiver is not None
        return self.receiver.receive_buffers(header, "cpu", self)
