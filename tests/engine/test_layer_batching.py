"""A policy is written for one layer's rows; at decode steps where a scored eviction selects per head
(`kvlens.engine.batching.batchable`) the engine stacks every layer's scores into one selection. Batched or
layer by layer (`RunOptions.batch_layers`), every policy decides exactly the same."""

from __future__ import annotations

import re

import pytest

from kvlens.engine.batching import batchable
from kvlens.engine.loop import RunOptions, run
from kvlens.policies import REGISTRY, make_policy, policy_class
from tests.conftest import ROOT

IDS = list(b"Batched or layer by layer, a policy keeps the same slots at every step. " * 2)
PREFILL, STEPS, BUDGET = 90, 10, 16
# every budgeted policy with its defaults, and the settings that change its competition or its decode steps
SETTINGS = [(name, {}) for name, cls in sorted(REGISTRY.items()) if not cls().budget_free] + [
    ("cam", {"base": "tova", "score": "decode"}),
    ("cam", {"base": "scissorhands"}),
    ("snapkv", {"decoding": "rolling"}),
    ("kvzip", {"layerwise": True, "decoding": "rolling"}),
    ("kvzip", {"decoding": "rolling"}),
    ("adakv", {"base": "h2o"}),
    ("adakv", {"base.decoding": "rolling"}),
    ("pyramidkv", {"base.decoding": "rolling"}),
    ("pyramidkv", {"base": "tova", "window": 4}),
    ("think", {"base": "h2o"}),
]


def decisions(tiny, name: str, params: dict, batch: bool):
    policy = make_policy(name, params)
    opts = RunOptions(budget=max(BUDGET, policy.needs().min_budget), batch_layers=batch)
    return run(tiny, policy, IDS, prefill=PREFILL, steps=STEPS, teacher=True, opts=opts).decisions


@pytest.mark.parametrize("name,params", SETTINGS, ids=lambda x: str(x or "defaults"))
def test_batched_and_layer_by_layer_decisions_are_identical(tiny, name, params):
    """Every eviction and merge, at the prompt and at each decode step, batched or not; the decode steps of a
    batchable policy do decide (else the comparison would be empty)."""
    batched, single = decisions(tiny, name, params, True), decisions(tiny, name, params, False)
    assert batched.equals(single)
    if batchable(make_policy(name, params)):
        assert int((batched["step"] > 0).sum()) > 0


@pytest.mark.parametrize(
    "name,params,together",
    [
        ("h2o", {}, True),
        ("random", {}, True),
        ("weightedkv", {}, True),  # its selection at once, its merge layer by layer
        ("cam", {"base": "tova"}, True),  # merges what its base's selection evicts: the selection is batched
        ("cam", {"base": "snapkv"}, False),  # its base compresses the prompt once
        ("snapkv", {"decoding": "rolling"}, True),
        ("snapkv", {}, False),  # compressed once (the paper's): the cache grows after the prompt
        ("adakv", {}, False),  # a layer's heads compete
        ("pyramidkv", {}, False),  # the layers' budgets differ
        ("d2o", {}, False),
        ("kvzip", {}, False),
    ],
)
def test_only_policies_whose_selection_is_per_head_are_batched(name, params, together):
    assert batchable(make_policy(name, params)) is together


def test_no_policy_file_handles_the_all_layer_shape_itself():
    """A policy never declares the engine's batching nor handles several layers' rows: no `by_layer`, no
    `rows.states` or `rows.layers`, no reshaping by a number of layers."""
    shape = re.compile(
        r"cross_layer|by_layer|rows\.(layers|states)\b|\.per_layer\(|\.chunk\(len\(|all_layers|\.kv_heads"
    )
    files = {
        ROOT / "kvlens" / "policies" / f"{policy_class(n).__module__.rsplit('.', 1)[1]}.py" for n in REGISTRY
    }
    found = [
        f"{path.name}:{i}: {line.strip()}"
        for path in sorted(files)
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if shape.search(line)
    ]
    assert not found, found
