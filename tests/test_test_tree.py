"""The test tree itself: every fixture name is defined once, shared code lives in a conftest (no test module
imports another), and the shipped runs' folder is named in one place (`tests.conftest.CACHED_RUNS`)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import CACHED_RUNS, ROOT

TESTS = ROOT / "tests"


def parsed() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(TESTS.rglob("*.py"))}


def fixture_names(tree: ast.Module) -> list[tuple[str, int]]:
    """(name, line) of each `@pytest.fixture` function, under its `name=` when it gives one."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            call = deco if isinstance(deco, ast.Call) else None
            if ast.unparse(call.func if call else deco) not in ("pytest.fixture", "fixture"):
                continue
            names = [
                k.value.value
                for k in (call.keywords if call else [])
                if k.arg == "name" and isinstance(k.value, ast.Constant)
            ]
            found.append(((names or [node.name])[0], node.lineno))
    return found


def test_no_fixture_name_is_defined_twice():
    where = defaultdict(list)
    for path, tree in parsed().items():
        for name, line in fixture_names(tree):
            where[name].append(f"{path.relative_to(ROOT)}:{line}")
    twice = {name: places for name, places in where.items() if len(places) > 1}
    assert not twice, twice


def test_the_checker_sees_a_fixture_defined_twice_and_a_renamed_one():
    tree = ast.parse(
        "import pytest\n@pytest.fixture\ndef a(): pass\n@pytest.fixture(scope='module', name='b')\n"
        "def c(): pass\ndef d(): pass\n"
    )
    assert fixture_names(tree) == [("a", 3), ("b", 5)]


def test_no_test_module_imports_another():
    """Helpers two modules share belong in a conftest, where pytest and every folder find them."""
    imported = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.module}"
        for path, tree in parsed().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1].startswith("test_")
    ]
    assert not imported, imported


def test_only_the_conftest_names_the_shipped_runs_folder():
    named = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path, tree in parsed().items()
        if path != TESTS / "conftest.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == CACHED_RUNS.name
    ]
    assert not named, named
