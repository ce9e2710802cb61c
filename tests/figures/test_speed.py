"""The speed figure: every `every_policy_*` family the file holds, per policy, the worst named; the rows'
ratios over full where the file has no families."""

from __future__ import annotations

import json

import pytest

from kvlens.figures.speed import families, met_text, speed_figure, worst_table
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
