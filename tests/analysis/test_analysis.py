"""Analyses against independent numpy computations, on the tiny model and on the embedded one."""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest
import torch

from kvlens.analysis.kinds.adjacency import adjacency
from kvlens.analysis.kinds.corm_lengths import corm_over_lengths
from kvlens.analysis.kinds.gaussian import gaussian_set
from kvlens.analysis.kinds.merge_similarity import merge_future_similarity
from kvlens.analysis.kinds.merging_ratio import merging_ratio, merging_ratio_over_texts, record_states
from kvlens.analysis.kinds.perplexity import log_perplexity_curve
from kvlens.analysis.kinds.preceding import preceding_similarity
from kvlens.analysis.kinds.similarity import block_edges, similarity_map
from kvlens.analysis.kinds.sparsity import corm_sparsity
from kvlens.analysis.kinds.spectrum import singular_values, spectrum
from kvlens.analysis.kinds.variance import attention_variance
from kvlens.analysis.states import aggregated_attention
from kvlens.cli import main
from kvlens.engine.loop import RunOptions
from kvlens.engine.loop import run as engine_run
from kvlens.errors import KvlensError
from kvlens.levels import RecordLevel
from kvlens.policies import make_policy
from kvlens.policies.kvmerger import merging_sets
from kvlens.texts import prefix_ids
from tests.conftest import CACHED_RUNS, ROOT, TEXTS, doc_example, tiny_model, tiny_run
from tests.conftest import TINY_RUN_T as T


def np_states(run, code, layer):
    return run.tensor(f"prefill/{code}/{layer}").float().numpy().astype(np.float64)  # (H, T, D)


def np_unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def np_attention(q, k):
    """Causal softmax attention per query head, GQA by repetition: (Hq, T, T) float64."""
    k = np.repeat(k, q.shape[0] // k.shape[0], axis=0)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    s = np.where(np.triu(np.ones(s.shape[-2:], bool), 1), -np.inf, s)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("kind,code,head", [("query", "q", 3), ("key", "k", 1), ("value", "v", 0)])
def test_similarity_map_is_the_cosine_matrix(run, kind, code, head):
    x = np_unit(np_states(run, code, 1)[head])
    full = x @ x.T
    m = similarity_map(run, 1, head, kind, max_size=512)
    assert m.block == 1 and m.matrix.shape == (T, T)
    lower = np.tril(np.ones((T, T), bool))
    np.testing.assert_allclose(m.matrix.numpy()[lower], full[lower], atol=1e-5)
    assert np.isnan(m.matrix.numpy()[~lower]).all()


def test_block_averaging_preserves_the_mean_and_each_block(run):
    x = np_unit(np_states(run, "k", 2)[0])
    full = x @ x.T
    m = similarity_map(run, 2, 0, "key", max_size=7, lower=False)
    edges = m.edges.tolist()
    assert m.matrix.shape == (7, 7) and edges[0] == 0 and edges[-1] == T
    sizes = np.diff(edges)
    weighted = (m.matrix.numpy() * sizes[:, None] * sizes[None, :]).sum() / T**2
    assert weighted == pytest.approx(full.mean(), abs=1e-5)
    a, b = 3, 5
    block = full[edges[a] : edges[a + 1], edges[b] : edges[b + 1]].mean()
    assert float(m.matrix[a, b]) == pytest.approx(block, abs=1e-5)


def test_block_edges_never_exceed_max_size():
    for t in (1, 5, 511, 512, 513, 1075, 4096):
        e = block_edges(t, 512)
        assert len(e) - 1 <= 512 and int(e[-1]) == t and bool((e[1:] > e[:-1]).all())


def test_adjacency_matches_numpy(run):
    adj = adjacency(run)
    assert adj.layers == [0, 1, 2]
    for name, code in (("query", "q"), ("key", "k"), ("value", "v")):
        for layer in adj.layers:
            x = np_unit(np_states(run, code, layer))
            want = (x[:, 1:] * x[:, :-1]).sum(-1).mean(-1)
            np.testing.assert_allclose(adj.values[name][layer].numpy(), want, atol=1e-5)
        assert adj.per_layer(name) == pytest.approx(adj.values[name].mean(1).tolist())


def test_preceding_similarity_matches_numpy_and_pads_before_token_zero(run):
    x = np_unit(np_states(run, "k", 0))
    sims = preceding_similarity(run, 0, 100, window=5, kind="key").numpy()
    for j in range(1, 6):
        np.testing.assert_allclose(sims[:, j - 1], (x[:, 100] * x[:, 100 - j]).sum(-1), atol=1e-5)
    early = preceding_similarity(run, 0, 2, window=5).numpy()
    assert np.isfinite(early[:, :2]).all() and np.isnan(early[:, 2:]).all()


def test_spectrum_matches_numpy_svd(run):
    spec = spectrum(run, "value", components=64, top=8)
    for layer in spec.layers:
        for head, x in enumerate(np_states(run, "v", layer)):
            s = np.linalg.svd(x, compute_uv=False)
            np.testing.assert_allclose(
                spec.values[layer, head].numpy(), (s / s[0])[:16], rtol=1e-4, atol=1e-6
            )
            assert float(spec.energy_top[layer, head]) == pytest.approx(
                (s[:8] ** 2).sum() / (s**2).sum(), rel=1e-5
            )
    assert spec.values.shape == (3, 2, 16)  # head_dim 16 bounds the rank


def test_randomized_svd_path_for_large_matrices():
    gen = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(700, 600, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(600, 600, generator=gen, dtype=torch.float64))[0]
    s = 0.9 ** torch.arange(600, dtype=torch.float64)
    x = (u * s) @ v.T  # (700, 600), min side > 512: randomized
    got, total = singular_values(x.float(), components=20)
    np.testing.assert_allclose(got.numpy(), s[:20].numpy(), rtol=1e-3)
    assert total == pytest.approx(float((s**2).sum()), rel=1e-4)


def test_corm_sparsity_matches_numpy(run):
    sp = corm_sparsity(run)
    for layer in sp.layers:
        a = np_attention(np_states(run, "q", layer), np_states(run, "k", layer))  # (Hq, T, T)
        seen = np.arange(1, T + 1)
        share = ((a >= 1 / seen[None, :, None]) & np.tril(np.ones((T, T), bool))).sum(-1) / seen
        np.testing.assert_allclose(sp.important[layer].numpy(), share.mean(-1), atol=2e-3)
    np.testing.assert_allclose(sp.sparsity.numpy(), 1 - sp.important.numpy())


def test_attention_variance_matches_numpy(run):
    res = attention_variance(run, 1, head=2, group=16, rows=60)
    a = np_attention(np_states(run, "q", 1), np_states(run, "k", 1))[
        2, T - 60 :, :96
    ]  # (rows, 6 groups * 16)
    np.testing.assert_allclose(res.token_var.numpy().ravel(), a.var(0), rtol=1e-3, atol=1e-9)
    np.testing.assert_allclose(
        res.group_var.numpy(), a.reshape(60, 6, 16).mean(-1).var(0), rtol=1e-3, atol=1e-9
    )
    assert res.starts.tolist() == [0, 16, 32, 48, 64, 80] and res.rows == (T - 60, T)


def test_merge_future_similarity_matches_an_explicit_renormalised_softmax(run):
    step, horizon = 50, 30
    res = merge_future_similarity(run, step, horizon, sink=4, layers=[2])
    q, k = np_states(run, "q", 2), np_states(run, "k", 2)
    a = np_attention(q, k)  # (Hq, T, T)
    kv_mean = a.reshape(2, 2, T, T).mean(1)  # (Hkv, T, T)
    seen = step + 1 - np.arange(step)
    score = kv_mean[:, : step + 1, :step].sum(1) / seen
    score[:, :4] = np.inf
    j = score.argmin(-1)
    assert res.merged[0].tolist() == j.tolist()
    for h in range(4):
        jh = j[h // 2]
        rows = a[h, step + 1 : step + 1 + horizon]
        merged = rows.copy()
        merged[:, jh] = 0
        merged /= merged.sum(-1, keepdims=True)
        cos = (rows * merged).sum(-1) / np.linalg.norm(rows, axis=-1) / np.linalg.norm(merged, axis=-1)
        np.testing.assert_allclose(res.cosine[0, h].numpy(), cos, atol=1e-5)


def test_aggregated_attention_recomputed_equals_the_engine_statistic(tiny):
    ids = prefix_ids(tiny, (TEXTS / "1953-Eisenhower.txt").read_text(), 96)
    r = engine_run(
        tiny,
        make_policy("h2o"),
        ids,
        prefill=96,
        steps=1,
        teacher=False,
        opts=RunOptions(budget=48, max_new_tokens=1, record="states"),
    )
    recorded = r.tensor("prefill/abar/1")
    del r.tensors["prefill/abar/1"]
    np.testing.assert_allclose(aggregated_attention(r, 1).numpy(), recorded.numpy(), rtol=1e-3, atol=1e-4)


def test_merging_ratio_and_gaussian_set_use_the_policy_functions(run):
    mr = merging_ratio(run, threshold=0.5)
    keys = run.tensor("prefill/k/1")[0]
    assert float(mr.ratio[1, 0]) == pytest.approx(1 - len(merging_sets(keys, 0.5)) / T)
    gs = gaussian_set(run, 1, 0, threshold=0.5, sigmas=("mean_distance", "eq7", 0.5))
    assert gs.positions == max(merging_sets(keys, 0.5), key=len)
    abar = aggregated_attention(run, 1)[0]
    assert gs.pivot == gs.positions[int(abar[gs.positions].argmax())]
    for w in gs.weights.values():
        assert float(w.sum()) == pytest.approx(1) and int(w.argmax()) == gs.positions.index(gs.pivot)


def test_gaussian_weights_follow_both_sigma_rules_of_the_paper_policy_default_first(run):
    gs = gaussian_set(run, 1, 0, threshold=0.5)
    assert set(gs.weights) == {"mean_distance", "eq7"}
    assert next(iter(gs.weights)) == make_policy("kvmerger").sigma_rule  # the policy's default first
    k = np_states(run, "k", 1)[0][gs.positions]  # (n, D)
    d2 = ((k - k[gs.positions.index(gs.pivot)]) ** 2).sum(-1)
    n = len(gs.positions)
    sigmas = {
        "mean_distance": np.sqrt(d2).sum() / (n - 1),  # §6.3: mean l2 distance to the pivot
        "eq7": d2.sum() / (np.sqrt(2) * n),
    }  # Eq. 7
    for rule, sigma in sigmas.items():
        w = np.exp(-d2 / (2 * sigma**2))
        np.testing.assert_allclose(gs.weights[rule].numpy(), w / w.sum(), rtol=1e-4, atol=1e-7)
    assert not torch.allclose(gs.weights["mean_distance"], gs.weights["eq7"])
    assert gs.label("mean_distance") == "σ = mean ‖k_p − k_i‖ (§6.3, default)"
    assert gs.label("eq7") == "σ from Eq. 7 (§5.2)" and gs.label(2.0) == "σ = 2"
    fig = run.figure("gaussian", layer=1, threshold=0.5, sigma=[2.0])
    assert [t.name for t in fig.data] == [gs.label("mean_distance"), gs.label("eq7"), gs.label(2.0)]
    js = run.analyze("gaussian", layer=1, threshold=0.5, rule=["eq7"])
    assert js["sigma_rules"] == {"eq7": "σ from Eq. 7 in KVMerger §5.2"} and list(js["weights"]) == ["eq7"]
    np.testing.assert_allclose(js["weights"]["eq7"], gs.weights["eq7"].numpy(), rtol=1e-6)


def test_log_perplexity_curve_is_the_running_mean_nll(run):
    c = log_perplexity_curve(run, "full")
    nll = run.tensor("steps/nll").double().numpy()
    np.testing.assert_allclose(c.log_ppl.numpy(), np.cumsum(nll) / np.arange(1, len(nll) + 1), rtol=1e-6)
    assert c.positions.tolist() == list(range(T, T + len(nll)))


def test_bad_input_is_one_sentence(run, tiny):
    with pytest.raises(KvlensError, match="out of range"):
        similarity_map(run, 3, 0)
    with pytest.raises(KvlensError, match="KV heads 0 to 1"):
        similarity_map(run, 0, 2, "key")
    r = engine_run(
        tiny,
        make_policy("full"),
        list(range(40, 60)),
        prefill=20,
        steps=1,
        teacher=False,
        opts=RunOptions(max_new_tokens=1),
    )
    with pytest.raises(KvlensError, match="--record states"):
        adjacency(r)


def test_cli_json_contracts(tmp_path, capsys):
    tiny_run(str(tmp_path / "run"))
    assert main(["analyze", "adjacency", "--run", str(tmp_path / "run"), "--json"]) == 0
    adj = json.loads(capsys.readouterr().out)
    assert set(adj) == {"layers", "query", "key", "value"} and adj["layers"] == 3
    assert adj["key"] == pytest.approx(adjacency(tiny_run()).per_layer("key"), abs=1e-6)
    assert main(["analyze", "spectrum", "--run", str(tmp_path / "run"), "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert set(spec) == {"layers", "key", "value"} and set(spec["value"]) == {
        "singular_values",
        "energy_top8",
    }
    assert len(spec["key"]["singular_values"]) == 3 and spec["key"]["singular_values"][0][0] == pytest.approx(
        1
    )
    x = np_states(tiny_run(), "k", 2)
    energy = [(s[:8] ** 2).sum() / (s**2).sum() for s in np.linalg.svd(x, compute_uv=False)]
    assert spec["key"]["energy_top8"][2] == pytest.approx(np.mean(energy), rel=1e-5)


def test_cli_bad_input_exits_2(tmp_path, capsys):
    tiny_run(str(tmp_path / "run"))
    assert main(["analyze", "similarity", "--run", str(tmp_path / "run"), "--layer", "9"]) == 2
    assert main(["analyze", "similarity", "--run", str(tmp_path / "run"), "--head", "5"]) == 2
    assert main(["analyze", "adjacency", "--run", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("kvlens: error: ") for line in err)


@pytest.mark.slow
def test_embedded_model_states_match_numpy(smol):
    ids = prefix_ids(smol, (TEXTS / "1961-Kennedy.txt").read_text(), 300)
    r = record_states(smol, ids, layers=[0, 15])
    adj = adjacency(r)
    for i, layer in enumerate(adj.layers):
        x = np_unit(np_states(r, "k", layer))
        np.testing.assert_allclose(
            adj.values["key"][i].numpy(), (x[:, 1:] * x[:, :-1]).sum(-1).mean(-1), atol=1e-5
        )
    x = np_unit(np_states(r, "q", 15)[4])
    m = similarity_map(r, 15, 4, "query", max_size=100, lower=False)
    sizes = np.diff(m.edges.numpy())
    assert (m.matrix.numpy() * np.outer(sizes, sizes)).sum() / 300**2 == pytest.approx(
        (x @ x.T).mean(), abs=1e-5
    )
    spec = spectrum(r, "key")
    s = np.linalg.svd(np_states(r, "k", 15)[1], compute_uv=False)
    np.testing.assert_allclose(spec.values[1, 1].numpy(), s / s[0], rtol=1e-4, atol=1e-6)


def test_sweeps_over_texts_and_lengths(tiny):
    texts = {"a": (TEXTS / "1953-Eisenhower.txt").read_text(), "b": (TEXTS / "1986-Reagan.txt").read_text()}
    ratios = merging_ratio_over_texts(tiny, texts, tokens=64, threshold=0.5)
    assert list(ratios) == ["a", "b"]
    keys = record_states(tiny, prefix_ids(tiny, texts["b"], 64)).tensor("prefill/k/2")[1]
    assert float(ratios["b"].ratio[2, 1]) == pytest.approx(1 - len(merging_sets(keys, 0.5)) / 64)
    res = corm_over_lengths(tiny, texts, [48, 96], {"window": 8, "recent": 8})
    assert res.ratio.shape == (2, 2) and res.params["window"] == 8
    r = engine_run(
        tiny,
        make_policy("corm", {"window": 8, "recent": 8}),
        prefix_ids(tiny, texts["a"], 96),
        prefill=96,
        steps=1,
        teacher=False,
        opts=RunOptions(max_new_tokens=1),
    )
    kept = r.tensor("steps/kv_slots")[0].float().mean()
    assert float(res.ratio[0, 1]) == pytest.approx(1 - float(kept) / 96)
    assert 0 < float(res.ratio[0, 1]) < 1  # corm drops some keys of a 96-token prompt, keeps the recent 8
    with pytest.raises(KvlensError, match="fewer than"):
        prefix_ids(tiny, "short", 64)


SMALL = {
    "similarity": {"max_size": 40},
    "preceding": {"window": 8},
    "variance": {"group": 16},
    "merge-similarity": {"step": 50, "horizon": 20},
    "gaussian": {"threshold": 0.5},
}


def run_kinds():
    from kvlens.analysis.registry import analyses

    # those that replay a run need its model: tests/analysis/test_rank_perturbation.py runs them on the tiny
    # one
    return [name for name, cls in analyses().items() if cls.inputs != "model" and not cls.replays]


@functools.cache
def measured_run(tmp_dir: str):
    """A measured CaM run of the tiny model with attention rows (so with states, decisions and merges),
    saved."""
    from kvlens.experiments.api import generate

    opts = RunOptions(budget=24, max_new_tokens=6, record=RecordLevel.ATTENTION)
    r = generate(
        tiny_model(),
        "Merging keeps what eviction drops. " * 4,
        "cam",
        {"base": "h2o"},
        opts=opts,
        measure=True,
    )
    return r.save(tmp_dir)


@pytest.mark.parametrize("kind", run_kinds())
def test_every_registered_analysis_dispatches_to_itself_on_the_cli_and_in_python(
    kind, tmp_path_factory, capsys
):
    from kvlens import load_run

    path = measured_run(str(tmp_path_factory.getbasetemp() / "measured"))
    run = load_run(path)
    flags = [a for k, v in SMALL.get(kind, {}).items() for a in (f"--{k.replace('_', '-')}", str(v))]
    assert main(["analyze", kind, "--run", str(path), "--json", *flags]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(
        json.dumps(run.analyze(kind, **SMALL.get(kind, {})))
    )
    assert (
        run.figure(kind, **SMALL.get(kind, {})).layout.meta["analysis"] == kind
    )  # no fall-through to another


def test_analyze_list_names_every_analysis_with_its_paper_level_and_parameters(capsys):
    from kvlens.analysis.registry import analyses

    assert main(["analyze", "--list", "--json"]) == 0
    listed = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    assert (
        set(listed)
        == set(analyses())
        >= {"similarity", "adjacency", "perplexity", "merging-ratio", "corm-lengths"}
    )
    assert listed["spectrum"]["paper"] == "WeightedKV Fig. 1" and listed["spectrum"]["level"] == "states"
    assert listed["merging-ratio"]["level"] is None and listed["perplexity"]["inputs"] == "runs"
    sim = {p["name"]: p for p in listed["similarity"]["params"]}
    assert (
        sim["max_size"]["default"] == 512 and sim["max_size"]["flag"] == "--max-size" and sim["layer"]["help"]
    )


def test_unknown_or_unfitting_requests_are_one_sentence(tmp_path, capsys):
    from kvlens.analysis.registry import analysis_figure, get_analysis

    with pytest.raises(KvlensError, match="Unknown analysis 'nope'; choose one of: adjacency, "):
        get_analysis("nope")
    r = tiny_run()
    with pytest.raises(KvlensError, match="'adjacency' has no parameter 'layer'; it takes none"):
        r.figure("adjacency", layer=1)
    with pytest.raises(KvlensError, match="layer must be an integer; got 'x'"):
        r.figure("similarity", layer="x")
    with pytest.raises(KvlensError, match="sigma must be comma-separated numbers"):
        r.figure("gaussian", sigma=2.0)
    with pytest.raises(KvlensError, match="rule takes mean_distance or eq7; got 'mean'"):
        r.figure("gaussian", rule=["mean"])
    with pytest.raises(KvlensError, match="Name at least one sigma"):
        r.figure("gaussian", rule=[])
    with pytest.raises(KvlensError, match="runs the model over the bundled texts"):
        r.figure("merging-ratio")
    for kind, bad in (
        ("spectrum", {"components": 0}),
        ("merge-similarity", {"horizon": 0}),
        ("similarity", {"max_size": 0}),
    ):
        with pytest.raises(KvlensError, match=f"{next(iter(bad))} must be at least 1; got 0"):
            r.figure(kind, **bad)
    summary = engine_run(
        tiny_model(),
        make_policy("full"),
        list(range(40, 60)),
        prefill=20,
        steps=1,
        teacher=False,
        opts=RunOptions(max_new_tokens=1),
    )
    with pytest.raises(
        KvlensError, match="needs a run recorded with --record states; this run was recorded at summ"
    ):
        analysis_figure("similarity", summary)
    with pytest.raises(SystemExit) as exit_:
        main(["analyze", "nope", "--run", "x"])
    assert exit_.value.code == 2
    assert main(["figure", "adjacency", "--run", "x", "--out", str(tmp_path / "a.gif")]) == 2
    assert main(["analyze", "adjacency", "--run", "x", "--run", "y"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "invalid choice: 'nope'" in err[0] and "takes one --run" in err[2]


def test_a_registered_analysis_reaches_the_cli_and_run_figure(tmp_path, capsys):
    import plotly.graph_objects as go

    from kvlens.analysis import registry

    @registry.register_analysis
    class Norms(registry.Analysis):
        name = "test-norms"
        paper = "none"
        level = RecordLevel.STATES
        params = (registry.Param("layer", 0, "layer"),)

        def compute(self, run, layer):
            return run.tensor(f"prefill/k/{layer}").float().norm(dim=-1).mean(0)  # (T,)

        def to_json(self, norms, layer):
            return {"layer": layer, "norms": norms.tolist()}

        def figure(self, run, layer):
            return go.Figure(
                go.Scatter(y=self.compute(run, layer).tolist()), layout={"meta": {"analysis": self.name}}
            )

    try:
        tiny_run(str(tmp_path / "run"))
        assert main(["analyze", "test-norms", "--run", str(tmp_path / "run"), "--layer", "2", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["layer"] == 2 and len(out["norms"]) == T
        assert list(tiny_run().figure("test-norms", layer=2).data[0].y) == pytest.approx(
            out["norms"], abs=1e-6
        )
        with pytest.raises(TypeError, match="Two analyses are called 'test-norms'"):
            registry.register_analysis(type("Other", (Norms,), {}))
    finally:
        del registry._REGISTRY["test-norms"]


def test_the_run_format_reaches_the_analyses_only_through_the_installed_dispatcher(monkeypatch):
    """`kvlens.runs.run` names no analysis module: importing it alone (which imports `kvlens`) installs the
    registry behind Run.figure; with no dispatcher installed, Run.figure is one sentence."""
    import subprocess
    import sys

    from kvlens.runs import run as run_format

    code = (
        "import kvlens.runs.run as r, sys; "
        "print(sorted(r._ANALYSES), 'kvlens.analysis.kinds.adjacency' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["['analyze',", "'figure']", "False"]  # installed; the kinds register on first use
    monkeypatch.setattr(run_format, "_ANALYSES", {})
    with pytest.raises(
        KvlensError, match=r"^No analyses are installed for Run.figure and Run.analyze; import kvlens"
    ):
        tiny_run().figure("adjacency")
    with pytest.raises(KvlensError, match="No analyses are installed"):
        tiny_run().analyze("adjacency")


def test_the_model_analyses_run_through_the_registry(tiny):
    from kvlens.analysis.registry import analysis_figure, analysis_json

    corm = analysis_json("corm-lengths", tiny, texts=1, lengths="96,48", settings=["window=8", "recent=8"])
    assert corm["lengths"] == [48, 96] and corm["params"]["window"] == 8 and len(corm["texts"]) == 1
    ratio = analysis_figure("merging-ratio", tiny, texts=2, tokens=64, threshold=0.5)
    assert ratio.layout.meta["analysis"] == "merging-ratio" and [t.name for t in ratio.data] == [
        "1946-Truman",
        "1953-Eisenhower",
    ]
    with pytest.raises(KvlensError, match="--lengths takes comma-separated integers; got '48,x'"):
        analysis_json("corm-lengths", tiny, lengths="48,x")
    with pytest.raises(KvlensError, match="texts must be at least 1; got 0"):
        analysis_json("merging-ratio", tiny, texts=0)


def test_bad_parameters_are_refused_before_the_model_is_loaded(capsys):
    assert main(["analyze", "merging-ratio", "--tokens", "1", "--model", "/no/such/model"]) == 2
    assert capsys.readouterr().err.strip() == "kvlens: error: tokens must be at least 2; got 1."


def test_aggregated_attention_is_recorded_and_recomputed_for_older_runs_that_recorded_zeros(run):
    a = np_attention(np_states(run, "q", 1), np_states(run, "k", 1))  # (Hq, T, T)
    want = a.reshape(2, 2, T, T).mean(1).sum(1)  # (Hkv, T) column sums of the group mean
    np.testing.assert_allclose(run.tensor("prefill/abar/1").numpy(), want, rtol=1e-3, atol=1e-4)
    older = dataclasses.replace(
        run, tensors={**run.tensors, "prefill/abar/1": torch.zeros_like(run.tensor("prefill/abar/1"))}
    )  # runs of policies without attention recorded zeros before
    np.testing.assert_allclose(aggregated_attention(older, 1).numpy(), want, rtol=1e-3, atol=1e-4)


def test_readme_analysis_example_is_listed_analyzed_drawn_and_reaches_run_figure(tmp_path):
    """The "Adding an analysis" file of docs/extending.md, saved in a copy of the repository, is all it takes:
    the CLI, Run.figure and the app's Analyses page offer it."""
    import os
    import shutil
    import subprocess
    import sys
    import textwrap

    path, code = doc_example("Adding an analysis")
    assert path.startswith("kvlens/analysis/kinds/") and not (ROOT / path).exists()
    repo = tmp_path / "repo"
    for part in ("kvlens", "pages"):
        shutil.copytree(ROOT / part, repo / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "app.py", repo / "app.py")
    (repo / path).write_text(code)
    run, out = str(CACHED_RUNS / "full-states"), str(tmp_path / "k.csv")
    script = textwrap.dedent(f"""
        import json
        import kvlens
        from kvlens.cli import main
        main(["analyze", "--list", "--json"])
        main(["analyze", "key-norms", "--run", {run!r}, "--layer", "5", "--json"])
        main(["figure", "key-norms", "--run", {run!r}, "--out", {out!r}])
        print(kvlens.load_run({run!r}).figure("key-norms").layout.meta["analysis"])
        from streamlit.testing.v1 import AppTest
        at = AppTest.from_file("app.py", default_timeout=120).run()
        # a page link leaves the last page's ?layer= behind; AppTest's switch_page keeps it
        at.query_params.clear()
        at.switch_page("pages/analyses.py").run()
        at.sidebar.selectbox(key="app_run").set_value({run!r}).run()
        at.selectbox(key="an_kind").set_value("key-norms").run()
        assert not at.exception and at.number_input(key="an_key-norms_layer").help
        print(json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]["meta"]["analysis"])
    """)
    env = {**os.environ, "KVLENS_CACHED_RUNS": str(CACHED_RUNS), "KVLENS_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    decoder, text = json.JSONDecoder(), proc.stdout
    listed, end = decoder.raw_decode(text)
    result, end2 = decoder.raw_decode(text, end + 1)
    assert {d["name"]: d["level"] for d in listed}["key-norms"] == "states"
    assert result["layer"] == 5 and all(-1 < c < 0 for c in result["correlation_norm_log_attention"])
    assert text[end2:].split() == [out, out.replace(".csv", ".json"), "key-norms", "key-norms"]
