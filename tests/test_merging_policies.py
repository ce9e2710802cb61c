"""Rules of the merging policies (CaM, WeightedKV, KVMerger) and CORM, their decision logs and provenance."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.cache import LayerCache
from kvlens.decisions import DecisionLog
from kvlens.engine import RunOptions, run
from kvlens.errors import KvlensError
from kvlens.policies import make_policy, parse_settings
from kvlens.policies.corm import CORM, MESSAGE, MESSAGES_SEEN
from kvlens.policies.kvmerger import gaussian_weights, merging_sets
from kvlens.provenance import replay
from tests.conftest import examples

HKV, G, D = 2, 2, 8
IDS = list(b"Attention sinks and heavy hitters keep the cache small. " * 3)


def random_layer(seed: int, slots: int, prefill: bool = False) -> LayerCache:
    """A layer of `slots` slots with random states; `prefill=True` marks it as just after prefill (step 0)."""
    gen = torch.Generator().manual_seed(seed)
    layer = LayerCache(layer=0)
    layer.append(torch.randn(1, HKV, slots, D, generator=gen), torch.randn(1, HKV, slots, D, generator=gen),
                 torch.arange(slots))
    layer.abar = torch.rand(HKV, slots, generator=gen) * 5
    layer.nobs = torch.randint(1, 20, (HKV, slots), generator=gen).float()
    layer.last_attn = torch.softmax(torch.randn(HKV * G, slots, generator=gen), -1)
    if prefill:
        layer.prefill_rows = layer.last_attn[:, None, :]
    return layer


def slot_of(layer: LayerCache, head: int, position: int) -> int:
    return int((layer.pos[head] == position).nonzero())


# ---------------------------------------------------------------- CaM


@pytest.mark.parametrize("span", [0, 3])
def test_cam_changes_only_target_values_by_exactly_m_vi_over_m(span):
    layer = random_layer(1, 17)  # a decode step: budget 16 + the new token
    layer.abar[:, 4] = 100.0  # the evicted slot (oldest non-sink) is heavy: p = 1
    keys, values = layer.keys.clone(), layer.values.clone()
    log = DecisionLog()
    make_policy("cam", {"span": span}).compress(layer, 16, log)
    m = 12 if span == 0 else 3  # streaming_llm's local window is budget - sink = 12
    for h in range(HKV):
        kept = [p for p in range(17) if p != 4]
        assert layer.pos[h].tolist() == kept
        assert torch.equal(layer.keys[0, h], keys[0, h, kept])  # keys untouched, key 4 dropped
        for s, p in enumerate(kept):
            expected = values[0, h, p] + (values[0, h, 4] / m if 5 <= p < 5 + m else 0)
            torch.testing.assert_close(layer.values[0, h, s], expected)
    merges = log.frame()
    assert (merges.action == "merge").all() and len(merges) == HKV
    assert merges.targets.iloc[0] == list(range(5, 5 + m)) and merges.prob.tolist() == [1.0, 1.0]
    assert merges.draw.tolist() == [1, 1] and merges.weights.iloc[0] == pytest.approx([1 / m] * m)


def test_cam_bernoulli_probability_is_clamped_attention_ratio():
    layer = random_layer(2, 17)
    layer.abar[:, 5:] = 2.0
    layer.abar[0, 4], layer.abar[1, 4] = 0.0, 0.5  # p = 0 and p = 0.25
    values = layer.values.clone()
    log = DecisionLog()
    make_policy("cam", {"seed": 3}).compress(layer, 16, log)
    frame = log.frame()
    assert frame.prob.tolist() == pytest.approx([0.0, 0.25])
    assert frame.draw.iloc[0] == 0 and torch.equal(layer.values[0, 0], values[0, 0, [p for p in range(17) if p != 4]])


@pytest.mark.parametrize("base", ["streaming_llm", "h2o", "scissorhands", "tova"])
def test_cam_mask_never_reproduces_its_base(tiny, base):
    opts = RunOptions(budget=20, max_new_tokens=12, stop_at_eos=False)
    for teacher in (True, False):
        a = run(tiny, make_policy(base), IDS, prefill=80, steps=12, teacher=teacher, opts=opts)
        b = run(tiny, make_policy("cam", {"base": base, "mask": "never"}), IDS, prefill=80, steps=12,
                teacher=teacher, opts=opts)
        assert a.meta["tokens"] == b.meta["tokens"] and a.metrics["ppl"] == b.metrics["ppl"]
        assert a.decisions.equals(b.decisions) and len(a.decisions)


def test_cam_prefill_choice_and_base_parameters(tiny):
    opts = RunOptions(budget=20)
    evict = run(tiny, make_policy("cam", {"mask": "always"}), IDS, prefill=80, steps=6, teacher=True, opts=opts)
    merge = run(tiny, make_policy("cam", {"mask": "always", "prefill": "merge"}), IDS, prefill=80, steps=6,
                teacher=True, opts=opts)
    step0 = evict.decisions[evict.decisions.step == 0]
    assert (step0.action == "evict").all() and (evict.decisions[evict.decisions.step > 0].action == "merge").all()
    assert (merge.decisions[merge.decisions.step == 0].action == "merge").all()
    assert make_policy("cam", {"base": "h2o", "base.recent_ratio": 0.25}).base.local_window(40) == 10
    assert parse_settings("cam", ["base=tova", "mask=always", "clamp=0.2,0.9"]) == \
        {"base": "tova", "mask": "always", "clamp": (0.2, 0.9)}
    with pytest.raises(KvlensError, match="mask of cam must be one of bernoulli, always, never"):
        parse_settings("cam", ["mask=sometimes"])


# ---------------------------------------------------------------- WeightedKV


def test_weightedkv_merges_least_attended_value_into_right_neighbour_on_the_segment():
    layer = random_layer(4, 21)
    avg = layer.abar / layer.nobs
    keys, values = layer.keys.clone(), layer.values.clone()
    make_policy("weightedkv").compress(layer, 20, DecisionLog())  # protected: 4 sinks + 10 - 4 = 6 recent
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
    layer = random_layer(5, 30, prefill=True)
    values = layer.values.clone()
    log = DecisionLog()
    make_policy("weightedkv", {"merge": False}).compress(layer, 12, log)
    assert layer.n_slots == 12 and (log.frame().action == "evict").all()
    for h in range(HKV):
        assert torch.equal(layer.values[0, h], values[0, h, layer.pos[h]])


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


def test_gaussian_weights_paper_sigma_and_explicit_sigma():
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]])
    w = gaussian_weights(keys, 0)
    sigma = (0 + 1 + 9) / (2 ** 0.5 * 3)  # Eq. 7
    g = torch.exp(-torch.tensor([0.0, 1.0, 9.0]) / (2 * sigma ** 2))
    torch.testing.assert_close(w, g / g.sum())
    assert float(w.sum()) == pytest.approx(1) and int(w.argmax()) == 0
    wide = gaussian_weights(keys, 0, sigma=100.0)
    torch.testing.assert_close(wide, torch.full((3,), 1 / 3), atol=1e-3, rtol=0)
    with pytest.raises(KvlensError):
        gaussian_weights(keys, 3)


def test_kvmerger_merges_each_set_at_its_pivot_with_gaussian_weights():
    layer = random_layer(6, 24, prefill=True)
    layer.keys[0, :, 6:12] = layer.keys[0, :, 6:7] + 0.05 * torch.randn(HKV, 6, D)  # a similar run
    keys, values, abar = layer.keys.clone(), layer.values.clone(), layer.abar.clone()
    log = DecisionLog()
    policy = make_policy("kvmerger", {"recent_ratio": 0.25, "keep_ratio": 0.0})
    policy.compress(layer, None, log)
    frame = log.frame()
    assert len(frame) and (frame.action == "merge").all()
    for (h, target), rows in frame.groupby(["kv_head", frame.targets.map(lambda t: t[0])]):
        members = sorted(rows.position.tolist() + [target])
        assert members == list(range(members[0], members[-1] + 1)) and members[-1] < 18  # not in the recent 6
        assert target == members[int(abar[h, members].argmax())]
        unit = torch.nn.functional.normalize(keys[0, h, members], dim=-1)
        assert bool((unit[:-1] @ unit[-1] > 0.75).all())
        w = gaussian_weights(keys[0, h, members], members.index(target))
        s = slot_of(layer, h, target)
        torch.testing.assert_close(layer.keys[0, h, s], w @ keys[0, h, members])
        torch.testing.assert_close(layer.values[0, h, s], w @ values[0, h, members])
        assert all(p not in layer.pos[h][layer.valid[h]].tolist() for p in rows.position)
    # heads keep different counts: padded to the longest, padding invalid
    assert layer.n_slots == int(layer.kept().max())


# ---------------------------------------------------------------- CORM


class SpyCORM(CORM):
    """CORM that remembers, before each compression, which keys were important in the window."""

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "checks", [])  # test-side record on a frozen policy

    def compress(self, layer, budget, log):
        if layer.state.get(MESSAGES_SEEN, 0) >= self.window:
            must = layer.extra[MESSAGE].any(-1) & layer.valid
            s = layer.n_slots
            must[:, max(0, s - self.recent):] = layer.valid[:, max(0, s - self.recent):]
            self.checks.append([set(layer.pos[h][must[h]].tolist()) for h in range(must.shape[0])])
            super().compress(layer, budget, log)
            self.checks[-1] = [(need, set(layer.pos[h][layer.valid[h]].tolist())) for h, need in
                               enumerate(self.checks[-1])]
        else:
            super().compress(layer, budget, log)


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
    policy.observe_prefill(layer, rows)
    policy.compress(layer, None, DecisionLog())
    assert layer.pos[0][layer.valid[0]].tolist() == [3, 9]
    assert layer.pos[1][layer.valid[1]].tolist() == [9]
    assert layer.n_slots == 2 and layer.kept().tolist() == [2, 1]


# ---------------------------------------------------------------- provenance


@pytest.mark.parametrize("name,params", [("cam", {"mask": "always", "prefill": "merge"}), ("weightedkv", {}),
                                         ("kvmerger", {"threshold": 0.0, "keep_ratio": 0.0})])
def test_provenance_replay_rebuilds_every_value(name, params):
    layer = random_layer(8, 40, prefill=True)
    original = layer.values.clone()
    log = DecisionLog()
    policy = make_policy(name, params)
    policy.compress(layer, None if policy.budget_free else 12, log)
    prov = replay(log.frame(), type(policy).merge_rule)
    assert prov
    for h in range(HKV):
        for s in torch.nonzero(layer.valid[h]).flatten().tolist():
            p = int(layer.pos[h, s])
            sources = prov.get((0, h), {}).get(p, {p: 1.0})
            rebuilt = sum(w * original[0, h, q] for q, w in sources.items())
            torch.testing.assert_close(layer.values[0, h, s], rebuilt, atol=1e-5, rtol=1e-5)
