"""The README and the documentation site: generated pages match their sources (the command line's parsers, the
policy and analysis registries, `results/*.json`), every command, policy and analysis has its section, the
site builds with --strict and references nothing outside itself, and no page reads as a work log."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import gen_docs  # noqa: E402
from docgen import analysis_page, cli_page, policy_page, results_page  # noqa: E402

DOCS = sorted((ROOT / "docs").rglob("*.md"))
TEXTS = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *DOCS]}


def headings(path: str, level: int) -> set[str]:
    return set(re.findall(rf"^{'#' * level} (.+)$", TEXTS[path], re.M))


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    return gen_docs.expected()


def test_the_generated_pages_and_readme_tables_are_what_their_sources_give(expected):
    stale = [path for path, text in expected.items() if TEXTS[path] != text]
    assert not stale, f"out of date: {stale}; run `make docs-gen`"


def test_the_results_page_is_read_from_the_results_files_and_cites_every_one_of_them(expected):
    assert TEXTS["docs/results.md"] == expected["docs/results.md"]
    cited = {p.name for p in results_page.cited()}
    assert cited == {p.name for p in (ROOT / "results").glob("*.json")}, (
        "a results file no page cites, or the reverse"
    )
    for name in cited:
        section = TEXTS["docs/results.md"].split(f"`results/{name}` · made by `", 1)[1]
        command = re.sub(
            r"^([A-Z_]+=\S+ )+", "", section.split("`", 1)[0]
        )  # environment settings first, if any
        assert command.startswith(("kvlens ", "python ")), name  # the command that made it


def test_every_command_policy_and_analysis_has_its_generated_section():
    commands = cli_page.commands()
    assert {"kvlens ppl", "kvlens bench tasks", "kvlens analyze", "kvlens compare"} <= set(commands)
    assert set(commands) <= headings("docs/cli.md", 2) | headings("docs/cli.md", 3)
    policies = policy_page.names()
    assert len(policies) >= 19 and set(policies) == headings("docs/policies.md", 2)
    readme_rows = re.findall(r"^\| `(\w+)` \| (reference|eviction|merging) \|", TEXTS["README.md"], re.M)
    assert [name for name, _ in readme_rows] == policies
    kinds = analysis_page.names()
    assert "attention" in kinds and set(kinds) == headings("docs/analyses.md", 2)


def test_the_policy_table_says_which_policies_kvpress_cross_checks():
    rows = {
        m[0]: m[1:]
        for m in re.findall(
            r"^\| `(\w+)` \| \w+ \| .*? \| (`\w+`|—) \| (yes|no|—) \|$", TEXTS["README.md"], re.M
        )
    }
    assert rows["snapkv"] == ("`SnapKVPress`", "yes") and rows["tova"] == ("`TOVAPress`", "yes")
    assert rows["qfilter"] == ("`QFilterPress`", "no") and rows["d2o"] == ("—", "—")


def test_the_readme_is_short_and_its_first_screen_says_what_kvlens_is_and_the_two_commands():
    lines = TEXTS["README.md"].splitlines()
    assert len(lines) <= 250
    first = "\n".join(lines[:20])
    assert (
        "kvlens shows what KV-cache compression does" in first
        and "make run" in first
        and "make test" in first
    )
    section = TEXTS["README.md"].split("## In your transformers code\n", 1)[1].split("\n## ", 1)[0]
    assert len(section.splitlines()) <= 30 and "docs/transformers.md" in section


def commits_named(texts: list[str]) -> list[str]:
    """The words of 7-40 hex characters in `texts` that git resolves as a commit of this repository."""
    words = sorted({w for text in texts for w in re.findall(r"\b[0-9a-f]{7,40}\b", text)})
    query = "".join(f"{w}^{{commit}}\n" for w in words)
    out = subprocess.run(
        ["git", "cat-file", "--batch-check"],
        cwd=ROOT,
        input=query,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [w for w, line in zip(words, out, strict=True) if not line.endswith("missing")]


def test_no_commit_of_this_repository_is_named_in_the_readme_or_the_docs():
    head = subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert commits_named([f"measured at {head}; digest 6fae264eff28, 1234567 tokens"]) == [
        head
    ]  # the check works
    assert not commits_named(list(TEXTS.values())), "commit ids in the README or docs"


WORK_LOG = [
    r"load average",
    r"earlier round",
    r"\btoday\b",
    r"\bthis session\b",
    r"\bUTC\b",
    r"shared with (?:\w+ )?other jobs",
    r"^#+ .*\b20\d\d-\d\d-\d\d",
    r"re-?run with today",
    r"\bwe (?:tried|ran)\b",
    r"\bnotes for the README\b",
    r"\blab notes?\b",
]


@pytest.mark.parametrize("path", sorted(TEXTS))
def test_no_page_reads_as_a_dated_work_log(path):
    found = [p for p in WORK_LOG if re.search(p, TEXTS[path], re.I | re.M)]
    assert not found, f"{path} reads as a work log: {found}"
    assert not re.search(r"^#+ .*notes", TEXTS[path], re.I | re.M)


def test_the_work_log_check_catches_a_dated_entry():
    entry = "### 2026-11-23: every target met\nFrom 07:15 to 08:20 UTC the load average was 8 to 15."
    assert [p for p in WORK_LOG if re.search(p, entry, re.I | re.M)] == [
        r"load average",
        r"\bUTC\b",
        r"^#+ .*\b20\d\d-\d\d-\d\d",
    ]


def test_the_site_builds_strict_and_references_nothing_outside_itself(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pages = sorted(site.rglob("*.html"))
    assert {"index.html", "policies.html", "results.html", "cli.html", "api.html"} <= {p.name for p in pages}
    external = re.compile(
        r"""<(?:script|img|link|iframe|source)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""", re.I
    )
    for page in pages:
        html = page.read_text(encoding="utf-8")
        assert not external.search(html), f"{page.name} loads {external.search(html).group(0)}"
    css = " ".join(p.read_text(encoding="utf-8", errors="replace") for p in site.rglob("*.css"))
    assert "fonts.googleapis" not in css and "fonts.gstatic" not in css
    api = (site / "api.html").read_text(encoding="utf-8")  # mkdocstrings rendered the docstrings
    assert "load_run" in api
    for name in (
        "kvlens.policies.base.Policy",
        "kvlens.policies.base.Needs",
        "kvlens.kvcache.contract.CacheRows",
    ):
        assert f'id="{name}"' in api, name  # the policy contract, rendered with its members


def test_the_results_page_and_the_apps_benchmarks_page_open_on_the_same_benchmarks_in_the_same_order():
    source = (ROOT / "pages" / "benchmarks.py").read_text(encoding="utf-8")
    lead = re.findall(r'\("(bench_\w+)", "[^"]+", "\w+", "kvlens bench \w+"\)', source)
    assert lead == ["bench_tasks", "bench_frontier", "bench_speed"]
    assert [p.stem for p in results_page.cited()][:3] == lead


def test_the_multiquery_turns_table_gives_each_turn_against_the_full_caches_same_turn():
    def cell(policy, ratio, scores, length=1024, task="niah_multiquery"):
        turns = [{"score": s, "ci_low": s, "ci_high": s} for s in scores]
        return {"policy": policy, "ratio": ratio, "task": task, "length": length, "turns": turns}

    summary = [
        cell("full", 0.0, [1.0, 0.5]),
        cell("a", 0.5, [0.5, 0.5]),
        cell("b", 0.5, [0.0, 0.25]),
        cell("a", 0.75, [0.0, 0.0]),  # another ratio: not in the 0.5 row
        cell("a", 0.5, [1.0, 1.0], task="all"),  # the average over tasks: not a task's turns
    ]
    text = results_page.turns_table(summary)
    assert "| 1024 | 1.00 · 0.50 | -0.75 · -0.12 | 2 |" in text
    assert results_page.turns_table([cell("a", 0.5, [0.5, 0.5])]) == ""  # no full cache to compare with


def grid_row(task, length, index, minutes, machine=None):
    """A finished task-grid sample that took `minutes`, spread over two (policy, ratio) cells."""
    ms = minutes * 60_000
    results = [{"prepare_ms": ms / 8, "own_ms": 0.0, "answer_ms": ms / 8}] * 2
    return {
        "suite_task": task,
        "length": length,
        "index": index,
        "shared_prefill_ms": ms / 2,
        "results": results,
        "machine": machine,
    }


def test_the_grid_time_counts_each_task_and_length_at_its_median_sample_and_only_this_machines_rows():
    rows = [
        grid_row("a", 1024, 0, 1.0),
        grid_row("a", 1024, 1, 1.0),
        grid_row("a", 1024, 2, 31.0),
    ]  # one timed across a pause
    rows += [grid_row("b", 4096, 0, 9.0), grid_row("b", 4096, 1, 500.0, machine="a GPU")]
    text = results_page.grid_time(rows)
    assert "took 0.2 h of one worker's time" in text  # (3 x 1 + 1 x 9) min; the pause and the GPU row apart
    assert "from 1.0 min a sample (`a`, 1024 tokens) to 9.0 min (`b`, 4096 tokens)" in text
    assert results_page.grid_time([grid_row("b", 4096, 0, 9.0, machine="a GPU")]) == ""


def test_a_query_aware_grid_short_of_lengths_says_what_those_lengths_cost_the_other_grid():
    agnostic = {
        "config": {"lengths": [1024, 4096]},
        "rows": [grid_row("a", 1024, 0, 1.0), grid_row("a", 4096, 0, 30.0), grid_row("a", 4096, 1, 60.0)],
    }
    aware = {"config": {"lengths": [1024]}, "rows": []}
    text = results_page.skipped_lengths(agnostic, aware)
    assert text == (
        " It runs at 1024 tokens only: the question-agnostic grid's 4096-token samples alone took 1.5 h of "
        "one worker's time on this machine."
    )  # the median sample (45 min) times 2
    assert results_page.skipped_lengths(agnostic, agnostic) == ""


def test_each_protocol_names_its_own_needle_figure():
    assert results_page.needles_figure({}) == "results/bench_tasks_needles.png"
    assert results_page.needles_figure({"query_aware": True}) == "results/bench_tasks_query_aware_needles.png"


def test_the_speed_section_tables_every_policy_against_full_and_its_floor_with_the_worst_named():
    """Each policy's row carries its median [lowest–highest] of each family, prefill in CPU time, and the
    worst policy of each column is named, from the file's own `ratio_details`."""
    fam = {"per_policy": {"h2o": 1.05, "adakv": 1.2}, "spread": {"h2o": [1.0, 1.1], "adakv": [1.1, 1.3]}}
    cpu = {"cpu": {"h2o": 1.1, "adakv": 1.4}, "cpu_spread": {"h2o": [1.0, 1.2], "adakv": [1.3, 1.5]}}
    details = {
        "every_policy_half_vs_full_at_4096": {**fam, "worst": "adakv"},
        "every_policy_vs_floor_at_4096": {**fam, "worst": "adakv"},
        "every_policy_prefill_vs_full_at_4096": {**fam, **cpu, "worst": "h2o", "worst_cpu": "adakv"},
        "every_policy_bytes_half_vs_full_at_4096": {
            "per_policy": {"h2o": 0.5, "adakv": 0.51},
            "worst": "adakv",
        },
    }
    text = results_page.every_policy_table({"ratio_details": details, "config": {"repeats": 3}})
    row = next(line for line in text.splitlines() if line.startswith("| `adakv`"))
    cells = [cell.replace("\u2060", "").replace("\u00a0", " ") for cell in row.split(" | ")[1:]]
    assert cells == ["4096", "1.20 [1.10–1.30]", "1.20 [1.10–1.30]", "1.40 [1.30–1.50]", "0.510 |"]
    assert "prefill vs full (CPU) at 4096: `adakv`" in text and "decode vs floor at 4096: `adakv`" in text
    assert results_page.every_policy_table({"ratio_details": {}, "config": {"repeats": 3}}) == ""


def test_the_speed_ratios_name_an_exception_and_leave_a_ratio_without_target_unjudged():
    why = "its passes' forward alone takes 2.67x the full prefill"
    obj = {
        "config": {"steps": 32, "budget": 0.5, "repeats": 3},
        "rows": [],
        "ratios": {"replay_vs_full_prefill_at_4096": 3.1, "replay_floor_vs_full_prefill_at_4096": 2.67},
        "targets": {"replay_vs_full_prefill_at_4096": {"target": "<= 2.5", "met": False, "exception": why}},
    }
    rows = {line.split(" | ")[0]: line for line in results_page.speed_section(obj).splitlines()}
    assert rows["| `replay_vs_full_prefill_at_4096`"].endswith(f"|  | <= 2.5 | no: exception, {why} |")
    assert rows["| `replay_floor_vs_full_prefill_at_4096`"].endswith("| 2.670 |  |  |  |")
    obj["ratios"]["every_policy_prefill_vs_full_at_4096"] = 1.5  # judged in CPU time: its CPU value beside
    obj["ratios_cpu"] = {"every_policy_prefill_vs_full_at_4096": 1.73}
    obj["targets"]["every_policy_prefill_vs_full_at_4096"] = {"target": "<= 1.3 (CPU time)", "met": False}
    rows = {line.split(" | ")[0]: line for line in results_page.speed_section(obj).splitlines()}
    assert rows["| `every_policy_prefill_vs_full_at_4096`"] == (
        "| `every_policy_prefill_vs_full_at_4096` | 1.500 | 1.730 | <= 1.3 (CPU time) | no |"
    )


def test_the_readme_speed_overview_names_each_columns_worst_how_many_meet_and_the_replay_floor():
    """Per length, each family's worst policy with its spread and the count within the target (the prefill
    family without the replay method, which has its own ratio); KVzip's prefill beside its passes' forward."""
    fam = {"per_policy": {"h2o": 1.05, "corm": 1.5}, "spread": {"h2o": [1.0, 1.1], "corm": [1.49, 1.52]}}
    prefill = {
        "per_policy": {"h2o": 1.2, "kvzip": 3.0},
        "cpu": {"h2o": 1.25, "kvzip": 3.1},
        "cpu_spread": {"h2o": [1.2, 1.3], "kvzip": [3.0, 3.2]},
        "worst_cpu": "h2o",
    }
    obj = {
        "command": "kvlens bench speed --json",
        "environment": {
            "time": "2026-12-06T11:00:00Z",
            "cpus": 2,
            "machine": "x86_64",
            "torch": "2.13.0+cpu",
        },
        "config": {"repeats": 3},
        "ratios": {"replay_floor_vs_full_prefill_at_4096": 2.67},
        "targets": {"replay_vs_full_prefill_at_4096": {"target": "<= 2.5", "met": False, "exception": "its"}},
        "ratio_details": {
            "every_policy_half_vs_full_at_4096": {**fam, "worst": "corm"},
            "every_policy_vs_floor_at_4096": {**fam, "worst": "corm"},
            "every_policy_prefill_vs_full_at_4096": prefill,
            "every_policy_bytes_half_vs_full_at_4096": {"per_policy": {"h2o": 0.5}, "worst": "h2o"},
            "replay_vs_full_prefill_at_4096": {"per_policy": {"kvzip": 3.0}, "worst": "kvzip"},
        },
    }
    text = results_page.speed_overview(obj).replace("\u2060", "").replace("\u00a0", " ")
    row = next(line for line in text.splitlines() if line.startswith("| 4096"))
    assert row.split(" | ")[1:] == [
        "`corm` 1.50 [1.49–1.52]; 0 of 2 ≤ 0.9",
        "`corm` 1.50 [1.49–1.52]; 1 of 2 ≤ 1.15",
        "`h2o` 1.25 [1.20–1.30]; 1 of 1 ≤ 1.3",
        "`h2o` 0.500; 1 of 1 ≤ 0.52 |",
    ]
    assert "4096 tokens 3.00× (its passes' forward alone 2.67×)" in text
    assert "At 4096 tokens its passes' forward alone exceeds the target" in text
    assert "column sums" not in text  # none measured
    sums = {"cpu": {"d2o": 1.44}, "cpu_spread": {"d2o": [1.41, 1.47]}, "worst_cpu": "d2o"}
    obj["ratio_details"]["column_sums_floor_vs_full_prefill_at_4096"] = sums
    obj["ratios_cpu"] = {"column_sums_floor_vs_full_prefill_at_4096": 1.44}
    obj["targets"]["every_policy_prefill_vs_full_at_4096"] = {"met": False, "exception": "its column sums"}
    text = results_page.speed_overview(obj).replace("\u2060", "").replace("\u00a0", " ")
    assert (
        "nothing evicted) over the full prefill, in CPU time: 4096 tokens 1.44 [1.41–1.47]. At 4096" in text
    )
    obj["targets"] = {}  # missed where its floor did not: no exception named
    assert "exception" not in results_page.speed_overview(obj)
