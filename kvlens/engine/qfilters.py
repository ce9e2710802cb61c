"""Q-Filters of a model: the main direction of each head's queries, computed once and cached.

Godey et al., "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression", 2025,
https://arxiv.org/abs/2503.02812, as the authors' `make_filters.py` computes them: run the model
over sequences of text, keep each query head's queries after RoPE, sample `samples` of them
(the same positions for every head), take the SVD Q = U S V^T, and the filter is `-sign * v1`
where v1 is the first right singular vector and sign is +1 when most entries of the first left
singular vector are positive; a KV head's filter is the mean of its query heads'. The authors
calibrate on 20 sequences of 2048 tokens of web text; kvlens uses the bundled State of the Union
texts (`texts` sequences of `tokens` tokens, offline), so the filters work on any supported model
without a download. They are cached as `qfilters.safetensors` beside the converted model (or in
the kvlens cache for a model kvlens does not own), with a fingerprint of the model's weights, and
recomputed when missing or when the fingerprint differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvlens import texts
from kvlens.engine.attention import CONTEXT_KWARG, plain_forward
from kvlens.engine.models import LoadedModel, cache_root
from kvlens.errors import KvlensError
from kvlens.kvcache import AttentionSpec

FILE = "qfilters.safetensors"
TEXTS, TOKENS, SAMPLES = 8, 1024, 3000  # calibration: sequences, tokens each, sampled queries per head


class QueryTap:
    """Stands in for a run context in one plain forward: keeps every layer's queries after RoPE, `(Hq, T, D)`
    float32 on the CPU, and attends as the model would."""

    def __init__(self):
        self.queries: dict[int, torch.Tensor] = {}

    def attend(self, layer_idx: int, query, key, value, spec: AttentionSpec) -> torch.Tensor:
        self.queries[layer_idx] = query[0].detach().float().cpu()
        return plain_forward(query, key, value, spec)


def fingerprint(model: LoadedModel) -> str:
    """A digest of the model's parameter names, shapes and first weights: which model the filters belong
    to."""
    digest = hashlib.sha256()
    for i, (name, tensor) in enumerate(model.model.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        if i < 4:
            digest.update(tensor.detach().flatten()[:1024].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def path_for(model: LoadedModel) -> Path:
    """Where the model's filters are cached: beside a model kvlens converted, else in the kvlens cache."""
    root = cache_root().resolve()
    where = Path(model.path).resolve()
    if root in where.parents:
        return where / FILE
    return root / "qfilters" / f"{fingerprint(model)}.safetensors"


def compute(
    model: LoadedModel,
    count: int = TEXTS,
    tokens: int = TOKENS,
    samples: int = SAMPLES,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """The filters `(L, Hkv, D)` from `count` bundled texts of `tokens` tokens each (at most the model's
    context)."""
    tokens = min(tokens, model.shape()["context"] or tokens)
    chosen = {i: t for i, t in texts.bundled().items() if len(model.tokenizer(t).input_ids) >= tokens}
    if len(chosen) < count:
        raise KvlensError(
            f"Only {len(chosen)} bundled texts have {tokens} tokens for this tokenizer; ask for fewer "
            f"texts or tokens."
        )
    taken: dict[int, list[torch.Tensor]] = {}
    for i, text in enumerate(list(chosen.values())[:count]):
        tap = QueryTap()
        ids = torch.tensor([list(model.tokenizer(text).input_ids)[:tokens]], device=model.device)
        with torch.inference_mode():
            model.model(input_ids=ids, use_cache=False, logits_to_keep=1, **{CONTEXT_KWARG: tap})
        for layer, q in tap.queries.items():
            taken.setdefault(layer, []).append(q)
        if progress is not None:
            progress(i + 1, count)
    kv_heads = model.shape()["kv_heads"]
    gen = torch.Generator().manual_seed(seed)
    filters = []
    for layer in sorted(taken):
        q = torch.cat(taken[layer], dim=1)  # (Hq, N, D)
        pick = torch.randperm(q.shape[1], generator=gen)[:samples]
        filters.append(head_filters(q[:, pick], kv_heads))
    return torch.stack(filters)


def head_filters(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`(Hq, N, D)` queries -> `(Hkv, D)` filters: `-sign * v1` per query head, averaged over each KV
    head's."""
    u, _, vh = torch.linalg.svd(queries.float(), full_matrices=False)
    sign = ((u[..., 0] > 0).float().mean(-1) > 0.5).float() * 2 - 1
    per_head = -sign[:, None] * vh[:, 0, :]  # (Hq, D)
    return per_head.view(kv_heads, -1, per_head.shape[-1]).mean(1)


def filters_for(
    model: LoadedModel, fresh: bool = False, progress: Callable[[int, int], None] | None = None
) -> torch.Tensor:
    """The model's cached filters `(L, Hkv, D)` (on its device), computed and cached first when missing."""
    path, mine = path_for(model), fingerprint(model)
    if path.is_file() and not fresh and safe_open_metadata(path).get("fingerprint") == mine:
        return load_file(path)["filters"].to(model.device)
    found = compute(model, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {"filters": found.contiguous()},
        tmp,
        metadata={"texts": str(TEXTS), "tokens": str(TOKENS), "samples": str(SAMPLES), "fingerprint": mine},
    )
    tmp.replace(path)
    return found.to(model.device)


def safe_open_metadata(path: Path) -> dict:
    """The metadata of a cached filters file (empty when it cannot be read)."""
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # a damaged cache file is recomputed
        return {}
