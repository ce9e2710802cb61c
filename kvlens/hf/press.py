"""`kvlens.press`: a policy in every generation of a block, as kvpress's `with press(model):
model.generate(...)`.

Inside the block, each forward of the model that starts a sequence (no cache, or an empty one) gets a fresh
`KvlensCache`, which `generate` then carries to the end. Unlike a kvpress press, which compresses the prompt
once, the policy runs as in `kvlens generate`: step 0's compression, then its own rule at every decode step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvlens.hf.attach import attach
from kvlens.hf.cache import KvlensCache, Settings, adopted, install


@contextmanager
def press(
    model: torch.nn.Module,
    policy: str,
    *,
    ratio: float | None = None,
    budget: int | float | None = None,
    record: str = "summary",
    kv_bits: int | None = None,
    tokenizer=None,
    **params,
) -> Iterator[list[KvlensCache]]:
    """Run `policy` (with `kvlens.cache`'s arguments) in every generation inside the block; yields the
    list of the caches it made, newest last (`caches[-1].save_run(path, output)`). The model is as it was
    afterwards."""
    settings = Settings.of(policy, ratio, budget, record, kv_bits, params)
    loaded = adopted(model, tokenizer, settings)
    made: list[KvlensCache] = []

    def fresh(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, KvlensCache) or (cache is not None and cache.get_seq_length() > 0):
            return None
        made.append(KvlensCache(loaded, settings))
        return args, {**kwargs, "past_key_values": made[-1]}

    install(model)
    with attach(model):
        handle = model.register_forward_pre_hook(fresh, with_kwargs=True, prepend=True)
        try:
            yield made
        finally:
            handle.remove()
