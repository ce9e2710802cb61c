"""The head grid (`kvlens.figures.head_grid`): every recorded layer and head at one step, against the run's
own tensors read independently; the per-layer status of `layer_cache` against `attention_grid`'s one-head
view."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlens import load_run
from kvlens.errors import KvlensError
from kvlens.figures.attention import EVICTED, HOLDS_MERGE, KEPT, MERGED_AWAY, layer_cache
from kvlens.figures.head_grid import METRICS, head_grid, rows_figure, summary_figure
from tests.conftest import CACHED_RUNS


@pytest.fixture(scope="module")
def adakv():
    return load_run(CACHED_RUNS / "adakv-heads")


def test_kept_share_is_the_cached_positions_of_each_kv_head_over_the_positions_seen(adakv):
    grid = head_grid(adakv)
    assert grid.layers == list(range(30)) and grid.heads == 9
    prompt = len(adakv.meta.prompt_tokens)
    for step in (0, 7, grid.steps - 1):
        kept = grid.metrics(step)["kept share"]
        for layer in (0, 14, 29):
            pos = adakv.tensor(f"attn_pos/{layer}")[step]  # (Hkv, Smax), -1 = empty slot
            for head in range(9):
                cached = len(set(pos[head // 3][pos[head // 3] >= 0].tolist()))
                assert kept[layer, head].item() == pytest.approx(cached / (prompt + step))
    shares = grid.metrics(grid.steps - 1)["kept share"]
    assert len(set(shares.flatten().tolist())) > 3  # Ada-KV gives heads of one layer different shares


def test_the_attention_strips_hold_each_heads_recorded_row_and_a_target_per_head(adakv):
    grid = head_grid(adakv)
    step = 5
    fig = rows_figure(grid, step)
    attention = next(t for t in fig.data if t.name == "attention")
    z = torch.as_tensor(attention.z)  # (L, Hq * (P + gap) - gap), log10 attention
    n_pos = grid.prompt_len + step
    width = (z.shape[1] + 3) // 9
    assert width == n_pos + 3  # one column per position (no pooling below 160), 3 blank between strips
    layer, head = 12, 7
    strip = z[layer, head * width : head * width + n_pos]
    attn = adakv.tensor(f"attn/{layer}")[step, head].float()
    pos = adakv.tensor(f"attn_pos/{layer}")[step, head // 3].long()
    expect = torch.full((n_pos,), float("nan"))
    expect[pos[pos >= 0]] = torch.log10(attn[pos >= 0].clamp(min=1e-6))
    torch.testing.assert_close(strip, expect, equal_nan=True)
    targets = next(t for t in fig.data if t.name == "heads")
    assert [list(c) for c in targets.customdata] == [[la, h] for la in range(30) for h in range(9)]
    assert f"at step {step} " in fig.layout.title.text


def test_long_rows_are_pooled_to_short_strips(adakv):
    grid = head_grid(adakv)
    from kvlens.figures import head_grid as module

    old = module.MAX_STRIP
    module.MAX_STRIP = 40
    try:
        fig = rows_figure(grid, grid.steps - 1)
    finally:
        module.MAX_STRIP = old
    n_pos = grid.prompt_len + grid.steps - 1
    z = next(t for t in fig.data if t.name == "attention").z
    assert (len(z[0]) + 3) // 9 - 3 == -(-n_pos // -(-n_pos // 40))  # ceil(P / block) columns per strip
    assert "blocks of" in fig.layout.title.text


def test_a_measured_run_adds_attention_lost_and_perturbation_one_row_behind(cam):
    grid = head_grid(cam)
    assert set(grid.metrics(3)) == set(METRICS)
    lost = cam.tensor("perturbation/attention_loss")  # (steps - 1, L, Hq): row k = attention row k + 1
    np.testing.assert_array_equal(
        grid.metrics(3)["attention mass lost"], lost[2, grid.layers].float().numpy()
    )
    assert np.isnan(grid.metrics(0)["output perturbation"]).all()  # step 0: no decode step measured
    merged = grid.metrics(20)["attention on merged slots"]
    assert merged.max() > 0.05  # CaM's merged slots draw attention
    fig = summary_figure(grid, 3, "attention mass lost")
    assert torch.as_tensor(fig.data[0].z).shape == (3, 9)


def test_bad_steps_and_metrics_get_one_sentence(adakv):
    grid = head_grid(adakv)
    with pytest.raises(KvlensError, match="Step 24 is out of range: this run recorded steps 0 to 23"):
        rows_figure(grid, 24)
    with pytest.raises(KvlensError, match="needs a measured run"):
        summary_figure(grid, 3, "output perturbation")
    with pytest.raises(KvlensError, match="Unknown head metric 'nope'"):
        summary_figure(grid, 3, "nope")


@pytest.mark.parametrize("name", ["cam-attention", "kvmerger-attention", "streaming_llm-attention"])
def test_layer_cache_status_follows_the_cache_and_the_decision_log(name):
    """Each status of every KV head, rebuilt from `attn_pos` and the merge rows of the decision log."""
    run = load_run(CACHED_RUNS / name)
    _, status = layer_cache(run, 15)
    d = run.decisions
    merges = d[(d["action"] == "merge") & (d["layer"] == 15) & (d["draw"] != 0)]
    prompt = len(run.meta.prompt_tokens)
    for row in (0, 10, status.shape[0] - 1):
        for kv in range(3):
            pos = run.tensor("attn_pos/15")[row, kv]
            present = set(pos[pos >= 0].tolist())
            done = merges[(merges["kv_head"] == kv) & (merges["step"] < row)]
            away = set(done["position"].tolist()) - present
            holds = present & {int(t) for ts in done["targets"] for t in ts}
            got = {
                code: set((status[row, kv] == code).nonzero().flatten().tolist())
                for code in (EVICTED, MERGED_AWAY, KEPT, HOLDS_MERGE)
            }
            assert got[MERGED_AWAY] == away and got[HOLDS_MERGE] == holds
            assert got[KEPT] | got[HOLDS_MERGE] == present - {
                p for p in present if status[row, kv, p] > HOLDS_MERGE
            }
            assert got[EVICTED] == set(range(prompt + row)) - present - away
    if name != "streaming_llm-attention":
        assert (status == MERGED_AWAY).any() and (status == HOLDS_MERGE).any()


def test_a_kvzap_threshold_run_opens_on_the_head_grid_with_each_heads_own_count(tiny):
    """Threshold mode's heads keep different counts: at decode step r each head's row covers the slots its
    cache kept after compression r - 1, plus the step's own token."""
    from kvlens.engine.loop import RunOptions, run
    from kvlens.policies import make_policy

    policy = make_policy("kvzap", {"mode": "threshold", "window": 8, "threshold": 0.0})
    r = run(
        tiny,
        policy,
        list(range(40, 140)),
        prefill=60,
        steps=10,
        teacher=True,
        opts=RunOptions(record="attention"),
    )
    grid, counts = head_grid(r), r.tensors["steps/kv_slots"].numpy()  # (steps, L, Hkv)
    assert len(np.unique(counts[-1])) > 1  # the heads differ
    group = grid.heads // counts.shape[2]
    for step in range(1, grid.steps):
        cached = (~np.isnan(grid.weights[step])).sum(-1)[:, ::group]  # (L, Hkv)
        assert (cached == counts[step - 1] + 1).all(), step
    summary_figure(grid, grid.steps - 1, "kept share")
