"""--pe-routing kv-aware on a real cluster (issue 51): two PEs publishing KV events and a CE reading them.
Chats that share a long system prompt but open with different user turns (rendezvous hashing of the first
user message spreads them over both PEs) all go to the PE that holds the system prompt's pages, each
reusing them."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request

from pd.tools.server_process import ServerProcess, free_port, get_json
from tests.server_fixtures import serving

MODEL = "smollm2-135m-instruct"
TOKEN = "kv-aware-cluster-token-0123456789"
BLOCK = 16
SYSTEM = "You are a careful assistant for a hardware shop. " + " ".join(
    f"Rule {i}: answer in one short sentence about item {i} and never mention prices." for i in range(24)
)


def chat(url: str, user: str) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 2,
        "temperature": 0,
    }
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def selected(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    pattern = r'pdserve_pe_selected_total\{pe="([^"]+)",reason="([^"]+)"\} ([0-9.e+]+)'
    return {(pe, reason): float(v) for pe, reason, v in re.findall(pattern, text)}


def test_chats_sharing_a_system_prompt_meet_its_pages_on_one_pe(tmp_path):
    common = ("--model", MODEL, "--block-size", str(BLOCK), "--max-model-len", "2048", "--kv-cache-gb", "0.25")
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": TOKEN}
    env.pop("PDSERVE_CLUSTER_TOKEN_FILE", None)
    pes = []
    for i in range(2):
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}",
                  "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}  # fmt: skip
        pes.append(ServerProcess("--role", "pe", *common, "--kv-events-config", json.dumps(events),
                                 log_path=tmp_path / f"pe{i}.log", env=env))  # fmt: skip
    ce = ServerProcess(
        "--role", "ce", *common, "--prefill-url", ",".join(p.url for p in pes), "--pe-routing", "kv-aware",
        "--kv-port-base", str(free_port()), log_path=tmp_path / "ce.log", env=env,
    )  # fmt: skip
    with serving(*pes, ce):
        deadline = time.monotonic() + 60
        while get_json(ce.url + "/health")[1].get("kv_index", {}).get("streams") != 2:
            assert time.monotonic() < deadline, get_json(ce.url + "/health")[1]
            time.sleep(0.2)
        first = chat(ce.url, "Which item is the lightest?")
        deadline = time.monotonic() + 30  # the PE's pages reach the CE's index
        while get_json(ce.url + "/health")[1]["kv_index"]["blocks"] * BLOCK < first["usage"]["prompt_tokens"] - BLOCK:
            assert time.monotonic() < deadline, get_json(ce.url + "/health")[1]
            time.sleep(0.1)
        users = ["Tell me about item 3.", "Is item 7 in stock?", "Hi", "What about item 12?", "Thanks, bye."]
        answers = [chat(ce.url, u) for u in users]
        got = selected(ce.url)
    hits = {pe: n for (pe, reason), n in got.items() if reason == "kv-hit" and n}
    assert len(hits) == 1 and sum(hits.values()) == len(users), got  # every later chat went to one PE
    assert got[(next(iter(hits)), "kv-miss")] == 1, got  # and that PE took the first one too
    system_tokens = first["usage"]["prompt_tokens"] - 40  # the system prompt's share, at least
    for a in answers:
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= system_tokens // BLOCK * BLOCK - BLOCK, a["usage"]
