"""D2O (Wan et al., ICLR 2025): the token-level rule (H2O eviction, nearest kept key, EMA threshold, Eq. 12
weights) and the layer allocation, each against the same rule written plainly here, on hand-made and random
rows."""

from __future__ import annotations

import math
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.engine.loop import RunOptions, run
from kvlens.figures.provenance import replay
from kvlens.kvcache import Phase, Step
from kvlens.kvcache.views import SlotRows
from kvlens.policies import d2o, make_policy
from kvlens.policies.d2o import THRESHOLD, bounded_shares
from kvlens.policies.key_norms import norm_of
from kvlens.runs.decisions import DecisionLog
from tests.conftest import examples, in_position_order, layer_rows, shrink

HKV, D = 2, 4
IDS = list(b"Dense layers keep more; similar keys merge into the nearest kept one. " * 3)


def frame_rows(log: DecisionLog, start: int = 0) -> list[tuple]:
    """(kv_head, action, position, target, weight) of the log's rows from `start`, in order."""
    f = log.frame().iloc[start:]
    return [
        (
            int(r.kv_head),
            r.action,
            int(r.position),
            int(r.targets[0]) if len(r.targets) else -1,
            float(r.weights[0]) if len(r.weights) else 0.0,
        )
        for r in f.itertuples()
    ]


# ---------------------------------------------------------------- a hand-made step


def test_d2o_merges_the_evicted_tokens_above_the_mean_similarity_into_their_nearest_kept_key():
    layer = layer_rows()
    keys = torch.tensor([[1, 0], [1, 0.1], [0, 1], [0.1, 1], [1, 0.2], [-1, 0.5], [1, 1], [-1, 0]])
    values = torch.arange(16, dtype=torch.float32).view(8, 2)
    layer.append(keys.view(1, 1, 8, 2).clone(), values.view(1, 1, 8, 2).clone(), torch.arange(8))
    layer.abar = torch.tensor([[9.0, 1.0, 5.0, 2.0, 0.5, 3.0, 0.0, 0.0]])
    log = DecisionLog()
    # budget 4: sink 0, recent window int(4 x 0.5) = 2 (positions 6, 7), one heavy hitter: position 2 (Abar 5)
    shrink(make_policy("d2o", {"sink": 1}), layer, 4, log, prompt=True)
    cos = lambda a, b: float(keys[a] @ keys[b] / (keys[a].norm() * keys[b].norm()))  # noqa: E731
    u = {
        1: cos(1, 0),
        3: cos(3, 2),
        4: cos(4, 0),
        5: cos(5, 7),
    }  # each evicted key's nearest kept key, by hand
    tau = sum(u.values()) / 4  # the first compression: tau = mean of the best similarities (0.966)
    assert (
        u[1] >= tau and u[3] >= tau and u[4] >= tau > u[5]
    )  # 1, 4 -> 0 and 3 -> 2 merge; 5 (0.894) is evicted
    s0, s2 = math.exp(u[1]) + math.exp(u[4]), math.exp(u[3])
    w = {
        1: math.exp(u[1]) / (s0 + math.e),
        4: math.exp(u[4]) / (s0 + math.e),
        3: math.exp(u[3]) / (s2 + math.e),
    }
    rows = frame_rows(log)
    assert [r[:4] for r in rows] == [
        (0, "merge", 1, 0),
        (0, "merge", 4, 0),
        (0, "merge", 3, 2),
        (0, "evict", 5, -1),
    ]
    assert [r[4] for r in rows[:3]] == pytest.approx([w[1], w[4], w[3]], rel=1e-5)
    assert float(layer.state[THRESHOLD]) == pytest.approx(tau, rel=1e-6)
    kept = in_position_order(layer)
    assert kept.pos[0].tolist() == [0, 2, 6, 7]
    w0, w2 = math.e / (s0 + math.e), math.e / (s2 + math.e)
    for states, original in ((kept.keys, keys), (kept.values, values)):  # Eq. 11: keys and values alike
        want = original[[0, 2, 6, 7]].clone()
        want[0] = w0 * original[0] + w[1] * original[1] + w[4] * original[4]
        want[1] = w2 * original[2] + w[3] * original[3]
        torch.testing.assert_close(states[0, 0], want)


# ---------------------------------------------------------------- the rule written plainly, over several
# steps


def plain_step(heads: list[dict], budget: int, sink: int, recent_ratio: float, beta: float, scope: str, tau):
    """One D2O compression of `heads` (per KV head {position: [key, value, abar]}, float64) written plainly,
    in place. Returns the new threshold and the log rows (kv_head, action, position, target, weight) in the
    policy's order."""
    found = []  # (head, source, best similarity, nearest kept position)
    for h, slots in enumerate(heads):
        order = sorted(slots)
        recent = (
            set(order[len(order) - int(budget * recent_ratio) :]) if int(budget * recent_ratio) else set()
        )
        protected = {q for q in order if q < sink} | recent
        ranked = sorted(
            order, key=lambda q, s=slots, p=protected: (0, 0.0, q) if q in p else (1, -s[q][2], q)
        )
        keep = sorted(ranked[:budget])
        for i in sorted(ranked[budget:]):
            k = slots[i][0]
            cos = [float(k @ slots[c][0] / (k.norm() * slots[c][0].norm())) for c in keep]
            best = max(range(len(keep)), key=lambda j, cos=cos: (cos[j], -j))  # the oldest on ties
            found.append((h, i, cos[best], keep[best]))
    if scope == "layer":
        seen = {h: sum(f[2] for f in found) / len(found) for h in range(len(heads))}
    else:
        seen = {
            h: sum(f[2] for f in found if f[0] == h) / sum(f[0] == h for f in found)
            for h in range(len(heads))
        }
    tau = seen if tau is None else {h: beta * seen[h] + (1 - beta) * tau[h] for h in seen}
    merges, evictions = [], []
    for h, i, u, c in found:
        (merges if u >= tau[h] else evictions).append((h, i, u, c))
    rows = []
    for h, slots in enumerate(heads):
        into: dict[int, list] = {}
        for _, i, u, c in (m for m in merges if m[0] == h):
            into.setdefault(c, []).append((i, u))
        new = {}
        for c, sources in into.items():
            total = sum(math.exp(u) for _, u in sources) + math.e
            for n in (0, 1):  # key, value
                new.setdefault(c, [None, None])[n] = (
                    (
                        math.e / total * slots[c][n]
                        + sum(math.exp(u) / total * slots[i][n] for i, u in sources)
                    )
                    .float()
                    .double()
                )  # stored as float32
            rows += [(h, "merge", i, c, math.exp(u) / total) for i, u in sorted(sources)]
        rows.sort(key=lambda r: (r[0], r[3], r[2]))
        for c, (k, v) in new.items():
            slots[c][0], slots[c][1] = k, v
        for _, i, _, _ in (f for f in found if f[0] == h):
            del slots[i]
    rows = sorted(rows, key=lambda r: (r[0], r[3], r[2])) + [
        (h, "evict", i, -1, 0.0) for h, i, _, _ in evictions
    ]
    return tau, rows


def norms_checked(search):
    """`nearest_slot`, first checking that the cached key norms it is given are exactly a fresh pass's."""

    def checked(keys, norms, valid, *rest):
        assert torch.equal(norms[valid], norm_of(keys)[valid])
        return search(keys, norms, valid, *rest)

    return checked


@settings(max_examples=examples(25))
@given(
    st.integers(0, 10_000),
    st.integers(10, 40),
    st.integers(6, 30),
    st.integers(0, 4),
    st.floats(0.0, 1.0),
    st.sampled_from(["layer", "head"]),
)
def test_d2o_prompt_and_decode_compressions_equal_the_rule_written_plainly(
    seed, slots, budget, steps, beta, scope
):
    budget = min(budget, slots - 1)
    gen = torch.Generator().manual_seed(seed)
    total = slots + steps
    keys, values = torch.randn(HKV, total, D, generator=gen), torch.randn(HKV, total, D, generator=gen)
    abar = torch.rand(HKV, total, generator=gen) * 5  # each position's accumulated attention
    layer = layer_rows()
    layer.append(keys[None, :, :slots].clone(), values[None, :, :slots].clone(), torch.arange(slots))
    layer.abar = abar[:, :slots].clone()
    heads = [
        {q: [keys[h, q].double(), values[h, q].double(), float(abar[h, q])] for q in range(slots)}
        for h in range(HKV)
    ]
    policy = make_policy("d2o", {"sink": 2, "beta": beta, "threshold_scope": scope})
    log, tau = DecisionLog(), None
    for step in range(steps + 1):
        if step:  # a decode step: the new token's slot, then every slot's Abar
            q = slots + step - 1
            layer.append(
                keys[None, :, q : q + 1].clone(), values[None, :, q : q + 1].clone(), torch.tensor([q])
            )
            layer.abar = torch.where(layer.valid, abar.gather(1, layer.pos.clamp(min=0)), 0.0)
            for h in range(HKV):
                heads[h][q] = [keys[h, q].double(), values[h, q].double(), float(abar[h, q])]
        start = len(log.frame())
        with patch.object(d2o, "nearest_slot", side_effect=norms_checked(d2o.nearest_slot)) as searched:
            policy.compress(layer, Step(step, Phase.PREFILL if step == 0 else Phase.DECODE, budget, log))
        assert searched.call_count == (step > 0 or slots == budget + 1), step  # one slot leaving: one search
        tau, want = plain_step(heads, budget, 2, 0.5, beta, scope, tau)
        got = frame_rows(log, start)
        assert [r[:4] for r in got] == [r[:4] for r in want], step
        assert [r[4] for r in got] == pytest.approx([r[4] for r in want], rel=1e-5)
        state = layer.state[THRESHOLD]
        assert state.tolist() == pytest.approx(
            tau[0] if scope == "layer" else [tau[h] for h in range(HKV)], rel=1e-5
        )
        kept = in_position_order(layer)
        for h in range(HKV):
            assert kept.pos[h].tolist() == sorted(heads[h])
            torch.testing.assert_close(
                kept.keys[0, h],
                torch.stack([heads[h][q][0] for q in sorted(heads[h])]).float(),
                rtol=1e-5,
                atol=1e-5,
            )
            torch.testing.assert_close(
                kept.values[0, h],
                torch.stack([heads[h][q][1] for q in sorted(heads[h])]).float(),
                rtol=1e-5,
                atol=1e-5,
            )


@pytest.mark.parametrize("evicted", [[[0, 4]], [[4]]])
def test_d2o_nearest_gives_the_oldest_of_equally_similar_kept_keys(evicted):
    """Eq. 9's argmax with ties: the kept key earliest in `keep` (position order) wins, for a prompt's many
    evicted keys (one product with the kept keys); a decode step's one is held against every valid slot in
    place (`nearest_slot`), where a later slot may hold an older position."""
    from kvlens.policies.d2o import D2O, nearest_slot

    keys = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [1.0, 0.0], [0.0, 3.0], [1.0, 0.1]]])  # (1, S, 2)
    keep = torch.tensor([[3, 2, 1]])  # positions in order: slot 3 before slots 2 and 1 (equal directions)
    u, nearest = D2O.nearest(keys, keep, torch.tensor(evicted))
    assert nearest[0, -1].item() == 1  # slot 2, the first of the two kept keys along (1, 0)
    assert u[0, -1].item() == pytest.approx(1 / math.sqrt(1.01))
    pos, valid = torch.tensor([[9, 2, 1, 0, 5]]), torch.tensor([[False, True, True, True, True]])
    u, slot = nearest_slot(keys, norm_of(keys), valid, pos, torch.tensor([[4]]))
    assert slot.item() == 2 and u.item() == pytest.approx(1 / math.sqrt(1.01))  # slot 0 is free


def clustered_layer(
    seed: int, slots: int, prompt: int | None = None
) -> tuple[SlotRows, torch.Tensor, torch.Tensor]:
    """Keys drawn around 3 directions (many similar keys: several sources per target) and their values `(Hkv,
    slots, D)`; the layer holds the first `prompt` positions (all by default), with random Abar."""
    prompt = slots if prompt is None else prompt
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(3, D, generator=gen)
    keys = base[torch.randint(0, 3, (HKV, slots), generator=gen)] + 0.2 * torch.randn(
        HKV, slots, D, generator=gen
    )
    values = torch.randn(HKV, slots, D, generator=gen)
    layer = layer_rows()
    layer.append(keys[None, :, :prompt].clone(), values[None, :, :prompt].clone(), torch.arange(prompt))
    layer.abar = torch.rand(HKV, prompt, generator=gen) * 5
    return layer, keys, values


def test_d2o_provenance_replay_rebuilds_every_key_and_value_over_several_steps():
    """The `set` rule needs all sources of one target of one head in consecutive rows: logged head by head."""
    layer, keys, values = clustered_layer(3, 50, prompt=40)  # positions 40-49 come in as decode tokens
    log = DecisionLog()
    policy = make_policy("d2o", {"beta": 0.3})
    shrink(policy, layer, 12, log, prompt=True)
    for q in range(40, 50):
        layer.append(keys[None, :, q : q + 1].clone(), values[None, :, q : q + 1].clone(), torch.tensor([q]))
        policy.compress(layer, Step(q - 39, Phase.DECODE, 12, log))
    frame = log.frame()
    merges = frame[frame.action == "merge"]
    step0 = merges[merges.step == 0]
    assert (
        step0.groupby(["kv_head", step0.targets.map(lambda t: t[0])]).size() > 1
    ).any()  # several into one
    assert len(merges[merges.step > 0])
    prov = replay(frame, "set")
    for h in range(HKV):
        for s in torch.nonzero(layer.valid[h]).flatten().tolist():
            p = int(layer.pos[h, s])
            sources = prov.get((0, h), {}).get(p, {p: 1.0})
            assert sum(sources.values()) == pytest.approx(1.0)
            for now, original in ((layer.keys, keys), (layer.values, values)):
                torch.testing.assert_close(
                    now[0, h, s], sum(w * original[h, q] for q, w in sources.items()), atol=1e-5, rtol=1e-5
                )


@settings(max_examples=examples(20))
@given(st.integers(0, 10_000), st.integers(12, 40), st.integers(5, 11), st.integers(1, 10_000))
def test_d2o_decisions_do_not_depend_on_which_slot_holds_which_position(seed, slots, budget, perm_seed):
    layer, _, _ = clustered_layer(seed, slots)
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(perm_seed))
    other = layer_rows()
    other.append(layer.keys[:, :, perm].clone(), layer.values[:, :, perm].clone(), perm)
    other.abar = layer.abar[:, perm]
    logs = [DecisionLog(), DecisionLog()]
    for rows, log in zip((layer, other), logs, strict=True):
        shrink(make_policy("d2o"), rows, budget, log, prompt=True)
    assert logs[0].frame().equals(logs[1].frame())
    a, b = in_position_order(layer), in_position_order(other)
    assert torch.equal(a.pos, b.pos) and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_d2o_without_merging_sinks_or_reallocation_is_h2o():
    a, _, _ = clustered_layer(5, 30)
    b, _, _ = clustered_layer(5, 30)
    log_a, log_b = DecisionLog(), DecisionLog()
    shrink(make_policy("d2o", {"merge": False, "sink": 0, "recent_ratio": 0.25}), a, 12, log_a, prompt=True)
    shrink(make_policy("h2o", {"recent_ratio": 0.25}), b, 12, log_b, prompt=True)
    assert log_a.frame().equals(log_b.frame()) and (log_a.frame().action == "evict").all()
    a, b = in_position_order(a), in_position_order(b)
    assert torch.equal(a.pos, b.pos) and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


# ---------------------------------------------------------------- layer allocation


def prompt_layer(column_sums: list[list[float]]) -> SlotRows:
    layer = layer_rows()
    t = len(column_sums[0])
    layer.append(
        torch.zeros(1, len(column_sums), t, D), torch.zeros(1, len(column_sums), t, D), torch.arange(t)
    )
    layer.abar = torch.tensor(column_sums)
    return layer


def test_d2o_gives_denser_layers_more_budget_and_keeps_the_total():
    t = 60
    sums = [
        [[1.0] * t, [1.0] * t],  # uniform column sums: variance 0, the densest layer
        [[2.0, 1.0] * (t // 2), [1.0] * t],
        [[t / 2, t / 2] + [0.0] * (t - 2), [3.0, 0.0, 1.0] * (t // 3)],
        [[float(t)] + [0.0] * (t - 1)] * 2,
    ]  # all attention on one key: the sparsest
    layers = [prompt_layer(s) for s in sums]
    for density in ("layers", "official"):
        got = make_policy("d2o", {"density": density}).allocate(30, layers)
        assert sum(got) == 30 * 4 and all(5 <= b <= t for b in got)
        # the rule written plainly: unbiased variance of each head's column sums, a score per layer,
        # softmax(-score)
        var = torch.tensor(
            [[torch.tensor(head).var().item() for head in layer] for layer in sums], dtype=torch.float64
        )
        if density == "layers":
            v = var.mean(1)
            score = (v - v.min()) / (v.max() - v.min() + 1e-6)
        else:
            score = torch.stack([((x - x.min()) / (x.max() - x.min() + 1e-6)).mean() for x in var])
        want = torch.softmax(-score, 0) * 4 * 30  # no bound binds here
        assert all(abs(b - w) < 1 for b, w in zip(got, want.tolist(), strict=True)), (density, got, want)
    got = make_policy("d2o").allocate(30, layers)
    assert got[0] > got[-1] and got == sorted(got, reverse=True)  # variance grows down this stack
    assert make_policy("d2o", {"allocation": "uniform"}).allocate(30, layers) == [30] * 4


@settings(max_examples=examples(60))
@given(
    st.lists(st.floats(1e-3, 1.0), min_size=1, max_size=32),
    st.integers(1, 20),
    st.integers(0, 200),
    st.floats(0.0, 1.0),
)
def test_bounded_shares_sum_to_the_total_within_bounds_in_the_order_of_the_shares(shares, lo, span, where):
    n, hi = len(shares), lo + span
    total = n * lo + round(where * n * span)
    got = bounded_shares(shares, total, lo, hi)
    assert sum(got) == total and all(lo <= b <= hi for b in got)
    for i in range(n):
        for j in range(n):
            if shares[i] > shares[j]:
                assert got[i] >= got[j]
    plain = [total * s / sum(shares) for s in shares]  # where no bound binds: the proportional share, rounded
    if all(lo <= x <= hi for x in plain):
        assert all(abs(b - x) < 1 for b, x in zip(got, plain, strict=True))


# ---------------------------------------------------------------- a run


def test_a_d2o_run_keeps_the_total_budget_merges_at_every_step_and_reallocates(tiny):
    r = run(tiny, make_policy("d2o"), IDS, prefill=120, steps=8, teacher=True, opts=RunOptions(budget=30))
    slots = r.tensors["steps/kv_slots"]  # (steps, L, Hkv)
    assert (slots.sum((1, 2)) == 30 * slots.shape[1] * slots.shape[2]).all()
    assert r.metrics["kv_entries_max"] == r.metrics["kv_entries_budget"] and math.isfinite(r.metrics["ppl"])
    d = r.decisions
    assert set(d.action) == {"merge", "evict"} and (d[d.action == "merge"].step > 0).any()
    uniform = run(
        tiny,
        make_policy("d2o", {"allocation": "uniform"}),
        IDS,
        prefill=120,
        steps=8,
        teacher=True,
        opts=RunOptions(budget=30),
    )
    assert (uniform.tensors["steps/kv_slots"] == 30).all()
    assert not (slots == 30).all()  # the dynamic allocation really moved budget between layers
