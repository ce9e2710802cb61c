"""KVzap scorers: one small surrogate per layer from the hidden state to each KV head's log KVzip+ score.

Jégou & Jeblick, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", 2026,
https://arxiv.org/abs/2601.07891 (kvpress's `KVzapModel` in `kvpress/presses/kvzap_press.py`): per layer a
linear map, or a two-layer MLP with a GELU, from the state entering the layer's attention `(N, d_model)` to
`(N, Hkv)` predicted log scores. kvpress downloads its weights from the hub for a few 8B-32B models;
kvlens trains them for any model (`kvlens train-scorer`, `kvlens.experiments.scorer_training`) and keeps
them in one safetensors file: tensors `L.w1` `(K, d_model)` and `L.b1` `(K,)` per layer `L` (K = Hkv for a
linear scorer), plus `L.w2` `(Hkv, K)` and `L.b2` for an MLP; metadata `format`, `kind`, `fingerprint` (the
model's, `kvlens.engine.qfilters.fingerprint`), `model`, `fit` (held-out fit, JSON) and `command`.

A scorer is named by its path, or found (`auto`) among the files of the repository's `scorers/`, of
`$KVLENS_SCORERS` and of the kvlens cache's `scorers/` by the model's fingerprint. A missing file, one that
is not a scorer and one trained for another model are each refused in one sentence.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvlens.engine.models import LoadedModel, cache_root
from kvlens.engine.qfilters import fingerprint
from kvlens.errors import KvlensError
from kvlens.kvcache import SCORER

__all__ = ["SCORER", "LayerScorer", "find", "layers_for", "load", "save"]  # SCORER: `kvzap_scorer=PATH`

FORMAT = "kvlens-scorer/1"
REPO_DIR = Path(__file__).resolve().parents[2] / "scorers"  # the scorers shipped with the repository
TRAIN = "train one with `kvlens train-scorer --model SPEC --out scorers/NAME.safetensors`"


@dataclass(frozen=True)
class LayerScorer:
    """One layer's surrogate: `(N, d_model)` hidden states -> `(Hkv, N)` predicted log KVzip+ scores."""

    w1: torch.Tensor  # (K, d_model)
    b1: torch.Tensor  # (K,)
    w2: torch.Tensor | None = None  # (Hkv, K), an MLP's second layer
    b2: torch.Tensor | None = None  # (Hkv,)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float() @ self.w1.T + self.b1
        if self.w2 is not None and self.b2 is not None:
            x = F.gelu(x) @ self.w2.T + self.b2
        return x.T

    def to(self, device: torch.device) -> LayerScorer:
        """The same scorer with its tensors on `device`."""
        return LayerScorer(**{k: v.to(device) for k, v in vars(self).items() if v is not None})

    def tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's tensors as the file names them."""
        named = {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": self.b2}
        return {f"{layer}.{k}": v.detach().float().contiguous() for k, v in named.items() if v is not None}


def save(path: Path, layers: list[LayerScorer], model: LoadedModel, meta: dict[str, str]) -> None:
    """Write `layers` with the model's fingerprint and `meta` (kind, fit, command) to `path`, atomically."""
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        tensors.update(layer.tensors(i))
    kind = "mlp" if layers[0].w2 is not None else "linear"
    info = {"format": FORMAT, "kind": kind, "fingerprint": fingerprint(model), "model": model.spec, **meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata=info)
    tmp.replace(path)


def metadata(path: Path) -> dict[str, str]:
    """A scorer file's metadata; one sentence when it is missing or not a kvlens scorer."""
    if not path.is_file():
        raise KvlensError(f"There is no scorer file {path}; {TRAIN}.")
    try:
        with safe_open(str(path), framework="pt") as f:
            info = f.metadata() or {}
    except Exception as err:  # any damage: the file is not read
        raise KvlensError(
            f"{path} is not a readable scorer file ({str(err).splitlines()[0]}); {TRAIN}."
        ) from err
    if info.get("format") != FORMAT or "fingerprint" not in info:
        raise KvlensError(
            f"{path} is a safetensors file but not a kvlens scorer (no {FORMAT} metadata); {TRAIN}."
        )
    return info


def load(path: Path, model: LoadedModel) -> tuple[list[LayerScorer], dict[str, str]]:
    """The per-layer scorers of `path` and its metadata; one sentence unless trained for `model`."""
    info, mine = metadata(path), fingerprint(model)
    if info["fingerprint"] != mine:
        raise KvlensError(
            f"{path} was trained for another model (fingerprint {info['fingerprint']}, this model's is "
            f"{mine}), so its scores mean nothing here; {TRAIN}."
        )
    layers = _read(str(path), path.stat().st_mtime_ns, model.shape()["layers"])
    return [layer.to(model.device) for layer in layers], info


@functools.lru_cache(maxsize=8)
def _read(path: str, _mtime: int, n_layers: int) -> list[LayerScorer]:
    """The file's layers (cached by path and modification time)."""
    try:
        t = load_file(path)
        if any(f"{i}.w1" not in t or f"{i}.b1" not in t for i in range(n_layers)):
            raise ValueError(f"it holds no weights for some of the model's {n_layers} layers")
        return [
            LayerScorer(t[f"{i}.w1"], t[f"{i}.b1"], t.get(f"{i}.w2"), t.get(f"{i}.b2"))
            for i in range(n_layers)
        ]
    except Exception as err:  # truncated tensors, a layer missing
        raise KvlensError(
            f"{path} is not a readable scorer file ({str(err).splitlines()[0]}); {TRAIN}."
        ) from err


def search_dirs() -> list[Path]:
    """Where `auto` looks: the repository's `scorers/`, `$KVLENS_SCORERS` (os.pathsep-separated) and the
    cache's."""
    extra = [Path(p) for p in os.environ.get("KVLENS_SCORERS", "").split(os.pathsep) if p]
    return [REPO_DIR, *extra, cache_root() / "scorers"]


def find(model: LoadedModel) -> Path:
    """The first scorer file of `search_dirs` trained for `model`; one sentence when there is none."""
    mine = fingerprint(model)
    for folder in search_dirs():
        for path in sorted(folder.glob("*.safetensors")):
            try:
                if metadata(path)["fingerprint"] == mine:
                    return path
            except KvlensError:  # another kind of file: not this model's scorer
                continue
    raise KvlensError(
        f"No KVzap scorer was trained for this model (fingerprint {mine}) in "
        f"{', '.join(map(str, search_dirs()))}; {TRAIN}, or name one with scorer=PATH."
    )


def layers_for(model: LoadedModel, argument: str) -> list[LayerScorer]:
    """Model data `kvzap_scorer=ARGUMENT`: the scorer at the path `ARGUMENT`, or `model`'s found (`auto`)."""
    path = find(model) if argument in ("", "auto") else Path(argument).expanduser()
    return load(path, model)[0]


def fit_of(info: dict[str, str]) -> dict:
    """The held-out fit stored in a scorer's metadata."""
    return json.loads(info.get("fit", "{}"))
