"""`kvlens analyze KIND` (numbers, or JSON with --json) and `kvlens figure KIND --out FILE` (image + CSV + JSON).

Single-run kinds read a run recorded with `--record states`; `perplexity` reads several runs;
`merging-ratio` and `corm-lengths` run the model over the bundled texts themselves.
"""
from __future__ import annotations

import argparse

from kvlens.cli.common import add_model_args, command_line, load, print_json
from kvlens.errors import KvlensError

KINDS = ["similarity", "adjacency", "preceding", "spectrum", "sparsity", "variance", "gaussian", "merge-similarity",
         "perplexity", "merging-ratio", "corm-lengths"]
SWEEPS = {"merging-ratio", "corm-lengths"}
HELP = ("similarity (KVMerger Fig. 2), adjacency and preceding (Fig. 3a), spectrum (WeightedKV Fig. 1), "
        "sparsity (CORM Fig. 1), variance (CaM Fig. 2), gaussian (KVMerger Fig. 3d), merge-similarity "
        "(WeightedKV Fig. 2), perplexity (WeightedKV Fig. 4, several --run), merging-ratio (KVMerger Fig. 3b, "
        "runs the model over the bundled texts), corm-lengths (CORM Fig. 4, likewise)")


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=KINDS, metavar="KIND", help=HELP)
    p.add_argument("--run", action="append", default=[], metavar="DIR",
                   help="recorded run (--record states); repeat for perplexity")
    p.add_argument("--label", action="append", default=[], help="legend label per --run (perplexity)")
    p.add_argument("--layer", type=int, help="layer (default: the middle recorded layer)")
    p.add_argument("--head", type=int, help="head: query head for queries, KV head otherwise (default 0; "
                                            "variance: mean of heads)")
    p.add_argument("--state", default="key", help="similarity/preceding: query, key or value; a figure of "
                                                  "similarity also takes several, comma-separated (key,value)")
    p.add_argument("--max-size", type=int, default=512, help="similarity: at most this many cells per side")
    p.add_argument("--token", type=int, help="preceding: token t (default: the last prompt token)")
    p.add_argument("--window", type=int, default=32, help="preceding: how many tokens before t")
    p.add_argument("--group", type=int, default=64, help="variance: tokens per group (CaM's m)")
    p.add_argument("--threshold", type=float, default=0.75, help="gaussian/merging-ratio: cosine threshold")
    p.add_argument("--sigma", type=float, action="append", default=[],
                   help="gaussian: extra sigma values besides the paper's formula")
    p.add_argument("--step", type=int, default=100, help="merge-similarity: the merge step")
    p.add_argument("--horizon", type=int, default=800, help="merge-similarity: steps after the merge")
    p.add_argument("--texts", type=int, default=4, help="merging-ratio/corm-lengths: how many bundled texts")
    p.add_argument("--tokens", type=int, default=1024, help="merging-ratio: tokens of each text")
    p.add_argument("--lengths", default="256,512,1024,2048", help="corm-lengths: comma-separated lengths")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="corm-lengths: a corm parameter (e.g. window=64)")
    add_model_args(p)


def register(sub) -> None:
    p = sub.add_parser("analyze", help="compute a paper's analysis on a recorded run and print it")
    _add_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_analyze)
    p = sub.add_parser("figure", help="export a paper-style figure (.png/.svg/.pdf) with its data (.csv) and "
                                      "config (.json)")
    _add_args(p)
    p.add_argument("--out", required=True, help="FILE.png, .svg or .pdf (FILE.csv and FILE.json are written beside it)")
    p.add_argument("--scale", type=float, default=2.0, help="PNG pixel scale")
    p.set_defaults(func=cmd_figure)


def _runs(args):
    from kvlens import load_run

    if args.kind in SWEEPS:
        return []
    if not args.run:
        raise KvlensError(f"`{args.kind}` needs --run DIR (a run recorded with --record states).")
    if len(args.run) > 1 and args.kind != "perplexity":
        raise KvlensError(f"`{args.kind}` takes one --run; only perplexity compares several.")
    return [load_run(path) for path in args.run]


def _layer_head(args, run, kind: str = "key"):
    from kvlens.analysis import recorded_layers
    from kvlens.analysis.states import check_layer

    layers = recorded_layers(run, kind)
    layer = layers[len(layers) // 2] if args.layer is None else args.layer
    check_layer(run, layer, kind)
    return layer, (0 if args.head is None else args.head)


def _states(text: str) -> list[str]:
    states = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in states if x not in ("query", "key", "value")]
    if not states or bad:
        raise KvlensError(f"--state takes query, key or value (comma-separated for a similarity figure); got '{text}'.")
    return states


def _state(text: str) -> str:
    states = _states(text)
    if len(states) > 1:
        raise KvlensError(f"This analysis takes one --state; got '{text}'.")
    return states[0]


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvlensError(f"{flag} takes comma-separated integers; got '{text}'.") from None
    if not values or min(values) < 2:
        raise KvlensError(f"{flag} needs lengths of at least 2 tokens; got '{text}'.")
    return sorted(values)


def _sweep(args):
    """Run the model over bundled texts: (result, labels)."""
    from kvlens.analysis import sweeps
    from kvlens.policies import parse_settings

    if args.texts < 1:
        raise KvlensError("--texts must be at least 1.")
    texts = sweeps.bundled_texts(args.texts)
    if args.kind == "merging-ratio":
        if args.tokens < 2:
            raise KvlensError("--tokens must be at least 2.")
        model = load(args)
        return sweeps.merging_ratio_over_texts(model, texts, args.tokens, args.threshold)
    lengths = _ints(args.lengths, "--lengths")
    params = parse_settings("corm", args.settings)
    model = load(args)
    return sweeps.corm_over_lengths(model, texts, lengths, params)


def analysis_result(args) -> dict:
    """The analysis as a JSON-able dict (the CLI's contract for adjacency and spectrum)."""
    import kvlens.analysis as an

    runs = _runs(args)
    run = runs[0] if runs else None
    kind = args.kind
    if kind == "adjacency":
        adj = an.adjacency(run)
        return {"layers": len(adj.layers), **{k: adj.per_layer(k) for k in ("query", "key", "value")}}
    if kind == "spectrum":
        out = {"layers": len(an.recorded_layers(run))}
        for k in ("key", "value"):
            spec = an.spectrum(run, k)
            out[k] = {"singular_values": spec.values.mean(1).tolist(), "energy_top8": spec.energy_top.mean(1).tolist()}
        return out
    if kind == "sparsity":
        sp = an.corm_sparsity(run)
        return {"layers": sp.layers, "sparsity": sp.sparsity.mean(1).tolist(),
                "sparsity_per_head": sp.sparsity.tolist()}
    if kind == "perplexity":
        labels = args.label + [None] * (len(runs) - len(args.label))
        curves = [an.log_perplexity_curve(r, lab) for r, lab in zip(runs, labels)]
        return {"runs": [{"label": c.label, "positions": c.positions.tolist(), "log_ppl": c.log_ppl.tolist()}
                         for c in curves]}
    if kind == "merging-ratio":
        res = _sweep(args)
        return {"threshold": args.threshold, "tokens": args.tokens, "layers": next(iter(res.values())).layers,
                "texts": {label: r.per_layer().tolist() for label, r in res.items()}}
    if kind == "corm-lengths":
        res = _sweep(args)
        return {"lengths": res.lengths, "params": res.params, "compression": res.mean(),
                "texts": dict(zip(res.labels, res.ratio.tolist()))}
    if kind == "merge-similarity":
        ms = an.merge_future_similarity(run, args.step, args.horizon)
        flat = ms.cosine.flatten(1)
        return {"layers": ms.layers, "step": ms.step, "mean": flat.mean(1).tolist(),
                "std": flat.std(1, unbiased=False).tolist(), "merged_token": ms.merged.tolist()}
    layer, head = _layer_head(args, run)
    if kind == "similarity":
        m = an.similarity_map(run, layer, head, _state(args.state), args.max_size)
        return {"layer": layer, "head": head, "state": m.kind, "tokens": m.tokens, "block": m.block,
                "edges": m.edges.tolist(), "matrix": _nan_to_none(m.matrix)}
    if kind == "preceding":
        token = len(run.meta["prompt_tokens"]) - 1 if args.token is None else args.token
        sims = an.preceding_similarity(run, layer, token, args.window, _state(args.state))
        return {"layer": layer, "token": token, "state": args.state,
                "similarity": _nan_to_none(sims)}
    if kind == "variance":
        res = an.attention_variance(run, layer, args.head, args.group)
        return {"layer": layer, "head": args.head, "group": args.group, "rows": list(res.rows),
                "starts": res.starts.tolist(), "group_var": res.group_var.tolist(),
                "token_var_mean": res.token_var.mean(1).tolist()}
    gs = an.gaussian_set(run, layer, head, args.threshold, args.token, (None, *args.sigma))
    return {"layer": layer, "head": head, "threshold": args.threshold, "positions": gs.positions, "pivot": gs.pivot,
            "weights": {("paper" if s is None else str(s)): w.tolist() for s, w in gs.weights.items()}}


def _nan_to_none(t) -> list[list]:
    """A 2-D tensor as nested lists with NaN as None (valid JSON)."""
    return [[None if v != v else v for v in row] for row in t.tolist()]


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
    result = analysis_result(args)
    if args.json:
        print_json(result)
    else:
        _print_text(result)
    return 0


def build_figure(args):
    """The figure for `args.kind` (builders in `kvlens.plots`)."""
    from kvlens import plots

    runs = _runs(args)
    run = runs[0] if runs else None
    kind = args.kind
    if kind == "adjacency":
        return plots.adjacency_figure(run)
    if kind == "spectrum":
        return plots.spectrum_figure(run)
    if kind == "sparsity":
        return plots.sparsity_figure(run)
    if kind == "perplexity":
        return plots.perplexity_figure(runs, args.label + [None] * (len(runs) - len(args.label)))
    if kind == "merge-similarity":
        return plots.merge_similarity_figure(run, args.step, args.horizon)
    if kind == "merging-ratio":
        res = _sweep(args)
        note = f" ({plots.model_label(args.model)}, first {args.tokens} tokens of {len(res)} texts)"
        return plots.merging_ratio_figure(list(res.values()), list(res), note)
    if kind == "corm-lengths":
        res = _sweep(args)
        params = ", ".join(f"{k}={v}" for k, v in res.params.items())
        note = f"<br><sup>{plots.model_label(args.model)}, corm {params}, mean of {len(res.labels)} texts</sup>"
        return plots.corm_lengths_figure(res.lengths, res.mean(), note=note)
    layer, head = _layer_head(args, run)
    if kind == "similarity":
        return plots.similarity_figure(run, layer, head, _states(args.state), args.max_size)
    if kind == "preceding":
        token = len(run.meta["prompt_tokens"]) - 1 if args.token is None else args.token
        return plots.preceding_figure(run, layer, token, args.window, _state(args.state))
    if kind == "variance":
        return plots.variance_figure(run, layer, args.head, args.group)
    return plots.gaussian_figure(run, layer, head, args.threshold, args.token, (None, *args.sigma))


def cmd_figure(args) -> int:
    from pathlib import Path

    from kvlens.export import export_figure

    if Path(args.out).suffix.lower() not in (".png", ".svg", ".pdf", ".csv", ".json"):
        raise KvlensError(f"--out must end in .png, .svg or .pdf (or .csv/.json for data only); got '{args.out}'.")
    fig = build_figure(args)
    for path in export_figure(fig, args.out, args.scale, command_line()):
        print(path)
    return 0
