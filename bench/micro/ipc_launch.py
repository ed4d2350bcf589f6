"""Where the ipc receiver's copy launch spends host time, and the fused copy+hash kernel's launch
constants, on one GPU: 2 GiB, microseconds of host time per call (launch only) and milliseconds on
the GPU per variant (warps x words per step); also the in-place copy (the ipc default: 128 pages of
16 MiB from shuffled blocks of one pool into shuffled blocks of another, block ids from pinned host
memory as the receiver makes them).

    python bench/micro/ipc_launch.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pdkernels.copy_hash as ch  # noqa: E402
from pdkernels import checksum_gpu  # noqa: E402
from pdkernels.checksum_gpu import Paged, copy_segment, copy_segments, usable  # noqa: E402
from transfer.ipc import TorchCudaIpc, _HostIds  # noqa: E402


def host_us(fn: Callable[[], object], n: int = 20) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def gpu_ms(fn: Callable[[], object], n: int = 7) -> float:
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def main() -> int:
    if not torch.cuda.is_available():
        print("ipc_launch: needs CUDA")
        return 0
    dev = torch.device("cuda")
    src = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    if not usable(dev):
        print("the copy+hash kernel is not usable here")
        return 1
    backend = TorchCudaIpc()
    print(f"event create+record: {host_us(lambda: torch.cuda.Event(enable_timing=True).record()):.1f} us")
    print(f"copy_segment 1 MiB, host: {host_us(lambda: copy_segment(dst[: 1 << 20], src[: 1 << 20])):.1f} us")
    print(f"copy_segment 2 GiB, host: {host_us(lambda: copy_segment(dst, src), 5):.1f} us")
    print(f"copy_segments 2 GiB, host: {host_us(lambda: copy_segments([dst], [src]), 5):.1f} us")
    print(f"backend.copy 2 GiB, host: {host_us(lambda: backend.copy([dst], [src]), 5):.1f} us")
    done = backend.copy([dst], [src])
    done.synchronize()  # type: ignore[attr-defined]
    print(f"segment_sums after the event, host: {host_us(lambda: done.segment_sums()):.1f} us")
    # in place: pool pages into pool pages, the ids made per call as the receiver makes them
    pool_a, pool_b = src.view(-1, 16 << 20), dst.view(-1, 16 << 20)
    order_a, order_b = (torch.randperm(pool_a.shape[0], generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2))

    def in_place() -> object:
        ids = _HostIds(order_a, order_b)
        return backend.copy([Paged(pool_b, ids.take(len(order_b)))], [Paged(pool_a, ids.sender)])

    print(f"backend.copy 2 GiB in place (pages to pages), host: {host_us(in_place, 5):.1f} us")
    # its pieces, each alone (host time of a call, the GPU idle before it)
    stream, cur = torch.cuda.Stream(), torch.cuda.current_stream()
    ids = _HostIds(order_a, order_b)
    paged = [Paged(pool_b, ids.take(len(order_b)))], [Paged(pool_a, ids.sender)]
    moved: dict[int, torch.Tensor] = {}
    sa, sb = checksum_gpu._side(paged[1][0], moved), checksum_gpu._side(paged[0][0], moved)
    assert sa is not None and sb is not None
    sums = torch.empty(2048, dtype=torch.int64, device=dev)
    pieces: list[tuple[str, Callable[[], object]]] = [
        ("stream.wait_stream", lambda: stream.wait_stream(cur)),
        ("set_stream x2", lambda: (torch.cuda.set_stream(stream), torch.cuda.set_stream(cur))),
        ("_HostIds 128+128 (pinned)", lambda: _HostIds(order_a, order_b)),
        ("_side x2 (ids to the device in one copy)", lambda: [checksum_gpu._side(p[0], {}) for p in paged]),
        ("torch.empty sums", lambda: torch.empty(2048, dtype=torch.int64, device=dev)),
        ("_launch (chunk keys + copy_hash + Triton launch)", lambda: checksum_gpu._launch(
            sa.words, sa.num_words, dst=sb.words, page_ids=sa.ids, page_words=sa.page_words, dst_page_ids=sb.ids, out=sums)),
        ("pinned sums + copy to host", lambda: torch.empty(2048, dtype=torch.int64, pin_memory=True).copy_(sums, non_blocking=True)),
        ("event create + record", lambda: torch.cuda.Event().record(stream)),
        ("copy_segments in place", lambda: copy_segments(*paged)),
    ]
    for name, fn in pieces:
        print(f"  piece {name}, host: {host_us(fn, 9):.1f} us", flush=True)
    # TorchCudaIpc.copy's body step by step, as it runs (its side stream, the GPU busy with the copy it
    # launched): where its host time goes beyond copy_segments' (the pieces above, each alone, do not
    # add up to it)
    marks: dict[str, list[float]] = {}
    for _ in range(9):
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        ids = _HostIds(order_a, order_b)
        dst_p, src_p = [Paged(pool_b, ids.take(len(order_b)))], [Paged(pool_a, ids.sender)]
        t.append(time.perf_counter())
        current = torch.cuda.current_stream(dev)
        stream.wait_stream(current)
        t.append(time.perf_counter())
        torch.cuda.set_stream(stream)
        t.append(time.perf_counter())
        got = copy_segments(dst_p, src_p)
        t.append(time.perf_counter())
        assert got is not None
        host = torch.empty(got.sums.shape, dtype=torch.int64, pin_memory=True)
        t.append(time.perf_counter())
        host.copy_(got.sums, non_blocking=True)
        t.append(time.perf_counter())
        event = torch.cuda.Event()
        event.record(stream)
        t.append(time.perf_counter())
        torch.cuda.set_stream(current)
        t.append(time.perf_counter())
        names = ("ids", "wait_stream", "set_stream", "copy_segments", "pinned empty", "copy to host", "event", "set_stream back")
        for n, a, b in zip(names, t, t[1:]):
            marks.setdefault(n, []).append((b - a) * 1e6)
    for n, v in marks.items():
        print(f"  step {n}, host: {statistics.median(v):.1f} us", flush=True)
    print(f"copy+hash 2 GiB in place, GPU: {gpu_ms(lambda: copy_segments(*paged)):.3f} ms")
    print(f"torch copy_ 2 GiB, host: {host_us(lambda: dst.copy_(src), 5):.1f} us")
    print(f"torch copy 2 GiB, GPU: {gpu_ms(lambda: dst.copy_(src)):.3f} ms")
    saved = ch.NUM_WARPS, ch.MAX_BLOCK_WORDS
    for warps in (4, 8, 16):
        for block in (1024, 2048, 4096):
            ch.NUM_WARPS, ch.MAX_BLOCK_WORDS = warps, block
            print(f"copy+hash warps {warps} block {block}: {gpu_ms(lambda: copy_segment(dst, src)):.3f} ms", flush=True)
    ch.NUM_WARPS, ch.MAX_BLOCK_WORDS = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
