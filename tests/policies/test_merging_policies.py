"""Rules of the merging policies (CaM, WeightedKV, KVMerger) and CORM, their decision logs and provenance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.engine.loop import RunOptions, run
from kvlens.errors import KvlensError
from kvlens.figures.provenance import replay
from kvlens.kvcache import Phase, Prompt, Step
from kvlens.kvcache.views import SlotRows
from kvlens.policies import REGISTRY, make_policy, parse_settings
from kvlens.policies.cam import DECODE_ATTN, CaM
from kvlens.policies.corm import CORM, MESSAGE, MESSAGES_SEEN
from kvlens.policies.kvmerger import gaussian_weights, merging_sets
from kvlens.policies.scissorhands import HISTORY
from kvlens.runs.decisions import DecisionLog
from tests.conftest import examples, in_position_order, layer_rows, shrink

HKV, G, D = 2, 2, 8
IDS = list(b"Attention sinks and heavy hitters keep the cache small. " * 3)


def random_layer(seed: int, slots: int) -> SlotRows:
    """A layer of `slots` slots with random states."""
    gen = torch.Generator().manual_seed(seed)
    layer = layer_rows()
    layer.append(
        torch.randn(1, HKV, slots, D, generator=gen),
        torch.randn(1, HKV, slots, D, generator=gen),
        torch.arange(slots),
    )
    layer.abar = torch.rand(HKV, slots, generator=gen) * 5
    layer.nobs = torch.randint(1, 20, (HKV, slots), generator=gen).float()
    layer.last_attn = torch.softmax(torch.randn(HKV * G, slots, generator=gen), -1)
    return layer


def slot_of(layer: SlotRows, head: int, position: int) -> int:
    return int((layer.pos[head] == position).nonzero())


# ---------------------------------------------------------------- CaM


def hand_layer() -> SlotRows:
    """One KV head, one query head, a decode step of 7 slots (positions 0-6) with round statistics."""
    layer = layer_rows()
    values = torch.arange(7 * 2, dtype=torch.float32).view(1, 1, 7, 2)
    layer.append(torch.ones(1, 1, 7, 2), values, torch.arange(7))
    layer.abar = torch.tensor([[10.0, 4.0, 8.0, 6.0, 4.0, 2.0, 1.0]])
    layer.extra[DECODE_ATTN] = torch.tensor([[3.0, 1.0, 2.0, 2.0, 1.0, 1.0, 1.0]])
    layer.last_attn = torch.tensor([[0.3, 0.1, 0.2, 0.1, 0.1, 0.1, 0.1]])
    return layer


# base streaming_llm with one sink at budget 6 evicts position 1; its local window is positions 2-6.
# p and the weight each of 2-6 receives, computed by hand from hand_layer()'s numbers:
HAND = {
    "paper": (4 / ((8 + 6 + 4 + 2 + 1) / 5), 1 / 5),  # Abar_1 / mean Abar_2..6, / m = whole window (5)
    "official-qa": (4 / 10, 1 / 5),  # Abar_1 / max(Abar of sink 0, 1, 2..6), / R = 5
    "official-ppl": (4 / ((8 + 6 + 4 + 2 + 1) / 5), 1 / 16),  # mean over the (only 5) next, / 16
    "official-summarization": (0.1 / ((0.2 + 0.1 * 4) / 5), 1 / 32),  # current A_1 / mean of the window, / 32
    "kvpress": (1 / ((2 + 2 + 1 + 1 + 1) / 5), 1 / 5),  # decode-only sums, mean over the 5 found, / found
}


@pytest.mark.parametrize("preset", sorted(HAND))
def test_cam_preset_on_a_hand_computed_step(preset):
    p, w = HAND[preset]
    layer = hand_layer()
    values = layer.values.clone()
    log = DecisionLog()
    policy = make_policy("cam", {"preset": preset, "base.sink": 1, "mask": "always"})  # explicit values win
    assert policy.params() == {**policy.params(), **CaM.presets[preset], "mask": "always"}
    shrink(policy, layer, 6, log)
    row = log.frame().iloc[0]
    assert len(log.frame()) == 1 and row.action == "merge" and row.position == 1
    assert (
        row.prob == pytest.approx(p)
        and row.targets == [2, 3, 4, 5, 6]
        and row.weights == pytest.approx([w] * 5)
    )
    kept = in_position_order(layer)
    assert kept.pos[0].tolist() == [0, 2, 3, 4, 5, 6]
    expected = values[0, 0, [0, 2, 3, 4, 5, 6]].clone()
    expected[1:] += w * values[0, 0, 1]
    torch.testing.assert_close(kept.values[0, 0], expected)


def test_cam_divides_by_m_or_by_the_targets_found_and_pools_local_or_kept_slots():
    # h2o at budget 6: recent window 4-6, heavy hitters 0, 2, 3 (after the evicted position 1)
    params = {
        "base": "h2o",
        "base.recent_ratio": 0.5,
        "mask": "always",
        "score": "accumulated",
        "denominator": "targets_mean",
    }
    frames = {}
    for pool, divide in (("kept", "found"), ("local", "m")):
        layer = hand_layer()
        layer.abar = torch.tensor([[10.0, 1.0, 8.0, 9.0, 4.0, 2.0, 1.0]])
        log = DecisionLog()
        shrink(make_policy("cam", {**params, "targets": pool, "divide": divide, "span": 4}), layer, 6, log)
        frames[pool] = log.frame().iloc[0]
    assert frames["kept"].targets == [2, 3, 4, 5] and frames["kept"].weights == pytest.approx([1 / 4] * 4)
    assert frames["local"].targets == [4, 5, 6] and frames["local"].weights == pytest.approx([1 / 4] * 3)
    assert frames["local"].prob == pytest.approx(1 / ((4 + 2 + 1) / 3))
    layer, plain = (
        hand_layer(),
        hand_layer(),
    )  # no local window at all: nothing to merge into, the base's eviction
    shrink(make_policy("cam", {**params, "base.recent_ratio": 0.0, "span": 0, "targets": "local"}), layer, 6)
    shrink(make_policy("h2o", {"recent_ratio": 0.0}), plain, 6)
    assert torch.equal(layer.values, plain.values) and torch.equal(layer.pos, plain.pos)


def test_cam_bernoulli_probability_is_clamped_attention_ratio():
    layer = random_layer(2, 17)
    layer.abar[:, 5:] = 2.0
    layer.abar[0, 4], layer.abar[1, 4] = 0.0, 0.5  # p = 0 and p = 0.25
    values = layer.values.clone()
    log = DecisionLog()
    shrink(make_policy("cam", {"preset": "paper", "seed": 3}), layer, 16, log)
    frame = log.frame()
    assert frame.prob.tolist() == pytest.approx([0.0, 0.25])
    kept = in_position_order(layer).values[0, 0]
    assert frame.draw.iloc[0] == 0 and torch.equal(kept, values[0, 0, [p for p in range(17) if p != 4]])
    with pytest.raises(KvlensError, match="Policy cam has no preset 'qa' \\(its presets: paper, official-qa"):
        make_policy("cam", {"preset": "qa"})
    with pytest.raises(KvlensError, match="Policy h2o has no preset 'paper' \\(it has no presets\\)"):
        parse_settings("h2o", ["preset=paper"])


def sequential_step0_merge(policy: CaM, layer: SlotRows, budget: int):
    """CaM's step-0 merge written plainly (the official loop: one evicted slot at a time, in position
    order, head by head, Python numbers); returns the merged values `(Hkv, S, D)` and the merge rows."""
    keep, evicted = policy.base.select(layer, Step(1, Phase.DECODE, budget))
    b, local = keep.shape[1], policy.base.local_window(budget)
    pool = local if policy.targets == "local" else b
    m = policy.span or pool
    score, pos, values = policy.attention(layer).tolist(), layer.pos.tolist(), layer.values[0].clone()
    gen = torch.Generator().manual_seed(policy.seed * 1_000_003 + layer.layers[0])
    cands = [
        sorted(keep[h, b - pool :].tolist() + evicted[h].tolist(), key=lambda x, h=h: pos[h][x])
        for h in range(HKV)
    ]
    outside = [keep[h, : b - pool].tolist() for h in range(HKV)]
    reach = local if policy.targets == "local" else len(cands[0])
    rows = []
    for k in range(evicted.shape[1]):
        u = torch.rand(HKV, generator=gen).tolist()
        for h in range(HKV):
            i = int(evicted[h, k])
            after = cands[h][cands[h].index(i) + 1 :]
            window, targets = after[:reach], after[: min(m, reach)]
            if not targets:
                continue
            if policy.denominator == "max":
                ref = max(score[h][x] for x in [*outside[h], *window, i])
            else:
                over = targets if policy.denominator == "targets_mean" else window
                ref = sum(score[h][x] for x in over) / len(over)
            p = min(max(score[h][i] / max(ref, 1e-30), policy.clamp[0]), policy.clamp[1])
            draw = 1 if policy.mask == "always" else int(u[h] < p)
            w = draw / (len(targets) if policy.divide == "found" else m)
            for t in targets:
                values[h, t] += w * values[h, i]
            rows.append((h, pos[h][i], [pos[h][t] for t in targets], draw, w, p))
    return values, rows


@pytest.mark.parametrize("block", [1, 256])  # the chain solve in blocks of its longest link, or in one block
@pytest.mark.parametrize(
    "budget", [12, 39]
)  # the prompt's bulk merge (28 evictions per head), a decode step's one
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"preset": "official-summarization", "span": 6, "prefill": "merge"},
        {"preset": "kvpress", "prefill": "merge"},
        {"preset": "paper", "prefill": "merge"},
        {"base": "h2o", "denominator": "window_mean", "span": 2},
        {"base": "h2o", "preset": "official-ppl", "span": 3, "mask": "always"},
    ],
)
def test_cam_merge_in_tensor_form_equals_the_sequential_loop(params, budget, block, monkeypatch):
    monkeypatch.setattr("kvlens.policies.cam.SOLVE_BLOCK", block)
    policy = make_policy("cam", {**params, "seed": 4})
    layer, reference = random_layer(11, 40), random_layer(11, 40)
    decode_attn = torch.rand(HKV, 40, generator=torch.Generator().manual_seed(1))  # score=decode (kvpress)
    layer.extra[DECODE_ATTN], reference.extra[DECODE_ATTN] = decode_attn, decode_attn.clone()
    values, rows = sequential_step0_merge(policy, reference, budget)
    log = DecisionLog()
    shrink(policy, layer, budget, log, prompt=budget == 12)
    merges = log.frame().query("action == 'merge'")
    assert len(merges) == len(rows) and (sum(r[3] for r in rows) > 0 or budget == 39)
    assert [(int(r.kv_head), int(r.position), list(r.targets), int(r.draw)) for r in merges.itertuples()] == [
        (h, i, t, d) for h, i, t, d, _, _ in rows
    ]
    assert merges.prob.tolist() == pytest.approx([r[5] for r in rows], rel=1e-5)
    kept = in_position_order(layer)
    for h in range(HKV):
        slots = [int((reference.pos[h] == q).nonzero()) for q in kept.pos[h].tolist()]
        torch.testing.assert_close(kept.values[0, h], values[h, slots])


@pytest.mark.parametrize(
    "params",
    [
        {"preset": "official-ppl", "span": 5},
        {"preset": "kvpress"},
        {"preset": "paper", "span": 3, "mask": "always"},
    ],
)
def test_cam_bulk_step0_merge_equals_the_same_evictions_one_at_a_time(params):
    bulk, single = random_layer(9, 40), random_layer(9, 40)
    bulk.extra[DECODE_ATTN] = single.extra[DECODE_ATTN] = torch.rand(HKV, 40)
    policy = make_policy("cam", {**params, "prefill": "merge"})
    log_bulk, log_single = DecisionLog(), DecisionLog()
    shrink(policy, bulk, 12, log_bulk, prompt=True)  # streaming_llm: positions 4..31 leave at once
    for budget in range(39, 11, -1):  # the same positions leave one per call, oldest first
        shrink(policy, single, budget, log_single, prompt=True)
    bulk, single = in_position_order(bulk), in_position_order(single)
    assert bulk.pos.equal(single.pos) and bulk.pos[0].tolist() == [0, 1, 2, 3, *range(32, 40)]
    torch.testing.assert_close(bulk.values, single.values)
    columns = ["kv_head", "position", "targets", "weights", "draw"]
    a, b = (
        log.frame().sort_values(["kv_head", "position"], kind="stable").reset_index(drop=True)
        for log in (log_bulk, log_single)
    )
    assert a[columns].equals(b[columns]) and a.prob.tolist() == pytest.approx(b.prob.tolist(), rel=1e-6)
    assert (log_bulk.frame().action == "merge").sum() == 2 * 28  # every evicted slot merged or drew 0


@pytest.mark.parametrize("base", ["streaming_llm", "h2o", "scissorhands", "tova"])
def test_cam_mask_never_reproduces_its_base(tiny, base):
    opts = RunOptions(budget=20, max_new_tokens=12, stop_at_eos=False)
    for teacher in (True, False):
        a = run(tiny, make_policy(base), IDS, prefill=80, steps=12, teacher=teacher, opts=opts)
        b = run(
            tiny,
            make_policy("cam", {"base": base, "mask": "never"}),
            IDS,
            prefill=80,
            steps=12,
            teacher=teacher,
            opts=opts,
        )
        assert a.meta.tokens == b.meta.tokens and a.metrics["ppl"] == b.metrics["ppl"]
        assert a.decisions.equals(b.decisions) and len(a.decisions)


def test_cam_prefill_choice_and_base_parameters(tiny):
    opts = RunOptions(budget=20)
    evict = run(
        tiny,
        make_policy("cam", {"mask": "always", "prefill": "evict"}),
        IDS,
        prefill=80,
        steps=6,
        teacher=True,
        opts=opts,
    )
    merge = run(
        tiny,
        make_policy("cam", {"mask": "always", "prefill": "merge"}),
        IDS,
        prefill=80,
        steps=6,
        teacher=True,
        opts=opts,
    )
    step0 = evict.decisions[evict.decisions.step == 0]
    assert (step0.action == "evict").all() and (
        evict.decisions[evict.decisions.step > 0].action == "merge"
    ).all()
    assert (merge.decisions[merge.decisions.step == 0].action == "merge").all()
    assert make_policy("cam", {"base": "h2o", "base.recent_ratio": 0.25}).base.local_window(40) == 10
    assert parse_settings("cam", ["base=tova", "mask=always", "clamp=0.2,0.9"]) == {
        "base": "tova",
        "mask": "always",
        "clamp": (0.2, 0.9),
    }
    with pytest.raises(KvlensError, match="mask of cam must be one of bernoulli, always, never"):
        parse_settings("cam", ["mask=sometimes"])


# ---------------------------------------------------------------- WeightedKV


def test_weightedkv_merges_least_attended_value_into_right_neighbour_on_the_segment():
    layer = random_layer(4, 21)
    avg = layer.abar / layer.nobs
    keys, values = layer.keys.clone(), layer.values.clone()
    shrink(make_policy("weightedkv"), layer, 20, DecisionLog())  # protected: 4 sinks + 10 - 4 = 6 recent
    layer = in_position_order(layer)
    for h in range(HKV):
        j = 4 + int(avg[h, 4:15].argmin())
        kept = [p for p in range(21) if p != j]
        assert layer.pos[h].tolist() == kept and torch.equal(layer.keys[0, h], keys[0, h, kept])
        new = layer.values[0, h, j]  # the right neighbour now sits in slot j
        a = avg[h, j] / (avg[h, j] + avg[h, j + 1])
        torch.testing.assert_close(new, a * values[0, h, j] + (1 - a) * values[0, h, j + 1])
        # on the segment: new - v_r = a (v_j - v_r) with 0 <= a <= 1
        seg = values[0, h, j] - values[0, h, j + 1]
        coef = float((new - values[0, h, j + 1]) @ seg / (seg @ seg))
        assert 0 <= coef <= 1
        torch.testing.assert_close(new - values[0, h, j + 1], coef * seg)
        others = [s for s, p in enumerate(kept) if p != j + 1]
        assert torch.equal(layer.values[0, h, others], values[0, h, [kept[s] for s in others]])


def test_weightedkv_eviction_ablation_keeps_values():
    layer = random_layer(5, 30)
    values = layer.values.clone()
    log = DecisionLog()
    shrink(make_policy("weightedkv", {"merge": False}), layer, 12, log, prompt=True)
    assert layer.n_kept == 12 and (log.frame().action == "evict").all()
    kept = in_position_order(layer)
    for h in range(HKV):
        assert torch.equal(kept.values[0, h], values[0, h, kept.pos[h]])


# ---------------------------------------------------------------- KVMerger


@settings(max_examples=examples(40))
@given(st.integers(0, 10_000), st.integers(1, 40), st.floats(-0.5, 0.95))
def test_merging_sets_are_consecutive_above_threshold_and_maximal(seed, t, threshold):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(4, D, generator=gen)
    keys = base[torch.randint(0, 4, (t,), generator=gen)] + 0.3 * torch.randn(t, D, generator=gen)
    cand = torch.rand(t, generator=gen) < 0.8
    sets = merging_sets(keys, threshold, cand)
    unit = torch.nn.functional.normalize(keys, dim=-1)
    assert sorted(i for s in sets for i in s) == torch.nonzero(cand).flatten().tolist()  # a partition
    for s in sets:
        assert s == list(range(s[0], s[-1] + 1))  # consecutive
        anchor = s[-1]
        assert all(float(unit[i] @ unit[anchor]) > threshold for i in s[:-1])
        left = s[0] - 1  # the scan stopped: the left neighbour is no candidate or below threshold
        assert left < 0 or not cand[left] or float(unit[left] @ unit[anchor]) <= threshold


def test_gaussian_weights_paper_sigmas_and_explicit_sigma():
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]])
    w = gaussian_weights(keys, 0, "eq7")
    sigma = (0 + 1 + 9) / (2**0.5 * 3)  # Eq. 7: 2.357, larger than the distances 1 and 3
    g = torch.exp(-torch.tensor([0.0, 1.0, 9.0]) / (2 * sigma**2))
    torch.testing.assert_close(w, g / g.sum())
    torch.testing.assert_close(gaussian_weights(keys, 0), w)  # None = Eq. 7
    assert float(w.sum()) == pytest.approx(1) and int(w.argmax()) == 0
    near = gaussian_weights(keys, 0, "mean_distance")  # §6.3: sigma = mean(1, 3) = 2 over the other keys
    g = torch.exp(-torch.tensor([0.0, 1.0, 9.0]) / (2 * 2.0**2))
    torch.testing.assert_close(near, g / g.sum())
    assert float(near[2]) < float(w[2])  # the far key weighs less than under Eq. 7
    wide = gaussian_weights(keys, 0, sigma=100.0)
    torch.testing.assert_close(wide, torch.full((3,), 1 / 3), atol=1e-3, rtol=0)
    with pytest.raises(KvlensError):
        gaussian_weights(keys, 3)
    with pytest.raises(
        KvlensError, match="sigma must be a positive number, eq7 or mean_distance; got 'mean'"
    ):
        gaussian_weights(keys, 0, "mean")
    assert make_policy("kvmerger", {"preset": "budget35"}).params()["recent_ratio"] == 0.08
    assert make_policy("kvmerger", {"preset": "budget50", "keep_ratio": 0.2}).params()["keep_ratio"] == 0.2


def test_kvmerger_merges_each_set_at_its_pivot_with_gaussian_weights():
    layer = random_layer(6, 24)
    layer.keys[0, :, 6:12] = layer.keys[0, :, 6:7] + 0.05 * torch.randn(HKV, 6, D)  # a similar run
    keys, values, abar = layer.keys.clone(), layer.values.clone(), layer.abar.clone()
    log = DecisionLog()
    policy = make_policy("kvmerger", {"recent_ratio": 0.25, "keep_ratio": 0.0})
    shrink(policy, layer, None, log, prompt=True)
    frame = log.frame()
    assert len(frame) and (frame.action == "merge").all()
    for (h, target), rows in frame.groupby(["kv_head", frame.targets.map(lambda t: t[0])]):
        members = sorted(rows.position.tolist() + [target])
        assert members == list(range(members[0], members[-1] + 1)) and members[-1] < 18  # not in the recent 6
        assert target == members[int(abar[h, members].argmax())]
        unit = torch.nn.functional.normalize(keys[0, h, members], dim=-1)
        assert bool((unit[:-1] @ unit[-1] > 0.75).all())
        w = gaussian_weights(keys[0, h, members], members.index(target), "mean_distance")
        s = slot_of(layer, h, target)
        torch.testing.assert_close(layer.keys[0, h, s], w @ keys[0, h, members])
        torch.testing.assert_close(layer.values[0, h, s], w @ values[0, h, members])
        assert all(p not in layer.pos[h][layer.valid[h]].tolist() for p in rows.position)
    # heads keep different counts: padded to the longest, padding invalid
    assert layer.n_slots == int(layer.kept_per_row().max())


# ---------------------------------------------------------------- CORM


class SpyCORM(CORM):
    """CORM that remembers, before each compression, which keys were important in the window."""

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "checks", [])  # test-side record on a frozen policy

    def compress(self, rows, step):
        seen = rows.state.get(MESSAGES_SEEN, 0)
        if seen >= self.window:
            recent = rows.valid & (rows.pos > rows.pos.max() - self.recent)  # the `recent` newest tokens
            must = ((rows.extra[MESSAGE] > seen - self.window) | recent) & rows.valid
            self.checks.append([set(rows.pos[h][must[h]].tolist()) for h in range(must.shape[0])])
            super().compress(rows, step)
            self.checks[-1] = [
                (need, set(rows.pos[h][rows.valid[h]].tolist())) for h, need in enumerate(self.checks[-1])
            ]
        else:
            super().compress(rows, step)


def test_corm_never_drops_an_important_or_recent_key(tiny):
    policy = SpyCORM(window=6, recent=6)
    r = run(tiny, policy, IDS, prefill=60, steps=30, teacher=True, opts=RunOptions())
    assert policy.checks and len(r.decisions)
    for heads in policy.checks:
        for need, kept in heads:
            assert need <= kept  # kept: important in the window or recent
            assert kept <= need  # and nothing else (padding is invalid)


def test_corm_messages_follow_gqa_rule_minor_for_every_query_head():
    layer = random_layer(7, 10)
    policy = CORM(window=2, recent=1)
    rows = torch.zeros(HKV * G, 2, 10)
    rows[0, :, 3] = 1.0  # only query head 0 (group of KV head 0) attends to key 3
    policy.observe_prefill(layer, Prompt(rows))
    shrink(policy, layer, None, DecisionLog())
    assert layer.pos[0][layer.valid[0]].tolist() == [3, 9]
    assert layer.pos[1][layer.valid[1]].tolist() == [9]
    assert layer.kept_per_row().tolist() == [2, 1]
    assert layer.n_slots == 10  # freed in place: later tokens fill the slots


# ---------------------------------------------------------------- provenance


@pytest.mark.parametrize(
    "name,params",
    [
        ("cam", {"mask": "always", "prefill": "merge"}),
        ("weightedkv", {}),
        ("kvmerger", {"threshold": 0.0, "keep_ratio": 0.0}),
    ],
)
def test_provenance_replay_rebuilds_every_value(name, params):
    layer = random_layer(8, 40)
    original = layer.values.clone()
    log = DecisionLog()
    policy = make_policy(name, params)
    shrink(policy, layer, None if policy.budget_free else 12, log, prompt=True)
    prov = replay(log.frame(), type(policy).merge_rule)
    assert prov
    for h in range(HKV):
        for s in torch.nonzero(layer.valid[h]).flatten().tolist():
            p = int(layer.pos[h, s])
            sources = prov.get((0, h), {}).get(p, {p: 1.0})
            rebuilt = sum(w * original[0, h, q] for q, w in sources.items())
            torch.testing.assert_close(layer.values[0, h, s], rebuilt, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Scissorhands


@pytest.mark.parametrize("count,kept", [("unimportant", [0, 3, 4, 5]), ("important", [0, 1, 2, 5])])
def test_scissorhands_counts_unimportant_steps_like_the_paper_or_important_ones(count, kept):
    layer = layer_rows()
    layer.append(torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2), torch.arange(6))
    layer.abar = torch.tensor([[9.0, 5.0, 4.0, 3.0, 1.0, 1.0]])  # slot 3 < slot 2: the important count's tie
    # per slot, the last 4 steps: 0 not yet in the cache, 1 below the average attention, 2 at or above it
    policy = make_policy("scissorhands", {"history": 4, "recent_ratio": 0.25, "count": count})
    policy.set_history(
        layer,
        torch.tensor(
            [[[2, 2, 2, 2], [1, 1, 2, 2], [1, 1, 1, 2], [0, 0, 2, 1], [0, 0, 0, 1], [0, 0, 0, 2]]],
            dtype=torch.int8,
        ),
    )
    shrink(policy, layer, 4, DecisionLog())  # recent window: slot 5; two of slots 0-4 go
    # unimportant counts 0, 2, 3, 1, 1: slots 2 and 1 go; the young slots 3 and 4 stay (seen only 2 and 1
    # times) important counts 4, 2, 1, 1, 0: slot 4 goes, then slot 3 (tie with 2, smaller Abar)
    assert in_position_order(layer).pos[0].tolist() == kept


def test_scissorhands_prefill_history_marks_unseen_slots_and_drop_compresses_m_at_once(tiny):
    layer = layer_rows()
    layer.append(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2), torch.arange(3))
    rows = torch.tensor([[[0.6, 0.4, 0.0], [0.2, 0.3, 0.5]]])  # queries 1 and 2 (one query head)
    policy = make_policy("scissorhands", {"history": 3})
    policy.observe_prefill(layer, Prompt(rows))
    # query 1 sees 2 slots (average 1/2), query 2 sees 3 (1/3); slot 2 is unseen by query 1: the window's
    # marks per slot, oldest step first, are [0, 2, 1], [0, 1, 1] and [0, 0, 2] (0 unseen, 1 unimportant)
    assert policy.newest_marks(layer)[0].tolist() == [1, 1, 2]
    assert layer.extra[HISTORY][0, :, 0].tolist() == [0b100, 0b110, 0]  # bit k: step k is unimportant
    r = run(
        tiny,
        make_policy("scissorhands", {"drop": 3}),
        IDS,
        prefill=80,
        steps=8,
        teacher=True,
        opts=RunOptions(budget=12),
    )
    assert r.tensors["steps/kv_slots"].amax((1, 2)).tolist() == [10, 11, 12, 10, 11, 12, 10, 11]
    with pytest.raises(KvlensError, match="Budget 2 is below the 3 slots that scissorhands always keeps"):
        run(
            tiny,
            make_policy("scissorhands", {"drop": 3}),
            IDS,
            prefill=80,
            steps=8,
            teacher=True,
            opts=RunOptions(budget=2),
        )


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("name,preset", [(n, p) for n in REGISTRY for p in REGISTRY[n].presets])
def test_every_preset_runs_and_is_recorded_resolved(tiny, name, preset):
    policy = make_policy(name, parse_settings(name, [f"preset={preset}"]))
    budget = None if policy.budget_free else max(20, policy.needs().min_budget)
    r = run(tiny, policy, IDS, prefill=80, steps=8, teacher=True, opts=RunOptions(budget=budget))
    assert r.meta.policy.params == {**r.meta.policy.params, **REGISTRY[name].presets[preset]}
    assert "preset" not in r.meta.policy.params and math.isfinite(r.metrics["ppl"])
    grows = not policy.needs().decode_steps  # compressed once, then one slot per token
    m = (
        policy.dropped(budget) if name == "scissorhands" else 1
    )  # m dropped at once, then one slot back per token
    assert policy.budget_free or r.metrics["kv_slots_max"] == min(budget, budget + 1 - m + 7) + (
        7 if grows else 0
    )


def test_merges_in_tensor_form_give_the_rows_of_one_merge_call_each():
    tensor_log, row_log = DecisionLog(), DecisionLog()
    source = torch.tensor([[5, 9], [6, 8]])  # (Hkv, E)
    targets = torch.tensor([[[6, 7, -1], [-1, -1, -1]], [[7, 9, 10], [9, -1, -1]]])  # (Hkv, E, K)
    weight, prob = torch.tensor([[0.5, 0.0], [0.25, 1.0]]), torch.tensor([[0.9, 0.0], [0.3, 1.0]])
    draw = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    tensor_log.merges(3, 2, source, targets, weight, prob, draw)  # step 3, layer 2
    for e, h in [(0, 0), (0, 1), (1, 1)]:  # source by source, head by head; head 0's second has no target
        found = [int(t) for t in targets[h, e] if t >= 0]
        row_log.merge(
            3,
            2,
            h,
            int(source[h, e]),
            found,
            [float(weight[h, e])] * len(found),
            prob=float(prob[h, e]),
            draw=int(draw[h, e]),
        )
    assert len(tensor_log) == len(row_log) == 3
    assert tensor_log.frame().equals(row_log.frame())
