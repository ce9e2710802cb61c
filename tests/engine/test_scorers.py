"""KVzap scorers (arXiv 2601.07891): the fit, the file and its refusals, and a training that resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvlens import texts
from kvlens.engine import scorers
from kvlens.errors import KvlensError
from kvlens.experiments import scorer_training as st
from tests.conftest import tiny_model

CFG = st.Training(tokens=128, per_text=2, samples=48, held_out=1)


def sources() -> dict[str, str]:
    return {name: text[:1500] for name, text in texts.bundled(3).items()}


def test_ridge_recovers_a_known_linear_map_and_scores_it_a_perfect_held_out_fit():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(3, 10, generator=gen), torch.randn(3, generator=gen)  # (Hkv, d), (Hkv,)
    x, held_x = torch.randn(400, 10, generator=gen), torch.randn(100, 10, generator=gen)
    layer = st.fit_linear(x, x @ w.T + b, alpha=1e-6)
    torch.testing.assert_close(layer.w1, w, atol=1e-4, rtol=0)
    torch.testing.assert_close(layer.b1, b, atol=1e-4, rtol=0)
    torch.testing.assert_close(layer(held_x), (held_x @ w.T + b).T, atol=1e-4, rtol=0)  # (Hkv, N)
    noisy = held_x @ w.T + b + 0.5 * torch.randn(100, 3, generator=gen)
    (fit,) = st.held_out_fit([layer], {"hidden": held_x[None], "target": noisy[None]})
    (exact,) = st.held_out_fit([layer], {"hidden": held_x[None], "target": (held_x @ w.T + b)[None]})
    assert exact == {"r2": 1.0, "spearman": 1.0} and 0.5 < fit["r2"] < 0.99 and fit["spearman"] < 1.0


def test_the_mlp_fits_a_saturating_target_that_a_linear_map_cannot_and_the_same_seed_gives_the_same_net():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(3, 10, generator=gen), torch.randn(3, generator=gen)
    x, held = torch.randn(2000, 10, generator=gen), torch.randn(300, 10, generator=gen)
    cfg = st.Training(kind="mlp", hidden=32, epochs=150, batch=128, lr=1e-2)
    mlp = st.fit_mlp(x, torch.tanh(x @ w.T) + b, cfg)
    data = {"hidden": held[None], "target": (torch.tanh(held @ w.T) + b)[None]}
    (fit,) = st.held_out_fit([mlp], data)
    (linear,) = st.held_out_fit([st.fit_linear(x, torch.tanh(x @ w.T) + b, 1.0)], data)
    assert fit["r2"] > 0.99 and linear["r2"] < 0.85
    again = st.fit_mlp(x, torch.tanh(x @ w.T) + b, cfg)
    assert all(
        torch.equal(p, q) for p, q in zip(mlp.tensors(0).values(), again.tensors(0).values(), strict=True)
    )


def test_ridge_penalises_the_weights_but_not_the_intercept():
    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(1))
    layer = st.fit_linear(x, torch.full((50, 2), 7.0), alpha=1e3)
    assert layer.w1.abs().max() < 1e-6 and torch.allclose(layer.b1, torch.full((2,), 7.0))


def test_spearman_ranks_ties_at_their_mean_rank():
    assert st.ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_an_interrupted_training_resumes_from_its_cached_targets_with_the_same_scorer(tmp_path):
    model, seen = tiny_model(), []

    def stop_after_two(done, total, cached):
        seen.append(cached)
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        st.train(model, sources(), CFG, tmp_path / "resumed", stop_after_two)
    layers, fit, _ = st.train(model, sources(), CFG, tmp_path / "resumed", lambda d, t, c: seen.append(c))
    fresh, fresh_fit, sizes = st.train(model, sources(), CFG, tmp_path / "fresh")
    assert seen == [False, False, True, True, False, False, False, False]  # 6 pieces: 2 read back, 4 computed
    assert sizes == {"train_positions": 4 * CFG.samples, "held_out_positions": 2 * CFG.samples}
    for a, b in zip(layers, fresh, strict=True):
        assert torch.equal(a.w1, b.w1) and torch.equal(a.b1, b.b1)
    assert fit == fresh_fit


def test_the_targets_are_the_log_kvzip_plus_scores_of_the_drawn_positions_never_the_sinks():
    model = tiny_model()
    ids = list(model.tokenizer(sources()["1961-Kennedy"]).input_ids)[:128]
    got = st.targets(model, ids, CFG)
    assert got["hidden"].shape == (3, CFG.samples, 64) and got["target"].shape == (3, CFG.samples, 2)
    assert got["positions"].min() >= CFG.n_sink and len(set(got["positions"].tolist())) == CFG.samples
    assert got["target"].isfinite().all() and (got["target"] < 10).all()


def saved(path: Path, model) -> Path:
    gen = torch.Generator().manual_seed(2)
    layers = [
        scorers.LayerScorer(torch.randn(2, 64, generator=gen), torch.randn(2, generator=gen))
        for _ in range(3)
    ]
    scorers.save(path, layers, model, {"fit": "[]", "command": "test"})
    return path


def test_a_saved_scorer_loads_back_for_its_model(tmp_path):
    model = tiny_model()
    layers, info = scorers.load(saved(tmp_path / "tiny.safetensors", model), model)
    assert len(layers) == 3 and info["kind"] == "linear" and info["fingerprint"] == scorers.fingerprint(model)
    assert layers[0](torch.zeros(5, 64)).shape == (2, 5)


def one_sentence(err: KvlensError) -> str:
    text = str(err)
    assert "\n" not in text and text.endswith(".") and "Traceback" not in text
    return text


def test_a_missing_file_a_corrupt_file_and_another_models_file_are_each_refused_in_one_sentence(tmp_path):
    model, other = tiny_model(), tiny_model(seed=1)
    path = saved(tmp_path / "tiny.safetensors", model)
    with pytest.raises(KvlensError) as missing:
        scorers.load(tmp_path / "none.safetensors", model)
    assert "There is no scorer file" in one_sentence(missing.value)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:200])
    with pytest.raises(KvlensError) as damaged:
        scorers.load(corrupt, model)
    assert "not a readable scorer file" in one_sentence(damaged.value)
    with pytest.raises(KvlensError) as foreign:
        scorers.load(path, other)
    assert "trained for another model" in one_sentence(foreign.value)


def test_auto_finds_the_scorer_trained_for_the_model_and_refuses_when_none_is(tmp_path, monkeypatch):
    model = tiny_model(seed=3)
    monkeypatch.setenv("KVLENS_SCORERS", str(tmp_path))
    saved(tmp_path / "b-other.safetensors", tiny_model(seed=4))
    (tmp_path / "a-broken.safetensors").write_bytes(b"not a scorer")  # read first, skipped
    with pytest.raises(KvlensError, match="No KVzap scorer was trained for this model"):
        scorers.find(model)
    mine = saved(tmp_path / "c-mine.safetensors", model)
    assert scorers.find(model) == mine


def test_train_scorer_writes_a_scorer_kvzap_finds_and_reports_its_held_out_fit_per_layer(
    tiny_dir, tmp_path, capsys
):
    import json

    from kvlens.cli import main
    from kvlens.engine.models import load_model

    files = []
    for name, text in sources().items():
        files.append(tmp_path / f"{name}.txt")
        files[-1].write_text(text, encoding="utf-8")
    out = tmp_path / "scorers" / "tiny.safetensors"
    args = ["--model", str(tiny_dir), "--texts", *map(str, files), "--tokens", "128", "--samples", "32"]
    args += ["--held-out", "1", "--cache", str(tmp_path / "cache"), "--out", str(out), "--json"]
    assert main(["train-scorer", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["held_out_fit"]) == 3 and report["train_positions"] == 4 * 32
    assert report["held_out_positions"] == 2 * 32 and report["seconds"]["wall"] > 0
    model = load_model(str(tiny_dir), device="cpu", dtype="float32")
    layers, info = scorers.load(out, model)
    assert scorers.fit_of(info) == report["held_out_fit"] and "--held-out 1" in info["command"]


def test_train_scorer_refuses_bad_settings_in_one_sentence(tmp_path, capsys):
    from kvlens.cli import main

    for bad, words in (
        (["--held-out", "0"], "--held-out must be at least 1"),
        (["--out", "scorer.bin"], "--out must name a .safetensors file"),
        (["--tokens", "0"], "--tokens must be at least 1"),
    ):
        assert main(["train-scorer", "--out", "x.safetensors", *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
