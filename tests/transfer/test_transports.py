"""The transports' one table (transfer/transports.py): each registered class names itself and declares
its capabilities from it, the flags' names and checks are derived from it, and reading it imports no
transport."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pd.config import TP_TRANSPORTS
from transfer.config import STREAM_TRANSPORTS, TRANSPORT_NAMES, TransferConfig
from transfer.transport import Transport, make_transport, transport_class
from transfer.transports import TRANSPORTS, Capabilities, names_where

ROOT = Path(__file__).resolve().parents[2]
TRANSPORT_MODULES = ("transfer.transport", "transfer.tcp", "transfer.nccl", "transfer.ipc", "transfer.nixl")


@pytest.mark.parametrize("name", list(TRANSPORTS))
def test_each_class_agrees_with_the_table(name: str) -> None:
    reg = TRANSPORTS[name]
    cls = transport_class(name)
    assert issubclass(cls, Transport)
    assert f"{cls.__module__}:{cls.__qualname__}" == reg.cls
    assert cls.name == name
    assert cls.capabilities is reg.capabilities
    # what the class does agrees with what it declares
    assert cls.capabilities.in_place == (cls.receive_buffers is not Transport.receive_buffers)
    assert not cls.writes_parts or cls.capabilities.streams


def test_the_derived_names_are_what_they_were() -> None:
    assert TRANSPORT_NAMES == ("tcp", "nccl", "ipc", "nixl")
    assert STREAM_TRANSPORTS == ("tcp", "nixl") == names_where(lambda c: c.streams)
    assert TP_TRANSPORTS == ("tcp", "nixl") == names_where(lambda c: c.tp_layouts)
    assert names_where(lambda c: c.in_place) == ("ipc", "nixl")
    assert names_where(lambda c: c.device_memory) == ("nccl", "ipc", "nixl")
    assert names_where(lambda c: True) == TRANSPORT_NAMES


def test_the_flags_offer_the_table() -> None:
    fields = {f.name: f for f in dataclasses.fields(TransferConfig)}
    assert fields["transport"].metadata["choices"] == TRANSPORT_NAMES
    assert fields["accept_transports"].metadata["choices"] == TRANSPORT_NAMES
    assert TransferConfig().accept_transports == TRANSPORT_NAMES
    with pytest.raises(ValueError, match="among \\('tcp', 'nccl', 'ipc', 'nixl'\\)"):
        TransferConfig(transport="udp")
    with pytest.raises(ValueError, match="over tcp, nixl; transport is 'ipc'"):
        TransferConfig(transport="ipc", stream="on")


def test_capabilities_are_frozen_and_default_to_nothing() -> None:
    none = Capabilities()
    assert not (none.streams or none.tp_layouts or none.in_place or none.device_memory)
    with pytest.raises(dataclasses.FrozenInstanceError):
        none.streams = True  # type: ignore[misc]


def test_an_unknown_transport_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown transport 'udp'; known: tcp, nccl, ipc, nixl"):
        make_transport("udp", TransferConfig())


def test_the_configs_import_no_transport() -> None:
    """transfer.config and pd.config read the table without importing a transport's module (nor cupy,
    nor NIXL): a fresh interpreter, so what this one imported already does not count."""
    code = (
        "import sys, transfer.config, pd.config; "
        f"print(','.join(m for m in {TRANSPORT_MODULES + ('cupy', 'nixl', 'nixl_cu12', 'nixl_cu13')!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip() == ""
