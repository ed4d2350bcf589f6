"""CUDA IPC transport: PE and CE on the same host; the receiver copies device to device, no host hop.

The sender puts CUDA IPC handles of its payload tensors in the offer (torch's own sharing:
torch.multiprocessing.reductions.reduce_tensor, the fields re-encoded as plain msgpack values, the
device named by its UUID since the two processes may number GPUs differently). The receiver opens
them, copies into its buffers on a side stream, waits for that copy's event, drops the mapping and
verifies. The sender must keep its tensors alive until the ack, which KVSender.send does by holding
them for the whole call.

As with NCCL, the CUDA calls sit behind a small backend, so the flow runs in CPU tests with a fake.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from transfer.config import TransferConfig
from transfer.errors import TIMEOUT, TRANSPORT, HandoffError
from transfer.handoff import DTYPES, HandoffHeader, dtype_name
from transfer.transport import Transport
from transfer.wire import Channel

POLL_S = 50e-6  # how often a worker thread asks whether the copy is done (a copy takes ~1 ms per GiB)


def host_id() -> str:
    """This machine's boot id (two containers on one host share it), else its hostname."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


class Done(Protocol):
    def done(self) -> bool: ...


class IpcBackend(Protocol):
    def can_carry(self, t: torch.Tensor) -> bool: ...

    def export(self, t: torch.Tensor) -> dict[str, Any]:
        """A handle to t that another process on this host can open (msgpack-able values only)."""

    def open(self, handle: dict[str, Any]) -> torch.Tensor: ...

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Done:
        """Queues dst[i].copy_(src[i]); the returned object says when it has finished."""


def _wait(done: Done, deadline_s: float) -> bool:
    """Polls done in a worker thread (an asyncio sleep on the loop lasts a millisecond at least, as long
    as the copy of a long sequence itself); False once time.monotonic() passes deadline_s."""
    while not done.done():
        if time.monotonic() > deadline_s:
            return False
        time.sleep(POLL_S)
    return True


class _EventDone:
    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())


class TorchCudaIpc:
    """The real backend: torch's CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle underneath)."""

    def can_carry(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def export(self, t: torch.Tensor) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(t)
        (
            _,
            size,
            stride,
            offset,
            _,
            dtype,
            device,
            handle,
            storage_bytes,
            storage_offset,
            _,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = args
        return {
            "size": list(size),
            "stride": list(stride),
            "offset": int(offset),
            "dtype": dtype_name(dtype),
            "device": _device_uuid(int(device)),
            "handle": bytes(handle),
            "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset),
            "ref_handle": bytes(ref_handle),
            "ref_offset": int(ref_offset),
            "event_handle": None if event_handle is None else bytes(event_handle),
            "event_sync": bool(event_sync),
        }

    def open(self, h: dict[str, Any]) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        local = next((i for i in range(torch.cuda.device_count()) if _device_uuid(i) == h["device"]), None)
        if local is None:
            raise HandoffError(
                TRANSPORT, f"the sender's GPU {h['device']} is not visible to this process (use tcp or nccl)"
            )
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"], torch.storage.TypedStorage, DTYPES[h["dtype"]],
            local, h["handle"], h["storage_bytes"], h["storage_offset"], False, h["ref_handle"], h["ref_offset"],
            h["event_handle"], h["event_sync"],
        )  # fmt: skip

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Done:
        device = dst[0].device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the buffers' allocation
        with torch.cuda.stream(stream):
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return _EventDone(event)


def _device_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"index:{index}"


class IpcTransport(Transport):
    name = "ipc"

    def __init__(self, config: TransferConfig, backend: IpcBackend | None = None) -> None:
        super().__init__(config)
        self.backend: IpcBackend = backend or TorchCudaIpc()
        self._host = host_id()

    async def offer(self, ch: Channel, segments: list[torch.Tensor]) -> dict[str, Any]:
        if not all(self.backend.can_carry(t) for t in segments):
            raise HandoffError(TRANSPORT, "the ipc transport needs the payload on a CUDA device")
        return {"host": self._host, "handles": [self.backend.export(t) for t in segments]}

    async def push(self, ch: Channel, segments: list[torch.Tensor], ready: dict[str, Any]) -> None:
        """Nothing to move: the receiver reads the tensors in place (and acks when it has)."""

    async def accept(
        self, ch: Channel, header: HandoffHeader, extra: dict[str, Any], segments: list[torch.Tensor]
    ) -> dict[str, Any]:
        if extra.get("host") != self._host:
            raise HandoffError(
                TRANSPORT, "the ipc transport works only between processes of one host (use tcp or nccl)"
            )
        handles = extra.get("handles")
        if (
            not isinstance(handles, list)
            or len(handles) != len(segments)
            or not all(isinstance(h, dict) for h in handles)
        ):
            raise HandoffError(TRANSPORT, "malformed ipc offer")
        if not all(self.backend.can_carry(t) for t in segments):
            raise HandoffError(TRANSPORT, "the ipc transport needs the receive buffers on a CUDA device")
        return {}

    async def pull(
        self, ch: Channel, header: HandoffHeader, extra: dict[str, Any], segments: list[torch.Tensor]
    ) -> int | None:
        loop = asyncio.get_running_loop()
        try:
            src = await loop.run_in_executor(
                self.executor, lambda: [self.backend.open(h) for h in extra["handles"]]
            )
        except HandoffError:
            raise
        except Exception as e:
            raise HandoffError(TRANSPORT, f"cannot open the sender's CUDA IPC handles: {e}") from None
        try:
            for s, d in zip(src, segments):
                if s.shape != d.shape or s.dtype != d.dtype:
                    raise HandoffError(
                        TRANSPORT,
                        f"ipc tensor {tuple(s.shape)} {s.dtype} != buffer {tuple(d.shape)} {d.dtype}",
                    )
            done = self.backend.copy(segments, src)
            deadline = time.monotonic() + self.config.idle_timeout_s
            if not await loop.run_in_executor(self.executor, _wait, done, deadline):
                raise HandoffError(TIMEOUT, "ipc copy did not finish")
        finally:
            del src  # unmaps the sender's memory once the copy is done
        return None
