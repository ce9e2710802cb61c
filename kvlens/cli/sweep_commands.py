"""`kvlens sweep`: policies x budgets x texts x prompt lengths (x seeds) -> one JSON + CSV table, cell by
cell.

Shared with `kvlens bench`: the executor flags (`--workers N`, `--ray [ADDRESS]`) and `--fresh`.
"""

from __future__ import annotations

from kvlens.cli.common import add_model_args, command_line, load, print_json, read_text
from kvlens.errors import KvlensError


def register(sub) -> None:
    p = sub.add_parser(
        "sweep", help="run policies x budgets x texts on the model and write one JSON + CSV table"
    )
    p.add_argument(
        "--policies",
        required=True,
        help="comma-separated policy names, or ';'-separated `name:key=value,...` specs to run several "
        "variants of one policy (e.g. 'cam:base=h2o;cam:base=tova')",
    )
    p.add_argument(
        "--budgets", default="", help="comma-separated budgets: slots (64) or shares of the prompt (0.3)"
    )
    p.add_argument("--text-file", action="append", default=[], help="a text to score; repeat for several")
    p.add_argument(
        "--texts",
        default="",
        help="bundled texts: a count (the first N) or comma-separated ids "
        "(see `kvlens.texts`, e.g. 1961-Kennedy)",
    )
    p.add_argument(
        "--prefill", default="256", help="prompt length, or comma-separated lengths (a row per length)"
    )
    p.add_argument("--tokens", type=int, default=64, help="tokens scored after the prompt")
    p.add_argument(
        "--seeds",
        help="comma-separated seeds (a row per seed): the run's seed and the `seed` "
        "parameter of policies that have one (CaM's draws)",
    )
    p.add_argument(
        "--measure", action="store_true", help="also measure output perturbation and KL to the full cache"
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        help="feed each prompt N tokens at a time, compressing after each chunk (see `kvlens ppl --help`)",
    )
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="a parameter of one policy of the sweep, e.g. cam.base=h2o; repeat for several",
    )
    p.add_argument(
        "--out",
        required=True,
        help="JSON file to write (the CSV goes beside it); re-running the "
        "same command skips the cells it already holds",
    )
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    add_executor_args(p)
    add_model_args(p)
    p.set_defaults(func=cmd_sweep)


def add_executor_args(p) -> None:
    """`--workers`, `--ray` and `--fresh`: where a grid's cells run, and whether finished ones are kept."""
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="run cells on N local processes, each loading the model once "
        "(default: one after another in this process)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run cells on Ray actors: on the cluster at ADDRESS (e.g. auto, ray://head:10001), or on a "
        "local Ray started here; --workers sets the actors (default: one per GPU, else per CPU)",
    )
    p.add_argument(
        "--fresh", action="store_true", help="recompute every cell instead of keeping finished ones"
    )


def run_cells(
    args,
    out,
    cells: list[dict],
    texts: dict[str, str],
    settings: dict,
    desc: str,
    implied: dict | None = None,
):
    """Run the cells the results file `out` still lacks on the executor `args` chose; the `Results`
    (`implied`: what an older row lacking a field had, `Results`)."""
    from kvlens.engine.models import model_path
    from kvlens.experiments.executors import Job, executor
    from kvlens.experiments.grid import Results, run_grid

    results = Results(out, cells, settings, fresh=args.fresh, implied=implied)
    local_workers = args.ray == "" or (args.ray is None and args.workers)
    if results.todo() and local_workers:
        model_path(args.model)  # convert (or download) once here, not in every worker
    job = Job(args.model, args.device, args.dtype, args.trust_remote_code, tuple(texts.items()))
    try:
        return run_grid(results, executor(lambda: load(args), job, args.workers, args.ray), desc)
    except KeyboardInterrupt:
        raise KvlensError(
            f"Stopped: {len(results.rows)} of {len(cells)} cells are saved in {results.path}; "
            "run the same command to go on."
        ) from None


def _settings(items: list[str]) -> dict[str, dict]:
    from kvlens.policies import parse_settings

    out: dict[str, dict] = {}
    for item in items:
        name, dot, rest = item.partition(".")
        if not dot or "=" not in rest:
            raise KvlensError(f"--set takes POLICY.KEY=VALUE (e.g. cam.base=h2o); got '{item}'.")
        out.setdefault(name.strip(), {}).update(parse_settings(name.strip(), [rest]))
    return out


def sweep_texts(files: list[str], bundled_arg: str) -> dict[str, str]:
    """The texts of a sweep by id: each --text-file by its path, then the --texts bundled ones."""
    from kvlens import texts as bundled
    from kvlens.lists import parse_list

    out = {path: read_text(path) for path in files}
    if bundled_arg.strip().isdigit():
        out.update(bundled.bundled(int(bundled_arg)))
    elif bundled_arg.strip():
        out.update({i: bundled.read(i) for i in parse_list(bundled_arg, "--texts", kind=str)})
    if not out:
        raise KvlensError("Give the texts to score: --text-file PATH and/or --texts N (bundled).")
    return out


def cmd_sweep(args) -> int:
    from kvlens.experiments.bench.common import parse_policies
    from kvlens.experiments.grid import report
    from kvlens.experiments.sweep import plan_ppl
    from kvlens.lists import parse_list
    from kvlens.policies import parse_budget

    if ";" in args.policies or ":" in args.policies:
        policies = [(p.name, dict(p.params)) for p in parse_policies(args.policies)]
    else:
        policies = [(n, {}) for n in parse_list(args.policies, "--policies", kind=str)]
    settings = _settings(args.settings)
    unknown = sorted(set(settings) - {n for n, _ in policies})
    if unknown:
        raise KvlensError(f"--set names policy '{unknown[0]}', which is not in --policies.")
    budgets = parse_list(args.budgets, "--budgets", kind=parse_budget) if args.budgets.strip() else []
    seeds = parse_list(args.seeds, "--seeds", minimum=0) if args.seeds is not None else None
    texts = sweep_texts(args.text_file, args.texts)
    cells = plan_ppl(
        [(n, {**given, **settings.get(n, {})}) for n, given in policies],
        budgets,
        texts,
        parse_list(args.prefill, "--prefill", minimum=1),
        tokens=args.tokens,
        model=args.model,
        measure=args.measure,
        seeds=seeds,
        prefill_chunk=args.prefill_chunk,
    )
    results = run_cells(
        args, args.out, cells, texts, {"command": command_line(), "model": args.model}, "sweep"
    )
    if args.json:
        print_json(results.ordered())
    print("\n".join(report(results)))
    return int(bool(results.failed))
