"""Run or analysis result -> plotly Figure, in one paper-ready style (the app and `kvlens figure` use these).

Builders (trace data are exactly the analysis output; `fig.layout.meta` holds the analysis name
and parameters, which `kvlens.figures.export` writes as the figure's JSON config):

| builder | analysis | paper figure |
|---|---|---|
| `similarity_figure(run, layer, head, kind="key", max_size=512)` | `similarity_map` | KVMerger Fig. 2, CORM Fig. 3 |
| `adjacency_figure(run)` | `adjacency` | KVMerger Fig. 3a (summary) |
| `preceding_figure(run, layer, token, window=32, kind="key")` | `preceding_similarity` | KVMerger Fig. 3a |
| `spectrum_figure(run, components=64)` | `spectrum` | WeightedKV Fig. 1 |
| `sparsity_figure(run)` | `corm_sparsity` | CORM Fig. 1 |
| `variance_figure(run, layer, head=None, group=64)` | `attention_variance` | CaM Fig. 2 |
| `merging_ratio_figure(ratios, labels)` | `merging_ratio` per text | KVMerger Fig. 3b |
| `gaussian_figure(run, layer, head, threshold=0.75, sigmas=RULES)` | `gaussian_set` | KVMerger Fig. 3d |
| `merge_similarity_figure(run, step=100, horizon=800)` | `merge_future_similarity` | WeightedKV Fig. 2 |
| `perplexity_figure(runs, labels=None)` | `log_perplexity_curve` per run | WeightedKV Fig. 4 |
| `corm_lengths_figure(lengths, ratios)` | `sweeps.corm_over_lengths` | CORM Fig. 4 |

Style: one font, white background, axis lines without grids, ticks outside, units in axis titles,
greyscale-safe colour scales (Viridis for maps) and line styles that differ by dash and marker
as well as colour. Heatmaps are at most `max_size` x `max_size` cells (block-averaged).
`similarity_figure` takes one kind or a list (e.g. `["key", "value"]`: panels on one colour scale).
"""
from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from kvlens import analysis as an
from kvlens.analysis.merging import RULES
from kvlens.runs.run import Run

FONT = dict(family="Helvetica, Arial, sans-serif", size=14, color="#111111")
SCALE = "Viridis"
COLORS = ["#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00"]  # Okabe-Ito, dark first
DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "cross"]
WIDTH, HEIGHT = 720, 460
PLURAL = {"query": "queries", "key": "keys", "value": "values"}

_axis = dict(showline=True, linecolor="#111111", linewidth=1, ticks="outside", showgrid=False, zeroline=False,
             mirror=False, title=dict(font=dict(size=14)))
pio.templates["kvlens"] = go.layout.Template(layout=dict(
    font=FONT, paper_bgcolor="white", plot_bgcolor="white", xaxis=_axis, yaxis=_axis,
    margin=dict(l=90, r=30, t=70, b=60), legend=dict(bgcolor="rgba(0,0,0,0)", borderwidth=0),
    title=dict(font=dict(size=16), x=0.02, xanchor="left"), colorway=COLORS, width=WIDTH, height=HEIGHT))


def line_style(i: int) -> dict:
    """Colour, dash and marker of the i-th series: distinct in greyscale too."""
    return dict(line=dict(color=COLORS[i % 6], dash=DASHES[i % 6], width=2),
                marker=dict(color=COLORS[i % 6], symbol=SYMBOLS[i % 6], size=6))


def finish(fig: go.Figure, title: str, analysis: str, run: Run | None = None, **params) -> go.Figure:
    """The paper style, the title, and `layout.meta` (the analysis, its parameters and the run) that
    `kvlens.figures.export` writes as the figure's JSON config."""
    meta = {"analysis": analysis, "params": params}
    if run is not None:
        meta["run"] = str(run.path) if run.path else None
        meta["run_command"] = run.meta.get("command")
        meta["model"] = run.meta["model"].get("spec")
    fig.update_layout(template="kvlens", title=dict(text=title), meta=meta)
    return fig


def model_label(spec: str) -> str:
    """A model spec as a figure shows it: the embedded default by name, else the last path part."""
    return "SmolLM2-135M-Instruct" if spec == "default" else spec.rstrip("/").split("/")[-1]


def _model(run: Run) -> str:
    return model_label(str(run.meta["model"].get("spec", "model")))


def similarity_figure(run: Run, layer: int, head: int, kind: str | list[str] = "key", max_size: int = 512) -> go.Figure:
    """Token x token cosine-similarity heatmap(s) of one head; several kinds share one colour scale.

    With queries among several kinds, `head` is a query head and keys/values come from its KV
    head (`head // group` under GQA); otherwise it is a KV head.
    """
    kinds = [kind] if isinstance(kind, str) else list(kind)
    group = run.shape["heads"] // run.shape["kv_heads"]
    mixed = "query" in kinds and len(kinds) > 1
    maps = [an.similarity_map(run, layer, head // group if mixed and k != "query" else head, k, max_size)
            for k in kinds]
    fig = make_subplots(rows=1, cols=len(maps), subplot_titles=[PLURAL[m.kind] for m in maps],
                        horizontal_spacing=0.1)
    lo = min(float(m.matrix.nan_to_num(1.0).min()) for m in maps)
    for i, m in enumerate(maps, start=1):
        starts = m.edges[:-1].tolist()
        fig.add_trace(go.Heatmap(z=m.matrix.tolist(), x=starts, y=starts, zmin=lo, zmax=1, colorscale=SCALE,
                                 name=m.kind, colorbar=dict(title=dict(text="cosine"), thickness=14),
                                 hovertemplate="token %{y} vs %{x}<br>cos %{z:.3f}<extra></extra>"), row=1, col=i)
        unit = "token" if m.block == 1 else f"token (mean over blocks of {m.block})"
        fig.update_xaxes(title_text=f"earlier {unit}", row=1, col=i, constrain="domain")
        fig.update_yaxes(title_text=unit if i == 1 else None, autorange="reversed",
                         scaleanchor=f"x{i if i > 1 else ''}",
                         row=1, col=i, constrain="domain")
    which = "KV head" if "query" not in kinds else "query head"
    if mixed:
        head_text = f"{head} (KV head {head // group})"
    names = " and ".join(m.kind for m in maps)
    title = (f"Cosine similarity of {names} states, layer {layer}, {which} {head_text if mixed else head} "
             f"({_model(run)})")
    fig = finish(fig, title, "similarity", run, layer=layer, head=head, kind=kinds, max_size=max_size)
    fig.update_layout(width=WIDTH if len(maps) == 1 else 1100, height=520)
    return fig


def adjacency_figure(run: Run) -> go.Figure:
    """Mean cosine similarity of adjacent tokens per layer (mean over heads; each head as a faint dot)."""
    adj = an.adjacency(run)
    fig = go.Figure()
    for i, (kind, values) in enumerate(adj.values.items()):
        style = line_style(i)
        heads = values.shape[1]
        fig.add_trace(go.Scatter(x=[layer for layer in adj.layers for _ in range(heads)], y=values.flatten().tolist(),
                                 mode="markers", name=f"{kind} (each head)", showlegend=False, hoverinfo="skip",
                                 marker=dict(color=style["marker"]["color"], size=4, opacity=0.3)))
        fig.add_trace(go.Scatter(x=adj.layers, y=adj.per_layer(kind), mode="lines+markers", name=PLURAL[kind], **style))
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(title_text="cos(x<sub>t</sub>, x<sub>t-1</sub>), mean over tokens")
    return finish(fig, f"Adjacent-token similarity of prefill states ({_model(run)})", "adjacency", run)


def preceding_figure(run: Run, layer: int, token: int, window: int = 32, kind: str = "key") -> go.Figure:
    """Similarity of token t to each of the `window` tokens before it, one line per head."""
    sims = an.preceding_similarity(run, layer, token, window, kind)  # (H, window)
    fig = go.Figure()
    for h, row in enumerate(sims):
        fig.add_trace(go.Scatter(x=list(range(1, window + 1)), y=row.tolist(), mode="lines+markers",
                                 name=f"{'query' if kind == 'query' else 'KV'} head {h}", **line_style(h)))
    fig.update_xaxes(title_text="distance j (tokens before t)")
    fig.update_yaxes(title_text=f"cos({kind}<sub>t</sub>, {kind}<sub>t-j</sub>)")
    title = f"Similarity of {kind} {token} to the {window} before it, layer {layer} ({_model(run)})"
    return finish(fig, title, "preceding", run, layer=layer, token=token, window=window, kind=kind)


def spectrum_figure(run: Run, components: int = 64) -> go.Figure:
    """Normalised singular values of keys and values, one line per layer (mean over heads), log scale."""
    specs = [an.spectrum(run, k, components) for k in ("key", "value")]
    fig = make_subplots(rows=1, cols=2, subplot_titles=["keys", "values"], shared_yaxes=True,
                        horizontal_spacing=0.06)
    n = len(specs[0].layers)
    colors = _sample(SCALE, n)
    for col, spec in enumerate(specs, start=1):
        for i, layer in enumerate(spec.layers):
            y = spec.values[i].mean(0).tolist()
            fig.add_trace(go.Scatter(x=list(range(1, len(y) + 1)), y=y, mode="lines", name=f"layer {layer}",
                                     legendgroup=f"{layer}", showlegend=False,
                                     line=dict(color=colors[i], width=1.5)), row=1, col=col)
        fig.update_xaxes(title_text="singular value index", row=1, col=col)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", showlegend=False, hoverinfo="skip",
                             marker=dict(colorscale=SCALE, cmin=specs[0].layers[0], cmax=specs[0].layers[-1],
                                         color=[specs[0].layers[0]], showscale=True,
                                         colorbar=dict(title=dict(text="layer"), thickness=14))))
    fig.update_yaxes(type="log", dtick=1, exponentformat="power", row=1, col=1,
                     title_text="σ<sub>i</sub> / σ<sub>1</sub> (mean over KV heads)")
    fig.update_yaxes(type="log", dtick=1, exponentformat="power", row=1, col=2)
    title = f"Normalised singular values of the KV cache ({_model(run)}, {n} layers)"
    fig = finish(fig, title, "spectrum", run, components=components)
    fig.update_layout(width=1000)
    return fig


def _sample(scale: str, n: int) -> list[str]:
    from plotly.colors import sample_colorscale

    return sample_colorscale(scale, [i / max(1, n - 1) for i in range(n)])


def sparsity_figure(run: Run, start: int = 0) -> go.Figure:
    """CORM Fig. 1: (a) layer-wise attention sparsity (mean over heads), (b) head-wise, as a map."""
    sp = an.corm_sparsity(run, start=start)
    values = sp.sparsity  # (L, Hq)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.12,
                        subplot_titles=["(a) layer-wise", "(b) head-wise"])
    fig.add_trace(go.Bar(x=sp.layers, y=values.mean(1).tolist(), marker=dict(color="#555555"), name="mean over heads"),
                  row=1, col=1)
    fig.add_trace(go.Heatmap(z=values.tolist(), x=list(range(values.shape[1])), y=sp.layers, colorscale=SCALE,
                             zmax=1, name="per head", colorbar=dict(title=dict(text="sparsity"), thickness=14),
                             hovertemplate="layer %{y} head %{x}<br>sparsity %{z:.3f}<extra></extra>"), row=1, col=2)
    fig.update_xaxes(title_text="layer", row=1, col=1)
    fig.update_yaxes(title_text="sparsity (share of keys with A < 1/t)", range=[0, 1], row=1, col=1)
    fig.update_xaxes(title_text="query head", row=1, col=2)
    fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=2)
    fig = finish(fig, f"Attention sparsity, CORM's definition ({_model(run)})", "sparsity", run, start=start)
    fig.update_layout(width=1000, showlegend=False)
    return fig


def variance_figure(run: Run, layer: int, head: int | None = None, group: int = 64,
                    rows: int | None = None) -> go.Figure:
    """CaM Fig. 2: attention variance of single tokens (small) vs of group means (large), log scale."""
    res = an.attention_variance(run, layer, head, group, rows)
    g, m = res.token_var.shape
    xs = res.starts.tolist()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[x for x in xs for _ in range(m)], y=res.token_var.flatten().tolist(), mode="markers",
                             name="single tokens", marker=dict(color=COLORS[3], size=4, symbol="circle-open")))
    fig.add_trace(go.Scatter(x=xs, y=res.group_var.tolist(), mode="lines+markers", name=f"mean of {group} tokens",
                             **line_style(1)))
    fig.update_xaxes(title_text=f"first token of the group of {group}")
    fig.update_yaxes(type="log", dtick=1, exponentformat="power",
                     title_text=f"variance of attention over steps {res.rows[0]}–{res.rows[1] - 1}")
    who = "mean of heads" if head is None else f"head {head}"
    fig = finish(fig, f"Attention variance, layer {layer}, {who} ({_model(run)})", "variance", run, layer=layer,
                  head=head, group=group, rows=rows)
    fig.update_layout(legend=dict(x=0.98, xanchor="right", y=0.02, yanchor="bottom"))
    return fig


def merging_ratio_figure(ratios: list[an.MergingRatio], labels: list[str], note: str = "") -> go.Figure:
    """KVMerger Fig. 3b: layer-wise merging-set compression ratio, one line per text (`note` ends the title)."""
    fig = go.Figure()
    for i, (r, label) in enumerate(zip(ratios, labels, strict=False)):
        fig.add_trace(go.Scatter(x=r.layers, y=r.per_layer().tolist(), mode="lines+markers", name=label,
                                 **line_style(i)))
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(title_text="compression ratio (1 − sets / tokens)", range=[0, 1])
    threshold = ratios[0].threshold if ratios else None
    return finish(fig, f"Merging-set compression ratio per layer, threshold {threshold}{note}", "merging-ratio",
                   threshold=threshold, labels=list(labels))


def gaussian_figure(run: Run, layer: int, head: int, threshold: float = 0.75, position: int | None = None,
                    sigmas: tuple[str | float | None, ...] = RULES) -> go.Figure:
    """KVMerger Fig. 3d: Gaussian-kernel weights over one merging set under each sigma rule or value, pivot marked."""
    gs = an.gaussian_set(run, layer, head, threshold, position, sigmas)
    fig = go.Figure()
    for i, (sigma, w) in enumerate(gs.weights.items()):
        name = gs.label(sigma)
        fig.add_trace(go.Scatter(x=gs.positions, y=w.tolist(), mode="lines+markers", name=name, **line_style(i)))
    fig.add_vline(x=gs.pivot, line=dict(color="#777777", dash="dot", width=1),
                  annotation_text=f"pivot {gs.pivot}", annotation_position="top")
    fig.update_xaxes(title_text="token position in the merging set")
    fig.update_yaxes(title_text="merge weight w<sub>i</sub>")
    title = f"Gaussian merge weights, layer {layer}, KV head {head}, threshold {threshold} ({_model(run)})"
    return finish(fig, title, "gaussian", run, layer=layer, head=head, threshold=threshold, position=position,
                   sigmas=list(sigmas))


def merge_similarity_figure(run: Run, step: int = 100, horizon: int = 800, sink: int = 4) -> go.Figure:
    """WeightedKV Fig. 2: per layer, 1 − cosine similarity of future attention rows with and without
    one merge (mean, and the worst row of any head), on a log axis: the paper's cosine is so close to
    1 that error bars around it would cross 1."""
    res = an.merge_future_similarity(run, step, horizon, sink)
    flat = res.cosine.flatten(1).double()  # (L, Hq * N)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=res.layers, y=(1 - flat.mean(1)).tolist(), mode="lines+markers", name="mean",
                             **line_style(0)))
    fig.add_trace(go.Scatter(x=res.layers, y=(1 - flat.min(1).values).tolist(), mode="lines+markers",
                             name="worst row", **line_style(1)))
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(type="log", dtick=1, exponentformat="power",
                     title_text=f"1 − cosine similarity, steps {step + 1}–{step + res.cosine.shape[-1]}")
    return finish(fig, f"Future attention with vs without one merge at step {step} ({_model(run)})",
                   "merge-similarity", run, step=step, horizon=horizon, sink=sink)


def perplexity_figure(runs: list[Run], labels: list[str] | None = None) -> go.Figure:
    """WeightedKV Fig. 4: log-perplexity of the tokens so far against position, one line per run."""
    labels = labels or [None] * len(runs)
    fig = go.Figure()
    for i, (r, label) in enumerate(zip(runs, labels, strict=False)):
        c = an.log_perplexity_curve(r, label)
        fig.add_trace(go.Scatter(x=c.positions.tolist(), y=c.log_ppl.tolist(), mode="lines", name=c.label,
                                 line=line_style(i)["line"]))
    fig.update_xaxes(title_text="position (tokens)")
    fig.update_yaxes(title_text="log perplexity (mean NLL so far, nats)")
    model = f" ({_model(runs[0])})" if runs else ""
    return finish(fig, f"Log-perplexity over position{model}", "perplexity", labels=[str(x) for x in labels],
                   runs=[str(r.path) if r.path else None for r in runs])


def corm_lengths_figure(lengths: list[int], ratios: list[float], budget: int | None = None,
                        note: str = "") -> go.Figure:
    """CORM Fig. 4: compression rate reached by CORM against sequence length."""
    fig = go.Figure(go.Scatter(x=lengths, y=ratios, mode="lines+markers", name="CORM", **line_style(0)))
    if budget:
        fig.add_trace(go.Scatter(x=lengths, y=[max(0.0, 1 - budget / n) for n in lengths], mode="lines",
                                 name=f"budget {budget}", **line_style(1)))
    fig.update_xaxes(title_text="sequence length (tokens)")
    fig.update_yaxes(title_text="compression rate (share of KV removed)", range=[0, 1])
    return finish(fig, f"CORM compression rate against sequence length{note}", "corm-lengths", lengths=list(lengths),
                   budget=budget)
