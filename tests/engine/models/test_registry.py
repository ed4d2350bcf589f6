"""The model registry: every family module is registered once under its model_type, an unknown model_type is
refused naming the supported ones, and no family's name is in the code of the engine's other rooms (their
docstrings may say where a mechanism comes from; identifiers and strings may not pick a family)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.errors import InvalidRequestError
from engine.models.family import Family
from engine.models.registry import FAMILIES, arch_from_hf, family_of

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / "engine" / "models"
NOT_FAMILIES = {"__init__", "registry", "family", "decoder", "hf_config", "loader", "mtp"}
# the engine's code outside engine/models: the rooms and the engine itself
FAMILY_FREE = ["engine/core", "engine/layers", "engine/execution", "engine/parallel", "engine/handoff", "engine/engine.py"]
STEMS = ("llama", "mistral", "qwen", "gemma", "gpt_oss", "deepseek", "phi3")


def _family_modules() -> list[str]:
    return sorted(p.stem for p in MODELS.glob("*.py") if p.stem not in NOT_FAMILIES)


def test_every_family_module_is_registered_once_under_its_model_type() -> None:
    declared = {}
    for name in _family_modules():
        family = importlib.import_module(f"engine.models.{name}").FAMILY
        assert isinstance(family, Family), name
        declared[family.model_type] = family
    assert declared == FAMILIES
    assert len(FAMILIES) == len(_family_modules())


def test_an_unknown_model_type_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(InvalidRequestError, match="unsupported model_type 'olmo2'.*phi3"):
        arch_from_hf(SimpleNamespace(model_type="olmo2"))
    assert family_of("phi3").model_type == "phi3"


def _code_names(path: Path) -> set[str]:
    """Identifiers and string constants of a module, its docstrings left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
    return names


def test_no_family_is_named_in_the_code_outside_engine_models() -> None:
    stems = STEMS + tuple(FAMILIES)
    found = []
    for place in FAMILY_FREE:
        path = ROOT / place
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            found += [f"{f.relative_to(ROOT)}: {n!r}" for n in _code_names(f) if any(s in n.lower() for s in stems)]
    assert not found, "\n".join(found)


def test_the_scan_sees_a_family_name() -> None:
    """The check above can fail: a module that picks a family by name is caught."""
    probe = ROOT / "engine" / "models" / "gemma3.py"
    assert any("gemma" in n for n in _code_names(probe))
