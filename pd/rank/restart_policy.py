"""When a dead engine rank is started again: exponential backoff, and a limit per sliding window.

The n-th restart within the window (n = 0, 1, ...) waits backoff_s * 2**n, at most max_backoff_s; once
max_restarts restarts lie within the last window_s seconds, the rank is not restarted again (it stays
down, and /health says why). A quiet window forgets older restarts, so the backoff starts over. Times
are the caller's clock (time.monotonic in the server), which keeps this object free of processes and
testable on plain numbers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pd.config import ServerConfig


@dataclass
class RestartPolicy:
    max_restarts: int  # 0: never restart
    window_s: float
    backoff_s: float
    max_backoff_s: float
    _times: deque[float] = field(default_factory=deque, repr=False)  # restarts granted, oldest first

    @classmethod
    def of(cls, cfg: ServerConfig) -> RestartPolicy:
        """A rank's restart policy from the server's flags (one per rank: each counts its own restarts)."""
        return cls(
            cfg.rank_restart_max, cfg.rank_restart_window_s, cfg.rank_restart_backoff_s, cfg.rank_restart_max_backoff_s
        )

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("need window_s > 0 and 0 <= backoff_s <= max_backoff_s")

    def num_recent(self, now_s: float) -> int:
        """Restarts granted within the window that ends at now_s."""
        while self._times and self._times[0] <= now_s - self.window_s:
            self._times.popleft()
        return len(self._times)

    def next_delay_s(self, now_s: float) -> float | None:
        """A death at now_s: the seconds to wait before the restart (which is counted now), or None
        when the window's limit is reached and the rank stays down."""
        n = self.num_recent(now_s)
        if n >= self.max_restarts:
            return None
        self._times.append(now_s)
        return float(min(self.backoff_s * 2.0**n, self.max_backoff_s))

    def describe_limit(self) -> str:
        return f"{self.max_restarts} restarts within {self.window_s:g} s (--rank-restart-max, --rank-restart-window-s)"
