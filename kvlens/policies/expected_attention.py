"""`expected_attention`: keep the keys that future queries are expected to attend to.

Devoto, Jeblick and Jégou, "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", 2025, https://arxiv.org/abs/2510.00636 (kvpress's
`ExpectedAttentionPress`, the authors' reference implementation). The prompt's queries before
RoPE (positions `n_sink` on) give a mean mu and, with `covariance`, a covariance Sigma per query
head; averaging RoPE's rotation over the `n_future` positions after the prompt, R, moves them to
mu' = R mu and Sigma' = R Sigma R^T. For a Gaussian query, E[exp(s q.k)] = exp(s mu'.k + s^2 k^T
Sigma' k / 2) (s the layer's logit scale, 1/sqrt(d) for Llama, as kvpress hard-codes); the
softmax of that expected logit over the keys, averaged over a KV head's query heads and, with
`vnorm`, times (score + `epsilon`) x ||v||, is the score; the first `n_sink` positions are always
kept. kvlens recovers the queries before RoPE from the rotated ones (the inverse rotation, with
the model's own cos/sin), so it needs one rotary embedding on every layer (refused otherwise, in
one sentence). At a decode step the new key is scored with the prompt's statistics (each slot's
expected logits are kept with it); kvpress's `DecodingPress` would re-estimate them from the
recent queries. kvpress's evaluation registers this method as Ada-KV over it with epsilon 0.01
(`--policy adakv --set base=expected_attention --set base.epsilon=0.01`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlens.errors import KvlensError
from kvlens.kvcache import LOSSY, CacheRows, Prompt, Step
from kvlens.policies.base import NO_ATTENTION, Needs, ScoredEviction, param, register

FUTURE = "expected_attention_future"  # per layer: mu' (Hq, D) and Sigma' (Hq, D, D) or None
# per slot (R, S, G): the expected logit of each query head of the row (-inf for a sink: outside the softmax)
LOGIT = "expected_attention_logit"
VNORM = "expected_attention_vnorm"  # per slot (R, S): ||v||
SCORED = (
    "expected_attention_scored"  # per slot (R, S): its logits are computed (a new token arrives unscored)
)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's pairing of the two halves of the head dimension: `(-x2, x1)`."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@register
@dataclass(frozen=True)
class ExpectedAttention(ScoredEviction):
    n_future: int = param(512, "Future positions RoPE's rotation is averaged over (kvpress: 512).", minimum=1)
    n_sink: int = param(
        4, "First positions always kept and left out of the query statistics (kvpress: 4).", minimum=0
    )
    covariance: bool = param(True, "Use the queries' covariance, not only their mean (kvpress: true).")
    vnorm: bool = param(True, "Multiply the score by the value's L2 norm (kvpress: true).")
    epsilon: float = param(
        0.0,
        "Added to the score before the value norm multiplies it (kvpress 0; its evaluation 0.01).",
        minimum=0.0,
    )

    name = "expected_attention"
    description = "Keep the keys future queries are expected to attend to (query statistics moved by RoPE)."
    paper = "https://arxiv.org/abs/2510.00636"
    kvpress = "ExpectedAttentionPress"
    kvpress_differs = (
        "A new decode token is scored with the prompt's statistics. kvpress compresses the prompt "
        "only; kvlens keeps the budget at every decode step too."
    )

    def needs(self) -> Needs:
        return dataclasses.replace(NO_ATTENTION, min_budget=self.n_sink + 1)

    def observe_prefill(self, rows: CacheRows, prompt: Prompt) -> None:
        rotary, queries, positions = prompt.rotary, prompt.queries, prompt.positions
        if rotary is None or queries is None or positions is None:
            raise KvlensError(
                "expected_attention needs a model with one rotary embedding (RoPE) on every layer, "
                "whose queries it moves to future positions."
            )
        q = queries.float()  # (Hq, T, D) after RoPE
        cos, sin = (x.float() for x in rotary(positions))  # (T, D)
        before = (q * cos - rotate_half(q) * sin) / (cos * cos + sin * sin)  # the inverse rotation
        h = before[:, self.n_sink :]
        mean = h.mean(1)  # (Hq, D)
        cov = None
        if self.covariance:
            centred = h - mean[:, None]
            cov = torch.einsum("hsi,hsj->hij", centred, centred) / h.shape[1]
        t, d = q.shape[1], q.shape[2]
        cos_f, sin_f = (
            x.float() for x in rotary(torch.arange(t, t + self.n_future, device=q.device))
        )  # (n, D)
        swap = torch.zeros(d, d, device=q.device)
        swap[d // 2 :, : d // 2], swap[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
        rotation = (cos_f[:, None, :] * torch.eye(d, device=q.device) + sin_f[:, None, :] * swap).mean(
            0
        )  # (D, D)
        hkv = rows.pos.shape[0]  # the statistics grouped by KV head: (Hkv, G, D) and (Hkv, G, D, D)
        moved = (mean @ rotation.T).view(hkv, -1, d)
        spread = None if cov is None else (rotation @ cov @ rotation.T).view(hkv, -1, d, d)
        rows.state[FUTURE] = (moved, spread, prompt.scaling)
        rows.extra[LOGIT] = self._stored_logits(rows.keys[0].float(), rows.pos, *rows.state[FUTURE])
        if self.vnorm:
            rows.extra[VNORM] = rows.values[0].float().norm(dim=-1)
        rows.extra[SCORED] = torch.ones(rows.pos.shape, dtype=torch.bool, device=q.device)

    def _stored_logits(
        self,
        keys: torch.Tensor,
        pos: torch.Tensor,
        mean: torch.Tensor,
        cov: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """What a slot keeps: the expected logits `(H, S, G)` of keys `(H, S, D)` at positions `(H, S)` under
        their KV heads' future query statistics, mean `(H, G, D)` and covariance `(H, G, D, D)`; a sink's are
        -inf (outside the softmax)."""
        logits = torch.einsum("hsd,hgd->hsg", keys, mean) * scale
        if cov is not None:
            logits += torch.einsum("hsi,hgij,hsj->hsg", keys, cov, keys) * (scale * scale / 2)
        return logits.masked_fill((pos < self.n_sink)[..., None], float("-inf"))

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        """`(R, S)`: the mean over a row's query heads of the softmax of its slots' expected logits (sinks and
        free slots outside it), times ||v|| with `vnorm`. Each slot keeps its logits and value norm: only new
        tokens' are computed (every value's norm again where the storage is lossy: a quantized value changes
        when it is stored)."""
        kept_norms = self.vnorm and not rows.state.get(LOSSY)
        scored = rows.extra[SCORED]  # the per-slot statistics are views of the store's: written in place
        heads, slots = (rows.valid & ~scored).nonzero(as_tuple=True)
        if heads.numel():
            mean, cov, scale = rows.state[FUTURE]  # (Hkv, G, D), (Hkv, G, D, D) or None
            keys = rows.keys[0][heads, slots][:, None].float()  # (n, 1, D)
            pos = rows.pos[heads, slots][:, None]  # (n, 1)
            cov = None if cov is None else cov[heads]
            rows.extra[LOGIT][heads, slots] = self._stored_logits(keys, pos, mean[heads], cov, scale)[:, 0]
            if kept_norms:
                rows.extra[VNORM][heads, slots] = rows.values[0][heads, slots].float().norm(dim=-1)
            scored[heads, slots] = True
        logits = rows.extra[LOGIT]
        if not bool(rows.valid.all()):
            logits = logits.masked_fill(~rows.valid[..., None], float("-inf"))
        # over the slots of each row (a strided softmax over dim 1 of (R, S, G) took twice as long)
        probs = torch.softmax(logits.transpose(1, 2), dim=-1).mean(1)  # (R, S)
        probs = torch.nan_to_num(probs, nan=0.0)
        if self.vnorm:
            norms = rows.extra[VNORM] if kept_norms else rows.values[0].float().norm(dim=-1)
            probs = (probs + self.epsilon) * norms
        return probs

    def protected(self, rows: CacheRows, budget: int) -> torch.Tensor:
        return rows.pos < self.n_sink
