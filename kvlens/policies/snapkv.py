"""`snapkv`: keep what the last queries of the prompt look at, pooled over neighbouring positions.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024,
https://arxiv.org/abs/2404.14469. The attention of the last `window` prompt queries onto the
earlier keys (softmax over every key, the window's own keys included, causal inside the window) is
averaged over those queries, pooled over `kernel` neighbouring positions (stride 1, zero padding
counted, as `F.avg_pool1d`), averaged over the query heads of each KV head, and the top slots are
kept beside the window, which is always kept; the budget counts the window (kvpress's
`SnapKVPress`: window 64, kernel 5, average pooling; the paper's LongBench runs use window 32,
kernel 7, max pooling, preset `paper`).

Decoding (`decoding`): `once` (the default) compresses the prompt only, once, before generation, as the paper
and kvpress's `SnapKVPress` do, and the cache then grows by one slot per generated token; `rolling` keeps the
budget at every step, as kvpress's `DecodingPress` does, scoring with the attention the slots received from
the last `window` queries (the prompt's last ones, then each step's), kept per slot as the queries came:
kvpress recomputes those queries' attention over the current cache instead, whose softmax no longer counts the
keys evicted since (the two differ by that normalisation), and pools within each query head before averaging
them, where kvlens stores the KV head's average (equal for average pooling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvlens.kvcache import CacheRows, Prompt, Step, group_mean
from kvlens.policies.base import (
    Needs,
    ScoredEviction,
    check,
    param,
    recent_mask,
    register,
)

WINDOW = "snapkv_window"  # per slot (R, S, window): attention from each of the last `window` queries (a ring)
NEXT = "snapkv_next"  # per layer: the ring column the next query writes
PROMPT_SCORE = "snapkv_prompt_score"  # per layer, until the prompt's compression: (Hkv, T) by prompt position
POOLS: dict[str, Callable[..., torch.Tensor]] = {
    "avg": F.avg_pool1d,
    "max": F.max_pool1d,
}  # `pooling` -> its pooling over neighbours


@register
@dataclass(frozen=True)
class SnapKV(ScoredEviction):
    window: int = param(
        64,
        "Observation window: the last queries whose attention scores the keys (kvpress 64, "
        "the paper's LongBench runs 32); always kept.",
        minimum=1,
    )
    kernel: int = param(
        5, "Pooling kernel over neighbouring positions (kvpress 5, the paper's runs 7); odd.", minimum=1
    )
    pooling: str = param(
        "avg",
        "Pooling of the scores over neighbouring positions: average (kvpress) or max (the paper's runs).",
        choices=("avg", "max"),
    )
    decoding: str = param(
        "once",
        "During decoding: compress the prompt once and let the cache grow (the paper, "
        "kvpress's SnapKVPress), or keep the budget at every step with a rolling window "
        "(kvpress's DecodingPress).",
        choices=("once", "rolling"),
    )

    name = "snapkv"
    description = "Keep the keys the last window of prompt queries attends to (pooled), plus that window."
    paper = "https://arxiv.org/abs/2404.14469"
    kvpress = "SnapKVPress"
    kvpress_differs = (
        "`decoding=rolling` keeps the budget at every decode step with the attention each slot "
        "received from the last `window` queries, as they came (kvpress's DecodingPress recomputes "
        "those queries' attention over the current cache)."
    )
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "kvpress": {"window": 64, "kernel": 5, "pooling": "avg", "decoding": "once"},
        "paper": {"window": 32, "kernel": 7, "pooling": "max", "decoding": "once"},
    }

    def validate(self) -> None:
        check(
            self.kernel % 2 == 1,
            f"kernel of snapkv must be odd (centred on each position); got {self.kernel}.",
        )

    def needs(self) -> Needs:
        return Needs(
            prefill_rows=self.window,
            column_sums=False,
            decode_steps=self.decoding == "rolling",
            min_budget=self.window + 1,
        )

    def local_window(self, budget: int) -> int:
        return self.window

    def observe_prefill(self, rows: CacheRows, prompt: Prompt) -> None:
        last = prompt.last  # (Hq, w, T): softmax over every key, causal inside the window
        r, t = rows.pos.shape
        hq, w = last.shape[:2]
        pooled = self._pool(last[:, :, : t - w].mean(1)[:, None, :])[
            :, 0
        ]  # (Hq, T - w), per query head (kvpress)
        score = pooled.new_zeros(r, t)
        score[:, : t - w] = pooled.view(r, hq // r, t - w).mean(1)
        rows.state[PROMPT_SCORE] = score
        if self.decoding == "rolling":
            ring = group_mean(last.view(r, hq // r, w, t)).transpose(1, 2)  # (R, T, w), oldest query first
            rows.extra[WINDOW] = torch.cat([ring.new_zeros(r, t, self.window - w), ring], dim=2)
            rows.state[NEXT] = 0

    def observe(self, rows: CacheRows, probs: torch.Tensor) -> None:
        if self.decoding == "rolling":
            ring, k = rows.extra[WINDOW], rows.state[NEXT]
            ring[:, :, k] = group_mean(probs)  # (R, S): this query's attention replaces the oldest one's
            rows.state[NEXT] = (k + 1) % self.window

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        """The prompt's pooled window attention at its compression; at a decode step the same over the ring
        of the last `window` queries (the recent window, protected, counts as zero in the pooling)."""
        if step.prompt:
            score: torch.Tensor = rows.state.pop(PROMPT_SCORE)
            return score
        order = rows.position_order()  # pooling runs over neighbouring positions
        recent = recent_mask(rows, self.window)
        mean = rows.extra[WINDOW].mean(-1).masked_fill(recent | ~rows.valid, 0.0).gather(1, order)
        pooled = self._pool(mean[:, None, :])[:, 0]
        return torch.empty_like(pooled).scatter_(1, order, pooled)

    def protected(self, rows: CacheRows, budget: int) -> torch.Tensor:
        return recent_mask(rows, self.window)

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        """`(N, 1, L)` pooled over `kernel` neighbours (stride 1; zero padding counted, max ignores it)."""
        if self.kernel == 1:
            return x
        return POOLS[self.pooling](x, kernel_size=self.kernel, padding=self.kernel // 2, stride=1)
