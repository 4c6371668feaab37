"""The package layering holds: wire models and settings import nothing above them, the
SDK imports only those (a client install never drags the server in), and the node /
control-plane layers never reach up into the API, CLI or benchmarks. A lazy import inside
a function counts: it is a dependency all the same. Imports under ``if TYPE_CHECKING``
do not (annotations only)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "dsec"

FOUNDATION = {"config", "errors", "ids", "models", "durable"}
CORE = {"state", "blobs", "images", "runtime", "net", "node", "checkpoints", "control", "accounting", "sim"}
TOP = {"api", "sdk", "cli", "bench"}

# Known and on purpose: `dsec serve --cluster` composes the API's services over the cluster router.
ALLOWED = {("cluster/serve.py", "api")}


def _package(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """Top-level dsec packages ``path`` imports, anywhere but under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n.split(".")[1] for n in names if n.startswith("dsec.") and n.count(".") >= 1}
    return out


def _forbidden(pkg: str) -> set[str]:
    if pkg in FOUNDATION:
        return (CORE | TOP | {"cluster", "testing"}) - FOUNDATION
    if pkg == "sdk":
        return CORE | {"api", "cli", "bench", "cluster", "testing"}
    if pkg in CORE:
        return TOP | {"cluster"}
    if pkg == "cluster":
        return {"sdk", "cli", "bench", "api"}
    return set()


def violations() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        pkg = _package(path)
        rel = str(path.relative_to(SRC))
        for dep in sorted(_imports(path) & _forbidden(pkg)):
            if (rel, dep) not in ALLOWED:
                found.append(f"{rel} imports dsec.{dep}")
    return found


def test_no_layer_imports_a_higher_one() -> None:
    assert violations() == []


def test_the_check_sees_lazy_imports_and_ignores_type_checking(tmp_path: Path) -> None:
    """The scanner itself: a function-local import counts, a TYPE_CHECKING one does not."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dsec.state.store import X\n"
                 "def f():\n    from dsec.api.app import y\n    import dsec.cli.main\n")
    assert _imports(f) == {"api", "cli"}
