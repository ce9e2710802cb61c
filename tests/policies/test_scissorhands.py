"""Scissorhands' options as its paper sets them (Liu et al. 2023, §3.1, §4.1, Algorithm 2): the threshold 1/t,
the recent window r as a count of slots, m = 0.5B (`drop_ratio`) and the `paper` preset, each against the rule
written plainly on hand-made rows, random rows and the tiny model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.engine.context import Observer
from kvlens.engine.loop import RunOptions, run
from kvlens.errors import KvlensError
from kvlens.policies import make_policy, parse_settings
from kvlens.policies.scissorhands import BITS, COUNT, HISTORY, IMPORTANT, UNIMPORTANT, UNSEEN
from kvlens.runs.decisions import DecisionLog
from tests.conftest import examples, in_position_order, layer_rows, shrink

IDS = list(b"Persistence of importance: a token that mattered once keeps mattering. " * 3)


def plain_marks(pos: list[int], valid: list[bool], att: list[float], threshold: str) -> list[int]:
    """The mark of each slot at one decode step, the rule written plainly: a free slot is unseen; a kept one
    is important if its attention reaches 1/t, where t is the query's position + 1 (the tokens it would attend
    to without compression; the query is the newest position) under `position`, the slots it attends to under
    `slots`."""
    if threshold == "position":
        t = max(p for p, v in zip(pos, valid, strict=True) if v) + 1
    else:
        t = sum(valid)
    return [_label(a, v, t) for a, v in zip(att, valid, strict=True)]


def counted_steps(layer, history: int) -> torch.Tensor:
    """`(R, S, history)` bool: the ring's steps whose mark is counted (unimportant), unpacked from its bits
    (step k: bit k % 64 of word k // 64)."""
    ring = layer.extra[HISTORY]  # (R, S, W) int64
    return ((ring[..., None] >> torch.arange(BITS)) & 1).flatten(2)[..., :history].bool()


def _label(a: float, v: bool, t: int) -> int:
    if not v:
        return UNSEEN
    return IMPORTANT if a >= 1 / t else UNIMPORTANT


SCISSORHANDS = make_policy("scissorhands")  # its default count (unimportant steps) and the window's helpers


def decode_layer(positions: list[int], free: list[int] = ()):
    """One KV head with a history of 4 unseen steps at the given positions; `free` slots evicted (holes)."""
    layer = layer_rows()
    n = len(positions)
    layer.append(torch.randn(1, 1, n, 2), torch.randn(1, 1, n, 2), torch.tensor(positions))
    if free:
        layer.free(torch.tensor([list(free)]))
    make_policy("scissorhands", {"history": 4}).set_history(layer, torch.zeros(1, n, 4, dtype=torch.int8))
    return layer


@pytest.mark.parametrize(
    "threshold,marks", [("position", [2, 2, 2, 2, 0, 1, 2]), ("slots", [2, 1, 1, 1, 0, 1, 2])]
)
def test_scissorhands_threshold_is_one_over_t_with_t_the_query_position_plus_one_or_the_slots(
    threshold, marks
):
    # a compressed cache: 6 kept slots at positions up to 19 (the query, stored in slot 6), slot 4 freed
    layer = decode_layer([0, 3, 7, 12, 8, 15, 19], free=[4])
    # two query heads; their mean is the KV head's attention: 0.30, 0.051, 0.10, 0.06, (free), 0.049, 0.44
    mean = torch.tensor([0.30, 0.051, 0.10, 0.06, 0.0, 0.049, 0.44])
    probs = torch.stack([mean + 0.01, mean - 0.01])[None]  # (R, G, S)
    probs[0, :, 4] = 0.0
    make_policy("scissorhands", {"history": 4, "threshold": threshold}).observe(layer, probs)
    # position: t = 19 + 1 = 20, 1/t = 0.05: 0.051 is important and 0.049 is not (1/19 = 0.0526 would mark
    # 0.051 unimportant: t is the position + 1, not the position); slots: 6 valid slots, 1/6 = 0.167
    assert SCISSORHANDS.newest_marks(layer)[0].tolist() == marks
    assert counted_steps(layer, 4)[0, :, 0].tolist() == [m == UNIMPORTANT for m in marks]  # the oldest step
    assert marks == plain_marks(
        [0, 3, 7, 12, -1, 15, 19], [True] * 4 + [False] + [True] * 2, mean.tolist(), threshold
    )
    assert not counted_steps(layer, 4)[0, :, 1:].any()  # the other steps untouched (unseen)
    assert layer.extra[COUNT][0].tolist() == [int(m == UNIMPORTANT) for m in marks]


@settings(max_examples=examples(40))
@given(
    st.integers(0, 10_000), st.integers(2, 30), st.integers(0, 200), st.sampled_from(["position", "slots"])
)
def test_scissorhands_marks_follow_the_threshold_rule_on_random_rows(seed, slots, gap, threshold):
    gen = torch.Generator().manual_seed(seed)
    hkv, g = 2, 3
    layer = layer_rows()
    # positions: slots of a compressed cache, in a random slot order, spread over [0, slots + gap)
    pos = torch.stack([torch.randperm(slots + gap, generator=gen)[:slots] for _ in range(hkv)])
    pos[:, 0] = slots + gap  # the query: the newest position, in slot 0 (it need not be the last slot)
    layer.append(
        torch.randn(1, hkv, slots, 2, generator=gen),
        torch.randn(1, hkv, slots, 2, generator=gen),
        torch.arange(slots),
    )
    holes = torch.rand(hkv, slots, generator=gen) < 0.2  # freed slots: position -1, not valid
    holes[:, 0] = False
    layer.pos, layer.valid = pos.masked_fill(holes, -1), ~holes
    policy = make_policy("scissorhands", {"history": 5, "threshold": threshold})
    policy.set_history(layer, torch.randint(0, 3, (hkv, slots, 5), generator=gen, dtype=torch.int8))
    before = counted_steps(layer, 5)
    probs = torch.softmax(torch.randn(hkv, g, slots, generator=gen) * 2, -1).masked_fill(holes[:, None], 0.0)
    policy.observe(layer, probs)
    att = probs.mean(1)
    for h in range(hkv):
        want = plain_marks(layer.pos[h].tolist(), (~holes[h]).tolist(), att[h].tolist(), threshold)
        assert policy.newest_marks(layer)[h].tolist() == want
        # the ring's oldest step, replaced
        assert counted_steps(layer, 5)[h, :, 0].tolist() == [m == UNIMPORTANT for m in want]
    assert torch.equal(counted_steps(layer, 5)[:, :, 1:], before[:, :, 1:])
    assert torch.equal(layer.extra[COUNT], counted_steps(layer, 5).sum(-1, dtype=torch.int32))


@pytest.mark.parametrize("history,count", [(70, "unimportant"), (64, "important"), (3, "unimportant")])
def test_scissorhands_ring_counts_the_last_history_steps_over_many_steps(history, count):
    """Steps past the ring's length and its words' boundaries (bit 63 included): each slot's count is its
    marks of the counted kind among the last `history` steps, kept plainly here as a list per slot."""
    gen = torch.Generator().manual_seed(history)
    hkv, slots = 2, 9
    layer = layer_rows()
    layer.append(
        torch.randn(1, hkv, slots, 2, generator=gen),
        torch.randn(1, hkv, slots, 2, generator=gen),
        torch.arange(slots),
    )
    policy = make_policy("scissorhands", {"history": history, "count": count})
    start = torch.randint(0, 3, (hkv, slots, history), generator=gen, dtype=torch.int8)
    policy.set_history(layer, start)
    window = [[start[h, j].tolist() for j in range(slots)] for h in range(hkv)]  # oldest first
    kind = IMPORTANT if count == "important" else UNIMPORTANT
    for _ in range(2 * history + 5):
        probs = torch.softmax(torch.randn(hkv, 2, slots, generator=gen) * 3, -1)
        policy.observe(layer, probs)
        marks = policy.newest_marks(layer)
        for h in range(hkv):
            for j in range(slots):
                window[h][j] = window[h][j][1:] + [int(marks[h, j])]
        want = [[sum(m == kind for m in window[h][j]) for j in range(slots)] for h in range(hkv)]
        assert layer.extra[COUNT].tolist() == want


class Marks(Observer):
    """After each decode step's `observe`: the step's marks, attention and rows, per layer."""

    needs_rows = True

    def __init__(self):
        self.steps: dict[int, list] = {}

    def on_decode(self, layer, query, probs, out, spec):
        self.steps.setdefault(layer.layers[0], []).append(
            (layer.pos.clone(), layer.valid.clone(), probs.mean(1), SCISSORHANDS.newest_marks(layer).clone())
        )


def test_scissorhands_position_threshold_in_a_run_uses_each_decode_query_s_own_position(tiny):
    """On the tiny model, decode step k's query is at position prefill + k: its marks are those of 1/(prefill
    + k
    + 1), not of 1/(kept slots), and under `slots` those of the kept slots."""
    prefill, steps, budget = 80, 8, 12
    for threshold in ("position", "slots"):
        spy = Marks()
        run(
            tiny,
            make_policy("scissorhands", {"threshold": threshold}),
            IDS,
            prefill=prefill,
            steps=steps,
            teacher=True,
            opts=RunOptions(budget=budget),
            observers=[spy],
        )
        for layer_steps in spy.steps.values():
            assert len(layer_steps) == steps - 1
            for k, (pos, valid, att, marks) in enumerate(layer_steps):
                assert int(pos.max()) == prefill + k  # the query itself is in the cache as it attends
                for h in range(pos.shape[0]):
                    want = plain_marks(pos[h].tolist(), valid[h].tolist(), att[h].tolist(), threshold)
                    assert marks[h].tolist() == want, (threshold, k, h)


def test_scissorhands_recent_keeps_that_many_newest_slots_whatever_their_marks():
    layer = layer_rows()
    layer.append(torch.randn(1, 1, 9, 2), torch.randn(1, 1, 9, 2), torch.arange(9))
    layer.abar = torch.tensor([[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]])
    # unimportant counts 0, 3, 1, 3, 2, 3, 3, 3, 3 over 3 steps: the three newest (6-8) are the worst
    marks = [
        [2, 2, 2],
        [1, 1, 1],
        [1, 2, 2],
        [1, 1, 1],
        [1, 1, 2],
        [1, 1, 1],
        [1, 1, 1],
        [1, 1, 1],
        [1, 1, 1],
    ]
    SCISSORHANDS.set_history(layer, torch.tensor([marks], dtype=torch.int8))
    policy = make_policy("scissorhands", {"history": 3, "recent": 3})
    assert policy.local_window(5) == 3 and policy.local_window(2) == 2  # never more than the size kept
    shrink(policy, layer, 5, DecisionLog())
    # recent 6, 7, 8; then the two fewest unimportant steps among 0-5: slots 0 (0) and 2 (1)
    assert in_position_order(layer).pos[0].tolist() == [0, 2, 6, 7, 8]


@settings(max_examples=examples(40))
@given(st.integers(0, 10_000), st.integers(8, 50), st.integers(1, 6), st.integers(1, 4), st.floats(0.0, 0.6))
def test_scissorhands_recent_and_drop_against_the_rule_written_plainly(seed, slots, recent, drop, drop_ratio):
    """Keep the `recent` newest slots, then the fewest unimportant steps (ties: larger Abar, then the older),
    down to budget + 1 - m slots, m = drop or max(1, floor(drop_ratio x budget))."""
    gen = torch.Generator().manual_seed(seed)
    policy = make_policy(
        "scissorhands", {"history": 6, "recent": recent, "drop": drop, "drop_ratio": drop_ratio}
    )
    budget = max(policy.needs().min_budget, slots // 2)
    if budget >= slots:
        return
    hkv = 2
    layer = layer_rows()
    layer.append(
        torch.randn(1, hkv, slots, 2, generator=gen),
        torch.randn(1, hkv, slots, 2, generator=gen),
        torch.arange(slots),
    )
    layer.abar = torch.stack([torch.randperm(slots, generator=gen) for _ in range(hkv)]).float()  # distinct
    hist = torch.randint(0, 3, (hkv, slots, 6), generator=gen, dtype=torch.int8)
    SCISSORHANDS.set_history(layer, hist)
    unimportant, abar = (hist == UNIMPORTANT).sum(-1).tolist(), layer.abar.tolist()
    shrink(policy, layer, budget, DecisionLog())
    m = max(1, int(drop_ratio * budget)) if drop_ratio else drop
    size = budget + 1 - m
    assert size >= recent + 1  # min_budget: the recent window and one slot chosen by importance always fit
    for h in range(hkv):
        newest = list(range(slots - recent, slots))
        older = sorted(range(slots - recent), key=lambda j, h=h: (unimportant[h][j], -abar[h][j], j))
        assert in_position_order(layer).pos[h].tolist() == sorted(older[: size - recent] + newest)


def test_scissorhands_recent_slots_equal_the_ratio_that_gives_as_many():
    """recent=6 at budget 12 is recent_ratio=0.5 there: the same run, decision for decision; recent=0 is the
    ratio (the defaults)."""
    layers = []
    for params in ({"recent": 6, "recent_ratio": 0.9}, {"recent_ratio": 0.5}, {"recent": 0}):
        layer = layer_rows()
        gen = torch.Generator().manual_seed(3)
        layer.append(
            torch.randn(1, 2, 30, 2, generator=gen), torch.randn(1, 2, 30, 2, generator=gen), torch.arange(30)
        )
        layer.abar = torch.rand(2, 30, generator=gen)
        SCISSORHANDS.set_history(layer, torch.randint(0, 3, (2, 30, 8), generator=gen, dtype=torch.int8))
        shrink(make_policy("scissorhands", {"history": 8, **params}), layer, 12, DecisionLog())
        layers.append(in_position_order(layer).pos)
    assert torch.equal(layers[0], layers[1]) and torch.equal(layers[1], layers[2])


def test_scissorhands_min_budget_keeps_room_for_the_recent_window():
    assert make_policy("scissorhands").needs().min_budget == 1
    assert make_policy("scissorhands", {"drop": 3}).needs().min_budget == 3
    assert make_policy("scissorhands", {"drop_ratio": 0.5}).needs().min_budget == 1
    assert make_policy("scissorhands", {"recent": 10}).needs().min_budget == 11  # 10 recent + 1 by importance
    assert (
        make_policy("scissorhands", {"recent": 3, "drop": 4}).needs().min_budget == 7
    )  # 7 + 1 - 4 = 4 = 3 + 1
    # m = floor(B / 2): B = 19 keeps 19 + 1 - 9 = 11 = r + 1; B = 18 would keep 18 + 1 - 9 = 10
    assert make_policy("scissorhands", {"recent": 10, "drop_ratio": 0.5}).needs().min_budget == 19
    with pytest.raises(KvlensError, match="drop_ratio=1 of scissorhands drops the whole budget"):
        make_policy("scissorhands", {"recent": 10, "drop_ratio": 1.0})
    with pytest.raises(KvlensError, match="drop_ratio of scissorhands must be in"):
        make_policy("scissorhands", {"drop_ratio": 1.5})


def test_scissorhands_paper_preset_is_the_paper_s_settings_and_explicit_values_win():
    paper = make_policy("scissorhands", parse_settings("scissorhands", ["preset=paper"]))
    assert paper.params() == {
        "history": 400,
        "recent": 10,
        "recent_ratio": 0.5,
        "threshold": "position",
        "count": "unimportant",
        "drop": 1,
        "drop_ratio": 0.5,
    }
    assert (
        paper.dropped(64) == 32 and paper.dropped(51) == 25 and paper.local_window(33) == 10
    )  # m = 0.5B, r = 10
    assert paper.needs().prefill_rows == 400  # w: the last 400 queries (all of a shorter prompt's)
    assert make_policy("scissorhands", {"preset": "paper", "history": 64}).history == 64
    default = make_policy("scissorhands")
    assert (default.threshold, default.recent, default.drop_ratio, default.history) == ("slots", 0, 0.0, 64)


def test_scissorhands_paper_preset_drops_half_the_budget_when_full(tiny):
    """m = 0.5B: at budget 20 the cache drops to 20 + 1 - 10 = 11 slots each time it passes 20."""
    r = run(
        tiny,
        make_policy("scissorhands", {"preset": "paper"}),
        IDS,
        prefill=80,
        steps=24,
        teacher=True,
        opts=RunOptions(budget=20),
    )
    assert r.tensors["steps/kv_slots"].amax((1, 2)).tolist() == [11 + k % 10 for k in range(24)]
    with pytest.raises(KvlensError, match="Budget 18 is below the 19 slots that scissorhands always keeps"):
        run(
            tiny,
            make_policy("scissorhands", {"preset": "paper"}),
            IDS,
            prefill=80,
            steps=4,
            teacher=True,
            opts=RunOptions(budget=18),
        )
