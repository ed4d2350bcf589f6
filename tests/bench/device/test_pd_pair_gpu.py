"""bench/device/pd_pair_gpu.py's placement of the servers, without a GPU."""

from __future__ import annotations

from pathlib import Path

from bench.device import pd_pair_gpu


def test_it_gives_each_pair_side_its_gpu(tmp_path: Path) -> None:
    """The two-GPU run's placement: every pair's PE and CE get the devices named, the references theirs,
    and the load step names its runs by GPU count; `auto` adds no flag (one GPU, as before)."""
    opts = pd_pair_gpu.parse_args(
        ["--out", str(tmp_path), "--pe-device", "cuda:0", "--ce-device", "cuda:1", "--transports", "nccl,ipc",
         "--load-colocated", "--dp 2", "--load-concurrency", "4,8"]
    )  # fmt: skip
    pair = pd_pair_gpu.pd_pair(("--model", "m"), tmp_path / "p", "nccl", opts)
    pe, ce = pair.pe.args, pair.ce.args
    assert pe[pe.index("--device") + 1] == "cuda:0" and pe[pe.index("--transport") + 1] == "nccl"
    assert ce[ce.index("--device") + 1] == "cuda:1"
    assert pd_pair_gpu.gpus(opts) == "2gpu" and opts.transports == ["nccl", "ipc"]
    one = pd_pair_gpu.parse_args(["--out", str(tmp_path)])
    single = pd_pair_gpu.pd_pair(("--model", "m"), tmp_path / "q", "ipc", one)
    assert "--device" not in single.pe.args and "--device" not in single.ce.args
    assert pd_pair_gpu.gpus(one) == "1gpu" and pd_pair_gpu.device_flag("auto") == ()
