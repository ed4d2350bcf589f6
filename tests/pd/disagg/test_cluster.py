"""A P/D cluster of two PEs and two CEs on four loopback "hosts" (127.0.0.2-127.0.0.5), started by
deploy/pd_run.sh beside a single-engine reference server (deploy/server.sh), all --deterministic:
bench/check_pd.py's multi-turn cases identical through both CEs; a conversation whose turns alternate between the CEs
keeps one PE and its cache hits; a PE killed under load: its requests fail over to the other PE and
succeed, the CEs show it down, `start` brings it back (and leaves the rest alone) and new conversations
reach it again; `stop` leaves no process on any address and `status` then finds nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pd.disagg.membership import hrw_order
from pd.tools.server_process import free_port, get_json, group_alive, group_members, wait_idle
from tests.server_fixtures import SMALL_DETERMINISTIC, metric, openai_client, skip_unless_bindable

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
PE_HOSTS = ("127.0.0.2", "127.0.0.3")
CE_HOSTS = ("127.0.0.4", "127.0.0.5")
FLAGS = (*SMALL_DETERMINISTIC, "--hicache-gb", "0.1")
MODEL = "smollm2-135m-instruct"


def run(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "deploy" / script), *args], env=env, capture_output=True, text=True, timeout=900
    )


@dataclass
class Cluster:
    env: dict[str, str]
    run_dir: Path
    pe_port: int
    ce_port: int
    ref_port: int
    ports: tuple[str, ...]
    pids: set[int]

    @property
    def hosts(self) -> tuple[str, str]:
        return ",".join(PE_HOSTS), ",".join(CE_HOSTS)

    def pe_url(self, host: str) -> str:
        return f"http://{host}:{self.pe_port}"

    def ce_url(self, host: str) -> str:
        return f"http://{host}:{self.ce_port}"

    def pidfile(self, role: str, host: str) -> Path:
        port = self.pe_port if role == "pe" else self.ce_port
        return self.run_dir / f"pd-{role}-{host}-{port}.pid"

    def start(self) -> subprocess.CompletedProcess[str]:
        r = run("pd_run.sh", "start", *self.hosts, *self.ports, *FLAGS, env=self.env)
        self.pids |= {int(f.read_text()) for f in self.run_dir.glob("pd-*.pid")}
        return r


def selected(c: Cluster, pe_host: str, reason: str | None = None) -> float:
    """Prefills the CEs sent to this PE (for this reason)."""
    labels = {"pe": c.pe_url(pe_host), **({"reason": reason} if reason else {})}
    return sum(metric(c.ce_url(h), "pdserve_pe_selected_total", **labels) for h in CE_HOSTS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    skip_unless_bindable(*PE_HOSTS, *CE_HOSTS)
    run_dir = tmp_path_factory.mktemp("cluster")
    env = {**os.environ, "PDSERVE_RUN_DIR": str(run_dir)}
    for k in ("PDSERVE_CLUSTER_TOKEN", "PDSERVE_CLUSTER_TOKEN_FILE"):
        env.pop(k, None)
    pe_port, ce_port, ref_port = free_port(), free_port(), free_port()
    ports = ("--port", str(ce_port), "--pe-port", str(pe_port), "--kv-port-base", str(free_port()))
    c = Cluster(env, run_dir, pe_port, ce_port, ref_port, ports, set())
    try:
        # the reference and the cluster start at once (the script waits for each server's readiness)
        ref = subprocess.Popen(
            ["bash", str(ROOT / "deploy" / "server.sh"), "start", "--port", str(ref_port), *FLAGS],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        r = c.start()
        out, _ = ref.communicate(timeout=900)
        assert ref.returncode == 0, out
        c.pids.add(int((run_dir / f"server-{ref_port}.pid").read_text()))
        assert r.returncode == 0, r.stdout + r.stderr
        endpoints = " ".join(f"{c.ce_url(h)}/v1" for h in CE_HOSTS)
        assert f"P/D cluster ready: 2 PE(s), 2 CE(s); OpenAI endpoints: {endpoints}" in r.stdout
        assert f"stop it with: deploy/pd_run.sh stop {' '.join(c.hosts)}" in r.stdout
        token = run_dir / "cluster.token"
        assert token.stat().st_mode & 0o077 == 0
        yield c
    finally:
        stopped = run("pd_run.sh", "stop", *c.hosts, env=env)
        run("server.sh", "stop", env=env)
        survivors = [p for p in c.pids if group_alive(p)]
        for p in survivors:  # whatever stop missed goes, so that a failure here leaves no server behind
            os.killpg(p, signal.SIGKILL)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "killing" not in stopped.stdout  # each server drained and stopped its ranks within the timeout
    assert not survivors, survivors


def test_every_server_listens_on_its_own_address(cluster: Cluster) -> None:
    for host in PE_HOSTS:
        status, health = get_json(cluster.pe_url(host) + "/health")
        assert status == 200 and health["role"] == "pe"
    for host in CE_HOSTS:
        status, health = get_json(cluster.ce_url(host) + "/health")
        assert status == 200 and health["role"] == "ce" and health["status"] == "ok", health
        assert [p["url"] for p in health["prefill_engines"]] == [cluster.pe_url(h) for h in PE_HOSTS]
        assert all(p["state"] == "up" for p in health["prefill_engines"])
        # the rank is in the CE's process group, its KV receiver on the CE's own address
        pid = int(cluster.pidfile("ce", host).read_text())
        assert [p for p, args in group_members(pid).items() if b"pd.rank.worker" in args and p != pid]
    st = run("pd_run.sh", "status", *cluster.hosts, *cluster.ports[:4], env=cluster.env)
    assert st.returncode == 0, st.stdout + st.stderr
    rows = [line.split() for line in st.stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [(h, "pe") for h in PE_HOSTS] + [(h, "ce") for h in CE_HOSTS]
    assert all(r[4] == "up" and r[5].startswith("ok") and r[6] == "0" for r in rows), st.stdout


def test_check_pd_through_both_ces(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import check_pd

    pd = ",".join(cluster.ce_url(h) for h in CE_HOSTS)
    ref = f"http://127.0.0.1:{cluster.ref_port}"
    # the multi-turn cases (all of them run against a pair in test_pd_e2e.py)
    only = "conversation greedy,conversation seeded stream"
    code = check_pd.main(["--ref", ref, "--pd", pd, "--max-tokens", "8", "--only", only, "--parallel", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2/2 cases identical" in out and all(f"via {cluster.ce_url(h)}" in out for h in CE_HOSTS), out


def test_a_conversation_across_both_ces_keeps_one_pe(cluster: Cluster) -> None:
    clients = [openai_client(cluster.ce_url(h), timeout_s=300) for h in CE_HOSTS]
    before = {h: selected(cluster, h) for h in PE_HOSTS}
    hits = "pdserve_engine_cache_hit_tokens_total"  # the PE engine's prefix cache
    cached_before = {h: metric(cluster.pe_url(h), hits) for h in PE_HOSTS}
    messages = [{"role": "user", "content": "List three colours of the rainbow, one per line. " * 25}]
    cached: list[int] = []
    for turn in range(4):
        r = clients[turn % 2].chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        details = r.usage.prompt_tokens_details if r.usage else None
        cached.append(details.cached_tokens or 0 if details else 0)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": f"And now number {turn} again, please."},
        ]
    sent = {h: selected(cluster, h) - before[h] for h in PE_HOSTS}
    home = max(sent, key=lambda h: sent[h])
    assert sorted(sent.values()) == [0, 4], sent  # every turn, from either CE, went to one PE
    assert home == hrw_order(messages[0]["content"], [cluster.pe_url(h) for h in PE_HOSTS])[0].split("/")[2].split(":")[0]
    assert cached[0] == 0 and all(n > 0 for n in cached[1:]), cached  # later turns hit its prefix cache
    gained = {h: metric(cluster.pe_url(h), hits) - cached_before[h] for h in PE_HOSTS}
    other = next(h for h in PE_HOSTS if h != home)
    assert gained[home] > 0 and gained[other] == 0, gained


def _ask(url: str, content: str, results: dict[str, str]) -> None:
    try:
        r = openai_client(url, timeout_s=300).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
        )
        results[content] = "ok" if r.choices[0].message.content else "empty"
    except Exception as e:  # the test reports every failure
        results[content] = f"{type(e).__name__}: {e}"


def test_a_pe_killed_under_load_fails_over_and_comes_back(cluster: Cluster) -> None:
    victim, survivor = PE_HOSTS
    pes = [cluster.pe_url(h) for h in PE_HOSTS]
    # conversations whose own PE is the victim, long enough to be in flight there when it dies
    prompts = [
        f"Conversation {i}: " + "Tell me about the sea and the sky and the hills. " * 30 for i in range(40)
    ]
    prompts = [p for p in prompts if hrw_order(p, pes)[0] == cluster.pe_url(victim)][:8]
    assert len(prompts) == 8
    failover_before = selected(cluster, survivor, "failover")
    results: dict[str, str] = {}
    threads = [
        threading.Thread(target=_ask, args=(cluster.ce_url(CE_HOSTS[i % 2]), p, results))
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(metric(cluster.ce_url(h), "pdserve_pe_inflight", pe=cluster.pe_url(victim)) for h in CE_HOSTS) < 2:
        assert time.monotonic() < deadline, "no prefill reached the PE"
        time.sleep(0.05)
    victim_pid = int(cluster.pidfile("pe", victim).read_text())
    os.killpg(victim_pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    assert results == {p: "ok" for p in prompts}, results  # every one was retried on the survivor
    assert selected(cluster, survivor, "failover") - failover_before >= 2
    failed_prefills = 0  # CEs that kept a failed prefill's error: those whose prefill was on the victim
    for h in CE_HOSTS:
        health = get_json(cluster.ce_url(h) + "/health")[1]
        state = {p["url"]: p for p in health["prefill_engines"]}
        down = state[cluster.pe_url(victim)]
        assert down["state"] == "down" and state[cluster.pe_url(survivor)]["state"] == "up"
        # every CE says why it is down (its probe's error); the in-flight prefills' failure too where one was
        # there (the kill may catch both CEs' prefills on it, or one CE's only)
        assert health["status"] == "degraded" and ("error" in down or "last_error" in down), down
        failed_prefills += "last_error" in down
        wait_idle(cluster.ce_port, host=h, timeout_s=60)
    assert failed_prefills >= 1
    # while it is down its conversations go to the survivor
    before = selected(cluster, survivor)
    _ask(cluster.ce_url(CE_HOSTS[0]), prompts[0] + " (again)", results)
    assert results[prompts[0] + " (again)"] == "ok" and selected(cluster, survivor) == before + 1

    # start brings the PE back and leaves every other server as it was
    others = {
        f: int(f.read_text())
        for f in cluster.run_dir.glob("pd-*.pid")
        if f != cluster.pidfile("pe", victim)
    }
    r = cluster.start()
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("already running") == 3 and "starting the pe on 127.0.0.2" in r.stdout, r.stdout
    assert {f: int(f.read_text()) for f in others} == others
    deadline = time.monotonic() + 60  # each CE's health check sees it again
    while not all(
        all(p["state"] == "up" for p in get_json(cluster.ce_url(h) + "/health")[1]["prefill_engines"])
        for h in CE_HOSTS
    ):
        assert time.monotonic() < deadline
        time.sleep(0.3)
    before = selected(cluster, victim, "affinity")
    fresh = [f"New conversation {i}: what is a river?" for i in range(40)]
    fresh = [p for p in fresh if hrw_order(p, pes)[0] == cluster.pe_url(victim)][:2]
    for i, p in enumerate(fresh):
        _ask(cluster.ce_url(CE_HOSTS[i % 2]), p, results)
        assert results[p] == "ok"
    assert selected(cluster, victim, "affinity") >= before + 1


def test_stop_leaves_nothing_on_any_address(cluster: Cluster) -> None:
    """Runs last: the fixture's teardown stops the cluster again (nothing left to do)."""
    stopped = run("pd_run.sh", "stop", *cluster.hosts, env=cluster.env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    for role, hosts in (("ce", CE_HOSTS), ("pe", PE_HOSTS)):
        for h in hosts:
            assert f"stopped pd-{role}-{h}-" in stopped.stdout, stopped.stdout
    assert stopped.stdout.index("stopped pd-ce") < stopped.stdout.index("stopped pd-pe")  # CEs first
    assert not [p for p in cluster.pids if group_alive(p) and p != int((cluster.run_dir / f"server-{cluster.ref_port}.pid").read_text())]
    assert not list(cluster.run_dir.glob("pd-*.pid"))
    st = run("pd_run.sh", "status", env=cluster.env)
    assert st.returncode == 3, st.stdout
    # the single-engine server beside it was left alone
    assert get_json(f"http://127.0.0.1:{cluster.ref_port}/health")[0] == 200
