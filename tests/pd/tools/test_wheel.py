"""The distribution a user installs: an sdist and a wheel built from the tracked files, the wheel installed
into a new environment outside the repository, and `pdserve --version` and one chat served from it.

The new environment is a fresh venv whose only other path is this checkout's .venv site-packages (for torch
and the other dependencies, which cannot be installed offline); pdserve itself comes from the wheel: `pd`
resolves into the new venv, run from a directory outside the checkout (the .pth line adds a directory,
not the editable install's finder, which that directory's own .pth files would set up)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from pd import __version__
from pd.tools.cli import main as pdserve
from pd.tools.server_process import ServerProcess
from tests.server_fixtures import openai_client

REPO = Path(__file__).resolve().parents[3]
# beside the packages: the script `pdserve pd` runs and the dashboard (pyproject.toml's data-files)
SHARED = ("share/pdserve/deploy/pd_run.sh", "share/pdserve/deploy/lib.sh", "share/pdserve/grafana/pdserve.json")


def test_pdserve_version(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    want = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
    assert pdserve(["--version"]) == 0
    assert capsys.readouterr().out == f"pdserve {want}\n" and __version__ == want


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_wheel_installs_outside_the_checkout_and_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.checkpoints import resolve_model

    src, dist = tmp_path / "src", tmp_path / "dist"
    for name in run("git", "ls-files", "-z", cwd=REPO).split("\0"):
        if name and (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    python = sys.executable
    run(python, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(dist)!r})", cwd=src)
    run(python, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q", "-w", dist, cwd=tmp_path)
    (sdist,) = dist.glob("pdserve-*.tar.gz")
    (wheel,) = dist.glob("pdserve-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    tracked = [n for n in run("git", "ls-files", "pd", "engine", "transfer", "pdkernels", cwd=REPO).split() if n.endswith(".py")]
    assert [n for n in tracked if n not in in_wheel] == []
    data = f"pdserve-{__version__}.data/data/"
    assert {data + s for s in SHARED} <= in_wheel
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"pyproject.toml", "pd/server.py", "deploy/pd_run.sh", "deploy/grafana/pdserve.json"} <= in_sdist

    venv = tmp_path / "venv"
    run(python, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    site = Path(run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip())
    (site / "repo_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(python, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "-q", wheel, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = run(venv / "bin" / "python", "-c", "import pd, engine; print(pd.__file__); print(engine.__file__)", cwd=tmp_path, env=env)
    assert all(Path(p).is_relative_to(venv) for p in where.split()), where
    assert run(venv / "bin" / "pdserve", "--version", cwd=tmp_path, env=env) == f"pdserve {__version__}\n"
    assert all((venv / s).is_file() for s in SHARED)

    monkeypatch.chdir(tmp_path)  # the ranks run `python -m`: their cwd must not hold the checkout's packages
    model = resolve_model("smollm2-135m-instruct")
    command = (str(venv / "bin" / "pdserve"), "serve", str(model))
    args = ("--max-model-len", "512", "--kv-cache-gb", "0.05", "--served-model-name", "wheel")
    with ServerProcess(*args, command=command, env=env, log_path=tmp_path / "server.log") as server:
        answer = openai_client(server.url).chat.completions.create(
            model="wheel", messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0
        )
        ranks = server.rank_pids()
        cwds = {Path(os.readlink(f"/proc/{pid}/cwd")) for pid in ranks.values()}
    assert answer.choices[0].message.content and ranks and cwds == {tmp_path}
