"""The registered attention function: exposes attention rows to policies and recorders.

Models are loaded with `attn_implementation="kvlens"`. The function receives queries and the
layer's (already updated) cached keys/values after RoPE, plus keyword arguments saying how the
layer attends. It reads them into an `AttentionSpec` and refuses, with one sentence naming the
layer, anything it cannot compute exactly (`read_call`). Without a run context (plain use of the
model) it is transformers' SDPA, or the dense math below when the layer soft-caps or slides. With
one, it hands the work to `RunContext.attend`: decode rows computed per KV head (GQA without
repeating K/V), and prefill statistics computed in row chunks so a long prompt never
materialises T x T per head at once.

Sliding windows (transformers' convention): a query at position p sees the keys at positions
k with p - window < k <= p. In a kvlens run the window is applied to the slots' original
positions before anything else: slots of the compressed cache outside the window get zero
attention and are not counted as observed (`nobs`); the policy still decides which slots the
cache keeps, and its budget counts every kept slot, in the window or not.
"""

from __future__ import annotations

import functools
import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvlens.errors import KvlensError
from kvlens.kvcache.channels import ChannelStates
from kvlens.kvcache.scores import AttentionSpec, layer_logits, softmax_weights

ATTENTION_NAME = "kvlens"
CONTEXT_KWARG = "kvlens_context"
CHUNK_ELEMENTS = 1 << 21  # ~8 MB of float32 scores per prefill chunk: 1.4x faster than 32 MB at 4096 tokens
# Keyword arguments transformers forwards to every attention call that do not change what a layer computes.
BOOKKEEPING = frozenset(
    {"position_ids", "use_cache", "cache_position", "output_attentions", "output_router_logits"}
)
NAMED_FEATURES = {"s_aux": "learned attention sinks (`s_aux`)"}


def read_call(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling,
    dropout,
    softcap,
    sliding_window,
    kwargs: dict,
    in_run: bool,
) -> AttentionSpec:
    """Check one attention call and return its spec; raise `KvlensError` on what kvlens cannot do exactly.

    query `(B, Hq, q, D)`, key/value `(B, Hkv, S, D)`. `in_run`: called inside a kvlens run,
    where no attention mask can be honoured (the engine passes none, so one comes from the model).
    """
    layer = getattr(module, "layer_idx", None)
    where = f"layer {layer}" if isinstance(layer, int) else f"attention module {type(module).__name__}"
    for name, val in kwargs.items():
        if name in BOOKKEEPING or val is None or (name == "is_causal" and val is True):
            continue
        if name == "is_causal":
            raise KvlensError(
                f"The attention of {where} is not causal (e.g. cross-attention or an encoder), "
                f"which kvlens does not support."
            )
        feature = NAMED_FEATURES.get(name, f"the attention argument `{name}`")
        raise KvlensError(
            f"The attention of {where} uses {feature}, which kvlens does not support, so it refuses "
            f"rather than approximate."
        )
    if not isinstance(layer, int):
        raise KvlensError(f"The {where} has no layer index, so it has no KV cache kvlens can compress.")
    if dropout:
        raise KvlensError(f"The attention of {where} applies dropout {dropout}; put the model in eval mode.")
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        raise KvlensError(
            f"The attention of {where} has queries, keys and values of different widths "
            f"({query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}; e.g. multi-latent attention), "
            f"which kvlens does not support."
        )
    if attention_mask is not None and in_run:
        raise KvlensError(
            f"The attention of {where} receives an attention mask or bias (e.g. ALiBi), which kvlens "
            f"cannot apply to a compressed cache."
        )
    spec = AttentionSpec(
        scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,
        softcap=float(softcap) if softcap else None,
        window=int(sliding_window) if sliding_window else None,
    )
    if attention_mask is not None and not spec.plain:
        raise KvlensError(
            f"The attention of {where} combines an attention mask with soft-capping or a sliding "
            f"window, which kvlens does not support."
        )
    return spec


def kvlens_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    softcap=None,
    sliding_window=None,
    **kwargs,
):
    """AttentionInterface entry point. Returns `(out (B, q, Hq, D), None)`."""
    ctx = kwargs.pop(CONTEXT_KWARG, None)
    spec = read_call(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling,
        dropout,
        softcap,
        sliding_window,
        kwargs,
        in_run=ctx is not None,
    )
    if ctx is not None:
        return ctx.attend(module.layer_idx, query, key, value, spec), None
    if spec.plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=spec.scaling)
    return dense(query, key, value, spec), None


def register_attention() -> None:
    """Register `kvlens` with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvlens_attention)


def visible(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Keys each query may attend: `qpos (q,)`, `kpos (..., S)` -> `(..., q, S)` bool (causal, within the
    window)."""
    diff = qpos[:, None] - kpos[..., None, :]
    ok = diff >= 0
    return ok & (diff < window) if window is not None else ok


def attention_probs(qg, key, spec: AttentionSpec, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention of grouped queries: qg `(..., Hkv, G, q, D)`, key `(..., Hkv, S, D)`.

    `allowed` broadcasts to `(..., Hkv, G, q, S)`. Returns float32 `(..., Hkv, G, q, S)`.
    """
    scores = torch.matmul(qg, key.unsqueeze(-3).transpose(-1, -2)).float()
    return softmax_weights(scores, spec, ~allowed)


def dense(query, key, value, spec: AttentionSpec) -> torch.Tensor:
    """Causal attention of the q queries at the last q of the S key positions, any spec.

    query `(B, Hq, q, D)`, key/value `(B, Hkv, S, D)` -> `(B, q, Hq, D)`.
    """
    b, hq, q, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    kpos = torch.arange(s, device=key.device)
    probs = attention_probs(
        query.view(b, hkv, hq // hkv, q, d), key, spec, visible(kpos[s - q :], kpos, spec.window)
    )
    out = torch.matmul(probs.to(value.dtype), value.unsqueeze(2))  # (B, Hkv, G, q, D)
    return out.reshape(b, hq, q, d).transpose(1, 2).contiguous()


def replayed(
    query, key, value, spec: AttentionSpec, span: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The q queries of a pass fed after S - q cached slots (all visible), causal among themselves.

    query `(1, Hq, q, D)`, key/value `(1, Hkv, S, D)`; `span` the cached slots start..end - 1 the pass
    reconstructs. Returns out `(1, q, Hq, D)`, each query's logsumexp over the pass's own keys `(Hq, q)`
    float32 and over the span's slots (or None): what KVzip's scores normalise by. On the CPU and a plain
    layer, flash attentions over the span, the other cached slots and the pass's own keys (causally) give
    all three, their outputs combined by their log-normalisers; else SDPA with a `(q, S)` mask (`dense`
    when the layer soft-caps) and the own keys' logits computed apart.
    """
    q, s = query.shape[2], key.shape[2]
    if spec.plain and key.device.type == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        start, end = span
        parts = [flash(query, key[:, :, start:end], value[:, :, start:end], scale=spec.scaling)]
        if end - start < s - q:  # the cached slots outside the span
            rest = (slice(0, start), slice(end, s - q))
            k_rest, v_rest = (torch.cat([x[:, :, cut] for cut in rest], 2) for x in (key, value))
            parts.append(flash(query, k_rest, v_rest, scale=spec.scaling))
        own = flash(query, key[:, :, s - q :], value[:, :, s - q :], is_causal=True, scale=spec.scaling)
        parts.append(own)
        lse = functools.reduce(torch.logaddexp, [part_lse for _, part_lse in parts])
        out = sum(part * (part_lse - lse).exp()[..., None] for part, part_lse in parts)
        return out.transpose(1, 2).contiguous().to(query.dtype), own[1][0], parts[0][1][0]
    if spec.plain:
        cols = torch.arange(s, device=key.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=visible(cols[s - q :], cols, None),
            scale=spec.scaling,
            enable_gqa=True,
        ).transpose(1, 2)
    else:
        out = dense(query, key, value, spec)
    return out.contiguous(), own_logsumexp(query[0], key[0, :, s - q :], spec), None


def own_logsumexp(query, key, spec: AttentionSpec) -> torch.Tensor:
    """`(Hq, q)` float32: each of q queries' logsumexp of its logits over q keys of its own pass, causal.
    query `(Hq, q, D)`, key `(Hkv, q, D)`."""
    hq, q, d = query.shape
    hkv = key.shape[0]
    logits = layer_logits(
        torch.matmul(query.view(hkv, hq // hkv, q, d), key[:, None].transpose(-1, -2)).float(), spec
    )
    future = torch.ones(q, q, dtype=torch.bool, device=key.device).triu(1)
    return logits.masked_fill_(future, float("-inf")).logsumexp(-1).view(hq, q)


def sdpa(query, key, value, scaling: float) -> torch.Tensor:
    """Plain causal SDPA with GQA, `(1, Hq, q, D)` x `(1, Hkv, S, D)` -> `(1, q, Hq, D)`.

    The q queries are the last q positions of the S keys (decode: q = 1, no mask needed).
    """
    q = query.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=q > 1, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


def plain_forward(query, key, value, spec: AttentionSpec) -> torch.Tensor:
    """One call's causal attention outside a run (a probe, a calibration forward): `sdpa` on a plain layer,
    else `dense`."""
    return sdpa(query, key, value, spec.scaling) if spec.plain else dense(query, key, value, spec)


def decode_rows(query, key, value, valid, spec: AttentionSpec):
    """One query per head against the compressed cache.

    query `(1, Hq, 1, D)`, key/value `(1, Hkv, S, D)`, valid `(Hkv, S)` (the slots the query may
    see) or None (all of them). Returns out `(1, 1, Hq, D)` and probs `(Hkv, G, S)` float32.
    """
    qg = query_groups(query, key.shape[1])
    # batched over KV heads, the group's queries as rows: no broadcast copy of K (`attention_probs`'s layout)
    return decode_weighted(torch.bmm(qg, key[0].transpose(1, 2)).float(), value, valid, spec)


def query_groups(query, hkv: int) -> torch.Tensor:
    """A decode step's query `(1, Hq, 1, D)` as each KV head's group of query heads `(Hkv, G, D)`."""
    return query[0, :, 0].reshape(hkv, query.shape[1] // hkv, query.shape[-1])


def decode_weighted(scores, value, valid, spec: AttentionSpec):
    """A decode step's attention from its logits `scores` `(Hkv, G, S)` float32: values `(1, Hkv, S, D)`,
    `valid` `(Hkv, S)` or None as in `decode_rows`. Returns out `(1, 1, Hq, D)` and probs `(Hkv, G, S)`."""
    hkv, g, _ = scores.shape
    probs = softmax_weights(scores, spec, None if valid is None else ~valid[:, None, :])
    out = torch.bmm(probs.to(value.dtype), value[0])  # (Hkv, G, D)
    return out.reshape(1, 1, hkv * g, value.shape[-1]), probs


def decode_channels(query, keys: ChannelStates, rows: slice, value, valid, spec: AttentionSpec):
    """A decode step's attention on channel-pruned keys (ThinK, `kvlens.kvcache.channels`): the logits on
    each row's kept channels (and a whole key's pruned ones), read in place, with no key rebuilt. query
    `(1, Hq, 1, D)`, `rows` the layer's rows of the store, value `(1, Hkv, S, D)`, valid `(Hkv, S)` or
    None. Returns out `(1, 1, Hq, D)`."""
    qg = query_groups(query, value.shape[1])
    return decode_weighted(keys.logits(rows, value.shape[2], qg), value, valid, spec)[0]


def decode_segments(query, store, rows: slice, counts: list[int], spec: AttentionSpec) -> torch.Tensor:
    """A decode step's attention on a paged layer laid out in segments (`PagedStore.reserve`): KV head r's
    `counts[r]` slots are one run of the pools' entries, read in place (`PagedStore.segment`), no gather. One
    attention per KV head over its group's query heads (SDPA, as heads, so that its threads share them; or
    `decode_rows` when soft-capped).

    query `(1, Hq, 1, D)`, `rows` the layer's rows of `store`. Returns out `(1, 1, Hq, D)`.
    """
    hq, d = query.shape[1], query.shape[-1]
    g = hq // len(counts)
    groups = query[0, :, 0].view(len(counts), g, d)
    outs = []
    for r, n in enumerate(counts):
        key, value = (store.segment(name, rows.start + r, n)[None, None] for name in ("keys", "values"))
        if spec.plain:
            out = torch.nn.functional.scaled_dot_product_attention(
                groups[r][None, :, None], key, value, scale=spec.scaling, enable_gqa=True
            ).transpose(1, 2)  # (1, 1, G, D)
        else:
            out = decode_rows(groups[r].view(1, g, 1, d), key, value, None, spec)[0]
        outs.append(out)
    return torch.cat(outs, dim=2)


def last_rows(query, key, spec: AttentionSpec, keep_rows: int) -> torch.Tensor:
    """The attention rows of a prompt's last `keep_rows` queries only (what TOVA and CORM read).

    query `(1, Hq, T, D)`, key `(1, Hkv, T, D)` -> `(Hq, L, T)` float32, equal to `prefill_stats`'s `last`.
    """
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    if keep_rows == 0:
        return torch.zeros(hq, 0, t, dtype=torch.float32, device=key.device)
    cols = torch.arange(t, device=key.device)
    rows = cols[t - keep_rows :]
    qg = query[0, :, t - keep_rows :].view(hkv, hq // hkv, keep_rows, d)
    return attention_probs(qg, key[0], spec, visible(rows, cols, spec.window)).reshape(hq, keep_rows, t)


def prefill_stats(query, key, value, spec: AttentionSpec, keep_rows: int):
    """Causal attention of a whole prompt, computed in row chunks, with the statistics policies need.

    query `(1, Hq, T, D)`, key/value `(1, Hkv, T, D)`. Returns
    out `(1, T, Hq, D)`; colsum `(Hkv, T)` float32, each KV head's column sums of its query heads'
    mean attention (H2O's accumulated score); last `(Hq, L, T)` float32, the last `keep_rows` rows.
    The output comes from the same probabilities as the statistics (one eager pass over the causal
    triangle: a chunk of rows a..b-1 scores keys 0..b-1 only), which costs less than SDPA's output
    plus a second, scoring pass.
    """
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    qg = query[0].view(hkv, g, t, d)
    k, v = key[0], value[0]
    chunk = max(
        1, min(CHUNK_ELEMENTS // (hq * t), max(64, t // 8))
    )  # >= 8 chunks: the causal triangle is skipped
    scaled = spec.plain and math.frexp(spec.scaling)[0] == 0.5  # a power of two scales exactly: once on Q
    if scaled:
        qg = qg * spec.scaling
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(
        1
    )  # a diagonal block's masked keys
    out = torch.empty(hkv, g, t, d, dtype=value.dtype, device=value.device)
    colsum = torch.zeros(hkv, t, dtype=torch.float32, device=key.device)
    first_kept = t - keep_rows
    last = torch.zeros(hq, max(keep_rows, 0), t, dtype=torch.float32, device=key.device)
    cols = torch.arange(t, device=key.device)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        if spec.plain:  # causal: the rows a..b-1 see keys 0..b-1 only; mask just the diagonal block
            # batched over KV heads with the group's rows stacked: K is read as is, never copied per query
            # head
            rows = qg[:, :, a:b].reshape(hkv, g * (b - a), d)
            scores = torch.bmm(rows, k[:, :b].transpose(1, 2)).float().view(hkv, g, b - a, b)
            probs = softmax_weights(scores, spec, future[: b - a, : b - a], scaled=scaled)  # (Hkv, G, q, b)
            out[:, :, a:b] = torch.bmm(probs.to(v.dtype).view(hkv, g * (b - a), b), v[:, :b]).view(
                hkv, g, b - a, d
            )
        else:
            probs = attention_probs(
                qg[:, :, a:b], k, spec, visible(cols[a:b], cols, spec.window)
            )  # (Hkv, G, q, T)
            out[:, :, a:b] = torch.einsum("hgqs,hsd->hgqd", probs.to(v.dtype), v)
        width = probs.shape[-1]
        colsum[:, :width] += probs.sum((1, 2)) / g
        if b > first_kept and keep_rows > 0:
            lo = max(a, first_kept)
            last[:, lo - first_kept : b - first_kept, :width] = probs[:, :, lo - a :].reshape(
                hq, b - lo, width
            )
    return out.reshape(hq, t, d).transpose(0, 1).unsqueeze(0), colsum, last
