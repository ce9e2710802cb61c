"""The hidden state entering each attention layer, for policies that read it (`Needs.hidden_states`).

KVzap (Jégou & Jeblick, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", 2026,
https://arxiv.org/abs/2601.07891) scores a KV pair from the hidden state its token brings to the layer, and
KVzip+ divides a replay query's attention by that state's norm: in both, the input of the attention module
(after the layer's input norm), as kvpress reads it (`kwargs["hidden_states"]` of a hook on `self_attn`, in
`kvpress/presses/dms_press.py` and `kvzap/data.py`). `tap` puts one forward pre-hook on every attention module
of a model: it hands the state `(1, q, d_model)` to the run context in the call's keyword arguments
(`RunContext.hidden_in`), so nothing of a run is kept on the module. `output_grams` are the per-head Gram
matrices of the output projection, `W_O^h (W_O^h)^T` `(Hq, D, D)`, so that `||v W_O^h||^2 = v G_h v^T`.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlens.engine.attention import CONTEXT_KWARG
from kvlens.errors import KvlensError
from kvlens.kvcache import HIDDEN, O_GRAM

__all__ = ["HIDDEN", "O_GRAM", "attention_modules", "output_grams", "tap"]

TAPPED = "_kvlens_hidden_tap"  # set on a model whose attention modules carry the hook


def attention_modules(model: torch.nn.Module) -> list[Any]:
    """The model's attention modules, by layer: one per layer, each with an int `layer_idx` and an output
    projection `o_proj` (the Llama family's names); a model without them is refused in one sentence."""
    found: list[Any] = [
        m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "o_proj")
    ]
    layers = getattr(model.config, "num_hidden_layers", None)
    if not found or len(found) != layers:
        raise KvlensError(
            f"This model's attention modules ({type(model).__name__}) have no `o_proj` output projection "
            f"with a layer index on each of its {layers} layers, where kvlens reads the state entering the "
            f"attention and W_O (KVzap, KVzip+), so those cannot run on it."
        )
    return sorted(found, key=lambda m: m.layer_idx)


def _hand_over(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: the module's input hidden states to the run context that asks for them."""
    ctx = kwargs.get(CONTEXT_KWARG)
    if ctx is not None and getattr(ctx, "wants_hidden", False):
        ctx.hidden_in(module.layer_idx, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])


def tap(model: torch.nn.Module) -> None:
    """Hook every attention module of `model` once (`_hand_over`); runs that ask for nothing see no change."""
    if getattr(model, TAPPED, False):
        return
    for module in attention_modules(model):
        module.register_forward_pre_hook(_hand_over, with_kwargs=True)
    setattr(model, TAPPED, True)


def output_grams(model: Any) -> list[torch.Tensor]:
    """Per layer `(Hq, D, D)`: `W_O^h (W_O^h)^T` of each query head h (`model` a `LoadedModel`), float32."""
    heads, d = model.shape()["heads"], model.shape()["head_dim"]
    grams = []
    for module in attention_modules(model.model):
        w = module.o_proj.weight.detach().float().T.reshape(heads, d, -1)  # (Hq, D, d_model)
        grams.append(w @ w.transpose(1, 2))
    return grams
