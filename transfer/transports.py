"""The KV transports by name: the one table that names each transport, where its class lives and what
it can do.

A *transport* carries a handoff's payload bytes (the header and the control messages always go over the
TCP control connection, wire.py). TRANSPORTS is the one place a transport is registered: its class
names itself by a key of it and reads its capabilities from it, e.g.

    class TcpTransport(Transport):
        name = "tcp"
        capabilities = TRANSPORTS[name].capabilities

(a test checks that every registered class agrees with its entry); make_transport (transfer/transport.py)
imports the class by the path given here, and the flags' choices and checks (transfer/config.py,
pd/config.py) are derived from the table (names_where).

This module imports nothing of the project's and nothing optional: a configuration reads names and
capabilities without importing a transport, whose module may need cupy (nccl), CUDA (ipc) or NIXL
(nixl), none of them needed to import it but all of them heavy or optional.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do: what a configuration may rely on, known without importing its class.
    (How the class runs the protocol to do it, e.g. Transport.writes_parts, stays on the class.)"""

    # A streamed handoff's parts (--kv-stream, wire.py's open / part / final offer) can go over it: a
    # part's pages move as soon as its prefill chunk completes them (Transport.push / pull of that part,
    # or write_part). --kv-stream auto turns streaming on where this is true; on elsewhere is refused.
    streams: bool = False
    # A --tp group (engine/handoff/kv_shards.py: the group's first process re-shards every KV head) may
    # hand off over it at either end (pd/config.py: a PE's --transport, a CE's --accept-transports).
    # A policy as much as a property: it is true for the transports run with --tp groups so far.
    tp_layouts: bool = False
    # Lands a payload straight in the receiver's KV pool, in the reservation's own pages (receive_buffers
    # with the pool: KVPool.target), so the import copies nothing; a transport without it lands in a
    # buffer of its own (or one the receiver allocates) that the import then copies into the pool.
    # Unless its --*-copy-in flag turns it off.
    in_place: bool = False
    # Moves GPU memory to GPU memory without a hop through host memory on either end (a transport
    # without it stages GPU tensors through host buffers, as tcp does through pinned ones).
    device_memory: bool = False


@dataclass(frozen=True)
class Registration:
    """A transport in the table: its class ("module:Class", imported only when it is made) and what it
    can do."""

    cls: str
    capabilities: Capabilities


# THE list of transports, in the order the flags offer them (--accept-transports' default, help texts).
TRANSPORTS: dict[str, Registration] = {
    # tcp: the payload on the control connection (and its data connections, --kv-tcp-streams), from and
    # into the tensors' own host memory or through pinned staging buffers for CUDA tensors; it lands in
    # a buffer the receiver allocates (no receive_buffers), which the import copies into the pool.
    "tcp": Registration("transfer.tcp:TcpTransport", Capabilities(streams=True, tp_layouts=True)),
    # nccl: send/recv on a two-rank communicator, CUDA tensors only, into buffers the receiver allocates.
    "nccl": Registration("transfer.nccl:NcclTransport", Capabilities(device_memory=True)),
    # ipc: PE and CE on one host; the CE copies device to device from the PE's exported pool pages (or
    # arena) straight into the reservation's pages (--ipc-copy-in: into a buffer first).
    "ipc": Registration("transfer.ipc:IpcTransport", Capabilities(in_place=True, device_memory=True)),
    # nixl (the optional extra pdserve[nixl]): the PE writes one-sided into the reservation's pages,
    # registered once (--nixl-copy-in, or a --tp CE: into the landing arena), DRAM or VRAM; its stream's
    # parts are written into the open's buffer before their `part` message.
    "nixl": Registration(
        "transfer.nixl:NixlTransport",
        Capabilities(streams=True, tp_layouts=True, in_place=True, device_memory=True),
    ),
}


def names_where(test: Callable[[Capabilities], bool]) -> tuple[str, ...]:
    """The transports whose capabilities pass test, in the table's order."""
    return tuple(name for name, reg in TRANSPORTS.items() if test(reg.capabilities))
