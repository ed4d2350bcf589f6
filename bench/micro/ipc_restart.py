"""What a decode engine's mapping of a prefill engine's KV pool (the ipc transport's in-place handoff opens
the PE's pool once and keeps it, transfer/ipc.py) does to the GPU's memory when that PE dies and a new
one starts on the same GPU: does the dead PE's pool stay allocated while the CE keeps it mapped, so that
the new PE cannot allocate its own?

Three processes besides this one (which only watches the GPU's free memory): PE1 allocates a pool of
--fraction of the free memory, fills it and exports it (TorchCudaIpc.export, as ExportedPool does); the
CE opens it (TorchCudaIpc.open, as IpcTransport._open_shared does) and reads it; PE1 is killed (SIGKILL,
as a crash); PE2 then allocates a pool of the same size while the CE still holds the mapping; then the
CE drops its mapping (as IpcTransport.channel_closed does when the dead PE's connections end) and PE3 tries again. Each step's free memory is
printed, and a table at the end.

    python bench/micro/ipc_restart.py [--fraction 0.6]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transfer.ipc import TorchCudaIpc  # noqa: E402

GiB = 2**30


def free_gib() -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / GiB


def pe(nbytes: int, out: Any, hold: Any) -> None:
    """A PE: a pool of nbytes filled with 7s and exported; reports the handle (or the error), then waits."""
    try:
        pool = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pool.fill_(7)
        torch.cuda.synchronize()
        out.put(("ok", TorchCudaIpc().export(pool)))
    except Exception as e:  # out of memory: what the new PE would hit
        out.put(("error", repr(e)[:200]))
        return
    hold.get()


def ce(handle: dict[str, Any], cmds: Any, out: Any) -> None:
    """A CE: opens the pool, then on each command reads it ("read") or drops the mapping ("drop")."""
    t = TorchCudaIpc().open(handle)
    out.put(("opened", int(t[:4096].sum().item())))
    while True:
        cmd = cmds.get()
        if cmd == "read":
            try:
                out.put(("read", int(t[:4096].sum().item())))
            except Exception as e:
                out.put(("read", repr(e)[:200]))
        elif cmd == "drop":
            del t
            gc.collect()
            torch.cuda.ipc_collect()
            torch.cuda.synchronize()
            out.put(("dropped", None))
        else:
            return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fraction", type=float, default=0.6, help="each PE's pool, of the free memory at the start")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("ipc_restart: needs CUDA")
        return 0
    ctx = mp.get_context("spawn")
    rows: list[tuple[str, str]] = []

    def step(what: str, got: Any = "") -> None:
        row = (what, f"{free_gib():.2f} GiB free" + (f"; {got}" if got != "" else ""))
        rows.append(row)
        print(f"{row[0]:55s} {row[1]}", flush=True)

    step("start (this process's context only)")
    nbytes = int(free_gib() * args.fraction * GiB)
    print(f"each PE's pool: {nbytes / GiB:.2f} GiB")
    out1, hold1 = ctx.Queue(), ctx.Queue()
    pe1 = ctx.Process(target=pe, args=(nbytes, out1, hold1))
    pe1.start()
    status, handle = out1.get(timeout=120)
    step("PE1 allocated and exported its pool", status)
    cmds, ce_out = ctx.Queue(), ctx.Queue()
    cep = ctx.Process(target=ce, args=(handle, cmds, ce_out))
    cep.start()
    step("CE opened it", ce_out.get(timeout=120))
    os.kill(pe1.pid, signal.SIGKILL)
    pe1.join()
    time.sleep(2.0)
    step("PE1 killed (SIGKILL), CE still mapping its pool")
    cmds.put("read")
    step("CE reads the dead PE's pool", ce_out.get(timeout=60))
    def new_pe(label: str) -> None:
        """A PE allocating a pool of the same size, reported, then let go."""
        out, hold = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=pe, args=(nbytes, out, hold))
        p.start()
        status, got = out.get(timeout=120)
        step(f"{label} allocates a pool of the same size", status if status == "ok" else got)
        if status == "ok":
            hold.put(None)
        p.join()

    new_pe("PE2")
    cmds.put("drop")
    step("CE dropped its mapping", ce_out.get(timeout=60))
    new_pe("PE3")
    cmds.put("quit")
    cep.join()
    step("all gone")
    print("\n| step | GPU memory, outcome |\n| --- | --- |")
    for what, got in rows:
        print(f"| {what} | {got} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
