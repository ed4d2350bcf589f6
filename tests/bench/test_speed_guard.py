"""bench/speed_guard.py on the CPU: a commit packed with git archive, then timed against this tree by the
real benchmark processes (--tiny), the table and the exit code; the verdict and the bisection's search."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import speed_guard

REPO = Path(__file__).resolve().parents[2]


def test_compare_times_a_packed_commit_against_this_tree(tmp_path: Path) -> None:
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True, capture_output=True,
                         text=True).stdout.strip()
    trees = tmp_path / "trees"
    (tarball,) = speed_guard.pack(["HEAD"], trees)
    assert tarball.name == f"{sha}.tar.gz"
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "bench" / "speed_guard.py"), "compare", "--tiny", "--baseline", sha[:10],
           "--trees", str(trees), "--scratch", str(tmp_path / "scratch"), "--out", str(out),
           "--rows", "llama8b:1,4:64", "--rounds", "1", "--tolerance", "100"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (out / "speed_guard_compare.txt").read_text().splitlines()
    rows = {line.split("|")[0].strip(): line for line in table if "|" in line and not line.startswith("row")}
    assert set(rows) == {"llama8b decode b=1", "llama8b decode b=4", "llama8b prefill 64"}
    for line in rows.values():
        cells = [c.strip() for c in line.split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and cells[-1] == "ok", line
    assert table[-1] == "passed: all 3 rows"


def test_verdicts_fail_a_slower_row_and_a_missing_one() -> None:
    base = {"a": {"ms": 10.0, "frac": 0.5}, "b": {"ms": 10.0, "frac": 0.5}, "c": {"ms": 10.0, "frac": 0.5}}
    head = {"a": {"ms": 10.29, "frac": 0.49}, "b": {"ms": 10.31, "frac": 0.48}}
    lines, failed = speed_guard.verdicts(base, head, {"a": [10.29, 10.4]}, 0.03)
    verdict = {line.split("|")[0].strip(): line.split("|")[-1].strip() for line in lines[1:-1]}
    assert verdict == {"a": "ok", "b": "FAIL", "c": "FAIL (no HEAD time)"} and failed == 2
    assert lines[-1] == "FAILED: 2 of 3 rows"


@pytest.mark.parametrize("first_slow, broken", [(1, ()), (5, ()), (9, ()), (6, (5,)), (4, (2, 3))])
def test_bisection_finds_the_first_slow_commit(first_slow: int, broken: tuple[int, ...]) -> None:
    asked: list[int] = []

    def timed(i: int) -> float:
        asked.append(i)
        return math.nan if i in broken else (8.4 if i < first_slow else 10.5)

    lo, hi = speed_guard.first_slow(10, timed, [f"c{i}" for i in range(10)])
    assert hi == first_slow and lo == max(i for i in range(first_slow) if i not in broken)
    assert len(asked) <= 2 + 4 + len(broken) + 2  # both ends, log2 of the rest, the broken ones, the pair again
