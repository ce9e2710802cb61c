"""Policy base classes, `param()` and the registry (kvpress style: a policy is one small file).

A policy is a frozen dataclass registered with `@register`. Its fields are hyperparameters
declared with `param()` (default, help text, bounds, choices), validated here once for all
policies; what the engine prepares for an instance and what the instance is capable of (`competes`,
`budget_free`, `min_budget`) is one declaration, `needs()`; class attributes say only what no parameter
changes (`merge_rule`, ...). It holds no run state: what changes during a run lives in the `CacheRows` it is
handed (`rows.extra` per slot, `rows.state` per layer), so one instance serves any number of runs and threads
with identical decisions.

One shape. Every hook takes one layer's `CacheRows` `(Hkv, S)` (`kvlens.kvcache.contract`). `competes` says
how a selection competes: within each KV head (`head`), across the heads of a layer (`layer`: Ada-KV, KVzip's
decoding), or across every layer and head (`model`: the budgets of KVzip, PyramidKV and D2O, decided in
`allocate`, which sees every layer). Where a `ScoredEviction` selects per head at decode steps, the engine may
stack the layers' scores and run one selection and one free for all of them (`kvlens.engine.batching`); the
policy's code is the same either way. `compress` is told its `Step` (index, phase, budget, decision log)
explicitly. Policies never record or plot: they report what they did to the step's `DecisionLog`.

Surface. Six hooks carry every policy's rule: `needs` (what the engine prepares and what the instance can
do), `validate` (checks across parameters), `allocate` (the layers' budgets), `observe_prefill`, `observe`
(statistics) and `compress`. Two optional capabilities each serve one method, as mixins the engine looks for:
`Replays` (KVzip: forward passes the engine feeds after the prompt, whose queries exist nowhere else) and
`PrunesKeys` (ThinK: a storage layout of the compressed prompt's keys, applied after every layer's compression
and before quantization). Class attributes: `merge_rule` (set: the policy merges), `chunked_prefill` and
`presets` (named parameter settings), metadata like `name` and `paper`. Budgets are resolved by
`resolve_budget` and `check_slots` from `Needs.min_budget`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal, final

import torch

from kvlens.errors import KvlensError
from kvlens.kvcache import CacheRows, Prompt, Replay, Step, padded_slots, without
from kvlens.params import Param, check_budget

REGISTRY: dict[str, type[Policy]] = {}

Competes = Literal["head", "layer", "model"]  # what a policy's selection competes over (`Policy.competes`)


@dataclass(frozen=True)
class Needs:
    """What the engine prepares for a policy's run (`Policy.needs`)."""

    decode_rows: bool = True  # attention rows `(R, G, S)` at decode steps (`observe`, `rows.last_attn`)
    prefill_rows: int = 1  # the last prefill attention rows `observe_prefill` reads (`prompt.last`)
    # the accumulated attention `rows.abar` and `rows.nobs`: the prompt's (a chunked T x T pass), then each
    # decode step's; False: neither is kept (both stay zero)
    column_sums: bool = True
    model_data: tuple[str, ...] = ()  # per-layer data of the model put in the run state (`MODEL_DATA` names)
    # compresses at decode steps; False (the decode protocol of SnapKV's and KVzip's papers): the prompt only,
    # after which the engine neither calls the policy nor computes attention rows for it, and the cache grows
    decode_steps: bool = True
    pruned_keys: bool = False  # keys stored channel-pruned after the prompt's compression (`key_channels`)
    tokenizer: bool = False  # the model's tokenizer (a reconstruction prompt, calibration texts)
    # the state entering each attention layer, `(q, d_model)` of the latest forward, in the run state
    # (`kvlens.engine.hidden.HIDDEN`): KVzap's surrogate input, KVzip+'s normaliser
    hidden_states: bool = False
    # what its selection competes over: each KV head keeps the budget (`head`), a layer's heads share the
    # layer's (`layer`), or layers and heads share the model's (`model`); beyond `head`, counts differ
    competes: Competes = "head"
    budget_free: bool = False  # decides its own size (reports the size it reached); no budget is asked
    min_budget: int = (
        1  # the slots per KV head it always protects (sinks, windows); a smaller budget is refused
    )


NO_ATTENTION = Needs(decode_rows=False, prefill_rows=0, column_sums=False)  # scores without attention


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: add a policy to `REGISTRY` under its `name`."""
    if not cls.name or (cls.name in REGISTRY and REGISTRY[cls.name].__qualname__ != cls.__qualname__):
        raise TypeError(f"policy class {cls.__qualname__} needs a unique `name`; got {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls


def param(
    default: Any,
    help: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[Any, ...] | Callable[[], tuple[Any, ...]] | None = None,
) -> Any:
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
    kvpress: ClassVar[str] = ""  # the NVIDIA kvpress press implementing the same method, if any
    kvpress_differs: ClassVar[str] = ""  # where kvlens differs from that press on purpose
    # set when it merges evicted entries into kept ones (Merges page, provenance): how provenance replays
    # its merges, "add", "convex" or "set"
    merge_rule: ClassVar[str | None] = None
    chunked_prefill: ClassVar[bool] = False  # can compress the prompt chunk by chunk (`--prefill-chunk`)
    # named settings, `preset=NAME` (explicit parameters override)
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    def __post_init__(self) -> None:
        for p in self.declared():
            object.__setattr__(self, p.name, p.check(getattr(self, p.name), owner=self.name))
        self.validate()

    @classmethod
    def declared(cls) -> list[Param]:
        """The policy's parameters as declared by its `param()` fields."""
        out = []
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default
            kind = "policy" if isinstance(default, Policy) else ""
            out.append(Param(f.name, default, kind=kind, **f.metadata["param"]))
        return out

    def validate(self) -> None:
        """Checks across several parameters, at construction (single fields are checked from their `param()`).

        Raises:
            KvlensError: one sentence naming the bad combination (`check`)."""

    @final
    def params(self) -> dict[str, Any]:
        """Resolved parameters, nested policies flattened as `base` + `base.PARAM`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Policy):
                out[f.name] = value.name
                out.update({f"{f.name}.{k}": v for k, v in value.params().items()})
            else:
                out[f.name] = value
        return out

    def needs(self) -> Needs:
        """What the engine prepares for a run of this instance and what it can do, asked once per run.

        Returns:
            Needs: attention rows, the prompt's statistics, model data, channel-pruned keys, whether it
                compresses at decode steps, what its selection competes over, whether it is budget-free and
                its least budget (default: attention rows at decode steps, the last prefill row and the column
                sums, per-head selection under a budget of at least 1)."""
        return Needs()

    @property
    def competes(self) -> Competes:
        """What this instance's selection competes over (`Needs.competes`)."""
        return self.needs().competes

    @property
    def budget_free(self) -> bool:
        """Whether this instance decides its own size (`Needs.budget_free`)."""
        return self.needs().budget_free

    def allocate(self, budget: int, layers: Sequence[CacheRows]) -> list[int]:
        """Each layer's budget, decided once the prompt is prefilled, before its compression; the only hook
        that sees every layer, one `CacheRows` each.

        Args:
            budget: the run's budget, slots per KV head.
            layers: each layer's rows `(Hkv, T)`, with the prompt's statistics.

        Returns:
            list[int]: one budget per layer, the same `budget` everywhere unless the selection competes across
                layers (PyramidKV, D2O, KVzip); an allocation keeps the total, `budget` x layers."""
        return [budget] * len(layers)

    def observe_prefill(self, rows: CacheRows, prompt: Prompt) -> None:
        """Initialise statistics from one layer's prompt; writes into `rows.extra` and `rows.state`.

        Args:
            rows: the layer's rows `(Hkv, T)`, their `abar` and `nobs` already set.
            prompt: its last attention rows `prompt.last` `(Hq, L, T)`, queries `(Hq, T, D)` and positions
                `(T,)`."""

    def observe(self, rows: CacheRows, probs: torch.Tensor) -> None:
        """Update statistics after a decode step's attention, before `compress`.

        Args:
            rows: the layer's rows `(Hkv, S)`.
            probs: `(Hkv, G, S)` each query head's weights over the slots, as the layer attended."""

    def compress(self, rows: CacheRows, step: Step) -> None:
        """Shrink the layer's rows through `rows.free` / `rows.retain`, logging to `step.log`.

        Args:
            rows: the layer's rows `(Hkv, S)`.
            step: the compression's index, phase, budget (slots per KV head, in total over the heads or layers
                it competes across; None when budget-free) and decision log."""
        raise NotImplementedError


class Replays(abc.ABC):
    """A policy that reads forward passes fed after the prompt, before its compression (KVzip's
    reconstruction): the engine feeds `replay_passes` and hands each layer's attention to `observe_replay`."""

    @abc.abstractmethod
    def replay_passes(self, tokenizer: Any, prompt: list[int]) -> list[tuple[int, int, list[int]]]:
        """The passes the engine feeds after the prompt; their keys are never cached.

        Args:
            tokenizer: the model's.
            prompt: the prompt's token ids.

        Returns:
            list: each pass `(start, end, ids)`, `ids` reconstructing the prompt's positions start..end-1."""

    @abc.abstractmethod
    def observe_replay(self, rows: CacheRows, replay: Replay) -> None:
        """Read one replay pass of one layer.

        Args:
            rows: the layer's rows `(Hkv, T)`, the uncompressed prompt.
            replay: the pass's queries `(Hq, q, D)` over the prompt's slots, its own keys `(Hkv, q, D)` and
                log-normalisers `(Hq, q)`."""


class PrunesKeys(abc.ABC):
    """A policy that stores the compressed prompt's keys channel-pruned (ThinK, `Needs.pruned_keys`)."""

    @abc.abstractmethod
    def key_channels(self, rows: CacheRows) -> tuple[torch.Tensor, torch.Tensor]:
        """The layout of one layer's compressed prompt keys, after every layer's compression.

        Args:
            rows: the layer's compressed rows `(Hkv, S)`.

        Returns:
            tuple: the key channels each row keeps `(Hkv, K)`, ascending, and the slots that keep every
                channel `(Hkv, S)` bool (`kvlens.kvcache.channels`)."""


def resolve_budget(
    policy: Policy, budget: int | float | None, prompt_len: int, total_len: int | None
) -> int | None:
    """`policy`'s budget as slots per KV head per layer: an int is slots, a float in (0, 1] a share of the
    prompt; None for a budget-free policy. `total_len`: the run's length, if known (a budget not below it is
    refused)."""
    if policy.budget_free:
        return None
    check(
        budget is not None,
        f"Policy {policy.name} needs a --budget (slots, or a share of the prompt in (0, 1]).",
    )
    budget = check_budget(budget)
    return check_slots(
        policy, max(1, round(budget * prompt_len)) if isinstance(budget, float) else budget, total_len
    )


def check_slots(policy: Policy, slots: int, total_len: int | None = None) -> int:
    """`slots` if `policy` can compress to it (and, given `total_len`, would ever compress)."""
    check(
        slots >= policy.needs().min_budget,
        f"Budget {slots} is below the {policy.needs().min_budget} slots that {policy.name} always keeps.",
    )
    check(
        total_len is None or slots < total_len,
        f"Budget {slots} is not below the sequence length {total_len}, so {policy.name} would never "
        f"compress; use a smaller budget or the full policy.",
    )
    return slots


@dataclass(frozen=True)
class ScoredEviction(Policy):
    """Evicts the lowest-scoring unprotected slots until `budget` remain (all heads keep `budget`).

    Any scored eviction policy can be CaM's base: it also says which kept slots are its local
    (recent) window, `local_window(budget)`.
    """

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        """Keep-scores of the layer's slots: higher is kept.

        Args:
            rows: the layer's rows `(Hkv, S)`.
            step: the compression (its phase tells the prompt's from a decode step's; its budget is `keeps`').

        Returns:
            Tensor: `(Hkv, S)` scores."""
        raise NotImplementedError

    def protected(self, rows: CacheRows, budget: int) -> torch.Tensor | None:
        """Slots that must stay.

        Args:
            rows: the layer's rows `(Hkv, S)`.
            budget: the slots each row keeps.

        Returns:
            Tensor | None: `(Hkv, S)` bool, or None when nothing is protected."""
        return None

    # among equal scores the older slot leaves first (WeightedKV's argmin), not the newer
    older_leaves_first: ClassVar[bool] = False

    def local_window(self, budget: int) -> int:
        """How many of the newest kept slots form the policy's local window (all of them by default)."""
        return budget

    def keeps(self, budget: int) -> int:
        """The slots each row keeps when rows over `budget` are compressed (`budget`; fewer for a policy that
        drops several at once, Scissorhands)."""
        return budget

    def no_selection(self, rows: CacheRows, step: Step) -> None:
        """A compression at which nothing is selected: the run is budget-free or the rows hold at most the
        budget. Nothing by default (KVzap scores the step's token, or drops by its threshold)."""

    @final
    def compress(self, rows: CacheRows, step: Step) -> None:
        """Rows over the budget keep `keeps(budget)` slots: `select` on `score` and `protected`, then `free`;
        else `no_selection`. Final: the engine runs the same selection on every layer's rows at once."""
        if step.budget is None or rows.n_kept <= step.budget:
            self.no_selection(rows, step)
            return
        _, evicted = self.select(rows, dataclasses.replace(step, budget=self.keeps(step.budget)))
        log_evictions(step, rows, rows.pos.gather(1, evicted))
        rows.free(evicted)

    def select(self, rows: CacheRows, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots to keep `(R, budget)` and to evict `(R, n_kept - budget)` at `step`, each in position order
        (`select_lowest` on this policy's score and protection)."""
        if step.budget is None:
            raise ValueError("kvlens: a scored eviction selects at a step with a budget")
        score, protected = self.score(rows, step), self.protected(rows, step.budget)
        return select_lowest(rows, score, protected, step.budget, self.older_leaves_first)


@dataclass(frozen=True)
class Wrapper(Policy):
    """A policy built on a scored eviction policy `base` (CaM, PyramidKV, Ada-KV): the base's statistics and
    needs unless it says otherwise. A subclass declares the `base` field with its default and help."""

    if TYPE_CHECKING:
        base: Policy  # the subclass's field (declared there: it keeps its place among the parameters)

    def needs(self) -> Needs:
        return self.base.needs()

    def observe_prefill(self, rows: CacheRows, prompt: Prompt) -> None:
        self.base.observe_prefill(rows, prompt)

    def observe(self, rows: CacheRows, probs: torch.Tensor) -> None:
        self.base.observe(rows, probs)


class MergesEvicted(Policy):
    """A policy whose `selector`, a scored eviction, chooses what leaves, and which merges the leaving slots'
    values into kept ones first (CaM, WeightedKV). Its `compress` is final: the selector's selection,
    `merge_evicted`, then `free`, so the engine may run the selection and the free on every layer's rows at
    once and `merge_evicted` layer by layer (`kvlens.engine.batching`)."""

    @property
    @abc.abstractmethod
    def selector(self) -> ScoredEviction:
        """The scored eviction whose selection (`select`) chooses the leaving slots."""

    @final
    def compress(self, rows: CacheRows, step: Step) -> None:
        if step.budget is None or rows.n_kept <= step.budget:
            return
        keep, evicted = self.selector.select(rows, step)
        self.merge_evicted(rows, keep, evicted, step)
        rows.free(evicted)

    @abc.abstractmethod
    def merge_evicted(self, rows: CacheRows, keep: torch.Tensor, evicted: torch.Tensor, step: Step) -> None:
        """Merge the leaving slots' values into kept slots, in place, and log each decision; they are freed
        after.

        Args:
            rows: the layer's rows `(Hkv, S)`.
            keep: `(Hkv, B)` the kept slots, in position order (B = `step.budget`).
            evicted: `(Hkv, E)` the leaving slots, in position order.
            step: the compression."""

    def merge_evicted_layers(
        self,
        layers: Sequence[CacheRows],
        everywhere: CacheRows,
        keep: torch.Tensor,
        evicted: torch.Tensor,
        step: Step,
    ) -> None:
        """`merge_evicted` on each of `layers`, one-layer views of the store that `everywhere` views whole,
        given every layer's `keep` and `evicted` stacked `(L * Hkv, .)` (the engine's all-layer eviction,
        `kvlens.engine.batching`): layer by layer, unless the policy merges every layer's rows at once."""
        n = len(layers)
        for rows, kept, leaving in zip(layers, keep.chunk(n), evicted.chunk(n), strict=True):
            self.merge_evicted(rows, kept, leaving, step)


def select_lowest(
    rows: CacheRows,
    score: torch.Tensor,
    protected: torch.Tensor | None,
    budget: int,
    older_leaves_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection rule of every scored eviction: keep the `budget` highest scores of each row, the
    protected slots first; among equal scores the older position stays (the newer with `older_leaves_first`).
    Returns the kept `(R, budget)` and the evicted `(R, n_kept - budget)` slots, each in position order. Free
    slots never count. `rows` are one layer's, or every layer's stacked by the engine
    (`kvlens.engine.batching`).

    When exactly one slot per row leaves (a decode step), the lowest score is found without a sort: the
    newest (oldest) position among the lowest; otherwise a stable sort by score over the position order
    (reversed).
    """
    s, one = _ranking_scores(rows, score, protected, budget)
    if one:
        last = _lowest_one(rows, s, older_leaves_first)
        return without(rows.position_order(), last)[:, :-1], last  # every slot but `last`, in position order
    return _sorted_selection(rows, s, budget, older_leaves_first)


def evicted_lowest(
    rows: CacheRows,
    score: torch.Tensor,
    protected: torch.Tensor | None,
    budget: int,
    older_leaves_first: bool = False,
) -> torch.Tensor:
    """`select_lowest`'s evicted slots alone `(R, n_kept - budget)`: a decode step's one slot per row is found
    without ordering the kept ones (the engine's all-layer eviction, which frees them)."""
    s, one = _ranking_scores(rows, score, protected, budget)
    if one:
        return _lowest_one(rows, s, older_leaves_first)
    return _sorted_selection(rows, s, budget, older_leaves_first)[1]


def _sorted_selection(
    rows: CacheRows, s: torch.Tensor, budget: int, older_leaves_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept `(R, budget)` and evicted slots of the ranking scores `s` `(R, S)`, each in position order: a
    stable sort by score over the position order (reversed with `older_leaves_first`)."""
    order = rows.position_order()  # (R, S): the positions' order, kept in step by the cache
    s = s.gather(1, order)  # by position
    if older_leaves_first:  # among equal scores the newer comes first: a stable sort of the reversed order
        rank = s.shape[1] - 1 - torch.argsort(s.flip(-1), dim=-1, descending=True, stable=True)
    else:
        rank = torch.argsort(s, dim=-1, descending=True, stable=True)
    keep, evicted = rank[:, :budget].sort(-1).values, rank[:, budget : rows.n_kept].sort(-1).values
    return order.gather(1, keep), order.gather(1, evicted)


def _ranking_scores(
    rows: CacheRows, score: torch.Tensor, protected: torch.Tensor | None, budget: int
) -> tuple[torch.Tensor, bool]:
    """`(R, S)` float scores in slot order as the selection ranks them (free slots -inf, protected ones +inf),
    and whether exactly one slot per row leaves, none free (a decode step)."""
    valid = rows.valid
    full = bool(valid.all())  # no slot is free
    s = score.float()
    if not full:
        s = s.masked_fill(~valid, float("-inf"))
    if protected is not None:
        s = torch.where(protected if full else protected & valid, float("inf"), s)
    return s, full and rows.n_kept == budget + 1 == s.shape[1]


def _lowest_one(rows: CacheRows, s: torch.Tensor, older_leaves_first: bool) -> torch.Tensor:
    """`(R, 1)` each row's slot of lowest score `s` `(R, S)`: the newest position among equal lowest ones (the
    oldest with `older_leaves_first`)."""
    lowest = s == s.min(-1, keepdim=True).values
    if older_leaves_first:
        return rows.pos.masked_fill(~lowest, torch.iinfo(rows.pos.dtype).max).argmin(-1, keepdim=True)
    return rows.pos.masked_fill(~lowest, -1).argmax(-1, keepdim=True)


def lowest_of_all_rows(rows: CacheRows, score: torch.Tensor, leaving: int) -> torch.Tensor:
    """The `leaving` lowest scores over all the rows together (heads then keep different counts), for
    policies that share a budget across heads (Ada-KV, KVzip): ties leave the newest position first, then
    the lower row; free slots never count. Returns each row's leaving slots `(R, E)`, ascending, -1 padded
    (for `free`).

    The cut is the `leaving`-th lowest score (`kthvalue`, linear time): every lower score leaves, and of the
    scores equal to it, the newest positions (then the lower rows) fill what is left, so no sort runs over the
    rows' R x S slots, only over those ties."""
    valid = rows.valid
    r, s = valid.shape
    if leaving <= 0:
        return padded_slots(torch.zeros_like(valid))
    flat = score.float().masked_fill(~valid, float("inf")).flatten()
    cut = flat.kthvalue(min(leaving, r * s)).values
    gone = flat < cut
    ties = (flat == cut).nonzero()[:, 0]  # ascending: lower rows first
    newest = ties[torch.argsort(-rows.pos.flatten()[ties], stable=True)]
    gone[newest[: leaving - int(gone.sum())]] = True
    return padded_slots(gone.view(r, s))


def free_logged(step: Step, rows: CacheRows, slots: torch.Tensor) -> None:
    """Evict `slots` `(R, E)` (-1 pads), or those marked `(R, S)` bool, and log their positions (when the run
    keeps a log)."""
    if step.log is not None:
        index = padded_slots(slots) if slots.dtype == torch.bool else slots
        log_evictions(step, rows, rows.pos.gather(1, index.clamp(min=0)).masked_fill(index < 0, -1))
    rows.free(slots)


def log_evictions(step: Step, rows: CacheRows, positions: torch.Tensor) -> None:
    """Log one layer's evicted `positions` `(Hkv, n)` (-1 = none) at `step`."""
    if step.log is not None:
        step.log.evict(step.index, rows.layer, positions)


def log_merges(
    step: Step,
    rows: CacheRows,
    source: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    prob: torch.Tensor,
    draw: torch.Tensor,
) -> None:
    """`DecisionLog.merges` of one layer at `step`: `source` `(Hkv, E)` positions, `targets` `(Hkv, E, K)`
    (ascending, -1 pads), `weight`, `prob`, `draw` `(Hkv, E)`."""
    if step.log is not None:
        step.log.merges(step.index, rows.layer, source, targets, weight, prob, draw)


def scored_eviction_names() -> tuple[str, ...]:
    """Registered policies that can be a merging policy's base."""
    return tuple(n for n, c in REGISTRY.items() if issubclass(c, ScoredEviction))


def recent_mask(rows: CacheRows, recent: int) -> torch.Tensor:
    """`(R, S)` True for each row's `recent` valid slots with the newest positions."""
    if recent <= 0:
        return torch.zeros(rows.pos.shape, dtype=torch.bool, device=rows.pos.device)
    return rows.valid & (rows.pos >= newest_cut(rows.pos, rows.valid, recent))


def protected_window(rows: CacheRows, recent: int) -> torch.Tensor:
    """`recent_mask` for a policy that protects the window at every compression, so each row holds all of its
    `recent` newest positions: a cut below the newest, with no search and no check. `(R, S)`."""
    return rows.valid & (rows.pos > rows.pos.max() - recent)


def newest_cut(pos: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """`(R, 1)` a cut such that `mask & (pos >= cut)` are each row's k newest slots of `mask`
    (all of them when it has fewer). Positions are distinct within a row.

    Windows that a policy protects hold consecutive positions, so the cut is tried as the newest
    position minus k - 1 and checked by counting (O(S)); a sort (`topk`) only when the check fails.
    """
    masked = pos.masked_fill(~mask, -1)
    guess = masked.max(-1, keepdim=True).values - (k - 1)
    if bool(((masked >= guess).sum(-1) == k).all()):
        return guess
    return masked.topk(min(k, pos.shape[1]), dim=-1).values[:, -1:]
