"""Figure builders: their trace data equal the analysis output, heatmaps stay small, style and config are
set."""

from __future__ import annotations

import numpy as np

from kvlens.analysis.kinds.adjacency import adjacency, adjacency_figure
from kvlens.analysis.kinds.corm_lengths import corm_lengths_figure
from kvlens.analysis.kinds.gaussian import gaussian_figure, gaussian_set
from kvlens.analysis.kinds.merge_similarity import merge_future_similarity, merge_similarity_figure
from kvlens.analysis.kinds.merging_ratio import merging_ratio, merging_ratio_figure
from kvlens.analysis.kinds.perplexity import log_perplexity_curve, perplexity_figure
from kvlens.analysis.kinds.preceding import preceding_figure, preceding_similarity
from kvlens.analysis.kinds.similarity import similarity_figure, similarity_map
from kvlens.analysis.kinds.sparsity import corm_sparsity, sparsity_figure
from kvlens.analysis.kinds.spectrum import spectrum, spectrum_figure
from kvlens.analysis.kinds.variance import attention_variance, variance_figure
from tests.conftest import TINY_RUN_T as T


def traces(fig, kind):
    return [t for t in fig.data if t.type == kind]


def test_similarity_figure_shows_the_map_within_512_cells(run):
    fig = similarity_figure(run, 1, 0, ["key", "value"], max_size=64)
    heat = traces(fig, "heatmap")
    assert len(heat) == 2
    for tr, kind in zip(heat, ("key", "value"), strict=True):
        m = similarity_map(run, 1, 0, kind, max_size=64)
        np.testing.assert_allclose(np.array(tr.z, dtype=float), m.matrix.numpy(), equal_nan=True)
        assert len(tr.z) <= 64 and list(tr.x) == m.edges[:-1].tolist()
    assert heat[0].zmin == heat[1].zmin  # one colour scale for both panels
    assert "mean over blocks of 3" in fig.layout.xaxis.title.text
    assert fig.layout.meta["analysis"] == "similarity" and fig.layout.template.layout.font.family


def test_similarity_with_queries_takes_keys_from_the_query_heads_kv_head(run):
    fig = similarity_figure(run, 1, 3, ["query", "key"], max_size=64)  # tiny: 4 query heads over 2 KV heads
    query, key = traces(fig, "heatmap")
    np.testing.assert_allclose(
        np.array(query.z, dtype=float), similarity_map(run, 1, 3, "query", 64).matrix.numpy(), equal_nan=True
    )
    np.testing.assert_allclose(
        np.array(key.z, dtype=float), similarity_map(run, 1, 1, "key", 64).matrix.numpy(), equal_nan=True
    )
    assert "query head 3 (KV head 1)" in fig.layout.title.text


def test_adjacency_figure_lines_are_the_per_layer_means(run):
    fig = adjacency_figure(run)
    adj = adjacency(run)
    lines = {t.name: t for t in fig.data if t.mode == "lines+markers"}
    assert set(lines) == {"queries", "keys", "values"}
    np.testing.assert_allclose(lines["keys"].y, adj.per_layer("key"))
    assert list(lines["values"].x) == adj.layers
    dashes = {t.line.dash for t in lines.values()}
    assert len(dashes) == 3  # distinguishable in greyscale


def test_spectrum_figure_lines_are_the_head_means(run):
    fig = spectrum_figure(run, components=64)
    spec = spectrum(run, "value")
    value_lines = [t for t in fig.data if t.xaxis == "x2" and t.name and t.name.startswith("layer")]
    assert len(value_lines) == 3
    np.testing.assert_allclose(value_lines[2].y, spec.values[2].mean(0).numpy(), rtol=1e-6)
    assert fig.layout.yaxis.type == "log"


def test_sparsity_figure_bars_and_map(run):
    fig = sparsity_figure(run)
    sp = corm_sparsity(run)
    np.testing.assert_allclose(traces(fig, "bar")[0].y, sp.sparsity.mean(1).numpy(), rtol=1e-6)
    np.testing.assert_allclose(np.array(traces(fig, "heatmap")[0].z), sp.sparsity.numpy(), rtol=1e-6)


def test_variance_preceding_gaussian_merge_and_perplexity_figures(run):
    fig = variance_figure(run, 1, 0, group=16, rows=60)
    res = attention_variance(run, 1, 0, 16, 60)
    np.testing.assert_allclose(fig.data[1].y, res.group_var.numpy())
    np.testing.assert_allclose(fig.data[0].y, res.token_var.numpy().ravel())

    fig = preceding_figure(run, 2, 120, window=8)
    np.testing.assert_allclose(
        np.array([t.y for t in fig.data]), preceding_similarity(run, 2, 120, 8).numpy()
    )

    fig = gaussian_figure(run, 1, 1, threshold=0.5, sigmas=(None, 2.0))
    gs = gaussian_set(run, 1, 1, 0.5, sigmas=(None, 2.0))
    assert list(fig.data[0].x) == gs.positions
    np.testing.assert_allclose(fig.data[1].y, gs.weights[2.0].numpy())

    fig = merge_similarity_figure(run, step=50, horizon=40)
    ms = merge_future_similarity(run, 50, 40)
    flat = ms.cosine.flatten(1).double().numpy()
    np.testing.assert_allclose(fig.data[0].y, 1 - flat.mean(1), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(fig.data[1].y, 1 - flat.min(1), rtol=1e-6, atol=1e-12)

    fig = perplexity_figure([run, run], ["a", "b"])
    assert [t.name for t in fig.data] == ["a", "b"]
    np.testing.assert_allclose(fig.data[1].y, log_perplexity_curve(run).log_ppl.numpy())
    assert fig.data[0].x[0] == T


def test_sweep_figures_plot_their_inputs(run):
    ratio = merging_ratio(run, 0.5)
    fig = merging_ratio_figure([ratio, ratio], ["text a", "text b"])
    np.testing.assert_allclose(fig.data[1].y, ratio.per_layer().numpy())
    fig = corm_lengths_figure([128, 256], [0.3, 0.5], budget=64)
    assert list(fig.data[0].y) == [0.3, 0.5] and list(fig.data[1].y) == [0.5, 0.75]
