"""Property tests of each eviction policy's rule (as its file cites the paper) on random caches and the tiny
model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.engine.loop import RunOptions, run
from kvlens.errors import KvlensError
from kvlens.kvcache import Phase, Step
from kvlens.kvcache.views import SlotRows
from kvlens.policies import make_policy, parse_budget, parse_settings
from kvlens.policies.base import evicted_lowest, lowest_of_all_rows, newest_cut, select_lowest
from kvlens.policies.cam import DECODE_ATTN
from kvlens.runs.decisions import DecisionLog
from tests.conftest import examples, in_position_order, layer_rows, shrink

HKV, G, D = 2, 2, 4


def random_layer(seed: int, slots: int, first_pos: int = 0) -> SlotRows:
    """A layer cache of `slots` slots with random states and statistics, positions ascending."""
    gen = torch.Generator().manual_seed(seed)
    layer = layer_rows()
    keys = torch.randn(1, HKV, slots, D, generator=gen)
    values = torch.randn(1, HKV, slots, D, generator=gen)
    layer.append(keys, values, torch.arange(first_pos, first_pos + slots))
    layer.abar = torch.rand(HKV, slots, generator=gen) * 5
    layer.nobs = torch.ones(HKV, slots)
    layer.last_attn = torch.softmax(torch.randn(HKV * G, slots, generator=gen), -1)
    return layer


def kept_positions(layer) -> list[list[int]]:
    """Each row's kept positions, oldest first."""
    return in_position_order(layer).pos.tolist()


def compress(policy, layer, budget):
    log = DecisionLog()
    before = layer.pos.clone()
    layer.books[0].limit = (
        budget + 1
    )  # as in a run: compressing the prompt moves the kept slots into budget + 1 slots
    shrink(policy, layer, budget, log, prompt=True)
    return before, log


cases = st.tuples(st.integers(0, 10_000), st.integers(8, 60), st.integers(6, 40))


@settings(max_examples=examples(40))
@given(cases)
def test_streaming_llm_keeps_sinks_and_most_recent(case):
    seed, slots, budget = case
    layer = random_layer(seed, slots)
    before, log = compress(make_policy("streaming_llm", {"sink": 4}), layer, budget)
    want = (
        list(range(4)) + list(range(max(4, slots - (budget - 4)), slots))
        if slots > budget
        else list(range(slots))
    )
    for h in range(HKV):
        assert kept_positions(layer)[h] == want
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
        kept = set(kept_positions(layer)[h])
        assert set(range(slots - recent, slots)) <= kept  # recent window never dropped
        others = [j for j in range(slots - recent)]
        heavy = sorted(others, key=lambda j: -abar[h, j].item())[: budget - recent]
        assert kept - set(range(slots - recent, slots)) == set(heavy)
    # the prompt's memory is released: budget kept slots and one free slot for the next token
    assert layer.n_kept == budget and layer.capacity == budget + 1 and not bool(layer.valid[:, budget:].any())


def history_of(layer, hist: torch.Tensor) -> None:
    """Scissorhands' window of marks `hist` `(R, S, 8)` in `layer` (its default count: unimportant steps)."""
    make_policy("scissorhands", {"history": hist.shape[-1]}).set_history(layer, hist)


@settings(max_examples=examples(40))
@given(cases)
def test_scissorhands_drops_least_persistent_then_smaller_abar(case):
    seed, slots, budget = case
    layer = random_layer(seed, slots)
    gen = torch.Generator().manual_seed(seed + 1)
    policy = make_policy("scissorhands", {"history": 8, "recent_ratio": 0.25})
    hist = torch.randint(0, 3, (HKV, slots, 8), generator=gen, dtype=torch.int8)  # unseen/below/above
    policy.set_history(layer, hist)
    counts, abar = -(hist == 1).sum(-1), layer.abar.clone()  # fewest unimportant steps are kept
    compress(policy, layer, budget)
    if slots <= budget:
        return
    recent = int(budget * 0.25)
    for h in range(HKV):
        kept = set(kept_positions(layer)[h])
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
    assert kept_positions(layer)[0] == want and kept_positions(layer)[1] == want


def test_full_keeps_everything(tiny):
    r = run(
        tiny,
        make_policy("full"),
        list(b"hello world, " * 8),
        prefill=40,
        steps=20,
        teacher=True,
        opts=RunOptions(budget=5),
    )
    assert r.decisions.empty
    assert r.tensors["steps/kv_slots"][-1].unique().tolist() == [59]


def test_fraction_budget_is_share_of_prompt(tiny):
    r = run(
        tiny,
        make_policy("h2o"),
        list(b"x" * 100),
        prefill=80,
        steps=5,
        teacher=True,
        opts=RunOptions(budget=0.25),
    )
    assert r.meta.budget.slots == 20 and r.metrics["kv_slots_max"] == 20


def test_parameters_are_validated_with_one_sentence():
    with pytest.raises(KvlensError, match="no parameter 'window'"):
        make_policy("h2o", {"window": 3})
    with pytest.raises(KvlensError, match="recent_ratio of h2o must be in"):
        make_policy("h2o", {"recent_ratio": 1.5})
    with pytest.raises(KvlensError, match="must be an integer"):
        parse_settings("streaming_llm", ["sink=four"])
    assert parse_settings("scissorhands", ["history=12", "recent_ratio=0.3"]) == {
        "history": 12,
        "recent_ratio": 0.3,
    }
    with pytest.raises(KvlensError, match="Unknown policy"):
        make_policy("nope")
    assert parse_budget("64") == 64 and parse_budget("0.5") == 0.5
    for bad in ("0.0", "1.5", "abc"):
        with pytest.raises(KvlensError):
            parse_budget(bad)


def shuffled(layer: SlotRows, seed: int) -> SlotRows:
    """The same slots as `layer`, stored in a random slot order (as a cache that reuses freed slots holds
    them)."""
    perm = torch.randperm(layer.n_slots, generator=torch.Generator().manual_seed(seed))
    out = layer_rows()
    out.append(layer.keys[:, :, perm].clone(), layer.values[:, :, perm].clone(), layer.pos[0, perm])
    out.abar, out.nobs, out.last_attn = (
        layer.abar[:, perm],
        layer.nobs[:, perm],
        layer.last_attn[:, perm].clone(),
    )
    out.extra = {name: t[:, perm].clone() for name, t in layer.extra.items()}
    return out


SLOT_FREE = [
    ("streaming_llm", {}),
    ("h2o", {}),
    ("tova", {}),
    ("scissorhands", {"drop": 3}),
    ("cam", {}),
    ("cam", {"base": "h2o", "preset": "paper", "mask": "always"}),
    ("cam", {"preset": "kvpress"}),
    ("cam", {"base": "scissorhands", "preset": "official-summarization"}),
    ("weightedkv", {}),
    ("weightedkv", {"merge": False}),
]


@settings(max_examples=examples(30))
@given(cases, st.integers(1, 10_000), st.sampled_from(range(len(SLOT_FREE))))
def test_decisions_do_not_depend_on_which_slot_holds_which_position(case, perm_seed, which):
    seed, slots, budget = case
    name, params = SLOT_FREE[which]
    policy = make_policy(name, params)
    budget = max(budget, policy.needs().min_budget)
    layer = random_layer(seed, slots)
    gen = torch.Generator().manual_seed(seed + 2)
    coarse = torch.randint(0, 4, (HKV * G + 2 * HKV, slots), generator=gen).float()  # many equal scores: ties
    layer.abar, layer.last_attn = coarse[:HKV], coarse[HKV : HKV + HKV * G] / slots
    layer.extra = {DECODE_ATTN: coarse[-HKV:]}
    history_of(layer, torch.randint(0, 3, (HKV, slots, 8), generator=gen, dtype=torch.int8))
    other = shuffled(layer, perm_seed)
    _, log = compress(policy, layer, budget)
    _, other_log = compress(policy, other, budget)
    assert log.frame().equals(other_log.frame())
    a, b = in_position_order(layer), in_position_order(other)
    assert torch.equal(a.pos, b.pos) and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@settings(max_examples=examples(30))
@given(
    cases,
    st.integers(1, 10_000),
    st.sampled_from(["streaming_llm", "h2o", "tova", "scissorhands"]),
    st.integers(1, 4),
    st.booleans(),
)
def test_selection_keeps_the_highest_scores_and_the_older_of_equal_ones(
    case, perm_seed, name, leaving, older
):
    """`select_lowest`, with (one leaving: no sort) or without its fast path, and `evicted_lowest` (its
    evicted slots alone), against the rule written plainly; with `older_leaves_first` (WeightedKV's
    selection) the newer of equal scores stays."""
    seed, slots, _ = case
    policy = make_policy(name)
    budget = max(slots - leaving, policy.needs().min_budget)
    layer = random_layer(seed, budget + leaving)
    gen = torch.Generator().manual_seed(seed + 2)
    layer.abar = torch.randint(0, 3, (HKV, budget + leaving), generator=gen).float()  # ties
    layer.last_attn = torch.randint(0, 3, (HKV * G, budget + leaving), generator=gen).float()
    history_of(layer, torch.randint(0, 3, (HKV, budget + leaving, 8), generator=gen, dtype=torch.int8))
    layer = shuffled(layer, perm_seed)
    score, protected = (
        policy.score(layer, Step(1, Phase.DECODE, budget)).float(),
        policy.protected(layer, budget),
    )
    keep, evicted = select_lowest(layer, score, protected, budget, older)
    assert torch.equal(evicted_lowest(layer, score, protected, budget, older), evicted)
    for h in range(HKV):
        ranked = sorted(
            range(layer.n_slots),
            key=lambda s, h=h: (
                -(float("inf") if protected is not None and protected[h, s] else float(score[h, s])),
                -int(layer.pos[h, s]) if older else int(layer.pos[h, s]),
            ),
        )
        by_pos = lambda slots, h=h: sorted(slots, key=lambda s: int(layer.pos[h, s]))  # noqa: E731
        assert keep[h].tolist() == by_pos(ranked[:budget]) and evicted[h].tolist() == by_pos(ranked[budget:])


@settings(max_examples=examples(60))
@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(1, 40), st.floats(0.0, 1.0), st.booleans())
def test_the_lowest_of_all_rows_leave_ties_newest_first_then_lower_row(seed, r, s, share, shared_pos):
    """Ada-KV's and KVzip's selection over a layer's heads (a linear-time cut), against the rule written
    plainly: lowest score, then newest position, then lower row; free slots never leave."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.rand(r, s, generator=gen) < 0.8
    pos = torch.stack([torch.randperm(3 * s, generator=gen)[:s] for _ in range(r)])
    pos = (pos[:1].expand(r, s) if shared_pos else pos).masked_fill(~valid, -1)  # GQA heads share positions
    score = torch.randint(0, 3, (r, s), generator=gen).float()  # many ties
    leaving = int(share * int(valid.sum()))
    rows = SimpleNamespace(valid=valid, pos=pos)
    gone = lowest_of_all_rows(rows, score, leaving)  # type: ignore[arg-type]
    ranked = sorted(
        ((h, j) for h in range(r) for j in range(s) if valid[h, j]),
        key=lambda hj: (float(score[hj]), -int(pos[hj]), hj[0]),
    )
    want = [sorted(j for h2, j in ranked[:leaving] if h2 == h) for h in range(r)]
    assert [[j for j in row if j >= 0] for row in gone.tolist()] == want


@settings(max_examples=examples(40))
@given(st.integers(0, 10_000), st.integers(1, 40), st.integers(1, 45), st.booleans())
def test_newest_cut_selects_the_k_newest_positions_with_or_without_gaps(seed, slots, k, consecutive):
    gen = torch.Generator().manual_seed(seed)
    span = slots if consecutive else 3 * slots  # consecutive positions take the counting path, gaps the sort
    pos = torch.stack([torch.randperm(span, generator=gen)[:slots] for _ in range(HKV)])
    mask = torch.rand(HKV, slots, generator=gen) < 0.8
    got = mask & (pos >= newest_cut(pos, mask, k))
    for h in range(HKV):
        newest = sorted(pos[h, mask[h]].tolist(), reverse=True)[:k]
        assert sorted(pos[h, got[h]].tolist(), reverse=True) == newest
