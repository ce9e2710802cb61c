"""kvlens's attention on a model the caller loaded with transformers, and the hooks that run its caches.

`adopt(model, tokenizer)` wraps the caller's `AutoModelForCausalLM` object (any device, dtype or
`device_map`) as the `LoadedModel` the engine runs, after the probe `kvlens check-model` runs: what it
refuses is refused here with the same sentence. A tokenizer is optional: only KVzip's reconstruction prompt,
Q-Filters' calibration, run files and the pipeline need one, and no hub is contacted unless the caller names
one. `attach(model)` switches the model's attention implementation to kvlens's for a block and restores it
afterwards.
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
    """The caller's model as a `LoadedModel`, probed and refused as `kvlens check-model` would.

    `tokenizer`: a tokenizer, a local path or hub id to load one from (the one place a hub is contacted),
    or None: the one saved beside the model (`model.name_or_path`), read from local files only, else none
    (`require_tokenizer` asks for it where a policy or a call needs one)."""
    with attach(model):
        support = inspect_model(model)
    support.require()
    source = getattr(model, "name_or_path", "") or type(model).__name__
    if isinstance(tokenizer, (str, Path)):
        tokenizer = _load_tokenizer(str(tokenizer), local=False)
    elif tokenizer is None and getattr(model, "name_or_path", ""):
        tokenizer = _load_tokenizer(str(source), local=True)
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


def require_tokenizer(model: LoadedModel, needed_for: str) -> None:
    """Refuse, in one sentence, a model adopted without a tokenizer where `needed_for` needs one."""
    if model.tokenizer is None:
        raise KvlensError(
            f"{needed_for} needs the model's tokenizer, and none is saved beside the model "
            f"({model.spec}); pass tokenizer=... (a tokenizer object or its local path)."
        )


def _load_tokenizer(source: str, local: bool):
    """The tokenizer at `source`; with `local`, from local files only (None when there is none)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError) as err:
        if local:
            return None
        raise KvlensError(
            f"No tokenizer could be loaded from {source}; pass a tokenizer object or the local directory "
            f"that holds one."
        ) from err
