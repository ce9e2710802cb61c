"""`kvlens sweep`: policies x budgets (x prompt lengths) on a text -> one JSON and CSV table."""
from __future__ import annotations

from kvlens.cli.common import add_model_args, command_line, load, print_json, read_text
from kvlens.errors import KvlensError


def register(sub) -> None:
    p = sub.add_parser("sweep", help="run policies x budgets on a text and write one JSON + CSV table")
    p.add_argument("--policies", required=True, help="comma-separated policy names")
    p.add_argument("--budgets", default="", help="comma-separated budgets: slots (64) or shares of the prompt (0.3)")
    p.add_argument("--text-file", required=True)
    p.add_argument("--prefill", default="256", help="prompt length, or comma-separated lengths (a row per length)")
    p.add_argument("--tokens", type=int, default=64, help="tokens scored after the prompt")
    p.add_argument("--measure", action="store_true", help="also measure output perturbation and KL to the full cache")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="POLICY.KEY=VALUE",
                   help="a parameter of one policy of the sweep, e.g. cam.base=h2o; repeat for several")
    p.add_argument("--out", required=True, help="JSON file to write (the CSV goes beside it)")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    add_model_args(p)
    p.set_defaults(func=cmd_sweep)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvlensError(f"{what} takes comma-separated integers; got '{text}'.") from None
    if not values or min(values) < 1:
        raise KvlensError(f"{what} takes positive integers; got '{text}'.")
    return values


def _settings(items: list[str]) -> dict[str, dict]:
    from kvlens.policies import parse_settings

    out: dict[str, dict] = {}
    for item in items:
        name, dot, rest = item.partition(".")
        if not dot or "=" not in rest:
            raise KvlensError(f"--set takes POLICY.KEY=VALUE (e.g. cam.base=h2o); got '{item}'.")
        out.setdefault(name.strip(), {}).update(parse_settings(name.strip(), [rest]))
    return out


def cmd_sweep(args) -> int:
    from tqdm import tqdm

    from kvlens.policies import parse_budget
    from kvlens.sweep import plan, sweep, write

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    budgets = [parse_budget(b) for b in args.budgets.split(",") if b.strip()]
    prefills = _ints(args.prefill, "--prefill")
    if args.tokens < 1:
        raise KvlensError("--tokens must be at least 1.")
    runs = plan(policies, budgets, prefills, _settings(args.settings))
    text = read_text(args.text_file)
    model = load(args)
    bar = tqdm(total=len(runs), desc="sweep", unit="run")

    def on_run(r):
        bar.update(1)
        bar.set_postfix(policy=r["policy"], budget=r["budget"], ppl=f"{r['ppl']:.2f}", refresh=True)

    with bar:
        rows = sweep(model, text, runs, tokens=args.tokens, measure=args.measure, on_run=on_run)
    meta = {"command": command_line(), "model": model.spec, "text_file": args.text_file, "tokens": args.tokens,
            "measure": args.measure}
    json_path, csv_path = write(rows, args.out, meta)
    if args.json:
        print_json(rows)
    print(f"{len(rows)} runs -> {json_path} and {csv_path}")
    return 0
