"""The rule floors: a replay method's passes fed as the method feeds them, read by nothing, nothing evicted
(`replay_forward`); a policy's statistics computed and observed, nothing evicted (`statistics_alone`); and the
verdicts that name a method whose rule alone misses its target as the exception."""

from __future__ import annotations

import pytest

import kvlens.engine.context as context_module
from kvlens.engine.loop import RunOptions, run
from kvlens.experiments.bench import speed
from kvlens.experiments.bench.rule_floors import replay_forward, statistics_alone
from kvlens.policies import make_policy
from kvlens.policies.h2o import H2O
from kvlens.policies.kvzip import KVzip

IDS = list(range(5, 125))


def test_the_replay_floor_feeds_the_methods_passes_and_keeps_the_full_caches_tokens(tiny, monkeypatch):
    method = make_policy("kvzip", {"chunk": 40})
    floor = replay_forward(method)
    assert floor.chunk == 40 and floor.budget_free and isinstance(floor, KVzip)
    read = []
    monkeypatch.setattr(KVzip, "observe_replay", lambda self, rows, replay: read.append(rows.layer))
    opts = RunOptions(budget=30, max_new_tokens=6, stop_at_eos=False)
    full = run(tiny, make_policy("full"), IDS, prefill=100, steps=6, teacher=False, opts=opts)
    r = run(tiny, floor, IDS, prefill=100, steps=6, teacher=False, opts=opts)
    assert r.metrics["replay_passes"] == 3 and r.metrics["replay_ms"] > 0  # 100 tokens in chunks of 40
    assert read == []  # the method's reading of the passes never runs
    assert r.meta.tokens == full.meta.tokens  # nothing evicted: the full cache's greedy tokens
    assert r.tensors["steps/kv_slots"].tolist() == full.tensors["steps/kv_slots"].tolist()
    assert type(replay_forward(make_policy("kvzip"))) is type(floor)  # one floor class per method


def test_a_policy_without_replay_passes_has_no_replay_floor():
    with pytest.raises(TypeError, match="h2o feeds no replay passes"):
        replay_forward(make_policy("h2o"))


@pytest.mark.parametrize(("floor", "exception"), [(2.67, True), (2.4, False), (None, False)])
def test_a_missed_replay_target_names_the_method_as_the_exception_only_where_its_floor_misses_it(
    floor, exception
):
    ratios = {
        "replay_vs_full_prefill_at_4096": 3.1,
        "every_policy_vs_floor_at_4096": 1.5,  # missed, not a replay ratio: never an exception
        "kv_bytes_half_budget_vs_full": 0.5,
    }
    if floor is not None:
        ratios["replay_floor_vs_full_prefill_at_4096"] = floor
    verdicts = speed.verdicts(ratios, 0.5)
    replay = verdicts["replay_vs_full_prefill_at_4096"]
    assert not replay["met"] and ("exception" in replay) == exception
    if exception:
        assert replay["exception"] == "its passes' forward alone takes 2.67x the full prefill"
    assert "exception" not in verdicts["every_policy_vs_floor_at_4096"]
    met = speed.verdicts({**ratios, "replay_vs_full_prefill_at_4096": 2.4}, 0.5)
    assert met["replay_vs_full_prefill_at_4096"] == {"target": "<= 2.5", "met": True}


def test_h2os_statistics_alone_compute_the_column_sums_and_keep_the_full_caches_tokens(tiny, monkeypatch):
    floor = statistics_alone(make_policy("h2o", {"recent_ratio": 0.25}))
    assert isinstance(floor, H2O) and floor.recent_ratio == 0.25 and floor.budget_free
    assert floor.needs().column_sums and floor.needs().budget_free
    computed, observed = [], []
    stats = context_module.prefill_stats
    monkeypatch.setattr(context_module, "prefill_stats", lambda *a: computed.append(1) or stats(*a))
    monkeypatch.setattr(H2O, "observe_prefill", lambda self, rows, prompt: observed.append(rows.abar.shape))
    opts = RunOptions(budget=30, max_new_tokens=6, stop_at_eos=False)
    full = run(tiny, make_policy("full"), IDS, prefill=100, steps=6, teacher=False, opts=opts)
    r = run(tiny, floor, IDS, prefill=100, steps=6, teacher=False, opts=opts)
    layers = tiny.shape()["layers"]
    assert len(computed) == layers  # one eager pass per layer over the prompt: the column sums
    assert len(observed) == layers and observed[0][-1] == 100  # each layer's `abar` `(Hkv, T)` seen
    assert r.meta.tokens == full.meta.tokens  # nothing evicted
    assert r.tensors["steps/kv_slots"].tolist() == full.tensors["steps/kv_slots"].tolist()
    assert type(statistics_alone(make_policy("h2o"))) is type(floor)


@pytest.mark.parametrize(
    ("worst", "floor", "exception"), [("d2o", 1.44, True), ("d2o", 1.2, False), ("tova", 1.44, False)]
)
def test_a_missed_prefill_target_names_the_exception_only_for_a_column_sum_reader_whose_floor_misses_it(
    worst, floor, exception
):
    key, sums = "every_policy_prefill_vs_full_at_4096", "column_sums_floor_vs_full_prefill_at_4096"
    ratios = {key: 1.6, sums: floor, "kv_bytes_half_budget_vs_full": 0.5}
    cpu = {key: 1.73, sums: floor}
    details = {key: {"worst_cpu": worst}, sums: {"cpu": {"d2o": floor, "h2o": floor}}}
    verdict = speed.verdicts(ratios, 0.5, cpu, details)[key]
    assert verdict["target"] == "<= 1.3 (CPU time)" and not verdict["met"]
    assert verdict.get("exception") == (
        f"its column sums alone take {floor:.2f}x the full prefill in CPU time" if exception else None
    )
