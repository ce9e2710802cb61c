"""`kvlens report` and `kvlens.analysis.report`: one HTML file per set of runs, drawn from plotly.js inlined
once, that names nothing outside itself; its figures, kept text, command and (for several runs) the
comparison."""

from __future__ import annotations

import copy
import html
import re
from pathlib import Path

import pytest
from plotly.offline import get_plotlyjs

from kvlens import load_run
from kvlens.analysis.report import report_html
from kvlens.cli import main
from kvlens.figures.kept_text import kept_text, kept_text_html
from tests.conftest import CACHED_RUNS, one_sentence

FIGURE_IDS = re.compile(r'<div id="([^"]+)" class="plotly-graph-div"')
# what each shipped run meets: attention rows and states (both), --measure (cam only)
H2O = ["attention", "occupancy", "similarity", "adjacency", "spectrum"]
CAM = ["attention", "occupancy", "similarity", "perturbation", "perturbation-layers", "adjacency", "spectrum"]


@pytest.fixture(scope="module")
def report_runs():
    return [load_run(CACHED_RUNS / name) for name in ("h2o-attention", "cam-attention", "tova-summary")]


@pytest.fixture(scope="module")
def two(report_runs) -> str:
    return report_html(report_runs[:2])


def outside_plotly(page: str) -> str:
    """The report without its one inlined copy of plotly.js (whose source names map tile servers in
    strings)."""
    assert page.count(get_plotlyjs()) == 1
    return page.replace(get_plotlyjs(), "")


def test_one_document_with_plotly_inlined_once_and_nothing_from_outside(two):
    assert two.startswith("<!DOCTYPE html>") and two.rstrip().endswith("</html>") and two.count("<html") == 1
    rest = outside_plotly(two)
    assert two.split("</head>")[0].count("<script") == 1  # plotly.js, inlined in the head
    for fetch in (
        'src="http',
        "src='http",
        'href="http',
        "href='http",
        "<link",
        "@import",
        "url(",
        "cdn.",
        "<iframe",
        "<img",
    ):
        assert fetch not in rest.lower(), fetch
    assert 'src="http' not in two and "mathjax" not in rest.lower()
    assert rest.count("<script") == 1 + len(FIGURE_IDS.findall(two))  # plotly.js's, then one per figure


def test_every_figure_of_every_run_and_the_comparison_is_drawn(two):
    ids = FIGURE_IDS.findall(two)
    assert ids == ["comparison-steps", *(f"run1-{k}" for k in H2O), *(f"run2-{k}" for k in CAM)]
    assert all(
        re.search(rf'Plotly\.newPlot\(\s*"{i}"', two) for i in ids
    )  # each div is drawn by its own script


def test_the_kept_text_command_settings_and_decisions_of_each_run(report_runs, two):
    for run in report_runs[:2]:
        assert kept_text_html(kept_text(run, len(run.meta.tokens) - 1)) in two
        assert f"<pre>{html.escape(run.meta.command)}</pre>" in two
        d = run.decisions
        evicted = (
            ((d["action"] == "evict") | (d["draw"] == 0)).groupby(d["layer"]).sum()
        )  # draw 0: moved nothing
        row = "".join(f'<td class="num">{int(evicted.get(n, 0)):,}</td>' for n in range(30))
        assert f"<tr><td>evicted</td>{row}" in two
    assert two.count('class="kvlens-kept-text"') == 2
    assert "<td>parameters</td><td>recent_ratio=0.5</td>" in two  # h2o's settings
    merges = ((report_runs[1].decisions["action"] == "merge") & (report_runs[1].decisions["draw"] != 0)).sum()
    assert re.search(
        rf"<tr><td>merged</td>(<td[^>]*>[\d,]+</td>){{30}}<td class=\"num\">{merges:,}</td>", two
    )


def test_two_runs_are_compared_side_by_side_first(report_runs, two):
    comparison = two[two.index('id="comparison"') : two.index('id="run-1"')]
    ppl = [f"{run.metrics['ppl']:#.4g}" for run in report_runs[:2]]
    assert re.search(
        r"perplexity <code>ppl</code></td>" + "".join(rf'<td class="num">{p}</td>' for p in ppl), comparison
    )
    assert (
        '<a href="#run-1">h2o-attention</a>' in comparison
        and '<a href="#run-2">cam-attention</a>' in comparison
    )
    assert "run1-" not in comparison and "comparison-steps" in comparison
    assert 'id="comparison"' not in report_html(report_runs[:1])


def test_a_summary_run_gets_its_text_and_says_how_to_record_the_rest(report_runs):
    page = report_html([report_runs[2]])
    assert FIGURE_IDS.findall(page) == ["run1-occupancy"]
    assert "record it with --record attention" in page and 'class="kvlens-kept-text"' not in page
    assert html.escape(report_runs[2].meta.text) in page


def test_everything_a_run_says_is_escaped(report_runs):
    run = copy.deepcopy(report_runs[2])
    run.meta.command = "kvlens generate --prompt '</pre><script>alert(1)</script>'"
    run.meta.policy.params = {"<b>x</b>": "<i>"}
    page = outside_plotly(report_html([run]))
    assert "<script>alert(1)" not in page and "&lt;/pre&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>x" not in page and "&lt;b&gt;x&lt;/b&gt;=&lt;i&gt;" in page


def test_cli_writes_the_report_and_prints_its_path(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert (
        main(
            [
                "report",
                "--run",
                str(CACHED_RUNS / "h2o-attention"),
                "--run",
                str(CACHED_RUNS / "tova-summary"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text(encoding="utf-8")
    assert FIGURE_IDS.findall(page) == ["comparison-steps", *(f"run1-{k}" for k in H2O), "run2-occupancy"]


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing run", "is not a run directory."),
        ("not a run", "is not a complete kvlens run: run.json is missing."),
        ("no folder", "does not exist."),
        ("a folder", "is a folder; give a file name ending in .html."),
        ("not html", "--out must end in .html; got 'report.png'."),
        ("unwritable", "(Permission denied)."),
    ],
)
def test_cli_bad_runs_and_outs_are_one_sentence_and_write_nothing(
    tmp_path, capsys, monkeypatch, case, message
):
    run, out = str(CACHED_RUNS / "tova-summary"), tmp_path / "report.html"
    if case == "missing run":
        run = str(tmp_path / "no-such-run")
    elif case == "not a run":
        run = str(tmp_path)
    elif case == "no folder":
        out = tmp_path / "missing" / "report.html"
    elif case == "a folder":
        out = tmp_path
    elif case == "not html":
        out = tmp_path / "report.png"
    else:

        def refuse(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(self))

        monkeypatch.setattr(Path, "write_text", refuse)
    assert main(["report", "--run", run, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert one_sentence(err) and err.rstrip().endswith(message), err
    assert not list(tmp_path.rglob("*.html")) and not list(tmp_path.rglob("*.png"))
