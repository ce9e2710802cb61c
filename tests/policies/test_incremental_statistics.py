"""The per-step statistics that decode-time methods keep cheaply, each against its rule written plainly here:
the same decisions exactly (kept sets, targets), the same floats within rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlens.kvcache import Phase, Step, padded_slots
from kvlens.policies import make_policy
from kvlens.policies.d2o import D2O, nearest_slot
from kvlens.policies.key_norms import norm_of
from kvlens.policies.scissorhands import COUNT, IMPORTANT, UNIMPORTANT
from tests.conftest import examples, layer_rows


def plain_nearest(keys: torch.Tensor, keep: torch.Tensor, evicted: torch.Tensor):
    """D2O's Eq. 9 as written: every evicted key's cosine similarity to every kept key, one at a time; the
    first (oldest, `keep` in position order) of the best."""
    unit = F.normalize(keys.float(), dim=-1)
    best = torch.zeros(evicted.shape, dtype=torch.float32)
    where = torch.zeros(evicted.shape, dtype=torch.long)
    for r in range(keys.shape[0]):
        for i, slot in enumerate(evicted[r].tolist()):
            sims = [float(unit[r, slot] @ unit[r, k]) for k in keep[r].tolist()]
            top = max(sims)
            best[r, i], where[r, i] = top, sims.index(top)
    return best, where


@settings(max_examples=examples(25), deadline=None)
@given(st.integers(0, 10_000), st.integers(4, 40), st.integers(1, 12), st.booleans())
@example(0, 12, 1, True).via("a decode step with ties")
@example(1, 5, 1, False).via("a decode step")
def test_d2o_nearest_kept_key_is_eq9_with_the_oldest_of_ties(seed, slots, evicted, duplicates):
    """One product with the cache in place (`D2O.nearest`) finds the same nearest kept key as comparing each
    evicted key with each kept one, ties (duplicated keys) to the oldest kept; a decode step is E = 1."""
    gen = torch.Generator().manual_seed(seed)
    rows, d = 3, 8
    evicted = min(evicted, slots - 1)
    keys = torch.randn(rows, slots, d, generator=gen)
    if duplicates:  # exact ties: some kept keys repeat, some evicted keys equal a kept one
        keys[:, 1::3] = keys[:, 0:1]
    order = torch.stack([torch.randperm(slots, generator=gen) for _ in range(rows)])  # slot -> position rank
    gone = order[:, :evicted].sort(-1).values
    keep = order[:, evicted:].sort(-1).values  # in slot order: ascending = oldest first in this test
    got_best, got_where = D2O.nearest(keys, keep, gone)
    want_best, want_where = plain_nearest(keys, keep, gone)
    assert torch.equal(got_where, want_where)
    torch.testing.assert_close(got_best, want_best, rtol=1e-5, atol=1e-6)
    if evicted == 1:  # a decode step's search, against every other slot in place (positions: slot order)
        valid, pos = torch.ones(rows, slots, dtype=torch.bool), torch.arange(slots).expand(rows, -1)
        got_best, slot = nearest_slot(keys, norm_of(keys), valid, pos, gone)
        assert torch.equal(slot, keep.gather(1, want_where))
        torch.testing.assert_close(got_best, want_best, rtol=1e-5, atol=1e-6)


@settings(max_examples=examples(20), deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(1, 6),
    st.integers(1, 20),
    st.sampled_from(["unimportant", "important"]),
)
def test_scissorhands_counts_over_a_ring_are_the_last_window_counted_plainly(seed, history, steps, count):
    """Many decode steps (the ring wraps): each slot's count is its marks of the counted kind over exactly the
    last `history` steps, the prompt's rows included, as a plain list of every step's marks counts them; and
    so its eviction choice is the plain rule's."""
    gen = torch.Generator().manual_seed(seed)
    layer = layer_rows()
    slots, hkv, g = 12, 2, 2
    layer.append(torch.randn(1, hkv, slots, 2), torch.randn(1, hkv, slots, 2), torch.arange(slots))
    policy = make_policy("scissorhands", {"history": history, "count": count})
    start = torch.randint(0, 3, (hkv, slots, history), generator=gen, dtype=torch.int8)
    policy.set_history(layer, start.clone())
    seen = [start[:, :, i] for i in range(history)]  # every step's marks, oldest first
    for _ in range(steps):
        probs = torch.softmax(torch.randn(hkv, g, slots, generator=gen) * 3, -1)
        policy.observe(layer, probs)
        t = float(slots)  # threshold=slots: every slot valid
        seen.append(torch.where(layer.valid, 1 + (probs.mean(1) >= 1.0 / t).to(torch.int8), 0).to(torch.int8))
        kind = IMPORTANT if count == "important" else UNIMPORTANT
        plain = sum((marks == kind).int() for marks in seen[-history:])
        assert torch.equal(layer.extra[COUNT], plain.to(torch.int32))
        step = Step(1, Phase.DECODE, slots - 1)
        score = policy.score(layer, step)
        assert torch.equal(score.floor(), (plain if count == "important" else -plain).float())


@settings(max_examples=examples(40), deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(0, 40), st.floats(0.0, 1.0))
def test_marked_slots_are_scattered_into_place_as_a_sort_would_order_them(seed, rows, slots, share):
    """`padded_slots` (every eviction's list of slots to free) ranks each row's marks by a running count: the
    slots ascending, -1 padded, exactly as sorting the marked slot indices gives."""
    gen = torch.Generator().manual_seed(seed)
    gone = torch.rand(rows, slots, generator=gen) < share
    width = int(gone.sum(-1).max()) if slots else 0
    want = [sorted(torch.nonzero(row)[:, 0].tolist()) for row in gone]
    want = [w + [-1] * (width - len(w)) for w in want]
    assert padded_slots(gone).tolist() == want
