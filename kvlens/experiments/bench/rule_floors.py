"""Rule floors: what a method's rule costs before it decides anything, measured beside the method.

- The replay floor (`replay_forward`). A replay method (`Replays`, KVzip's reconstruction) feeds forward
  passes over its prompt after the prefill, reads each layer's attention from them (`observe_replay`) and
  compresses. Its floor is the same policy with its passes still fed but read by nothing and nothing evicted:
  the prefill plus the passes' forward.
- The column-sums floor (`statistics_alone(H2O)`). H2O's score, and that of every method built on it
  (Scissorhands, CaM, WeightedKV, D2O, KVMerger's eviction), is the column sums of the prompt's attention
  (`Needs.column_sums`). Fused attention (SDPA) never holds those probabilities, so the prefill computes them
  in one eager pass over the causal triangle (`kvlens.engine.attention.prefill_stats`). Its floor is H2O with
  its statistics computed and observed and nothing evicted: the prefill plus the column sums.

`kvlens bench speed` runs each beside the methods it bounds (`replay_floor_vs_full_prefill_at_N`,
`column_sums_floor_vs_full_prefill_at_N`), so that a method that misses its target can be told from one whose
rule alone does.
"""

from __future__ import annotations

import dataclasses

from kvlens.kvcache import CacheRows, Replay, Step
from kvlens.policies import Policy, Replays
from kvlens.policies.base import NO_ATTENTION, Needs


def replay_forward(policy: Policy) -> Policy:
    """`policy`, a `Replays`, with the same parameters and passes, whose passes are read by nothing and which
    keeps every slot (budget-free, no decode-time compression)."""
    if not isinstance(policy, Replays):
        raise TypeError(f"{policy.name} feeds no replay passes")
    return _variant(policy, "Forward", _REPLAY_FORWARD)


def statistics_alone(policy: Policy) -> Policy:
    """`policy` with the same parameters and the statistics its `needs` ask for, computed and observed, which
    keeps every slot (budget-free, no compression)."""
    return _variant(policy, "Statistics", _STATISTICS_ALONE)


def _variant(policy: Policy, suffix: str, overrides: dict) -> Policy:
    """`policy` rebuilt as its subclass with `overrides`, the class made once per policy class and kind."""
    base = type(policy)
    key = (base, suffix)
    if key not in _MADE:
        _MADE[key] = type(f"{base.__name__}{suffix}", (base,), {"__module__": __name__, **overrides})
    return _MADE[key](**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


def _passes_only(self: Policy) -> Needs:
    """The tokenizer (the passes' text), nothing else: no statistic, no budget."""
    return dataclasses.replace(NO_ATTENTION, budget_free=True, tokenizer=True)


def _own_statistics(self: Policy) -> Needs:
    """The policy's own needs, without a budget."""
    needs: Needs = type(self).__mro__[1].needs(self)
    return dataclasses.replace(needs, budget_free=True)


def _read_nothing(self: Policy, rows: CacheRows, replay: Replay) -> None:
    """The pass's attention goes unread."""


def _keep_all(self: Policy, rows: CacheRows, step: Step) -> None:
    """Nothing leaves."""


_REPLAY_FORWARD = {
    "__doc__": "A replay policy whose passes are read by nothing and which keeps every slot.",
    "needs": _passes_only,
    "observe_replay": _read_nothing,
    "compress": _keep_all,
}
_STATISTICS_ALONE = {
    "__doc__": "A policy whose statistics are computed and observed and which keeps every slot.",
    "needs": _own_statistics,
    "compress": _keep_all,
}
_MADE: dict[tuple[type, str], type] = {}  # each floor class, made once
