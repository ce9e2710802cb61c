"""`scripts/decode_phases.py`: each decode phase's timer counts the calls it wraps, only during decode steps,
and every wrapped function is restored after the run."""

from __future__ import annotations

from kvlens.engine import context, loop
from kvlens.kvcache.cache import KVCache
from kvlens.policies import REGISTRY
from scripts.decode_phases import PHASES, Timers, decode_phases, summarise
from tests.conftest import TEXTS


def test_phases_of_an_evicting_and_an_observing_policy_and_nothing_left_patched(tiny):
    ids = list(tiny.tokenizer((TEXTS / "1961-Kennedy.txt").read_text()).input_ids)[:192]
    before = (context.decode_rows, context.sdpa, KVCache.update, context.RunContext.accumulate)
    runs = {name: decode_phases(tiny, name, ids, 4, 0.5) for name in ("full", "h2o", "scissorhands")}
    layers = len(tiny.model.model.layers)
    for ms, calls in runs.values():
        assert set(ms) == {*PHASES, "total"} and all(ms[p] >= 0 for p in PHASES[1:])
        assert abs(sum(ms[p] for p in PHASES) - ms["total"]) < 1e-6
        steps = calls["steps"]  # the decode steps after the prompt's (not timed)
        assert steps == 3 and calls["cache"] == calls["attention"] == layers * steps
        assert calls["accumulate"] == calls["compress"] == steps
    observed = runs["scissorhands"][1]
    assert observed["observe"] == layers * observed["steps"]  # a statistic per layer
    assert (context.decode_rows, context.sdpa, KVCache.update, context.RunContext.accumulate) == before
    assert "observe" not in vars(REGISTRY["h2o"]) and "compress_step" in vars(loop._Loop)


def test_a_timer_counts_only_while_on():
    class Owner:
        @staticmethod
        def work() -> int:
            return 7

    timers = Timers()
    undo = timers.wrap(Owner, "work", "compress")
    assert Owner.work() == 7 and timers.ms["compress"] == 0
    timers.on = True
    assert Owner.work() == 7 and timers.ms["compress"] > 0
    undo()
    assert Owner.work() == 7 and "work" in vars(Owner)


def test_the_summary_pairs_each_round_with_the_full_caches_and_the_evictions_of_the_same_round():
    def run(total: float) -> dict[str, float]:
        return {**dict.fromkeys(PHASES, 0.0), "model": total, "total": total}

    runs = {
        "full": [run(100), run(50), run(80)],
        "streaming_llm": [run(90), run(45), run(80)],
        "snapkv": [run(150), run(50), run(120)],
    }
    table = summarise(runs)
    assert table["snapkv"]["vs_full"] == [1.5, 1.0, 1.5]  # 1.5, 1.0, 1.5: the median and the extremes
    assert table["snapkv"]["total"] == 120 and table["snapkv"]["beyond_full"] == 40  # median of 50, 0, 40
    assert table["snapkv"]["beyond_eviction"] == 40  # median of 60, 5, 40
    assert table["full"]["vs_full"] == [1.0, 1.0, 1.0] and table["streaming_llm"]["beyond_eviction"] == 0
    assert "beyond_eviction" not in summarise({"full": runs["full"], "snapkv": runs["snapkv"]})["snapkv"]
