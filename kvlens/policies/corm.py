"""`corm`: budget-free eviction by recent query messages.

Dai et al., "CORM: Cache Optimization with Recent Message for Large Language Model Inference",
2024, https://arxiv.org/abs/2404.15949 (Algorithm 1, Section 5.3 for GQA). Each query step
leaves a message `1[A_t[j] >= 1/t]` per key; with a window of the last `w` messages, a key
minor in all of them is dropped, except the `r` most recent. Under GQA a key is minor only if
minor for every query head of its group. Nothing happens until `w` messages exist (the last
prefill rows count as messages). Heads keep different counts: a dropped key's slot is freed in
place (`valid=False`) and later tokens fill it, so kept entries and allocated bytes both get reported.

`important="position"` (default) uses the paper's `1/t`, t the number of tokens seen so far;
`important="slots"` uses `1/n_slots` (the keys actually attended).
Paper defaults are w = r = 256 for 4k contexts; the defaults here (32, 32) scale that to the
few-hundred-token prompts this workbench runs on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.kvcache import CacheRows, Prompt, Step
from kvlens.policies.base import Needs, Policy, free_logged, param, protected_window, register

# (Hkv, S) int32: the number of messages seen when the slot was last important (0: never); it says whether the
# slot was important in any of the last w messages without keeping them
MESSAGE = "corm_last_important"
MESSAGES_SEEN = "corm_messages_seen"  # per layer: query messages observed so far in this run


@register
@dataclass(frozen=True)
class CORM(Policy):
    window: int = param(
        32,
        "w: the number of recent query messages a key must be minor in to be dropped "
        "(paper: 256 for 4k contexts).",
        minimum=1,
    )
    recent: int = param(
        32, "r: the newest slots that are never dropped (paper: 256 for 4k contexts).", minimum=0
    )
    important: str = param(
        "position",
        "Importance threshold: 1/t with t the tokens seen (position, the paper) "
        "or 1/n_slots, the keys actually attended (slots).",
        choices=("position", "slots"),
    )

    name = "corm"
    description = (
        "Budget-free: drop keys minor for all of the last `window` queries (GQA: every head of the group)."
    )
    paper = "https://arxiv.org/abs/2404.15949"

    def needs(self) -> Needs:
        return Needs(prefill_rows=self.window, column_sums=False, budget_free=True)  # the last prefill rows

    def observe_prefill(self, rows: CacheRows, prompt: Prompt) -> None:
        last = prompt.last  # (Hq, L, T)
        r, t = rows.pos.shape
        hq, length, _ = last.shape
        seen = torch.arange(
            t - length + 1, t + 1, device=last.device, dtype=torch.float32
        )  # query i sees i+1 keys
        important = (last >= (1.0 / seen)[None, :, None]).view(r, hq // r, length, t).any(1)  # (R, L, T)
        count = torch.arange(1, length + 1, device=last.device, dtype=torch.int32)  # message i's number
        rows.extra[MESSAGE] = (important * count[None, :, None]).amax(1)  # its latest important message
        rows.state[MESSAGES_SEEN] = length

    def observe(self, rows: CacheRows, probs: torch.Tensor) -> None:
        t: float | torch.Tensor
        if self.important == "position":
            t = float(rows.pos.max()) + 1
        else:
            t = rows.valid.sum(-1, keepdim=True)[:, None].float()  # (R, 1, 1)
        important = (probs.amax(1) >= 1.0 / t) & rows.valid  # (R, S): any query head of the group
        rows.state[MESSAGES_SEEN] = rows.state.get(MESSAGES_SEEN, 0) + 1
        rows.extra[MESSAGE].masked_fill_(important, self._seen(rows))  # a view of the store's rows: in place

    def _seen(self, rows: CacheRows) -> int:
        """The layer's messages seen so far."""
        seen: int = rows.state.get(MESSAGES_SEEN, 0)
        return seen

    def compress(self, rows: CacheRows, step: Step) -> None:
        """Free, in place, each head's keys minor in all of the last `window` messages and older than the
        `recent` newest positions (later tokens fill the freed slots: no re-layout of the layer at each
        step)."""
        if self._seen(rows) < self.window:
            return
        minor = rows.extra[MESSAGE] <= self._seen(rows) - self.window  # not important in the last w messages
        drop = minor & rows.valid & ~protected_window(rows, self.recent)  # (R, S): nor among the r newest
        if bool(drop.any()):
            free_logged(step, rows, drop)  # marked: freed where they lie
