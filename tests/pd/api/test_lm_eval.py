"""lm-evaluation-harness against a single-engine server and a P/D pair (SmolLM2-135M, --deterministic), on
the two small offline tasks in bench/lm_eval_tasks: `local-completions` on a multiple-choice task
(loglikelihood: completions with echo, logprobs 1 and max_tokens 1, token-id prompts in batches) and
`local-chat-completions` with the chat template on a generation task. Both sides give the same scores and
the same per-sample results, logprobs bit for bit. Skipped without lm_eval (pip install "lm_eval[api]")."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pd.tools.server_process import wait_idle
from tests.server_fixtures import wait_pair_idle

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[3]
TASKS = ROOT / "bench" / "lm_eval_tasks"

@pytest.fixture(scope="module")
def servers(smollm_servers):
    """The session's SmolLM2 reference and pair (tests/pd/conftest.py), SMALL_DETERMINISTIC."""
    return smollm_servers


def evaluate(url: str, model: str, task: str, **kw: Any) -> tuple[dict[str, Any], list[Any]]:
    """lm_eval's results for `task` against the server at url, and its samples' responses."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from engine.checkpoints import resolve_model

    path = "/v1/completions" if model == "local-completions" else "/v1/chat/completions"
    args: dict[str, Any] = dict(base_url=url + path, model=MODEL, num_concurrent=1, max_retries=1)
    if model == "local-completions":  # the requests as token ids, counted with the model's own tokenizer
        args.update(tokenizer=str(resolve_model(MODEL)), tokenizer_backend="huggingface", batch_size=4)
    out = simple_evaluate(
        model=model,
        model_args=args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
        **kw,
    )
    assert out is not None
    return out["results"][task], [s["resps"] for s in out["samples"][task]]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setitem(os.environ, key, "1")


def test_loglikelihood_through_local_completions(servers):
    ref, pair = servers
    (ref_scores, ref_resps), (pd_scores, pd_resps) = (
        evaluate(s.url, "local-completions", "pdserve_mc") for s in (ref, pair)
    )
    assert ref_scores["sample_len"] == 6 and ref_scores["acc,none"] >= 0.5, ref_scores  # it knows some
    assert pd_scores == ref_scores and pd_resps == ref_resps  # (logprob, is_greedy) per choice, bit for bit
    wait_idle(ref.port)
    wait_pair_idle(pair)


def test_generation_through_local_chat_completions(servers):
    ref, pair = servers
    (ref_scores, ref_resps), (pd_scores, pd_resps) = (
        evaluate(s.url, "local-chat-completions", "pdserve_gen", apply_chat_template=True) for s in (ref, pair)
    )
    assert ref_scores["sample_len"] == 4 and ref_scores["exact_match,last-word"] > 0, ref_scores
    assert pd_scores == ref_scores and pd_resps == ref_resps
    wait_idle(ref.port)
    wait_pair_idle(pair)
