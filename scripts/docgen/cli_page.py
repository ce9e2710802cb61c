"""docs/cli.md: every `kvlens` command from its argparse parser (`kvlens.cli.build_parser()`)."""

from __future__ import annotations

import argparse
import os

from docgen.common import banner, table

WIDTH = "100"  # argparse wraps usage lines to $COLUMNS: fixed, so the page does not depend on the terminal
# What some commands print or write, beyond their options (kept here, beside the page that shows it).
NOTES = {
    "kvlens ppl": (
        "Tokenizes the text with the tokenizer's default special tokens, prefills the first N "
        "tokens, scores token "
        "N from the prefill's last logits, then feeds tokens one at a time, each scored from the "
        "compressed cache. "
        "`--json` prints `policy`, `params`, `budget`, `prefill`, `tokens`, `nll`, `ppl`, "
        "`kv_slots_max` (largest "
        "kept count of any layer and KV head after any compression), `kv_entries_max` (largest "
        "total of kept slots "
        "over every layer and KV head; the bound for policies that give layers or heads "
        "different budgets) and "
        "`kv_entries_budget` (budget x layers x KV heads), `kv_bytes_peak` (largest allocated "
        "K+V bytes after any "
        "compression, padding and the free slots of pages included), `ms_per_token`, `prefill_ms` (the "
        "prompt's forward and "
        "its compression), "
        "and for a policy with replay passes (KVzip) `replay_passes` and `replay_ms`. With `--measure`: "
        "`perturbation_used`, `perturbation_evict`, `attention_loss` and `kl`, with per-layer lists."
    ),
    "kvlens analyze": (
        "`kvlens analyze --list [--json]` lists every kind with the paper figure it reproduces, "
        "what it reads and "
        "its parameters; `kvlens analyze KIND --help` prints a kind's flags. `--json` prints the "
        "numbers behind "
        'the figure, e.g. `kvlens analyze adjacency --run DIR --json` gives `{"layers": L, "query": [...], '
        '"key": [...], "value": [...]}` (per layer, the mean over heads of the adjacent-token cosine '
        "similarity of the prefill states)."
    ),
    "kvlens figure": (
        "Writes FILE (PNG, SVG or PDF in the paper style) with FILE.csv (its data) and FILE.json "
        "(its settings and "
        "the commands that made the run and the figure)."
    ),
    "kvlens report": (
        "One HTML file that opens in any browser without a network (plotly.js inlined once): for "
        "each run its "
        "settings, the exact command, its metrics, evictions and merges per layer, the figures "
        "its record level "
        "allows and the kept text at its last step; with two runs or more, their settings and "
        "metrics side by "
        "side and their per-step curves overlaid. A missing or invalid run folder, or an `--out` "
        "that is not an "
        "`.html` file in an existing folder, is one sentence (exit 2)."
    ),
    "kvlens compare": (
        "`--json` prints one row per policy (its perplexity on the full cache's text, KL, output "
        "perturbation, "
        "attention loss, kept slots, peak KV bytes, `first_divergence`, `top1_agreement`, its "
        "own `generated` "
        "text and `generated_steps`, the tokens of it generated after its divergence) plus "
        "`wall_s` (the whole comparison), `generate_s` (the part spent on the policies' own "
        "texts; "
        "`--no-generate` skips them) and `generation_s` (one plain `kvlens generate` of the full cache "
        "with the same settings, timed before the comparison: `wall_s / generation_s` is its cost in "
        "generations)."
    ),
}


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
        default = (
            ""
            if a.default in (None, argparse.SUPPRESS, False) or a.option_strings == []
            else f"`{a.default}`"
        )
        rows.append([flag, (a.help or "").replace("%%", "%"), default])
    return rows


def usage(parser: argparse.ArgumentParser) -> str:
    lines = (
        parser.format_usage().removeprefix("usage: ").rstrip().splitlines()
    )  # later lines: indented past "usage: "
    return "```\n" + "\n".join([lines[0], *(line[len("usage: ") :] for line in lines[1:])]) + "\n```\n"


def section(level: int, name: str, help_: str, parser: argparse.ArgumentParser, kinds_page: bool) -> str:
    out = (
        f"{'#' * level} {name}\n\n{help_[:1].upper() + help_[1:]}.\n\n"
        if help_
        else f"{'#' * level} {name}\n\n"
    )
    out += usage(parser) + "\n"
    if name in NOTES:
        out += NOTES[name] + "\n\n"
    rows = options(parser)
    if rows:
        out += table(["option", "what it does", "default"], rows) + "\n"
    subs = subcommands(parser)
    if (
        kinds_page and subs
    ):  # analyze / figure: one subcommand per analysis kind, documented on the Analyses page
        out += (
            "One subcommand per analysis kind; each kind's parameters are its flags (see "
            "[Analyses](analyses.md)):\n\n"
        )
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
    out += (
        f"{parser.description} Every command exits with code 2 and one sentence on stderr for bad input; "
        "`kvlens COMMAND --help` prints what this page shows.\n\n"
    )
    out += table(
        ["command", "what it does"], [[f"[`kvlens {n}`](#kvlens-{n})", h] for n, h, _ in subcommands(parser)]
    )
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
