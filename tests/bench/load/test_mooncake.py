"""`pdserve bench mooncake` (bench/load/mooncake.py): a Mooncake-format trace turned into token-id prompts
(equal hash ids, equal blocks), the trace's own reuse as one unlimited cache sees it, and a replay against a
real SmolLM2 server with 16-token pages, whose prefix cache gives back exactly the trace's reuse."""

from __future__ import annotations

import json
from pathlib import Path

from bench.load.mooncake import block_tokens, prompt_of, trace_reuse
from pd.tools.cli import main as pdserve
from tests.server_fixtures import module_server

server = module_server("--model", "smollm2-135m-instruct", "--block-size", "16", "--max-model-len", "2048", "--kv-cache-gb", "0.1")

RECORDS = [  # 512-token trace blocks, scaled to 16 here: input_length 1536 is three blocks
    {"timestamp": 0, "input_length": 1536, "output_length": 9, "hash_ids": [0, 1, 2]},
    {"timestamp": 1, "input_length": 2048, "output_length": 9, "hash_ids": [0, 1, 2, 3]},  # 3 blocks seen
    {"timestamp": 2, "input_length": 1000, "output_length": 9, "hash_ids": [0, 4]},  # 1 seen (31 tokens)
    {"timestamp": 3, "input_length": 1024, "output_length": 9, "hash_ids": [5, 1]},  # another chain: none
]


def test_prompts_are_blocks_of_the_hash_ids_scaled_to_the_block_size():
    prompts = [prompt_of(r, 16, 512) for r in RECORDS]
    assert [len(p) for p in prompts] == [48, 64, 31, 32]
    assert prompts[1][:48] == prompts[0] and prompts[2][:16] == prompts[0][:16] == block_tokens(0, 16)
    assert prompts[3][16:] == block_tokens(1, 16) and prompts[3][:16] != prompts[0][:16]


def test_the_traces_own_reuse_counts_whole_pages_of_seen_chains():
    prompts = [prompt_of(r, 16, 512) for r in RECORDS]
    ids = [r["hash_ids"] for r in RECORDS]
    # the second holds 3 seen blocks; the third one (its only full page: 31 tokens); the fourth's chain is new
    assert trace_reuse(prompts, ids, 16, 16) == [0, 48, 16, 0]
    # the first one again: all three blocks seen, one token left to compute -> two pages
    assert trace_reuse([prompts[0], prompts[0]], [ids[0], ids[0]], 16, 16) == [0, 32]


def test_a_replay_against_a_server_reaches_the_traces_reuse(server, tmp_path: Path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / "report.json"
    rc = pdserve(["bench", "mooncake", "--trace", str(trace), "--base-url", server.url, "--requests", "4",
                  "--concurrency", "1", "--ce-url", server.url, "--out", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    r = json.loads(out.read_text())
    assert (r["ok"], r["failed"], r["prompt_tokens"]) == (4, 0, 48 + 64 + 31 + 32), r
    assert r["cached_tokens"] == 48 + 16 and abs(r["share_of_reuse"] - 1.0) < 1e-9, r
    assert r["per_ce"][server.url]["requests"] == 4, r
    assert "share of reuse 100.0%" in capsys.readouterr().out
