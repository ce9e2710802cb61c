"""kvlens's attention on a model the caller loaded with transformers, and the hooks that run its caches.

`adopt(model, tokenizer)` wraps the caller's `AutoModelForCausalLM` object (any device, dtype or
`device_map`) as the `LoadedModel` the engine runs, after the probe `kvlens check-model` runs: what it refuses
is refused here with the same sentence. `attach(model)` switches the model's attention implementation to
kvlens's for a block and restores it afterwards.

"""

from __future__ import annotations

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
    """Set the model's attention implementation to `name` (its config's setter reaches every sub-config);
    returns the one it replaced."""
    before = _implementation(model)
    if before != name:
        model.config._attn_implementation = name
    return before


@contextmanager
def attach(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """kvlens's attention function on `model` for the block (plain SDPA unless a kvlens run's context reaches
    it); the original attention implementation comes back afterwards, also on an error."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise KvlensError(
            "kvlens needs a transformers model object (e.g. from AutoModelForCausalLM.from_pretrained)."
        )
    register_attention()
    before = switch(model, ATTENTION_NAME)
    try:
        yield model
    finally:
        switch(model, before)


def adopt(model: torch.nn.Module, tokenizer=None) -> LoadedModel:
    """The caller's model as a `LoadedModel`, probed and refused as `kvlens check-model` would; `tokenizer`
    defaults to the one saved beside the model (`model.name_or_path`)."""
    with attach(model):
        support = inspect_model(model)
    support.require()
    source = getattr(model, "name_or_path", "") or type(model).__name__
    if tokenizer is None:
        tokenizer = _saved_tokenizer(source)
    param = next(model.parameters())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=str(source),
        path=Path(str(source)),
        device=param.device,
        dtype=param.dtype,
        support=support,
    )


def _saved_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise KvlensError(
            f"No tokenizer is saved beside the model ({source}); pass tokenizer=... "
            f"(kvlens needs it for run files and for KVzip's reconstruction prompt)."
        ) from err
