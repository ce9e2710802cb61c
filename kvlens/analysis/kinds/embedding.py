"""Queries and keys of one layer and KV head projected together into 2-D, evicted and merged keys marked.

The prompt's recorded prefill queries and keys (`--record states`) of one layer are stacked,
`(2T, D)`, and one projection is fitted on all of them, so queries and keys share the axes:
scikit-learn's PCA (default; `explained_variance` is each axis' share of the variance) or t-SNE
(`method=tsne`, PCA-initialised), both with a fixed `random_state`, so a result is deterministic.

GQA: `head` is a KV head; its keys are shown with the queries of ONE query head of its group,
`query_head` (default: the group's first, `head * group`), so there are exactly T queries and T
keys. The keys' fates come from the run's decision log (`run.decisions`) for that layer and KV
head, up to `step` (default: the whole run): evicted prompt positions, and merged ones with the
positions their value went to (`targets`, `weights`). Decisions about tokens generated after the
prompt have no recorded prefill state: they are counted (`generated_decisions`), not drawn, and
targets among them get no link in the figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from kvlens.analysis.registry import LAYER, Analysis, Param, register_analysis
from kvlens.analysis.states import head_states, layer_or_middle
from kvlens.errors import KvlensError
from kvlens.figures.plots import COLORS, finish, run_model
from kvlens.figures.wording import if_none, when
from kvlens.levels import RecordLevel
from kvlens.runs import token_text
from kvlens.runs.run import Run

METHODS = ("pca", "tsne")
METHOD_NAMES = {"pca": "PCA", "tsne": "t-SNE"}  # as figure titles name them
SEED = 0  # random_state of PCA's and t-SNE's solvers
EVICTED_COLOR, MERGED_COLOR = "#888888", "#D55E00"  # as the decision log's figure


@dataclass
class Embedding:
    """`queries`, `keys` `(T, 2)`: the 2-D coordinates of prompt token i's query and key (row i).

    `evicted` the prompt positions evicted (ascending); `merged` one dict per merge of a prompt
    position (`position`, `step`, `targets`, `weights`, `draw`: the Bernoulli draw, -1 when the policy
    draws none, 0 when the merge moved nothing); `explained_variance` PCA's share of the variance per
    axis (None for t-SNE).
    """

    layer: int
    head: int
    query_head: int
    method: str
    step: int | None
    queries: torch.Tensor
    keys: torch.Tensor
    evicted: list[int]
    merged: list[dict]
    generated_decisions: int
    explained_variance: list[float] | None

    @property
    def tokens(self) -> int:
        return self.keys.shape[0]


def project(x: torch.Tensor, method: str = "pca") -> tuple[torch.Tensor, list[float] | None]:
    """Rows of `x` `(N, D)` in 2-D `(N, 2)` (float32), and PCA's explained variance ratio per axis (t-SNE:
    None)."""
    if method not in METHODS:
        raise KvlensError(f"The projection method takes {' or '.join(METHODS)}; got '{method}'.")
    data = x.double().numpy()
    if method == "pca":
        from sklearn.decomposition import PCA

        pca = PCA(n_components=2, svd_solver="full", random_state=SEED)
        return torch.from_numpy(pca.fit_transform(data)).float(), [
            float(v) for v in pca.explained_variance_ratio_
        ]
    from sklearn.manifold import TSNE

    perplexity = float(min(30.0, max(1.0, (len(data) - 1) / 3)))  # t-SNE needs perplexity < n_samples
    tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=SEED)
    return torch.from_numpy(tsne.fit_transform(data)).float(), None


def embedding(
    run: Run,
    layer: int,
    head: int = 0,
    method: str = "pca",
    query_head: int | None = None,
    step: int | None = None,
) -> Embedding:
    """One layer's prompt queries (of `query_head`) and keys (of KV head `head`) projected together, with
    the evictions and merges of that KV head's prompt keys at steps `<= step` (all when None)."""
    keys = head_states(run, "key", layer, head)  # (T, D); an out-of-range head is one sentence
    group = run.shape["heads"] // run.shape["kv_heads"]
    query_head = if_none(query_head, head * group)
    if query_head // group != head:
        raise KvlensError(
            f"Query head {query_head} does not read KV head {head}: KV head {head} serves query heads "
            f"{head * group} to {head * group + group - 1}."
        )
    queries = head_states(run, "query", layer, query_head)
    t = keys.shape[0]
    xy, variance = project(torch.cat([queries, keys]), method)
    d = run.decisions
    d = d[(d["layer"] == layer) & (d["kv_head"] == head)]
    if step is not None:
        d = d[d["step"] <= step]
    d = d.sort_values(["step", "position"], kind="stable")
    prompt = d[d["position"] < t]
    evicted = sorted(int(p) for p in prompt.loc[prompt["action"] == "evict", "position"])
    merges = prompt[prompt["action"] == "merge"]
    merged = [
        {
            "position": int(p),
            "step": int(s),
            "targets": [int(x) for x in tg],
            "weights": [float(w) for w in ws],
            "draw": int(dr),
        }
        for p, s, tg, ws, dr in zip(
            merges["position"],
            merges["step"],
            merges["targets"],
            merges["weights"],
            merges["draw"],
            strict=True,
        )
    ]
    return Embedding(
        layer, head, query_head, method, step, xy[:t], xy[t:], evicted, merged, len(d) - len(prompt), variance
    )


def _prompt_labels(run: Run, tokens: int) -> list[str]:
    """Each prompt position's token as the hover shows it (blank when the run's token strings are not the
    embedding's `tokens`)."""
    prompt = token_text.decode(list(run.meta.prompt_token_strings or []))
    labels = [prompt.label(i) for i in range(len(prompt.spans))]
    return labels if len(labels) == tokens else [""] * tokens


def _hover(
    labels: list[str], what: str, positions: list[int], extra: dict[int, str] | None = None
) -> list[str]:
    """One hover text per position: what it is, where, its token, and its `extra` line if any."""
    return [f"{what} {p}: {labels[p]!r}" + ((extra or {}).get(p, "")) for p in positions]


def _points(
    xy: torch.Tensor, positions: list[int], name: str, rank: int, marker: dict, text: list[str]
) -> go.Scatter:
    """The rows `positions` of `xy` `(T, 2)` as one legend entry of markers."""
    sel = xy[positions]
    return go.Scatter(
        x=sel[:, 0].tolist(),
        y=sel[:, 1].tolist(),
        mode="markers",
        name=name,
        marker=marker,
        hovertext=text,
        hoverinfo="text",
        legendrank=rank,
    )


def _add_merge_links(fig: go.Figure, keys: torch.Tensor, merges: list[dict]) -> None:
    """Thin lines from each of `merges`' keys (`keys` `(T, 2)`) to the prompt targets it moved weight to (a
    generated target has no recorded key); no trace when there is none."""
    lx: list[float | None] = []
    ly: list[float | None] = []
    for m in merges:
        p = m["position"]
        weights = m["weights"] if len(m["weights"]) == len(m["targets"]) else [1.0] * len(m["targets"])
        for target, w in zip(m["targets"], weights, strict=True):
            if target < len(keys) and w != 0:
                lx += [float(keys[p, 0]), float(keys[target, 0]), None]
                ly += [float(keys[p, 1]), float(keys[target, 1]), None]
    if lx:
        fig.add_trace(
            go.Scatter(
                x=lx,
                y=ly,
                mode="lines",
                name="merged key → target",
                hoverinfo="skip",
                line=dict(color=MERGED_COLOR, width=0.8),
                opacity=0.45,
                legendrank=6,
            )
        )


def _point_traces(e: Embedding, labels: list[str], merged_at: dict[int, dict]) -> list[go.Scatter]:
    """Queries, evicted keys, kept keys, merged keys that moved something and those that moved nothing, in
    that drawing order (the groups with no position left out)."""
    q, k, t = e.queries, e.keys, e.tokens
    gone = set(e.evicted) | set(merged_at)
    kept = [p for p in range(t) if p not in gone]
    moved = [p for p, m in merged_at.items() if m["draw"] != 0]
    nothing = [p for p, m in merged_at.items() if m["draw"] == 0]
    into = {p: f"<br>merged at step {m['step']} into {m['targets']}" for p, m in merged_at.items()}
    traces = [
        _points(
            q,
            list(range(t)),
            f"queries (query head {e.query_head})",
            1,
            dict(color=COLORS[1], symbol="circle-open", size=6, opacity=0.7),
            _hover(labels, "query", list(range(t))),
        )
    ]
    if e.evicted:
        traces.append(
            _points(
                k,
                e.evicted,
                f"evicted keys ({len(e.evicted)})",
                3,
                dict(color=EVICTED_COLOR, symbol="x-thin", size=8, line=dict(color=EVICTED_COLOR, width=1.5)),
                _hover(labels, "evicted key", e.evicted),
            )
        )
    traces.append(
        _points(
            k,
            kept,
            f"kept keys ({len(kept)})",
            2,
            dict(color=COLORS[0], symbol="circle", size=6),
            _hover(labels, "key", kept),
        )
    )
    if moved:
        traces.append(
            _points(
                k,
                moved,
                f"merged keys ({len(moved)})",
                4,
                dict(color=MERGED_COLOR, symbol="diamond", size=8, line=dict(color="white", width=0.5)),
                _hover(labels, "merged key", moved, into),
            )
        )
    if nothing:
        traces.append(
            _points(
                k,
                nothing,
                f"merged, nothing moved ({len(nothing)})",
                5,
                dict(color=MERGED_COLOR, symbol="diamond-open", size=8),
                _hover(labels, "merged key", nothing, into),
            )
        )
    return traces


def _axis_titles(fig: go.Figure, e: Embedding) -> None:
    """PCA's axes with their share of the variance, or t-SNE's."""
    if e.method == "pca":
        for axis, (update, share) in enumerate(
            zip((fig.update_xaxes, fig.update_yaxes), e.explained_variance, strict=True), start=1
        ):
            update(title_text=f"PC {axis} ({100 * share:.1f}% of the variance)")
    else:
        fig.update_xaxes(title_text="t-SNE 1")
        fig.update_yaxes(title_text="t-SNE 2")


def embedding_figure(run: Run, e: Embedding) -> go.Figure:
    """Queries (open circles), kept keys, evicted keys (grey x) and merged keys (orange diamonds, hollow when
    the Bernoulli draw moved nothing) linked to their prompt targets by thin lines; hover names each token."""
    merged_at = {m["position"]: m for m in e.merged}
    # drawn bottom to top: links, queries, evicted keys, kept keys, merged keys; listed in legendrank order
    fig = go.Figure()
    _add_merge_links(fig, e.keys, [m for m in merged_at.values() if m["draw"] != 0])
    for trace in _point_traces(e, _prompt_labels(run, e.tokens), merged_at):
        fig.add_trace(trace)
    _axis_titles(fig, e)
    upto = when(e.step is not None, f", decisions to step {e.step}")
    title = (
        f"Queries and keys, layer {e.layer}, KV head {e.head}{upto} "
        f"({METHOD_NAMES[e.method]}, {run_model(run)})"
    )
    fig = finish(
        fig,
        title,
        "embedding",
        run,
        layer=e.layer,
        head=e.head,
        method=e.method,
        query_head=e.query_head,
        step=e.step,
    )
    fig.update_layout(
        width=860, height=560, legend=dict(x=1.02, xanchor="left", y=1, yanchor="top"), margin=dict(r=250)
    )
    return fig


@register_analysis
class EmbeddingAnalysis(Analysis):
    name = "embedding"
    paper = "queries and keys of one head in 2-D (PCA or t-SNE), evicted and merged keys marked"
    level = RecordLevel.STATES
    params = (
        LAYER,
        Param(
            "head",
            0,
            kind="int",
            help="KV head (its keys; the queries are one query head of its group)",
            minimum=0,
        ),
        Param(
            "method",
            "pca",
            choices=METHODS,
            help="pca (axes show their share of the variance) or tsne (slower on long prompts)",
        ),
        Param(
            "query_head",
            None,
            kind="int",
            optional=True,
            minimum=0,
            help="query head whose queries are shown; it must read --head (default: the group's first)",
        ),
        Param(
            "step",
            None,
            kind="int",
            optional=True,
            minimum=0,
            help="decisions up to this step (0 = the compression right after the prompt; default: all)",
        ),
    )

    def compute(self, run, layer, head, method, query_head, step):
        return embedding(run, layer_or_middle(run, layer), head, method, query_head, step)

    def to_json(self, e, **params) -> dict:
        return {
            "layer": e.layer,
            "head": e.head,
            "query_head": e.query_head,
            "method": e.method,
            "step": e.step,
            "tokens": e.tokens,
            "positions": list(range(e.tokens)),
            "queries": e.queries.tolist(),
            "keys": e.keys.tolist(),
            "evicted": e.evicted,
            "merged": e.merged,
            "generated_decisions": e.generated_decisions,
            "explained_variance": e.explained_variance,
        }

    def figure(self, run, **params):
        return embedding_figure(run, self.compute(run, **params))
