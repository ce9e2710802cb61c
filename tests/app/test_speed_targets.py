"""The Speed section's targets table: each target's ratio as it was judged (CPU time where the target says so)
and its verdict in words, the exception a replay method makes included."""

from __future__ import annotations

from kvlens.ui.speed import targets_table


def test_each_target_shows_the_value_it_was_judged_on_and_its_verdict():
    why = "its passes' forward alone takes 2.68x the full prefill"
    raw = {
        "ratios": {"every_policy_prefill_vs_full_at_4096": 1.723, "replay_vs_full_prefill_at_4096": 3.196},
        "ratios_cpu": {"every_policy_prefill_vs_full_at_4096": 1.732},
        "targets": {
            "every_policy_prefill_vs_full_at_4096": {"target": "<= 1.3 (CPU time)", "met": False},
            "replay_vs_full_prefill_at_4096": {"target": "<= 2.5", "met": False, "exception": why},
        },
    }
    table = targets_table(raw)
    assert table.to_dict("records") == [
        {
            "ratio name": "every_policy_prefill_vs_full_at_4096",
            "ratio": 1.732,
            "target": "<= 1.3 (CPU time)",
            "met": "no",
        },
        {
            "ratio name": "replay_vs_full_prefill_at_4096",
            "ratio": 3.196,
            "target": "<= 2.5",
            "met": f"no: exception, {why}",
        },
    ]
