"""`kvlens explain`: which of a policy's removals made the compressed cache get it wrong
(`kvlens.explain`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvlens.cli.common import add_model_args, command_line, load, print_json
from kvlens.errors import KvlensError


def register(sub) -> None:
    p = sub.add_parser(
        "explain",
        help="cache patching: restore each group of a policy's removals from the full "
        "cache and measure how much of the answer's log-probability gap it recovers",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--run", metavar="DIR", help="a measured run (its prompt, policy and budget; needs decisions)"
    )
    src.add_argument(
        "--samples", metavar="FILE.jsonl", help="task samples (`kvlens bench tasks --dump-samples`)"
    )
    p.add_argument("--index", type=int, default=0, help="the sample's line among the file's samples (from 0)")
    p.add_argument("--policy", help="with --samples: the policy (name or `name:key=value,...`)")
    p.add_argument(
        "--ratio",
        type=float,
        help="with --samples: the compression ratio, the share removed (0.75); none for a policy that "
        "keeps its own budget (CORM, kvzap:mode=threshold)",
    )
    p.add_argument(
        "--by",
        default="layer,head,span,kind,sinks,needle",
        help="comma-separated groupings: layer, head (layer x KV head), span, kind (evicted, merged), "
        "sinks, needle (task samples), needle-head (the needle within each layer x KV head)",
    )
    p.add_argument("--span", type=int, default=32, help="tokens per position span (default 32)")
    p.add_argument(
        "--reverse",
        action="store_true",
        help="also remove each group alone from the full cache (what is necessary, not sufficient)",
    )
    p.add_argument(
        "--find-minimal",
        action="store_true",
        help="greedy smallest sufficient set: groups back in order of recovered share until the answer "
        "is right again (samples) or the gap closes to 10 %% (text)",
    )
    p.add_argument(
        "--minimal-by",
        default="head",
        help="the grouping the search adds back (default head; needle-head: the needle's slots only)",
    )
    p.add_argument("--batch", type=int, default=16, help="patched caches per batched forward")
    p.add_argument("--no-chat", action="store_true", help="plain text prompt instead of the chat template")
    p.add_argument("--out", metavar="FILE.json", help="also write the result there (the Why page reads it)")
    p.add_argument("--json", action="store_true")
    add_model_args(p)
    p.set_defaults(func=cmd_explain)


def cmd_explain(args) -> int:
    from kvlens.explain.case import file_sample, run_case, sample_case
    from kvlens.explain.explain import explain
    from kvlens.explain.groups import GROUPINGS, check_span, parse_by

    by = parse_by(args.by)
    check_span(args.span)
    if args.batch < 1:
        raise KvlensError(f"--batch must be at least 1; got {args.batch}.")
    if args.minimal_by not in GROUPINGS:
        raise KvlensError(
            f"Unknown --minimal-by '{args.minimal_by}'; the groupings are {', '.join(GROUPINGS)}."
        )
    if args.samples and args.policy is None:
        raise KvlensError("--samples needs --policy (and --ratio, unless the policy keeps its own budget).")
    if args.run:
        from kvlens.runs.run import load_run

        if load_run(args.run).decisions.empty:  # before the model loads
            raise KvlensError(
                f"The run at {args.run} has no decisions; explain needs a run recorded with them."
            )
    model = load(args)
    t = time.perf_counter()
    if args.run:
        case = run_case(model, args.run)
    else:
        case = sample_case(
            model,
            file_sample(args.samples, args.index),
            args.policy,
            args.ratio,
            not args.no_chat,
            {"samples": args.samples, "index": args.index},
        )
    result = explain(
        case, by, args.span, args.reverse, args.minimal_by if args.find_minimal else None, args.batch
    )
    result["command"] = command_line()
    result["seconds"] = time.perf_counter() - t
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.json:
        print_json(result)
    else:
        print(summary(result))
    return 0


def summary(result: dict) -> str:
    """The result in a few lines: the gap, both ends, the groups that recover most, the minimal set."""
    case, cost = result["case"], result["cost"]
    what = f"sample {case['index']} ({case['task']})" if case["source"] == "sample" else f"run {case['run']}"
    lines = [
        f"{case['policy']} on {what}: log-probability of the full cache's answer {result['lp_full']:.2f} "
        f"(full) vs {result['lp_compressed']:.2f} (compressed), {result['slots_removed']} entries removed",
        f"restore all groups: {result['all_groups']['recovered_share']:.3f} of the gap; "
        f"none: {result['no_groups']['recovered_share']:.3f}",
    ]
    if "full" in result["answers"] and "compressed" in result["answers"]:
        lines.append(
            f"full answer: {result['answers']['full'][:80]!r}; compressed: "
            f"{result['answers']['compressed'][:80]!r}"
        )
    for kind in result["by"]:
        top = sorted((g for g in result["groups"] if g["kind"] == kind), key=lambda g: -g["recovered_share"])[
            :5
        ]
        lines.append(
            f"by {kind}: "
            + ", ".join(f"{g['name']} {g['recovered_share']:.2f} ({g['slots']} slots)" for g in top)
        )
    m = result.get("minimal")
    if m:
        if m["found"]:
            lines.append(
                f"minimal set ({m['by']}): {len(m['groups'])} groups, {m['slots']} of "
                f"{m['slots_removed']} removed slots, in layers {_ranges(m['layers'])} of "
                f"{result['shape']['layers']}"
                f"; recovers {m['recovered_share']:.2f} of the gap"
                + (
                    f"; answer {'right' if m['right'] else 'wrong'}: {m['answer'][:60]!r}"
                    if "right" in m
                    else ""
                )
                + f" ({m['seconds']:.1f} s)"
            )
            lines.append("  " + ", ".join(m["groups"]))
        else:
            lines.append(
                f"minimal set ({m['by']}): none of its groups' prefixes fixes the case ({m['seconds']:.1f} s)"
            )
    lines.append(
        f"cost: {cost['patched_caches']} patched caches, prepare {cost['prepare_s']:.1f} s, scoring "
        f"{cost['score_s']:.1f} s, total {cost['total_s']:.1f} s on {cost['threads']} thread(s)"
    )
    return "\n".join(lines)


def _ranges(values: list[int]) -> str:
    """[9, 10, 11, 12, 15] -> '9-12, 15'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)
