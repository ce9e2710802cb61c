"""`kvlens analyze KIND` (numbers, or JSON with --json), `kvlens figure KIND --out FILE` (image + CSV + JSON)
and `kvlens analyze --list`, all derived from the analysis registry (`kvlens.analysis.registry`), and `kvlens
report --run DIR ... --out FILE.html` (`kvlens.analysis.report`: runs, their metrics and figures in one file).

Each KIND is a subcommand with its own parameters (`kvlens analyze similarity --help`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvlens.cli.common import add_model_args, command_line, load, print_json
from kvlens.errors import KvlensError
from kvlens.figures.wording import suffix

INPUTS = {
    "run": "a run (--run DIR)",
    "runs": "several runs (--run DIR, repeated)",
    "model": "the model, over the bundled texts",
}


def register(sub) -> None:
    from kvlens.analysis.registry import analyses

    known = analyses()
    for command, helptext, func in (
        ("analyze", "compute a paper's analysis and print it (--list: the analyses)", cmd_analyze),
        (
            "figure",
            "export a paper-style figure (.png/.svg/.pdf) with its data (.csv) and config (.json)",
            cmd_figure,
        ),
    ):
        p = sub.add_parser(command, help=helptext, description=helptext)
        p.add_argument(
            "--list", action="store_true", help="list the analyses, their paper figures and parameters"
        )
        p.add_argument("--json", action="store_true", help="print JSON (with --list: the list)")
        kinds = p.add_subparsers(
            dest="kind",
            metavar="KIND",
            parser_class=type(p),
            help=", ".join(f"{name} ({cls.paper})" for name, cls in known.items()),
        )
        for name, cls in known.items():
            _add_kind(kinds, name, cls, command)
        p.set_defaults(func=func)
    helptext = "write one self-contained HTML report of runs: settings, command, metrics, figures, kept text"
    p = sub.add_parser(
        "report", help=helptext, description=helptext + "; it opens offline (plotly.js inlined)."
    )
    p.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="DIR",
        help="recorded run; repeat for several (compared side by side first)",
    )
    p.add_argument(
        "--explain",
        action="append",
        default=[],
        metavar="FILE.json",
        help="a `kvlens explain --out` result (the Why page's figures); repeat for several",
    )
    p.add_argument("--out", required=True, metavar="FILE.html", help="the report to write")
    p.set_defaults(func=cmd_report)


def _add_kind(kinds, name: str, cls, command: str) -> None:
    level = (
        ""
        if cls.inputs == "model"
        else f", recorded with --record {cls.level} or more" + " and --measure" * cls.measured
    )
    replays = "; replays the run's tokens through its model" * cls.replays
    k = kinds.add_parser(
        name,
        help=cls.paper,
        description=f"{name}: {cls.paper}. Reads {INPUTS[cls.inputs]}{level}"
        f"{replays}. {cls.see_also}".strip(),
    )
    if cls.inputs != "model":
        k.add_argument(
            "--run",
            action="append",
            default=[],
            metavar="DIR",
            help="recorded run" + "; repeat for several" * (cls.inputs == "runs"),
        )
    for prm in cls.params:
        k.add_argument(
            prm.flag,
            dest=f"param_{prm.name}",
            metavar=prm.name.upper(),
            default=argparse.SUPPRESS,
            type=_flag_type(prm),
            action="append" if prm.many else "store",
            help=prm.help + _shown_default(prm.default),
        )
    if cls.inputs == "model":
        add_model_args(k)
    if cls.replays:
        k.add_argument(
            "--device",
            default="auto",
            help="where to run the run's model: auto (CUDA, MPS, CPU), cpu, cuda, cuda:N or mps",
        )
        k.add_argument("--dtype", help="the model's dtype (default: the run's)")
    if command == "analyze":
        k.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    else:
        k.add_argument(
            "--out",
            required=True,
            help="FILE.png, .svg or .pdf (FILE.csv and FILE.json are written beside it)",
        )
        k.add_argument("--scale", type=float, default=2.0, help="PNG pixel scale")


def _flag_type(prm):
    """argparse's `type` for a parameter's flag: one item of its kind (checked with the others before
    loading)."""

    def parse(text: str):
        try:
            return prm.parse_item(text)
        except KvlensError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _source(args, inputs: str):
    """What the analysis reads: the loaded run(s), or the model."""
    from kvlens.runs.run import load_run

    if inputs == "model":
        return load(args)
    if not args.run:
        raise KvlensError(f"`{args.kind}` needs --run DIR (a recorded run).")
    if len(args.run) > 1 and inputs == "run":
        raise KvlensError(f"`{args.kind}` takes one --run; only analyses of several runs take more.")
    runs = [load_run(path) for path in args.run]
    return runs if inputs == "runs" else runs[0]


def _call(args, fn):
    """`fn(kind, source, **params)` with the parameters given on the command line (checked before
    anything is loaded)."""
    from kvlens.analysis.registry import checked_params, get_analysis, lacks, replay_model

    if args.kind is None:
        raise KvlensError("Name an analysis KIND (see `kvlens analyze --list`).")
    params = {k.removeprefix("param_"): v for k, v in vars(args).items() if k.startswith("param_")}
    checked_params(args.kind, **params)
    analysis = get_analysis(args.kind)
    source = _source(args, analysis.inputs)
    if analysis.replays:
        if why := lacks(analysis, source):  # before the model loads
            raise KvlensError(why)
        params["model"] = replay_model(source, args.device, args.dtype)
    return fn(args.kind, source, **params)


def _print_list(as_json: bool) -> None:
    from kvlens.analysis.registry import analyses

    described = [cls.describe() for cls in analyses().values()]
    if as_json:
        print_json(described)
        return
    for d in described:
        needs = (
            INPUTS[d["inputs"]]
            + suffix(" at --record {}", d["level"])
            + ", made with --measure" * d["measured"]
            + ", and replays it" * d["replays"]
        )
        print(f"{d['name']:<20} {d['paper']}; reads {needs}")
        for p in d["params"]:
            print(f"{'':<4}{p['flag']:<13} {p['help']}{_shown_default(p['default'])}")


def _shown_default(default) -> str:
    """A parameter's default, as its help ends (none when it has none)."""
    return "" if default in (None, ()) else f" (default {default})"


def _print_text(result: dict) -> None:
    """A compact human rendering: scalars as they are, number lists rounded."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, list) and len(v) > 12:
            return f"[{', '.join(fmt(x) for x in v[:8])}, ..., {fmt(v[-1])}] ({len(v)} values)"
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {fmt(x)}" for k, x in v.items()) + "}"
        return str(v)

    for key, value in result.items():
        if key in ("matrix", "edges"):
            print(f"{key:<16} {len(value)} rows (use --json or `kvlens figure` for the values)")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for item in value:
                print(f"{key:<16} {fmt(item)}")
        else:
            print(f"{key:<16} {fmt(value)}")


def cmd_analyze(args) -> int:
    from kvlens.analysis.registry import analysis_json, get_analysis

    if args.list:
        _print_list(args.json)
        return 0
    result = _call(args, analysis_json)
    if args.json:
        print_json(result)
        return 0
    text = get_analysis(args.kind).text(result)
    if text is None:
        _print_text(result)
    else:
        print(text)
    return 0


def cmd_figure(args) -> int:
    from pathlib import Path

    from kvlens.analysis.registry import analysis_figure
    from kvlens.figures.export import export_figure

    if args.list:
        _print_list(args.json)
        return 0
    if args.kind is not None and Path(args.out).suffix.lower() not in (
        ".png",
        ".svg",
        ".pdf",
        ".csv",
        ".json",
    ):
        raise KvlensError(
            f"--out must end in .png, .svg or .pdf (or .csv/.json for data only); got '{args.out}'."
        )
    fig = _call(args, analysis_figure)
    for path in export_figure(fig, args.out, args.scale, command_line()):
        print(path)
    return 0


def read_explain(path: str) -> dict:
    """A `kvlens explain --out` file, or one sentence."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise KvlensError(f"{path} is not a readable kvlens explain result (JSON).") from None
    if not isinstance(result, dict) or not {"case", "groups", "all_groups", "no_groups"} <= set(result):
        raise KvlensError(
            f"{path} is not a kvlens explain result (it lacks case, groups, all_groups, no_groups)."
        )
    return result


def cmd_report(args) -> int:
    from kvlens.analysis.report import checked_out, write_report
    from kvlens.runs.run import load_run

    out = checked_out(args.out)  # before the runs are loaded: a bad --out fails at once
    if not args.run and not args.explain:
        raise KvlensError("A report needs at least one --run or --explain.")
    explained = [read_explain(path) for path in args.explain]
    print(write_report([load_run(path) for path in args.run], out, explained))
    return 0
