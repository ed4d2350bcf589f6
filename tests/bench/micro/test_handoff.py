"""bench/micro/handoff.py's pieces that run anywhere: its 8B-shaped and DeepSeek-V3 layouts, a receiver that dies."""

from __future__ import annotations

import sys

from bench.micro import handoff


def test_layouts_are_8b_shaped() -> None:
    llama = handoff.layout_of("llama8b")
    assert (llama.num_full_layers, llama.num_swa_layers, llama.page_bytes) == (
        32,
        0,
        16 << 20,
    )  # 128 KiB per token
    hybrid = handoff.layout_of("hybrid8b")
    assert hybrid.num_full_layers + hybrid.num_swa_layers == 32 and hybrid.window == 1024
    exp = handoff.synthetic_export(hybrid, 200, handoff.torch.device("cpu"))
    assert exp.pages.shape[0] == 2 and exp.state is not None and exp.num_computed == 200
    # DeepSeek-V3's latent pages: 61 layers x 128 tokens x (512 + 64) x 2 bytes, 1,152 B a token and layer
    ds = handoff.layout_of("deepseek_v3")
    assert (ds.page_kind, ds.token_bytes, ds.page_bytes) == ("latent", 1152, 61 * 128 * 1152)
    exp = handoff.synthetic_export(ds, 200, handoff.torch.device("cpu"))
    assert tuple(exp.pages.shape) == (2, 61, 1, 128, 1, 576) and exp.state is None


def test_handoff_fails_fast_when_its_receiver_dies() -> None:
    import multiprocessing as mp

    import pytest

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sys.exit, args=(3,))  # dies before it answers, as a failed CUDA init did
    proc.start()
    with pytest.raises(RuntimeError, match="exited"):
        handoff.first_answer(parent, proc, 30.0)
    proc.join()


def test_nixl_lands_in_place_in_the_receivers_pool(tmp_path, capfd) -> None:
    """Where the nixl extra is installed: the nixl-in-place sender's handoffs land in the receiving process's
    pool (its counters say so), beside the arena path's, one page of llama8b on the CPU."""
    import json

    import pytest

    from transfer.config import nixl_installed

    if not nixl_installed():
        pytest.skip("the nixl extra is not installed")
    out = tmp_path / "rows.json"
    assert handoff.main(["--device", "cpu", "--tokens", "128", "--repeats", "1", "--json", str(out)]) == 0
    rows = {r["what"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["handoff nixl"]["s"] > 0 and rows["handoff nixl-in-place"]["s"] > 0
    printed = capfd.readouterr().out
    # two sends each (a first on a new connection, then one timed): the arena's and the pool's
    assert "'arena_receives': 2" in printed and "'in_place_receives': 2" in printed, printed[-2000:]
