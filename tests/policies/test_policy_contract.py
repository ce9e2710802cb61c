"""One contract over the whole registry (kvpress `default_presses.py` style): every registered policy,
on the tiny model with its defaults and one small budget (or the least it accepts, below the prompt's
length), must pass every test here. A new policy
file in `kvlens/policies/` is picked up with no other change."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from kvlens.engine.context import Observer
from kvlens.engine.loop import RunOptions, run
from kvlens.policies import REGISTRY, make_policy, parameters, parse_settings, policy_names
from tests.conftest import within_budget

IDS = list(b"The contract: a budget kept, an evicted token never back, a log that tells the truth. " * 2)
PREFILL, STEPS, BUDGET = 80, 24, 12
NAMES = policy_names()


class KeptSets(Observer):
    """Records the valid positions of every (layer, KV head) each time a decode step attends to the cache."""

    needs_rows = True

    def __init__(self):
        self.seen: dict[tuple[int, int], list[set[int]]] = {}

    def on_decode(self, layer, query, probs, out, spec):
        for h in range(layer.pos.shape[0]):
            kept = set(layer.pos[h][layer.valid[h]].tolist())
            self.seen.setdefault((layer.layers[0], h), []).append(kept)


def budget_of(policy) -> int:
    return max(BUDGET, policy.needs().min_budget)


def go(policy, observers=()):
    return run(
        TINY,
        policy,
        IDS,
        prefill=PREFILL,
        steps=STEPS,
        teacher=True,
        opts=RunOptions(budget=budget_of(policy)),
        observers=list(observers),
    )


@pytest.fixture(scope="module", autouse=True)
def _tiny(tiny):
    global TINY
    TINY = tiny


@pytest.mark.parametrize("name", NAMES)
def test_budget_is_respected_or_the_policy_is_budget_free(name):
    policy = make_policy(name)
    r = go(policy)
    if policy.budget_free:
        assert r.meta.budget.slots is None
        assert 0 < r.metrics["kv_slots_final_mean"] <= PREFILL + STEPS
    else:
        budget = budget_of(policy)
        prompt = r.tensors["steps/kv_slots"][0]  # (L, Hkv) after the prompt's compression
        assert r.meta.budget.slots == budget and int(prompt.sum()) == r.metrics["kv_entries_budget"]
        assert r.metrics["kv_entries_budget"] == budget * TINY.shape()["layers"] * TINY.shape()["kv_heads"]
        assert within_budget(policy, r, budget)
        assert policy.competes != "head" or int(prompt.max()) == budget  # else every layer and head keeps it


@pytest.mark.parametrize("name", NAMES)
def test_evicted_positions_never_come_back_and_the_log_names_exactly_what_left(name):
    spy = KeptSets()
    r = go(make_policy(name), [spy])
    log = r.decisions
    for (layer, head), sets in spy.seen.items():
        before = set(range(PREFILL))
        gone: set[int] = set()
        for step, kept in enumerate(sets):  # decode step k attends to the cache after compression k
            left = before - kept
            rows = log[(log.step == step) & (log.layer == layer) & (log.kv_head == head)]
            assert left == set(rows.position.tolist()), (layer, head, step)
            assert not (kept & gone), "an evicted position came back"
            gone |= left
            before = kept
    if make_policy(name).budget_free or name == "full":
        return
    assert len(log), "a budget below the prompt length must evict or merge something"


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_round_trips_through_set(name):
    default = make_policy(name)
    for spec in parameters(name):
        value = spec.describe()["default"]
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        parsed = parse_settings(name, [f"{spec.name}={text}"])
        assert parsed == {spec.name: value}
        assert make_policy(name, parsed).params() == default.params()
    assert make_policy(name, default.params()) == default  # run.json's params rebuild the same policy


@pytest.mark.parametrize("name", NAMES)
def test_one_instance_twice_and_from_two_threads_gives_identical_runs(name):
    policy = make_policy(name)
    first, second = go(policy), go(policy)
    threaded = {}
    workers = [threading.Thread(target=lambda i=i: threaded.update({i: go(policy)})) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for other in (second, threaded[0], threaded[1]):
        assert other.tensors["steps/nll"].tolist() == first.tensors["steps/nll"].tolist()
        assert other.decisions.equals(first.decisions)
        assert other.tensors["steps/kv_slots"].equal(first.tensors["steps/kv_slots"])


@pytest.mark.parametrize("name", NAMES)
def test_policies_are_immutable_configuration_with_help_for_every_parameter(name):
    policy = make_policy(name)
    for f in dataclasses.fields(policy):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(policy, f.name, getattr(policy, f.name))
    assert all(spec.help for spec in parameters(name)), "every parameter needs help text (param(..., help))"
    assert REGISTRY[name].description


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_every_policy_on_the_embedded_model(smol, long_text, name):
    from kvlens.experiments.api import encode

    policy = make_policy(name)
    budget = budget_of(policy)
    ids = encode(smol, long_text)[: budget + 52]
    r = run(smol, policy, ids, prefill=budget + 36, steps=4, teacher=True, opts=RunOptions(budget=budget))
    assert r.tensors["steps/nll"].isfinite().all()
    assert policy.budget_free or within_budget(policy, r, budget)


CAPABILITIES = ("competes", "budget_free")


@pytest.mark.parametrize("name", NAMES)
def test_what_a_policy_is_capable_of_is_declared_by_its_instance_in_needs_alone(name):
    """`competes` and `budget_free` come from the instance's `needs()`: no policy class sets them as class
    attributes (which an instance's parameters could contradict)."""
    from kvlens.policies.base import Policy

    for klass in REGISTRY[name].__mro__[: REGISTRY[name].__mro__.index(Policy)]:
        assert not set(CAPABILITIES) & set(vars(klass)), f"{klass.__name__} sets a capability itself"
    assert all(isinstance(vars(Policy)[attr], property) for attr in CAPABILITIES)  # read from needs()
    policy = make_policy(name)
    assert (policy.competes, policy.budget_free) == (policy.needs().competes, policy.needs().budget_free)


@pytest.mark.parametrize(
    "name, settings, competes, budget_free",
    [
        ("kvzip", {}, "model", False),
        ("kvzip", {"layerwise": "true"}, "layer", False),  # a layer's heads share its count
        ("kvzap", {}, "head", False),
        ("kvzap", {"mode": "threshold"}, "head", True),
        ("think", {}, "head", False),
        ("think", {"base": "full"}, "head", True),  # over full: no budget
        ("adakv", {}, "layer", False),
        ("pyramidkv", {}, "model", False),
        ("corm", {}, "head", True),
    ],
)
def test_an_instances_parameters_decide_what_its_selection_competes_over_and_whether_it_is_budget_free(
    name, settings, competes, budget_free
):
    policy = make_policy(name, parse_settings(name, [f"{k}={v}" for k, v in settings.items()]))
    assert (policy.competes, policy.budget_free) == (competes, budget_free)


def test_policy_has_at_most_six_hooks_and_the_row_contract_at_most_fifteen_members():
    """The surface a policy author learns: `Policy`'s hooks (its public methods that are not final) and the
    members of `CacheRows`, each member documented with its shape or meaning on its line."""
    import inspect

    from kvlens.kvcache import CacheRows
    from kvlens.policies.base import Policy

    hooks = {
        name
        for name, value in vars(Policy).items()
        if inspect.isfunction(value) and not name.startswith("_") and not getattr(value, "__final__", False)
    }
    assert hooks == {"needs", "validate", "allocate", "observe_prefill", "observe", "compress"}

    members = {name for name in vars(CacheRows) if not name.startswith("_")} | set(CacheRows.__annotations__)
    assert len(members) <= 15, sorted(members)
    source = inspect.getsource(CacheRows).splitlines()
    undocumented = [m for m in members if not any(f" {m}" in line and "#" in line for line in source)]
    assert not undocumented, undocumented
