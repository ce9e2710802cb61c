"""Policy base classes (kvpress style: a two-level base, scorers only write `score()`).

A policy sees one layer's `LayerCache` at a time. It may keep per-slot statistics in
`layer.extra` (`observe`, `observe_prefill`), and `compress` shrinks the layer to the budget.
Policies never record or plot: they report what they did to the `DecisionLog` they are given.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from kvlens.cache import LayerCache
from kvlens.decisions import DecisionLog
from kvlens.errors import KvlensError


def check(condition: bool, message: str) -> None:
    """Raise the one-sentence error of a bad parameter."""
    if not condition:
        raise KvlensError(message)


def check_int(name: str, value, minimum: int) -> None:
    """An integer parameter of at least `minimum`."""
    check(isinstance(value, int) and value >= minimum, f"{name} must be an integer >= {minimum}; got {value!r}.")


def check_share(name: str, value) -> None:
    """A share (ratio) parameter in [0, 1]."""
    check(isinstance(value, (int, float)) and 0 <= value <= 1, f"{name} must be in [0, 1]; got {value!r}.")


@dataclass
class Policy:
    """Base of all policies. Fields are hyperparameters with defaults, validated in `__post_init__`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    needs_attention: ClassVar[bool] = True  # needs attention rows at decode steps
    budget_free: ClassVar[bool] = False  # decides its own size (reports the budget it reached)

    def params(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def prefill_rows(self) -> int:
        """How many of the last prefill attention rows `observe_prefill` needs."""
        return 1 if self.needs_attention else 0

    def min_budget(self) -> int:
        """Slots the policy always protects; a smaller budget is refused."""
        return 1

    def resolve_budget(self, budget: int | float | None, prompt_len: int, total_len: int) -> int | None:
        """Budget as slots per KV head per layer: an int is slots, a float in (0, 1] a share of the prompt."""
        if self.budget_free:
            return None
        check(budget is not None, f"Policy {self.name} needs a --budget (slots, or a share of the prompt in (0, 1]).")
        if isinstance(budget, float):
            check(0 < budget <= 1, f"A fractional budget must be in (0, 1]; got {budget}.")
            slots = max(1, round(budget * prompt_len))
        else:
            check(budget > 0, f"The budget must be a positive number of slots; got {budget}.")
            slots = int(budget)
        check(slots >= self.min_budget(),
              f"Budget {slots} is below the {self.min_budget()} slots that {self.name} always keeps.")
        check(slots < total_len,
              f"Budget {slots} is not below the sequence length {total_len}, so {self.name} would never "
              f"compress; use a smaller budget or the full policy.")
        return slots

    def observe_prefill(self, layer: LayerCache, rows: torch.Tensor) -> None:
        """Initialise statistics from the last prefill rows `(Hq, L, T)` (`abar`, `nobs` are already set)."""

    def observe(self, layer: LayerCache, probs: torch.Tensor) -> None:
        """Update statistics after a decode step's attention `probs` `(Hkv, G, S)`."""

    def compress(self, layer: LayerCache, budget: int | None, log: DecisionLog | None) -> None:
        """Shrink the layer to `budget` slots per KV head."""
        raise NotImplementedError


@dataclass
class ScoredEviction(Policy):
    """Evicts the lowest-scoring unprotected slots until `budget` remain (all heads keep `budget`)."""

    def score(self, layer: LayerCache) -> torch.Tensor:
        """`(Hkv, S)` keep-scores: higher is kept."""
        raise NotImplementedError

    def protected(self, layer: LayerCache, budget: int) -> torch.Tensor | None:
        """`(Hkv, S)` bool of slots that must stay, or None."""
        return None

    def compress(self, layer: LayerCache, budget: int | None, log: DecisionLog | None) -> None:
        if budget is None or layer.n_slots <= budget:
            return
        keep, evicted = self.select(layer, budget)
        if log is not None:
            log.evict(layer.layer, torch.gather(layer.pos, 1, evicted))
        layer.keep(keep)

    def select(self, layer: LayerCache, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices to keep `(Hkv, budget)` and to evict `(Hkv, S - budget)`, each ascending."""
        score = self.score(layer).float().clone()
        protected = self.protected(layer, budget)
        if protected is not None:
            score[protected] = float("inf")
        order = torch.argsort(score, dim=-1, descending=True, stable=True)
        keep = order[:, :budget].sort(-1).values
        evicted = order[:, budget:].sort(-1).values
        return keep, evicted


def recent_mask(layer: LayerCache, recent: int) -> torch.Tensor:
    """`(Hkv, S)` True for each head's `recent` newest slots (slots are kept in arrival order)."""
    s = layer.n_slots
    mask = torch.zeros(layer.pos.shape, dtype=torch.bool, device=layer.pos.device)
    if recent > 0:
        mask[:, max(0, s - recent):] = True
    return mask


def group_mean(probs: torch.Tensor) -> torch.Tensor:
    """A KV head's attention is the mean of its query heads': `(Hkv, G, ...)` -> `(Hkv, ...)`."""
    return probs.mean(1)
