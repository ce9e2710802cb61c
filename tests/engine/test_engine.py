"""The engine: exact `full` logits, true positions, real eviction, events, sampling, cancellation."""

from __future__ import annotations

import threading

import pytest
import torch

from kvlens.engine.attention import decode_rows, prefill_stats
from kvlens.engine.context import Observer
from kvlens.engine.loop import RunOptions, run, run_steps
from kvlens.errors import Cancelled, KvlensError
from kvlens.kvcache import AttentionSpec
from kvlens.policies import make_policy
from tests.conftest import model_logits

IDS = list(b"The quick brown fox jumps over the lazy dog. " * 6)


def _teacher(model, policy, ids, prefill, steps, **opts):
    logits = []
    r = run(
        model,
        make_policy(policy),
        ids,
        prefill=prefill,
        steps=steps,
        teacher=True,
        opts=RunOptions(**opts),
        on_step=lambda e: logits.append(e.logits.clone()),
    )
    return r, torch.stack(logits)


def test_full_reproduces_model_logits_tiny(tiny):
    prefill, steps = 40, 30
    r, got = _teacher(tiny, "full", IDS, prefill, steps)
    want = model_logits(tiny, IDS[: prefill + steps])[prefill - 1 : prefill + steps - 1]
    assert (got - want).abs().max() < 1e-4
    assert r.decisions.empty and r.metrics["kv_slots_max"] == prefill + steps - 1


def test_compressed_policy_changes_logits(tiny):
    _, full = _teacher(tiny, "full", IDS, 40, 30)
    _, comp = _teacher(tiny, "h2o", IDS, 40, 30, budget=12)
    assert torch.allclose(full[0], comp[0], atol=1e-5)  # step 0 comes from the uncompressed prefill
    assert (full[1:] - comp[1:]).abs().max() > 1e-3


def test_eviction_really_shrinks_tensors(tiny):
    budget = 10
    r = run(
        tiny,
        make_policy("streaming_llm"),
        IDS,
        prefill=50,
        steps=20,
        teacher=True,
        opts=RunOptions(budget=budget),
    )
    kept = r.tensors["steps/kv_slots"]
    assert kept.shape == (20, 3, 2) and bool((kept == budget).all())
    shape = tiny.shape()
    per_slot = 2 * shape["kv_heads"] * shape["head_dim"] * 4  # K and V, fp32
    # allocated: the budget plus the slot each step's token is written into before compression
    assert r.metrics["kv_bytes_peak"] == shape["layers"] * (budget + 1) * per_slot
    assert r.metrics["kv_bytes_prefill"] == shape["layers"] * 50 * per_slot


def test_the_prompt_is_released_and_steps_write_into_the_same_buffers(tiny):
    """After step 0 the cache lives in budget + 1 slots (for h2o, whose selection is per head, the rows of
    the one all-layer store the cache allocates); every decode step writes into those same buffers."""
    seen = []

    class Spy(Observer):
        def on_decode(self, layer, query, probs, out, spec):
            if layer.layers[0] == 0:
                seen.append((layer.keys.data_ptr(), layer.capacity, layer.n_slots))

    run(
        tiny,
        make_policy("h2o"),
        IDS,
        prefill=50,
        steps=12,
        teacher=True,
        opts=RunOptions(budget=10),
        observers=[Spy()],
    )
    assert (
        len(seen) == 11
        and len({ptr for ptr, _, _ in seen}) == 1
        and {(c, n) for _, c, n in seen} == {(11, 11)}
    )


def test_new_tokens_get_true_positions(tiny):
    r = run(
        tiny,
        make_policy("streaming_llm", {"sink": 2}),
        IDS,
        prefill=30,
        steps=10,
        teacher=True,
        opts=RunOptions(budget=8, record="attention"),
    )
    pos = r.tensors["attn_pos/0"]  # (steps, Hkv, S)
    for step in range(1, 10):
        row = pos[step, 0]
        assert int(row.max()) == 30 + step - 1  # the fed token sits at its true position, not at slot 8
        assert sorted(row[row >= 0].tolist())[:2] == [0, 1]


def test_one_event_per_step_and_decisions_logged(tiny):
    events = []
    r = run(
        tiny,
        make_policy("tova"),
        IDS,
        prefill=30,
        steps=12,
        teacher=True,
        opts=RunOptions(budget=16),
        on_step=events.append,
    )
    assert [e.step for e in events] == list(range(12))
    assert all(max(e.kv_slots) <= 16 for e in events)
    # 30 -> 16 after prefill, then one eviction per step and KV head
    per_layer = (30 - 16) + 11
    assert len(r.decisions) == 3 * 2 * per_layer
    assert set(r.decisions["action"]) == {"evict"}


def test_greedy_is_deterministic_and_sampling_is_seeded(tiny):
    def gen(seed, temperature):
        return run(
            tiny,
            make_policy("h2o"),
            IDS[:20],
            prefill=20,
            steps=15,
            teacher=False,
            opts=RunOptions(budget=10, seed=seed, temperature=temperature, stop_at_eos=False),
        ).meta.tokens

    assert gen(0, 0.0) == gen(5, 0.0)
    assert gen(3, 1.0) == gen(3, 1.0)
    assert gen(3, 1.0) != gen(4, 1.0)


def test_sampling_draws_from_the_top_p_nucleus_only():
    """Probabilities 0.6, 0.3, 0.1: top-p 0.5 keeps the first token alone, 0.8 the first two, 1.0 all three
    (the smallest set whose mass reaches p, as transformers' `TopPLogitsWarper`)."""
    from kvlens.engine.loop import _choose

    logits = torch.tensor([0.6, 0.3, 0.1]).log()
    gen = torch.Generator().manual_seed(0)

    def drawn(top_p: float) -> set[int]:
        return {_choose(logits, RunOptions(temperature=1.0, top_p=top_p), gen) for _ in range(300)}

    assert (drawn(0.5), drawn(0.8), drawn(1.0)) == ({0}, {0, 1}, {0, 1, 2})
    assert _choose(logits, RunOptions(temperature=0.0, top_p=0.1), gen) == 0


def test_cancel_stops_within_one_step(tiny):
    stop = threading.Event()
    seen = []

    def on_step(e):
        seen.append(e.step)
        if e.step == 2:
            stop.set()

    with pytest.raises(Cancelled):
        run(
            tiny,
            make_policy("full"),
            IDS,
            prefill=20,
            steps=30,
            teacher=True,
            opts=RunOptions(),
            on_step=on_step,
            cancel=stop,
        )
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("policy", ["full", "streaming_llm", "h2o"])
def test_states_record_the_prompts_accumulated_attention_whatever_the_policy_computes(tiny, policy):
    """`prefill/abar/{layer}` holds real column sums even for policies that need no attention: each of
    the T prompt rows sums to one, so a KV head's column sums add up to T."""
    ids = list(b"Column sums of the prompt's attention. " * 2)
    r = run(
        tiny,
        make_policy(policy),
        ids,
        prefill=60,
        steps=4,
        teacher=True,
        opts=RunOptions(budget=None if policy == "full" else 20, record="states"),
    )
    for layer in range(3):
        abar = r.tensors[f"prefill/abar/{layer}"]
        torch.testing.assert_close(abar.sum(-1), torch.full((abar.shape[0],), 60.0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    "policy,params", [("tova", {}), ("corm", {"window": 4, "recent": 4}), ("streaming_llm", {})]
)
def test_policies_that_read_no_column_sums_skip_the_chunked_pass_and_decide_the_same(
    tiny, policy, params, monkeypatch
):
    """TOVA and CORM read only the last prefill rows, StreamingLLM nothing: SDPA plus those rows, no T x T
    pass, and no decode step's attention added to `abar` and `nobs`."""
    import kvlens.engine.context
    from kvlens.engine.context import Observer

    class WantsSums(Observer):
        needs_prefill_stats = True

    ids = list(b"Only what a policy reads is computed. " * 3)
    go = lambda obs=(): run(
        tiny,
        make_policy(policy, params),
        ids,
        prefill=90,
        steps=12,
        teacher=True,  # noqa: E731
        opts=RunOptions(budget=None if policy == "corm" else 24),
        observers=list(obs),
    )
    chunked = go([WantsSums()])
    monkeypatch.setattr(
        kvlens.engine.context, "prefill_stats", lambda *a: pytest.fail("chunked prefill pass")
    )
    monkeypatch.setattr(kvlens.engine.context, "group_mean", lambda *a: pytest.fail("accumulated attention"))
    light = go()
    assert light.decisions.equals(chunked.decisions) and len(light.decisions)
    torch.testing.assert_close(light.tensors["steps/nll"], chunked.tensors["steps/nll"], rtol=1e-5, atol=1e-6)


def test_bad_lengths_are_one_sentence(tiny):
    with pytest.raises(KvlensError, match="fewer than prefill"):
        run(tiny, make_policy("full"), IDS[:10], prefill=8, steps=5, teacher=True, opts=RunOptions())
    with pytest.raises(KvlensError, match="context window"):
        run(tiny, make_policy("full"), IDS * 5, prefill=1000, steps=30, teacher=True, opts=RunOptions())
    with pytest.raises(KvlensError, match="below the 5 slots"):
        run(
            tiny,
            make_policy("streaming_llm"),
            IDS,
            prefill=30,
            steps=5,
            teacher=True,
            opts=RunOptions(budget=3),
        )


@pytest.mark.parametrize("softcap, window", [(None, None), (2.0, 6)])
def test_prefill_stats_in_chunks_match_dense(monkeypatch, softcap, window):
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 37, 8), torch.randn(1, 2, 37, 8), torch.randn(1, 2, 37, 8)
    monkeypatch.setattr("kvlens.engine.attention.CHUNK_ELEMENTS", 4 * 37 * 5)  # 5 rows per chunk
    out, colsum, last = prefill_stats(q, k, v, AttentionSpec(8**-0.5, softcap, window), keep_rows=7)
    kr = k.repeat_interleave(2, 1)
    scores = (q @ kr.transpose(-1, -2)) * 8**-0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    hidden = torch.ones(37, 37, dtype=torch.bool).triu(1)
    if window:
        hidden |= torch.ones(37, 37, dtype=torch.bool).tril(-window)  # keys `window` or more behind the query
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = scores.softmax(-1)[0]  # (Hq, T, T)
    dense_out = probs @ v.repeat_interleave(2, 1)[0]
    assert torch.allclose(out[0].transpose(0, 1), dense_out, atol=1e-5)
    assert torch.allclose(colsum, probs.view(2, 2, 37, 37).mean(1).sum(1), atol=1e-5)
    assert torch.allclose(last, probs[:, -7:], atol=1e-6)


def test_decode_rows_match_repeated_kv_and_mask_padding():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 6, 1, 8), torch.randn(1, 3, 11, 8), torch.randn(1, 3, 11, 8)
    valid = torch.ones(3, 11, dtype=torch.bool)
    valid[1, 7:] = False
    out, probs = decode_rows(q, k, v, valid, AttentionSpec(0.3, softcap=1.5))
    for h in range(6):
        kv = h // 2
        n = int(valid[kv].sum())
        p = torch.softmax(1.5 * torch.tanh((k[0, kv, :n] @ q[0, h, 0]) * 0.3 / 1.5), -1)
        assert torch.allclose(probs[kv, h % 2, :n], p, atol=1e-6)
        assert float(probs[kv, h % 2, n:].sum()) == 0.0
        assert torch.allclose(out[0, 0, h], p @ v[0, kv, :n], atol=1e-5)


@pytest.mark.slow
def test_full_reproduces_embeddedmodel_logits(smol, long_text):
    ids = smol.tokenizer(long_text).input_ids[:300]
    _, got = _teacher(smol, "full", ids, 200, 100)
    want = model_logits(smol, ids)[199:299]
    assert (got - want).abs().max() <= 1e-3


@pytest.mark.slow
def test_full_perplexity_equals_model_loss(smol, long_text):
    ids = smol.tokenizer(long_text).input_ids[:400]
    r, _ = _teacher(smol, "full", ids, 256, 144)
    logits = model_logits(smol, ids)
    loss = torch.nn.functional.cross_entropy(logits[255:399], torch.tensor(ids[256:400]))
    assert abs(r.metrics["nll"] - float(loss)) / float(loss) < 1e-3


@pytest.mark.parametrize(
    "name,params,batch,together",
    [
        ("streaming_llm", {}, True, True),
        ("h2o", {}, True, True),
        ("tova", {}, True, True),
        ("scissorhands", {}, True, True),
        ("tova", {}, False, False),  # the engine's switch: layer by layer
        ("cam", {}, True, True),  # its base's selection at once, its merge layer by layer
        ("cam", {"score": "decode"}, True, True),
        ("weightedkv", {}, True, True),
        ("adakv", {"base": "h2o"}, True, False),
        ("kvmerger", {}, True, False),  # merges after the prompt only (the paper's protocol)
        ("snapkv", {"window": 4}, True, False),  # compresses the prompt once (the paper's protocol)
    ],
)
def test_batchable_policies_compress_every_layer_at_once_at_decode_steps(
    tiny, monkeypatch, name, params, batch, together
):
    """The engine picks all-layer or per-layer once, from the policy (`batchable`) and
    `RunOptions.batch_layers`: the prompt's compression is per layer, each decode step's then one selection
    over every layer's stacked scores (`evict_all_layers`); other policies stay per layer, and one whose
    protocol compresses the prompt only is not called at decode steps."""
    from kvlens.engine import loop

    policy = make_policy(name, params)
    calls = []
    compress, everywhere = type(policy).compress, loop.evict_all_layers
    monkeypatch.setattr(
        type(policy),
        "compress",
        lambda self, rows, step: calls.append((step.index, (rows.layer,))) or compress(self, rows, step),
    )
    monkeypatch.setattr(
        loop,
        "evict_all_layers",
        lambda p, rows, layers, step: (
            calls.append((step.index, tuple(r.layer for r in layers))) or everywhere(p, rows, layers, step)
        ),
    )
    run(tiny, policy, IDS, prefill=40, steps=8, teacher=True, opts=RunOptions(budget=10, batch_layers=batch))
    layers = tuple(range(tiny.shape()["layers"]))
    assert [c for c in calls if c[0] == 0] == [(0, (i,)) for i in layers]
    decode = [c for c in calls if c[0] > 0]
    per_layer = [(i, (j,)) for i in range(1, 8) for j in layers] if policy.needs().decode_steps else []
    assert decode == ([(i, layers) for i in range(1, 8)] if together else per_layer)


def test_run_steps_yields_each_step_and_returns_the_same_run_as_run(tiny):
    policy, opts = make_policy("h2o"), RunOptions(budget=10)
    whole = run(tiny, policy, IDS, prefill=40, steps=6, teacher=True, opts=opts)
    events = run_steps(tiny, policy, IDS, prefill=40, steps=6, teacher=True, opts=opts)
    seen = []
    while True:
        try:
            seen.append(next(events).step)
        except StopIteration as done:
            stepped = done.value
            break
    assert seen == list(range(6))
    assert torch.equal(stepped.tensors["steps/nll"], whole.tensors["steps/nll"])
    assert stepped.decisions.equals(whole.decisions)
