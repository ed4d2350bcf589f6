"""Handoff throughput against its ceilings, for a synthetic sequence of an 8B-shaped model.

For each sequence length (tokens), one export of the layout of bench/configs/<layout>.json (bf16,
128-token pages) is handed off to a KVReceiver in a second process, and compared with:
  - raw TCP: the same number of bytes pushed through one plain socket to the same process, which
    recv_into()s them into a reused buffer (no framing, no checksum, no auth): the loopback ceiling;
  - on CUDA, also ipc (the receiver copies from the sender's GPU memory) against a device-to-device
    copy of the same bytes, twice: in place (`ipc`, the default: the sender's pool pages, exported once,
    copied straight into the receiver's pool pages) and `ipc-copy-in` (--ipc-copy-in: the export gathered
    into the sender's arena, copied into a buffer of the receiver's); and tcp from/to GPU memory through
    the pinned staging buffers;
  - where the nixl extra is installed, nixl (a one-sided NIXL/UCX write; UCX_TLS picks the link; each
    end's arena registered once, --nixl-arena-mb, its counters printed at the end), against the raw
    socket from host memory and the device copy from GPU memory, twice: landing in the receiver's
    registered arena (`nixl`, as a --tp CE or --nixl-copy-in), and in place (`nixl-in-place`: written
    straight into shuffled blocks of the receiver's KV pool, registered once, and verified there, as a
    decode rank receives).
Reported per row: milliseconds and GB/s of the whole send (connect, auth, sender checksum, payload,
receiver verify, ack: `handoff`; on a GPU the receiver acks after writing a payload that landed in a
buffer of its own into its KV pool, as a CE's import does), the same with the PE's export before it
(`export+handoff`: the gather, or the hash of pages offered in place), the receiver's payload phase with and without its checksum pass
(`payload+verify`, `payload`: for ipc, opening the handles and the copy), the sender's checksum
pass, and the ratio to the ceiling. Bars: the whole tcp handoff at least 70% of the raw socket, the
whole ipc handoff at least 50% of the device copy and its median at least 60% (`--json` writes rows
and bars).
With the receiver on a second GPU (the default where there are two), nccl is measured too, and the
ceiling of ipc and nccl is a peer copy of the same bytes from the sender's GPU to the receiver's
(`peer copy`); --p2p-gbps names NCCL's own point-to-point rate on that link (bench/nccl_xtray_test.py
--local), which the nccl handoff is then held to (bar: 80%).
Both processes reuse their buffers across repeats (first-touch page faults are not the transport's
cost). Each transport's sender keeps its authenticated connection, as a PE does: the first send opens
it (shown as `new connection` where it happened), the best and the median of the --repeats sends after
it are reported, with the sender's phases and the receiver's (from its ack) of the best.

    python bench/micro/handoff.py                            # 1k, 4k, 8k tokens of llama8b
    python bench/micro/handoff.py --tokens 1024,16384 --layout hybrid8b --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.core.kv_cache import KVCache  # noqa: E402
from engine.core.kv_cache import layout_of as engine_layout_of  # noqa: E402
from engine.handoff import (  # noqa: E402
    KVLayout,
    PoolPages,
    SequenceExport,
)
from engine.models.registry import arch_from_hf
from engine.request import SamplingParams  # noqa: E402
from pdkernels.checksum import as_words, fold, torch_segment_sum
from transfer.checksum import payload_checksum  # noqa: E402
from transfer.config import TransferConfig, nixl_installed  # noqa: E402
from transfer.header import (  # noqa: E402
    HandoffHeader,
    allocate_payload,
    payload_segments,
)
from transfer.nccl import nccl_version  # noqa: E402
from transfer.receiver import KVReceiver  # noqa: E402
from transfer.sender import KVSender  # noqa: E402
from transfer.tcp import byte_view  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOKEN = os.urandom(24).hex().encode()
GB = 1e9


def layout_of(name: str, block_size: int = 128, dtype: torch.dtype = torch.bfloat16) -> KVLayout:
    """The KV layout an engine gives bench/configs/<name>.json (engine/core/kv_cache.py's layout_of: K/V pages,
    or deepseek_v3's latent pages)."""
    from transformers import AutoConfig

    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    return engine_layout_of(arch_from_hf(AutoConfig.for_model(cfg.pop("model_type"), **cfg)), block_size, dtype)


class SyntheticPool:
    """A KV pool (engine/kv_cache.KVCache) holding one sequence of `tokens` prompt tokens (+1 sampled)
    in shuffled blocks, filled with a cheap non-constant pattern, exported as the PE exports it
    (engine.export_sequence: the page gather, hashing the pages on CUDA, into alloc's memory if given; or
    in place, the pages named where they lie and hashed there)."""

    def __init__(self, layout: KVLayout, tokens: int, device: torch.device) -> None:
        self.layout, self.tokens = layout, tokens
        n_pages = math.ceil(tokens / layout.block_size) if layout.num_full_layers else 0
        self.kv = KVCache(layout, n_pages + 8, 1, device)
        self.block_ids = torch.randperm(n_pages + 8, generator=torch.Generator().manual_seed(1))[
            :n_pages
        ].tolist()
        pattern = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=device)
        for t in (self.kv.pages, self.kv.swa):
            b = byte_view(t)
            for off in range(0, b.numel(), pattern.numel()):
                n = min(pattern.numel(), b.numel() - off)
                b[off : off + n].copy_(pattern[:n])
                pattern = pattern.roll(1)

    def gather(self, with_checksum: bool, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        return self.kv.read_pages(self.block_ids, out=out, with_checksum=with_checksum)

    def export(self, alloc: Any = None, request_id: str | None = None, in_place: bool = False) -> SequenceExport:
        """What engine.export_sequence(rid, device=None, alloc=alloc, pages_in_place=in_place) does."""
        kv, n_pages = self.kv, len(self.block_ids)
        pages: torch.Tensor | PoolPages
        if in_place and n_pages:
            pages, pages_sum = kv.pages_in_place(self.block_ids, with_checksum=True)
        else:
            out = alloc((n_pages, *kv.pages.shape[1:]), kv.pages.dtype, kv.device) if alloc and n_pages else None
            pages, pages_sum = self.gather(True, out)
        state = kv.read_state(0) if self.layout.num_swa_layers else None
        if state is not None and alloc is not None:
            st = alloc(tuple(state.shape), state.dtype, state.device)
            state = st.copy_(state) if st is not None else state
        return SequenceExport(
            request_id or f"bench-{self.tokens}", list(range(self.tokens)), [1], self.tokens, SamplingParams(), 0, pages,
            state, pages_sum=pages_sum,
        )  # fmt: skip


def synthetic_export(layout: KVLayout, tokens: int, device: torch.device) -> SequenceExport:
    """An export of `tokens` prompt tokens (+1 sampled), made as the PE makes one."""
    return SyntheticPool(layout, tokens, device).export()


# ---- the receiving process ---------------------------------------------------------------------


def _raw_sink(lst: socket.socket) -> None:
    """Receives `8-byte length + bytes` per connection into one reused buffer; answers one byte."""
    buf = bytearray()
    while True:
        conn, _ = lst.accept()
        with conn:
            (n,) = struct.unpack(">Q", conn.recv(8, socket.MSG_WAITALL))
            if len(buf) < n:
                buf = bytearray(n)
            view, got = memoryview(buf), 0
            while got < n:
                k = conn.recv_into(view[got:n])
                if k == 0:
                    break
                got += k
            conn.sendall(b"k")


def reused_payload(device: str) -> Callable[[HandoffHeader], list[torch.Tensor]]:
    """A receiver's on_handoff that allocates a payload per shape and hands it out again (a benchmark's
    repeats land in the same buffers)."""
    buffers: dict[tuple, list[torch.Tensor]] = {}

    def on_handoff(h: HandoffHeader) -> list[torch.Tensor]:
        key = (h.page_shape, h.state_shape if h.has_state else None)
        if key not in buffers:
            buffers.clear()
            buffers[key] = allocate_payload(h, device)
        return buffers[key]

    return on_handoff


IN_PLACE = "nixl-in-place"
# the senders (and request id prefixes) whose handoffs land in the receiver's pool
LANDS_IN_POOL = (IN_PLACE, "ipc")


class ReceiverPool:
    """The receiving process's KV pool (engine/kv_cache.KVCache's pages and SWA slots), where a handoff
    of LANDS_IN_POOL's lands in place (transfer.transport.KVPool): its pages in blocks of a fixed shuffle of
    the pool (runs of one block, the most scattered a decode rank's pool gets), its state in slot 0."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str) -> None:
        self.kv = KVCache(layout, num_blocks, 1, torch.device(device))
        self.order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2)).tolist()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.kv.pages, self.kv.swa

    def target(self, header: HandoffHeader, hold_s: float) -> list[Any] | None:
        first, n = header.first_page, header.page_shape[0]
        if first + n > len(self.order):
            return None  # larger than the pool: the arena
        out: list[Any] = [PoolPages(self.kv.pages, self.order[first : first + n])]
        return out + ([self.kv.swa[0]] if header.has_state else [])


def receiver_main(
    conn: Any, layout: dict[str, Any], device: str, token: bytes, nixl_arena_mb: int | None, pool_blocks: int
) -> None:
    if torch.device(device).index is not None:  # "cuda" alone: the current device
        torch.cuda.set_device(torch.device(device))
    lst = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_sink, args=(lst,), daemon=True).start()
    reused = reused_payload(device)
    receivers: list[KVReceiver] = []
    kv_layout = KVLayout.from_fields(layout)
    pool = ReceiverPool(kv_layout, pool_blocks, device) if pool_blocks else None

    def on_complete(h: HandoffHeader, exp: SequenceExport) -> None:
        """As a CE's import (its ack goes after it): a payload landed in a buffer of its own is written into
        the pool's pages (the sequence cannot decode before that), on a GPU; one landed in place is there."""
        if pool is None or not isinstance(exp.pages, torch.Tensor) or exp.pages.device.type != "cuda":
            return
        n = exp.pages.shape[0]
        if n and exp.first_page + n <= len(pool.order):
            pool.kv.write_pages(pool.order[exp.first_page : exp.first_page + n], exp.pages)
        if exp.state is not None:
            pool.kv.write_state(0, exp.state)
        torch.cuda.synchronize(exp.pages.device)

    def on_handoff(h: HandoffHeader) -> list[Any]:
        """nixl and ipc: LANDS_IN_POOL's in the pool's pages; nixl's others in slices of its registered
        landing arena (freed after each handoff, so reused), as a CE's; the other transports (and a payload
        larger than the arena): the reused buffers."""
        in_place = pool if h.request_id.rsplit("-", 1)[0] in LANDS_IN_POOL else None
        got = receivers[0].receive_buffers(h, device, in_place)
        return got if got is not None else reused(h)

    async def main() -> None:
        cfg = TransferConfig(idle_timeout_s=120.0, nixl_arena_mb=nixl_arena_mb)
        async with KVReceiver(
            token, kv_layout, on_handoff, on_complete, config=cfg
        ) as r:
            receivers.append(r)
            conn.send((r.port, lst.getsockname()[1]))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
            for name, tr in r.transports.items():  # nixl: payloads in its arena or registered for themselves
                if getattr(tr, "counters", None):
                    print(f"# {name} receiver: {tr.counters}", flush=True)  # type: ignore[attr-defined]

    asyncio.run(main())


# ---- the sending process -----------------------------------------------------------------------


def first_answer(conn: Any, proc: Any, timeout_s: float) -> Any:
    """The receiving process's first message (its ports). Raises, rather than waiting forever, if
    it exits first (its traceback is on stderr) or says nothing within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"the receiving process exited ({proc.exitcode}) before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the receiving process was not ready within {timeout_s:.0f} s")
    return conn.recv()


def raw_send(port: int, host: list[torch.Tensor]) -> float:
    """Seconds to push host's bytes through one plain socket, to the receiver's one byte answer."""
    n = sum(b.numel() for b in host)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(struct.pack(">Q", n))
        for b in host:
            s.sendall(b.numpy().data)
        s.recv(1)
    return time.perf_counter() - t0


def d2d_copy_s(
    segments: list[torch.Tensor], device: torch.device, repeats: int = 5, dst: torch.device | None = None
) -> float:
    """The best of `repeats` device-to-device copies of the payload's bytes (one buffer), by events;
    to another GPU where dst names one (a peer copy, cudaMemcpyPeerAsync once peer access is on)."""
    src = torch.cat([byte_view(t) for t in segments])
    out = torch.empty_like(src, device=dst or device)
    out.copy_(src)
    torch.cuda.synchronize(out.device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, out
    torch.cuda.empty_cache()
    return min(times)


def best(fn: Any, repeats: int) -> Any:
    fn()  # warm-up
    return min((fn() for _ in range(repeats)), key=lambda r: r if isinstance(r, float) else r[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="llama8b", help="a config in bench/configs (llama8b | hybrid8b | deepseek_v3)")
    ap.add_argument("--tokens", default="1024,4096,8192", help="comma-separated sequence lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument(
        "--recv-device",
        default=None,
        help="the receiver's device (default: cuda:1 if present, else the same)",
    )
    ap.add_argument("--json", default=None, help="also write the rows and bars here")
    ap.add_argument(
        "--nixl-arena-mb",
        type=int,
        default=None,
        help="nixl: each end's arena registered once (TransferConfig.nixl_arena_mb; default its default,"
        " 0: every handoff registers its memory)",
    )
    ap.add_argument(
        "--p2p-gbps",
        type=float,
        default=None,
        help="NCCL's point-to-point GB/s between the two GPUs (nccl_xtray_test.py): the nccl handoff's ceiling",
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    recv_device = args.recv_device or (
        "cuda:1" if device.type == "cuda" and torch.cuda.device_count() > 1 else str(device)
    )
    layout = layout_of(args.layout)
    print(f"# {args.layout}: {layout.num_full_layers} full + {layout.num_swa_layers} sliding layers, "
          f"{layout.page_bytes / 2**20:.1f} MiB per {layout.block_size}-token page "
          f"({layout.page_bytes / max(1, layout.num_full_layers * layout.block_size):,.0f} B per token and full layer), SWA state {layout.state_bytes / 2**20:.1f} MiB; "
          f"sender {device}, receiver {recv_device}, torch threads {torch.get_num_threads()}, {os.cpu_count()} cores")  # fmt: skip
    if device.type != "cuda":
        print("# no CUDA: tcp over loopback only (ipc and the device-copy ceiling need a GPU)")

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    token_counts = [int(t) for t in args.tokens.split(",")]
    # the receiver's pool: room for the longest sequence's pages (ipc and nixl-in-place land there)
    in_pool = layout.num_full_layers and (nixl_installed() or device.type == "cuda")
    pool_blocks = math.ceil(max(token_counts) / layout.block_size) + 8 if in_pool else 0
    proc = ctx.Process(
        target=receiver_main,
        args=(child, layout.fields(), recv_device, TOKEN, args.nixl_arena_mb, pool_blocks),
        daemon=True,
    )
    proc.start()
    rows: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    try:
        kv_port, raw_port = first_answer(parent, proc, 120.0)
        addr = f"127.0.0.1:{kv_port}"
        cfg = TransferConfig(send_timeout_s=600.0, idle_timeout_s=120.0)
        senders = {"tcp": KVSender(TOKEN, layout, config=cfg)}
        if device.type == "cuda":  # in place (the default), and the export gathered and landed in a buffer
            senders["ipc"] = KVSender(TOKEN, layout, config=TransferConfig(transport="ipc", send_timeout_s=600.0))
            senders["ipc-copy-in"] = KVSender(
                TOKEN, layout, config=TransferConfig(transport="ipc", send_timeout_s=600.0, ipc_copy_in=True)
            )
        if nixl_installed():  # the nixl extra: UCX picks its transport (shared memory, cuda_ipc, TCP)
            nixl_cfg = TransferConfig(
                transport="nixl", send_timeout_s=600.0, idle_timeout_s=120.0, nixl_arena_mb=args.nixl_arena_mb
            )
            senders["nixl"] = KVSender(TOKEN, layout, config=nixl_cfg)
            if pool_blocks:
                senders[IN_PLACE] = KVSender(TOKEN, layout, config=nixl_cfg)
        peer = torch.device(recv_device) if torch.device(recv_device) != device else None
        if peer is not None and nccl_version() is not None:
            senders["nccl"] = KVSender(
                TOKEN, layout, config=TransferConfig(transport="nccl", send_timeout_s=600.0)
            )
        for tokens in token_counts:
            pool = SyntheticPool(layout, tokens, device)
            rows += measure(pool, layout, senders, addr, raw_port, args.repeats, loop, peer, args.p2p_gbps)
    finally:
        with contextlib.suppress(OSError):  # a receiver that died has closed its end
            parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
        loop.close()
    _print(rows)
    for name, sender in senders.items():  # ipc: whether exports went through the arena or per-tensor handles
        print(f"# {name} sender connections: {sender.counters}")
        if getattr(sender.transport, "counters", None):
            print(f"# {name} sender: {sender.transport.counters}")  # type: ignore[attr-defined]
    checked = bars(rows)
    for b in checked:
        print(
            f"bar {b['tokens']} tokens, {b['what']}: {b['got']:.0%} (need {b['need']:.0%}): {'met' if b['met'] else 'NOT met'}"
        )
    if args.json:
        doc = {
            "device": str(device),
            "receiver": recv_device,
            "nccl": nccl_version(),
            "p2p_gbps": args.p2p_gbps,
            "layout": args.layout,
            "rows": rows,
            "bars": checked,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


def measure(
    pool: SyntheticPool,
    layout: KVLayout,
    senders: dict[str, KVSender],
    addr: str,
    raw_port: int,
    repeats: int,
    loop: asyncio.AbstractEventLoop,
    peer: torch.device | None = None,
    p2p_gbps: float | None = None,
) -> list[dict[str, Any]]:
    """The rows of one sequence length. peer: the receiver's GPU where it is another one."""
    exp = pool.export()
    tokens, nbytes = (
        exp.num_computed,
        sum(t.numel() * t.element_size() for t in payload_segments(exp, layout)),
    )
    device = exp.pages.device
    raw_s, copy_s, ck_s, gather_s, gather_hash_s = _baselines(pool, exp, layout, raw_port, repeats)
    del exp  # the handoffs below export afresh (the ipc arena has room for two)

    def row(
        what: str, s: float, ceiling: str | None = None, ceiling_s: float | None = None
    ) -> dict[str, Any]:
        return dict(
            tokens=tokens, what=what, bytes=nbytes, s=s, ceiling=ceiling, ceiling_s=ceiling_s,
            of_ceiling=ceiling_s / s if ceiling_s else None,
        )  # fmt: skip

    rows = [row("raw tcp socket", raw_s)]
    if copy_s is not None:
        rows.append(row("d2d copy", copy_s))
    # the receiver on another GPU: the link is the device transports' ceiling
    peer_s = d2d_copy_s(payload_segments(pool.export(), layout), device, dst=peer) if peer else None
    if peer_s is not None:
        rows.append(row(f"peer copy {device}->{peer}", peer_s))
    p2p_s = nbytes / (p2p_gbps * GB) if p2p_gbps else None
    rows.append(row(f"checksum ({device.type})", ck_s))
    if device.type == "cuda":  # the torch path, which the one-pass kernel replaces where it matches
        ck_torch_s = best(
            lambda: _timed(lambda: torch_checksum(payload_segments(pool.export(), layout)), device), repeats
        )
        rows.append(row("checksum (torch path)", ck_torch_s))
    # the PE's export gather (pages only), alone and hashing on the way (the sender then hashes nothing)
    rows.append(row("export gather", gather_s, "d2d copy" if copy_s else None, copy_s))
    rows.append(row("export gather+hash", gather_hash_s, "d2d copy" if copy_s else None, copy_s))
    for name, sender in senders.items():
        # the first send opens (and authenticates) the sender's connection, which later sends reuse
        sends = [_ack(loop, sender, addr, pool, name) for _ in range(repeats + 1)]
        acks = [a for _, a, _ in sends]
        first, ack = acks[0], min(acks[1:], key=lambda a: a.elapsed_s)
        if name == "tcp" or (name.startswith("nixl") and device.type != "cuda"):  # host memory: loopback's ceiling
            ceiling, ceiling_s = "raw tcp socket", raw_s
        elif name == "nccl" and p2p_s is not None:
            ceiling, ceiling_s = "nccl p2p", p2p_s
        elif peer_s is not None:
            ceiling, ceiling_s = "peer copy", peer_s
        else:
            ceiling, ceiling_s = "d2d copy", copy_s
        rows.append(row(f"handoff {name}", ack.elapsed_s, ceiling, ceiling_s))
        median = statistics.median(a.elapsed_s for a in acks[1:])
        rows.append(row(f"  handoff {name} (median)", median, ceiling, ceiling_s))
        # with the PE's export before it (a gather, or a hash of the pages in place): the sequence's way
        # from its prefill's end to decodable pages on the CE
        with_export = statistics.median(export_s + a.elapsed_s for _, a, export_s in sends[1:])
        rows.append(row(f"  export+handoff {name} (median)", with_export, ceiling, ceiling_s))
        if not first.reused:
            rows.append(row(f"  handoff {name} (new connection)", first.elapsed_s, ceiling, ceiling_s))
        rows.append(row(f"  payload+verify {name}", ack.recv_s + ack.verify_s, ceiling, ceiling_s))
        rows.append(row(f"  payload {name}", ack.recv_s, ceiling, ceiling_s))
        # the phases of the best send and of the median one (where a slow send's time went)
        mid = sorted(acks[1:], key=lambda a: a.elapsed_s)[(len(acks) - 2) // 2]
        for which, a in (("", ack), (" (median)", mid)):
            for phase, s in a.phases.items():  # the sender's, in order: where the fixed costs go
                rows.append(row(f"    sender {phase} {name}{which}", s))
            for phase, s in a.receiver_phases.items():  # the receiver's steps, in order
                rows.append(row(f"    receiver {phase} {name}{which}", s))
    return rows


def _baselines(
    pool: SyntheticPool, exp: SequenceExport, layout: KVLayout, raw_port: int, repeats: int
) -> tuple[float, float | None, float, float, float]:
    """Seconds of: the raw socket, the d2d copy (CUDA), the payload checksum, the export gather
    alone and with its hash."""
    segments = payload_segments(exp, layout)
    device = segments[0].device
    ck_s = best(lambda: _timed(lambda: payload_checksum(segments), device), repeats)
    host = [byte_view(t).cpu() for t in segments]
    raw_s = best(lambda: raw_send(raw_port, host), repeats)
    host.clear()
    copy_s = d2d_copy_s(segments, device) if device.type == "cuda" else None
    out = torch.empty_like(exp.pages)
    gather_s = best(lambda: _timed(lambda: pool.gather(False, out), device), repeats)
    gather_hash_s = best(lambda: _timed(lambda: _read(pool.gather(True, out)), device), repeats)
    return raw_s, copy_s, ck_s, gather_s, gather_hash_s


def _read(gathered: tuple[torch.Tensor, Any]) -> None:
    """Reads the gather's recorded sum, as the sender's header does (waits for it)."""
    if gathered[1] is not None:
        int(gathered[1])


def torch_checksum(segments: list[torch.Tensor]) -> int:
    return fold([(t.numel() * t.element_size(), torch_segment_sum(as_words(t), 0)) for t in segments])


def _timed(fn: Any, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _ack(
    loop: asyncio.AbstractEventLoop, sender: KVSender, addr: str, pool: SyntheticPool, name: str
) -> tuple[float, Any, float]:
    """One handoff of a fresh export, made as the PE makes it for this sender's transport and finished
    before the handoff's clock starts: the whole send, from sender.send() to the ack (the receiver
    acks after its import), its ack, and the export's own seconds. Its request id starts with the
    sender's name (the receiver lets LANDS_IN_POOL's land in its pool)."""
    device = pool.kv.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    exp = pool.export(sender.export_allocator, f"{name}-{pool.tokens}", sender.exports_pages_in_place)
    if exp.pages_sum is not None:
        int(exp.pages_sum)  # the sender reads it for the header: done when it can
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    export_s = time.perf_counter() - t0
    ack = loop.run_until_complete(sender.send(addr, exp))
    return ack.elapsed_s, ack, export_s


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'tokens':>7} {'MiB':>7}  {'what':<36} {'ms':>9} {'GB/s':>8}  {'of ceiling':<24}")
    for r in rows:
        frac = f"{r['of_ceiling']:.0%} of {r['ceiling']}" if r["of_ceiling"] else ""
        phase = "sender" in r["what"] or "receiver" in r["what"]
        gbs = f"{r['bytes'] / r['s'] / GB:>8.2f}" if not phase and r["s"] > 0 else " " * 8
        print(
            f"{r['tokens']:>7} {r['bytes'] / 2**20:>7.0f}  {r['what']:<36} {r['s'] * 1e3:>9.3f} {gbs}  {frac:<24}"
        )


def bars(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issues' bars, per sequence length: the whole tcp handoff at least 70% of the raw socket,
    the whole ipc handoff at least 50% of the device copy and its median at least 60% (its payload
    phase shown beside it), and
    on two GPUs the nccl handoff at least 80% of NCCL's point-to-point rate (--p2p-gbps)."""
    out = []
    for r in rows:
        checks = (
            ("handoff tcp", 0.7), ("handoff ipc", 0.5), ("  handoff ipc (median)", 0.6), ("  payload+verify ipc", 0.5),
            ("handoff nccl", 0.8),
        )  # fmt: skip
        for what, need in checks:
            if what == "handoff nccl" and r["ceiling"] != "nccl p2p":
                continue  # held to NCCL's own point-to-point rate only (--p2p-gbps)
            if r["what"] == what and r["of_ceiling"] is not None:
                out.append(
                    dict(
                        tokens=r["tokens"],
                        what=what.strip(),
                        need=need,
                        got=r["of_ceiling"],
                        met=r["of_ceiling"] >= need,
                    )
                )
    return out


if __name__ == "__main__":
    sys.exit(main())
