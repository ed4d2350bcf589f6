"""What `pdserve router --routing kv-aware` adds to a chat to learn its token ids: one /tokenize round trip to
a server (SmolLM2, real process on loopback), a short chat and a 2k-token one, 60 calls each one at a time
(the first 10 dropped as warm-up).

    python bench/micro/tokenize_latency.py
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request

from pd.tools.server_process import ServerProcess

MODEL = "smollm2-135m-instruct"


def main() -> int:
    server = ServerProcess("--model", MODEL, "--kv-cache-gb", "0.5", "--hicache-gb", "0")
    rows = []
    with server:
        for name, content in (("short chat", "Say a number: 7"), ("2k-token chat", "word " * 2000)):
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()
            ms, count = [], 0
            for _ in range(60):
                t0 = time.perf_counter()
                req = urllib.request.Request(server.url + "/tokenize", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    count = json.loads(r.read())["count"]
                ms.append((time.perf_counter() - t0) * 1e3)
            ms = sorted(ms[10:])
            rows.append((name, count, statistics.median(ms), ms[int(0.9 * len(ms))]))
    for name, count, p50, p90 in rows:
        print(f"/tokenize {name} ({count} tokens): p50 {p50:.2f} ms, p90 {p90:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
