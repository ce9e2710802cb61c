"""Train a KVzap scorer for a model: KVzip+ targets from the engine's own replay, one surrogate per layer.

Jégou & Jeblick, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", 2026,
https://arxiv.org/abs/2601.07891, as kvpress's `kvzap/data.py` and `kvzap/train.py` do it: for each text,
the KVzip+ score of every prompt KV pair (`kvzip:score=plus`, `kvlens.policies.kvzip`) and the state
entering each layer's attention; `samples` positions drawn per text; per layer a fit from the state
`(N, d_model)` to the log scores `(N, Hkv)`: ridge regression (`linear`, scikit-learn's `Ridge(alpha=1)`
in kvpress; here its closed form in float64, the intercept unpenalised) or a two-layer GELU MLP (`mlp`,
AdamW on the squared error, cosine schedule, gradient clipped at 1, as kvpress's skorch settings).
Whole texts are held out (the last `held_out` of the texts given) and the fit is reported on them per
layer: R² and Spearman's rank correlation, each the mean over the layer's KV heads.

Divergences from kvpress, on purpose: texts are the bundled State of the Union addresses (or the user's),
cut into `per_text` consecutive pieces of `tokens` tokens, not Nemotron's pretraining sample; the replay is
kvlens's KVzip (a pass per `chunk` after the prompt, the first `n_sink` slots in its softmax and never
targets) rather than one forward of the chat-templated prompt and its copy; log scores are floored at
float32's smallest normal number. Targets are cached per piece (`cache_dir`, keyed by the model's
fingerprint, the piece's tokens and the settings), so an interrupted training resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvlens.engine.loop import RunOptions, new_loop
from kvlens.engine.models import LoadedModel
from kvlens.engine.qfilters import fingerprint
from kvlens.engine.scorers import LayerScorer
from kvlens.errors import KvlensError
from kvlens.kvcache import HIDDEN
from kvlens.policies import make_policy

SCORE = "kvzip_score"  # what `kvzip:score=plus` leaves per layer after its replay `(Hkv, T)`
Progress = Callable[[int, int, bool], None]  # (done, total, whether this piece came from the cache)


@dataclass(frozen=True)
class Training:
    """How a scorer is trained (kvpress's `train.py` defaults where they apply)."""

    kind: str = "linear"  # linear | mlp
    tokens: int = 1024  # per piece (kvpress: texts of 750-1250 tokens)
    per_text: int = 2  # consecutive pieces cut from each text
    samples: int = 512  # positions drawn per piece (kvpress: 500)
    held_out: int = 2  # the last texts, kept apart for the fit's report
    n_sink: int = 4  # KVzip's sinks: in the replay's softmax, never targets
    chunk: int = 2048  # KVzip's replay chunk
    alpha: float = 1.0  # ridge penalty (scikit-learn's default, kvpress's)
    hidden: int = 512  # the MLP's width (kvpress: 512)
    epochs: int = 15  # MLP (kvpress: 15)
    lr: float = 5e-3  # MLP (kvpress: 5e-3)
    batch: int = 512  # MLP (kvpress: 512)
    seed: int = 0


def pieces(model: LoadedModel, texts: dict[str, str], cfg: Training) -> list[tuple[str, list[int]]]:
    """`(text id, token ids)` of each text's first `per_text` pieces of `cfg.tokens` tokens."""
    out = []
    for name, text in texts.items():
        ids = list(model.tokenizer(text).input_ids)
        out += [(name, ids[i : i + cfg.tokens]) for i in range(0, cfg.per_text * cfg.tokens, cfg.tokens)]
    out = [(name, ids) for name, ids in out if len(ids) == cfg.tokens]
    if len({name for name, _ in out}) <= cfg.held_out:
        raise KvlensError(
            f"Only {len({n for n, _ in out})} texts have {cfg.tokens} tokens, and {cfg.held_out} are held "
            f"out: give more or longer texts, or fewer --tokens."
        )
    return out


def targets(model: LoadedModel, ids: list[int], cfg: Training) -> dict[str, torch.Tensor]:
    """One piece: `hidden` `(L, S, d_model)` at `samples` drawn positions, their log KVzip+ `target`
    `(L, S, Hkv)` and `positions` `(S,)`, from the prefill and replay of `kvzip:score=plus`."""
    policy = make_policy("kvzip", {"score": "plus", "n_sink": cfg.n_sink, "chunk": cfg.chunk})
    opts = RunOptions(record="summary", log_decisions=False, budget=cfg.n_sink + 1)
    loop = new_loop(model, policy, opts, [], len(ids), len(ids) + 1)
    with torch.inference_mode():
        loop.forward(ids, 0)
        states = [book.state[HIDDEN].float().cpu() for book in loop.cache.books]  # (T, d) per layer
        loop.replay(ids)
        scores = [book.state[SCORE].float().cpu() for book in loop.cache.books]  # (Hkv, T)
    gen = torch.Generator().manual_seed(cfg.seed + int(hashlib.sha256(str(ids).encode()).hexdigest()[:8], 16))
    drawn = cfg.n_sink + torch.randperm(len(ids) - cfg.n_sink, generator=gen)[: cfg.samples].sort().values
    floor = torch.finfo(torch.float32).tiny
    return {
        "hidden": torch.stack([h[drawn] for h in states]).contiguous(),
        "target": torch.stack([s[:, drawn].T for s in scores]).clamp_min(floor).log().contiguous(),
        "positions": drawn,
    }


def cached_targets(model: LoadedModel, ids: list[int], cfg: Training, cache_dir: Path) -> tuple[dict, bool]:
    """`targets`, read from `cache_dir` when an earlier run computed them (then True), else computed and
    written there atomically."""
    keep = ("tokens", "samples", "n_sink", "chunk", "seed")
    key = json.dumps([fingerprint(model), ids, {k: getattr(cfg, k) for k in keep}])
    path = cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"
    if path.is_file():
        try:
            return load_file(path), True
        except Exception:  # a damaged cache entry (an interrupted write of another tool): computed again
            path.unlink()
    found = targets(model, ids, cfg)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(found, tmp)
    tmp.replace(path)
    return found, False


def collect(
    model: LoadedModel,
    texts: dict[str, str],
    cfg: Training,
    cache_dir: Path,
    progress: Progress | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Training and held-out data, each `hidden` `(L, N, d_model)` and `target` `(L, N, Hkv)`: the pieces
    of all texts but the last `held_out`, and of those."""
    chosen = pieces(model, texts, cfg)
    names = list(dict.fromkeys(name for name, _ in chosen))
    held = set(names[len(names) - cfg.held_out :])
    parts: dict[bool, list[dict]] = {False: [], True: []}
    for i, (name, ids) in enumerate(chosen):
        found, cached = cached_targets(model, ids, cfg, cache_dir)
        parts[name in held].append(found)
        if progress is not None:
            progress(i + 1, len(chosen), cached)
    joined = [
        {k: torch.cat([p[k] for p in parts[h]], dim=1) for k in ("hidden", "target")} for h in (False, True)
    ]
    return joined[0], joined[1]


def fit_linear(x: torch.Tensor, y: torch.Tensor, alpha: float) -> LayerScorer:
    """Ridge regression `(N, d)` -> `(N, H)` with an unpenalised intercept (scikit-learn's `Ridge`), solved in
    float64: `w = (Xc^T Xc + alpha I)^-1 Xc^T yc` on centred data, `b = mean(y) - mean(x) w`."""
    x, y = x.double(), y.double()
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    w = torch.linalg.solve(xc.T @ xc + alpha * torch.eye(x.shape[1], dtype=x.dtype), xc.T @ yc)  # (d, H)
    return LayerScorer(w.T.float(), (my - mx @ w).float())


def fit_mlp(x: torch.Tensor, y: torch.Tensor, cfg: Training) -> LayerScorer:
    """A `d -> hidden -> H` GELU MLP fit by AdamW on the squared error, kvpress's schedule (cosine, gradient
    norm clipped at 1), in shuffled batches drawn from `cfg.seed`."""
    gen = torch.Generator().manual_seed(cfg.seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], cfg.hidden), torch.nn.GELU(), torch.nn.Linear(cfg.hidden, y.shape[1])
    )
    with torch.no_grad():
        for p in net.parameters():  # a seeded start (the layers' own init draws from the global generator)
            p.copy_(torch.empty_like(p).uniform_(-1, 1, generator=gen) / math.sqrt(p.shape[-1]))
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)
    with torch.enable_grad():
        for _ in range(cfg.epochs):
            for batch in torch.randperm(x.shape[0], generator=gen).split(cfg.batch):
                opt.zero_grad()
                F.mse_loss(net(x[batch]), y[batch]).backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
            sched.step()
    w1, b1, w2, b2 = (p.detach() for p in net.parameters())  # the first layer's weight and bias, the second's
    return LayerScorer(w1, b1, w2, b2)


def fit(train: dict[str, torch.Tensor], cfg: Training) -> list[LayerScorer]:
    """One scorer per layer from `train`'s `hidden` `(L, N, d)` to its `target` `(L, N, Hkv)`."""
    if cfg.kind == "linear":
        return [fit_linear(x, y, cfg.alpha) for x, y in zip(train["hidden"], train["target"], strict=True)]
    return [fit_mlp(x, y, cfg) for x, y in zip(train["hidden"], train["target"], strict=True)]


def held_out_fit(layers: list[LayerScorer], held: dict[str, torch.Tensor]) -> list[dict[str, float]]:
    """Per layer, on the held-out texts: R² and Spearman's rank correlation, each the mean over KV heads."""
    out = []
    for scorer, x, y in zip(layers, held["hidden"], held["target"], strict=True):
        pred = scorer(x).T.double()  # (N, H)
        y = y.double()
        r2 = 1 - ((y - pred) ** 2).sum(0) / ((y - y.mean(0)) ** 2).sum(0)
        spearman = torch.stack([pearson(ranks(pred[:, h]), ranks(y[:, h])) for h in range(y.shape[1])])
        out.append({"r2": round(float(r2.mean()), 4), "spearman": round(float(spearman.mean()), 4)})
    return out


def ranks(v: torch.Tensor) -> torch.Tensor:
    """Average ranks of `v` `(N,)` (ties share their mean rank), float64."""
    values, inverse, counts = torch.unique(v, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    return (ends - (counts.double() - 1) / 2)[inverse]


def pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a - a.mean(), b - b.mean()
    return (a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-300)


def train(
    model: LoadedModel,
    texts: dict[str, str],
    cfg: Training,
    cache_dir: Path,
    progress: Progress | None = None,
) -> tuple[list[LayerScorer], list[dict[str, float]], dict[str, int]]:
    """The fitted layers, their held-out fit per layer and the data's sizes (pieces, positions)."""
    if cfg.kind not in ("linear", "mlp"):
        raise KvlensError(f"A scorer's kind is linear or mlp, not {cfg.kind!r}.")
    train_data, held = collect(model, texts, cfg, cache_dir, progress)
    layers = fit(train_data, cfg)
    sizes = {"train_positions": train_data["hidden"].shape[1], "held_out_positions": held["hidden"].shape[1]}
    return layers, held_out_fit(layers, held), sizes


def settings(cfg: Training) -> dict:
    """`cfg` as stored in the scorer's metadata."""
    return dataclasses.asdict(cfg)
