"""When a dead rank is restarted (pd/rank/restart_policy.py): backoff, and the window's limit."""

from __future__ import annotations

import pytest

from pd.config import ServerConfig
from pd.rank.restart_policy import RestartPolicy


def test_restart_policy_backs_off_and_stops_at_the_window_limit() -> None:
    p = RestartPolicy(max_restarts=3, window_s=600.0, backoff_s=1.0, max_backoff_s=3.0)
    assert [p.next_delay_s(t) for t in (0.0, 10.0, 20.0)] == [1.0, 2.0, 3.0]  # doubling, capped
    assert p.next_delay_s(30.0) is None  # 3 restarts within 600 s: stays down
    assert p.next_delay_s(599.0) is None and p.num_recent(599.0) == 3  # a refusal is not counted
    assert p.next_delay_s(600.0) == 3.0  # the restart at 0 s left the window: 2 recent, backoff 4 capped
    assert p.next_delay_s(5000.0) == 1.0  # a quiet window: the backoff starts over
    assert RestartPolicy(0, 600.0, 1.0, 30.0).next_delay_s(0.0) is None  # 0: never restart
    with pytest.raises(ValueError):
        RestartPolicy(1, 600.0, 10.0, 5.0)
    cfg = ServerConfig.from_argv(["--rank-restart-max", "2", "--rank-restart-backoff-s", "0.5"])
    assert RestartPolicy.of(cfg) == RestartPolicy(2, 600.0, 0.5, 30.0)
    with pytest.raises(ValueError):
        ServerConfig.from_argv(["--rank-restart-backoff-s", "60"])
