"""Two runs at once on one shared model get exactly what each gets alone (no shared state in the hook)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvlens.engine.loop import RunOptions, run
from kvlens.policies import make_policy

JOBS = [
    ("h2o", 12, b"Two researchers share one workstation. "),
    ("tova", 9, b"Attention is all you need, said the paper. "),
    ("scissorhands", 14, b"Merging keeps information that eviction throws away. "),
]


def _go(model, name, budget, text):
    ids = list(text * 3)
    r = run(
        model,
        make_policy(name),
        ids,
        prefill=50,
        steps=40,
        teacher=False,
        opts=RunOptions(
            budget=budget, temperature=0.8, seed=7, stop_at_eos=False, record="attention", record_layers=[1]
        ),
    )
    return r.meta.tokens, r.decisions, r.tensors["attn/1"]


def test_concurrent_runs_match_their_single_thread_results(tiny):
    alone = [_go(tiny, *job) for job in JOBS]
    results: dict[int, tuple] = {}
    barrier = threading.Barrier(len(JOBS))

    def worker(i):
        barrier.wait()
        results[i] = _go(tiny, *JOBS[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(JOBS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (tokens, decisions, attn) in enumerate(alone):
        got_tokens, got_decisions, got_attn = results[i]
        assert got_tokens == tokens
        assert got_decisions.equals(decisions)
        assert (got_attn == attn).all()


@pytest.mark.slow
def test_concurrent_runs_on_the_embedded_model(smol):
    prompts = ["The Constitution of the United States", "In the beginning of the year"]

    def go(prompt, name):
        ids = smol.tokenizer(prompt).input_ids
        return run(
            smol, make_policy(name), ids, prefill=len(ids), steps=16, teacher=False, opts=RunOptions(budget=6)
        ).meta.tokens

    alone = [go(p, n) for p, n in zip(prompts, ("h2o", "tova"))]
    out = {}
    names = ("h2o", "tova")
    threads = [
        threading.Thread(target=lambda i=i: out.update({i: go(prompts[i], names[i])})) for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[0], out[1]] == alone


def test_two_processes_converting_the_embedded_model_at_once_both_get_it(tmp_path, monkeypatch):
    """The second rename of a conversion finds the first one's directory in place: it uses that one and leaves
    no temporary directory, where it used to fail with "Directory not empty"."""
    import os

    from kvlens.engine import models

    monkeypatch.setenv("KVLENS_CACHE", str(tmp_path))
    real_replace = os.replace

    def other_process_first(src, dst):
        os.makedirs(dst)
        (Path(dst) / "config.json").write_text("{}")  # the other process's finished conversion
        real_replace(src, dst)  # now fails: the target is a directory that is not empty

    monkeypatch.setattr(
        models, "_write_converted", lambda gguf, out: (out / "config.json").write_text("mine")
    )
    monkeypatch.setattr(models.os, "replace", other_process_first)
    target = models.convert_gguf(models.default_gguf())
    assert (target / "config.json").read_text() == "{}"
    assert [p.name for p in target.parent.iterdir()] == [target.name]
