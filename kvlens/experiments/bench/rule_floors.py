"""The replay floor: what a replay method's rule costs before it scores anything.

A replay method (`Replays`, KVzip's reconstruction) feeds forward passes over its prompt after the prefill,
reads each layer's attention from them (`observe_replay`) and compresses. `replay_forward` gives the same
policy with its passes still fed but read by nothing and nothing evicted: its prefill is the prefill plus the
passes' forward, the least that the rule written plainly costs. `kvlens bench speed` runs it beside the
method (`replay_floor_vs_full_prefill_at_N`), so that a method whose replay misses its target can be told
from one whose rule alone does.
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
    floor = _FORWARD.setdefault(type(policy), type(f"{type(policy).__name__}Forward", (type(policy),), _SKIP))
    return floor(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


def _needs(self: Policy) -> Needs:
    """The tokenizer (the passes' text), nothing else: no statistic, no budget."""
    return dataclasses.replace(NO_ATTENTION, budget_free=True, tokenizer=True)


def _read_nothing(self: Policy, rows: CacheRows, replay: Replay) -> None:
    """The pass's attention goes unread."""


def _keep_all(self: Policy, rows: CacheRows, step: Step) -> None:
    """Nothing leaves."""


_SKIP = {
    "__module__": __name__,
    "__doc__": "A replay policy whose passes are read by nothing and which keeps every slot.",
    "needs": _needs,
    "observe_replay": _read_nothing,
    "compress": _keep_all,
}
_FORWARD: dict[type, type] = {}  # each replay policy's floor class, made once
