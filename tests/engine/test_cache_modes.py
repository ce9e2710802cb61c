"""The cache's modes are scoped: positions hold inside `KVCache.feeding` only, a replay pass inside
`KVCache.replaying` caches nothing, and packed storage is a subclass of the store that `quantize` puts in
place."""

from __future__ import annotations

import pytest
import torch

from kvlens.kvcache.cache import KVCache
from kvlens.kvcache.quantize import Storage
from kvlens.kvcache.quantized import PackedStore
from kvlens.kvcache.store import SlotStore


def states(q: int, value: float = 0.0) -> torch.Tensor:
    """Keys or values of 2 KV heads, `(1, 2, q, 4)`."""
    return torch.full((1, 2, q, 4), value)


def test_positions_hold_inside_feeding_only_and_nest():
    cache = KVCache(1)
    with pytest.raises(RuntimeError, match="feeding"):
        cache.update(states(3), states(3), 0)
    with cache.feeding(torch.arange(3)):
        with cache.feeding(torch.tensor([7])):
            assert cache.positions.tolist() == [7]
        assert cache.positions.tolist() == [0, 1, 2]
        cache.update(states(3), states(3), 0)
    with pytest.raises(RuntimeError, match="feeding"):
        cache.positions  # noqa: B018
    assert cache.layers[0].pos.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_a_replay_pass_sees_the_cache_and_itself_and_leaves_nothing():
    cache = KVCache(1)
    with cache.feeding(torch.arange(3)):
        cache.update(states(3), states(3), 0)
    with cache.feeding(torch.arange(3, 5)), cache.replaying():
        keys, _ = cache.update(states(2, 1.0), states(2, 1.0), 0)
    assert keys.shape[2] == 5 and keys[0, 0, 3:].eq(1).all() and cache.layers[0].n_slots == 3
    with cache.feeding(torch.tensor([3])):  # out of the pass: tokens are cached again
        cache.update(states(1, 2.0), states(1, 2.0), 0)
    assert cache.layers[0].n_slots == 4 and cache.layers[0].pos[0].tolist() == [0, 1, 2, 3]


def test_quantized_storage_replaces_the_store_and_keeps_the_slots():
    cache = KVCache(1)
    x = torch.randn(1, 2, 8, 4)
    with cache.feeding(torch.arange(8)):
        cache.update(x, x, 0)
    assert type(cache.layers[0].store) is SlotStore
    cache.quantize(Storage(bits=8, group=4))
    layer = cache.layers[0]
    assert isinstance(layer.store, PackedStore) and "keys" not in layer.store.buffers
    assert layer.pos[0].tolist() == list(range(8))
    assert torch.allclose(layer.keys, x, atol=0.05) and torch.allclose(layer.values, x, atol=0.05)


@pytest.mark.parametrize("softcap, span", [(None, (0, 20)), (None, (5, 12)), (None, (0, 9)), (4.0, (5, 12))])
def test_a_replay_pass_attends_as_dense_causal_attention_and_returns_its_logsumexps(softcap, span):
    """`replayed` (flash attentions over the span, the other cached slots and the pass's own keys, combined,
    on a plain CPU layer; masked attention when soft-capped) equals `dense` over the cached slots and the
    pass's own keys, causal among them, with GQA; its own-key logsumexp is the plain formula's, and so is its
    span's logsumexp where it gives one (plain layer)."""
    from kvlens.engine.attention import dense, replayed
    from kvlens.kvcache import AttentionSpec

    g = torch.Generator().manual_seed(3)
    t, q, d = 20, 7, 8
    query = torch.randn(1, 6, q, d, generator=g)  # 3 query heads per KV head
    key, value = torch.randn(1, 2, t + q, d, generator=g), torch.randn(1, 2, t + q, d, generator=g)
    spec = AttentionSpec(scaling=0.4, softcap=softcap)
    out, own_lse, span_lse = replayed(query, key, value, spec, span)
    assert torch.allclose(out, dense(query, key, value, spec), atol=1e-6)
    logits = 0.4 * query.view(2, 3, q, d) @ key[0][:, None].transpose(-1, -2)  # (Hkv, G, q, t + q)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    future = torch.ones(q, q, dtype=torch.bool).triu(1)
    own = logits[..., t:].masked_fill(future, -torch.inf).logsumexp(-1).view(6, q)
    assert torch.allclose(own_lse, own, atol=1e-6)
    if softcap is None:
        assert torch.allclose(span_lse, logits[..., span[0] : span[1]].logsumexp(-1).view(6, q), atol=1e-6)
    else:
        assert span_lse is None
