"""The q/k embedding analysis on the shipped runs, against the decision log and an independent numpy PCA."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

from kvlens import load_run
from kvlens.analysis.kinds.embedding import embedding, project
from kvlens.cli import main
from kvlens.errors import KvlensError
from tests.conftest import CACHED_RUNS


@functools.cache
def shipped(name: str):
    return load_run(CACHED_RUNS / name)


def decisions(run, layer: int, head: int, action: str, step: int | None = None):
    d = run.decisions
    d = d[(d["layer"] == layer) & (d["kv_head"] == head) & (d["action"] == action)]
    return d if step is None else d[d["step"] <= step]


def test_cli_json_has_t_queries_and_keys_and_the_run_evictions(capsys):
    run = shipped("h2o-attention")
    t = run.tensor("prefill/k/15").shape[1]
    assert (
        main(
            [
                "analyze",
                "embedding",
                "--run",
                str(CACHED_RUNS / "h2o-attention"),
                "--layer",
                "15",
                "--head",
                "0",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert (out["layer"], out["head"], out["query_head"], out["method"]) == (15, 0, 0, "pca")
    assert len(out["queries"]) == len(out["keys"]) == t == out["tokens"] and out["positions"] == list(
        range(t)
    )
    assert all(len(xy) == 2 for xy in out["queries"] + out["keys"])
    d = decisions(run, 15, 0, "evict")
    assert out["evicted"] == sorted(int(p) for p in d["position"] if p < t) and len(out["evicted"]) > 10
    assert (
        out["generated_decisions"] == int((d["position"] >= t).sum()) > 0
    )  # h2o also evicts generated tokens
    assert out["merged"] == [] and len(out["explained_variance"]) == 2
    first = run.analyze("embedding", layer=15, head=0, step=0)  # the compression right after the prompt
    assert first["evicted"] == sorted(int(p) for p in decisions(run, 15, 0, "evict", step=0)["position"])
    assert 0 < len(first["evicted"]) < len(out["evicted"]) and first["queries"] == out["queries"]


@pytest.mark.parametrize("name,layer,head", [("kvmerger-attention", 15, 1), ("cam-attention", 0, 2)])
def test_merged_keys_and_their_links_are_the_merge_decisions(name, layer, head):
    run = shipped(name)
    t = run.tensor(f"prefill/k/{layer}").shape[1]
    e = embedding(run, layer, head)
    d = decisions(run, layer, head, "merge")
    want = {int(p): [int(x) for x in tg] for p, tg in zip(d["position"], d["targets"], strict=True) if p < t}
    assert {m["position"]: m["targets"] for m in e.merged} == want and len(want) > 5 and e.evicted == []
    draws = {int(p): int(x) for p, x in zip(d["position"], d["draw"], strict=True)}
    assert all(m["draw"] == draws[m["position"]] for m in e.merged)
    fig = run.figure("embedding", layer=layer, head=head)
    assert fig.layout.meta["analysis"] == "embedding" and fig.layout.xaxis.title.text.startswith("PC 1")
    links = [tr for tr in fig.data if tr.mode == "lines"]
    segments = sum(
        1
        for m in e.merged
        if m["draw"] != 0
        for tg, w in zip(m["targets"], m["weights"], strict=True)
        if tg < t and w != 0
    )  # a merge that moved nothing (Bernoulli draw 0) is not linked
    assert segments > 0 and len(links) == 1 and len(links[0].x) == 3 * segments
    k = e.keys
    starts = {(round(x, 4), round(y, 4)) for x, y in zip(links[0].x[0::3], links[0].y[0::3], strict=True)}
    assert starts == {
        (round(float(k[m["position"], 0]), 4), round(float(k[m["position"], 1]), 4))
        for m in e.merged
        if m["draw"] != 0 and any(w != 0 for w in m["weights"])
    }


def test_pca_is_fitted_on_queries_and_keys_together_and_is_deterministic():
    run = shipped("h2o-attention")
    e = embedding(run, 15, 1)
    assert e.query_head == 3  # KV head 1 serves query heads 3 to 5 (9 query heads over 3 KV heads)
    x = np.concatenate(
        [run.tensor("prefill/q/15")[3].double().numpy(), run.tensor("prefill/k/15")[1].double().numpy()]
    )
    x -= x.mean(0)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    want = x @ vt[:2].T
    got = torch.cat([e.queries, e.keys]).double().numpy()
    np.testing.assert_allclose(np.abs(got), np.abs(want), rtol=1e-3, atol=1e-3)  # up to each axis' sign
    assert e.explained_variance == pytest.approx((s[:2] ** 2 / (s**2).sum()).tolist(), rel=1e-5)
    again = embedding(run, 15, 1)
    assert torch.equal(again.queries, e.queries) and torch.equal(again.keys, e.keys)
    other = embedding(run, 15, 1, query_head=5)
    assert not torch.equal(other.queries, e.queries)


def test_tsne_option_is_deterministic_and_separates_clusters():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20, 8, generator=g), torch.randn(20, 8, generator=g) + 12])
    xy, variance = project(x, "tsne")
    assert xy.shape == (40, 2) and variance is None
    assert torch.equal(xy, project(x, "tsne")[0])
    a, b = xy[:20], xy[20:]
    assert torch.cdist(a, b).min() > max(torch.pdist(a).max(), torch.pdist(b).max()) / 4


def test_bad_requests_are_one_sentence(capsys):
    run = shipped("h2o-attention")
    with pytest.raises(KvlensError, match="^Head 3 is out of range: layer 15 has KV heads 0 to 2.$"):
        run.analyze("embedding", layer=15, head=3)
    with pytest.raises(
        KvlensError, match="^Query head 4 does not read KV head 0: KV head 0 serves query heads 0 to 2"
    ):
        run.analyze("embedding", layer=15, head=0, query_head=4)
    with pytest.raises(KvlensError, match="method must be one of pca, tsne; got 'umap'"):
        run.analyze("embedding", method="umap")
    with pytest.raises(
        KvlensError, match="needs a run recorded with --record states; tova-summary was recorded at"
    ):
        shipped("tova-summary").analyze("embedding")
    assert main(["analyze", "embedding", "--run", str(CACHED_RUNS / "h2o-attention"), "--head", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvlens: error: Head 7 is out of range: layer 15 has KV heads 0 to 2."]
