"""Soak test of a running pdserve server (issue 14): good traffic, client aborts, bad requests and engine
rank kills for --minutes, then a check that nothing good was lost and every KV pool is idle again.

    deploy/server.sh start                     # or: deploy/pd_run.sh start localhost localhost
    python -m bench.load.soak --url http://127.0.0.1:8888 --minutes 30 --out run/soak.json

Traffic (--concurrency threads, seeded by --seed): chat completions through the `openai` client (streamed
or not, one prompt or a multi-turn conversation, max_tokens 8-64), /v1/completions, streams closed after
a few chunks (the server must free them), and a rotating set of bad requests that must each get a 4xx
with OpenAI's error object (each is sent once first, while every rank is up). Every --kill-every-s one
engine rank that is up gets SIGKILL, alternating between the servers (the --url server and, on a P/D
pair, its PE) and their ranks: the server pids come from --run-dir's pid files (`server-PORT.pid`,
`pd-ce-PORT.pid`, `pd-pe-PORT.pid`), the ranks are their `pd.rank.worker` children.

A request that fails is allowed only when a kill explains it:
  lost_on_killed_rank  502/503/504 (or an error event in its stream) with a kill at most KILL_SLACK_S
                       before it started or while it ran
  no_rank_up           503 service_unavailable after a kill (the restart window: no rank is up)
  good_lost            any other failure of a good request: must be 0
  bad_request_not_4xx  any other answer to a bad request (5xx, not OpenAI's shape, none within
                       CLIENT_TIMEOUT_S): must be 0
A bad request may meet a dead rank too (a rank checks token ids against the vocabulary), so its answers
fall in the same allowed classes.

At the end (within --settle-s) every rank of every server must be up again, serve one more short request
(counted as good traffic), and be idle: nothing running, waiting or in flight, its KV pool all free
(pd.tools.server_process.wait_idle). Restarts come from `pdserve_rank_restarts_total`, memory from VmRSS (per rank
index: a restarted rank has a new pid). Exit 1 on good_lost, bad_request_not_4xx, no answer to the last
request, or a pool not idle. Plain http, loopback servers only.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import itertools
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai

from pd.tools.server_process import get_json, rank_metrics, rank_pids, wait_idle

MIN_KILL_INTERVAL_S = 125.0  # a kill a rank per 125 s stays within 5 restarts per 600 s (server default)
CLIENT_TIMEOUT_S = 120.0
KILL_SLACK_S = 5.0  # the server may send a request to a dead rank before it sees the death
PAUSE_S = 0.5  # after a failure a kill explains: no busy loop of 503s while a rank restarts
MAX_EXAMPLES = 3  # distinct failures of each class kept verbatim for the report
OK_CLASSES = ("good_ok", "aborts_ok", "bad_request_4xx")
CLASSES = (*OK_CLASSES, "lost_on_killed_rank", "no_rank_up", "good_lost", "bad_request_not_4xx")
PROMPTS = (
    "Say hello.", "Name three colours.", "What is 2 + 2?", "Write a haiku about the sea.",
    "Explain TCP in one sentence.", "List the days of the week.", "Tell me a short story about a cat.",
)  # fmt: skip
Message = dict[str, str]


@dataclass(frozen=True)
class Server:
    name: str  # its pid file's stem: server-8888, pd-ce-8888, pd-pe-8889
    port: int
    pid: int | None  # None: no pid file (no kills, no RSS)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rank_states(self) -> list[str]:
        return [r["state"] for r in get_json(self.url + "/health")[1].get("ranks", [])]

    def restarts(self) -> int:
        ranks = range(len(self.rank_states()))
        return sum(int(rank_metrics(self.port, r).get("pdserve_rank_restarts_total", 0)) for r in ranks)

    def rss_mib(self) -> dict[str, float | None]:
        if self.pid is None:
            return {}
        ranks = sorted(rank_pids(self.pid).items())
        return {self.name: vm_rss_mib(self.pid), **{f"{self.name} rank {r}": vm_rss_mib(p) for r, p in ranks}}


def vm_rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(x.split()[1]) / 1024 for x in status.splitlines() if x.startswith("VmRSS:")), None)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def find_servers(run_dir: Path, port: int, pe_port: int | None, need_pids: bool) -> list[Server]:
    """The --url server and, when it is a CE, its PE(s) (--pe-url, else every pd-pe-PORT.pid)."""
    found = [f for f in (run_dir / f"server-{port}.pid", run_dir / f"pd-ce-{port}.pid") if f.exists()]
    if not found and need_pids:
        raise SystemExit(f"no server-{port}.pid or pd-ce-{port}.pid in {run_dir} (see --run-dir)")
    main = found[0] if found else run_dir / f"server-{port}.pid"
    files = [main]
    if main.stem.startswith("pd-ce-") or pe_port is not None:
        files += [run_dir / f"pd-pe-{pe_port}.pid"] if pe_port else sorted(run_dir.glob("pd-pe-*.pid"))
    servers = []
    for f in files:
        pid = int(f.read_text().split()[0]) if f.exists() else None
        if pid is None and need_pids:
            raise SystemExit(f"no pid file {f}: a server whose ranks are to be killed needs one")
        if pid is not None and b"pd.server" not in cmdline(pid):
            raise SystemExit(f"{f} names pid {pid}, which is not a running pd.server: not touching it")
        servers.append(Server(f.stem, int(f.stem.rsplit("-", 1)[1]), pid))
    return servers


def post_raw(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """POST /v1/chat/completions as raw bytes (what the openai client would refuse to send)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=CLIENT_TIMEOUT_S)
    try:
        try:
            conn.request(
                "POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **headers}
            )
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered early (413) and stopped reading: the answer may be there
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def openai_error_code(data: bytes) -> str | None:
    """The code of OpenAI's error object in data; raises (ValueError, KeyError, ...) if it is not one."""
    err = json.loads(data)["error"]
    if not {"message", "type", "param", "code"} <= err.keys():
        raise ValueError("not OpenAI's error object")
    return err["code"]


def bad_requests(model: str) -> list[tuple[str, bytes, dict[str, str]]]:
    """(what, body, extra headers): each must get a 4xx with OpenAI's error object."""
    hi = [{"role": "user", "content": "Hi"}]

    def body(**fields: Any) -> bytes:
        # max_tokens: one that is wrongly accepted comes back soon (a 200), not at the client timeout
        return json.dumps(
            {"model": model, "messages": hi, "max_tokens": 4, **fields}
        ).encode()  # NaN stays NaN

    nested = b'{"model": %s, "messages": %s%s}' % (json.dumps(model).encode(), b"[" * 200, b"]" * 200)
    return [
        ("invalid JSON", b'{"model": "', {}),
        ("temperature NaN", body(temperature=float("nan")), {}),
        ('temperature "hot"', body(temperature="hot"), {}),
        ("temperature -1", body(temperature=-1), {}),
        ("max_tokens 10**9", body(max_tokens=10**9), {}),
        ("seed 2**64", body(seed=2**64), {}),
        ("stop_token_ids [-1]", body(stop_token_ids=[-1]), {}),
        ("unknown model", body(model="no-such-model"), {}),
        ("messages nested 200 deep", nested, {}),
        ("10 kB header", body(), {"X-Pad": "a" * 10240}),
        ("X-Request-Id with a space", body(), {"X-Request-Id": "bad id"}),
        ("5 MiB body", body(messages=[{"role": "user", "content": "x" * (5 << 20)}]), {}),
    ]


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    latencies_s: list[float] = field(default_factory=list)  # of good requests that succeeded
    kill_times: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, cls: str, latency_s: float | None = None, detail: str = "") -> None:
        with self.lock:
            self.counts[cls] += 1
            if latency_s is not None:
                self.latencies_s.append(latency_s)
            example = f"{cls}: {detail}"[:300]
            num_kept = sum(e.startswith(cls + ":") for e in self.examples)
            if cls not in OK_CLASSES and num_kept < MAX_EXAMPLES and example not in self.examples:
                self.examples.append(example)

    def allowed(self, status: int | None, code: str | None, start: float, end: float) -> str | None:
        """The allowed class of a failure that a kill explains (see the module's doc), else None."""
        with self.lock:
            kills = list(self.kill_times)
        if status == 503 and code == "service_unavailable" and any(t <= end for t in kills):
            return "no_rank_up"
        in_band = status is None and code is not None  # an error event in a stream already started
        if (status in (502, 503, 504) or in_band) and any(start - KILL_SLACK_S <= t <= end for t in kills):
            return "lost_on_killed_rank"
        return None


class Traffic:
    """Workers that each send a random kind of request, one at a time, until the deadline."""

    KINDS = ("chat", "stream", "conversation", "completion", "abort", "bad")
    WEIGHTS = (3, 3, 2, 2, 1, 2)

    def __init__(self, url: str, api_key: str | None, tally: Tally, deadline: float) -> None:
        self.client = openai.OpenAI(
            base_url=url + "/v1", api_key=api_key or "none", max_retries=0, timeout=CLIENT_TIMEOUT_S
        )
        self.model = self.client.models.list().data[0].id
        self.url, self.tally, self.deadline = url, tally, deadline
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        bad = bad_requests(self.model)
        self.num_bad, self.bad = len(bad), itertools.cycle(bad)
        self.bad_lock = threading.Lock()
        self.bad_answers: dict[str, int] = {}  # 'what -> status': count

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            kind = rng.choices(self.KINDS, self.WEIGHTS)[0]
            if kind == "bad":
                self.bad_request()
            elif kind == "abort":
                self.good(functools.partial(self.abort, rng), ok_class="aborts_ok")
            elif kind == "completion":
                self.good(functools.partial(self.completion, rng))
            elif kind == "conversation":
                self.conversation(rng)
            else:
                prompt = [{"role": "user", "content": rng.choice(PROMPTS)}]
                self.good(functools.partial(self.chat, prompt, rng, kind == "stream"))

    def good(self, send: Callable[[], str], ok_class: str = "good_ok") -> str | None:
        """send()'s text, its outcome counted; None when it failed."""
        start = time.monotonic()
        try:
            text = send()
        except openai.APIError as e:
            status = getattr(e, "status_code", None)
            code = e.body.get("code") if isinstance(e.body, dict) else None
            cls = self.tally.allowed(status, code, start, time.monotonic()) or "good_lost"
            self.tally.add(cls, detail=f"{type(e).__name__} {status} {code}: {e.message}")
            time.sleep(PAUSE_S)
            return None
        except EOFError as e:
            self.tally.add("good_lost", detail=str(e))
            return None
        self.tally.add(ok_class, time.monotonic() - start if ok_class == "good_ok" else None)
        return text

    def conversation(self, rng: random.Random) -> None:
        """2-3 turns, each sending the whole history; it ends at the first failure."""
        history: list[Message] = []
        for _ in range(rng.randint(2, 3)):
            history.append({"role": "user", "content": rng.choice(PROMPTS)})
            answer = self.good(functools.partial(self.chat, history, rng, rng.random() < 0.5))
            if answer is None or time.monotonic() >= self.deadline:
                return
            history.append({"role": "assistant", "content": answer})

    def chat(self, messages: list[Message], rng: random.Random, stream: bool) -> str:
        kw: dict[str, Any] = dict(model=self.model, messages=messages, max_tokens=rng.randint(8, 64))
        kw.update(temperature=rng.choice((0.0, 0.7)), seed=rng.randrange(2**31))
        if not stream:
            return self.client.chat.completions.create(**kw).choices[0].message.content or ""
        chunks = self.client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        pieces = [(c.delta.content or "", c.finish_reason) for chunk in chunks for c in chunk.choices]
        return finished_text(pieces)

    def completion(self, rng: random.Random) -> str:
        kw: dict[str, Any] = dict(model=self.model, prompt=rng.choice(PROMPTS), max_tokens=rng.randint(8, 64))
        if rng.random() < 0.5:
            return self.client.completions.create(**kw).choices[0].text
        chunks = self.client.completions.create(**kw, stream=True)
        return finished_text([(c.text, c.finish_reason) for chunk in chunks for c in chunk.choices])

    def abort(self, rng: random.Random) -> str:
        """A long stream closed after a few chunks: the server must free it."""
        messages: Any = [{"role": "user", "content": rng.choice(PROMPTS)}]
        create = self.client.chat.completions.create
        with create(
            model=self.model, messages=messages, max_tokens=256, stream=True, extra_body={"ignore_eos": True}
        ) as stream:
            for _ in zip(range(rng.randint(2, 5)), stream):
                pass
        return ""

    def last_request(self) -> str:
        """After the run, once every rank is up again: a short request must be served."""
        messages: Any = [{"role": "user", "content": "Say hello."}]
        reply = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=8)
        return reply.choices[0].message.content or ""

    def bad_request(self) -> None:
        with self.bad_lock:
            what, body, headers = next(self.bad)
        start = time.monotonic()
        try:
            status, data = post_raw(self.url, body, {**self.auth, **headers})
        except OSError as e:  # no answer: a hang ends at the client timeout
            status, data = None, f"{type(e).__name__} {e}".encode()
        with self.bad_lock:
            answer = f"{what} -> {status or 'no answer'}"
            self.bad_answers[answer] = self.bad_answers.get(answer, 0) + 1
        try:
            code = openai_error_code(data)
        except (ValueError, KeyError, TypeError, AttributeError):
            self.tally.add("bad_request_not_4xx", detail=f"{what}: {status} {data[:200]!r}")
            return
        if status is not None and 400 <= status < 500:
            self.tally.add("bad_request_4xx")
            return
        cls = self.tally.allowed(status, code, start, time.monotonic()) or "bad_request_not_4xx"
        self.tally.add(cls, detail=f"{what}: {status} {data[:200]!r}")
        time.sleep(PAUSE_S)


def finished_text(pieces: list[tuple[str, str | None]]) -> str:
    """A stream's text; EOFError if it ended without a finish_reason (cut, but not by an error event)."""
    if not any(finish for _, finish in pieces):
        raise EOFError("a stream ended without a finish_reason")
    return "".join(text for text, _ in pieces)


def kill_one(servers: list[Server], kill_no: int, tally: Tally) -> dict[str, Any] | None:
    """SIGKILLs a rank that is up of servers[kill_no % len(servers)], its ranks in turn; None: none up."""
    server = servers[kill_no % len(servers)]
    assert server.pid is not None
    pids = rank_pids(server.pid)
    up = [r for r, state in enumerate(server.rank_states()) if state == "up" and r in pids]
    if not up:
        return None
    rank = up[(kill_no // len(servers)) % len(up)]
    with tally.lock:
        tally.kill_times.append(time.monotonic())  # NOTE: before the kill, so that its failures find it
    os.kill(pids[rank], signal.SIGKILL)
    return {"server": server.name, "rank": rank, "pid": pids[rank]}


def wait_up(servers: list[Server], deadline: float) -> None:
    for s in servers:
        while time.monotonic() < deadline and any(state != "up" for state in s.rank_states()):
            time.sleep(0.5)


def pools_idle(servers: list[Server], deadline: float) -> dict[str, bool]:
    """Waits (until the deadline in all) for every rank to be idle: {'NAME rank N': idle}."""
    idle: dict[str, bool] = {}
    for s in servers:
        for rank, state in enumerate(s.rank_states()):
            try:
                if state != "up":  # a dead rank's last stats may look idle
                    raise AssertionError(f"the rank is {state}")
                wait_idle(s.port, rank, timeout_s=max(0.5, deadline - time.monotonic()))
                idle[f"{s.name} rank {rank}"] = True
            except (AssertionError, OSError) as e:
                print(f"{s.name} rank {rank} not idle: {e}", file=sys.stderr)
                idle[f"{s.name} rank {rank}"] = False
    return idle


def percentile(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


def report_table(doc: dict[str, Any]) -> str:
    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    lat = [("-" if v is None else f"{v:.2f}") for v in doc["good_latency_s"].values()]
    rows = [("duration", f"{doc['duration_s']:.1f} s"), *doc["requests"].items()]
    rows += [("good latency p50 / p99", f"{lat[0]} / {lat[1]} s")]
    rows += [("rank kills (skipped: no rank up)", f"{len(doc['kills'])} ({doc['kills_skipped']})")]
    rows += [(f"restarts seen, {name}", n) for name, n in doc["restarts_seen"].items()]
    rows += [("served after the kills", "yes" if doc["served_after_kills"] else "NO")]
    rows += [(f"pool idle, {name}", "yes" if ok else "NO") for name, ok in doc["pools_idle"].items()]
    rows += [(f"RSS MiB, {name}", f"{mib(a)} -> {mib(b)}") for name, (a, b) in doc["rss_mib"].items()]
    lines = ["| soak | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join(lines + [f"- {e}" for e in doc["failures"]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the server (a P/D pair's CE): http://127.0.0.1:PORT")
    ap.add_argument("--minutes", type=float, required=True, help="how long traffic runs")
    ap.add_argument("--run-dir", type=Path, default=Path("run"), help="where the servers' pid files are")
    ap.add_argument("--pe-url", help="a CE's PE (default: every pd-pe-PORT.pid in --run-dir)")
    ap.add_argument("--kill-every-s", type=float, default=120.0, help="SIGKILL a rank this often (0: never)")
    ap.add_argument("--force", action="store_true", help=f"allow --kill-every-s < {MIN_KILL_INTERVAL_S:g}")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--settle-s", type=float, default=60.0, help="bound on the wait for idle pools at the end"
    )
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)
    urls = [urlsplit(u) for u in (args.url, args.pe_url) if u]
    if not all(u.scheme == "http" and u.port and u.hostname in ("127.0.0.1", "localhost") for u in urls):
        ap.error("--url and --pe-url must be http://127.0.0.1:PORT (or localhost): loopback servers only")
    if 0 < args.kill_every_s < MIN_KILL_INTERVAL_S and not args.force:
        ap.error(
            f"--kill-every-s {args.kill_every_s:g} may reach the server's rank restart limit (5 a rank per "
            f"600 s by default, then the rank stays down): use >= {MIN_KILL_INTERVAL_S:g}, or --force"
        )
    pe_port = urls[1].port if args.pe_url else None
    servers = find_servers(args.run_dir, urls[0].port or 0, pe_port, need_pids=args.kill_every_s > 0)

    tally = Tally()
    start = time.monotonic()
    traffic = Traffic(servers[0].url, args.api_key, tally, deadline=start + args.minutes * 60)
    restarts_start = {s.name: s.restarts() for s in servers}
    rss_start = {k: v for s in servers for k, v in s.rss_mib().items()}
    for _ in range(traffic.num_bad):  # each bad request once while every rank is up, then in turn
        traffic.bad_request()
    workers = [
        threading.Thread(target=traffic.run, args=(args.seed * 1000 + i,), daemon=True)
        for i in range(args.concurrency)
    ]
    for w in workers:
        w.start()
    kills: list[dict[str, Any]] = []
    num_skipped = 0
    next_kill_s = start + args.kill_every_s if args.kill_every_s > 0 else float("inf")
    for kill_no in itertools.count():  # ends at the deadline: one pass per kill or per 0.5 s
        while (now := time.monotonic()) < min(next_kill_s, traffic.deadline):
            time.sleep(min(0.5, min(next_kill_s, traffic.deadline) - now))
        if now >= traffic.deadline:
            break
        next_kill_s += args.kill_every_s
        if (kill := kill_one(servers, kill_no, tally)) is None:
            num_skipped += 1
            continue
        kills.append({"t_s": round(now - start, 1), **kill})
        print(f"t={now - start:.0f} s: SIGKILL {kill['server']} rank {kill['rank']} (pid {kill['pid']})")
    join_deadline = time.monotonic() + CLIENT_TIMEOUT_S + 10  # a request in flight ends by its timeout
    for w in workers:
        w.join(max(0.0, join_deadline - time.monotonic()))
        if w.is_alive():
            tally.add("good_lost", detail=f"a request still ran {CLIENT_TIMEOUT_S + 10:g} s after the end")
    duration_s = time.monotonic() - start

    settle_deadline = time.monotonic() + args.settle_s
    wait_up(servers, settle_deadline)
    served_after = traffic.good(traffic.last_request) is not None  # counted as good traffic too
    idle = pools_idle(servers, settle_deadline)
    rss_end = {k: v for s in servers for k, v in s.rss_mib().items()}
    doc = {
        "schema": "pdserve-soak/1",
        "url": args.url,
        "duration_s": round(duration_s, 1),
        "requests": dict(tally.counts),
        "good_latency_s": {
            "p50": percentile(tally.latencies_s, 0.5),
            "p99": percentile(tally.latencies_s, 0.99),
        },
        "kills": kills,
        "kills_skipped": num_skipped,
        "restarts_seen": {s.name: s.restarts() - restarts_start[s.name] for s in servers},
        "served_after_kills": served_after,
        "pools_idle": idle,
        "rss_mib": {k: [rss_start.get(k), rss_end.get(k)] for k in {**rss_start, **rss_end}},
        "bad_request_answers": dict(sorted(traffic.bad_answers.items())),
        "failures": tally.examples,
    }
    failed = (
        tally.counts["good_lost"]
        or tally.counts["bad_request_not_4xx"]
        or not served_after
        or not all(idle.values())
    )
    doc["ok"] = not failed
    print(report_table(doc))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
