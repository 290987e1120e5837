"""An algorithm module never imports another algorithm's module: helpers shared by algorithms
live in the bases and shared modules (``ast`` only: nothing is imported)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator/strategies", "edge_agent/algorithms")
REGISTERS = {"register_strategy", "register_edge_algorithm"}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _registers(tree: ast.Module) -> bool:
    """Whether the module registers an algorithm (a decorator ``@register_*("name")``)."""
    return any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id in REGISTERS
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for d in node.decorator_list
    )


def _algorithm_modules() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            if _registers(tree):
                found[_module(path)] = tree
    return found


def _imports(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


ALGORITHMS = _algorithm_modules()


def _home(module: str) -> str:
    """An algorithm's package (``coordinator.strategies.fedktl``) or its module."""
    parts = module.split(".")
    return ".".join(parts[:3])


def test_the_algorithm_modules_are_found() -> None:
    # the scan sees both halves of algorithms kept as modules and as packages
    assert {"coordinator.strategies.fedavg", "coordinator.strategies.felo.strategy"} <= set(
        ALGORITHMS
    )
    assert {"edge_agent.algorithms.fedproto", "edge_agent.algorithms.fml"} <= set(ALGORITHMS)
    assert "coordinator.strategies.weight_averaging" not in ALGORITHMS  # shared: registers none


@pytest.mark.parametrize("module", sorted(ALGORITHMS))
def test_an_algorithm_imports_no_other_algorithm(module: str) -> None:
    own = _home(module)
    others = {_home(m) for m in ALGORITHMS} - {own}
    bad = sorted(
        name
        for name in _imports(ALGORITHMS[module])
        if any(name == o or name.startswith(o + ".") for o in others)
    )
    assert not bad, f"{module} imports another algorithm's module: {bad}"
