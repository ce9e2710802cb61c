"""Output perturbation (`--measure`): shadow full cache, O_used / O_evict vs O_full, attention loss, KL."""

from __future__ import annotations

import json

import pytest
import torch

from kvlens.engine.loop import RunOptions, run
from kvlens.engine.perturbation import measured, summary
from kvlens.policies import make_policy

IDS = list(b"Attention sinks and heavy hitters keep the cache small. " * 3)
NAMES = ("used", "evict", "attention_loss")


def measure(model, name, params=None, budget=20, steps=16):
    policy = make_policy(name, params)

    def go(obs, cb):
        return run(
            model,
            policy,
            IDS,
            prefill=80,
            steps=steps,
            teacher=True,
            observers=obs,
            on_step=cb,
            opts=RunOptions(budget=None if policy.budget_free or name == "full" else budget),
        )

    return measured(model, go)


def test_full_has_zero_perturbation_and_zero_kl(tiny):
    r = measure(tiny, "full")
    for n in NAMES:
        t = r.tensors[f"perturbation/{n}"]
        assert t.shape == (15, 3, 4) and float(t.abs().max()) < 1e-5
    assert r.tensors["perturbation/kl"].shape == (16,) and float(r.tensors["perturbation/kl"].max()) < 1e-6
    assert r.metrics["kl"] < 1e-6 and len(r.metrics["perturbation_used_per_layer"]) == 3


@pytest.mark.parametrize("name,params", [("streaming_llm", {}), ("h2o", {}), ("cam", {"mask": "never"})])
def test_without_merges_used_equals_evict_and_eviction_perturbs(tiny, name, params):
    r = measure(tiny, name, params)
    used, evict = r.tensors["perturbation/used"], r.tensors["perturbation/evict"]
    torch.testing.assert_close(used, evict, atol=1e-5, rtol=1e-4)
    assert r.metrics["perturbation_used"] > 0.01 and r.metrics["kl"] > 0
    assert r.metrics["merge_better_share"] == r.metrics["merge_worse_share"] == 0  # float noise is a tie
    assert set(r.metrics["merge_sign_per_layer"]) == {0}
    loss = r.tensors["perturbation/attention_loss"]
    assert float(loss.min()) >= -1e-6 and float(loss.max()) <= 1 and r.metrics["attention_loss"] > 0


def test_cam_differs_from_eviction_only_after_its_first_merge(tiny):
    r = measure(tiny, "cam", {"mask": "always", "prefill": "evict"})  # step 0 evicts, decode steps merge
    used, evict = r.tensors["perturbation/used"], r.tensors["perturbation/evict"]
    torch.testing.assert_close(used[0], evict[0], atol=1e-5, rtol=1e-4)  # before any merge
    assert float((used[1:] - evict[1:]).abs().max()) > 1e-3
    # same decisions and, in layer 0, the same queries (teacher forcing): the same attention loss there
    plain = measure(tiny, "streaming_llm")
    assert r.tensors["steps/kv_slots"].equal(plain.tensors["steps/kv_slots"])
    torch.testing.assert_close(
        r.tensors["perturbation/attention_loss"][:, 0], plain.tensors["perturbation/attention_loss"][:, 0]
    )


def test_kl_is_against_a_full_pass_on_the_same_tokens(tiny):
    r = measure(tiny, "h2o", budget=12)
    full = run(tiny, make_policy("full"), IDS, prefill=80, steps=16, teacher=True, opts=RunOptions())
    assert r.tensors["perturbation/kl"][0] == pytest.approx(0, abs=1e-6)  # the prefill's logits are shared
    # KL from the logged nll: E_full[log p_full - log p_policy] >= 0, and large where nll moved most
    assert float(r.tensors["perturbation/kl"].min()) >= 0
    moved = (r.tensors["steps/nll"] - full.tensors["steps/nll"]).abs()
    assert (float(r.tensors["perturbation/kl"].sum()) > 0) == (float(moved.sum()) > 0)


def test_ppl_measure_json_keys(tiny, monkeypatch, capsys, tmp_path):
    from kvlens.cli import main

    text = tmp_path / "t.txt"
    text.write_bytes(bytes(IDS))
    monkeypatch.setattr("kvlens.cli.run_commands.load", lambda args: tiny)
    out = tmp_path / "run"
    assert (
        main(
            [
                "ppl",
                "--policy",
                "cam",
                "--budget",
                "20",
                "--text-file",
                str(text),
                "--prefill",
                "80",
                "--tokens",
                "8",
                "--measure",
                "--json",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    for key in (
        "perturbation_used",
        "perturbation_evict",
        "attention_loss",
        "kl",
        "perturbation_used_median",
        "perturbation_evict_median",
        "perturbation_used_pooled",
        "perturbation_evict_pooled",
        "base_ppl",
        "base_perturbation_used",
        "base_perturbation_used_pooled",
        "base_kl",
    ):
        assert isinstance(result[key], float), key
    better, worse = result["merge_better_share"], result["merge_worse_share"]
    assert 0 <= better <= 1 and 0 <= worse <= 1 and better + worse <= 1
    assert result["kl_steps"] == 7 and result["base_policy"] == "streaming_llm"
    assert set(result["merge_sign_per_layer"]) <= {-1, 0, 1} and len(result["merge_sign_per_layer"]) == 3
    # the separate base run is streaming_llm's own measured run: same numbers as running it directly
    assert (
        main(
            [
                "ppl",
                "--policy",
                "streaming_llm",
                "--budget",
                "20",
                "--text-file",
                str(text),
                "--prefill",
                "80",
                "--tokens",
                "8",
                "--measure",
                "--json",
            ]
        )
        == 0
    )
    base = json.loads(capsys.readouterr().out)
    assert result["base_ppl"] == base["ppl"] and result["base_perturbation_used"] == base["perturbation_used"]
    assert "base_ppl" not in base  # an eviction policy has no base
    assert len(result["perturbation_used_per_layer"]) == len(result["perturbation_evict_per_layer"]) == 3
    from kvlens import load_run

    saved = load_run(out)
    assert saved.tensors["perturbation/used"].shape == (7, 3, 4) and "perturbation/kl" in saved.tensors


def test_generate_measure_scores_the_generated_tokens(tiny):
    from kvlens.experiments.api import generate

    opts = RunOptions(budget=20, max_new_tokens=8, stop_at_eos=False)
    r = generate(tiny, bytes(IDS[:80]).decode(), "tova", opts=opts, measure=True)
    assert len(r.meta.tokens) == 8 and r.tensors["perturbation/used"].shape == (7, 3, 4)
    assert r.metrics["kl"] >= 0 and r.metrics["perturbation_used"] > 0


def test_summary_medians_pooled_shares_signs_and_kl_without_entry_0():
    used = torch.tensor([[[0.1, 0.5], [0.2, 0.2]], [[0.3, 0.1], [0.4, 0.2]]])  # (steps 2, layers 2, heads 2)
    evict = torch.tensor([[[0.2, 0.4], [0.2, 0.1]], [[0.1, 0.2], [0.4, 0.3]]])
    norm = torch.tensor([[[1.0, 3.0], [2.0, 2.0]], [[1.0, 1.0], [2.0, 4.0]]])
    tensors = {
        "perturbation/used": used,
        "perturbation/evict": evict,
        "perturbation/full_norm": norm,
        "perturbation/attention_loss": torch.zeros(2, 2, 2),
        "perturbation/kl": torch.tensor([0.0, 0.3, 0.1]),
    }
    m = summary(tensors)
    assert m["perturbation_used"] == pytest.approx(2.0 / 8) and m[
        "perturbation_used_median"
    ] == pytest.approx(0.2)
    # sum |dO| / sum |O_full|: used (0.1 + 1.5 + 0.4 + 0.4 + 0.3 + 0.1 + 0.8 + 0.8) / 16
    assert m["perturbation_used_pooled"] == pytest.approx(4.4 / 16)
    assert m["perturbation_evict_pooled"] == pytest.approx(
        (0.2 + 1.2 + 0.4 + 0.2 + 0.1 + 0.2 + 0.8 + 1.2) / 16
    )
    assert m["merge_better_share"] == pytest.approx(3 / 8) and m["merge_worse_share"] == pytest.approx(3 / 8)
    # layer 0: used 2.0 vs evict 1.7 of 6 (worse, -1); layer 1: used 2.4 vs evict 2.6 of 10 (better, +1)
    assert m["merge_sign_per_layer"] == [-1, 1]
    assert (
        m["kl"] == pytest.approx(0.2) and m["kl_steps"] == 2
    )  # entry 0 (the shared prefill logits) left out


def test_generate_measure_records_the_base_run_in_run_json(tiny, monkeypatch, capsys, tmp_path):
    from kvlens import load_run
    from kvlens.cli import main

    monkeypatch.setattr("kvlens.cli.run_commands.load", lambda args: tiny)
    prompt = bytes(IDS[:80]).decode()
    assert (
        main(
            [
                "generate",
                "--policy",
                "cam",
                "--budget",
                "20",
                "--prompt",
                prompt,
                "--max-new-tokens",
                "6",
                "--measure",
                "--out",
                str(tmp_path / "cam"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "generate",
                "--policy",
                "streaming_llm",
                "--budget",
                "20",
                "--prompt",
                prompt,
                "--max-new-tokens",
                "6",
                "--measure",
                "--out",
                str(tmp_path / "base"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    cam, base = load_run(tmp_path / "cam").metrics, load_run(tmp_path / "base").metrics
    assert cam["base_policy"] == "streaming_llm" and cam["base_ppl"] == base["ppl"]
    assert cam["base_perturbation_used_pooled"] == base["perturbation_used_pooled"] and "base_ppl" not in base
