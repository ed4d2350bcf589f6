"""A weight load's progress, in bytes and tensors of the checkpoint: a bar redrawn on stderr when stderr is a
terminal, and a log line every LOAD_LOG_S otherwise (a log file, a pipe, a JSON log), so a large model's
minutes of loading are never silent and a log never fills with carriage returns.

    rank1 weights [#########...........]  47%  7.1/15.0 GiB  136/291 tensors  21 s

A process that is one of several ranks names itself (`configure(label=...)`, from its entry point), so the
bars of ranks sharing one terminal say whose they are; a process logging JSON turns the bar off."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

log = logging.getLogger(__name__)
LOAD_LOG_S = 10.0  # off a terminal: a long weight load logs its progress this often
REDRAW_S = 0.1  # on a terminal: the bar is redrawn at most this often (and once at the end)
BAR_CELLS = 20

_label = ""  # this process's name on its bars ("" for the only rank)
_is_bar_allowed = True


def configure(label: str = "", is_bar_allowed: bool = True) -> None:
    """This process's loads: label prefixes each bar (a rank's name where a server runs several);
    is_bar_allowed False keeps stderr to log lines even on a terminal (a JSON log)."""
    global _label, _is_bar_allowed
    _label, _is_bar_allowed = label, is_bar_allowed


def is_terminal(stream: TextIO | None) -> bool:
    """Whether stream is an open terminal (a closed or absent stream is not)."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _size(num_bytes: int, unit: int) -> str:
    return f"{num_bytes / unit:.1f}"


def _columns(stream: TextIO) -> int:
    """The terminal's width (80 where it cannot tell): a longer line would wrap, and \r would redraw only
    its last row."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):  # no file descriptor (a test's stream), or not a terminal
        return 80


class LoadProgress:
    """Counts a load's bytes and tensors (the checkpoint's, each once) and shows them: a bar when stream
    is a terminal (stream None: sys.stderr, unless configure turned the bar off), a log line every
    LOAD_LOG_S otherwise. close() ends the bar's line; call it however the load ends."""

    def __init__(
        self,
        total_bytes: int,
        total_tensors: int,
        num_files: int,
        stream: TextIO | None = None,
        label: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_bytes, self.total_tensors, self.num_files = total_bytes, total_tensors, num_files
        self.done_bytes = self.done_tensors = self.done_files = 0
        if stream is None and _is_bar_allowed:
            stream = sys.stderr
        self.stream = stream if is_terminal(stream) else None  # None: log lines
        self.label = _label if label is None else label
        self.clock = clock
        self.t0 = self.last_shown = clock()
        self.is_closed = False

    @property
    def is_bar(self) -> bool:
        return self.stream is not None

    def tensors(self, keys: Iterable[str], num_bytes: dict[str, int]) -> Iterator[str]:
        """The keys of one file, each counted as loaded (with its bytes) once the caller's loop body for it
        is done, and the file counted after its last key."""
        for key in keys:
            yield key
            self.advance(num_bytes.get(key, 0))
        self.done_files += 1

    def advance(self, num_bytes: int, num_tensors: int = 1) -> None:
        self.done_bytes += num_bytes
        self.done_tensors += num_tensors
        now = self.clock()
        if now - self.last_shown >= (REDRAW_S if self.is_bar else LOAD_LOG_S):
            self.last_shown = now
            self._show(now)

    def close(self) -> None:
        """The bar's last state and the end of its line (nothing off a terminal: the load logs its time)."""
        if self.is_closed:
            return
        self.is_closed = True
        if self.stream is not None:
            self._draw(self.clock(), end="\n")

    def _show(self, now: float) -> None:
        if self.stream is not None:
            self._draw(now)
        else:
            log.info(
                "weights: %d of %d files, %.1f of %.1f GiB, %d of %d tensors, in %.0f s",
                self.done_files, self.num_files, self.done_bytes / 2**30, self.total_bytes / 2**30,
                self.done_tensors, self.total_tensors, now - self.t0,
            )  # fmt: skip

    def line(self, now: float) -> str:
        """The bar as it reads at time now."""
        share = min(1.0, self.done_bytes / self.total_bytes) if self.total_bytes else 1.0
        filled = int(share * BAR_CELLS)
        unit, unit_name = (2**30, "GiB") if self.total_bytes >= 2**30 else (2**20, "MiB")
        prefix = f"{self.label} " if self.label else ""
        return (
            f"{prefix}weights [{'#' * filled}{'.' * (BAR_CELLS - filled)}] {share * 100:3.0f}%  "
            f"{_size(self.done_bytes, unit)}/{_size(self.total_bytes, unit)} {unit_name}  "
            f"{self.done_tensors}/{self.total_tensors} tensors  {now - self.t0:.0f} s"
        )

    def _draw(self, now: float, end: str = "") -> None:
        assert self.stream is not None
        # \r back to the line's start, \x1b[K clears what a longer earlier line left
        self.stream.write("\r" + self.line(now)[: _columns(self.stream) - 1] + "\x1b[K" + end)
        self.stream.flush()
