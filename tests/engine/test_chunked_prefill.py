"""Chunked prefill (`RunOptions.prefill_chunk`, `--prefill-chunk`): one chunk is today's run exactly, later
chunks add to the same statistics a whole prompt gives, no layer ever holds more than budget + chunk slots,
and what cannot be chunked is refused in one sentence."""

from __future__ import annotations

import pytest
import torch

from kvlens.engine.loop import RunOptions, prepare_run, run
from kvlens.errors import KvlensError
from kvlens.policies import make_policy

IDS = list(b"The quick brown fox jumps over the lazy dog. " * 6)


def teacher(model, policy, prefill, steps, **opts):
    return run(
        model, make_policy(policy), IDS, prefill=prefill, steps=steps, teacher=True, opts=RunOptions(**opts)
    )


@pytest.mark.parametrize("policy", ["h2o", "tova", "streaming_llm"])
def test_one_chunk_is_the_unchunked_run_exactly(tiny, policy):
    whole, one = (
        teacher(tiny, policy, 60, 20, budget=16),
        teacher(tiny, policy, 60, 20, budget=16, prefill_chunk=60),
    )
    assert whole.decisions.equals(one.decisions)
    assert torch.equal(whole.tensors["steps/nll"], one.tensors["steps/nll"])
    assert whole.metrics["kv_bytes_prefill"] == one.metrics["kv_bytes_prefill"]


def test_chunks_add_up_to_the_whole_prompts_attention_statistics(tiny):
    """Nothing evicted (budget above the prompt): the chunked column sums, query counts and last row are the
    whole prompt's, and so are the logits."""

    def prefilled(chunk):
        loop = prepare_run(
            tiny, make_policy("h2o"), IDS, 64, 50, True, RunOptions(budget=100, prefill_chunk=chunk), []
        )
        with torch.inference_mode():
            logits = loop.prefill(IDS[:64])
        return loop, logits

    (whole, a), (chunked, b) = prefilled(None), prefilled(16)
    assert torch.allclose(a, b, atol=1e-4)
    for x, y in zip(whole.cache.layers, chunked.cache.layers, strict=True):
        assert torch.equal(x.pos, y.pos)
        assert torch.allclose(x.abar, y.abar, atol=1e-5) and torch.equal(x.nobs, y.nobs)
        assert torch.allclose(x.last_attn, y.last_attn, atol=1e-6)


@pytest.mark.parametrize("policy", ["h2o", "tova", "streaming_llm"])
def test_a_chunked_prefill_never_holds_more_than_budget_plus_the_chunk(tiny, policy):
    shape = tiny.shape()
    per_slot = 2 * shape["kv_heads"] * shape["head_dim"] * 4  # keys and values, float32
    whole = teacher(tiny, policy, 200, 16, budget=32)
    chunked = teacher(tiny, policy, 200, 16, budget=32, prefill_chunk=24)
    assert whole.metrics["kv_bytes_prefill"] == shape["layers"] * 200 * per_slot
    assert chunked.metrics["kv_bytes_prefill"] <= shape["layers"] * (32 + 24) * per_slot
    assert bool((chunked.tensors["steps/kv_slots"] == 32).all())
    assert chunked.meta.prefill_chunk == 24

    def evicted_at_prefill(r):
        d = r.decisions[(r.decisions["step"] == 0) & (r.decisions["action"] == "evict")]
        return sorted(zip(d["layer"], d["kv_head"], d["position"], strict=True))

    gone = evicted_at_prefill(chunked)  # each layer and head evicts 200 - 32 prompt positions, each once
    assert len(gone) == len(set(gone)) == shape["layers"] * shape["kv_heads"] * (200 - 32)
    if policy == "streaming_llm":  # sinks + the newest: the same kept positions, however the prompt arrives
        assert gone == evicted_at_prefill(whole)


def test_a_chunked_prefill_composes_with_quantized_storage(tiny):
    from kvlens.kvcache.quantize import Storage

    shape = tiny.shape()
    per_slot = 2 * shape["kv_heads"] * shape["head_dim"] * 4
    r = teacher(tiny, "h2o", 200, 16, budget=32, prefill_chunk=24, storage=Storage(4, group=16))
    assert (
        r.metrics["kv_bytes_prefill"] <= shape["layers"] * (32 + 24) * per_slot
    )  # the first chunk in float32
    assert r.metrics["kv_bytes_peak"] < 0.2 * shape["layers"] * (32 + 24) * per_slot
    assert bool((r.tensors["steps/kv_slots"] == 32).all()) and torch.isfinite(r.tensors["steps/nll"]).all()


@pytest.mark.parametrize(
    "policy, opts, words",
    [
        ("cam", {"budget": 16, "prefill_chunk": 8}, "cam cannot compress a prompt chunk by chunk"),
        ("h2o", {"budget": 16, "prefill_chunk": 0}, "at least 1"),
        ("h2o", {"budget": 16, "prefill_chunk": 8, "record": "attention"}, "summary only"),
    ],
)
def test_what_cannot_be_chunked_is_one_sentence(tiny, policy, opts, words):
    with pytest.raises(KvlensError, match=words):
        teacher(tiny, policy, 40, 4, **opts)
