"""Cache patching (`kvlens explain`): structural facts exact, floats within float rounding (1e-4 on
log-probs and logits of the embedded model in float32; the recovered share of the all-groups restore
within 1e-3 of 1)."""

from __future__ import annotations

import json

import pytest
import torch

from kvlens.cli import main
from kvlens.engine.batch_answer import _BatchContext, _forward, score_many
from kvlens.experiments.bench import ruler
from kvlens.explain.case import build, file_sample, sample_case
from kvlens.explain.explain import explain_built
from kvlens.explain.groups import make_groups
from kvlens.explain.patch import patched, without
from kvlens.texts import bundled
from tests.conftest import CACHED_RUNS, one_sentence

ROUNDING = 1e-4


@pytest.fixture(scope="module")
def samples(smol, tmp_path_factory):
    """Two short niah_single samples (384 tokens)."""
    count = lambda s: len(smol.tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    path = tmp_path_factory.mktemp("explain") / "samples.jsonl"
    ruler.write_samples(
        [ruler.generate("niah_single", 384, i, count, " ".join(bundled().values())) for i in range(2)], path
    )
    return path


@pytest.fixture(scope="module")
def snapkv(smol, samples):
    return build(sample_case(smol, file_sample(samples, 0), "snapkv", 0.75, about={"index": 0}))


def logits_of(built, caches) -> torch.Tensor:
    """`(B, k, V)` logits of the scored tokens, from one batched forward over `caches`."""
    with torch.inference_mode():
        ctx = _BatchContext(caches, len(built.ids))
        ids = torch.tensor([built.ids] * len(caches))
        return _forward(built.case.model, ctx, ids, built.start, built.scored + 1).float()


def test_the_needle_is_a_group_of_the_samples_needle_tokens(snapkv, smol):
    ((start, end),) = snapkv.case.needles
    assert snapkv.case.sample.answers[0][0] in smol.tokenizer.decode(snapkv.case.context[start:end])
    groups = make_groups(snapkv.pair, ["needle", "sinks", "needle-head"], needles=snapkv.case.needles)
    assert [g.kind for g in groups[:2]] == ["needle", "sinks"] and len(groups) == 2 + 30 * 3
    assert not groups[0].mask[..., :start].any() and not groups[0].mask[..., end:].any()
    cells = torch.stack([g.mask for g in groups[2:]])
    assert (
        torch.equal(cells.any(0), groups[0].mask) and int(cells.sum()) == groups[0].slots
    )  # split, not copied


def test_restoring_every_group_gives_the_full_cache(snapkv):
    pair = snapkv.pair
    restored = patched(pair, pair.removed)
    for (kf, vf, _, pf), (k, v, valid, pos) in zip(pair.full.layers, restored.layers, strict=True):
        assert (valid.sum(1) == pf.shape[1]).all()  # every position, once
        order = torch.where(valid, pos, pos.max() + 1).argsort(1)[:, : pf.shape[1]]
        assert torch.equal(pos.gather(1, order), pf)
        assert torch.equal(k.gather(1, order[..., None].expand(-1, -1, k.shape[-1])), kf)
        assert torch.equal(v.gather(1, order[..., None].expand(-1, -1, v.shape[-1])), vf)
    full, patch = logits_of(snapkv, [pair.full, restored])
    assert (full - patch).abs().max() < ROUNDING
    groups = make_groups(pair, ["layer"])
    union = torch.stack([g.mask for g in groups]).any(0)
    assert torch.equal(union, pair.removed)  # the layers' groups cover every removal, each once
    assert sum(g.slots for g in groups) == int(pair.removed.sum())


def test_restoring_no_group_is_the_compressed_cache(snapkv):
    pair = snapkv.pair
    none = patched(pair, torch.zeros_like(pair.removed))
    assert all(a is b for a, b in zip(none.layers, pair.compressed.layers, strict=True))
    assert torch.equal(*logits_of(snapkv, [pair.compressed, none]))
    full, reverse = logits_of(snapkv, [pair.full, without(pair, torch.zeros_like(pair.removed))])
    assert (full - reverse).abs().max() < ROUNDING  # removing no group from the full cache: the full cache


def test_recovered_shares_hold_at_their_ends(snapkv):
    result = explain_built(snapkv, ["layer", "span"], span=64, reverse=True)
    assert abs(result["all_groups"]["recovered_share"] - 1) < 1e-3
    assert result["no_groups"]["recovered_share"] == 0.0
    assert result["lp_full"] > result["lp_compressed"]
    assert len([g for g in result["groups"] if g["kind"] == "layer"]) == 30
    assert sum(g["slots"] for g in result["groups"] if g["kind"] == "span") == result["slots_removed"]
    assert all("removed_share" in g for g in result["groups"])


@pytest.mark.parametrize("policy", ["cam", "d2o"])
def test_a_merged_slots_restore_gives_back_its_original_key_and_value(smol, samples, policy):
    built = build(sample_case(smol, file_sample(samples, 1), policy, 0.5, about={"index": 1}))
    pair = built.pair
    targets = torch.zeros(pair.removed.numel(), dtype=torch.bool)
    targets[pair.links[1]] = True  # from provenance: the positions the decision log says received a merge
    # (layer, head, position, slot) of merge targets the compressed cache holds with another key/value
    kept = []
    for layer, head, position in torch.nonzero(pair.removed & targets.view(pair.shape)).tolist():
        kc, vc, ok, pc = pair.compressed.layers[layer]
        slots = torch.nonzero((pc[head] == position) & ok[head])[:, 0]
        full = torch.stack(
            [pair.full.layers[layer][0][head, position], pair.full.layers[layer][1][head, position]]
        )
        if len(slots) and not torch.equal(torch.stack([kc[head, slots[0]], vc[head, slots[0]]]), full):
            kept.append((layer, head, position, int(slots[0])))
    assert kept, "no merge target was changed"
    layer, head, position, slot = kept[0]
    kc, vc = pair.compressed.layers[layer][:2]
    kf, vf = pair.full.layers[layer][0][head, position], pair.full.layers[layer][1][head, position]
    assert not torch.equal(vc[head, slot], vf) or not torch.equal(kc[head, slot], kf)  # it was merged
    merged = next(g for g in make_groups(pair, ["kind"]) if g.name == "merged")
    k, v, valid, pos = patched(pair, merged.mask).layers[layer]
    back = int(torch.nonzero((pos[head] == position) & valid[head])[0])
    assert torch.equal(k[head, back], kf) and torch.equal(v[head, back], vf)
    assert int(((pos[head] == position) & valid[head]).sum()) == 1


def test_a_threshold_policy_is_explained_at_the_budget_its_own_rule_reached(smol, samples):
    """kvzap's threshold mode has no budget: explain takes no ratio, removes per head what scores below the
    threshold outside the window, and restoring every group closes the gap."""
    case = sample_case(smol, file_sample(samples, 0), "kvzap:mode=threshold", None, about={"index": 0})
    built = build(case)
    removed = built.pair.removed  # (L, Hkv, T)
    assert case.budget is None and case.about["ratio"] is None
    assert not removed[..., -128:].any() and removed.any()
    assert len(set(removed.sum(-1).flatten().tolist())) > 1  # each head keeps as many as pass
    out = explain_built(built, ["layer"])
    assert out["budget"] is None and out["slots_removed"] == int(removed.sum())
    assert out["all_groups"]["recovered_share"] == pytest.approx(1.0, abs=1e-3)


def test_patched_caches_in_a_batch_equal_each_alone(snapkv):
    pair = snapkv.pair
    masks = [g.mask for g in make_groups(pair, ["layer"])[::7]]
    caches = [patched(pair, m) for m in masks] + [pair.compressed]
    batch_lp, batch_greedy = score_many(caches, snapkv.ids, snapkv.start, snapkv.scored)
    for i, cache in enumerate(caches):
        lp, greedy = score_many([cache], snapkv.ids, snapkv.start, snapkv.scored)
        assert (lp[0] - batch_lp[i]).abs().max() < ROUNDING
        assert torch.equal(greedy[0], batch_greedy[i])


def test_the_command_prints_json_with_the_minimal_set_and_the_report_draws_it(
    snapkv, samples, tmp_path, capsys
):
    if snapkv.answers["compressed_right"] or not snapkv.answers["full_right"]:
        pytest.skip("this sample's compressed cache answers right")
    out = tmp_path / "why.json"
    assert (
        main(
            [
                "explain",
                "--samples",
                str(samples),
                "--index",
                "0",
                "--policy",
                "snapkv",
                "--ratio",
                "0.75",
                "--by",
                "layer,sinks,needle",
                "--find-minimal",
                "--minimal-by",
                "layer",
                "--json",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert (
        abs(result["all_groups"]["recovered_share"] - 1) < 1e-3
        and result["no_groups"]["recovered_share"] == 0
    )
    assert [g["kind"] for g in result["groups"]] == ["layer"] * 30 + ["sinks", "needle"]
    assert all({"kind", "name", "recovered_share", "slots"} <= set(g) for g in result["groups"])
    m = result["minimal"]
    assert m["found"] and m["right"] and 0 < m["slots"] <= result["slots_removed"]
    assert m["layers"] == sorted(int(g[1:]) for g in m["groups"])
    assert m["slots"] == sum(g["slots"] for g in result["groups"] if g["name"] in m["groups"])
    assert json.loads(out.read_text())["minimal"] == m
    html = tmp_path / "report.html"
    assert main(["report", "--explain", str(out), "--out", str(html)]) == 0
    text = html.read_text()
    assert "Why 1." in text and "Recovered share by layer" in text and "Minimal sufficient set" in text


def test_bad_input_is_one_sentence(samples, capsys, tmp_path):

    cases = [
        (["--run", str(CACHED_RUNS / "full-states")], "has no decisions"),
        (
            ["--samples", str(samples), "--index", "5", "--policy", "snapkv", "--ratio", "0.75"],
            "out of range",
        ),
        (["--samples", str(samples), "--policy", "snapkv", "--ratio", "0.75", "--span", "0"], "at least 1"),
        (
            ["--samples", str(samples), "--policy", "snapkv", "--ratio", "0.75", "--by", "row"],
            "Unknown grouping",
        ),
        (["--samples", str(samples), "--policy", "snapkv"], "give its compression ratio"),
        (["--samples", str(samples), "--ratio", "0.5"], "needs --policy"),
        (
            ["--samples", str(tmp_path / "none.jsonl"), "--policy", "snapkv", "--ratio", "0.5"],
            "no samples file",
        ),
    ]
    (tmp_path / "bad.json").write_text("{}")
    assert main(["report", "--explain", str(tmp_path / "bad.json"), "--out", str(tmp_path / "r.html")]) == 2
    assert "not a kvlens explain result" in capsys.readouterr().err
    for argv, message in cases:
        assert main(["explain", *argv]) == 2
        err = capsys.readouterr().err
        assert one_sentence(err) and message in err, err
