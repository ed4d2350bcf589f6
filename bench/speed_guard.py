"""Speed guard: the key engine rows of this tree against a baseline commit's, timed in one GPU call.

The device machine gets the working tree but no git history, so the baseline (and any other commit to
time) travels as a tarball made here first:

    python bench/speed_guard.py pack 0f646d4 [more commits]     # here: .trees/<sha>.tar.gz (git archive)

and on the GPU, in one call (carry .trees):

    python bench/speed_guard.py compare --baseline 0f646d4      # HEAD (this tree) vs the baseline; exit 1
                                                                # when a row of HEAD is > 3% slower
    python bench/speed_guard.py bisect c1 c2 ... cN --row llama8b:64   # c1 fast, cN slow: which commit?

Every timing is one run of the tree's own engine benchmark (bench/micro/engine_speed.py, or
bench/bench_engine.py in trees before bench/ was sorted), in a process of its own, with the same
arguments: default mode, dummy 8B-shaped weights, decode rows at 1k context (median ms per step of 8,
host work included) and an 8k prefill. `compare` interleaves the trees (round r runs baseline and HEAD
in turn, the order swapped every round) and compares each row's best time over the rounds: a machine's
drift then moves both sides alike. `bisect` times the first and last commits, then halves the list
against the midpoint of their times, and times the commit it names and its parent once more.
The baseline is the last commit whose figures are in bench/RESULTS.md; `bench/device/speed_guard.sh`
is the one device call (the GPU tests' parts and this guard).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TREES = REPO / ".trees"  # ignored by git; carried to the device
# what a tree needs to run its engine benchmark (no tests, no docs, no recorded results)
TREE_PATHS = ("engine", "pdkernels", "transfer", "pd", "bench", "pyproject.toml")
BENCH_SCRIPTS = ("bench/micro/engine_speed.py", "bench/bench_engine.py")
HEAD = "HEAD"  # this working tree, as it is


# ---- here: the trees to time ---------------------------------------------------------------------


def pack(commits: list[str], out: Path) -> list[Path]:
    """Each commit's files that the benchmark needs, as out/<full sha>.tar.gz."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for c in commits:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{c}^{{commit}}"],
                             check=True, capture_output=True, text=True).stdout.strip()
        path = out / f"{sha}.tar.gz"
        if not path.exists():
            present = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", sha],
                                     check=True, capture_output=True, text=True).stdout.split()
            subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar.gz", "-o", str(path), sha,
                            *[p for p in TREE_PATHS if p in present], ":(exclude)bench/results"], check=True)
        print(f"{c}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
        paths.append(path)
    return paths


# ---- on the device: one timing -------------------------------------------------------------------


def tree_root(commit: str, scratch: Path, trees: Path = TREES) -> Path:
    """This tree for HEAD; else the packed commit (a prefix of its sha will do), unpacked once."""
    if commit == HEAD:
        return REPO
    found = sorted(trees.glob(f"{commit}*.tar.gz"))
    if len(found) != 1:
        raise SystemExit(f"{commit}: {len(found)} packed trees match in {trees} (run `pack {commit}` here first)")
    root = scratch / found[0].name.removesuffix(".tar.gz")
    if not root.exists():
        tmp = root.with_suffix(".part")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(found[0]) as tar:
            tar.extractall(tmp, filter="data")
        tmp.rename(root)
    return root


def bench_script(root: Path) -> Path:
    for rel in BENCH_SCRIPTS:
        if (root / rel).exists():
            return root / rel
    raise SystemExit(f"{root}: no engine benchmark ({' or '.join(BENCH_SCRIPTS)})")


def time_rows(commit: str, model: str, batches: list[int], prefill: list[int], args: argparse.Namespace,
              scratch: Path, tag: str) -> dict[str, dict[str, Any]]:
    """One benchmark process of `commit` for one model: {row name: {"ms", "frac"}} (missing rows: absent)."""
    root = tree_root(commit, scratch, args.trees)
    out = scratch / "runs" / tag
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, str(bench_script(root)), "--models", model, "--modes", "default",
           "--batches", ",".join(map(str, batches)), "--contexts", str(args.context),
           "--prefill", ",".join(map(str, prefill)), "--prefill-reps", "2", "--det-batches", "",
           "--det-prefill", "", "--no-hf", "--hicache-gb", "0", "--steps", str(args.steps), "--out", str(out),
           "--tag", "guard"]
    if args.tiny:
        cmd += ["--tiny", "--device", "cpu"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(root), env.get("PYTHONPATH", "")] if p)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=args.run_timeout_s)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    rows: dict[str, dict[str, Any]] = {}
    for f in out.glob("*.json"):
        for r in json.loads(f.read_text()).get("rows", []):
            if r.get("status") != "ok" or r.get("mode") != "default":
                continue
            if r.get("kind") == "decode":
                rows[f"{model} decode b={r['batch']}"] = {"ms": r["ms_per_step"], "frac": r.get("frac_ceiling")}
            elif r.get("kind") == "prefill":
                rows[f"{model} prefill {r['tokens']}"] = {"ms": r["ms"], "frac": r.get("frac_ceiling")}
    print(f"  {commit[:12]:12s} {model}: rc {proc.returncode}, {time.monotonic() - t0:.0f} s: "
          + ", ".join(f"{k.split(' ', 1)[1]} {v['ms']:.2f} ms" for k, v in rows.items()), flush=True)
    if proc.returncode != 0 or not rows:
        print("\n".join(("    " + line) for line in (proc.stdout + proc.stderr).splitlines()[-15:]), flush=True)
    return rows


def parse_model_rows(specs: list[str]) -> list[tuple[str, list[int], list[int]]]:
    """'llama8b:1,64:8192' -> (model, decode batches, prefill lengths); the prefill part may be left out."""
    out = []
    for spec in specs:
        model, _, rest = spec.partition(":")
        batches, _, prefill = rest.partition(":")
        out.append((model, [int(b) for b in batches.split(",") if b], [int(n) for n in prefill.split(",") if n]))
    return out


# ---- compare -------------------------------------------------------------------------------------


def compare(args: argparse.Namespace, scratch: Path) -> int:
    base = args.baseline
    sides = [base, HEAD]
    best: dict[str, dict[str, dict[str, Any]]] = {base: {}, HEAD: {}}
    seen: dict[str, dict[str, list[float]]] = {base: {}, HEAD: {}}
    specs = parse_model_rows(args.rows)
    deadline = time.monotonic() + args.budget_s
    for rnd in range(args.rounds):
        if rnd and time.monotonic() > deadline:
            print(f"round {rnd + 1}: skipped (budget)")
            break
        print(f"round {rnd + 1}", flush=True)
        for model, batches, prefill in specs:
            for side in (sides if rnd % 2 == 0 else sides[::-1]):
                rows = time_rows(side, model, batches, prefill, args, scratch, f"{side[:12]}-{model}-{rnd}")
                for name, r in rows.items():
                    seen[side].setdefault(name, []).append(r["ms"])
                    if name not in best[side] or r["ms"] < best[side][name]["ms"]:
                        best[side][name] = r
    lines, failed = verdicts(best[base], best[HEAD], seen[HEAD], args.tolerance)
    lines.insert(0, f"speed guard: HEAD vs {base[:12]}, {args.rounds} interleaved rounds, best of each; "
                    f"a row fails when HEAD is > {args.tolerance:.0%} slower")
    report(lines, args)
    return 1 if failed else 0


def verdicts(base: dict[str, dict[str, Any]], head: dict[str, dict[str, Any]], head_runs: dict[str, list[float]],
             tolerance: float) -> tuple[list[str], int]:
    """The table of rows (best ms each side) and how many fail: HEAD more than `tolerance` slower than
    the baseline, or no HEAD time where the baseline has one."""
    lines = [f"{'row':28s} | {'baseline ms':>11s} | {'HEAD ms':>9s} | {'HEAD/base':>9s} | {'HEAD of ceiling':>15s} | "
             f"{'all HEAD ms':>20s} | verdict"]
    failed = 0
    names = list(dict.fromkeys([*base, *head]))
    for name in names:
        b, h = base.get(name), head.get(name)
        ratio = "-"
        if b is None or h is None:
            verdict = "FAIL (no HEAD time)" if h is None else "no baseline time"
            failed += h is None
        else:
            r = h["ms"] / b["ms"]
            ratio = f"{r:.3f}"
            verdict = "FAIL" if r > 1 + tolerance else "ok"
            failed += verdict == "FAIL"
        frac = f"{h['frac']:.1%}" if h and h.get("frac") else "-"
        runs = ",".join(f"{x:.2f}" for x in head_runs.get(name, []))
        lines.append(f"{name:28s} | {b['ms'] if b else float('nan'):11.2f} | {h['ms'] if h else float('nan'):9.2f} | "
                     f"{ratio:>9s} | {frac:>15s} | {runs:>20s} | {verdict}")
    lines.append(f"FAILED: {failed} of {len(names)} rows" if failed else f"passed: all {len(names)} rows")
    return lines, failed


# ---- bisect --------------------------------------------------------------------------------------


def first_slow(n: int, timed: Callable[[int], float], names: list[str]) -> tuple[int, int]:
    """(last fast, first slow): indices into n commits in order, the first fast and the last slow: both
    ends timed, then halving against the midpoint of their times (a commit that does not run, NaN, is
    left out); the first slow one and the one before it are timed once more (their figures in the table)."""
    fast, slow = timed(0), timed(n - 1)
    mid = (fast + slow) / 2
    print(f"{names[0][:12]} {fast:.2f} ms, {names[n - 1][:12]} {slow:.2f} ms: threshold {mid:.2f} ms", flush=True)
    lo, hi = 0, n - 1  # lo is fast, hi is slow
    skipped: set[int] = set()
    while True:
        between = [i for i in range(lo + 1, hi) if i not in skipped]
        if not between:
            break
        m = between[len(between) // 2]
        ms = timed(m)
        if ms != ms:  # NaN: the commit did not run
            print(f"  {names[m][:12]} did not run; left out", flush=True)
            skipped.add(m)
            continue
        lo, hi = (m, hi) if ms < mid else (lo, m)
    timed(lo)
    timed(hi)
    return lo, hi


def bisect(args: argparse.Namespace, scratch: Path) -> int:
    commits = args.commits
    (model, batches, _), = parse_model_rows([args.row])
    name = f"{model} decode b={batches[0]}"
    times: dict[int, list[float]] = {}

    def timed(i: int) -> float:
        rows = time_rows(commits[i], model, batches[:1], [], args, scratch, f"bisect-{i}-{len(times.get(i, []))}")
        ms = rows[name]["ms"] if name in rows else float("nan")
        times.setdefault(i, []).append(ms)
        return ms

    lo, hi = first_slow(len(commits), timed, commits)
    lines = [f"bisect {name}: the first slow commit is {commits[hi]} (the last fast one: "
             f"{commits[lo][:12]})",
             f"{'commit':12s} | ms per step (each run)"]
    for i in sorted(times):
        mark = "  <- first slow" if i == hi else ""
        lines.append(f"{commits[i][:12]:12s} | {', '.join(f'{x:.2f}' for x in times[i])}{mark}")
    report(lines, args)
    return 0


def report(lines: list[str], args: argparse.Namespace) -> None:
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"speed_guard_{args.command}.txt").write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="here: commits' trees as .trees/<sha>.tar.gz for the device")
    pk.add_argument("commits", nargs="+")
    pk.add_argument("--trees", type=Path, default=TREES, help="where the tarballs go")
    for name, help_ in (("compare", "HEAD against --baseline, interleaved; exit 1 on a row > --tolerance slower"),
                        ("bisect", "the first slow commit of COMMITS (oldest first; the first fast, the last slow)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--context", type=int, default=1024)
        s.add_argument("--steps", type=int, default=8)
        s.add_argument("--run-timeout-s", type=float, default=180.0, help="one benchmark process")
        s.add_argument("--tiny", action="store_true", help="toy dims on the CPU: a rehearsal of the call")
        s.add_argument("--out", default=os.environ.get("OUT"))
        s.add_argument("--scratch", default="/tmp/speed_guard", help="unpacked trees and each run's output")
        s.add_argument("--trees", type=Path, default=TREES, help="where `pack` put the commits' tarballs")
    cmp_ = sub.choices["compare"]
    cmp_.add_argument("--baseline", required=True, help="a packed commit (a prefix of its sha)")
    cmp_.add_argument("--rows", nargs="+", default=["llama8b:1,64:8192", "hybrid8b:1,64"],
                      help="MODEL:decode batches[:prefill lengths]")
    cmp_.add_argument("--rounds", type=int, default=2)
    cmp_.add_argument("--budget-s", type=float, default=400.0, help="no new round after this long")
    cmp_.add_argument("--tolerance", type=float, default=0.03)
    bis = sub.choices["bisect"]
    bis.add_argument("commits", nargs="+", help="packed commits, oldest first, or HEAD last")
    bis.add_argument("--row", default="llama8b:64", help="MODEL:batch, the decode row to bisect")
    args = p.parse_args(argv)
    if args.command == "pack":
        pack(args.commits, args.trees)
        return 0
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    if args.command == "compare":
        args.baseline = tree_root(args.baseline, scratch, args.trees).name if args.baseline != HEAD else HEAD
        return compare(args, scratch)
    args.commits = [c if c == HEAD else tree_root(c, scratch, args.trees).name for c in args.commits]
    return bisect(args, scratch)


if __name__ == "__main__":
    sys.exit(main())
