"""docs/transformers.md and the README's transformers block run as written, from a scratch folder; the saved
run opens with `load_run` and the model keeps its own attention implementation."""

from __future__ import annotations

import re

import pytest

from kvlens import load_run
from tests.conftest import ROOT

DOC = ROOT / "docs" / "transformers.md"


@pytest.mark.slow
def test_every_block_of_the_transformers_doc_runs_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cells = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(cells) == 3
    namespace: dict = {}
    for i, code in enumerate(cells):
        exec(compile(code, f"docs/transformers.md block {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out
    run = load_run(tmp_path / "runs" / "mine")
    assert run.meta.policy.name == "snapkv" and len(run.decisions) == len(namespace["cache"].decisions) > 0
    assert run.meta.tokens == namespace["out"][0, namespace["ids"].shape[1] :].tolist()
    assert "decisions in the pressed generation" in out and "'answer':" in out
    assert namespace["model"].config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_the_readmes_transformers_example_runs_as_written(tmp_path, monkeypatch):
    """The README's block, as a new user would paste it: the run it saves opens with `load_run`."""
    readme = (DOC.parent.parent / "README.md").read_text()
    section = readme.split("## In your transformers code\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md (transformers)", "exec"), namespace)
    run = load_run(tmp_path / "runs" / "mine")
    assert run.meta.tokens == namespace["out"][0, namespace["ids"].shape[1] :].tolist()
    assert run.meta.policy.name == "snapkv" and len(run.decisions) > 0
