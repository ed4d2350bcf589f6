"""Two engine ranks: affinity keeps a conversation on one rank; killing a rank's engine process mid-stream
fails that stream with an error, /health and /metrics show the rank down, and the other rank serves; after
the restart backoff the server starts the rank again, which serves its conversations once more."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from pd.tools.server_process import get_json, rank_metrics
from tests.server_fixtures import module_server, openai_client

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


RESTART_BACKOFF_S = 5.0  # long enough to see the rank down and the survivor serve before it is back

server = module_server(
    "--model", MODEL, "--dp", "2", "--routing", "affinity", "--max-model-len", "1024", "--kv-cache-gb", "0.1",
    "--rank-restart-backoff-s", str(RESTART_BACKOFF_S),
)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout_s=300)


def finished_per_rank(server) -> list[float]:
    return [rank_metrics(server.port, r).get("pdserve_requests_total", 0.0) for r in (0, 1)]


def test_affinity_keeps_a_conversation_on_one_rank(server, client):
    for k in range(3):
        first = {"role": "user", "content": f"Conversation {k}: hello!"}
        before = finished_per_rank(server)
        for turn in range(2):
            history = [first] + [
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "More."},
            ] * turn
            client.chat.completions.create(model=MODEL, messages=history, max_tokens=1)
        after = finished_per_rank(server)
        assert sorted(a - b for a, b in zip(after, before)) == [0.0, 2.0]  # both turns on the same rank


def test_killed_rank_fails_its_stream_the_other_serves_and_it_is_restarted(server, client) -> None:
    status, health = get_json(server.url + "/health")
    assert status == 200 and [r["state"] for r in health["ranks"]] == ["up", "up"]
    assert all("pid" not in r for r in health["ranks"])  # /health shows no pids
    pids = server.rank_pids()
    assert sorted(pids) == [0, 1]

    started = threading.Event()
    outcome: dict[str, object] = {}

    story = [{"role": "user", "content": "Tell me a very long story."}]

    def long_stream() -> None:
        try:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=story,
                max_tokens=900,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                started.set()
            outcome["result"] = "completed"
        except openai.APIError as e:
            outcome["result"] = e
        finally:
            started.set()

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(120), "the stream never started"
    busy = [r["rank"] for r in get_json(server.url + "/health")[1]["ranks"] if r["num_inflight"] > 0]
    assert len(busy) == 1, busy
    victim = busy[0]
    survivor = 1 - victim
    t0 = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 10, "the failure was not noticed at once"
    err = outcome["result"]
    assert isinstance(err, openai.APIError), err
    assert "engine rank" in str(err) and "exited" in str(err)

    status, health = get_json(server.url + "/health")
    assert status == 200 and health["status"] == "degraded"
    states = {r["rank"]: r for r in health["ranks"]}
    assert states[victim]["state"] in ("restarting", "starting") and "exited" in states[victim]["error"]
    assert states[survivor]["state"] == "up"
    assert rank_metrics(server.port, victim)["pdserve_rank_up"] == 0.0

    before = rank_metrics(server.port, survivor).get("pdserve_requests_total", 0.0)
    for k in range(4):  # whatever their affinity, new conversations go to the surviving rank
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Question {k}?"}], max_tokens=2
        )
        assert r.choices[0].message.content is not None
    assert rank_metrics(server.port, survivor)["pdserve_requests_total"] == before + 4

    # the restart: the new process re-registers, /health is ok again and the rank serves its conversations
    deadline = time.monotonic() + RESTART_BACKOFF_S + 120
    while time.monotonic() < deadline:
        status, health = get_json(server.url + "/health")
        if health["status"] == "ok":
            break
        time.sleep(0.5)
    assert status == 200 and health["status"] == "ok", health
    states = {r["rank"]: r for r in health["ranks"]}
    assert states[victim]["num_restarts"] == 1 and server.rank_pids()[victim] != pids[victim]
    assert "error" not in states[victim]
    assert rank_metrics(server.port, victim)["pdserve_rank_restarts_total"] == 1.0
    assert rank_metrics(server.port, survivor)["pdserve_rank_restarts_total"] == 0.0
    assert rank_metrics(server.port, victim)["pdserve_rank_up"] == 1.0
    before = rank_metrics(server.port, victim).get("pdserve_requests_total", 0.0)
    r = client.chat.completions.create(model=MODEL, messages=story, max_tokens=2)  # affinity: the victim
    assert r.choices[0].message.content is not None
    assert rank_metrics(server.port, victim)["pdserve_requests_total"] == before + 1
