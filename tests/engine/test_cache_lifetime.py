"""A run's cache is freed with the run's last reference: nothing in it refers back to it (its layers' views
hold the cache weakly), so its buffers never wait for Python's cycle collector. With a cycle, a process that
runs one run after another (the speed benchmark's lockstep, the app, a grid) kept every finished run's cache
until the collector happened to run: 19.6 GB at 8160 tokens on the every-policy lockstep."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvlens.engine.context import Observer
from kvlens.engine.loop import RunOptions, run
from kvlens.kvcache.cache import KVCache
from kvlens.policies import REGISTRY, make_policy

IDS = list(b"A finished run's cache leaves with its last reference, not with the collector. " * 2)
PREFILL, STEPS = 90, 6


class Views(Observer):
    """Holds each layer's view of the cache, weakly."""

    def __init__(self):
        self.layers: list[weakref.ref] = []

    def on_prefill(self, layer, query, key, value, last_rows) -> None:
        self.layers.append(weakref.ref(layer))


@pytest.fixture
def without_collector():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_finished_runs_cache_is_freed_without_the_cycle_collector(tiny, name, without_collector):
    """Every policy (budgeted ones compress to the all-layer store or to layers of their own, budget-free ones
    free in place): once the run is over, no layer's view of its cache is alive."""
    policy = make_policy(name, {})
    budget = None if policy.needs().budget_free else max(16, policy.needs().min_budget)
    views = Views()
    opts = RunOptions(budget=budget, max_new_tokens=STEPS, stop_at_eos=False)
    result = run(tiny, policy, IDS, prefill=PREFILL, steps=STEPS, teacher=False, opts=opts, observers=[views])
    assert result.meta.tokens and len(views.layers) == len(tiny.model.model.layers)
    assert [ref() for ref in views.layers] == [None] * len(views.layers)


def test_a_cache_whose_layers_were_laid_out_again_is_freed_without_the_cycle_collector(without_collector):
    """The cache itself, once its layers' compressed layouts went into the all-layer store (the views that
    call back into the cache)."""
    cache = KVCache(2, limit=3, all_layers=True)
    states = torch.randn(1, 2, 5, 4)
    with cache.feeding(torch.arange(5)):
        cache.update(states, states, 0)
        cache.update(states, states, 1)
    for layer in cache.layers:
        layer.retain(torch.tensor([[0, 2, 4], [1, 2, 3]]))
    assert cache.all_layers() is not None
    gone = weakref.ref(cache)
    del cache, layer
    assert gone() is None
