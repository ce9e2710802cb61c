"""docs/cli.md: every `kvlens` command from its argparse parser (`kvlens.cli.build_parser()`)."""
from __future__ import annotations

import argparse
import os

from docgen.common import banner, table

WIDTH = "100"  # argparse wraps usage lines to $COLUMNS: fixed, so the page does not depend on the terminal


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand of `parser`, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def options(parser: argparse.ArgumentParser) -> list[list[str]]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flag = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.metavar or a.dest}`"
        default = "" if a.default in (None, argparse.SUPPRESS, False) or a.option_strings == [] else f"`{a.default}`"
        rows.append([flag, (a.help or "").replace("%%", "%"), default])
    return rows


def usage(parser: argparse.ArgumentParser) -> str:
    lines = parser.format_usage().removeprefix("usage: ").rstrip().splitlines()  # later lines: indented past "usage: "
    return "```\n" + "\n".join([lines[0], *(line[len("usage: "):] for line in lines[1:])]) + "\n```\n"


def section(level: int, name: str, help_: str, parser: argparse.ArgumentParser, kinds_page: bool) -> str:
    out = f"{'#' * level} {name}\n\n{help_[:1].upper() + help_[1:]}.\n\n" if help_ else f"{'#' * level} {name}\n\n"
    out += usage(parser) + "\n"
    rows = options(parser)
    if rows:
        out += table(["option", "what it does", "default"], rows) + "\n"
    subs = subcommands(parser)
    if kinds_page and subs:  # analyze / figure: one subcommand per analysis kind, documented on the Analyses page
        out += ("One subcommand per analysis kind; each kind's parameters are its flags (see "
                "[Analyses](analyses.md)):\n\n")
        out += table(["kind", "reproduces"], [[f"[`{n}`](analyses.md#{n})", h] for n, h, _ in subs]) + "\n"
    else:
        for sub_name, sub_help, sub in subs:
            out += section(level + 1, f"{name} {sub_name}", sub_help, sub, False)
    return out


def page() -> str:
    os.environ["COLUMNS"] = WIDTH
    from kvlens.cli import build_parser

    parser = build_parser()
    out = banner("the argparse parsers (`kvlens.cli.build_parser()`)") + "# Command line\n\n"
    out += (f"{parser.description} Every command exits with code 2 and one sentence on stderr for bad input; "
            "`kvlens COMMAND --help` prints what this page shows.\n\n")
    out += table(["command", "what it does"], [[f"[`kvlens {n}`](#kvlens-{n})", h] for n, h, _ in subcommands(parser)])
    out += "\n"
    for name, help_, sub in subcommands(parser):
        out += section(2, f"kvlens {name}", help_, sub, name in ("analyze", "figure"))
    return out


def commands() -> list[str]:
    """Every command and subcommand the page must have a section for (`kvlens bench ppl`, ...)."""
    from kvlens.cli import build_parser

    out = []
    for name, _, sub in subcommands(build_parser()):
        out.append(f"kvlens {name}")
        if name not in ("analyze", "figure"):
            out += [f"kvlens {name} {s}" for s, _, _ in subcommands(sub)]
    return out
