"""The methods the field compares against (SnapKV, PyramidKV, Ada-KV, Expected Attention, KNorm, KeyDiff,
Q-Filters, random): each rule against the same rule written plainly here, on hand-made or random rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens import texts
from kvlens.engine.loop import RunOptions, run
from kvlens.kvcache import Phase, Prompt, Step
from kvlens.policies import make_policy
from kvlens.policies.expected_attention import rotate_half
from kvlens.policies.keydiff import KEY_NORM
from kvlens.runs.decisions import DecisionLog
from tests.conftest import examples, in_position_order, layer_rows, shrink, within_budget

HKV, G, D = 2, 2, 8
IDS = list(b"Observation windows, pyramids and filters: which keys does each method keep? " * 3)


def random_layer(seed: int, slots: int):
    gen = torch.Generator().manual_seed(seed)
    layer = layer_rows()
    layer.append(
        torch.randn(1, HKV, slots, D, generator=gen),
        torch.randn(1, HKV, slots, D, generator=gen),
        torch.arange(slots),
    )
    return layer


def kept(layer) -> list[list[int]]:
    return in_position_order(layer).pos.tolist()


@settings(max_examples=examples(25))
@given(st.integers(0, 10_000), st.integers(12, 40), st.integers(3, 10))
def test_knorm_and_keydiff_keep_the_lowest_norms_and_the_least_typical_keys(seed, slots, budget):
    for name in ("knorm", "keydiff"):
        layer = random_layer(seed, slots)
        keys = layer.keys[0].clone()
        shrink(make_policy(name), layer, budget, prompt=True)
        for h in range(HKV):
            if name == "knorm":
                score = -keys[h].norm(dim=-1)
            else:
                anchor = F.normalize(keys[h], dim=-1).mean(0)
                score = -F.cosine_similarity(keys[h], anchor[None], dim=-1)
            assert kept(layer)[h] == sorted(score.topk(budget).indices.tolist()), (name, h)


@settings(max_examples=examples(25))
@given(st.integers(0, 10_000), st.integers(6, 30), st.integers(1, 8), st.integers(0, 2))
def test_keydiff_decode_steps_with_cached_norms_keep_what_a_fresh_pass_keeps(seed, budget, steps, gap):
    """A prompt compression, then decode steps (one new key each; after a `gap` the cached key norms are
    recomputed): every step keeps the slots that KeyDiff's rule keeps written plainly over the kept keys, and
    the cached norms are exactly a fresh pass's."""
    slots = budget + 5
    new = torch.randn(HKV, steps, D, generator=torch.Generator().manual_seed(seed + 10_007))
    layer, policy = random_layer(seed, slots), make_policy("keydiff")
    held = {h: dict(enumerate(layer.keys[0, h].clone())) for h in range(HKV)}  # position -> key
    for step in range(steps + 1):
        if step:
            q = slots + step - 1
            layer.append(
                new[None, :, step - 1 : step].clone(),
                new[None, :, step - 1 : step].clone(),
                torch.tensor([q]),
            )
            for h in range(HKV):
                held[h][q] = new[h, step - 1]
        index = step + gap * (step == steps > 1)  # the last step after a gap: every norm again
        policy.compress(layer, Step(index, Phase.PREFILL if step == 0 else Phase.DECODE, budget, None))
        for h in range(HKV):
            positions = sorted(held[h])
            keys = torch.stack([held[h][p] for p in positions])
            anchor = F.normalize(keys, dim=-1).mean(0)
            score = -F.cosine_similarity(keys, anchor[None], dim=-1)
            ranked = sorted(range(len(positions)), key=lambda i: (-float(score[i]), positions[i]))
            keep = sorted(positions[i] for i in ranked[:budget])  # of equal scores the older stays
            held[h] = {p: held[h][p] for p in keep}
            assert kept(layer)[h] == keep, (step, h)
        valid = layer.valid
        norms = layer.extra[KEY_NORM]
        assert torch.equal(
            norms[valid], torch.linalg.vector_norm(layer.keys[0], dim=-1)[valid].clamp(min=1e-12)
        )


def test_snapkv_keeps_its_window_and_the_pooled_window_attention_top():
    t, w, budget = 30, 6, 14
    layer = random_layer(3, t)
    gen = torch.Generator().manual_seed(4)
    last = torch.softmax(
        torch.randn(HKV * G, w, t, generator=gen), -1
    )  # the window's rows (softmax over keys)
    policy = make_policy("snapkv", {"window": w, "kernel": 3})
    policy.observe_prefill(layer, Prompt(last))
    shrink(policy, layer, budget, prompt=True)
    pooled = F.avg_pool1d(last[:, :, : t - w].mean(1)[:, None], 3, padding=1, stride=1)[
        :, 0
    ]  # per query head
    score = pooled.view(HKV, G, t - w).mean(1)
    for h in range(HKV):
        want = sorted(score[h].topk(budget - w).indices.tolist()) + list(range(t - w, t))
        assert kept(layer)[h] == want


def test_pyramidkv_schedules_keep_the_total_and_fall_with_depth(tiny):
    layers = [layer_rows() for _ in range(30)]
    for layer in layers:
        layer.append(torch.zeros(1, 1, 2048, 2), torch.zeros(1, 1, 2048, 2), torch.arange(2048))
    paper = make_policy("pyramidkv").allocate(512, layers)
    assert sum(paper) == 30 * 512 and paper == sorted(paper, reverse=True) and paper[0] > paper[-1] >= 64
    official = make_policy("pyramidkv", {"schedule": "official"}).allocate(512, layers)
    assert (
        official[0] == paper[0] and 0 <= sum(official) - 30 * 512 < 30 * 29 // 2
    )  # the integer floors' excess
    # kvpress: the window inside the share, and uniform unless min = B / beta reaches the window (B >= 1280)
    assert make_policy("pyramidkv", {"schedule": "kvpress"}).allocate(512, layers) == [512] * 30
    assert sum(make_policy("pyramidkv", {"schedule": "kvpress"}).allocate(1400, layers)) == 30 * 1400
    r = run(
        tiny,
        make_policy("pyramidkv", {"base.window": 8, "window": 8, "beta": 4}),
        IDS,
        prefill=120,
        steps=6,
        teacher=True,
        opts=RunOptions(budget=40),
    )
    per_layer = r.tensors["steps/kv_slots"][0, :, 0].tolist()  # after the prompt's compression
    prompt_entries = int(r.tensors["steps/kv_slots"][0].sum())  # the prompt compressed once, then it grows
    assert per_layer[0] > per_layer[-1] and prompt_entries == r.metrics["kv_entries_budget"]


@settings(max_examples=examples(25))
@given(st.integers(0, 10_000), st.integers(12, 40), st.integers(2, 10), st.floats(0.0, 1.0))
def test_adakv_shares_the_layer_budget_by_score_with_a_floor_per_head(seed, slots, budget, alpha):
    layer = random_layer(seed, slots)
    policy = make_policy("adakv", {"base": "knorm", "alpha": alpha})
    score = -layer.keys[0].norm(dim=-1)  # (Hkv, S)
    shrink(policy, layer, budget, prompt=True)
    counts = layer.kept_per_row().tolist()
    if slots <= budget:
        return
    assert sum(counts) == HKV * budget and min(counts) >= min(
        max(1, int(budget * alpha)) if alpha else 0, slots
    )
    safe = max(1, int(budget * alpha)) if alpha > 0 else 0
    boosted = score.clone()
    if safe:
        boosted.scatter_(1, score.topk(min(safe, slots), dim=-1).indices, float("inf"))
    flat = boosted.flatten()
    want = set(flat.topk(HKV * budget).indices.tolist())  # no ties in random scores
    got = {h * slots + p for h, row in enumerate(kept(layer)) for p in row if p >= 0}  # -1: padding
    assert got == want


def test_adakv_keeps_the_total_at_every_decode_step_and_pads_the_heads(tiny):
    r = run(
        tiny,
        make_policy("adakv", {"base": "knorm", "alpha": 0.1}),
        IDS,
        prefill=120,
        steps=12,
        teacher=True,
        opts=RunOptions(budget=30),
    )
    slots = r.tensors["steps/kv_slots"]  # (steps, L, Hkv)
    assert (slots.sum((1, 2)) == 30 * slots.shape[1] * slots.shape[2]).all()
    assert (slots.amax(-1) != slots.amin(-1)).any()  # heads really keep different counts


@pytest.mark.parametrize("bits", [None, 2])
def test_expected_attention_recovers_the_queries_before_rope_and_scores_as_the_formula(tiny, bits):
    """At the prompt and after new tokens (each scored once, then kept), in the model's dtype or 2-bit
    storage (whose values change when stored: their norms are read again)."""
    from kvlens.engine.architectures import rotary_of
    from kvlens.kvcache.cache import KVCache
    from kvlens.kvcache.quantize import Storage

    rope = rotary_of(tiny.model, tiny.supported())
    gen = torch.Generator().manual_seed(5)
    t, d, new = 24, 16, 3
    before = torch.randn(HKV * G, t, d, generator=gen)
    cos, sin = rope(torch.arange(t))
    after = before * cos + rotate_half(before) * sin  # RoPE as Llama applies it
    cache = KVCache(1)
    layer = cache.layers[0]
    layer.append(
        torch.randn(1, HKV, t, d, generator=gen), torch.randn(1, HKV, t, d, generator=gen), torch.arange(t)
    )
    policy = make_policy("expected_attention", {"n_future": 8, "n_sink": 2})
    policy.observe_prefill(layer, Prompt(torch.zeros(HKV * G, 0, t), after, torch.arange(t), 0.25, rope))
    got = [policy.score(layer, Step(0, Phase.PREFILL, 10))]
    read = [(layer.keys[0].clone(), layer.values[0].clone())]  # the keys and values each score read
    if bits:
        cache.quantize(Storage(bits=bits, group=4))
    layer.append(
        torch.randn(1, HKV, new, d, generator=gen),
        torch.randn(1, HKV, new, d, generator=gen),
        torch.arange(t, t + new),
    )
    got.append(policy.score(layer, Step(1, Phase.DECODE, 10)))
    # a slot's expected logits are computed once, from its key as first read; its value is read as stored now
    read.append((torch.cat([read[0][0], layer.keys[0][:, t:]], 1), layer.values[0]))
    # the formula, written plainly: statistics of the queries before RoPE, RoPE averaged over 8 future
    # positions
    h = before[:, 2:]
    mu, cov = h.mean(1), torch.stack([(x - x.mean(0)).T @ (x - x.mean(0)) / x.shape[0] for x in h])
    cf, sf = rope(torch.arange(t, t + 8))
    swap = torch.zeros(d, d)
    swap[d // 2 :, : d // 2], swap[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
    rot = torch.stack(
        [c[None, :] * torch.eye(d) + s[None, :] * swap for c, s in zip(cf, sf, strict=True)]
    ).mean(0)
    mu, cov = mu @ rot.T, rot @ cov @ rot.T
    for score, (keys, values), slots in zip(got, read, (t, t + new), strict=True):
        for kv in range(HKV):
            probs = []
            for g in range(G):
                q = kv * G + g
                k = keys[kv, :slots]
                z = 0.25 * k @ mu[q] + 0.25**2 / 2 * torch.einsum("si,ij,sj->s", k, cov[q], k)
                probs.append(torch.softmax(z[2:], 0))
            want = torch.stack(probs).mean(0) * values[kv, 2:slots].norm(dim=-1)
            torch.testing.assert_close(score[kv, 2:slots], want, rtol=1e-4, atol=1e-6)


def test_qfilters_are_the_main_right_singular_vector_of_the_queries(smol):
    from kvlens.engine import qfilters

    computed = qfilters.compute(smol, count=2, tokens=128, samples=200, seed=3)  # (L, Hkv, D)
    tap = qfilters.QueryTap()
    taken = []
    for text in texts.bundled().values():
        ids = list(smol.tokenizer(text).input_ids)
        if len(ids) >= 128:
            with torch.inference_mode():
                smol.model(
                    input_ids=torch.tensor([ids[:128]], device=smol.device),
                    use_cache=False,
                    logits_to_keep=1,
                    kvlens_context=tap,
                )
            taken.append(tap.queries[7].cpu())
        if len(taken) == 2:
            break
    gen = torch.Generator().manual_seed(3)
    picks = [torch.randperm(256, generator=gen)[:200] for _ in range(8)]  # one draw per layer, in layer order
    q = torch.cat(taken, dim=1)[:, picks[7]]
    head = q[0]  # query head 0 of layer 7, the first of KV head 0's group
    u, _, vh = torch.linalg.svd(head, full_matrices=False)
    sign = 1.0 if (u[:, 0] > 0).float().mean() > 0.5 else -1.0
    g = smol.shape()["heads"] // smol.shape()["kv_heads"]
    group = []
    for i in range(g):
        ui, _, vi = torch.linalg.svd(q[i], full_matrices=False)
        si = 1.0 if (ui[:, 0] > 0).float().mean() > 0.5 else -1.0
        group.append(-si * vi[0])
    torch.testing.assert_close(computed[7, 0].cpu(), torch.stack(group).mean(0), rtol=1e-4, atol=1e-5)
    assert float((-sign * vh[0]) @ group[0]) > 0.999  # head 0's own filter, the SVD done here


def test_random_is_seeded_per_layer_and_run():
    a, b, c = (random_layer(1, 20) for _ in range(3))
    log_a, log_b, log_c = DecisionLog(), DecisionLog(), DecisionLog()
    shrink(make_policy("random"), a, 8, log_a, prompt=True)
    shrink(make_policy("random"), b, 8, log_b, prompt=True)
    shrink(make_policy("random", {"seed": 1}), c, 8, log_c, prompt=True)
    assert log_a.frame().equals(log_b.frame()) and not log_a.frame().equals(log_c.frame())


def test_a_run_of_every_field_method_keeps_its_budget(tiny):
    for name in ("snapkv", "knorm", "keydiff", "expected_attention", "qfilter", "random"):
        policy = make_policy(name, {"window": 16} if name == "snapkv" else {})
        r = run(tiny, policy, IDS, prefill=120, steps=8, teacher=True, opts=RunOptions(budget=40))
        assert int(r.tensors["steps/kv_slots"][0].max()) == 40 and within_budget(policy, r, 40), name
        assert torch.isfinite(r.tensors["steps/nll"]).all(), name


def test_kvzip_asks_to_repeat_each_chunk_quoting_the_previous_one(tiny):
    prompt = list(range(100, 150))
    passes = make_policy("kvzip", {"chunk": 20}).replay_passes(tiny.tokenizer, prompt)
    first, later = (
        list(b"\n\nRepeat the previous context exactly."),
        list(b"\n\nRepeat the part of the previous context exactly, starting with"),
    )
    assert [(a, b) for a, b, _ in passes] == [(0, 20), (20, 40), (40, 50)]
    assert passes[0][2] == first + list(b"\n") + prompt[:20]  # no chat template: "\n" ends the turn
    assert passes[1][2] == later + prompt[12:20] + list(b"\n") + prompt[20:40]  # the previous chunk's last 8
    assert passes[2][2] == later + prompt[32:40] + list(b"\n") + prompt[40:50]


def test_kvzip_reconstructs_the_context_without_exactly_the_chat_templates_head(smol):
    """`reconstruct=context` (kvpress's): the passes start after the template's head, whose slots score 0 and
    so are the first to leave (the sinks aside); `prompt` (kvlens's) repeats the whole prompt."""
    from kvlens.engine.shared_prefill import split_prompt, template_parts

    context, _ = split_prompt(smol, next(iter(texts.bundled(1).values()))[:400], "Who wrote this?")
    head = smol.tokenizer(template_parts(smol, True)[0], add_special_tokens=False).input_ids
    assert context[: len(head)] == head and len(head) > 8
    whole = make_policy("kvzip", {"chunk": 40}).replay_passes(smol.tokenizer, context)
    passes = make_policy("kvzip", {"chunk": 40, "reconstruct": "context"}).replay_passes(
        smol.tokenizer, context
    )
    assert whole[0][0] == 0 and passes[0][0] == len(head)
    assert [(a, b) for a, b, _ in passes] == [
        (a, min(a + 40, len(context))) for a in range(len(head), len(context), 40)
    ]
    suffix = smol.tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert passes[0][2][-40 - len(suffix) :] == suffix + context[len(head) : len(head) + 40]
    quote = context[len(head) + 32 : len(head) + 40]  # the previous chunk's last 8, never the template's
    assert passes[1][2][-48 - len(suffix) :] == quote + suffix + context[len(head) + 40 : len(head) + 80]
    assert (
        make_policy("kvzip", {"reconstruct": "context"}).replay_passes(smol.tokenizer, context[2:])[0][0] == 0
    )
    r = run(
        smol,
        make_policy("kvzip", {"chunk": 40, "reconstruct": "context", "decoding": "once"}),
        context,
        prefill=len(context),
        steps=1,
        teacher=False,
        opts=RunOptions(budget=len(context) - len(head)),
    )
    gone = r.decisions.groupby(["layer", "kv_head"]).position.apply(set)
    assert all(set(range(4, len(head))) <= g for g in gone)  # every head slot but the 4 sinks, in every head
    assert not (r.decisions.position < 4).any()


def own_logsumexp(queries: torch.Tensor, own: torch.Tensor, scale: float) -> torch.Tensor:
    """`(Hq, q)` a replay pass's logsumexp over its own keys `(Hkv, q, D)`, causal, written plainly."""
    q = own.shape[1]
    logits = scale * queries.view(HKV, G, q, D) @ own[:, None].transpose(-1, -2)
    return (
        logits.masked_fill(torch.ones(q, q, dtype=torch.bool).triu(1), -torch.inf).logsumexp(-1).view(-1, q)
    )


@settings(max_examples=examples(10))
@given(st.integers(0, 10_000), st.integers(0, 6), st.integers(1, 5), st.booleans())
def test_kvzip_scores_each_slot_by_the_largest_weight_of_the_repeating_queries(
    seed, start, sinks, engine_lse
):
    """The same scores whether the chunk's log-normaliser comes from the engine's attention (`span_lse`) or
    from the scores' own logits."""
    from kvlens.kvcache import Replay

    t, q, end = 16, 5, min(16, start + 7)
    layer = random_layer(seed, t)
    gen = torch.Generator().manual_seed(seed + 1)
    queries, own = torch.randn(HKV * G, q, D, generator=gen), torch.randn(HKV, q, D, generator=gen)
    mask = torch.ones(q, q, dtype=torch.bool).triu(1)  # the pass's own logsumexp, written plainly
    own_lse = (0.5 * queries.view(HKV, G, q, D) @ own[:, None].transpose(-1, -2)).masked_fill(
        mask, -torch.inf
    )
    keys = layer.keys[0]
    span_lse = None
    if engine_lse:
        chunk_logits = 0.5 * queries.view(HKV, G, q, D) @ keys[:, None, start:end].transpose(-1, -2)
        span_lse = chunk_logits.logsumexp(-1).view(HKV * G, q)
    replay = Replay(start, end, queries, own, own_lse.logsumexp(-1).view(HKV * G, q), 0.5, None, span_lse)
    make_policy("kvzip", {"n_sink": sinks}).observe_replay(layer, replay)
    got = layer.state["kvzip_score"]
    s = min(sinks, start)
    for kv in range(HKV):
        seen = torch.cat([keys[kv, :s], keys[kv, start:end], own[kv]])  # sinks, the chunk, the pass itself
        best = torch.zeros(end - start)
        for g in range(G):
            for i in range(q):
                logits = 0.5 * seen @ queries[kv * G + g, i]
                logits[s + end - start + i + 1 :] = float("-inf")  # causal among the pass's own keys
                best = torch.maximum(best, torch.softmax(logits, 0)[s : s + end - start])
        torch.testing.assert_close(got[kv, start:end], best, rtol=1e-5, atol=1e-7)
        assert (got[kv, :start] == 0).all() and (got[kv, end:] == 0).all()  # other chunks: other passes


@settings(max_examples=examples(10))
@given(st.integers(0, 10_000), st.integers(0, 6), st.integers(1, 5))
def test_kvzip_plus_is_the_largest_weight_times_the_values_output_norm_over_the_querys_hidden_norm(
    seed, start, sinks
):
    """KVzap's KVzip+ (arXiv 2601.07891; kvpress `kvzap/data.py`): max over the pass's queries j and the KV
    head's query heads h of a_hji * ||v_i W_O^h|| / ||h_j||, computed here from the plain softmax."""
    from kvlens.kvcache import HIDDEN, O_GRAM, Replay

    t, q, end, dm = 16, 5, min(16, start + 7), 12
    layer = random_layer(seed, t)
    gen = torch.Generator().manual_seed(seed + 1)
    queries, own = torch.randn(HKV * G, q, D, generator=gen), torch.randn(HKV, q, D, generator=gen)
    hidden, w_o = torch.randn(q, dm, generator=gen) * 3, torch.randn(HKV * G, D, dm, generator=gen)
    layer.state[HIDDEN], layer.state[O_GRAM] = hidden, w_o @ w_o.transpose(1, 2)
    make_policy("kvzip", {"n_sink": sinks, "score": "plus"}).observe_replay(
        layer, Replay(start, end, queries, own, own_logsumexp(queries, own, 0.5), 0.5)
    )
    got = layer.state["kvzip_score"]
    keys, values = layer.keys[0], layer.values[0]
    s = min(sinks, start)
    for kv in range(HKV):
        seen = torch.cat([keys[kv, :s], keys[kv, start:end], own[kv]])
        best = torch.zeros(end - start)
        for g in range(G):
            out_norm = (values[kv, start:end] @ w_o[kv * G + g]).norm(dim=-1)  # ||v_i W_O^h||
            for i in range(q):
                logits = 0.5 * seen @ queries[kv * G + g, i]
                logits[s + end - start + i + 1 :] = float("-inf")
                weight = torch.softmax(logits, 0)[s : s + end - start]
                best = torch.maximum(best, weight * out_norm / hidden[i].norm())
        torch.testing.assert_close(got[kv, start:end], best, rtol=1e-4, atol=1e-7)
        assert (got[kv, :start] == 0).all() and (got[kv, end:] == 0).all()


@settings(max_examples=examples(10))
@given(st.integers(0, 10_000), st.integers(5, 14), st.booleans())
def test_kvzip_evicts_the_lowest_scores_over_every_layer_and_head_and_never_the_sinks(
    seed, budget, layerwise
):
    from kvlens.kvcache.cache import KVCache

    t, n = 16, 3
    gen = torch.Generator().manual_seed(seed)
    layers = KVCache(n).layers
    scores = torch.rand(n, HKV, t, generator=gen)
    for rows, score in zip(layers, scores, strict=True):
        rows.append(
            torch.randn(1, HKV, t, D, generator=gen),
            torch.randn(1, HKV, t, D, generator=gen),
            torch.arange(t),
        )
        rows.state["kvzip_score"] = score.clone()
    policy = make_policy("kvzip", {"n_sink": 2, "layerwise": layerwise})
    widths = policy.allocate(budget, layers)
    for rows, width in zip(layers, widths, strict=True):
        policy.compress(rows, Step(0, Phase.PREFILL, width, None))
    scores[..., :2] = float("inf")
    if layerwise:  # each layer keeps its HKV x budget best, shared by its heads
        want = [set(layer.flatten().topk(HKV * budget).indices.tolist()) for layer in scores]
    else:
        best = set(scores.flatten().topk(n * HKV * budget).indices.tolist())
        want = [{i - k * HKV * t for i in best if k * HKV * t <= i < (k + 1) * HKV * t} for k in range(n)]
    for rows, width, wanted in zip(layers, widths, want, strict=True):
        got = {h * t + int(p) for h in range(HKV) for p in rows.pos[h][rows.valid[h]].tolist()}
        assert got == wanted and {0, 1, t, t + 1} <= got
        assert width == int(rows.valid.sum(-1).max())
    assert sum(int(rows.valid.sum()) for rows in layers) == n * HKV * budget


def test_kvzip_replays_leave_the_prompts_cache_as_it_was_and_keep_the_total_while_decoding(tiny):
    steps, budget = 10, 30
    full = run(tiny, make_policy("full"), IDS, prefill=100, steps=steps, teacher=True, opts=RunOptions())
    for decoding in ("rolling", "once"):
        r = run(
            tiny,
            make_policy("kvzip", {"chunk": 40, "decoding": decoding}),
            IDS,
            prefill=100,
            steps=steps,
            teacher=True,
            opts=RunOptions(budget=budget),
        )
        assert r.metrics["replay_passes"] == 3 and r.metrics["replay_ms"] > 0
        assert (
            r.tensors["steps/nll"][0] == full.tensors["steps/nll"][0]
        )  # the prompt's logits: no replay in them
        total = r.tensors["steps/kv_slots"].sum((1, 2))  # (steps,) kept entries after each compression
        entries = budget * 3 * HKV
        assert total[0] == entries
        assert (
            (total == entries).all()
            if decoding == "rolling"
            else total.tolist() == [entries + HKV * 3 * i for i in range(steps)]
        )
        log = r.decisions
        assert (
            set(log.step) == ({0} if decoding == "once" else set(range(steps))) and (log.position >= 4).all()
        )
        assert (log[log.step > 0].position < 100).all()  # the least reconstructed prompt slots leave first
