"""`scissorhands`: persistence of importance.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023, https://arxiv.org/abs/2305.17118 (§4, Algorithms 1-2).
Over the last `history` queries, a slot is important at a step if its attention reaches the
average `1/t` over the t slots that query saw (a KV head's attention being the mean of its query
heads'), unimportant if below. The paper counts the unimportant steps and drops the non-recent
slots with the largest count (`count="unimportant"`); it compresses only when the cache is full,
dropping `m` slots at once (`drop`). kvlens used to keep the slots with the most important steps
(`count="important"`): the two rankings differ only for slots that entered during the window
(they were observed fewer times, so they have fewer of both counts: the paper keeps them, the
important count drops them). Ties are broken by smaller accumulated attention `Abar`. With
`drop` > 1 the recent window is `recent_ratio` of the size compressed to.

As CaM's base only `select()` is used (one slot per decode step), so `drop` applies when
scissorhands runs on its own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlens.engine.cache import CacheRows, Prompt, Step
from kvlens.policies.base import ScoredEviction, group_mean, param, recent_mask, register

HISTORY = "scissorhands_history"  # (Hkv, S, history) int8, newest step last: 0 unseen, 1 unimportant, 2 important
UNSEEN, UNIMPORTANT, IMPORTANT = 0, 1, 2


@register
@dataclass(frozen=True)
class Scissorhands(ScoredEviction):
    history: int = param(64, "Window of the last queries over which a slot's importance is counted.", minimum=1)
    recent_ratio: float = param(0.5, "Share of the budget kept as the most recent slots (never dropped).",
                                minimum=0.0, maximum=1.0)
    count: str = param("unimportant", "Statistic over the window: drop the slots most often below the average "
                       "attention (the paper), or keep those most often at or above it.",
                       choices=("unimportant", "important"))
    drop: int = param(1, "m, slots dropped at once when the cache exceeds the budget (the paper drops m when full; "
                      "1 = compress at every step).", minimum=1)

    name = "scissorhands"
    description = "Keep a recent window; drop the slots most often unimportant over the last `history` queries."
    paper = "https://arxiv.org/abs/2305.17118"

    def prefill_rows(self) -> int:
        return self.history

    def min_budget(self) -> int:
        return self.drop

    def observe_prefill(self, rows: CacheRows, prompt: Prompt) -> None:
        last = prompt.last  # (Hq, L, T)
        r, s = rows.pos.shape
        g = last.shape[0] // r
        length = last.shape[1]
        kv_rows = last.view(r, g, length, -1).mean(1)  # (R, L, T)
        query = torch.arange(s - length, s, device=last.device)  # query i sees slots 0..i
        seen = torch.arange(s, device=last.device)[None, :] <= query[:, None]  # (L, T)
        important = kv_rows >= (1.0 / (query + 1).float())[None, :, None]
        state = torch.where(seen[None], UNIMPORTANT + important.to(torch.int8), UNSEEN).to(torch.int8)
        hist = torch.zeros(r, s, self.history, dtype=torch.int8, device=last.device)
        hist[:, :, self.history - length:] = state.transpose(1, 2)
        rows.extra[HISTORY] = hist

    def observe(self, rows: CacheRows, probs: torch.Tensor) -> None:
        att = group_mean(probs)  # (R, S)
        n_slots = rows.valid.sum(-1, keepdim=True).float()
        state = torch.where(rows.valid, UNIMPORTANT + (att >= 1.0 / n_slots).to(torch.int8), UNSEEN)
        hist = rows.extra[HISTORY]
        rows.extra[HISTORY] = torch.cat([hist[:, :, 1:], state.to(torch.int8)[:, :, None]], dim=2)

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        hist = rows.extra[HISTORY]
        counted = (hist == IMPORTANT).sum(-1) if self.count == "important" else -(hist == UNIMPORTANT).sum(-1)
        tie = rows.abar / (rows.abar.max() + 1.0)  # in [0, 1): breaks ties only
        return counted.float() + tie

    def local_window(self, budget: int) -> int:
        return int(budget * self.recent_ratio)

    def protected(self, rows: CacheRows, budget: int) -> torch.Tensor | None:
        return recent_mask(rows, self.local_window(budget))

    def compress(self, rows: CacheRows, step: Step) -> None:
        if step.budget is not None and rows.n_kept > step.budget:
            super().compress(rows, dataclasses.replace(step, budget=step.budget + 1 - self.drop))
