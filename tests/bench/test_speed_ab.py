"""`scripts/speed_ab.py`'s table (median, spread, `worse` flag) on fabricated `bench speed --json` results."""

from __future__ import annotations

import json

from scripts.speed_ab import parse, summarize, table, worst_of


def results(walls: dict[str, list[float]], cpus: dict[str, list[float]]) -> list[dict]:
    """One fabricated `bench speed --json` result per round (only the fields the table reads)."""
    rounds = len(next(iter(walls.values())))
    return [
        {
            "ratios": {k: v[i] for k, v in walls.items()},
            "ratios_cpu": {k: v[i] for k, v in cpus.items() if i < len(v)},
            "rows": [],
        }
        for i in range(rounds)
    ]


def test_each_ratio_has_its_median_and_range_per_side_and_worse_only_beyond_both_spreads(tmp_path):
    rev = results(
        {"up": [1.00, 1.02, 0.98], "overlap": [1.00, 1.10, 0.90], "down": [1.0, 1.0, 1.0]},
        {"up": [1.0, 1.0, 1.0], "overlap": [1.0, 1.0]},  # the last round has no CPU time for overlap
    )
    head = results(
        {"up": [1.11, 1.12, 1.10], "overlap": [1.05, 1.2, 1.08], "down": [0.5, 0.6, 0.7], "new": [9] * 3},
        {"up": [1.0, 1.0, 1.01], "overlap": [1.0, 1.0, 1.0]},
    )
    for name, runs in (("rev", rev), ("head", head)):
        (tmp_path / f"{name}.json").write_text(json.dumps(runs))
    rows = summarize(*(json.loads((tmp_path / f"{name}.json").read_text()) for name in ("rev", "head")))
    # the ratios every round of both sides has, in HEAD's order (one new at HEAD has nothing to compare with)
    assert [r.ratio for r in rows] == ["up", "overlap", "down", "up (cpu)"]
    # (cpu): HEAD's lowest round ties REV's highest, which is not beyond the spread
    assert [r.worse for r in rows] == [True, False, False, False]
    assert rows[0].rev == [1.00, 1.02, 0.98] and rows[0].head == [1.11, 1.12, 1.10]
    lines = table(rows, "main").splitlines()
    assert lines[0].split() == ["ratio", "main", "HEAD", "worse", "worst", "at", "HEAD"]
    assert lines[1].split() == ["up", "1.000", "[0.980,", "1.020]", "1.110", "[1.100,", "1.120]", "WORSE"]
    assert lines[2].split() == ["overlap", "1.000", "[0.900,", "1.100]", "1.080", "[1.050,", "1.200]"]
    assert lines[3].split() == ["down", "1.000", "[1.000,", "1.000]", "0.600", "[0.500,", "0.700]"]
    assert "over 3 rounds" in lines[-1]


def test_one_round_marks_any_increase():
    rows = summarize(results({"r": [1.0]}, {}), results({"r": [1.001]}, {}))
    assert [r.worse for r in rows] == [True]
    assert [r.worse for r in summarize(results({"r": [1.0]}, {}), results({"r": [1.0]}, {}))] == [False]


def test_arguments_other_than_rev_and_rounds_go_to_the_bench():
    args, bench = parse(["main", "--policies", "full,streaming_llm", "--rounds", "2", "--lengths", "128"])
    assert (args.rev, args.rounds) == ("main", 2)
    assert bench == ["--policies", "full,streaming_llm", "--lengths", "128"]
    args, bench = parse(["HEAD~1"])
    assert (args.rev, args.rounds, bench) == ("HEAD~1", 3, ["--quick"])


def test_an_every_policy_ratio_names_its_worst_policy_and_each_policy_gets_its_own_row():
    def run(adakv: float, snapkv: float) -> dict:
        worst = "adakv" if adakv >= snapkv else "snapkv"
        details = {"worst": worst, "per_policy": {"adakv": adakv, "snapkv": snapkv}}
        return {"ratios": {"every": max(adakv, snapkv)}, "ratio_details": {"every": details}}

    rev = [run(2.0, 1.0), run(2.1, 1.0)]
    head = [run(1.5, 1.2), run(1.0, 1.3), run(1.4, 1.1)]
    rows = summarize(rev, head)
    assert [r.ratio for r in rows] == ["every", "every: adakv", "every: snapkv"]
    assert [r.worse for r in rows] == [False, False, True]  # snapkv got slower though the worst got faster
    assert worst_of(head) == {"every": "adakv"}  # two of three rounds
    lines = table(rows, "main", worst_of(head)).splitlines()
    assert lines[1].split()[1:] == ["2.050", "[2.000,", "2.100]", "1.400", "[1.300,", "1.500]", "adakv"]
    assert lines[2].split()[-1] == "1.500]"  # neither worse nor an every-policy ratio
    assert lines[3].split()[-1] == "WORSE"
