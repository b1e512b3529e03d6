"""trainer/loop's packages and the order they import in (issue 46).

From the top: ``start`` (the run, preflight, launch, restarts) > ``schedule`` (the
controller's step, pipeline, stream, validation timing) > ``ranks`` (the FSDP training ranks)
and ``engines`` (the rollout host's side), siblings that never import each other > ``weights``
(the weight path) > ``plan`` (pure plans from the config and the model) > ``cluster`` (Ray
plumbing). A module imports only modules of its own package or of a package below it, and no
import circle joins modules. Every import counts: at the top of a module, inside a function,
under ``TYPE_CHECKING``, and a string literal that names a module (``importlib``,
``run.DRIVER_MODULES``).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from trainer.loop.start import run

ROOT = Path(__file__).resolve().parents[1]
LOOP = ROOT / "trainer" / "loop"

#: Each package's layer, 0 the top: a package imports only packages of a larger number.
LEVEL = {
    "start": 0,
    "schedule": 1,
    "ranks": 2,
    "engines": 2,  # a sibling of ranks: neither imports the other
    "weights": 3,
    "plan": 4,
    "cluster": 5,
}


def _modules() -> dict[str, Path]:
    """Every module of trainer/loop by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(LOOP.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(module: str) -> str | None:
    """The layer package of ``module`` (``trainer.loop.<package>...``); None for trainer.loop."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else None


def _target(name: str) -> str | None:
    """The trainer/loop module ``name`` imports (the longest prefix that is one), or None."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def _imports(module: str) -> list[tuple[str, int]]:
    """``(imported trainer/loop module, line)`` for every import in ``module``'s file."""
    path = MODULES[module]
    here = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` imports the module, ``from module import name``
            # the module itself.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in MODULES:  # importlib.import_module("trainer.loop....")
                names = [node.value]
        for name in names:
            target = _target(name)
            if target is not None and target != module:
                out.append((target, node.lineno))
    return out


EDGES = {module: _imports(module) for module in MODULES}


@pytest.mark.parametrize("name", run.DRIVER_MODULES)
def test_every_driver_module_imports(name):
    """``run.DRIVER_MODULES`` are imported in the background while Ray starts: a name left
    behind by a move would be skipped there and imported on the critical path instead."""
    assert importlib.import_module(name).__name__ == name


def test_every_module_lives_in_a_layer_package():
    """A module outside the layer packages (or a new package) has no place in the order."""
    stray = [m for m in MODULES if m != "trainer.loop" and _package(m) not in LEVEL]
    assert not stray, f"modules outside {sorted(LEVEL)}: {stray}"
    assert {_package(m) for m in MODULES} - {None} == set(LEVEL)


def test_no_import_runs_up_or_between_ranks_and_engines():
    """Every import between packages goes down the order (so never between the siblings)."""
    wrong = []
    for module, targets in EDGES.items():
        src = _package(module)
        for target, line in targets:
            dst = _package(target)
            if src is None or dst is None or src == dst:
                continue
            if LEVEL[dst] <= LEVEL[src]:
                where = MODULES[module].relative_to(ROOT)
                wrong.append(f"{where}:{line}: {module} ({src}) imports {target} ({dst})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def _circles(graph: dict[str, list[str]]) -> list[str]:
    """Every import circle a depth-first walk of ``graph`` (module -> imported modules) meets,
    as ``a -> b -> a``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in graph[module]:
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    return circles


def test_no_import_circle_between_modules():
    """No module reaches itself through imports, at any depth."""
    circles = _circles({m: sorted({t for t, _ in EDGES[m]}) for m in MODULES})
    assert not circles, "import circles:\n" + "\n".join(circles)
    # the walk finds a circle where there is one
    assert _circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a -> b -> c -> a"]


def test_the_graph_is_read_from_every_kind_of_import():
    """The parser sees what the layer tests rely on: a function-level import (the rollout
    host's validation rollouts), a ``from package import module`` (the memory tracker's
    model loading) and a module named by a string (``run.DRIVER_MODULES``)."""
    host = {t for t, _ in EDGES["trainer.loop.engines.rollout_host"]}
    assert "trainer.loop.engines.validation_rollouts" in host
    tracker = {t for t, _ in EDGES["trainer.loop.ranks.memory_tracker"]}
    assert "trainer.loop.ranks.model_loading" in tracker
    assert set(run.DRIVER_MODULES) & set(MODULES) <= {t for t, _ in EDGES[run.__name__]}


def test_the_weight_path_tag_lives_in_weights():
    """``PUSHED`` (weights that came through the weight group) belongs to the weight path:
    the rollout host and the push's driver side (``weights.driver``, which the controller
    calls) both take it from ``weights``, and the controller imports nothing of the rollout
    host for it."""
    from trainer.loop.engines import rollout_host
    from trainer.loop.weights import weight_group

    assert rollout_host.PUSHED is weight_group.PUSHED
    assert "trainer.loop.weights.weight_group" in {
        t for t, _ in EDGES["trainer.loop.weights.driver"]
    }
    controller = {t for t, _ in EDGES["trainer.loop.schedule.controller"]}
    assert "trainer.loop.weights.driver" in controller
    assert "trainer.loop.engines.rollout_host" not in controller
