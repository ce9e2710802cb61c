"""`kvlens bench tasks|frontier|speed|ppl|needle`: paper-style tables and figures, saved under results/ for
the app."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from kvlens.cli.common import add_model_args, add_storage_args, command_line, load, print_json
from kvlens.cli.sweep_commands import add_executor_args, run_cells
from kvlens.errors import KvlensError
from kvlens.experiments.bench.ruler import SUITE
from kvlens.policies import policy_names

ALL_POLICIES = ";".join(policy_names())
DEFAULT_TASK_POLICIES = ";".join(n for n in policy_names() if n != "full")
# vt and cwe are left out: the full cache of the embedded model scores under 20 % on them (README, "Task
# accuracy")
DEFAULT_TASKS = "niah_single,niah_multikey,niah_multivalue,niah_multiquery,fwe"


def register(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmarks: task accuracy, quality at equal bytes, speed and memory, "
        "perplexity, needle in a haystack",
    )
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH", parser_class=type(bench))
    _register_ppl(bsub)
    _register_needle(bsub)
    _register_tasks(bsub)
    _register_frontier(bsub)
    _register_speed(bsub)


def _register_ppl(bsub) -> None:
    """`kvlens bench ppl`: perplexity."""
    p = bsub.add_parser("ppl", help="teacher-forced perplexity, policies x budgets x bundled texts")
    _common(p, ALL_POLICIES)
    p.add_argument(
        "--budgets", default="0.5,0.25,64", help="comma-separated slots (64) or prompt shares (0.5)"
    )
    p.add_argument("--texts", type=int, default=3, help="how many bundled texts (default 3)")
    p.add_argument("--prefill", type=int, default=384)
    p.add_argument("--tokens", type=int, default=96, help="tokens scored after the prefill")
    add_executor_args(p)
    p.set_defaults(func=cmd_ppl)
    _quick(p, policies="full;streaming_llm;h2o;cam", budgets="0.5", texts=2, prefill=192, tokens=32)


def _register_needle(bsub) -> None:
    """`kvlens bench needle`: needle in a haystack."""
    p = bsub.add_parser("needle", help="needle in a haystack: context length x depth heatmap per policy")
    _common(p, "full;streaming_llm;h2o;tova;cam;weightedkv;kvmerger")
    p.add_argument("--lengths", default="256,512,1024", help="comma-separated context lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="comma-separated needle depths in [0, 1]")
    p.add_argument("--budget", default="0.5", help="budget of the compressing policies (slots or share)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--no-chat", action="store_true", help="plain text prompt instead of the chat template")
    add_executor_args(p)
    p.set_defaults(func=cmd_needle)
    _quick(p, policies="full;streaming_llm;h2o", lengths="256,512", depths="0.5,1")


def _register_tasks(bsub) -> None:
    """`kvlens bench tasks`: task accuracy."""
    p = bsub.add_parser(
        "tasks", help="task accuracy (RULER-style) under compression: policies x ratios x tasks x lengths"
    )
    _common(p, DEFAULT_TASK_POLICIES)
    p.add_argument(
        "--ratios",
        default="0.25,0.5,0.75,0.875",
        help="comma-separated compression ratios: the share of the context removed (kvpress's)",
    )
    p.add_argument(
        "--tasks",
        help=f"comma-separated tasks (default: {DEFAULT_TASKS}; all: "
        "niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe,fwe)",
    )
    p.add_argument("--lengths", help="comma-separated context lengths in tokens (default 1024,2048,4096)")
    p.add_argument("--count", type=int, help=f"samples per task and length (default {SUITE['count']})")
    p.add_argument("--seed", type=int, default=SUITE["seed"], help="seed of the generated samples")
    p.add_argument(
        "--samples",
        metavar="FILE.jsonl",
        help='your own samples instead, one {"context", "question", "answers", "task"} per line, or a '
        "kvpress benchmark file (.parquet or JSON lines with its columns), scored with kvpress's metric",
    )
    p.add_argument("--dump-samples", metavar="FILE.jsonl", help="write the generated samples there and stop")
    p.add_argument(
        "--query-aware",
        action="store_true",
        help="compress context and question together (SnapKV's setting) instead of the context alone",
    )
    p.add_argument("--no-chat", action="store_true", help="plain text prompt instead of the chat template")
    p.add_argument(
        "--full-answers",
        action="store_true",
        help="generate every answer to the task's length limit (default: stop once every expected "
        "string is in it, which leaves the score unchanged)",
    )
    p.add_argument(
        "--rounding",
        choices=("kvpress", "kvlens"),
        default=SUITE["rounding"],
        help="kept slots at a ratio: kvpress's int(T * (1 - ratio)) (default), or kvlens's earlier "
        "T - int(T * ratio), one more when T * ratio is not whole",
    )
    p.add_argument(
        "--depths",
        choices=("stratified", "random"),
        default=SUITE["depths"],
        help="needle depths: sample i of n in the i-th n-th of the context (default), or RULER's "
        "uniformly random boundaries (the samples made before this option)",
    )
    p.add_argument(
        "--one-by-one",
        action="store_true",
        help="answer from each compressed cache in turn (default: all of a sample's caches in one batch "
        "per token; the same answers up to float rounding, several times faster)",
    )
    add_executor_args(p)
    p.set_defaults(func=cmd_tasks)
    # quick: 2 local workers when there are 2 CPUs (decoding a small model uses them better than 2 threads)
    _quick(
        p,
        policies="full;streaming_llm;snapkv;cam",
        ratios="0.5,0.875",
        tasks="niah_single,vt",
        lengths="1024",
        count=5,
        workers=2 if (os.cpu_count() or 1) >= 2 else None,
    )
    p.set_defaults(
        parser_defaults={
            **p.get_default("parser_defaults"),
            "tasks": DEFAULT_TASKS,
            "lengths": "1024,2048,4096",
            "count": SUITE["count"],
        }
    )


def _register_frontier(bsub) -> None:
    """`kvlens bench frontier`: quality at equal bytes."""
    p = bsub.add_parser(
        "frontier",
        help="perplexity and task score against KV bytes: eviction, merging, "
        "quantized and low-rank storage, and their mixes at equal bytes",
    )
    p.add_argument(
        "--byte-shares",
        default="0.5,0.25,0.125",
        help="comma-separated byte budgets, shares of the full cache's bytes (default 0.5,0.25,0.125)",
    )
    p.add_argument(
        "--evict", default="h2o;tova;snapkv;kvzip;kvzap", help="';'-separated eviction policies ('' for none)"
    )
    p.add_argument("--merge", default="cam;weightedkv", help="';'-separated merging policies ('' for none)")
    p.add_argument("--bits", default="8,4,2", help="quantization alone: every slot at these bits")
    p.add_argument("--mix", default="h2o", help="the eviction policy of the mixes ('' for none)")
    p.add_argument("--mix-bits", default="8,4", help="the mixes' bits")
    p.add_argument(
        "--rank-layers",
        type=int,
        default=4,
        help="the cross-layer low-rank cells' group of adjacent layers (xKV-4, the paper's largest "
        "group; 0: no cross-layer cells)",
    )
    add_storage_args(p, bits=False)
    p.add_argument("--texts", type=int, default=3, help="how many bundled texts (default 3)")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64, help="tokens scored after the prefill")
    p.add_argument(
        "--task-count",
        type=int,
        default=2,
        help="task samples per task and length, scored as `bench tasks` does (0: perplexity only)",
    )
    p.add_argument(
        "--tasks", default="niah_single,niah_multikey", help="comma-separated tasks of the task cells"
    )
    p.add_argument("--task-lengths", default="1024", help="comma-separated context lengths of the task cells")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated task samples")
    _common(p, None)
    add_executor_args(p)
    p.set_defaults(func=cmd_frontier)
    _quick(
        p,
        byte_shares="0.25,0.125",
        evict="h2o",
        merge="cam",
        bits="4",
        mix_bits="8",
        texts=2,
        prefill=256,
        tokens=32,
        task_count=0,
    )


def _register_speed(bsub) -> None:
    """`kvlens bench speed`: speed and memory."""
    p = bsub.add_parser("speed", help="prefill, ms/token, KV bytes, peak memory per policy; target ratios")
    _common(p, ALL_POLICIES)
    p.add_argument("--lengths", default="256,1024,2048", help="comma-separated prompt lengths")
    p.add_argument("--steps", type=int, default=32, help="generated tokens per run")
    p.add_argument(
        "--budget", type=float, default=0.5, help="share of the prompt kept by compressing policies"
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats of each side of each ratio")
    p.add_argument("--ratio-length", type=int, default=1024, help="prompt length the ratios are measured at")
    p.add_argument(
        "--evict-lengths",
        default="1024,4096,8192",
        help="prompt lengths of the evict_half_vs_full ratios (capped at the context minus --steps)",
    )
    p.add_argument(
        "--lockstep",
        default="all",
        help="policies measured against full in the evict lockstep for the every_policy_* ratios: 'all' "
        "(every registered policy), a comma-separated list, or 'none'",
    )
    p.add_argument(
        "--group",
        type=int,
        default=6,
        help="policies per group of the evict lockstep, each group run alone beside its own full cache and "
        "floors, so that only one group's caches are alive at a time (0: every policy in one lockstep)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on with the run cut short whose streams (bench_speed.rows.jsonl, .lengths.jsonl) are in "
        "--out-dir: its rows and finished lengths are kept, the rest is measured (same settings only)",
    )
    p.set_defaults(func=cmd_speed)
    _quick(
        p,
        policies="full;streaming_llm;h2o;cam",
        lengths="256,1024",
        steps=16,
        repeats=3,
        ratio_length=512,
        evict_lengths="1024,4096",
    )


def _quick(p, **settings) -> None:
    """Register the --quick settings; the options they cover default to None so that a value
    given on the command line (even one equal to the default) always wins."""
    p.set_defaults(quick_args=settings, parser_defaults={k: p.get_default(k) for k in settings})
    p.set_defaults(**{k: None for k in settings})


def _common(p, policies: str | None) -> None:
    if policies is not None:
        p.add_argument(
            "--policies",
            default=policies,
            help=f"policies separated by ';' (or ',' between them), each `name` or `name:key=value,...` "
            f"(default: {policies})",
        )
    p.add_argument(
        "--quick", action="store_true", help="small settings (minutes); results go to *_quick files"
    )
    p.add_argument("--out-dir", default="results", help="where JSON, CSV and PNG go (default results/)")
    p.add_argument("--no-figure", action="store_true", help="skip the PNG (needs Chromium)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    add_model_args(p)


def _apply_quick(args) -> str:
    """Fill settings not given on the command line (quick or default ones); returns the file stem suffix."""
    chosen = args.quick_args if args.quick else args.parser_defaults
    for key, value in chosen.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return "_quick" * args.quick


def _finish(args, result: dict, rows: list[dict], stem: str, text: str) -> int:
    """Save a benchmark that has no figure (its result, rows and table), then show its table or JSON."""
    from kvlens.experiments.bench.common import save_results

    result["command"] = command_line()
    paths = save_results(result, rows, None, args.out_dir, stem)
    if args.json:
        print_json(result)
    else:
        print(text)
        print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_grid(
    args,
    cells: list[dict],
    texts: dict[str, str],
    config: dict,
    stem: str,
    summarise,
    figure,
    table,
    implied: dict | None = None,
    complete=None,
    figures: tuple = (),
) -> int:
    """Run a benchmark's cells (resumable, on the chosen executor), then add its summary, figure and table.
    `implied`: what older rows lacking a cell field had (`grid.Results`); `complete(rows)`: fills in what
    older rows lack; `figures`: more (file stem suffix, figure of the result or None) pairs."""
    from kvlens.experiments.bench.common import environment
    from kvlens.experiments.grid import report
    from kvlens.figures.export import image_bytes

    executor = f"{args.workers} processes" if args.workers else "in-process"
    if args.ray is not None:
        executor = "ray"
    settings = {
        "command": command_line(),
        "config": config,
        "environment": {**environment(), "model": args.model, "executor": executor},
    }
    results = run_cells(args, Path(args.out_dir) / f"{stem}.json", cells, texts, settings, stem, implied)
    if complete is not None:
        complete(results.ordered())
    result = {**settings, "rows": results.ordered(), "summary": summarise(results.ordered())}
    results.write({"summary": result["summary"]})
    paths = [results.path, results.path.with_suffix(".csv")]
    if not args.no_figure and result["rows"]:
        paths.append(results.path.with_suffix(".png"))
        paths[-1].write_bytes(image_bytes(figure(result), "png"))
        for suffix, build in figures:
            fig = build(result)
            if fig is not None:
                paths.append(results.path.with_name(f"{stem}{suffix}.png"))
                paths[-1].write_bytes(image_bytes(fig, "png"))
    if args.json:
        print_json(result)
    else:
        print(table(result))
        print("\n" + "\n".join(report(results)) + "\nwrote " + ", ".join(str(p) for p in paths))
    return int(bool(results.failed))


def cmd_ppl(args) -> int:
    from kvlens import texts as bundled
    from kvlens.experiments.bench import ppl
    from kvlens.experiments.bench.common import parse_policies
    from kvlens.experiments.sweep import plan_ppl
    from kvlens.lists import parse_list
    from kvlens.policies import parse_budget

    suffix = _apply_quick(args)
    policies = parse_policies(args.policies)
    budgets = parse_list(args.budgets, "--budgets", kind=parse_budget)
    if args.prefill < 1 or args.tokens < 1 or args.texts < 1:
        raise KvlensError("--prefill, --tokens and --texts must all be at least 1.")
    texts = bundled.bundled(args.texts, min_chars=8 * (args.prefill + args.tokens))
    cells = plan_ppl(
        [(p.name, dict(p.params)) for p in policies],
        budgets,
        texts,
        [args.prefill],
        tokens=args.tokens,
        model=args.model,
    )
    config = {
        "policies": [p.label for p in policies],
        "budgets": budgets,
        "texts": list(texts),
        "prefill": args.prefill,
        "tokens": args.tokens,
    }
    return _run_grid(
        args,
        cells,
        texts,
        config,
        "bench_ppl" + suffix,
        ppl.summarise,
        ppl.figure,
        lambda result: ppl.markdown_table(result["summary"]),
    )


def cmd_frontier(args) -> int:
    from kvlens import texts as bundled
    from kvlens.cli.common import storage
    from kvlens.experiments.bench import frontier, tasks
    from kvlens.experiments.bench.common import parse_policies
    from kvlens.lists import parse_list

    suffix = _apply_quick(args)
    shares = parse_list(args.byte_shares, "--byte-shares", kind=float)
    bits = parse_list(args.bits, "--bits", kind=int) if args.bits else []
    mix_bits = parse_list(args.mix_bits, "--mix-bits", kind=int) if args.mix_bits else []
    if any(b not in (2, 4, 8) for b in bits + mix_bits):
        raise KvlensError("--bits and --mix-bits take 2, 4 and 8.")
    if args.prefill < 1 or args.tokens < 1 or args.texts < 1:
        raise KvlensError("--prefill, --tokens and --texts must all be at least 1.")
    specs = {
        name: [(p.name, dict(p.params)) for p in parse_policies(text)] if text.strip() else []
        for name, text in (("evict", args.evict), ("merge", args.merge), ("mix", args.mix))
    }
    args.kv_bits = 4  # the scheme, group and window of every quantized cell
    if args.task_count < 0:
        raise KvlensError("--task-count must be 0 (perplexity only) or more.")
    if args.rank_layers < 0:
        raise KvlensError("--rank-layers must be 0 (no cross-layer low rank) or more.")
    texts = bundled.bundled(args.texts, min_chars=8 * (args.prefill + args.tokens))
    families = dict(
        evictors=specs["evict"],
        mergers=specs["merge"],
        bits=bits,
        mix=specs["mix"][0] if specs["mix"] else None,
        mix_bits=mix_bits,
        storage=storage(args),
        rank_layers=args.rank_layers or None,
    )
    cells = frontier.plan_frontier(
        shares, texts, prefill=args.prefill, tokens=args.tokens, model=args.model, **families
    )
    names, lengths, haystack = [], [], {}  # the task cells' (none without them)
    if args.task_count:
        names = parse_list(args.tasks, "--tasks", kind=str)
        lengths = parse_list(args.task_lengths, "--task-lengths", minimum=1)
        haystack = {"haystack": " ".join(bundled.bundled().values())}
        cells += frontier.plan_frontier_tasks(
            shares,
            tasks=names,
            lengths=lengths,
            count=args.task_count,
            seed=args.seed,
            source=tasks.digest(haystack["haystack"]),
            model=args.model,
            **families,
        )
    config = {
        "byte_shares": shares,
        "evict": args.evict,
        "merge": args.merge,
        "bits": bits,
        "mix": args.mix,
        "mix_bits": mix_bits,
        "rank_layers": args.rank_layers,
        "storage": storage(args).describe(),
        "texts": list(texts),
        "prefill": args.prefill,
        "tokens": args.tokens,
        "tasks": names,
        "task_lengths": lengths,
        "task_count": args.task_count,
        "seed": args.seed,
    }
    texts = {**texts, **haystack}
    return _run_grid(
        args,
        cells,
        texts,
        config,
        "bench_frontier" + suffix,
        frontier.summarise,
        frontier.figure,
        lambda result: frontier.table(result["summary"]),
    )


def cmd_needle(args) -> int:
    from kvlens import texts as bundled
    from kvlens.experiments.bench import needle
    from kvlens.experiments.bench.common import parse_policies
    from kvlens.lists import parse_list
    from kvlens.policies import parse_budget

    suffix = _apply_quick(args)
    policies = parse_policies(args.policies)
    lengths = parse_list(args.lengths, "--lengths", minimum=1)
    depths = parse_list(args.depths, "--depths", kind=float, minimum=0, maximum=1)
    if args.max_new_tokens < 1:
        raise KvlensError("--max-new-tokens must be at least 1.")
    texts = {"haystack": " ".join(bundled.bundled().values())}
    budget = parse_budget(args.budget)
    cells = needle.plan_needle(
        [(p.name, dict(p.params)) for p in policies],
        lengths,
        depths,
        budget=budget,
        filler_text=texts["haystack"],
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        chat=not args.no_chat,
    )
    config = {
        "policies": [p.label for p in policies],
        "lengths": lengths,
        "depths": depths,
        "budget": budget,
        "needle": needle.NEEDLE,
        "question": needle.QUESTION,
        "answer": needle.ANSWER,
        "chat": not args.no_chat,
        "max_new_tokens": args.max_new_tokens,
    }

    def table(result):
        return "\n".join(
            f"{s['policy']:<16} found {s['score']:.0%}  by length "
            + ", ".join(f"{n}: {v:.0%}" for n, v in s["by_length"].items())
            for s in result["summary"]
        )

    return _run_grid(
        args, cells, texts, config, "bench_needle" + suffix, needle.summarise, needle.figure, table
    )


def cmd_speed(args) -> int:
    from kvlens import texts as bundled
    from kvlens.experiments.bench import speed
    from kvlens.experiments.bench.common import parse_policies
    from kvlens.figures.speed import met_text
    from kvlens.lists import parse_list
    from kvlens.progress import Progress

    suffix = _apply_quick(args)
    policies = parse_policies(args.policies)
    lengths = parse_list(args.lengths, "--lengths", minimum=1)
    evict_lengths = parse_list(args.evict_lengths, "--evict-lengths", minimum=1)
    if not 0 < args.budget <= 1 or args.repeats < 1 or args.steps < 2 or args.group < 0:
        raise KvlensError(
            "--budget must be in (0, 1], --repeats at least 1, --steps at least 2 and --group at least 0."
        )
    text = bundled.read(bundled.ids()[0])  # the longest-running address (1946 Truman, ~40k tokens)
    every = _lockstep(args.lockstep)
    ticks = speed.ticks(len(policies), lengths, args.repeats, evict_lengths, every, args.group)
    bar = Progress("bench speed", ticks, "measurement", log=True)
    settings = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "policies": [p.label for p in policies],
        "lengths": lengths,
        "steps": args.steps,
        "budget": args.budget,
        "repeats": args.repeats,
        "ratio_length": args.ratio_length,
        "evict_lengths": evict_lengths,
        "lockstep": every,
        "group": args.group,
    }
    streams = {kind: Path(args.out_dir) / f"bench_speed{suffix}.{kind}.jsonl" for kind in ("rows", "lengths")}
    done = _speed_streams(streams, settings, args.resume, Path(args.out_dir) / f"bench_speed{suffix}.json")
    model = load(args)

    def append(kind: str, item: dict) -> None:
        with streams[kind].open("a", encoding="utf-8") as f:
            f.write(json.dumps(item) + "\n")

    with bar:
        result = speed.bench_speed(
            model,
            policies,
            lengths,
            text=text,
            steps=args.steps,
            budget=args.budget,
            repeats=args.repeats,
            ratio_length=args.ratio_length,
            evict_lengths=evict_lengths,
            every=every,
            group=args.group,
            tick=bar.advance,
            on_row=functools.partial(append, "rows"),
            on_length=functools.partial(append, "lengths"),
            done_rows=done["rows"],
            done_lengths=done["lengths"],
        )
    lines = [speed.markdown_table(result), ""]
    for key, value in result["ratios"].items():
        verdict = result["targets"].get(key)
        cpu = result["ratios_cpu"].get(key)
        worst = result["ratio_details"].get(key, {}).get("worst")
        lines.append(
            f"{key:<38} {value:.3f}"
            + (f"  target {verdict['target']}, met: {met_text(verdict)}" if verdict else "")
            + (f"  (worst: {worst})" if worst else "")
            + (f"  (CPU time: {cpu:.3f})" if cpu is not None else "")
        )
    return _finish(args, result, result["rows"], "bench_speed" + suffix, "\n".join(lines))


def _speed_streams(
    streams: dict[str, Path], settings: dict, resume: bool, final: Path
) -> dict[str, list[dict]]:
    """Each row, and each evict length's ratios, go to `streams` as soon as measured, after a first line with
    the run's `settings`: a run cut short keeps what it finished. Started afresh (never over the measurements
    of a run cut short, `_cut_short`), or with `resume` read back (what they hold, by kind) when they hold a
    run of the same settings; else one sentence says why not."""
    if not resume:
        if (held := _cut_short(streams, final)) is not None:
            raise KvlensError(
                f"{held} holds the measurements of a run cut short; go on with it with --resume, or move "
                "its streams away to start afresh."
            )
        for path in streams.values():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"settings": settings}) + "\n", encoding="utf-8")
        return {kind: [] for kind in streams}
    done = {}
    for kind, path in streams.items():
        items = _json_lines(path)
        if not items or not isinstance(items[0], dict) or items[0].get("settings") is None:
            raise KvlensError(
                f"{path} holds no run of `kvlens bench speed` to resume; run it without --resume."
            )
        if items[0]["settings"] != json.loads(json.dumps(settings)):
            raise KvlensError(
                f"{path} holds a run with other settings than these, so it cannot be resumed; run with its "
                f"settings ({json.dumps(items[0]['settings'])}) or without --resume."
            )
        path.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
        done[kind] = items[1:]
    return done


def _cut_short(streams: dict[str, Path], final: Path) -> Path | None:
    """The first stream that holds measurements its finished result `final` does not (a run cut short), else
    None. A finished run's streams hold exactly its result's rows and evict lengths, whatever the files' times
    (a clone writes them in any order); a stream that cannot be read is a run cut short."""
    try:
        result = json.loads(final.read_text(encoding="utf-8")) if final.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        result = None
    result = result if isinstance(result, dict) else {}
    finished = {"rows": result.get("rows"), "lengths": result.get("config", {}).get("evict_lengths")}
    for kind, path in streams.items():
        try:
            items = [
                item for item in _json_lines(path) if not (isinstance(item, dict) and "settings" in item)
            ]
        except KvlensError:
            return path
        measured = items if kind == "rows" else [isinstance(x, dict) and x.get("evict_length") for x in items]
        if measured and measured != finished[kind]:
            return path
    return None


def _json_lines(path: Path) -> list:
    """The items of a run's stream (none when the file is missing), a last line cut short by the run's
    interruption left out; any other line that is not JSON is named in one sentence."""
    from kvlens.jsonl import json_lines

    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        return [item for _, item in json_lines(text, path, cut_short=True)]
    except KvlensError as err:
        raise KvlensError(f"{str(err).rstrip('.')}, so the run cannot be resumed.") from None


def _lockstep(text: str) -> list[str]:
    """`--lockstep`: every registered policy but full for 'all', none for 'none', else the named ones."""
    from kvlens.policies import policy_names

    known = [name for name in policy_names() if name != "full"]
    named = {"all": known, "none": []}
    if text.strip() in named:
        return named[text.strip()]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise KvlensError(
            f"--lockstep takes 'all', 'none' or policies among {', '.join(known)}; got '{text}'."
        )
    return names


def cmd_tasks(args) -> int:
    from kvlens import texts as bundled
    from kvlens.experiments.bench import ruler, tasks
    from kvlens.experiments.bench.common import parse_policies
    from kvlens.lists import parse_list

    suffix = _apply_quick(args)
    policies = parse_policies(args.policies)
    ratios = parse_list(args.ratios, "--ratios", kind=float)
    if args.count < 1:
        raise KvlensError("--count must be at least 1.")
    settings = dict(
        model=args.model,
        query_aware=args.query_aware,
        chat=not args.no_chat,
        stop_when_found=not args.full_answers,
        batch=not args.one_by_one,
        rounding=args.rounding,
    )
    if args.samples:
        from kvlens.experiments.bench import kvpress_format

        kvpress = kvpress_format.is_kvpress(args.samples)
        text = kvpress_format.to_jsonl(args.samples) if kvpress else ruler.read_text(args.samples)
        samples = ruler.parse_lines(text, args.samples)
        texts = {"samples": text}
        cells = tasks.plan_file(samples, policies, ratios, text=text, **settings)
        stem = "bench_tasks_" + Path(args.samples).stem
    else:
        names = parse_list(args.tasks, "--tasks", kind=str)
        lengths = parse_list(args.lengths, "--lengths", minimum=1)
        texts = {"haystack": " ".join(bundled.bundled().values())}
        if args.dump_samples:
            return _dump_samples(args, names, lengths, texts["haystack"])
        cells = tasks.plan_tasks(
            policies,
            ratios,
            names,
            lengths,
            args.count,
            seed=args.seed,
            source=tasks.digest(texts["haystack"]),
            depths=args.depths,
            **settings,
        )
        stem = "bench_tasks" + suffix + "_query_aware" * args.query_aware
    config = {
        "policies": cells[0]["policies"],  # a samples file has samples, a generated grid tasks and lengths
        "ratios": ratios,
        "samples_file": args.samples,
        "tasks": sorted({c["suite_task"] for c in cells}),
        "lengths": sorted({c["length"] or 0 for c in cells}),
        "count": args.count,
        "seed": args.seed,
        "depths": None if args.samples else args.depths,
        **settings,
    }
    return _run_grid(
        args,
        cells,
        texts,
        config,
        stem,
        tasks.summarise,
        tasks.figure,
        lambda result: tasks.table(result["summary"]),
        implied=ruler.IMPLIED,
        complete=lambda rows: _needle_depths(args, rows, texts),
        figures=(("_needles", _needle_figure),),
    )


def _dump_samples(args, names: list[str], lengths: list[int], haystack: str) -> int:
    """`--dump-samples FILE`: the grid's generated samples written there, nothing run."""
    from kvlens.experiments.bench import ruler

    model = load(args)
    count = lambda s: len(model.tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    out = [
        ruler.generate(t, n, i, count, haystack, seed=args.seed, depths=args.depths, count=args.count)
        for t in names
        for n in lengths
        for i in range(args.count)
    ]
    ruler.write_samples(out, args.dump_samples)
    print(f"wrote {len(out)} samples to {args.dump_samples}")
    return 0


def _needle_depths(args, rows: list[dict], texts: dict[str, str]) -> None:
    """Rows written before needle depths were recorded get their samples' (the model's tokenizer loaded only
    then)."""
    from kvlens.experiments.bench import task_needles

    if "haystack" not in texts or all(
        r.get("needle_depths") is not None or not r["suite_task"].startswith("niah_") for r in rows
    ):
        return
    tokenizer = load(args).tokenizer
    task_needles.fill_depths(
        rows, lambda s: len(tokenizer(s, add_special_tokens=False).input_ids), texts["haystack"]
    )


def _needle_figure(result: dict):
    """The needle figure at the grid's middle ratio, None without niah rows that have depths."""
    from kvlens.experiments.bench import task_needles, tasks

    cells = task_needles.grid(result["rows"])
    protocol = tasks.protocol(result["config"])
    return task_needles.figure(cells, task_needles.default_ratio(cells), protocol)
