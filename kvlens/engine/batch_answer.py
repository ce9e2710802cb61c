"""Answer from many compressed caches at once: one batched forward per token for every (policy, budget).

The task protocol (`kvlens.engine.shared_prefill`) compresses a context once per policy and budget, then
generates each answer greedily from the frozen cache. One token of a small model is bound by reading its
weights, so answering the caches one after the other reads the weights once per cache and token; `answer_many`
stacks the caches as a batch instead and reads them once per token for all of them.

Each cache's kept slots are copied, per layer, into a batch buffer `(B, Hkv, S, D)` padded to the longest
(`valid` marks the slots that hold a token, `pos` their positions); the question and the answer's tokens are
appended behind them. A query sees the valid slots at or before its position (and inside the layer's sliding
window), as the frozen cache's own attention does, so each row's answer is its cache's own up to float
rounding (tested). The caches themselves are not touched. Rows that stop (end of sequence, the length limit,
or `done`) leave the batch once a quarter of it has stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvlens.engine.attention import CONTEXT_KWARG, visible
from kvlens.kvcache import AttentionSpec, softmax_weights

COMPACT_SHARE = 0.25  # stopped rows are dropped from the batch once they are this share of it


class Kept:
    """A frozen cache's kept slots, per layer `(keys, values, valid, pos)` of shapes `(Hkv, n, D)` twice and
    `(Hkv, n)` twice: what a batch needs of a prepared loop, without its statistics, extras and spare capacity
    (so the loop can be dropped before the batch is built)."""

    def __init__(self, loop):
        self.model = loop.model
        self.layers = [
            (v.keys[0].clone(), v.values[0].clone(), v.valid.clone(), v.pos.clone())
            for v in loop.cache.layers
        ]

    @classmethod
    def of(cls, model, layers: list[tuple]) -> Kept:
        """Kept slots given per layer (e.g. a patched cache, `kvlens.explain.patch`), of `model`."""
        kept = cls.__new__(cls)
        kept.model, kept.layers = model, list(layers)
        return kept

    @classmethod
    def each(cls, caches: Sequence) -> list[Kept]:
        """`caches` (`Kept`, or loops whose slots are copied) as `Kept`."""
        return [c if isinstance(c, cls) else cls(c) for c in caches]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer)


class _BatchLayer:
    """One layer's slots for B caches: keys/values `(B, Hkv, S, D)`, valid `(B, Hkv, S)`, pos `(B, Hkv, S)`.
    Each cache's own slots come first (`own[i]` of them), padded to `base`; the tokens fed since sit at
    `base..n`."""

    def __init__(self, parts: Sequence[tuple], room: int):
        n = max(k.shape[1] for k, _, _, _ in parts)
        first = parts[0][0]
        b, hkv, d = len(parts), first.shape[0], first.shape[-1]
        self.keys = first.new_zeros(b, hkv, n + room, d)
        self.values = first.new_zeros(b, hkv, n + room, d)
        self.valid = torch.zeros(b, hkv, n + room, dtype=torch.bool, device=first.device)
        self.pos = torch.zeros(b, hkv, n + room, dtype=torch.long, device=first.device)
        for i, (keys, values, valid, pos) in enumerate(parts):
            s = keys.shape[1]
            self.keys[i, :, :s], self.values[i, :, :s], self.valid[i, :, :s], self.pos[i, :, :s] = (
                keys,
                values,
                valid,
                pos,
            )
        self.own = [k.shape[1] for k, _, _, _ in parts]
        self.base = self.n = n

    def keep(self, rows: torch.Tensor) -> None:
        """Only batch rows `rows` stay; the padding that only the dropped caches needed goes with them (the
        fed tokens move up behind the longest remaining cache: attention reads slots by `pos` and `valid`)."""
        self.own = [self.own[i] for i in rows.tolist()]
        shift = self.base - max(self.own)
        n = self.n - shift
        for name in ("keys", "values", "valid", "pos"):
            t = getattr(self, name).index_select(0, rows)
            if shift:
                t[:, :, self.base - shift : n] = t[:, :, self.base : self.n].clone()
                t = t[:, :, : t.shape[2] - shift]
                if name == "valid":
                    t[:, :, n:] = False  # where the fed tokens were
            setattr(self, name, t)
        self.base, self.n = self.base - shift, n


class _BatchContext:
    """The run context of a batched forward (`kvlens_attention` calls `attend`): appends the new tokens' keys
    and values to each layer's batch buffer and attends over it. `release`: each cache's layer is dropped from
    its `Kept` once copied (the last use of those caches), so the copies never all exist twice."""

    def __init__(self, caches: Sequence[Kept], room: int, release: bool = False):
        self.layers = []
        for i in range(len(caches[0].layers)):
            self.layers.append(_BatchLayer([c.layers[i] for c in caches], room))
            if release:
                for c in caches:
                    c.layers[i] = None
        self.positions = torch.zeros(0, dtype=torch.long)

    def attend(self, layer_idx: int, query, key, value, spec: AttentionSpec) -> torch.Tensor:
        """query `(B, Hq, q, D)`, key/value `(B, Hkv, q, D)` of the new tokens -> out `(B, q, Hq, D)`."""
        layer = self.layers[layer_idx]
        b, hq, q, d = query.shape
        hkv, at = key.shape[1], layer.n
        layer.keys[:, :, at : at + q], layer.values[:, :, at : at + q] = key, value
        layer.valid[:, :, at : at + q] = True
        layer.pos[:, :, at : at + q] = self.positions
        layer.n = at + q
        allowed = (
            visible(self.positions, layer.pos[:, :, : at + q], spec.window)
            & layer.valid[:, :, None, : at + q]
        )
        g = hq // hkv
        # the group's queries as rows of one (B * Hkv) batched product: no broadcast copy of the keys or
        # values
        scores = torch.matmul(
            query.reshape(b, hkv, g * q, d), layer.keys[:, :, : at + q].transpose(-1, -2)
        ).float()
        hidden = ~allowed[:, :, None].expand(b, hkv, g, q, at + q).reshape(b, hkv, g * q, at + q)
        probs = softmax_weights(scores, spec, hidden)  # (B, Hkv, G * q, S)
        out = torch.matmul(probs.to(value.dtype), layer.values[:, :, : at + q])  # (B, Hkv, G * q, D)
        return out.view(b, hq, q, d).transpose(1, 2).contiguous()

    def keep(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keep(rows)


def _forward(model, ctx: _BatchContext, ids: torch.Tensor, start: int, keep: int = 1) -> torch.Tensor:
    """ids `(B, q)` at positions start.. -> the last token's logits `(B, V)` (`keep` > 1: the last `keep`
    tokens' `(B, keep, V)`)."""
    ctx.positions = torch.arange(start, start + ids.shape[1], device=ids.device)
    out = model.model(
        input_ids=ids,
        position_ids=ctx.positions[None].expand(ids.shape[0], -1),
        use_cache=False,
        logits_to_keep=keep,
        **{CONTEXT_KWARG: ctx},
    )
    return out.logits[:, -1] if keep == 1 else out.logits[:, -keep:]


def score_many(
    caches: Sequence, ids: list[int], start: int, scored: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced scores of frozen caches in one batched forward: `ids` fed at positions start.., each of
    its last `scored` tokens scored from the logits before it (`scored` < len(ids)). Returns log-probabilities
    `(B, scored)` float32 and whether each token is the greedy choice `(B, scored)` bool."""
    kept = Kept.each(caches)
    model = kept[0].model
    with torch.inference_mode():
        ctx = _BatchContext(kept, len(ids))
        batch = torch.tensor([ids] * len(kept), device=model.device)
        logits = _forward(model, ctx, batch, start, scored + 1)[:, :-1].float()  # (B, scored, V)
        target = batch[:, -scored:, None]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, target)[..., 0]
        greedy = logits.argmax(-1) == target[..., 0]
    return logp.cpu(), greedy.cpu()


def answer_many(
    caches: Sequence,
    question: list[int],
    start: int,
    max_new_tokens: int,
    logits: Sequence[torch.Tensor] | None = None,
    done: Callable[[int, list[int]], bool] | None = None,
    release: bool = False,
) -> list[tuple[list[int], list[float]]]:
    """Greedy answers of frozen caches (`Kept` of loops from `shared_prefill.prepare`, or the loops), one
    batched forward per token: `question` fed at positions start.. (empty: answer from `logits`, each prompt's
    last logits). A row stops at the end-of-sequence token, after `max_new_tokens`, or once `done(row,
    tokens)`. `release`: the caches' `Kept` slots are freed as the batch copies them. Returns each row's
    tokens and NLLs."""
    kept = Kept.each(caches)
    model = kept[0].model
    eos = model.tokenizer.eos_token_id
    results: list[tuple[list[int], list[float]]] = [([], []) for _ in kept]
    with torch.inference_mode():
        ctx = _BatchContext(kept, len(question) + max_new_tokens, release)
        if question:
            ids = torch.tensor([question] * len(kept), device=model.device)
            logits = _forward(model, ctx, ids, start)
        else:
            logits = torch.stack(list(logits))
        rows = list(range(len(kept)))  # the batch's rows, by cache index
        live = [True] * len(kept)
        pos = start + len(question)
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            chosen = torch.argmax(logits, dim=-1)
            for k, row in enumerate(rows):
                if not live[row]:
                    continue
                token = int(chosen[k])
                tokens, nlls = results[row]
                tokens.append(token)
                nlls.append(float(-logp[k, token]))
                if token == eos or len(tokens) == max_new_tokens or (done is not None and done(row, tokens)):
                    live[row] = False
            if not any(live):
                break
            stopped = sum(not live[row] for row in rows)
            if stopped >= COMPACT_SHARE * len(rows):
                keep = [k for k, row in enumerate(rows) if live[row]]
                index = torch.tensor(keep, device=chosen.device)
                ctx.keep(index)
                rows, chosen = [rows[k] for k in keep], chosen.index_select(0, index)
            logits = _forward(model, ctx, chosen[:, None], pos)
            pos += 1
    return results
