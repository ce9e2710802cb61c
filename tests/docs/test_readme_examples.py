"""The "Adding a policy" example of docs/extending.md, saved as the one new file it names in a copy of the
repository, is listed, runs, is offered by the app with tooltips and passes the contract test. (`doc_example`
also serves the analysis and page examples of that file, tested in test_analysis and test_app.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, doc_example

COPIED = ["kvlens", "pages", "tests", "app.py", "pyproject.toml", ".streamlit"]


def sh(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def repo_with_example(tmp_path_factory) -> tuple[Path, str]:
    """A copy of the repository with the example's policy file added, and the policy's name."""
    repo = tmp_path_factory.mktemp("repo")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy(src, repo / name)
    path, code = doc_example("Adding a policy")
    assert not (ROOT / path).exists(), "the example must be a file the repository does not have"
    (repo / path).write_text(code)
    return repo, re.search(r'name = "(\w+)"', code).group(1)


@pytest.mark.slow
def test_readme_policy_is_listed_runs_and_passes_the_contract(repo_with_example):
    repo, name = repo_with_example
    listed = {r["name"]: r for r in json.loads(sh(["-m", "kvlens", "policies", "--json"], repo).stdout)}
    assert name in listed and all(p["help"] for p in listed[name]["parameters"])
    out = sh(
        [
            "-m",
            "kvlens",
            "ppl",
            "--policy",
            name,
            "--budget",
            "0.2",
            "--text-file",
            "kvlens/data/state_union/1961-Kennedy.txt",
            "--prefill",
            "128",
            "--tokens",
            "16",
            "--json",
        ],
        repo,
    )
    result = json.loads(out.stdout)
    assert result["ppl"] > 1 and result["kv_slots_max"] <= round(0.2 * 128)
    contract = sh(
        [
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/policies/test_policy_contract.py",
            "-k",
            name,
            "-m",
            "not slow",
        ],
        repo,
    )
    assert re.search(r"(\d+) passed", contract.stdout) and " failed" not in contract.stdout


@pytest.mark.slow
def test_readme_policy_is_offered_by_the_run_page_with_tooltips(repo_with_example):
    repo, name = repo_with_example
    script = textwrap.dedent(f"""
        from streamlit.testing.v1 import AppTest
        at = AppTest.from_file("app.py", default_timeout=120)
        at.run()
        at.switch_page("pages/run.py")
        at.run()
        at.selectbox(key="run_policy").set_value("{name}").run()
        assert not at.exception, [e.value for e in at.exception]
        for param in ("recent", "seed"):
            widget = at.number_input(key=f"run_{name}_{{param}}")
            assert widget.help, param
        print("ok")
    """)
    assert sh(["-c", script], repo).stdout.strip().endswith("ok")
