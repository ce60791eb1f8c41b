"""The import layering of docs/architecture.md: no module imports from a higher layer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"

# Which hybridflow packages each package may import (itself always allowed). docs/architecture.md, Layers.
L0 = {"protocol", "utils"}
L2 = L0 | {"config", "algos", "rewards", "tools", "data", "models"}  # L0 to L2
L3 = L2 | {"engine", "checkpoint"}  # L0 to L3
ALLOWED: dict[str, set[str]] = {
    "protocol": {"utils"},
    "utils": set(),
    "config": L0,
    "algos": L0,
    "rewards": L0,
    "tools": L0,
    "data": L0 | {"config"},
    "models": L0 | {"config"},
    "engine": L2,
    "checkpoint": L2,
    # the layout planner: beside the workers, below the trainer (it reads a config and the engine's accounting)
    "plan": L3,
    # the OpenAI-compatible endpoint on the rollout engine, its trajectories and the harness runner
    "serve": L3,
    "workers": L3 | {"serve"},
    "trainer": L3 | {"workers", "plan", "serve"},
    # the Python APIs (RLTrainer, the step-wise Trainer) and the built-in demos: above the trainer
    "api": L3 | {"workers", "plan", "trainer", "serve"},
    "demos": L3 | {"workers", "plan", "trainer", "serve"},
    "cli": L3 | {"workers", "plan", "trainer", "api", "demos", "serve"},
}
# Third-party packages a low layer must not reach for (config is stdlib + yaml only).
FORBIDDEN_THIRD_PARTY = {
    "protocol": {"transformers", "ray", "yaml"},
    "utils": {"transformers", "ray", "yaml"},
    "config": {"torch", "transformers", "ray", "numpy"},
    "algos": {"transformers", "ray", "yaml"},
    "rewards": {"transformers", "ray", "yaml"},
    "tools": {"transformers", "ray", "yaml"},
}


def _imports(path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """Absolute module names imported by a file, with line numbers (relative imports resolved)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + (1 if path.name == "__init__.py" else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((name, node.lineno))
    return out


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_layer() -> None:
    """A new top-level package must be placed in the layer table before it can be imported from."""
    packages = {p.relative_to(PACKAGE).parts[0] for p in _sources() if p.parent != PACKAGE}
    assert packages <= set(ALLOWED), f"add {sorted(packages - set(ALLOWED))} to ALLOWED in {__file__}"


def test_no_module_imports_a_higher_layer() -> None:
    """Each hybridflow.<pkg> imports only the packages its layer may import."""
    violations = []
    for path in _sources():
        if path.parent == PACKAGE:
            continue
        pkg = path.relative_to(PACKAGE).parts[0]
        for name, line in _imports(path):
            top = name.split(".")
            if top[0] == "hybridflow" and len(top) > 1 and top[1] != pkg and top[1] not in ALLOWED[pkg]:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
            if top[0] in FORBIDDEN_THIRD_PARTY.get(pkg, set()):
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not violations, "layering violations:\n" + "\n".join(violations)


# The engine's rooms (hybridflow/engine/__init__.py): which other rooms each may import.
ROOMS: dict[str, set[str]] = {
    "ops": set(),
    "parallel": {"ops"},
    "train": {"ops", "parallel"},
    "rollout": {"ops", "parallel"},
    "roles": {"ops", "parallel", "train"},
    "hybrid": {"ops", "parallel", "rollout", "train", "roles"},  # the hybrid actor owns all of them
}


def test_engine_rooms_import_only_the_rooms_below() -> None:
    """Training never imports the rollout, the rollout never imports training, nothing imports upwards."""
    engine = PACKAGE / "engine"
    rooms = {p.relative_to(engine).parts[0] for p in engine.rglob("*.py") if p.parent != engine}
    assert rooms == set(ROOMS), f"place {sorted(rooms ^ set(ROOMS))} in ROOMS of {__file__}"
    violations = []
    for path in sorted(engine.rglob("*.py")):
        if path.parent == engine:
            continue  # the package's surface
        room = path.relative_to(engine).parts[0]
        for name, line in _imports(path):
            parts = name.split(".")
            if parts[:2] == ["hybridflow", "engine"] and len(parts) == 2:
                violations.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} imports the surface from inside"
                )
            elif parts[:2] == ["hybridflow", "engine"] and parts[2] not in {room} | ROOMS[room]:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not violations, "engine room violations:\n" + "\n".join(violations)


def test_other_packages_use_the_engine_surface() -> None:
    """Outside engine/, names come from ``hybridflow.engine`` (its exported surface), not from its rooms."""
    deep = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in _sources()
        if path.parent != PACKAGE and path.relative_to(PACKAGE).parts[0] != "engine"
        for name, line in _imports(path)
        if name.startswith("hybridflow.engine.")
    ]
    assert not deep, "import these from hybridflow.engine:\n" + "\n".join(deep)


def _module_graph() -> dict[str, set[str]]:
    """hybridflow module -> the hybridflow modules it imports (anywhere in the file)."""
    modules = {}
    for path in _sources():
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
                graph[module] |= {n if n in modules else node.module for n in names} & set(modules)
            elif isinstance(node, ast.Import):
                graph[module] |= {a.name for a in node.names} & set(modules)
        graph[module].discard(module)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle() -> None:
    """No hybridflow module imports itself through others, at the top or inside a function."""
    cycle = _cycle(_module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle() -> None:
    """The search above can fail: a two-module cycle is found."""
    assert _cycle({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a", "b", "a"]


def test_ray_is_imported_in_at_most_one_module() -> None:
    """Ray lives behind one module of hybridflow.workers."""
    users = {
        str(path.relative_to(PACKAGE.parent))
        for path in _sources()
        for name, _ in _imports(path)
        if name.split(".")[0] == "ray"
    }
    assert len(users) <= 1, f"ray imported in {sorted(users)}"
    assert all(u.startswith("hybridflow/workers/") for u in users), users


def test_algos_and_rewards_never_take_config_objects() -> None:
    """algos and rewards are pure functions of plain values: they do not import hybridflow.config."""
    for path in _sources():
        pkg = path.relative_to(PACKAGE).parts[0] if path.parent != PACKAGE else ""
        if pkg in {"algos", "rewards"}:
            assert not any(n.startswith("hybridflow.config") for n, _ in _imports(path)), path


def test_layering_check_catches_a_violation() -> None:
    """The import parser sees both absolute and relative imports (so the check above can fail)."""
    probe = PACKAGE / "algos" / "probe.py"  # never written: only its place in the tree matters
    source = "from hybridflow.trainer import x\nfrom ..config import y\nfrom . import kl\n"
    names = [n for n, _ in _imports(probe, source)]
    assert names == ["hybridflow.trainer", "hybridflow.config", "hybridflow.algos"]


def test_import_hybridflow_is_light() -> None:
    """`import hybridflow` loads neither Ray nor transformers."""
    code = "import sys, hybridflow; print(sorted(m for m in ('ray', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
