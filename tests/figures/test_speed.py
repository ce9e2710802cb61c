"""The speed figure: every `every_policy_*` family the file holds, per policy, the worst named; the rows'
ratios over full where the file has no families."""

from __future__ import annotations

import json

import pytest

from kvlens.figures.speed import families, met_text, policy_table, speed_figure, worst_table
from tests.conftest import ROOT


def test_every_policy_families_are_drawn_per_policy_with_the_worst_named():
    raw = {
        "ratio_details": {
            "every_policy_half_vs_full_at_1024": {"worst": "h2o", "per_policy": {"h2o": 0.97, "tova": 0.9}},
            "every_policy_vs_floor_at_4096": {"worst": "cam", "per_policy": {"cam": 1.2, "h2o": 1.05}},
            "evict_half_vs_full_at_1024": {"ratio": 0.9},
        },
        "targets": {"every_policy_vs_floor_at_4096": {"target": "<= 1.15", "met": False}},
        "rows": [{"policy": "full", "prompt_tokens": 256, "ms_per_token": 1.0}],
    }
    found = families(raw)
    assert [(f.measure, f.length, f.worst) for f in found] == [
        ("decode", 1024, "h2o"),
        ("floor", 4096, "cam"),
    ]
    table = worst_table(found)
    assert table["met"].tolist() == ["", "no"] and table["target"].tolist() == ["", "<= 1.15"]
    fig = speed_figure(found)
    assert [a.text for a in fig.layout.annotations] == [
        "decode ms/token ÷ full",
        "decode ms/token ÷ its floor",
    ]
    assert {tuple(t.y) for t in fig.data} == {("cam", "h2o", "tova")}


def test_a_family_judged_in_cpu_time_is_drawn_and_named_in_cpu_time_with_its_exception():
    """The prefill family's target is judged in CPU time: its bars, its worst policy (another than in wall
    time here) and its verdict, exception included, are the CPU-time ones."""
    why = "its column sums alone take 1.44x the full prefill in CPU time"
    raw = {
        "ratio_details": {
            "every_policy_prefill_vs_full_at_4096": {
                "worst": "h2o",
                "per_policy": {"h2o": 1.5, "d2o": 1.45},
                "worst_cpu": "d2o",
                "cpu": {"h2o": 1.4, "d2o": 1.73},
            },
            "every_policy_half_vs_full_at_4096": {"worst": "d2o", "per_policy": {"h2o": 0.8, "d2o": 1.1}},
        },
        "targets": {
            "every_policy_prefill_vs_full_at_4096": {
                "target": "<= 1.3 (CPU time)",
                "met": False,
                "exception": why,
            }
        },
    }
    decode, prefill = families(raw)
    assert (prefill.cpu, prefill.worst, prefill.per_policy) == (True, "d2o", {"h2o": 1.4, "d2o": 1.73})
    assert not decode.cpu and decode.per_policy == {"h2o": 0.8, "d2o": 1.1}
    row = worst_table([prefill]).iloc[0]
    assert row["measure"] == "prefill CPU ms ÷ full" and row["its ratio"] == 1.73
    assert row["met"] == f"no: exception, {why}"
    assert list(policy_table([decode, prefill]).columns) == ["policy", "decode @ 4096", "prefill CPU @ 4096"]
    titles = [a.text for a in speed_figure([decode, prefill]).layout.annotations]
    assert titles == ["decode ms/token ÷ full", "prefill CPU ms ÷ full"]


def test_a_file_without_families_is_drawn_from_its_rows():
    raw = json.loads((ROOT / "results" / "bench_speed.json").read_text(encoding="utf-8"))
    details = raw["ratio_details"]
    raw["ratio_details"] = {k: v for k, v in details.items() if not k.startswith("every_policy_")}
    found = families(raw)
    assert {f.measure for f in found} == {"decode", "prefill", "bytes"}
    by = {(r["policy"], r["prompt_tokens"]): r for r in raw["rows"]}
    decode = next(f for f in found if f.measure == "decode" and f.length == 1024)
    assert "full" not in decode.per_policy
    assert decode.per_policy["h2o"] == by["h2o", 1024]["ms_per_token"] / by["full", 1024]["ms_per_token"]
    assert decode.worst == max(decode.per_policy, key=decode.per_policy.__getitem__)


@pytest.mark.parametrize(
    ("verdict", "text"),
    [
        ({}, ""),
        ({"target": "<= 2.5", "met": True}, "yes"),
        ({"target": "<= 2.5", "met": False}, "no"),
        (
            {
                "target": "<= 2.5",
                "met": False,
                "exception": "its passes' forward alone takes 2.67x the full prefill",
            },
            "no: exception, its passes' forward alone takes 2.67x the full prefill",
        ),
    ],
)
def test_a_verdict_reads_yes_no_or_no_with_the_exception_it_names(verdict, text):
    assert met_text(verdict) == text
