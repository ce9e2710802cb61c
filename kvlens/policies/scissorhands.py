"""`scissorhands`: persistence of importance.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023, https://arxiv.org/abs/2305.17118 (§3, §4.1, Algorithms
1-2). Over the last `history` queries (the paper's w), a slot is important at a step if its
attention (a KV head's being the mean of its query heads') reaches the step's threshold,
unimportant if below. The paper counts the unimportant steps and drops the non-recent slots with
the largest count (`count="unimportant"`); it compresses only when the cache is over budget,
dropping m slots at once. kvlens used to keep the slots with the most important steps
(`count="important"`): the two rankings differ only for slots that entered during the window
(they were observed fewer times, so they have fewer of both counts: the paper keeps them, the
important count drops them). Ties are broken by smaller accumulated attention `Abar`.

Each choice is a parameter; `preset=paper` sets the paper's (§4.1: "We use r=10 and w=400 in all
our experiments", "we use m=0.5B"; the threshold 1/t of §3.1 and Algorithm 2):
- `threshold`: at a decode step, `position` is the paper's `1/t`, t the tokens the query attends
  to in the uncompressed stream, i.e. its position + 1 ("the attention score from the position t
  over all the words that come before it ... 1/t indicates an averaging mixing score", §3.1);
  `slots` (default, kvlens's earlier rule) is `1/n_slots`, the slots it attends to in the
  compressed cache. Prompt rows see every earlier token, so there both rules are `1/(i + 1)` for
  row i. Each step is judged against its own t as it happens (the paper's "maintaining the
  importance record during generation steps", §4.1); Algorithm 2 as printed judges the whole
  window at the compression step t against one `1/t`, which would need the window's attention
  kept, not only its marks.
- the recent window (r): `recent` slots when > 0 (paper: 10), else `recent_ratio` of the size
  compressed to (default, H2O's even split).
- m: `drop` slots, or with `drop_ratio` > 0 `max(1, floor(drop_ratio * budget))` (paper: 0.5B);
  the cache then ranges over budget + 1 - m ... budget.
Not expressed: the paper's per-layer budgets ("allocate more budget to later layers", §4.1, from
its Fig. 2; kvlens gives every layer the same) and the streamed prompt (kvlens prefills with full
attention, then compresses once with the last `history` prompt rows, as for every policy).

As CaM's base only `select()` is used (one slot per decode step), so `drop` and `drop_ratio`
apply when scissorhands runs on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlens.kvcache import CacheRows, Prompt, Step, group_mean
from kvlens.policies.base import (
    Needs,
    ScoredEviction,
    check,
    param,
    protected_window,
    register,
)

# (Hkv, S, W) int64, a ring of the last `history` steps, one bit per step: the step's mark is the kind `count`
# counts; step k is bit k % 64 of word k // 64 (W = ceil(history / 64): one contiguous word by default)
HISTORY = "scissorhands_history"
NEWEST = "scissorhands_newest"  # (Hkv, S) int8: the last step's marks, 0 unseen, 1 unimportant, 2 important
COUNT = "scissorhands_count"  # (Hkv, S) int32: the ring's bits set, the steps of the kind `count` counts
NEXT = "scissorhands_next"  # per layer: the ring's step the next step's marks replace (its oldest)
UNSEEN, UNIMPORTANT, IMPORTANT = 0, 1, 2
BITS = 64  # steps per word of the ring
COUNTED = {"important": IMPORTANT, "unimportant": UNIMPORTANT}  # `count` -> the mark it counts

# the paper's settings (§4.1: r = 10, w = 400, m = 0.5B; the threshold 1/t of §3.1 and Algorithm 2)
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "threshold": "position",
        "recent": 10,
        "history": 400,
        "drop_ratio": 0.5,
        "count": "unimportant",
    },
}


@register
@dataclass(frozen=True)
class Scissorhands(ScoredEviction):
    history: int = param(
        64,
        "w, the last queries over which a slot's importance is counted (paper §4.1: w = 400; "
        "64 scales it to prompts of a few hundred tokens).",
        minimum=1,
    )
    recent: int = param(
        0, "r, the newest slots never dropped (paper §4.1: r = 10); 0 = use recent_ratio.", minimum=0
    )
    recent_ratio: float = param(
        0.5,
        "With recent=0: share of the size compressed to kept as the most recent slots "
        "(kvlens's default, H2O's even split; the paper gives a count, r).",
        minimum=0.0,
        maximum=1.0,
    )
    threshold: str = param(
        "slots",
        "Importance threshold at a decode step: 1/n_slots, the slots the query attends "
        "to (kvlens's earlier rule), or 1/t with t its position + 1, the tokens it would attend "
        "to uncompressed (paper §3.1, Algorithm 2). Prompt rows: 1/(i + 1) under both.",
        choices=("slots", "position"),
    )
    count: str = param(
        "unimportant",
        "Statistic over the window: drop the slots most often below the threshold "
        '(paper Algorithm 2, "Mark low score cache"), or keep those most often at or above it '
        "(kvlens's earlier rule).",
        choices=("unimportant", "important"),
    )
    drop: int = param(
        1,
        "m, slots dropped at once when the cache exceeds the budget (paper Algorithm 2's drop "
        "amount; 1 = compress at every step, as its §4.2 analysis).",
        minimum=1,
    )
    drop_ratio: float = param(
        0.0,
        "m as a share of the budget, max(1, floor(drop_ratio x budget)) (paper §4.1: "
        "m = 0.5B); 0 = use drop.",
        minimum=0.0,
        maximum=1.0,
    )

    name = "scissorhands"
    description = (
        "Keep a recent window; drop the slots most often unimportant over the last `history` queries."
    )
    paper = "https://arxiv.org/abs/2305.17118"
    presets: ClassVar[dict[str, dict[str, Any]]] = PRESETS

    def validate(self) -> None:
        check(
            not (self.recent and self.drop_ratio >= 1.0),
            "drop_ratio=1 of scissorhands drops the whole budget, leaving no room for its "
            f"recent={self.recent} "
            f"slots; use a drop_ratio below 1 or recent=0.",
        )

    def dropped(self, budget: int) -> int:
        """m, the slots dropped at once when the cache exceeds `budget`."""
        return max(1, int(self.drop_ratio * budget)) if self.drop_ratio else self.drop

    def needs(self) -> Needs:
        return Needs(prefill_rows=self.history, min_budget=self._least_budget())

    def _least_budget(self) -> int:
        # the least budget that, m dropped, still keeps the recent window and one slot chosen by importance
        budget = self.recent + 1
        while budget + 1 - self.dropped(budget) < self.recent + 1:
            budget += 1
        return budget

    def observe_prefill(self, rows: CacheRows, prompt: Prompt) -> None:
        last = prompt.last  # (Hq, L, T)
        r, s = rows.pos.shape
        g = last.shape[0] // r
        length = last.shape[1]
        kv_rows = last.view(r, g, length, -1).mean(1)  # (R, L, T)
        query = torch.arange(s - length, s, device=last.device)  # query i sees slots 0..i
        seen = torch.arange(s, device=last.device)[None, :] <= query[:, None]  # (L, T)
        important = (
            kv_rows >= (1.0 / (query + 1).float())[None, :, None]
        )  # i + 1 tokens = slots: both thresholds
        state = torch.where(seen[None], UNIMPORTANT + important.to(torch.int8), UNSEEN).to(torch.int8)
        hist = torch.zeros(r, s, self.history, dtype=torch.int8, device=last.device)
        hist[:, :, self.history - length :] = state.transpose(1, 2)
        self.set_history(rows, hist)

    def counted(self) -> int:
        """The mark the window counts (`count`)."""
        return COUNTED[self.count]

    def set_history(self, rows: CacheRows, hist: torch.Tensor) -> None:
        """Start the window from the marks `hist` `(R, S, history)`, oldest step first: its ring of counted
        bits, its counts, its newest marks, and the next step written over its oldest."""
        r, s, w = hist.shape
        words = -(-w // BITS)
        bits = torch.zeros(r, s, words * BITS, dtype=torch.int64, device=hist.device)
        bits[..., :w] = hist == self.counted()
        shift = torch.arange(BITS, device=hist.device)
        weight = torch.ones(BITS, dtype=torch.int64, device=hist.device) << shift
        rows.extra[HISTORY] = (bits.view(r, s, words, BITS) * weight).sum(-1)  # bit 63 weighs -2^63: exact
        rows.extra[COUNT] = bits.sum(-1, dtype=torch.int32)
        rows.extra[NEWEST] = hist[..., -1].contiguous()
        rows.state[NEXT] = 0

    def observe(self, rows: CacheRows, probs: torch.Tensor) -> None:
        """This step's marks `(R, S)` replace the window's oldest in the ring, and each slot's count gains
        the new mark and loses the old one: O(S) per step, never a pass over the window."""
        att = group_mean(probs)  # (R, S)
        if self.threshold == "position":  # t: the tokens the query attends to uncompressed, its position + 1
            t = rows.pos.max(-1, keepdim=True).values.float() + 1.0
        else:  # the slots it attends to
            t = rows.valid.sum(-1, keepdim=True).float()
        marks = torch.where(rows.valid, UNIMPORTANT + (att >= 1.0 / t).to(torch.int8), UNSEEN).to(torch.int8)
        word, bit = divmod(rows.state[NEXT], BITS)
        ring = rows.extra[HISTORY][:, :, word]  # a view of the store's rows: written in place
        new = (marks == self.counted()).to(torch.int64)
        old = (ring >> bit).bitwise_and_(1)
        ring.bitwise_xor_((new ^ old) << bit)  # the oldest step's bit becomes the new one
        rows.extra[COUNT].add_((new - old).to(torch.int32))  # in place, as the ring
        rows.extra[NEWEST].copy_(marks)
        rows.state[NEXT] = (rows.state[NEXT] + 1) % self.history

    def newest_marks(self, rows: CacheRows) -> torch.Tensor:
        """`(R, S)` int8 the marks of the last step observed."""
        return rows.extra[NEWEST]

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        count = rows.extra[COUNT]
        counted = count if self.count == "important" else -count  # int32 sums: half the time of int64's
        abar = rows.abar
        tie = abar / (abar.amax() + 1.0)  # in [0, 1): breaks ties only
        return counted.float() + tie

    def local_window(self, budget: int) -> int:
        return min(self.recent, budget) if self.recent else int(budget * self.recent_ratio)

    def protected(self, rows: CacheRows, budget: int) -> torch.Tensor | None:
        return protected_window(rows, self.local_window(budget))

    def keeps(self, budget: int) -> int:
        return budget + 1 - self.dropped(budget)
