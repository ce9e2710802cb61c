"""A run's recorded prefill states, and what the analyses recompute from them (unit rows, attention).

Every analysis takes a loaded `Run` (`kvlens.load_run`). States are stored as float16
`prefill/q/{layer}` `(Hq, T, D)` and `prefill/k|v/{layer}` `(Hkv, T, D)` after RoPE; they are
read back as float32. A missing tensor or an out-of-range layer/head is one `KvlensError` sentence.
Attention is the model's causal softmax `softmax(q k^T / sqrt(head_dim))` per query head (GQA:
query head h reads KV head h // group), recomputed in row chunks (`attention_chunks`), so it needs
`--record states` and never the full T x T for all heads at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvlens.errors import KvlensError
from kvlens.figures.wording import if_none
from kvlens.runs.run import Run

KINDS = {"query": "q", "key": "k", "value": "v"}
NAMES = {code: name for name, code in KINDS.items()}  # "q" -> "query"
HEADS = {"q": "query", "k": "KV", "v": "KV"}  # whose heads a state's tensor has, by its letter
CHUNK_ELEMENTS = 1 << 22  # float32 scores per attention chunk (~16 MB)


def kind_code(kind: str) -> str:
    """'query'/'key'/'value' (or 'q'/'k'/'v') -> the tensor letter."""
    code = KINDS.get(kind, kind)
    if code not in KINDS.values():
        raise KvlensError(f"Unknown state kind '{kind}'; choose query, key or value.")
    return code


def kind_name(kind: str) -> str:
    """'q'/'k'/'v' (or 'query'/'key'/'value') -> the state's name."""
    return NAMES[kind_code(kind)]


def unit(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit length `(..., T, D)`; zero rows stay zero (cosine similarity is their dot
    product)."""
    return torch.nn.functional.normalize(x.float(), dim=-1)


def recorded_layers(run: Run, kind: str = "key") -> list[int]:
    """Layers whose prefill states of `kind` were recorded, ascending."""
    prefix = f"prefill/{kind_code(kind)}/"
    layers = sorted(int(n[len(prefix) :]) for n in run.tensors if n.startswith(prefix))
    if not layers:
        raise KvlensError(
            "This run has no recorded prefill states; record it with --record states (or full)."
        )
    return layers


def check_layer(run: Run, layer: int, kind: str = "key") -> None:
    layers = recorded_layers(run, kind)
    if layer not in layers:
        total = run.shape.get("layers", len(layers))
        if 0 <= layer < total:
            raise KvlensError(
                f"Layer {layer} was not recorded in this run; recorded layers: {', '.join(map(str, layers))}."
            )
        raise KvlensError(f"Layer {layer} is out of range: the model has layers 0 to {total - 1}.")


def states(run: Run, kind: str, layer: int) -> torch.Tensor:
    """Prefill states of one layer as float32: query `(Hq, T, D)`, key/value `(Hkv, T, D)`."""
    check_layer(run, layer, kind)
    return run.tensor(f"prefill/{kind_code(kind)}/{layer}").float()


def head_states(run: Run, kind: str, layer: int, head: int) -> torch.Tensor:
    """One head's prefill states `(T, D)`; `head` indexes query heads for queries, KV heads otherwise."""
    x = states(run, kind, layer)
    if not 0 <= head < x.shape[0]:
        what = HEADS[kind_code(kind)]
        raise KvlensError(
            f"Head {head} is out of range: layer {layer} has {what} heads 0 to {x.shape[0] - 1}."
        )
    return x[head]


def attention_chunks(
    q: torch.Tensor, k: torch.Tensor, start: int = 0, stop: int | None = None
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Causal softmax attention of query rows `[start, stop)`, a chunk of rows at a time.

    q `(Hq, T, D)`, k `(Hkv, T, D)` with Hq a multiple of Hkv (GQA: query head h reads KV head
    h // (Hq / Hkv)). Scores scale by 1/sqrt(head_dim) (Llama-family models; runs do not record
    another). Yields `(a, b, probs (Hq, b - a, T))`, zero above the diagonal, so a long
    prompt never materialises T x T for every head at once.
    """
    hq, t, _ = q.shape
    group = hq // k.shape[0]
    kk = k.repeat_interleave(group, dim=0)  # (Hq, T, D)
    stop = stop or t  # callers' stops are at least 1
    scale = q.shape[-1] ** -0.5
    chunk = max(1, CHUNK_ELEMENTS // (hq * t))
    cols = torch.arange(t)
    for a in range(start, stop, chunk):
        b = min(stop, a + chunk)
        scores = torch.einsum("hqd,hsd->hqs", q[:, a:b], kk) * scale  # (Hq, q, T)
        future = cols[None, :] > torch.arange(a, b)[:, None]  # (q, T)
        yield a, b, torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


def aggregated_attention(run: Run, layer: int) -> torch.Tensor:
    """Accumulated prefill attention per KV head `(Hkv, T)`: column sums of the mean over the
    group's query heads (H2O's score; KVMerger's pivot choice). The recorded `prefill/abar/{layer}`
    when the policy computed it, else recomputed (a policy that needs no attention records zeros)."""
    name = f"prefill/abar/{layer}"
    if run.has(name) and bool(run.tensor(name).any()):
        return run.tensor(name).float()
    check_layer(run, layer)
    q, k = states(run, "q", layer), states(run, "k", layer)
    hkv = k.shape[0]
    total = torch.zeros(hkv, q.shape[1], dtype=torch.float64)
    for _, _, probs in attention_chunks(q, k):
        total += probs.view(hkv, -1, *probs.shape[1:]).mean(1).sum(1).double()
    return total.float()


def layer_or_middle(run: Run, layer: int | None, kind: str = "key") -> int:
    """`layer` checked against the recorded layers, or the middle recorded layer when None."""
    layers = recorded_layers(run, kind)
    layer = if_none(layer, layers[len(layers) // 2])
    check_layer(run, layer, kind)
    return layer


def parse_states(text: str, many: bool = True) -> list[str]:
    """'key' or 'key,value' -> the state kinds; one sentence for anything else (or for several when not
    `many`)."""
    states = [x.strip() for x in text.split(",") if x.strip()]
    if not states or any(x not in KINDS for x in states):
        raise KvlensError(
            f"--state takes query, key or value (comma-separated for a similarity figure); got '{text}'."
        )
    if len(states) > 1 and not many:
        raise KvlensError(f"This analysis takes one --state; got '{text}'.")
    return states
