"""The `kvlens` command. Each module in COMMAND_MODULES adds its subcommands via `register(sub)`.

Bad input exits with code 2 and one sentence on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvlens.errors import Cancelled, KvlensError, one_line

COMMAND_MODULES = [
    "kvlens.cli.run_commands",
    "kvlens.cli.sweep_commands",
    "kvlens.cli.analysis_commands",
    "kvlens.cli.bench_commands",
    "kvlens.cli.compare_commands",
    "kvlens.cli.explain_commands",
    "kvlens.cli.eval_commands",
    "kvlens.cli.scorer_commands",
]


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one sentence (exit 2)."""

    def error(self, message):
        self.exit(2, f"kvlens: error: {one_line(message)} (see `{self.prog} --help`).\n")


def build_parser() -> Parser:
    parser = Parser(prog="kvlens", description="See what KV-cache compression does to a language model.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KvlensError as err:
        print(f"kvlens: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except (Cancelled, KeyboardInterrupt):
        print("kvlens: stopped; nothing was saved.", file=sys.stderr)
        return 130
    except MemoryError:
        print(
            "kvlens: error: out of memory; try a shorter text, fewer tokens or a smaller model.",
            file=sys.stderr,
        )
        return 2
    except RuntimeError as err:
        if "out of memory" in str(err).lower():
            print(
                f"kvlens: error: out of memory ({str(err).splitlines()[0][:160]}); "
                "try a shorter text or a smaller model.",
                file=sys.stderr,
            )
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
