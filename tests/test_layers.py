"""The layers of DESIGN (docs/architecture.md) hold in the source, not just at import time: a function-level or
lazy import would pass an import-time check, so these read every module's syntax tree."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dovetail"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its syntax tree."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def modules_under(*parts: str) -> list[Path]:
    target = PACKAGE.joinpath(*parts)
    return sorted(target.rglob("*.py")) if target.is_dir() else [target]


def offending(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    hits = {}
    for path in paths:
        bad = sorted(m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in forbidden))
        if bad:
            hits[str(path.relative_to(PACKAGE))] = bad
    return hits


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        (("cost",), ("dovetail.graph", "dovetail.sched", "dovetail.exec", "torch", "ray")),
        (("graph",), ("dovetail.sched", "dovetail.exec", "torch", "ray")),
        (("sched",), ("dovetail.exec", "torch", "ray")),
        (("exec", "sim.py"), ("torch", "ray")),
        (("algo",), ("dovetail.sched", "dovetail.exec", "dovetail.graph", "ray")),
    ],
)
def test_layer_imports_only_downward(layer, forbidden):
    assert offending(modules_under(*layer), forbidden) == {}


def test_the_check_sees_function_level_imports(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from dovetail.sched.policy import Policy\n    return Policy\n")
    assert imported_modules(module) == {"dovetail.sched.policy"}
