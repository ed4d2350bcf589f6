"""Models by Hugging Face hub id (engine/checkpoints/hub.py) through huggingface_hub itself, with no route to
the real hub: a fake hub on 127.0.0.1 (tests/fake_hub.py, HF_ENDPOINT) for the download path and its
errors, and a cache laid out by hand for HF_HUB_OFFLINE=1. The commands run as users run them
(`pdserve download`, `python -m pd.server`) in child processes, since huggingface_hub reads HF_* once
at import; the last test serves a completion from a server started with `--model ORG/NAME`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.checkpoints import HubModel, models_home
from engine.checkpoints.hub import parse_hub_model
from pd.tools.server_process import ServerProcess, free_port, get_json
from tests.fake_hub import FakeHub, Repo, commit_of, files_of, write_hub_cache
from tests.server_fixtures import openai_client
from tests.tiny_models import make_servable

# What a download keeps of the checkpoint below: the engine's files, none of the rest.
ENGINE_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
GATED_TOKEN = "hf_test_token_accepted"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with SmolLM2's tokenizer, beside what real repositories also hold and the engine never
    reads: PyTorch .bin weights, Meta's original/ folder, a GGUF, Mistral's consolidated copy, a README."""
    folder = make_servable("llama", tmp_path_factory.mktemp("tiny-hub-llama"), models_home() / "smollm2-135m-instruct")
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)
    (folder / "original" / "params.json").write_text("{}")
    (folder / "original" / "model.safetensors").write_bytes(b"\0" * 4096)  # a subfolder's weights: never read
    (folder / "model-q4.gguf").write_bytes(b"GGUF")
    (folder / "consolidated.safetensors").write_bytes(b"\0" * 4096)
    (folder / "README.md").write_text("# tiny\n")
    return folder


@pytest.fixture(scope="module")
def hub(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    files = files_of(checkpoint)
    bin_only = tmp_path_factory.mktemp("bin-only")
    (bin_only / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    (bin_only / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    repos = {
        "org/tiny": Repo(files, commit_of(files), refs=("main", "v1")),
        "org/gated": Repo(files, commit_of(files), gated_token=GATED_TOKEN),
        "org/bin-only": Repo(files_of(bin_only), commit_of(files_of(bin_only))),
    }
    with FakeHub(repos) as h:
        yield h


def hub_env(home: Path, endpoint: str | None, **more: str) -> dict[str, str]:
    """The environment of a child: its own HF_HOME, the fake hub as the endpoint, no token of the user's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), **more)
    if endpoint is not None:
        env["HF_ENDPOINT"] = endpoint
    return env


def pdserve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pd.tools.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def one_line_error(out: subprocess.CompletedProcess[str], after_download: bool = False) -> str:
    """The command failed with exit status 1 and one line on stderr, no traceback: that line (after the
    progress bars of what it downloaded, where it got that far)."""
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 or (after_download and "Fetching" in out.stderr), out.stderr
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], out.stderr
    return lines[-1]


def test_parse_hub_model() -> None:
    assert parse_hub_model("Qwen/Qwen3-8B") == HubModel("Qwen/Qwen3-8B", None)
    assert parse_hub_model("Qwen/Qwen3-8B@v1.0") == HubModel("Qwen/Qwen3-8B", "v1.0")
    assert parse_hub_model("meta-llama/Llama-3.1-8B", "abc") == HubModel("meta-llama/Llama-3.1-8B", "abc")
    assert parse_hub_model("org/x@r", "r") == HubModel("org/x", "r")
    assert str(HubModel("org/x", "r")) == "org/x@r"
    for not_hub in ("smollm2-135m-instruct", "/abs/org/name", "./org/name", "~/org", "a/b/c", "org/", "/x"):
        assert parse_hub_model(not_hub) is None, not_hub
    with pytest.raises(ValueError, match="nothing after '@'"):
        parse_hub_model("org/x@")
    with pytest.raises(ValueError, match="--revision says 'b'"):
        parse_hub_model("org/x@a", "b")


def test_download_takes_only_the_engines_files_then_works_offline(hub: FakeHub, tmp_path: Path) -> None:
    env = hub_env(tmp_path / "hf", hub.url)
    out = pdserve(env, "download", "org/tiny")
    assert out.returncode == 0, out.stderr
    commit = hub.repos["org/tiny"].commit
    folder = Path(out.stdout.strip())
    assert folder == tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / commit
    assert {p.name for p in folder.iterdir()} == ENGINE_FILES
    assert hub.downloaded("org/tiny") == ENGINE_FILES  # nothing else crossed the wire
    assert (folder / "model.safetensors").read_bytes() == (hub.repos["org/tiny"].files["model.safetensors"]).read_bytes()
    assert "Fetching 5 files" in out.stderr  # huggingface_hub's progress bars, shown without a terminal too
    # The cache is huggingface_hub's: offline, the same folder comes back with no request at all.
    asked = len(hub.requests)
    offline = pdserve({**env, "HF_HUB_OFFLINE": "1"}, "download", "org/tiny")
    assert offline.returncode == 0, offline.stderr
    assert Path(offline.stdout.strip()) == folder
    assert len(hub.requests) == asked


def test_revision_as_suffix_or_flag_and_download_dir(hub: FakeHub, tmp_path: Path) -> None:
    env = hub_env(tmp_path / "hf", hub.url)
    commit = hub.repos["org/tiny"].commit
    cache = tmp_path / "models"
    by_suffix = pdserve(env, "download", "org/tiny@v1", "--download-dir", str(cache))
    by_flag = pdserve(env, "download", "org/tiny", "--revision", "v1", "--download-dir", str(cache))
    for out in (by_suffix, by_flag):
        assert out.returncode == 0, out.stderr
        assert Path(out.stdout.strip()) == cache / "models--org--tiny" / "snapshots" / commit
    assert (cache / "models--org--tiny" / "refs" / "v1").read_text() == commit
    assert not (tmp_path / "hf" / "hub").exists()  # --download-dir replaced the cache
    error = one_line_error(pdserve(env, "download", "org/tiny@no-such-tag"))
    assert "org/tiny@no-such-tag" in error and "no revision 'no-such-tag'" in error, error


def test_gated_model_needs_an_accepted_token(hub: FakeHub, tmp_path: Path) -> None:
    error = one_line_error(pdserve(hub_env(tmp_path / "hf", hub.url), "download", "org/gated"))
    assert error.startswith("error: org/gated is a gated model") and "HF_TOKEN" in error, error
    assert f"{hub.url}/org/gated" in error  # where to accept its terms
    wrong = pdserve(hub_env(tmp_path / "hf", hub.url, HF_TOKEN="hf_not_accepted"), "download", "org/gated")
    assert "gated" in one_line_error(wrong)
    out = pdserve(hub_env(tmp_path / "hf", hub.url, HF_TOKEN=GATED_TOKEN), "download", "org/gated")
    assert out.returncode == 0, out.stderr
    assert {p.name for p in Path(out.stdout.strip()).iterdir()} == ENGINE_FILES


def test_missing_model_and_one_without_safetensors(hub: FakeHub, tmp_path: Path) -> None:
    env = hub_env(tmp_path / "hf", hub.url)
    error = one_line_error(pdserve(env, "download", "org/no-such-model"))
    assert "org/no-such-model: no such model on " + hub.url in error and "HF_TOKEN" in error, error
    error = one_line_error(pdserve(env, "download", "org/bin-only"), after_download=True)  # config.json
    assert "org/bin-only has no *.safetensors weights" in error, error


def test_offline_reads_a_hand_laid_cache_and_names_what_to_do_when_absent(checkpoint: Path, tmp_path: Path) -> None:
    """A cache laid out as huggingface_hub lays it out (blobs/, refs/main, snapshots/COMMIT/ links), read
    by huggingface_hub with HF_HUB_OFFLINE=1; an absent model is a one-line error naming the way out."""
    files = {name: checkpoint / name for name in ENGINE_FILES}
    commit = commit_of(files)
    snapshot = write_hub_cache(tmp_path / "cache", "acme/laid-out", files, commit)
    env = hub_env(tmp_path / "hf", None, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    out = pdserve(env, "download", "acme/laid-out")
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == snapshot
    assert (snapshot / "config.json").resolve().parent == tmp_path / "cache" / "models--acme--laid-out" / "blobs"
    error = one_line_error(pdserve(env, "download", "acme/absent"))
    assert "acme/absent is not (fully) in the cache " + str(tmp_path / "cache") in error, error
    assert "HF_HUB_OFFLINE is set" in error and "`pdserve download acme/absent`" in error, error


def test_unreachable_hub_and_misplaced_flags(checkpoint: Path, tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = hub_env(tmp_path / "hf", closed)
    error = one_line_error(pdserve(env, "download", "org/tiny"))
    assert f"{closed} is out of reach" in error, error
    # a revision or a cache means nothing for a local folder or a catalogue model: refused, not ignored
    for model in (str(checkpoint), "smollm2-135m-instruct"):
        error = one_line_error(pdserve(env, "download", model, "--revision", "v1"))
        assert "apply to hub ids (ORG/NAME) only" in error, error
    assert pdserve(env, "download", str(checkpoint)).stdout.strip() == str(checkpoint)


def test_server_refuses_a_gated_model_in_one_line(hub: FakeHub, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pd.server", "--model", "org/gated", "--port", str(free_port())],
        env=hub_env(tmp_path / "hf", hub.url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("python -m pd.server: org/gated is a gated model")


@pytest.mark.slow
def test_server_serves_a_hub_model(hub: FakeHub, tmp_path: Path) -> None:
    """`pdserve serve org/tiny` against the fake hub: downloaded once, then served under its hub id."""
    env = hub_env(tmp_path / "hf", hub.url)
    args = ("--max-model-len", "256", "--kv-cache-gb", "0.05", "--max-num-seqs", "4", "--hicache-gb", "0")
    command = (sys.executable, "-m", "pd.tools.cli", "serve", "org/tiny")
    with ServerProcess(*args, env=env, command=command, log_path=tmp_path / "server.log") as server:
        status, models = get_json(server.url + "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["org/tiny"], models
        r = openai_client(server.url).completions.create(model="org/tiny", prompt="The cat", max_tokens=8, temperature=0)
        assert r.model == "org/tiny" and r.usage is not None and r.usage.completion_tokens >= 1
        assert r.choices[0].finish_reason in ("length", "stop")
    assert hub.downloaded("org/tiny") <= ENGINE_FILES
    assert (tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / hub.repos["org/tiny"].commit).is_dir()
