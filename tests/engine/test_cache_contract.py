"""Both views of the cache that a policy is handed implement its row contract `CacheRows`: mypy checks `views`
statically (this module is in `make lint`'s type check), the test checks the objects at run time."""

from __future__ import annotations

import torch

from kvlens.kvcache import CacheRows
from kvlens.kvcache.cache import KVCache


def views(cache: KVCache) -> tuple[CacheRows, CacheRows | None]:
    """One layer's rows and every layer's rows (None until the all-layer store holds them), as the
    contract."""
    return cache.layers[0], cache.all_layers()


def test_a_layer_is_the_contract_and_the_all_layer_view_waits_for_the_shared_store() -> None:
    cache = KVCache(2, limit=8, all_layers=True)
    states = torch.zeros(1, 2, 3, 4)  # (1, Hkv, q, D)
    with cache.feeding(torch.arange(3)):
        cache.update(states, states, 0)
    layer, everywhere = views(cache)
    assert isinstance(layer, CacheRows) and layer.layer == 0 and layer.pos.shape == (2, 3)
    assert everywhere is None
