"""The registered attention function: exposes attention rows to policies and recorders.

Models are loaded with `attn_implementation="kvlens"`. The function receives queries and the
layer's (already updated) cached keys/values after RoPE. Without a run context (plain use of
the model) it is transformers' SDPA. With one, it hands the work to `RunContext.attend`, which
uses the math below: decode rows computed per KV head (GQA without repeating K/V), and prefill
statistics computed in row chunks so a long prompt never materialises T x T per head at once.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "kvlens"
CONTEXT_KWARG = "kvlens_context"
CHUNK_ELEMENTS = 1 << 23  # ~32 MB of float32 scores per prefill chunk


def kvlens_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface entry point. Returns `(out (B, q, Hq, D), None)`."""
    ctx = kwargs.pop(CONTEXT_KWARG, None)
    if ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    return ctx.attend(module.layer_idx, query, key, value, scaling), None


def register_attention() -> None:
    """Register `kvlens` with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvlens_attention)


def sdpa(query, key, value, scaling: float) -> torch.Tensor:
    """Plain causal SDPA with GQA, `(1, Hq, q, D)` x `(1, Hkv, S, D)` -> `(1, q, Hq, D)`.

    The q queries are the last q positions of the S keys (decode: q = 1, no mask needed).
    """
    q = query.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=q > 1, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


def decode_rows(query, key, value, valid, scaling: float):
    """One query per head against the compressed cache.

    query `(1, Hq, 1, D)`, key/value `(1, Hkv, S, D)`, valid `(Hkv, S)`.
    Returns out `(1, 1, Hq, D)` and probs `(Hkv, G, S)` float32.
    """
    hq, d = query.shape[1], query.shape[-1]
    hkv = key.shape[1]
    qg = query[0, :, 0].view(hkv, hq // hkv, d)  # (Hkv, G, D)
    scores = torch.einsum("hgd,hsd->hgs", qg, key[0]).float() * scaling
    if valid is not None and not bool(valid.all()):
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgs,hsd->hgd", probs.to(value.dtype), value[0])  # (Hkv, G, D)
    return out.reshape(1, 1, hq, d), probs


def prefill_stats(query, key, value, scaling: float, keep_rows: int):
    """Causal attention of a whole prompt, computed in row chunks, with the statistics policies need.

    query `(1, Hq, T, D)`, key/value `(1, Hkv, T, D)`. Returns
    out `(1, T, Hq, D)`; colsum `(Hkv, T)` float32, each KV head's column sums of its query heads'
    mean attention (H2O's accumulated score); last `(Hq, L, T)` float32, the last `keep_rows` rows.
    """
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    qg = query[0].view(hkv, g, t, d)
    k, v = key[0], value[0]
    chunk = max(1, CHUNK_ELEMENTS // (hq * t))
    out = torch.empty(hkv, g, t, d, dtype=value.dtype, device=value.device)
    colsum = torch.zeros(hkv, t, dtype=torch.float32, device=key.device)
    first_kept = t - keep_rows
    last = torch.zeros(hq, max(keep_rows, 0), t, dtype=torch.float32, device=key.device)
    cols = torch.arange(t, device=key.device)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        scores = torch.einsum("hgqd,hsd->hgqs", qg[:, :, a:b], k).float() * scaling
        future = cols[None, :] > torch.arange(a, b, device=key.device)[:, None]  # (q, T)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)  # (Hkv, G, q, T)
        out[:, :, a:b] = torch.einsum("hgqs,hsd->hgqd", probs.to(v.dtype), v)
        colsum += probs.mean(1).sum(1)
        if b > first_kept and keep_rows > 0:
            lo = max(a, first_kept)
            last[:, lo - first_kept:b - first_kept] = probs[:, :, lo - a:].reshape(hq, b - lo, t)
    return out.reshape(hq, t, d).transpose(0, 1).unsqueeze(0), colsum, last
