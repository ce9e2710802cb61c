"""`kvlens.eval`: lm-eval's HF model under kvlens caches, on the shipped tasks (local JSON data), offline.

With the full cache the scores and the generated text are lm-eval's own `HFLM`'s on the same model; with a
compressing policy every request's cache holds at most its budget, read from its decision log.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvlens
import kvlens.eval
from kvlens.cli import main
from kvlens.errors import KvlensError

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kvlens.eval import require_lm_eval, shipped  # noqa: E402
from kvlens.eval.lm import KvlensLM  # noqa: E402

pytestmark = pytest.mark.slow
TASKS = ["kvlens_passkey", "kvlens_cloze"]  # one generate_until task, one loglikelihood task


@pytest.fixture(scope="module")
def eval_model():
    """The embedded model as lm-eval's HFLM would load it (float32, SDPA) and its tokenizer."""
    path = kvlens.model_path()
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(path)


def _evaluate(lm, folder, limit: int) -> dict:
    manager = TaskManager(include_path=str(shipped.write_tasks(folder)))
    return lm_eval.simple_evaluate(
        model=lm, tasks=TASKS, limit=limit, task_manager=manager, bootstrap_iters=0
    )


def test_the_full_cache_scores_exactly_as_lm_evals_own_hf_model(eval_model, tmp_path, no_network):
    model, tok = eval_model
    theirs = _evaluate(HFLM(pretrained=model, tokenizer=tok, batch_size=1), tmp_path, limit=3)
    lm = KvlensLM(model, policy="full", tokenizer=tok)
    ours = _evaluate(lm, tmp_path, limit=3)
    assert all(r.kept_slots == r.fed and r.budget is None for r in lm.requests)  # nothing evicted
    assert ours["results"] == theirs["results"]
    assert {m for m in ours["results"]["kvlens_cloze"]} >= {"acc,none", "acc_norm,none"}
    said = [[s["resps"] for s in run["samples"]["kvlens_passkey"]] for run in (ours, theirs)]
    assert said[0] == said[1] and all(r[0][0] for r in said[0])  # the same, non-empty, generated text
    assert no_network == []


def test_a_compressing_policy_keeps_every_requests_budget(eval_model, tmp_path, no_network):
    model, tok = eval_model
    lm = KvlensLM(model, policy="snapkv", ratio=0.5, tokenizer=tok)
    _evaluate(lm, tmp_path, limit=2)
    assert {r.kind for r in lm.requests} == {"generate_until", "loglikelihood"}
    assert len(lm.requests) == 2 + 2 * 4  # two prompts, two contexts of four choices each
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    for r in lm.requests:
        assert r.budget == int(r.prompt_tokens * 0.5)  # kvpress's kept count
        evicted = r.decisions.groupby(["layer", "kv_head"]).size()
        assert len(evicted) == layers * heads
        # SnapKV's protocol: the prompt compressed once to its budget, then each fed token appended
        assert (r.prompt_tokens - evicted).max() <= r.budget and set(r.decisions.step) == {0}
    assert no_network == []


def test_kvlens_eval_writes_lm_evals_results_and_kvlens_summary(tmp_path, capsys, no_network):
    """A user's own task from --include-path (the shipped cloze task under another name), under snapkv."""
    mine = tmp_path / "mine"
    mine.mkdir()
    shipped_yaml = (shipped.write_tasks(tmp_path / "data") / "kvlens_cloze.yaml").read_text()
    (mine / "my_cloze.yaml").write_text(shipped_yaml.replace("task: kvlens_cloze", "task: my_cloze"))
    out = tmp_path / "out"
    argv = ["eval", "--tasks", "my_cloze", "--policy", "snapkv", "--ratio", "0.5", "--limit", "1"]
    assert main([*argv, "--include-path", str(mine), "--out", str(out), "--device", "cpu"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["results"]["my_cloze"]) >= {"acc,none", "acc_norm,none"}
    summary = json.loads((out / "kvlens.json").read_text())
    assert summary["policy"] == "snapkv" and summary["requests"] == 4
    assert 0.4 < summary["kept_share"] < 0.6
    assert "my_cloze: acc" in capsys.readouterr().out


def test_batches_an_unknown_task_and_a_missing_extra_get_one_sentence(tmp_path, monkeypatch, capsys):
    with pytest.raises(KvlensError, match="^kvlens evaluates one request at a time.*not 4"):
        kvlens.eval.KvlensLM(None, policy="full", batch_size=4)
    assert main(["eval", "--tasks", "no_such_task", "--policy", "full", "--out", str(tmp_path)]) == 2
    assert "lm-eval has no task no_such_task" in capsys.readouterr().err
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(KvlensError, match=r"pip install 'kvlens\[eval\]'"):
        require_lm_eval()
    assert main(["eval", "--tasks", "kvlens_cloze", "--policy", "full", "--out", str(tmp_path)]) == 2
    assert "needs lm-evaluation-harness, the optional extra" in capsys.readouterr().err
