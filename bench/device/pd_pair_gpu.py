#!/usr/bin/env python3
"""The P/D pair on one GPU machine (one GPU or two), in one go: its GPU checks (transports, handoff, token
identity) and its GPU load run.

Device time is short and every call starts a bare machine, so one script does all of it and always
ends with one summary table, whatever failed on the way:

  model    SmolLM2-135M-Instruct converted here from its GGUF (--gguf, parts joined by '+') into
           $PDSERVE_HOME/models (what `--model smollm2-135m-instruct` resolves to); with no GGUF and
           --fallback-folder (config.json + tokenizer files), that model's shape with random weights
  tests    tests/transfer/test_transfer_gpu.py: the checksum, TCP and CUDA IPC paths on the GPU (in the
           background from the start, collected before the handoff step, or after the check step
           with --handoff-last, which runs the handoff step at the end, alone)
  xtray    bench/nccl_xtray_test.py --local (two GPUs): NCCL's transport and point-to-point rate
           between GPU 0 and GPU 1, torch.distributed's all-reduce bus bandwidth and a peer copy
  handoff  bench/micro/handoff.py: a --handoff-tokens sequence of the llama8b layout over tcp and ipc,
           against the raw socket and the device-copy ceilings measured in the same run; with the
           receiver on a second GPU also nccl, against the xtray step's NCCL rate
  check    a single-engine server and one P/D pair per --transports, all --deterministic and all on
           this GPU (PE and CE as two processes), then bench/check_pd.py against each pair at once
  load     an 8B-shaped dummy model (bench/configs/llama8b.json, SmolLM2's tokenizer and vocabulary)
           as a PE and a CE sharing the GPU, and bench/load/replay.py's synthetic trace against the CE;
           with --load-colocated FLAGS also a single-engine server of that model (e.g. '--dp 2': one
           rank per GPU), and bench/load/compare.py --interleave runs the same trace against both

On two GPUs, --pe-device cuda:0 --ce-device cuda:1 gives each pair's PE and CE a GPU of its own (the
reference servers stay on --ref-device), and --transports may include nccl.

The 8B pair is started with the check step's servers (loading overlaps the checks) and runs its
trace once they are gone. Memory: two 8B processes on one GPU get explicit pools (--load-kv-gb
each): --gpu-memory-utilization sizes a pool as (memory free at start) - (1 - util) x total - peak,
so for two processes starting together the split depends on which one measures first (with 0.9 the
second finds nothing left); a fixed pool per process does not.

Logs and results go to a work folder; --out gets summary.md, summary.json and logs.tgz (everything),
rewritten after each step so a run cut short still returns what it did.

    bench/device/pd_pair_gpu.sh --out $OUT --steps model,check,load --gguf a.part1+a.part2     # on the GPU machine
    python bench/device/pd_pair_gpu.py --tiny --out /tmp/pd_rehearsal                           # CPU rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pd.tools.server_process import PDPair, ServerProcess  # noqa: E402

STEPS = ("model", "tests", "xtray", "handoff", "check", "load")
SMOLLM2 = "smollm2-135m-instruct"
TINY_8B = dict(  # --tiny: the llama8b family at toy size, for a CPU rehearsal of the load step
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16,
)  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    """The step results, the deadline, and the files that go back (rewritten after every step)."""

    def __init__(self, out: Path, work: Path, budget_s: float) -> None:
        self.out, self.work = out, work
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget_s
        self.results: dict[str, dict[str, Any]] = {}
        self.environment: dict[str, Any] = {}

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.monotonic()
        log(f"step {name} ({self.left_s():.0f} s left)")
        try:
            res = {"status": "ok", **fn()}
        except Exception as e:  # a failed step is reported; the next steps still run
            res = {"status": "failed", "error": f"{type(e).__name__}: {e}"[-2000:]}
            log(f"step {name} failed: {res['error']}")
        res["seconds"] = round(time.monotonic() - t0, 1)
        self.results[name] = res
        self.save()

    def save(self) -> None:
        doc = {"environment": self.environment, "steps": self.results}
        (self.work / "summary.json").write_text(json.dumps(doc, indent=2, default=str))
        (self.work / "summary.md").write_text(summary_table(doc))
        self.out.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "summary.md"):
            shutil.copy(self.work / name, self.out / name)
        with tarfile.open(self.out / "logs.tgz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")


def sh(cmd: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None) -> int:
    """Runs cmd with its output in log_path; returns its exit code (124 when it ran out of time)."""
    with log_path.open("ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        try:
            return subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(1.0, timeout_s), cwd=REPO, env=env
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[timed out after {timeout_s:.0f} s]\n".encode())
            return 124


def tail(path: Path, num_lines: int = 3) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(lines[-num_lines:])


# ---- environment and model -----------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """Versions that the numbers depend on (each one best effort)."""
    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    probes: dict[str, Callable[[], Any]] = {
        "gpu": lambda: torch.cuda.get_device_name(0),
        "gpu_count": lambda: torch.cuda.device_count(),
        "gpu_memory_mib": lambda: torch.cuda.get_device_properties(0).total_memory >> 20,
        "cuda": lambda: torch.version.cuda,
        "driver": lambda: subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "nccl_torch": lambda: ".".join(map(str, torch.cuda.nccl.version())),
        "cupy": lambda: __import__("cupy").__version__,
        "nccl_cupy": lambda: (lambda v: f"{v // 10000}.{v // 100 % 100}.{v % 100}")(
            __import__("cupy.cuda.nccl", fromlist=["nccl"]).get_version()
        ),
        "triton": lambda: __import__("triton").__version__,
        "transformers": lambda: __import__("transformers").__version__,
        "alloc_conf": lambda: os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    for name, probe in probes.items():
        if name in ("gpu", "gpu_count", "gpu_memory_mib", "nccl_torch", "driver") and not torch.cuda.is_available():
            continue
        try:
            env[name] = probe()
        except Exception as e:
            env[name] = f"n/a ({type(e).__name__})"
    return env


def prepare_smollm2(gguf: str | None, fallback: Path | None) -> dict[str, Any]:
    """The SmolLM2 checkpoint the check step serves: converted from the GGUF parts, else already
    converted, else the fallback folder's shape with dummy weights."""
    from engine.checkpoints import models_home
    from engine.checkpoints.store import is_converted

    folder = models_home() / SMOLLM2
    parts = [Path(p) for p in gguf.split("+")] if gguf else []
    if is_converted(folder):
        return {"model": SMOLLM2, "folder": str(folder), "weights": "real (already converted)", "flags": []}
    if parts and all(p.exists() for p in parts):
        from engine.checkpoints.convert import gguf_to_hf

        scratch = Path(
            tempfile.mkdtemp(prefix="smollm2-", dir=folder.parent if folder.parent.exists() else None)
        )
        joined = scratch / "smollm2.gguf"
        with joined.open("wb") as f:
            for p in parts:
                with p.open("rb") as src:
                    shutil.copyfileobj(src, f, 1 << 24)
        folder.parent.mkdir(parents=True, exist_ok=True)
        gguf_to_hf(joined, scratch / "hf", log)
        (scratch / "hf").rename(folder)
        shutil.rmtree(scratch, ignore_errors=True)
        num_bytes = sum(p.stat().st_size for p in parts)
        return {
            "model": SMOLLM2,
            "folder": str(folder),
            "weights": f"real (from a {num_bytes / 2**20:.0f} MiB GGUF)",
            "flags": [],
        }
    if fallback is not None and (fallback / "config.json").exists():
        fallback = fallback.resolve()
        return {
            "model": str(fallback),
            "folder": str(fallback),
            "weights": "DUMMY (no GGUF here)",
            "flags": ["--load-format", "dummy"],
        }
    raise FileNotFoundError(f"no GGUF parts ({gguf}) and no fallback folder: cannot serve {SMOLLM2}")


def make_8b_folder(dst: Path, tokenizer_from: Path, tiny: bool) -> Path:
    """bench/configs/llama8b.json with SmolLM2's vocabulary and special ids, and its tokenizer files
    (the server needs a tokenizer and a chat template; the KV layout, what the handoff moves, is the
    8B model's: 32 layers x 8 KV heads x 128)."""
    config = json.loads((REPO / "bench/configs/llama8b.json").read_text())
    small = json.loads((tokenizer_from / "config.json").read_text())
    for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        if k in small:
            config[k] = small[k]
    if tiny:
        config.update(TINY_8B)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in tokenizer_from.iterdir():
        if f.is_file() and f.name != "config.json" and f.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy(f, dst / f.name)
    return dst


# ---- steps ---------------------------------------------------------------------------------------


class Tests:
    """tests/transfer/test_transfer_gpu.py in a child process, started first: it runs beside the model's
    conversion and the servers' start, and is collected before anything that is timed."""

    def __init__(self, run: Run) -> None:
        self.path = run.logs / "tests.log"
        self.log = self.path.open("wb")
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            "tests/transfer/test_transfer_gpu.py",
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)

    def result(self, timeout_s: float) -> dict[str, Any]:
        try:
            rc = self.proc.wait(max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = 124
        self.log.close()
        return {"rc": rc, "result": tail(self.path, 1), **({"status": "failed"} if rc else {})}


def step_xtray(run: Run, sizes: str) -> dict[str, Any]:
    """bench/nccl_xtray_test.py --local: GPU 0 and GPU 1 as two processes."""
    path, js = run.logs / "xtray.log", run.logs / "xtray.json"
    cmd = [sys.executable, "bench/nccl_xtray_test.py", "--local", "--peer", "127.0.0.1:0", "--sizes", sizes]
    rc = sh(cmd + ["--json", str(js)], path, min(180.0, run.left_s()))
    res: dict[str, Any] = {"rc": rc}
    if js.exists():
        res.update(json.loads(js.read_text()))
    if rc or not res.get("nccl_p2p_gbps"):
        res.update(status="failed", error=tail(path, 5))
    return res


def p2p_gbps(run: Run) -> float | None:
    """NCCL's point-to-point rate at the xtray step's largest size, if it ran."""
    rates = run.results.get("xtray", {}).get("nccl_p2p_gbps")
    return rates[-1] if rates else None


def step_handoff(run: Run, tokens: str, repeats: int) -> dict[str, Any]:
    path, js = run.logs / "handoff.log", run.logs / "handoff.json"
    p2p = p2p_gbps(run)
    rc = sh(
        [
            sys.executable,
            "bench/micro/handoff.py",
            "--tokens",
            tokens,
            "--repeats",
            str(repeats),
            "--json",
            str(js),
            *(["--p2p-gbps", f"{p2p:.3f}"] if p2p else []),
        ],
        path,
        min(240.0, run.left_s()),
    )
    res: dict[str, Any] = {"rc": rc}
    if js.exists():
        res.update(json.loads(js.read_text()))
    if rc:
        res.update(status="failed", error=tail(path, 5))
    return res


def device_flag(device: str) -> tuple[str, ...]:
    return () if device == "auto" else ("--device", device)


def pd_pair(args: tuple[str, ...], logs: Path, transport: str, opts: argparse.Namespace) -> PDPair:
    logs.mkdir(parents=True, exist_ok=True)
    pe_args = ("--transport", transport, *device_flag(opts.pe_device))
    return PDPair(*args, log_dir=logs, pe_args=pe_args, ce_args=device_flag(opts.ce_device))


def model_8b_args(run: Run, model: dict[str, Any], opts: argparse.Namespace) -> tuple[str, ...]:
    """The load step's 8B-shaped model and pools, common to its pair and its colocated server."""
    folder = make_8b_folder(run.work / "llama8b-dummy", Path(model["folder"]), opts.tiny)
    return (
        "--model", str(folder), "--load-format", "dummy", "--kv-cache-gb", str(opts.load_kv_gb),
        "--hicache-gb", str(opts.load_hicache_gb), "--max-model-len", str(opts.load_max_model_len),
        "--max-num-seqs", "32",
    )  # fmt: skip


def colocated_server(run: Run, model: dict[str, Any], opts: argparse.Namespace) -> ServerProcess:
    """The load step's single-engine server (--load-colocated's flags, e.g. '--dp 2')."""
    args = (*model_8b_args(run, model, opts), *shlex.split(opts.load_colocated))
    return ServerProcess(*args, log_path=run.logs / "load_colocated.log")


def load_pair(run: Run, model: dict[str, Any], opts: argparse.Namespace, decode_cache: bool = True) -> PDPair:
    args = (*model_8b_args(run, model, opts), "--decode-cache" if decode_cache else "--no-decode-cache")
    logs = run.logs / ("load_pair" if decode_cache else "load_pair_no_decode_cache")
    return pd_pair(args, logs, opts.load_transport, opts)


def wait_all(servers: dict[str, Any], timeout_s: float) -> dict[str, str]:
    """Waits for each server (a pair: both sides) until timeout_s from now; returns name -> 'ready'
    or why it is not."""
    state = {}
    deadline = time.monotonic() + timeout_s
    for name, s in servers.items():
        for proc in [s.pe, s.ce] if isinstance(s, PDPair) else [s]:
            proc.ready_timeout_s = max(5.0, deadline - time.monotonic())
        try:
            s.wait_ready()
            state[name] = "ready"
        except Exception as e:
            state[name] = f"{type(e).__name__}: {str(e)[-600:]}"
            log(f"{name} not ready: {state[name]}")
    return state


def step_check(
    run: Run, model: dict[str, Any], opts: argparse.Namespace, pending: dict[str, Any]
) -> dict[str, Any]:
    """Starts a reference server and a pair per transport (and the load step's pair, so that its
    loading overlaps), then runs check_pd against every pair at once, each against its own reference
    (a reference serving two checkers would be the bottleneck)."""
    args = (
        "--model", model["model"], *model["flags"], "--deterministic", "--max-model-len", "4096",
        "--kv-cache-gb", str(opts.check_kv_gb), "--hicache-gb", "0.5", "--max-num-seqs", "32",
    )  # fmt: skip
    servers: dict[str, Any] = {}
    for t in opts.transports:
        ref_args = (*args, *device_flag(opts.ref_device))
        servers[f"ref_{t}"] = ServerProcess(*ref_args, log_path=run.logs / f"check_ref_{t}.log")
        servers[f"pd_{t}"] = pd_pair(args, run.logs / f"check_pd_{t}", t, opts)
    t0 = time.monotonic()
    for s in servers.values():
        s.start()
    if "load" in opts.steps:
        try:
            pending["load_pair"] = load_pair(run, model, opts).start()
            if opts.load_colocated:
                pending["colocated"] = colocated_server(run, model, opts).start()
        except Exception as e:
            pending["load_pair_error"] = f"{type(e).__name__}: {e}"
    res: dict[str, Any] = {"model": model["weights"], "transports": {}}
    reserve_s = 10 + (opts.load_reserve_s if "load" in opts.steps else 0)
    if opts.handoff_last and "handoff" in opts.steps:
        reserve_s += opts.handoff_reserve_s
    try:
        state = wait_all(servers, min(opts.check_time_s, run.left_s() - reserve_s))
        res["start_s"] = round(time.monotonic() - t0, 1)
        procs = {}
        for t in opts.transports:
            ref, pair = servers[f"ref_{t}"], servers[f"pd_{t}"]
            if state[f"ref_{t}"] != "ready" or state[f"pd_{t}"] != "ready":
                res["transports"][t] = {
                    "status": "failed",
                    "error": f"ref: {state[f'ref_{t}']}; pd: {state[f'pd_{t}']}",
                }
                continue
            cmd = [
                sys.executable, "bench/check_pd.py", "--ref", ref.url, "--pd", pair.url,
                "--max-tokens", str(opts.check_max_tokens), "--concurrency", str(opts.check_concurrency),
                "--timeout-s", "300",
            ]  # fmt: skip
            f = (run.logs / f"check_pd_{t}.log").open("wb")
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
            procs[t] = (p, f, time.monotonic())
        for t, (p, f, started) in procs.items():
            try:
                rc = p.wait(
                    max(1.0, min(opts.check_time_s - (time.monotonic() - t0), run.left_s() - reserve_s))
                )
            except subprocess.TimeoutExpired:
                p.kill()
                rc = 124
            f.close()
            res["transports"][t] = {
                "status": "ok" if rc == 0 else "failed",
                "rc": rc,
                **check_counts(run.logs / f"check_pd_{t}.log", cut=rc == 124),
                "seconds": round(time.monotonic() - started, 1),
                "handoffs": handoff_metrics(servers[f"pd_{t}"]),
            }
    finally:
        for s in servers.values():
            s.stop()
    if len(res["transports"]) < len(opts.transports) or any(
        v["status"] != "ok" for v in res["transports"].values()
    ):
        res["status"] = "failed"
    return res


def check_counts(path: Path, cut: bool) -> dict[str, Any]:
    """check_pd's verdict from its log: cases identical, different, failed (and whether it was cut)."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    n = {k: sum(ln.startswith(k) for ln in lines) for k in ("ok  ", "DIFF", "FAIL")}
    summary = [ln for ln in lines if "cases identical" in ln]
    result = summary[-1] if summary else f"{n['ok  ']} cases identical so far"
    if cut:
        result += " (cut at the time limit)"
    return {"result": result, "num_ok": n["ok  "], "num_diff": n["DIFF"], "num_failed": n["FAIL"]}


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def handoff_metrics(pair: PDPair) -> dict[str, Any]:
    """From the CE's /metrics: handoffs by transport, their bytes and mean duration, those written in
    place (nixl: straight into the reservation's pages), and the mean TTFT phases (the coordinator's split)."""
    out: dict[str, Any] = {}
    try:
        text = metrics_text(pair.ce.port)
    except Exception as e:
        return {"error": repr(e)}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        for key in (
            "pdserve_handoffs_total", "pdserve_handoff_bytes_total", "pdserve_handoff_duration_seconds_sum",
            "pdserve_handoff_duration_seconds_count", "pdserve_ttft_phase_seconds_sum", "pdserve_ttft_phase_seconds_count",
            "pdserve_handoff_skipped_tokens_total", "pdserve_engine_handoffs_in_place_total",
        ):  # fmt: skip
            if name.startswith(key + "{") or name == key:
                label = name[len(key) :]
                sums[key + label] = sums.get(key + label, 0.0) + float(value)
    out["raw"] = sums
    n = sum(v for k, v in sums.items() if k.startswith("pdserve_handoffs_total"))
    b = sum(v for k, v in sums.items() if k.startswith("pdserve_handoff_bytes_total"))
    ds = sum(v for k, v in sums.items() if k.startswith("pdserve_handoff_duration_seconds_sum"))
    sk = sum(v for k, v in sums.items() if k.startswith("pdserve_handoff_skipped_tokens_total"))
    out.update(num_handoffs=n, mean_bytes=b / n if n else None, mean_handoff_ms=1e3 * ds / n if n else None)
    out.update(mean_skipped_tokens=sk / n if n else None)
    out["in_place"] = sum(v for k, v in sums.items() if k.startswith("pdserve_engine_handoffs_in_place_total"))
    phases = {}
    for k, v in sums.items():
        if k.startswith("pdserve_ttft_phase_seconds_sum"):
            phase = k.split('phase="')[1].split('"')[0] if 'phase="' in k else k
            cnt = sums.get(k.replace("_sum", "_count"), 0.0)
            phases[phase] = round(1e3 * v / cnt, 2) if cnt else None
    out["ttft_phase_mean_ms"] = phases
    return out


def step_load(
    run: Run, model: dict[str, Any], opts: argparse.Namespace, pending: dict[str, Any]
) -> dict[str, Any]:
    """The trace against the 8B pair, once per --load-decode-cache value (on, off: the CE keeps each
    turn's pages or not), each with a pair of its own; the first value's result is the step's."""
    if opts.load_colocated:
        return _compare_run(run, model, opts, pending)
    variants = [v.strip() for v in opts.load_decode_cache.split(",") if v.strip()]
    results: dict[str, Any] = {}
    for i, variant in enumerate(variants):
        share = 1.0 / (len(variants) - i)  # the time left, split evenly over the runs left
        results[variant] = _load_run(run, model, opts, pending if i == 0 else {}, variant == "on", share)
    first = dict(results[variants[0]])
    if len(variants) > 1:
        first["variants"] = results
        if any(r.get("status") == "failed" for r in results.values()):
            first["status"] = "failed"
    return first


def _load_run(
    run: Run, model: dict[str, Any], opts: argparse.Namespace, pending: dict[str, Any], decode_cache: bool,
    share: float,
) -> dict[str, Any]:
    if "load_pair_error" in pending:
        raise RuntimeError(pending["load_pair_error"])
    pre = pending.get("load_pair") if decode_cache else None  # the pair started early has the cache on
    if pending.get("load_pair") is not None and pre is None:
        pending["load_pair"].stop()
    pair = pre or load_pair(run, model, opts, decode_cache).start()
    try:
        state = wait_all({"load_pair": pair}, run.left_s() - 20)
        if state["load_pair"] != "ready":
            raise RuntimeError(state["load_pair"])
        out_dir = run.logs / ("load" if decode_cache else "load_no_decode_cache")
        after = opts.handoff_reserve_s if opts.handoff_last and "handoff" in opts.steps else 0.0
        budget = max(30.0, (run.left_s() - 15 - after) * share)  # replay.py's start, warm-up, plots: ~10 s
        grace_s = 15.0
        label = f"pd-{opts.load_transport}-{gpus(opts)}" + ("" if decode_cache else "-no-decode-cache")
        duration_s = min(opts.load_duration_s, budget - grace_s - 10)
        cmd = [
            sys.executable, "bench/load/replay.py", "--url", pair.url, "--concurrency", str(opts.load_concurrency),
            *trace_flags(opts, duration_s, grace_s), "--label", label, "--out", str(out_dir),
        ]  # fmt: skip
        log_name = "load.log" if decode_cache else "load_no_decode_cache.log"
        rc = sh(cmd, run.logs / log_name, budget)
        res: dict[str, Any] = {"rc": rc, "decode_cache": decode_cache, "handoffs": handoff_metrics(pair)}
        results = out_dir / "results.json"
        if results.exists():
            doc = json.loads(results.read_text())
            res["summary"] = doc["runs"][0]["summary"]
            res["trace"] = doc.get("trace")
        if rc:
            res.update(status="failed", error=tail(run.logs / log_name, 5))
        return res
    finally:
        pair.stop()


def gpus(opts: argparse.Namespace) -> str:
    return "2gpu" if opts.pe_device != opts.ce_device and "auto" not in (opts.pe_device, opts.ce_device) else "1gpu"


def trace_flags(opts: argparse.Namespace, duration_s: float, grace_s: float) -> list[str]:
    """bench/load/replay.py's synthetic trace (compare.py takes the same flags)."""
    return [
        "--trace", "synthetic", "--conversations", str(opts.load_conversations), "--turns", str(opts.load_turns),
        "--output-tokens", str(opts.load_output_tokens), "--output-sigma", "0", "--think-s", "0.5",
        "--tool-latency-s", "0.2", "--ignore-eos", "--max-context-tokens", str(opts.load_max_model_len - 256),
        "--duration-s", str(round(duration_s)), "--grace-s", str(grace_s),
        "--slo-ttft-ms", "2000", "--slo-itl-ms", "200",
    ]  # fmt: skip


def _compare_run(
    run: Run, model: dict[str, Any], opts: argparse.Namespace, pending: dict[str, Any]
) -> dict[str, Any]:
    """The trace against the pair and the colocated server, interleaved (bench/load/compare.py: every target
    at one concurrency before the next), both up for the whole run."""
    if "load_pair_error" in pending:
        raise RuntimeError(pending["load_pair_error"])
    pair = pending.get("load_pair") or load_pair(run, model, opts).start()
    colo = pending.get("colocated") or colocated_server(run, model, opts).start()
    try:
        state = wait_all({"load_pair": pair, "colocated": colo}, run.left_s() - 20)
        if any(v != "ready" for v in state.values()):
            raise RuntimeError(str(state))
        out_dir = run.logs / "compare"
        points = [c for c in str(opts.load_concurrency).split(",") if c]
        after = opts.handoff_reserve_s if opts.handoff_last and "handoff" in opts.steps else 0.0
        budget = max(60.0, run.left_s() - 20 - after)
        grace_s = 15.0
        per_run = min(opts.load_duration_s, budget / (2 * len(points)) - grace_s - 8)
        names = (
            f"pd-{opts.load_transport}-{gpus(opts)}",
            "-".join(["colocated", *(a.lstrip("-") for a in shlex.split(opts.load_colocated))]),
        )
        cmd = [
            sys.executable, "bench/load/compare.py", "--target", f"{names[0]}={pair.url}",
            "--target", f"{names[1]}={colo.url}", "--interleave", "--concurrency", ",".join(points),
            *trace_flags(opts, max(10.0, per_run), grace_s), "--out", str(out_dir),
        ]  # fmt: skip
        rc = sh(cmd, run.logs / "compare.log", budget)
        res: dict[str, Any] = {"rc": rc, "handoffs": handoff_metrics(pair), "compare": []}
        results = out_dir / "results.json"
        if results.exists():
            doc = json.loads(results.read_text())
            res["compare"] = [{"label": r["label"], "summary": r["summary"]} for r in doc["runs"]]
            res["trace"] = doc.get("trace")
        if rc:
            res.update(status="failed", error=tail(run.logs / "compare.log", 5))
        return res
    finally:
        pair.stop()
        colo.stop()


# ---- summary -------------------------------------------------------------------------------------


def _f(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def summary_table(doc: dict[str, Any]) -> str:
    env, steps = doc["environment"], doc["steps"]
    lines = [
        "| step | status | result |",
        "| --- | --- | --- |",
    ]
    for name, r in steps.items():
        status = r.get("status", "?")
        if name == "model":
            lines.append(f"| model | {status} | {r.get('weights', r.get('error', ''))} ({r['seconds']} s) |")
        elif name == "tests":
            lines.append(f"| tests | {status} | {r.get('result', r.get('error', ''))} ({r['seconds']} s) |")
        elif name == "handoff":
            for row in r.get("rows", []):
                frac = f"{row['of_ceiling']:.0%} of {row['ceiling']}" if row.get("of_ceiling") else ""
                lines.append(
                    f"| handoff {row['tokens']} tok | {row['what']} | {row['bytes'] / 2**20:.0f} MiB in "
                    f"{row['s'] * 1e3:.2f} ms = {row['bytes'] / row['s'] / 1e9:.2f} GB/s {frac} |"
                )
            if not r.get("rows"):
                lines.append(f"| handoff | {status} | {r.get('error', '')} |")
        elif name == "check":
            lines.append(
                f"| check | {status} | {r.get('model', r.get('error', ''))}, servers up in {r.get('start_s', '-')} s |"
            )
            for t, tr in r.get("transports", {}).items():
                h = tr.get("handoffs", {})
                lines.append(
                    f"| check_pd {t} | {tr['status']} | {tr.get('result', tr.get('error', ''))}, "
                    f"{tr.get('num_diff', '-')} different, {tr.get('num_failed', '-')} failed; "
                    f"{_f(h.get('num_handoffs'), '.0f')} handoffs"
                    + (f" ({h['in_place']:.0f} in place)" if h.get("in_place") else "")
                    + f", mean {_f(h.get('mean_handoff_ms'), '.2f')} ms ({tr.get('seconds', '-')} s) |"
                )
        elif name == "xtray":
            if not r.get("sizes"):
                lines.append(f"| xtray | {status} | {r.get('error', '')} |")
                continue
            lines.append(
                f"| xtray | {status} | NCCL {r.get('nccl_version')}, transport {', '.join(r.get('transport') or []) or '-'} |"
            )
            for i, size in enumerate(r["sizes"]):
                cols = {
                    k: (r.get(f"{k}_gbps") or [None] * len(r["sizes"]))[i]
                    for k in ("nccl_p2p", "allreduce_busbw", "peer_copy", "tcp")
                }
                lines.append(
                    f"| xtray {size >> 20} MiB | GB/s | NCCL p2p {_f(cols['nccl_p2p'], '.1f')}, all-reduce busbw "
                    f"{_f(cols['allreduce_busbw'], '.1f')}, peer copy {_f(cols['peer_copy'], '.1f')}, tcp {_f(cols['tcp'], '.2f')} |"
                )
        elif name == "load" and "compare" in r:
            for c in r["compare"]:
                s = c["summary"]
                lines.append(
                    f"| load {c['label']} | {status} | {s['num_ok']}/{s['num_planned']} ok, {s['num_errors']} errors; "
                    f"TTFT p50/p90/p99 {_f(s['ttft_ms']['p50'], '.0f')}/{_f(s['ttft_ms']['p90'], '.0f')}/"
                    f"{_f(s['ttft_ms'].get('p99'), '.0f')} ms; ITL p50/p99 {_f(s['itl_ms']['p50'], '.1f')}/"
                    f"{_f(s['itl_ms'].get('p99'), '.1f')} ms; ITL p99 in long prefills "
                    f"{_f(s['itl_in_long_prefill_ms'].get('p99'), '.1f')} ms; {_f(s['output_tokens_per_s'], '.1f')} "
                    f"output tok/s; goodput {_f(s.get('goodput_requests_per_s'), '.2f')} req/s ({_f(s.get('goodput_fraction'), '.2f')} of ok) |"
                )
            if not r["compare"]:
                lines.append(f"| load | {status} | {r.get('error', '')} |")
        elif name == "load":
            for tag, v in (r.get("variants") or {"": r}).items():
                what = f"load (decode cache {tag})" if tag else "load"
                s = v.get("summary")
                if not s:
                    lines.append(f"| {what} | {v.get('status', status)} | {v.get('error', '')} |")
                    continue
                lines.append(
                    f"| {what} | {v.get('status', status)} | {s['num_ok']}/{s['num_planned']} ok, {s['num_errors']} errors; "
                    f"TTFT p50/p90 {_f(s['ttft_ms']['p50'], '.0f')}/{_f(s['ttft_ms']['p90'], '.0f')} ms; ITL p50/p90 "
                    f"{_f(s['itl_ms']['p50'], '.1f')}/{_f(s['itl_ms']['p90'], '.1f')} ms; "
                    f"{_f(s['output_tokens_per_s'], '.1f')} output tok/s; cache hit {_f(s['prefix_cache_hit_rate'], '.2f')} |"
                )
                h = v.get("handoffs", {})
                phases = h.get("ttft_phase_mean_ms", {})
                mean_mb = h.get("mean_bytes") / 1e6 if h.get("mean_bytes") else None
                lines.append(
                    f"| {what}: handoffs | | {_f(h.get('num_handoffs'), '.0f')} handoffs, "
                    f"{_f(mean_mb, '.1f')} MB and {_f(h.get('mean_skipped_tokens'), '.0f')} skipped tokens each; "
                    f"TTFT phases (mean ms) {', '.join(f'{k} {x}' for k, x in phases.items())} |"
                )
        else:
            lines.append(f"| {name} | {status} | {r.get('error', '')} |")
    head = ", ".join(f"{k} {v}" for k, v in env.items())
    return f"# P/D on {env.get('gpu_count', 1)} GPU(s)\n\n{head}\n\n" + "\n".join(lines) + "\n"


# ---- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="summary.md, summary.json and logs.tgz go here")
    p.add_argument("--work", type=Path, default=None, help="logs and scratch (default: a temporary folder)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time; steps shrink to fit")
    p.add_argument(
        "--home", type=Path, default=None, help="PDSERVE_HOME for the converted model (default: as set)"
    )
    p.add_argument("--gguf", default=None, help="SmolLM2's GGUF, or its parts joined by '+'")
    p.add_argument(
        "--fallback-folder", type=Path, default=None, help="config + tokenizer: dummy weights if no GGUF"
    )
    p.add_argument("--tiny", action="store_true", help="CPU rehearsal: toy dims for the load step's model")
    p.add_argument("--handoff-tokens", default="16384")
    p.add_argument("--handoff-repeats", type=int, default=3)
    p.add_argument(
        "--handoff-last",
        action="store_true",
        help="the handoff step after the load step (tests then overlap the servers' start)",
    )
    p.add_argument(
        "--handoff-reserve-s",
        type=float,
        default=40.0,
        help="with --handoff-last: time the load step leaves it",
    )
    p.add_argument("--transports", default="tcp,ipc", help="one P/D pair each in the check step (tcp, ipc, nccl)")
    p.add_argument("--pe-device", default="auto", help="every pair's PE (auto: the GPU its rank picks)")
    p.add_argument("--ce-device", default="auto", help="every pair's CE (cuda:1: a GPU of its own)")
    p.add_argument("--ref-device", default="auto", help="the check step's single-engine servers")
    p.add_argument("--xtray-sizes", default="1M,16M,256M,1G", help="the xtray step's message sizes")
    p.add_argument("--check-max-tokens", type=int, default=12)
    p.add_argument("--check-concurrency", type=int, default=8)
    p.add_argument("--check-kv-gb", type=float, default=2.0)
    p.add_argument(
        "--check-time-s", type=float, default=240.0, help="the check step at most (start included)"
    )
    p.add_argument(
        "--load-reserve-s", type=float, default=90.0, help="time the check step leaves the load step"
    )
    p.add_argument("--load-transport", default="ipc")
    p.add_argument("--load-kv-gb", type=float, default=24.0, help="KV pool of each 8B process")
    p.add_argument("--load-hicache-gb", type=float, default=2.0)
    p.add_argument(
        "--load-decode-cache", default="on",
        help="on, off or on,off: the CE keeps each turn's KV pages (--decode-cache) or not; one run each",
    )  # fmt: skip
    p.add_argument("--load-max-model-len", type=int, default=8192)
    p.add_argument("--load-conversations", type=int, default=6)
    p.add_argument("--load-turns", type=int, default=3)
    p.add_argument(
        "--load-concurrency", default="4", help="conversations at once (with --load-colocated: a list)"
    )
    p.add_argument(
        "--load-colocated", default="",
        help="flags of a single-engine server of the 8B model to compare with, interleaved ('--dp 2')",
    )  # fmt: skip
    p.add_argument("--load-output-tokens", type=int, default=32)
    p.add_argument("--load-duration-s", type=float, default=90.0)
    args = p.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    args.transports = [t for t in args.transports.split(",") if t]
    if bad := [s for s in args.steps if s not in STEPS]:
        p.error(f"unknown steps {bad}; known: {STEPS}")
    return args


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.home is not None:
        os.environ["PDSERVE_HOME"] = str(opts.home)
    work = opts.work or Path(tempfile.mkdtemp(prefix="pd_pair_gpu-"))
    run = Run(opts.out, work, opts.budget_s)
    tests = Tests(run) if "tests" in opts.steps else None
    run.environment = environment()
    log(f"work folder {work}; {run.environment}")
    model: dict[str, Any] = {}
    pending: dict[str, Any] = {}
    if {"model", "check", "load"} & set(opts.steps):
        run.step(
            "model", lambda: model.update(prepare_smollm2(opts.gguf, opts.fallback_folder)) or dict(model)
        )
    handoff = lambda: step_handoff(run, opts.handoff_tokens, opts.handoff_repeats)  # noqa: E731
    if tests is not None and "handoff" in opts.steps and not opts.handoff_last:
        run.step("tests", lambda: tests.result(min(180.0, run.left_s())))
    if "xtray" in opts.steps:
        run.step("xtray", lambda: step_xtray(run, opts.xtray_sizes))
    if "handoff" in opts.steps and not opts.handoff_last:
        run.step("handoff", handoff)
    if model and "check" in opts.steps:
        run.step("check", lambda: step_check(run, model, opts, pending))
    if tests is not None and "tests" not in run.results:
        run.step("tests", lambda: tests.result(min(180.0, run.left_s())))
    if model and "load" in opts.steps:
        run.step("load", lambda: step_load(run, model, opts, pending))
    if "handoff" in opts.steps and opts.handoff_last:
        run.step("handoff", handoff)
    run.save()
    print("\n" + (work / "summary.md").read_text(), flush=True)
    return 0 if all(r["status"] == "ok" for r in run.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
