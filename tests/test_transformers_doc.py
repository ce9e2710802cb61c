"""docs/transformers.md runs: every python block, in order, in one namespace, from a scratch folder; the saved
run opens with `load_run` and the model keeps its own attention implementation."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlens import load_run

DOC = Path(__file__).resolve().parent.parent / "docs" / "transformers.md"


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
    assert run.meta["policy"]["name"] == "snapkv" and len(run.decisions) == len(namespace["cache"].decisions) > 0
    assert run.meta["tokens"] == namespace["out"][0, namespace["ids"].shape[1]:].tolist()
    assert "decisions in the pressed generation" in out and "'answer':" in out
    assert namespace["model"].config._attn_implementation == "sdpa"
