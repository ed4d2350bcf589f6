"""The transports' CUDA paths on a real GPU (skipped without one): the checksum on the device against
the CPU's, TCP from and to GPU memory through the pinned staging buffers, and CUDA IPC (and, where the
nixl extra is installed, NIXL's one-sided write) between two processes (a sender in a child process, the
receiver here), twice from the same memory so a stale mapping or a missing ordering event would show as
the first payload arriving again. The tests are plain functions around asyncio.run: the GPU machine need
not have pytest-asyncio."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.handoff import KVLayout, PoolPages, SequenceExport
from pdkernels.checksum import CHUNK_BYTES, GPU_GROUP_CHUNKS, fold
from tests.transfer.support import TOKEN, Sink, make_export, receiver
from transfer.checksum import SegmentHasher, payload_checksum
from transfer.config import TransferConfig, nixl_installed
from transfer.header import HandoffHeader, allocate_payload, payload_segments
from transfer.nccl import nccl_version
from transfer.sender import KVSender

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[2]
# Several 1 MiB TCP chunks per segment (both staging buffers in use, a partial last chunk).
LAYOUT = KVLayout(
    num_full_layers=4, num_swa_layers=2, block_size=32, window=48, num_kv_heads=4, head_dim=64,
    dtype=torch.bfloat16,
)  # fmt: skip
CONFIG = TransferConfig(
    chunk_bytes=CHUNK_BYTES, idle_timeout_s=20.0, handshake_timeout_s=20.0, send_timeout_s=60.0
)


def cuda_export(seed: int, request_id: str, num_prompt: int = 1200) -> SequenceExport:
    exp = make_export(LAYOUT, num_prompt=num_prompt, seed=seed)
    exp.request_id = request_id
    exp.pages = exp.pages.to("cuda", torch.bfloat16)
    exp.state = exp.state.to("cuda", torch.bfloat16) if exp.state is not None else None
    return exp


def host_payload(exp: SequenceExport) -> list[torch.Tensor]:
    return [t.to("cpu", copy=True) for t in payload_segments(exp, LAYOUT)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class CudaSink(Sink):
    """Receives into GPU memory (the CE rank does), on `device`."""

    def __init__(self, *expected: str, device: str = "cuda") -> None:
        super().__init__(*expected)
        self.device = device

    def on_handoff(self, header: HandoffHeader) -> list[torch.Tensor] | None:
        self.offered.append(header.request_id)
        return allocate_payload(header, self.device) if header.request_id in self.expected else None


@pytest.mark.parametrize("nbytes", [8, 4096 + 8, 3 * CHUNK_BYTES + 40, (GPU_GROUP_CHUNKS + 3) * CHUNK_BYTES])
def test_checksum_on_the_gpu_equals_the_cpu(nbytes: int) -> None:
    g = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    assert payload_checksum([data.cuda()]) == payload_checksum([data])
    hasher = SegmentHasher(nbytes)  # in pieces, as a receiver hashes chunks on the way in
    for off in range(0, nbytes, 2 * CHUNK_BYTES):
        hasher.update(data[off : off + 2 * CHUNK_BYTES].cuda())
    assert fold([hasher.result()]) == payload_checksum([data])
    flipped = data.clone()
    flipped[nbytes // 2] ^= 0x80
    assert payload_checksum([flipped.cuda()]) != payload_checksum([data])


def test_pages_in_a_pool_hash_in_one_pass_as_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handoff received in place is verified where its pages lie (scattered blocks, runs of one and
    more): the one-pass kernel's sum equals the gathered pages' and the staged runs' (the CPU's way)."""
    pytest.importorskip("triton")
    from engine.core.kv_cache import KVCache
    from pdkernels import checksum_gpu

    kv = KVCache(LAYOUT, num_blocks=64, num_slots=1, device=torch.device("cuda"))
    kv.pages.copy_(torch.randn(kv.pages.shape, generator=torch.Generator().manual_seed(6)).to(kv.pages))
    ids = [40, 41, 42, 7, 63, 0, 1, *range(10, 30), 5]
    want = payload_checksum([kv.pages[torch.tensor(ids, device="cuda")]])
    assert payload_checksum([PoolPages(kv.pages, ids)]) == want
    assert payload_checksum([PoolPages(kv.pages, ids[3:4])]) == payload_checksum([kv.pages[7:8]])
    calls = []
    monkeypatch.setattr(checksum_gpu, "pages_sum", lambda pool, ids: calls.append(ids))  # the staged runs
    assert payload_checksum([PoolPages(kv.pages, ids)]) == want and calls == [tuple(ids)]


def test_the_one_pass_checksum_kernel_runs_here() -> None:
    pytest.importorskip("triton")
    from pdkernels.checksum_gpu import usable

    assert usable(torch.device("cuda"))  # it built and matched the torch path (else: torch is used)


def test_fused_copy_hash_gathers_and_copies_like_torch() -> None:
    """The export gather (pages of a pool, in a shuffled order; a chunk spans several pages) and the
    ipc receiver's copy, each against torch's copy and the torch checksum path; prints GB/s."""
    pytest.importorskip("triton")
    from engine.core.kv_cache import KVCache
    from pdkernels.checksum import MASK64, as_words, torch_segment_sum
    from pdkernels.checksum_gpu import copy_segment, usable

    dev = torch.device("cuda")
    assert usable(dev)
    kv = KVCache(LAYOUT, num_blocks=300, num_slots=1, device=dev)
    kv.pages.copy_(torch.randn(kv.pages.shape, generator=torch.Generator().manual_seed(3)).to(kv.pages))
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(4))[:237].tolist()
    out = torch.full((237, *kv.pages.shape[1:]), float("nan"), dtype=kv.pages.dtype, device=dev)
    pages, s = kv.read_pages(ids, out=out, with_checksum=True)
    want = kv.pages[torch.tensor(ids, device=dev)]
    assert pages is out and s is not None and torch.equal(pages, want)
    assert int(s) & MASK64 == torch_segment_sum(as_words(want), 0)
    dst = torch.empty_like(want)
    s2 = copy_segment(dst, want)
    assert s2 is not None and int(s2) == int(s) and torch.equal(dst, want)
    # bandwidth: a 1 GiB gather of 1 MiB pages, hashed, against torch's gather (bytes read + written)
    big = torch.empty((1100, 1 << 19), dtype=torch.bfloat16, device=dev).normal_()
    sel = torch.randperm(1100)[:1024].tolist()
    gout = torch.empty((1024, 1 << 19), dtype=torch.bfloat16, device=dev)
    kv_big = KVCache.__new__(KVCache)
    kv_big.pages, kv_big.device = big, dev
    from triton.testing import do_bench

    fused = do_bench(lambda: kv_big.read_pages(sel, out=gout, with_checksum=True), return_mode="median")
    plain = do_bench(lambda: kv_big.read_pages(sel, out=gout), return_mode="median")
    gb = 2 * gout.numel() * 2 / 1e9
    print(
        f"\ngather 1 GiB: fused copy+hash {fused:.3f} ms ({gb / fused * 1e3:.0f} GB/s), torch {plain:.3f} ms ({gb / plain * 1e3:.0f} GB/s)"
    )


@pytest.mark.parametrize("src, dst", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_tcp_moves_gpu_memory_through_pinned_staging(src: str, dst: str) -> None:
    asyncio.run(tcp_round_trip(src, dst))


async def tcp_round_trip(src: str, dst: str) -> None:
    exp = cuda_export(seed=1, request_id="r1")
    want = host_payload(exp)
    if src == "cpu":
        exp.pages, exp.state = want[0], want[1]
    sink = (CudaSink if dst == "cuda" else Sink)("r1", "r2")
    async with receiver(sink, layout=LAYOUT, config=CONFIG) as r:
        sender = KVSender(TOKEN, LAYOUT, config=CONFIG)
        ack = await sender.send(r.address, exp)
        assert ack.payload_bytes == sum(t.numel() * t.element_size() for t in want) > 4 * CHUNK_BYTES
        if src == "cuda":  # the staging buffers are reused: a second handoff of other bytes
            exp.pages.neg_()
            exp.request_id = "r2"
            await sender.send(r.address, exp)
    assert sink.delivered["r1"].pages.device.type == dst
    assert same(host_payload(sink.delivered["r1"]), want)
    if src == "cuda":
        assert same(host_payload(sink.delivered["r2"]), [-want[0], want[1]])


# The child: exports two sequences from one GPU buffer (the second after overwriting it) over ipc.
_SENDER = """
import asyncio, sys, torch
from tests.transfer.test_transfer_gpu import CONFIG, LAYOUT, TOKEN, cuda_export
from dataclasses import replace
from transfer.sender import KVSender

async def main():
    sender = KVSender(TOKEN, LAYOUT, config=replace(CONFIG, transport="ipc"))
    exp = cuda_export(seed=2, request_id="i1")
    a1 = await sender.send({addr!r}, exp)
    exp.pages.neg_()
    exp.state.neg_()
    exp.request_id = "i2"
    a2 = await sender.send({addr!r}, exp)
    print("acks", a1.transport, a2.transport, a1.payload_bytes)

asyncio.run(main())
"""


def test_ipc_between_two_processes() -> None:
    asyncio.run(from_a_child_process("ipc", "cuda:0"))


@pytest.mark.skipif(not nixl_installed(), reason="the nixl extra (pip install 'pdserve[nixl]') is not installed")
@pytest.mark.parametrize("in_place", [False, True], ids=["arena", "in-place"])
def test_nixl_between_two_processes(in_place: bool) -> None:
    """NIXL's UCX backend writes the child's GPU export into the receiver's GPU memory (cuda_ipc on one GPU):
    into its registered landing arena, or in place, into scattered blocks of a GPU KV pool as a decode rank
    receives (the pool registered once, the checksum read where the pages lie)."""
    asyncio.run(from_a_child_process("nixl", "cuda:0", in_place=in_place))


class CudaPoolSink(CudaSink):
    """A decode rank's stand-in with a KV pool on the GPU (transfer.transport.KVPool): each handoff lands
    in place, its pages in its own shuffled blocks of the pool, its state in its own slot."""

    def __init__(self, *expected: str, device: str) -> None:
        super().__init__(*expected, device=device)
        from engine.core.kv_cache import KVCache

        self.kv = KVCache(LAYOUT, num_blocks=96, num_slots=len(expected) + 1, device=torch.device(device))
        self.kv.pages.zero_()
        self.kv.swa.zero_()
        order = torch.randperm(96, generator=torch.Generator().manual_seed(5)).tolist()
        self.blocks = {rid: order[i * 40 : (i + 1) * 40] for i, rid in enumerate(sorted(expected))}
        self.slots = {rid: i + 1 for i, rid in enumerate(sorted(expected))}
        self.receiver: Any = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.kv.pages, self.kv.swa

    def target(self, header: HandoffHeader, hold_s: float) -> list[Any]:
        first, n = header.first_page, header.page_shape[0]
        out: list[Any] = [PoolPages(self.kv.pages, self.blocks[header.request_id][first : first + n])]
        return out + ([self.kv.swa[self.slots[header.request_id]]] if header.has_state else [])

    def on_handoff(self, header: HandoffHeader) -> list[Any] | None:
        self.offered.append(header.request_id)
        if header.request_id not in self.expected:
            return None
        return self.receiver.receive_buffers(header, self.device, self)


async def from_a_child_process(transport: str, device: str, in_place: bool = False) -> None:
    """The child sends two exports (the second from the same memory, overwritten) from its GPU 0 over
    `transport` to a receiver here that allocates on `device` (in_place: lands them in its pool)."""
    want = host_payload(cuda_export(seed=2, request_id="i1"))
    sink = CudaPoolSink("i1", "i2", device=device) if in_place else CudaSink("i1", "i2", device=device)
    async with receiver(sink, layout=LAYOUT, config=CONFIG) as r:
        if isinstance(sink, CudaPoolSink):
            sink.receiver = r
        script = _SENDER.format(addr=r.address).replace('transport="ipc"', f"transport={transport!r}")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 180)
        counters = getattr(r.transports.get(transport), "counters", {})
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    assert f"acks {transport} {transport}".encode() in out, out.decode(errors="replace")[-3000:]
    assert not sink.errors, sink.errors
    assert sink.delivered["i1"].pages.device == torch.device(device)
    if isinstance(sink, CudaPoolSink):
        for rid in ("i1", "i2"):
            got = sink.delivered[rid]
            assert isinstance(got.pages, PoolPages) and got.pages.block_ids == tuple(sink.blocks[rid][: len(got.pages)])
            assert got.state is not None and got.state.data_ptr() == sink.kv.swa[sink.slots[rid]].data_ptr()
        got1, got2 = ([d.pages.gather().cpu(), d.state.cpu()] for d in (sink.delivered["i1"], sink.delivered["i2"]))
        assert same(got1, want) and same(got2, [-t for t in want])
        assert counters["in_place_receives"] == 2 and counters["arena_receives"] == 0, counters
        assert counters["registrations"] == 1, counters  # the pool, once
        return
    assert same(host_payload(sink.delivered["i1"]), want)
    assert same(host_payload(sink.delivered["i2"]), [-t for t in want])


# The child: gathers two exports into its ipc export arena (the second after the first's slices are
# freed, so it reuses them) and sends both; the receiver must open the arena once. The second gather
# is held back on the GPU: its offer goes before it is written, and only the receiver's wait for the
# arena's interprocess event keeps its copy from reading the first export's bytes.
_ARENA_SENDER = """
import asyncio, dataclasses, gc, sys, torch
from tests.transfer.test_transfer_gpu import CONFIG, LAYOUT, TOKEN, cuda_export
from transfer.sender import KVSender

def in_arena(tr, exp, rid):
    pages = tr.allocate(tuple(exp.pages.shape), exp.pages.dtype, torch.device("cuda")).copy_(exp.pages)
    state = tr.allocate(tuple(exp.state.shape), exp.state.dtype, exp.state.device).copy_(exp.state)
    return dataclasses.replace(exp, request_id=rid, pages=pages, state=state)

async def main():
    sender = KVSender(TOKEN, LAYOUT, config=dataclasses.replace(CONFIG, transport="ipc", ipc_arena_gb=64 / 1024))
    tr = sender.transport
    exp = cuda_export(seed=3, request_id="x")
    a1 = await sender.send({addr!r}, in_arena(tr, exp, "a1"))
    gc.collect()
    assert tr.arena.num_used_bytes == 0, tr.arena.num_used_bytes
    exp.pages.neg_()
    exp.state.neg_()
    torch.cuda._sleep(400_000_000)  # the second gather ends ~0.2 s after the offer goes out
    a2 = await sender.send({addr!r}, in_arena(tr, exp, "a2"))
    print("acks", a1.transport, a2.transport, tr.counters)

asyncio.run(main())
"""


def test_ipc_arena_between_two_processes() -> None:
    asyncio.run(ipc_arena_from_a_child_process())


async def ipc_arena_from_a_child_process() -> None:
    from transfer.ipc import IpcTransport

    want = host_payload(cuda_export(seed=3, request_id="x"))
    sink = CudaSink("a1", "a2")
    recv_tr = IpcTransport(CONFIG)
    async with receiver(sink, layout=LAYOUT, config=CONFIG, transports={"ipc": recv_tr}) as r:
        script = _ARENA_SENDER.format(addr=r.address)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        counters = dict(recv_tr.counters)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    assert b"acks ipc ipc" in out and b"'arena_offers': 2, 'event_offers': 2" in out, out.decode(errors="replace")[-3000:]
    assert counters["arena_opens"] == 1 and counters["arena_hits"] == 1
    assert not sink.errors
    assert same(host_payload(sink.delivered["a1"]), want)
    assert same(host_payload(sink.delivered["a2"]), [-t for t in want])


# The child: a PE's KV pool on its GPU, exported once; two exports name their pages where they lie
# (engine.export_sequence(pages_in_place=True)), the second after the pool's pages were overwritten (and
# the overwrite held back on the GPU: only the receiver's wait for the sender's event keeps its copy from
# reading the old bytes). The receiver copies them straight into its own pool's pages.
_POOL_SENDER = """
import asyncio, dataclasses, sys, torch
from engine.core.kv_cache import KVCache
from tests.transfer.test_transfer_gpu import CONFIG, LAYOUT, TOKEN, cuda_export, pool_pages_of
from transfer.sender import KVSender

async def main():
    sender = KVSender(TOKEN, LAYOUT, config=dataclasses.replace(CONFIG, transport="ipc", ipc_arena_gb=64 / 1024))
    tr = sender.transport
    assert sender.exports_pages_in_place
    kv = KVCache(LAYOUT, num_blocks=64, num_slots=1, device=torch.device("cuda"))
    exp = cuda_export(seed=4, request_id="p1")
    ids = pool_pages_of(exp)
    kv.pages[torch.tensor(ids, device="cuda")] = exp.pages

    def in_place(rid):
        pages, pages_sum = kv.pages_in_place(ids, with_checksum=True)
        state = tr.allocate(tuple(exp.state.shape), exp.state.dtype, exp.state.device).copy_(exp.state)
        return dataclasses.replace(exp, request_id=rid, pages=pages, state=state, pages_sum=pages_sum)

    a1 = await sender.send({addr!r}, in_place("p1"))
    torch.cuda._sleep(400_000_000)  # the overwrite ends ~0.2 s after the offer goes out
    kv.pages.neg_()
    exp.state.neg_()
    a2 = await sender.send({addr!r}, in_place("p2"))
    print("acks", a1.transport, a2.transport, tr.counters)

asyncio.run(main())
"""


def pool_pages_of(exp: SequenceExport) -> list[int]:
    """Where the child's pool holds exp's pages: scattered, out of order, runs of one and more."""
    order = torch.randperm(64, generator=torch.Generator().manual_seed(8)).tolist()
    return order[: exp.pages.shape[0]]


def test_ipc_pool_pages_into_the_receivers_pool_between_two_processes() -> None:
    """The default ipc handoff: one device-to-device copy from the sender's pool pages to the receiver's."""
    asyncio.run(ipc_pool_pages_from_a_child_process())


async def ipc_pool_pages_from_a_child_process() -> None:
    from transfer.ipc import IpcTransport

    want = host_payload(cuda_export(seed=4, request_id="p1"))
    sink = CudaPoolSink("p1", "p2", device="cuda:0")
    recv_tr = IpcTransport(CONFIG)
    async with receiver(sink, layout=LAYOUT, config=CONFIG, transports={"ipc": recv_tr}) as r:
        sink.receiver = r
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _POOL_SENDER.format(addr=r.address), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        counters = dict(recv_tr.counters)
    text = out.decode(errors="replace")[-3000:]
    assert proc.returncode == 0, text
    assert "acks ipc ipc" in text and "'pool_offers': 2" in text and "'event_offers': 2" in text, text
    assert counters["pool_opens"] == 1 and counters["in_place_receives"] == 2, counters
    assert not sink.errors, sink.errors
    for rid, sign in (("p1", 1), ("p2", -1)):
        got = sink.delivered[rid]
        assert isinstance(got.pages, PoolPages) and got.pages.pool is sink.kv.pages
        assert got.pages.block_ids == tuple(sink.blocks[rid][: len(got.pages)])
        assert got.state is not None
        assert same([got.pages.gather().cpu(), got.state.cpu()], [sign * t for t in want])


# ---- two GPUs: the PE's GPU 0 to the CE's GPU 1 ----------------------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@two_gpus
@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_gpu0_to_gpu1_between_two_processes(transport: str) -> None:
    """The sender (a child process, GPU 0) hands two sequences to a receiver on GPU 1, the second from
    the same memory overwritten: NCCL's point-to-point (its communicator made on the first handoff and
    reused), or CUDA IPC through peer access."""
    if transport == "nccl" and nccl_version() is None:
        pytest.skip("no NCCL through cupy here")
    asyncio.run(from_a_child_process(transport, "cuda:1"))
