"""`kvlens compare`: the Compare page's table on the command line (`kvlens.experiments.compare`)."""

from __future__ import annotations

import time

from kvlens.cli.common import add_model_args, command_line, load, print_json, progress, prompt_text
from kvlens.errors import KvlensError


def register(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="policies against the full cache on one prompt: divergence, perplexity on "
        "the full cache's text, KL, perturbation, memory, speed",
    )
    p.add_argument(
        "--policies",
        required=True,
        help="comma-separated policy names, or ';'-separated `name:key=value,...` specs (1 to 4)",
    )
    p.add_argument(
        "--budget",
        default="0.5",
        help="budget of every compressing policy: slots per KV head (64) or a share of the prompt (0.5)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument(
        "--no-generate",
        action="store_true",
        help="skip each policy's own text (the rows' `generated`, resumed from its divergence, and "
        "`generate_s`)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time `floor_s`: transformers' own batched forward of as many rows as the comparison "
        "measures (the full cache and each policy) over the same steps, the least this machine needs",
    )
    p.add_argument("--json", action="store_true")
    add_model_args(p)
    p.set_defaults(func=cmd_compare)


def policy_entries(text: str, budget: str):
    """`--policies` (the `kvlens sweep` syntax) and `--budget` as comparison entries."""
    from kvlens.experiments.bench.common import parse_policies
    from kvlens.experiments.compare import Entry
    from kvlens.lists import parse_list
    from kvlens.policies import make_policy, parse_budget

    if ";" in text or ":" in text:
        specs = [(p.name, dict(p.params)) for p in parse_policies(text)]
    else:
        specs = [(n, {}) for n in parse_list(text, "--policies", kind=str)]
    slots = parse_budget(budget)
    if isinstance(slots, int) and slots < 1:
        raise KvlensError(f"The budget must be a positive number of slots; got {slots}.")
    return [
        Entry(name, params, None if make_policy(name, params).budget_free else slots)
        for name, params in specs
    ]


def cmd_compare(args) -> int:
    from kvlens.engine.loop import RunOptions
    from kvlens.experiments.api import generate
    from kvlens.experiments.compare import batched_floor, compare, entries_with_reference, table

    entries = policy_entries(args.policies, args.budget)
    entries_with_reference(entries)  # the count and every setting checked before the model loads
    prompt = prompt_text(args)
    if args.max_new_tokens < 1:
        raise KvlensError("--max-new-tokens must be at least 1.")
    model = load(args)
    generate(model, prompt, "full", opts=RunOptions(max_new_tokens=1))  # one-time setup, out of every timing
    t = (
        time.perf_counter()
    )  # the yardstick: one plain generation of the full cache, as `kvlens generate` runs it
    generate(model, prompt, "full", opts=RunOptions(max_new_tokens=args.max_new_tokens, stop_at_eos=False))
    generation_s = time.perf_counter() - t
    bar, on_step = progress(args.max_new_tokens * len(entries_with_reference(entries)), "compare")
    t = time.perf_counter()
    with bar:
        results = compare(
            model,
            prompt,
            entries,
            args.max_new_tokens,
            lambda entry, event: on_step(event),
            own_text=not args.no_generate,
        )
    wall = time.perf_counter() - t
    floor_s = batched_floor(model, prompt, len(results), args.max_new_tokens)[0] if args.floor else None
    generate_s = None if args.no_generate else sum(r.generate_s for r in results)
    rows = table(results)
    reference = results[0].run.meta
    out = {
        "command": command_line(),
        "model": args.model,
        "prompt_tokens": len(reference.prompt_tokens),
        "new_tokens": args.max_new_tokens,
        "reference_text": reference.text,
        "rows": rows,
        "wall_s": wall,
        "generate_s": generate_s,
        "generation_s": generation_s,
        "floor_s": floor_s,
    }
    if args.json:
        print_json(out)
    else:
        _print_table(out)
    return 0


def _print_table(out: dict) -> None:
    """`kvlens compare`'s result as text: the full cache's text, a row per policy, each one's own text and
    the times."""
    rows, generate_s = out["rows"], out["generate_s"]
    print(f"full cache: {out['reference_text']!r}\n")
    print(
        f"{'policy':<28}{'diverges':>9}{'agree':>7}{'ppl':>9}{'KL':>9}"
        f"{'perturb.':>9}{'KV MiB':>8}{'ms/tok':>8}"
    )
    for r in rows:
        div = _fmt(r["first_divergence"], "d")
        cells = [
            _fmt(r[k], f)
            for k, f in (
                ("top1_agreement", ".0%"),
                ("ppl", ".3f"),
                ("kl", ".4f"),
                ("perturbation", ".3f"),
                ("kv_bytes_peak", "mib"),
                ("ms_per_token", ".0f"),
            )
        ]
        print(f"{r['policy']:<28}{div:>9}" + "".join(f"{c:>{w}}" for c, w in zip(cells, (7, 9, 9, 9, 8, 8))))
    if generate_s is not None:
        print("\nEach one's own text:")
        for r in rows[1:]:
            where = (
                "same as the full cache's"
                if r["generated_divergence"] is None
                else f"leaves the full cache's at token {r['generated_divergence']}"
            )
            print(f"{r['policy']:<28}{where} ({r['generated_steps']} generated): {r['generated']!r}")
    base = (
        ""
        if generate_s is None
        else f", of which each one's own text after its divergence {generate_s:.1f} s"
    )
    print(
        f"\ncompared in {out['wall_s']:.1f} s{base}; one plain generation of the full cache: "
        f"{out['generation_s']:.1f} s"
    )
    if out["floor_s"] is not None:
        print(f"transformers' own batched forward of the {len(rows)} measured rows: {out['floor_s']:.1f} s")


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    return f"{value / 2**20:.2f}" if spec == "mib" else f"{value:{spec}}"
