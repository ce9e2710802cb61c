"""`kvlens eval`: lm-evaluation-harness tasks under a policy (`kvlens.eval.run.evaluate`)."""

from __future__ import annotations

from kvlens.cli.common import add_model_args, add_policy_name_args, load, print_json


def register(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="lm-evaluation-harness tasks under a policy: lm-eval's results JSON and kvlens's summary",
    )
    p.add_argument(
        "--tasks",
        required=True,
        help="comma-separated lm-eval task names (shipped: kvlens_passkey, kvlens_cloze; lm-eval's own; "
        "those under --include-path)",
    )
    add_policy_name_args(p)
    p.add_argument("--ratio", type=float, help="the share of each prompt removed, as in kvpress")
    p.add_argument("--limit", type=int, help="at most this many documents per task")
    p.add_argument("--include-path", help="a folder of your own lm-eval task YAML files")
    p.add_argument("--out", required=True, help="folder for results.json, kvlens.json and tasks/")
    p.add_argument("--json", action="store_true", help="print lm-eval's results key and the summary")
    add_model_args(p)
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    from kvlens.eval import require_lm_eval
    from kvlens.lists import parse_list
    from kvlens.policies import parse_settings

    require_lm_eval()
    from kvlens.eval.run import evaluate

    tasks = parse_list(args.tasks, "--tasks", kind=str)
    params = parse_settings(args.policy, args.settings)
    model = load(args)
    out = evaluate(
        model.model,
        model.tokenizer,
        tasks,
        args.policy,
        args.ratio,
        params,
        args.out,
        limit=args.limit,
        include_path=args.include_path,
    )
    summary = {k: v for k, v in out["kvlens"].items() if k != "per_request"}
    if args.json:
        print_json({"results": out["results"]["results"], "kvlens": summary})
    else:
        for task, metrics in out["results"]["results"].items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
            print(f"{task}: {shown}")
        print(f"kept {summary['kept_share']:.3f} of the tokens fed; wrote {args.out}")
    return 0
