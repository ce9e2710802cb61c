"""kvlens's attention on a model the caller loaded with transformers, and the hooks that run its caches.

`adopt(model, tokenizer)` wraps the caller's `AutoModelForCausalLM` object (any device, dtype or
`device_map`) as the `LoadedModel` the engine runs, after the probe `kvlens check-model` runs: what it refuses
is refused here with the same sentence. `attach(model)` switches the model's attention implementation to
kvlens's for a block and restores it afterwards.

Two forward hooks on the model, installed once (`install`), act only on a forward whose `past_key_values` is a
`KvlensCache`: before it, the cache puts the run's context into the forward's keyword arguments and the model's
attention implementation is switched to kvlens's; after it (also when the forward raised), the cache compresses
and the implementation is switched back. Any other forward passes through them untouched.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvlens.engine.architectures import inspect_model
from kvlens.engine.attention import ATTENTION_NAME, register_attention
from kvlens.engine.models import LoadedModel
from kvlens.errors import KvlensError


def _implementation(model: torch.nn.Module) -> str | None:
    return model.config._attn_implementation


def switch(model: torch.nn.Module, name: str | None) -> str | None:
    """Set the model's attention implementation to `name` (its config's setter reaches every sub-config); returns
    the one it replaced."""
    before = _implementation(model)
    if before != name:
        model.config._attn_implementation = name
    return before


@contextmanager
def attach(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """kvlens's attention function on `model` for the block (plain SDPA unless a kvlens cache runs), and the cache
    hooks; the original attention implementation comes back afterwards, also on an error."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise KvlensError("kvlens needs a transformers model object (e.g. from AutoModelForCausalLM.from_pretrained).")
    register_attention()
    before = switch(model, ATTENTION_NAME)
    installed = install(model)
    try:
        yield model
    finally:
        if installed:
            uninstall(model)
        switch(model, before)


def adopt(model: torch.nn.Module, tokenizer=None) -> LoadedModel:
    """The caller's model as a `LoadedModel`, probed and refused as `kvlens check-model` would; `tokenizer` defaults
    to the one saved beside the model (`model.name_or_path`)."""
    with attach(model):
        support = inspect_model(model)
    support.require()
    source = getattr(model, "name_or_path", "") or type(model).__name__
    if tokenizer is None:
        tokenizer = _saved_tokenizer(source)
    param = next(model.parameters())
    return LoadedModel(model=model, tokenizer=tokenizer, spec=str(source), path=Path(str(source)),
                       device=param.device, dtype=param.dtype, support=support)


def _saved_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise KvlensError(f"No tokenizer is saved beside the model ({source}); pass tokenizer=... "
                          f"(kvlens needs it for run files and for KVzip's reconstruction prompt).") from err


def _before(module, args, kwargs):
    from kvlens.hf.cache import KvlensCache

    cache = kwargs.get("past_key_values")
    if not isinstance(cache, KvlensCache):
        return None
    return args, cache.before(module, args, kwargs)


def _after(module, args, kwargs, output):
    from kvlens.hf.cache import KvlensCache

    cache = kwargs.get("past_key_values")
    if isinstance(cache, KvlensCache):
        cache.after(module, output)
    return None


# each model's two hook handles (weakly: a model that goes away takes its entry along)
_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def install(model: torch.nn.Module) -> bool:
    """The cache hooks on `model`, once; True if this call installed them."""
    if model in _HOOKS:
        return False
    _HOOKS[model] = (model.register_forward_pre_hook(_before, with_kwargs=True),
                     model.register_forward_hook(_after, with_kwargs=True, always_call=True))
    return True


def uninstall(model: torch.nn.Module) -> None:
    """Remove the cache hooks from `model`."""
    for handle in _HOOKS.pop(model, ()):
        handle.remove()
