"""The layers: pdkernels <- engine <- transfer <- pd <- bench (an arrow: "may be imported by").

Read from the source with ast (nothing is imported, so no import side effects and no GPU needed),
every import counted, including those inside functions:
- a module imports only from its own layer and the layers below it;
- transfer/ imports from engine/ only engine.handoff, the boundary module, and that module's own
  imports stay CUDA-free (no pdkernels, no model, loader or attention);
- no import cycle among the project's modules;
- inside engine/, the rooms import down: the modules every room shares (engine/*.py: errors, codec, request,
  config, faults, arch, quantization, and the handoff boundary engine.handoff) at the bottom, then
  checkpoints/ <- core/ <- parallel/ <- layers/ <- models/ <- execution/ <- handoff/ (the ledger and the
  pages of an export or import), and engine.engine (LLMEngine) on top; the layers never name a model family;
- inside pd/, the rooms keep the same rule: the modules the whole server shares (pd/*.py) at the bottom,
  then http/ <- chat/ <- rank/ <- disagg/ <- frontend/ <- api/ <- router/ (`pdserve router`, its own
  process), the server's entry (pd/server.py), and
  tools/ (the pdserve command, the demo client, a server in a child process) on top.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("pdkernels", "engine", "transfer", "pd", "bench")
BOUNDARY = "engine.handoff"
BOUNDARY_MAY_IMPORT = {"engine.codec", "engine.errors", "engine.request"}
PD_ROOMS = (
    "pd", "pd.kv_events", "pd.http", "pd.chat", "pd.rank", "pd.disagg", "pd.frontend", "pd.api", "pd.router", "pd.server", "pd.tools"
)  # fmt: skip
PD_SHARED = {"pd", "pd.config", "pd.errors", "pd.flags", "pd.kv_transfer_config", "pd.lifecycle", "pd.messages"}
ENGINE_ROOMS = (
    "engine", "engine.checkpoints", "engine.core", "engine.parallel", "engine.layers", "engine.models",
    "engine.speculative", "engine.execution", "engine.handoff", "engine.engine",
)  # fmt: skip
ENGINE_SHARED = {
    "engine", "engine.errors", "engine.codec", "engine.request", "engine.config", "engine.faults", "engine.arch",
    "engine.quantization", "engine.handoff",
}  # fmt: skip


def _modules() -> dict[str, Path]:
    mods = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The project modules that path imports (a `from pkg import mod` counts as pkg.mod)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_the_tree_is_seen() -> None:
    assert {"engine.engine", "engine.handoff", "transfer.header", "pd.server", "pdkernels.checksum"} <= set(MODULES)
    assert "engine.handoff" in GRAPH["transfer.header"]


def _room(module: str) -> int:
    """The index in PD_ROOMS of a pd module's room (its sub-package; "pd" for the shared modules)."""
    if module == "pd.server":
        return PD_ROOMS.index(module)
    parts = module.split(".")
    return PD_ROOMS.index(".".join(parts[:2]) if len(parts) > 2 or module in PD_ROOMS else "pd")


def _upward(modules: set[str], level: Callable[[str], int]) -> list[str]:
    """Imports among modules that go to a higher level than the importer's."""
    return [
        f"{mod} imports {dep}"
        for mod in sorted(modules)
        for dep in sorted(GRAPH[mod] & modules)
        if level(dep) > level(mod)
    ]


def test_imports_point_down() -> None:
    wrong = _upward(set(GRAPH), _layer)
    assert not wrong, "\n".join(wrong)


def test_transfer_sees_the_engine_only_through_the_boundary() -> None:
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in GRAPH.items()
        if mod.startswith("transfer")
        for dep in sorted(deps)
        if dep.startswith("engine") and dep != BOUNDARY
    ]
    assert not wrong, "\n".join(wrong)


def test_the_boundary_stays_light() -> None:
    seen, todo = set(), [BOUNDARY]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(GRAPH[mod])
    assert seen - {BOUNDARY} <= BOUNDARY_MAY_IMPORT, sorted(seen)


def test_no_import_cycle() -> None:
    cycles = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(GRAPH[mod]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[mod] = 2

    for mod in sorted(GRAPH):
        if mod not in state:
            visit(mod)
    assert not cycles, "\n".join(cycles)


def _engine_room(module: str) -> int:
    """The index in ENGINE_ROOMS of an engine module's room (the shared modules and the boundary: "engine")."""
    if module in ENGINE_SHARED:
        return 0
    if module == "engine.engine":
        return ENGINE_ROOMS.index(module)
    return ENGINE_ROOMS.index(".".join(module.split(".")[:2]))


# layer -> (its rooms in order, its shared top-level modules, its entry module on top, its room index)
ROOMED = {
    "pd": (PD_ROOMS, PD_SHARED, "pd.server", _room),
    "engine": (ENGINE_ROOMS, ENGINE_SHARED - {"engine.handoff"}, "engine.engine", _engine_room),
}


@pytest.mark.parametrize("layer", sorted(ROOMED))
def test_rooms_import_down(layer: str) -> None:
    wrong = _upward({mod for mod in GRAPH if mod.split(".")[0] == layer}, ROOMED[layer][3])
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("layer", sorted(ROOMED))
def test_top_level_holds_only_what_the_rooms_share(layer: str) -> None:
    order, shared, entry, _ = ROOMED[layer]
    top = {mod for mod, path in MODULES.items() if mod.startswith(layer) and path.parent == ROOT / layer}
    rooms = {f"{layer}.{p.name}" for p in (ROOT / layer).iterdir() if (p / "__init__.py").is_file()}
    assert top - {entry} == shared
    assert rooms == set(order) - {layer, entry}  # a new room takes its place in the order
