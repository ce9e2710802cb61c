"""Policy base classes, `param()` and the registry (kvpress style: a policy is one small file).

A policy is a frozen dataclass registered with `@register`. Its fields are hyperparameters
declared with `param()` (default, help text, bounds, choices), validated here once for all
policies; its capabilities are class attributes (`budget_free`, `merges`, `needs_attention`).
It holds no run state: what changes during a run lives in the `LayerCache` it is handed
(`layer.extra` per slot, `layer.state` per layer), so one instance serves any number of runs
and threads with identical decisions. Policies never record or plot: they report what they did
to the `DecisionLog` they are given.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar

import torch

from kvlens.engine.cache import LayerCache
from kvlens.errors import KvlensError
from kvlens.params import Param, check_budget
from kvlens.runs.decisions import DecisionLog

REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: add a policy to `REGISTRY` under its `name`."""
    if not cls.name or (cls.name in REGISTRY and REGISTRY[cls.name].__qualname__ != cls.__qualname__):
        raise TypeError(f"policy class {cls.__qualname__} needs a unique `name`; got {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls


def param(default, help: str, *, minimum: float | None = None, maximum: float | None = None,
          choices: tuple | Callable[[], tuple] | None = None):
    """A hyperparameter: a dataclass field declaring its `kvlens.params.Param` (help, bounds, choices).

    `choices` may be a callable (resolved when validating), e.g. the registered names of a kind.
    A field whose default is a policy instance is a nested policy (CaM's `base`), set as
    `base=NAME` and `base.PARAM=VALUE`.
    """
    meta = {"help": help, "minimum": minimum, "maximum": maximum, "choices": choices}
    return field(default=default, metadata={"param": meta})


def check(condition: bool, message: str) -> None:
    """Raise the one-sentence error of a bad combination of parameters."""
    if not condition:
        raise KvlensError(message)


@dataclass(frozen=True)
class Policy:
    """Base of all policies. Subclasses are `@register`-ed frozen dataclasses of `param()` fields."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    needs_attention: ClassVar[bool] = True  # needs attention rows at decode steps
    budget_free: ClassVar[bool] = False  # decides its own size (reports the size it reached)
    merges: ClassVar[bool] = False  # merges evicted entries into kept ones (Merges page, provenance)
    cross_layer: ClassVar[bool] = False  # its one-eviction decode step may run on all layers at once (`LayerStack`)
    presets: ClassVar[dict[str, dict]] = {}  # named settings, `preset=NAME` (explicit parameters override)

    def __post_init__(self):
        for p in self.declared():
            object.__setattr__(self, p.name, p.check(getattr(self, p.name), owner=self.name))
        self.validate()

    @classmethod
    def declared(cls) -> list[Param]:
        """The policy's parameters as declared by its `param()` fields."""
        out = []
        for f in fields(cls):
            default = f.default if f.default is not MISSING else f.default_factory()
            kind = "policy" if isinstance(default, Policy) else ""
            out.append(Param(f.name, default, kind=kind, **f.metadata["param"]))
        return out

    def validate(self) -> None:
        """Checks across several parameters (single fields are checked from their `param()`)."""

    def params(self) -> dict:
        """Resolved parameters, nested policies flattened as `base` + `base.PARAM`."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Policy):
                out[f.name] = value.name
                out.update({f"{f.name}.{k}": v for k, v in value.params().items()})
            else:
                out[f.name] = value
        return out

    def prefill_rows(self) -> int:
        """How many of the last prefill attention rows `observe_prefill` needs."""
        return 1 if self.needs_attention else 0

    def prefill_column_sums(self) -> bool:
        """Whether it reads the prompt's accumulated attention `layer.abar` (a chunked T x T pass)."""
        return self.needs_attention

    def min_budget(self) -> int:
        """Slots the policy always protects; a smaller budget is refused."""
        return 1

    def resolve_budget(self, budget: int | float | None, prompt_len: int, total_len: int) -> int | None:
        """Budget as slots per KV head per layer: an int is slots, a float in (0, 1] a share of the prompt."""
        if self.budget_free:
            return None
        check(budget is not None, f"Policy {self.name} needs a --budget (slots, or a share of the prompt in (0, 1]).")
        budget = check_budget(budget)
        return self.check_slots(max(1, round(budget * prompt_len)) if isinstance(budget, float) else budget, total_len)

    def check_slots(self, slots: int, total_len: int | None = None) -> int:
        """`slots` if the policy can compress to it (and, given `total_len`, would ever compress)."""
        check(slots >= self.min_budget(),
              f"Budget {slots} is below the {self.min_budget()} slots that {self.name} always keeps.")
        check(total_len is None or slots < total_len,
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


@dataclass(frozen=True)
class ScoredEviction(Policy):
    """Evicts the lowest-scoring unprotected slots until `budget` remain (all heads keep `budget`).

    Any scored eviction policy can be CaM's base: it also says which kept slots are its local
    (recent) window, `local_window(budget)`.
    """

    def score(self, layer: LayerCache) -> torch.Tensor:
        """`(Hkv, S)` keep-scores: higher is kept."""
        raise NotImplementedError

    def protected(self, layer: LayerCache, budget: int) -> torch.Tensor | None:
        """`(Hkv, S)` bool of slots that must stay, or None."""
        return None

    def local_window(self, budget: int) -> int:
        """How many of the newest kept slots form the policy's local window (all of them by default)."""
        return budget

    def compress(self, layer: LayerCache, budget: int | None, log: DecisionLog | None) -> None:
        if budget is None or layer.n_kept <= budget:
            return
        if layer.one_to_evict(budget):
            evicted = self.lowest(layer, budget)
        else:
            _, evicted = self.select(layer, budget)
        if log is not None:
            log_evictions(log, layer, torch.gather(layer.pos, 1, evicted))
        layer.free(evicted)

    def lowest(self, layer: LayerCache, budget: int) -> torch.Tensor:
        """`(Hkv, 1)` the slot `select` would evict when exactly one must go (no sort): the lowest
        score, and among equal lowest scores the newest position. The cache has no free slot."""
        score = self.score(layer).float()
        protected = self.protected(layer, budget)
        if protected is not None:
            score = score.masked_fill(protected, float("inf"))
        low = score == score.min(-1, keepdim=True).values
        return torch.where(low, layer.pos, -1).argmax(-1, keepdim=True)

    def select(self, layer: LayerCache, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots to keep `(Hkv, budget)` and to evict `(Hkv, n_kept - budget)`, each in position order.

        Highest score first; among equal scores the older position stays. Free slots never count.
        """
        score = self.score(layer).float().masked_fill(~layer.valid, float("-inf"))
        protected = self.protected(layer, budget)
        if protected is not None:
            score = score.masked_fill(protected & layer.valid, float("inf"))
        by_pos = layer.position_order()
        order = by_pos.gather(1, torch.argsort(score.gather(1, by_pos), dim=-1, descending=True, stable=True))
        keep, evicted = order[:, :budget], order[:, budget:layer.n_kept]
        return by_position(layer, keep), by_position(layer, evicted)


def log_evictions(log: DecisionLog, layer: LayerCache, positions: torch.Tensor) -> None:
    """Log evicted `positions` `(Hkv, n)` (-1 = none) of a layer or of a `LayerStack`'s layers."""
    for index, rows in layer.split(positions):
        log.evict(index, rows)


def scored_eviction_names() -> tuple[str, ...]:
    """Registered policies that can be a merging policy's base."""
    return tuple(n for n, c in REGISTRY.items() if issubclass(c, ScoredEviction))


def by_position(layer: LayerCache, slots: torch.Tensor) -> torch.Tensor:
    """Valid `slots` `(Hkv, n)` reordered so that their positions ascend."""
    return slots.gather(1, layer.pos.gather(1, slots).argsort(-1))


def recent_mask(layer: LayerCache, recent: int) -> torch.Tensor:
    """`(Hkv, S)` True for each head's `recent` valid slots with the newest positions."""
    if recent <= 0:
        return torch.zeros(layer.pos.shape, dtype=torch.bool, device=layer.pos.device)
    return layer.valid & (layer.pos >= newest_cut(layer.pos, layer.valid, recent))


def newest_cut(pos: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """`(Hkv, 1)` a cut such that `mask & (pos >= cut)` are each head's k newest slots of `mask`
    (all of them when it has fewer). Positions are distinct within a head.

    Windows that a policy protects hold consecutive positions, so the cut is tried as the newest
    position minus k - 1 and checked by counting (O(S)); a sort (`topk`) only when the check fails.
    """
    masked = pos.masked_fill(~mask, -1)
    guess = masked.max(-1, keepdim=True).values - (k - 1)
    if bool(((masked >= guess).sum(-1) == k).all()):
        return guess
    return masked.topk(min(k, pos.shape[1]), dim=-1).values[:, -1:]


def group_mean(probs: torch.Tensor) -> torch.Tensor:
    """A KV head's attention is the mean of its query heads': `(Hkv, G, ...)` -> `(Hkv, ...)`."""
    return probs.mean(1)

