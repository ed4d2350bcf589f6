"""deploy/Dockerfile, where no docker daemon builds it: its instructions parsed and checked (a base image
pinned by tag, a non-root user, no pip or apt cache left in a layer, the model cache on a volume, a
health check on a route the server serves, extras that pyproject.toml defines, the build context its
COPYs need), the entrypoint run as the image runs it, and its pip steps resolved against the package
index (`pip install --dry-run` into a fresh, empty venv) where the index is reachable."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from pd.config import DEFAULT_PE_PORT, DEFAULT_PORT, ServerConfig
from pd.frontend.coordinator import Coordinator
from pd.server import make_app

tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    text: str  # the rest, continuation lines joined

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction (after its --options; HEALTHCHECK's after CMD), else
        None."""
        rest = re.sub(r"^(--\S+\s+)*(CMD\s+)?", "", self.text)
        if rest.startswith("["):
            return list(json.loads(rest))
        return None


def parse(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile: comments dropped, `\\` continuations joined."""
    out: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        out.append(Instruction(keyword.upper(), " ".join(rest.split())))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


INSTRUCTIONS = parse(DOCKERFILE.read_text())


def of(keyword: str) -> list[Instruction]:
    return [i for i in INSTRUCTIONS if i.keyword == keyword]


def arg_defaults() -> dict[str, str]:
    out = {}
    for i in of("ARG"):
        name, _, value = i.text.partition("=")
        out[name] = value
    return out


def env() -> dict[str, str]:
    """ENV's values, $VAR references to earlier ones expanded (PATH's own included as `$PATH`)."""
    values: dict[str, str] = {}
    for i in of("ENV"):
        for pair in shlex.split(i.text):
            name, _, value = pair.partition("=")
            values[name] = _VAR.sub(lambda m: values.get(m.group(1) or m.group(2), m.group(0)), value)
    return values


def expand(text: str) -> str:
    """text with the ARG defaults and ENV values substituted, as the build substitutes them."""
    values = {**arg_defaults(), **env()}
    return _VAR.sub(lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)


def pip_installs() -> list[list[str]]:
    """Each `pip install` command of the RUN steps, as argv, build args expanded."""
    found = []
    for i in of("RUN"):
        for command in re.split(r"&&|;", i.text):
            argv = shlex.split(expand(command))
            if argv[:2] == ["pip", "install"]:
                found.append(argv)
    return found


def test_base_image_is_a_cuda_runtime_pinned_by_tag() -> None:
    (base,) = of("FROM")
    image = expand(base.text)
    name, _, tag = image.partition(":")
    assert name == "nvidia/cuda", image
    assert re.fullmatch(r"\d+\.\d+\.\d+-(cudnn-)?runtime-ubuntu\d+\.\d+", tag), f"pin a full runtime tag: {image}"
    cuda = tag.split("-")[0]
    index = arg_defaults()["TORCH_INDEX_URL"]
    # torch built for the base image's CUDA: cuXY names the same major.minor
    assert index.rstrip("/").endswith("/cu" + "".join(cuda.split(".")[:2])), (image, index)
    assert re.fullmatch(r"\d+\.\d+\.\d+", arg_defaults()["TORCH_VERSION"])


def test_runs_as_a_fixed_non_root_user() -> None:
    user = of("USER")[-1].text
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0), f"USER {user}: numeric, not root"
    useradd = [i.text for i in of("RUN") if "useradd" in i.text]
    assert useradd and f"--uid {uid}" in useradd[0], "the USER's uid is created"
    # the last instruction that runs as someone is this user: nothing after it switches back
    assert INSTRUCTIONS.index(of("USER")[-1]) > max(INSTRUCTIONS.index(i) for i in of("RUN"))


def test_no_package_cache_stays_in_a_layer() -> None:
    assert env().get("PIP_NO_CACHE_DIR") == "1"
    installs = pip_installs()
    assert len(installs) >= 2, installs  # torch, then pdserve
    for argv in installs:
        assert "--no-cache-dir" in argv, argv
    for i in of("RUN"):
        if "apt-get install" in i.text:
            assert "--no-install-recommends" in i.text and "rm -rf /var/lib/apt/lists/*" in i.text, i.text


def test_the_model_cache_is_a_volume_the_user_owns() -> None:
    (volume,) = of("VOLUME")
    (cache,) = volume.exec_form() or []
    values = env()
    for var in ("HF_HOME", "PDSERVE_HOME"):  # huggingface_hub's cache; converted catalogue models
        assert values[var].startswith(cache.rstrip("/") + "/"), f"{var}={values[var]} is not under {cache}"
    assert any(f"chown pdserve:pdserve {cache}" in i.text for i in of("RUN")), "the user must write the volume"


def test_health_check_asks_a_served_route_on_the_servers_port() -> None:
    (check,) = of("HEALTHCHECK")
    command = check.exec_form()
    assert command is not None and command[:2] == ["python", "-c"], check.text
    urls = re.findall(r"'(http://[^']+)'", command[2])
    assert len(urls) == 1, command
    url = urlsplit(urls[0].replace("%s", str(DEFAULT_PORT)))
    assert "'8888'" in command[2] and DEFAULT_PORT == 8888
    routes = {r.resource.canonical for r in make_app(Coordinator(ServerConfig())).router.routes() if r.resource}
    assert url.path in routes, (url.path, routes)
    exposed = {int(p) for p in of("EXPOSE")[0].text.split()}
    assert {DEFAULT_PORT, DEFAULT_PE_PORT, ServerConfig().kv_port_base} <= exposed


def test_pip_installs_extras_that_pyproject_defines() -> None:
    (step,) = [argv for argv in pip_installs() if any(a.startswith(".[") for a in argv)]
    (target,) = [a for a in step if a.startswith(".[")]
    extras = set(target[2:-1].split(","))
    assert extras and extras <= set(PYPROJECT["project"]["optional-dependencies"]), extras
    assert "cuda" in extras


def test_copies_every_package_and_the_build_context_holds_them() -> None:
    copied = set()
    for i in of("COPY"):
        *sources, _ = i.text.split()
        copied.update(sources)
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml"} <= copied, copied
    data_files = {f for files in PYPROJECT["tool"]["setuptools"]["data-files"].values() for f in files}
    assert data_files <= copied, data_files - copied  # the wheel's build needs them
    # what the ignore file lets into the context: each COPY source must be let in
    rules = [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    for source in copied:
        included = False
        for rule in rules:
            negated = rule.startswith("!")
            if fnmatch.fnmatch(source, rule.lstrip("!")):
                included = negated
        assert included, f"COPY {source}: deploy/Dockerfile.dockerignore leaves it out of the context"
        assert (ROOT / source).exists(), source


def test_the_entrypoint_is_the_pdserve_command() -> None:
    (entrypoint,) = of("ENTRYPOINT")
    assert entrypoint.exec_form() == ["pdserve"]
    assert PYPROJECT["project"]["scripts"]["pdserve"] == "pd.tools.cli:main"
    cmd = of("CMD")[-1].exec_form() or []
    # the image's commands: its default (--help), and serve's flags with the hub ones
    out = subprocess.run([sys.executable, "-m", "pd.tools.cli", *cmd], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "download" in out.stdout and "serve" in out.stdout, out.stderr
    serve = subprocess.run(
        [sys.executable, "-m", "pd.tools.cli", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert serve.returncode == 0 and "--revision" in serve.stdout and "--download-dir" in serve.stdout


def _reachable(url: str) -> bool:
    try:
        socket.getaddrinfo(urlsplit(url).hostname or "", 443)
    except OSError:
        return False
    return True


def _dry_run(venv: Path, argv: list[str]) -> dict:
    """argv (a `pip install ...` of the Dockerfile) with --dry-run into venv, from the repository root: the
    report of what it would install. The pip that runs is this environment's (`pip --python`), not one
    seeded into the venv: ensurepip's bundled pip can be years older, and it took two to three times as
    long on the same steps, to the same report (from an index without PEP 658 metadata both download
    every wheel whole, torch's CUDA ones included)."""
    report = venv / "report.json"
    python = venv / "bin" / "python"
    assert argv[0] == "pip", argv
    out = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), *argv[1:], "--dry-run", "--quiet", "--report", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty venv (no pip in it either: nothing counts as installed already)."""
    path = tmp_path_factory.mktemp("docker-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    return path


def test_the_torch_step_resolves_from_its_index(venv: Path) -> None:
    (torch_step,) = [argv for argv in pip_installs() if any(a.startswith("torch==") for a in argv)]
    index = torch_step[torch_step.index("--index-url") + 1]
    if not _reachable(index):
        pytest.skip(f"{index} is out of reach from here")
    report = _dry_run(venv, torch_step)
    versions = {i["metadata"]["name"]: i["metadata"]["version"] for i in report["install"]}
    assert versions["torch"].startswith(arg_defaults()["TORCH_VERSION"]), versions


@pytest.mark.slow
def test_the_pdserve_step_resolves_with_the_images_torch(venv: Path) -> None:
    """pdserve with its extras, against the package index, with the image's torch version pinned (the torch
    step installs it first; its CUDA index may be out of reach here, PyPI's build of it stands in)."""
    if not _reachable("https://pypi.org") or os.environ.get("PIP_NO_INDEX"):
        pytest.skip("the package index is out of reach from here")
    (step,) = [argv for argv in pip_installs() if any(a.startswith(".[") for a in argv)]
    torch = f"torch=={arg_defaults()['TORCH_VERSION']}"
    report = _dry_run(venv, [*step, torch])
    versions = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}
    assert versions["pdserve"] == PYPROJECT["project"]["version"]
    assert versions["torch"] == arg_defaults()["TORCH_VERSION"]
    for extra in ("cupy-cuda12x", "huggingface-hub", "transformers"):
        assert extra in versions, sorted(versions)
