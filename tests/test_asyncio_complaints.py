"""The conftest check that fails a test whose servers' logs show an asyncio complaint, shown to see one:
a process started through ServerProcess (as every test server is) drops a failed task unread."""

from __future__ import annotations

import sys

from pd.tools.server_process import ServerProcess
from tests.conftest import asyncio_complaints

DROPS_A_FAILED_TASK = """
import asyncio, gc

async def fails():
    raise RuntimeError("nobody reads this")

async def main():
    asyncio.create_task(fails())
    await asyncio.sleep(0.1)

asyncio.run(main())
gc.collect()
"""


def test_a_task_failure_nobody_read_is_found_in_the_log(tmp_path) -> None:
    asyncio_complaints()  # what earlier tests left is theirs
    proc = ServerProcess(log_path=tmp_path / "drops.log", command=(sys.executable, "-c", DROPS_A_FAILED_TASK))
    proc.start()
    assert proc.proc is not None and proc.proc.wait(60) == 0
    found = asyncio_complaints()
    assert len(found) == 1 and "Task exception was never retrieved" in found[0], found
    assert asyncio_complaints() == []  # each line is reported once
