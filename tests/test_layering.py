"""The import layering of DESIGN.md section 2: no module imports from a higher layer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"

# Which hybridflow packages each package may import (itself always allowed). DESIGN.md section 2.
L0 = {"protocol", "utils"}
ALLOWED: dict[str, set[str]] = {
    "protocol": {"utils"},
    "utils": set(),
    "config": L0,
    "algos": L0,
    "rewards": L0,
    "data": L0 | {"config"},
    "models": L0 | {"config"},
    "engine": L0 | {"config", "algos", "rewards", "data", "models"},
    "checkpoint": L0 | {"config", "algos", "rewards", "data", "models"},
    "workers": L0 | {"config", "algos", "rewards", "data", "models", "engine", "checkpoint"},
    "trainer": L0 | {"config", "algos", "rewards", "data", "models", "engine", "checkpoint", "workers"},
    "cli": L0
    | {"config", "trainer", "algos", "rewards", "data", "models", "engine", "checkpoint", "workers"},
}
# Third-party packages a low layer must not reach for (config is stdlib + yaml only).
FORBIDDEN_THIRD_PARTY = {
    "protocol": {"transformers", "ray", "yaml"},
    "utils": {"transformers", "ray", "yaml"},
    "config": {"torch", "transformers", "ray", "numpy"},
    "algos": {"transformers", "ray", "yaml"},
    "rewards": {"transformers", "ray", "yaml"},
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
