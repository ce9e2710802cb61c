"""Statistics of prefill attention recomputed from the recorded queries and keys.

Attention is the model's causal softmax `softmax(q k^T / sqrt(head_dim))` per query head (GQA:
query head h reads KV head h // group), recomputed in row chunks (`attention_chunks`), so it needs
`--record states` and never the full T x T for all heads at once.

- `corm_sparsity`: CORM Fig. 1 (layer-wise and head-wise attention sparsity).
- `attention_variance`: CaM Fig. 2 (variance of single-token attention vs group means).
- `merge_future_similarity`: WeightedKV Fig. 2 (future attention with and without one merge).
- `aggregated_attention`: per KV head column sums (H2O's score; KVMerger's pivot choice).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.analysis.states import attention_chunks, check_layer, recorded_layers, states
from kvlens.errors import KvlensError
from kvlens.runs.run import Run


@dataclass
class Sparsity:
    """`important` `(L, Hq)`: mean over query rows t of the share of the t visible keys with
    attention >= 1/t (CORM Definition 3.1); `sparsity = 1 - important` is what CORM Fig. 1 plots."""

    layers: list[int]
    important: torch.Tensor

    @property
    def sparsity(self) -> torch.Tensor:
        return 1 - self.important


def corm_sparsity(run: Run, layers: list[int] | None = None, start: int = 0) -> Sparsity:
    """CORM Fig. 1: per layer and query head, the share of important keys, averaged over rows.

    Row i (0-based) sees t = i + 1 keys; key j is important if `A[i, j] >= 1/t`. Rows before
    `start` are skipped (the paper does not say which rows it averages; default: all of them).
    """
    layers = recorded_layers(run, "q") if layers is None else layers
    out = []
    for layer in layers:
        q, k = states(run, "q", layer), states(run, "k", layer)
        t = q.shape[1]
        if not 0 <= start < t:
            raise KvlensError(f"start must be between 0 and {t - 1} (the prompt has {t} tokens); got {start}.")
        total = torch.zeros(q.shape[0], dtype=torch.float64)
        for a, b, probs in attention_chunks(q, k, start):  # (Hq, rows, T)
            seen = torch.arange(a + 1, b + 1, dtype=torch.float32)  # keys visible per row
            share = (probs >= 1 / seen[None, :, None]).sum(-1) / seen  # (Hq, rows)
            total += share.double().sum(-1)
        out.append((total / (t - start)).float())
    return Sparsity(list(layers), torch.stack(out))


@dataclass
class AttentionVariance:
    """CaM Fig. 2 for one layer: `group_var` `(G,)` variance over query rows of the mean attention
    of group g's m consecutive tokens; `token_var` `(G, m)` the same for each single token.
    `starts` `(G,)` first token of each group; `rows` the query rows the variance is over."""

    layer: int
    head: int | None
    group: int
    starts: torch.Tensor
    group_var: torch.Tensor
    token_var: torch.Tensor
    rows: tuple[int, int]


def attention_variance(run: Run, layer: int, head: int | None = None, group: int = 64,
                       rows: int | None = None) -> AttentionVariance:
    """CaM Fig. 2: how much single tokens' attention varies over later steps vs their group means.

    Over the last `rows` query rows (default: the second half of the prompt; teacher-forced steps
    of a full-cache run stand in for the paper's generation steps), take the attention to each
    earlier token (positions before the first of those rows, cut into consecutive groups of
    `group`); `head=None` averages the attention over the layer's query heads first.
    """
    q, k = states(run, "q", layer), states(run, "k", layer)
    hq, t, _ = q.shape
    if head is not None and not 0 <= head < hq:
        raise KvlensError(f"Head {head} is out of range: layer {layer} has query heads 0 to {hq - 1}.")
    rows = t // 2 if rows is None else rows
    first = t - rows
    if rows < 2 or first < group or group < 1:
        raise KvlensError(f"Attention variance needs at least 2 rows and one group of {group} tokens before them; "
                          f"the prompt has {t} tokens (rows={rows}).")
    n_groups = first // group
    cols = n_groups * group
    picked = []
    for _, _, probs in attention_chunks(q, k, first):  # (Hq, r, T)
        p = probs.mean(0) if head is None else probs[head]  # (r, T)
        picked.append(p[:, :cols])
    a = torch.cat(picked).double()  # (rows, G * m)
    token_var = a.var(0, unbiased=False).view(n_groups, group)
    group_var = a.view(rows, n_groups, group).mean(-1).var(0, unbiased=False)
    return AttentionVariance(layer, head, group, torch.arange(n_groups) * group, group_var.float(),
                             token_var.float(), (first, t))


def aggregated_attention(run: Run, layer: int) -> torch.Tensor:
    """Accumulated prefill attention per KV head `(Hkv, T)`: column sums of the mean over the
    group's query heads (the recorded `prefill/abar/{layer}` when the policy computed it, else
    recomputed; a policy that needs no attention records it as zeros)."""
    name = f"prefill/abar/{layer}"
    if run.has(name) and bool(run.tensor(name).any()):
        return run.tensor(name).float()
    check_layer(run, layer)
    q, k = states(run, "q", layer), states(run, "k", layer)
    hkv = k.shape[0]
    total = torch.zeros(hkv, q.shape[1], dtype=torch.float64)
    for _, _, probs in attention_chunks(q, k):
        total += probs.view(hkv, -1, *probs.shape[1:]).mean(1).sum(1).double()
    return total.float()


@dataclass
class MergeSimilarity:
    """WeightedKV Fig. 2: `cosine` `(L, Hq, N)` float64 similarity of attention rows at steps
    `step+1 .. step+N` with and without the merge at `step`; `merged` `(L, Hkv)` the merged token."""

    layers: list[int]
    step: int
    cosine: torch.Tensor
    merged: torch.Tensor


def merge_future_similarity(run: Run, step: int = 100, horizon: int = 800, sink: int = 4,
                            layers: list[int] | None = None) -> MergeSimilarity:
    """WeightedKV Fig. 2 from prefill states: one merge at `step`, its effect on later attention rows.

    At query row `step`, each KV head's token j with the smallest average attention
    `Abar[j] / n[j]` over rows 0..step (sinks `0..sink-1` and token `step` itself excluded) has its
    value merged into token j+1 and its key dropped. Later rows then attend over the other keys:
    `A'_t = A_t` without column j, renormalised, and `cos(A_t, A'_t)` is reported for each query
    head of the group. Choice: queries come from the unmerged run (the merged value changes no
    attention weight of this layer; its knock-on effect on later layers' queries is not modelled),
    which makes the measure exact for the layer itself and cheap.
    """
    layers = recorded_layers(run, "q") if layers is None else layers
    out, merged = [], []
    for layer in layers:
        q, k = states(run, "q", layer), states(run, "k", layer)
        hq, t, _ = q.shape
        hkv = k.shape[0]
        if not sink < step < t - 1:
            raise KvlensError(f"The merge step must lie between {sink + 1} and {t - 2} for this {t}-token prompt; "
                              f"got {step}.")
        stop = min(t, step + 1 + horizon)
        abar = torch.zeros(hkv, t, dtype=torch.float64)
        for _, _, probs in attention_chunks(q, k, 0, step + 1):
            abar += probs.view(hkv, -1, *probs.shape[1:]).mean(1).sum(1).double()
        seen = (step + 1 - torch.arange(t)).clamp(min=1)  # rows 0..step that saw each token
        score = (abar / seen)[:, :step].clone()
        score[:, :sink] = float("inf")
        j = score.argmin(-1)  # (Hkv,)
        jq = j.repeat_interleave(hq // hkv)  # (Hq,)
        cos = []
        for _, _, probs in attention_chunks(q, k, step + 1, stop):  # (Hq, r, T)
            a = probs.double()
            aj = a.gather(-1, jq[:, None, None].expand(-1, a.shape[1], 1)).squeeze(-1)  # (Hq, r)
            norm2 = (a ** 2).sum(-1)
            cos.append((norm2 - aj ** 2).clamp(min=0).sqrt() / norm2.sqrt())  # float64: values sit near 1
        out.append(torch.cat(cos, dim=1))
        merged.append(j)
    return MergeSimilarity(list(layers), step, torch.stack(out), torch.stack(merged))
