"""What the Kubernetes tests read of deploy/k8s/ (the base) and deploy/k8s/monitoring/: a folder's
kustomization.yaml, the documents of the files it lists, and what `kustomize build` renders of it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MONITORING_DIR = K8S_DIR / "monitoring"


def kustomization(folder: Path) -> dict[str, Any]:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def resources(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    """(file, document) for every document of every file folder's kustomization.yaml lists, in order."""
    found = []
    for name in kustomization(folder)["resources"]:
        for doc in yaml.safe_load_all((folder / name).read_text()):
            if doc is not None:
                found.append((name, doc))
    return found


def listed_and_on_disk(folder: Path) -> tuple[set[str], set[str]]:
    """The files folder's kustomization.yaml lists, and the YAML files in folder beside it."""
    return set(kustomization(folder)["resources"]), {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}


def kustomize_build(folder: Path) -> tuple[str, list[dict[str, Any]]]:
    """The command run and the documents it renders: `kustomize build`, else `kubectl kustomize`; the test
    is skipped where neither is installed."""
    if shutil.which("kustomize"):
        cmd = ["kustomize", "build", str(folder)]
    elif shutil.which("kubectl"):
        cmd = ["kubectl", "kustomize", str(folder)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return " ".join(cmd), [doc for doc in yaml.safe_load_all(out.stdout) if doc]
