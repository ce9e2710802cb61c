"""Property tests of each eviction policy's rule (as its file cites the paper) on random caches and the tiny model."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.cache import LayerCache
from kvlens.decisions import DecisionLog
from kvlens.engine import RunOptions, run
from kvlens.errors import KvlensError
from kvlens.policies import make_policy, parse_budget, parse_settings
from kvlens.policies.scissorhands import HISTORY
from tests.conftest import examples

HKV, G, D = 2, 2, 4


def random_layer(seed: int, slots: int, first_pos: int = 0) -> LayerCache:
    """A layer cache of `slots` slots with random states and statistics, positions ascending."""
    gen = torch.Generator().manual_seed(seed)
    layer = LayerCache(layer=0)
    keys = torch.randn(1, HKV, slots, D, generator=gen)
    values = torch.randn(1, HKV, slots, D, generator=gen)
    layer.append(keys, values, torch.arange(first_pos, first_pos + slots))
    layer.abar = torch.rand(HKV, slots, generator=gen) * 5
    layer.nobs = torch.ones(HKV, slots)
    layer.last_attn = torch.softmax(torch.randn(HKV * G, slots, generator=gen), -1)
    return layer


def compress(policy, layer, budget):
    log = DecisionLog()
    before = layer.pos.clone()
    policy.compress(layer, budget, log)
    return before, log


cases = st.tuples(st.integers(0, 10_000), st.integers(8, 60), st.integers(6, 40))


@settings(max_examples=examples(40))
@given(cases)
def test_streaming_llm_keeps_sinks_and_most_recent(case):
    seed, slots, budget = case
    layer = random_layer(seed, slots)
    before, log = compress(make_policy("streaming_llm", {"sink": 4}), layer, budget)
    want = list(range(4)) + list(range(max(4, slots - (budget - 4)), slots)) if slots > budget else list(range(slots))
    for h in range(HKV):
        assert layer.pos[h].tolist() == want
    assert len(log) == HKV * max(0, slots - budget)


@settings(max_examples=examples(40))
@given(cases, st.floats(0.0, 1.0))
def test_h2o_keeps_recent_window_and_heaviest_hitters(case, ratio):
    seed, slots, budget = case
    layer = random_layer(seed, slots)
    abar = layer.abar.clone()
    policy = make_policy("h2o", {"recent_ratio": ratio})
    compress(policy, layer, budget)
    if slots <= budget:
        assert layer.n_slots == slots
        return
    recent = int(budget * ratio)
    for h in range(HKV):
        kept = set(layer.pos[h].tolist())
        assert set(range(slots - recent, slots)) <= kept  # recent window never dropped
        others = [j for j in range(slots - recent)]
        heavy = sorted(others, key=lambda j: -abar[h, j].item())[: budget - recent]
        assert kept - set(range(slots - recent, slots)) == set(heavy)
    assert layer.keys.shape[2] == budget and torch.equal(layer.pos, layer.pos.sort(-1).values)


@settings(max_examples=examples(40))
@given(cases)
def test_scissorhands_drops_least_persistent_then_smaller_abar(case):
    seed, slots, budget = case
    layer = random_layer(seed, slots)
    gen = torch.Generator().manual_seed(seed + 1)
    layer.extra[HISTORY] = torch.randint(0, 3, (HKV, slots, 8), generator=gen, dtype=torch.int8)  # unseen/below/above
    counts, abar = -(layer.extra[HISTORY] == 1).sum(-1), layer.abar.clone()  # fewest unimportant steps are kept
    policy = make_policy("scissorhands", {"history": 8, "recent_ratio": 0.25})
    compress(policy, layer, budget)
    if slots <= budget:
        return
    recent = int(budget * 0.25)
    for h in range(HKV):
        kept = set(layer.pos[h].tolist())
        assert set(range(slots - recent, slots)) <= kept
        dropped = set(range(slots)) - kept
        for d in dropped:
            for k in kept - set(range(slots - recent, slots)):
                assert (counts[h, d], abar[h, d]) <= (counts[h, k], abar[h, k])


@settings(max_examples=examples(40))
@given(cases)
def test_tova_keeps_top_current_attention_same_set_per_layer(case):
    seed, slots, budget = case
    layer = random_layer(seed, slots)
    score = layer.last_attn.mean(0)
    compress(make_policy("tova"), layer, budget)
    if slots <= budget:
        return
    want = sorted(torch.topk(score, budget).indices.tolist())
    assert layer.pos[0].tolist() == want and torch.equal(layer.pos[0], layer.pos[1])


def test_full_keeps_everything(tiny):
    r = run(tiny, make_policy("full"), list(b"hello world, " * 8), prefill=40, steps=20, teacher=True,
            opts=RunOptions(budget=5))
    assert r.decisions.empty
    assert r.tensors["steps/kv_slots"][-1].unique().tolist() == [59]


def test_fraction_budget_is_share_of_prompt(tiny):
    r = run(tiny, make_policy("h2o"), list(b"x" * 100), prefill=80, steps=5, teacher=True,
            opts=RunOptions(budget=0.25))
    assert r.meta["budget"]["slots"] == 20 and r.metrics["kv_slots_max"] == 20


def test_parameters_are_validated_with_one_sentence():
    with pytest.raises(KvlensError, match="no parameter 'window'"):
        make_policy("h2o", {"window": 3})
    with pytest.raises(KvlensError, match="recent_ratio of h2o must be in"):
        make_policy("h2o", {"recent_ratio": 1.5})
    with pytest.raises(KvlensError, match="must be an integer"):
        parse_settings("streaming_llm", ["sink=four"])
    assert parse_settings("scissorhands", ["history=12", "recent_ratio=0.3"]) == {"history": 12, "recent_ratio": 0.3}
    with pytest.raises(KvlensError, match="Unknown policy"):
        make_policy("nope")
    assert parse_budget("64") == 64 and parse_budget("0.5") == 0.5
    for bad in ("0.0", "1.5", "abc"):
        with pytest.raises(KvlensError):
            parse_budget(bad)
