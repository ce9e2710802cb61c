"""`kvzip`: query-agnostic scores from a pass in which the model repeats the prompt.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025,
https://arxiv.org/abs/2505.23416 (kvpress's `KVzipPress`, which the authors contributed). After the
prompt is prefilled, the engine feeds replay passes (`Policy.replay_passes`): for each chunk of
`chunk` prompt tokens, "Repeat the previous context exactly." (later chunks: "Repeat the part of the
previous context exactly, starting with" and the previous chunk's last 8 tokens), the chat template's
turn suffix, then the chunk itself, at the positions after the prompt; the pass's keys are never
cached. A prompt slot's score is the largest attention it receives from any of the pass's queries
and any query head of its KV head, the softmax taken over the first `n_sink` positions, the chunk
and the pass's own keys (causal). The lowest scores leave, over every layer and KV head at once
(`layerwise=false`, the paper's non-uniform budgets; `true`: the same count per layer, shared by its
heads); the first `n_sink` positions never leave. What is reconstructed (`reconstruct`): the whole
prompt (`prompt`, kvlens's), or the context without the chat template's head (`context`, kvpress's
`KVzipPress.prepare`, which skips `prefix_length` tokens: the template's text before the user's,
found as kvpress finds it; those slots then score 0 and leave first, the `n_sink` first aside; a
prompt that does not begin with the head is reconstructed whole). The passes cost about twice the
prompt's prefill; a run reports them as `replay_passes` and `replay_ms` (part of `prefill_ms`).

Score (`score`): `attention` (KVzip's), or `plus`, KVzap's KVzip+ (Jégou & Jeblick, 2026,
https://arxiv.org/abs/2601.07891, as kvpress's `kvzap/data.py` computes its training targets): each weight
a_hji of query j of the pass times `||v_i W_O^h|| / ||h_j||`, the value's contribution to the residual stream
through query head h's slice of the output projection over the norm of the state entering the layer's
attention at j, maximised over j and the KV head's query heads. kvpress computes it in one forward of the
templated prompt and its copy (no sinks, no chunks); kvlens in its replay passes, as `attention`. It is the
target `kvlens train-scorer` fits and the `kvzap` policy predicts; kvpress has no press computing it, so it is
checked against its formula (tests), not against kvpress's code.

Decoding (`decoding`): `once` (the default) compresses the prompt only, as the paper (the context is
compressed once, query-agnostic, and reused for every query) and kvpress do, and the cache then grows by one
slot per generated token; `rolling` (kvlens's, so that the budget holds at every step) evicts, at each decode
step, the layer's lowest score over its heads, generated tokens scoring above every prompt slot (older ones
lower), so the least reconstructed prompt slots leave first.

Heads and layers keep different counts: a layer's keys and values are held in pages of 4 slots
(`kvlens.kvcache.paged`), each head its own kept slots (with packed storage, buffers padded to
the layer's fullest head, the padding masked); `kv_entries_max` counts the kept entries (L x Hkv
x budget), `kv_bytes_*` the allocated pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlens.kvcache import HIDDEN, O_GRAM, AttentionSpec, CacheRows, Replay, Step, layer_logits
from kvlens.policies.base import (
    NO_ATTENTION,
    Needs,
    Policy,
    Replays,
    free_logged,
    lowest_of_all_rows,
    param,
    register,
)

# per layer until the budgets are allocated: (Hkv, T) by prompt position; then per slot (R, S)
SCORE = "kvzip_score"
TOTAL = "kvzip_total"  # per layer: the entries the layer keeps, over its heads
PROMPT = "kvzip_prompt"  # per layer: the prompt's length (positions from it on are generated tokens)
FIRST = "\n\nRepeat the previous context exactly."  # the first chunk's instruction (kvpress's words)
LATER = "\n\nRepeat the part of the previous context exactly, starting with"  # a later chunk's
GENERATED = 2.0**60  # a generated token's score while decoding (`rolling`), above any reconstruction score
ROWS = 64  # replay queries scored at once (each row's softmax is its own, so blocks give the same weights)
OVERLAP = (
    8  # tokens of the previous chunk quoted by a later chunk's instruction (kvpress `prev_postfix_size`)
)


@register
@dataclass(frozen=True)
class KVzip(Policy, Replays):
    n_sink: int = param(
        4, "First positions never evicted, also in every pass's softmax (kvpress: 4).", minimum=0
    )
    chunk: int = param(2048, "Prompt tokens each replay pass reconstructs (kvpress: 2048).", minimum=1)
    layerwise: bool = param(
        False,
        "Same count in every layer (kvpress layerwise=true); false: the lowest scores "
        "over all layers and heads leave (the paper's default).",
    )
    decoding: str = param(
        "once",
        "During decoding: compress the prompt once and let the cache grow (the paper, "
        "kvpress), or keep the budget, evicting the least reconstructed prompt slot of each "
        "layer (kvlens).",
        choices=("once", "rolling"),
    )
    score: str = param(
        "attention",
        "A slot's score: its largest replay attention weight (KVzip), or KVzap's KVzip+, that weight "
        "times ||v W_O^h|| / ||h_j|| (the value's contribution to the residual stream over the query's "
        "hidden-state norm).",
        choices=("attention", "plus"),
    )
    reconstruct: str = param(
        "prompt",
        "What the replay passes repeat: the whole prompt (kvlens), or the context "
        "without the chat template's head, whose slots then score 0 (kvpress).",
        choices=("prompt", "context"),
    )

    name = "kvzip"
    description = (
        "Keep the prompt slots the model attends to most while repeating the prompt (query-agnostic)."
    )
    paper = "https://arxiv.org/abs/2505.23416"
    kvpress = "KVzipPress"
    kvpress_differs = (
        "kvlens reconstructs the whole prompt by default (`reconstruct=context` skips the chat "
        "template's head, as kvpress does) and frees what it evicts (kvpress masks it); "
        "`decoding=rolling` keeps the budget while decoding (kvpress compresses the prompt only)."
    )

    def needs(self) -> Needs:
        plus = self.score == "plus"  # the attention's input and W_O's Gram matrices (KVzip+)
        return dataclasses.replace(
            NO_ATTENTION,
            decode_steps=self.decoding == "rolling",
            tokenizer=True,
            hidden_states=plus,
            model_data=(O_GRAM,) * plus,
            # the prompt's lowest scores over every layer and head, or (`layerwise`) over a layer's heads
            competes="layer" if self.layerwise else "model",
            min_budget=self.n_sink + 1,
        )

    def replay_passes(self, tokenizer: Any, prompt: list[int]) -> list[tuple[int, int, list[int]]]:
        head_text, suffix_text = template_around(tokenizer)
        suffix = tokenizer.encode(suffix_text, add_special_tokens=False)
        head = tokenizer.encode(head_text, add_special_tokens=False) if self.reconstruct == "context" else []
        first = len(head) * (prompt[: len(head)] == head)  # past the head, where the prompt starts with it
        passes = []
        for start in range(first, len(prompt), self.chunk):
            end = min(start + self.chunk, len(prompt))
            ask = tokenizer.encode(FIRST if start == first else LATER, add_special_tokens=False)
            quote = prompt[max(first, start - OVERLAP) : start]
            passes.append((start, end, ask + quote + suffix + prompt[start:end]))
        return passes

    def observe_replay(self, rows: CacheRows, replay: Replay) -> None:
        """Scores `(Hkv, T)`: each slot of the chunk, the largest weight any query of the pass gives it
        (`plus`: times `||v W_O^h|| / ||h_j||`, `_plus_terms`), over the pass's queries j and the KV head's
        query heads h.

        The weights are never materialised: each query's log-normaliser `lse` over the sinks, the chunk and
        the pass's own keys comes from the engine's attention (`Replay.own_lse`, `Replay.span_lse`, and the
        few sinks' logits) or, where it gave none, from a block's logits; a slot's score is
        `exp(max (logit - lse_q [+ terms]))`, in log space, a block of queries at a time. The prompt's keys
        (and values) are read where the prefill cached them."""
        keys = rows.keys[0]  # (Hkv, T, D): before the prompt's compression slot i holds position i
        hkv, t, d = keys.shape
        sink = min(self.n_sink, replay.start)
        prompt = torch.cat([keys[:, :sink], keys[:, replay.start : replay.end]], dim=1)  # (Hkv, n, D)
        q = replay.queries.shape[1]
        queries = replay.queries.view(hkv, -1, q, d)
        g, n = queries.shape[1], replay.end - replay.start
        own_lse = replay.own_lse.view(hkv, g, q)
        spec = AttentionSpec(replay.scaling, replay.softcap)
        lse = None  # each query's log-normaliser, where the engine's attention gave it over the chunk
        if replay.span_lse is not None and keys.dtype == torch.float32:
            sinks = layer_logits((queries @ keys[:, None, :sink].transpose(-1, -2)).float(), spec)
            lse = torch.logaddexp(replay.span_lse.view(hkv, g, q), own_lse)
            lse = torch.logaddexp(lse, sinks.logsumexp(-1))  # (Hkv, G, q); no sink: -inf, no change
        rows_term, slots_term = self._plus_terms(rows, replay, g) if self.score == "plus" else (None, None)
        best = torch.full((hkv, n), float("-inf"), device=keys.device)
        for a in range(0, q, ROWS):  # a block of rows at a time: (Hkv, G, ROWS, n) stays in cache
            b = min(q, a + ROWS)
            rows_q = queries[:, :, a:b].reshape(hkv, g * (b - a), d)
            given = None if lse is None else lse[:, :, a:b]
            block = _log_weights(rows_q, prompt, sink, spec, own_lse[:, :, a:b], given).view(hkv, g, b - a, n)
            if rows_term is not None and slots_term is not None:
                block = block + rows_term[a:b, None] + slots_term[:, :, None]
            torch.maximum(best, block.amax((1, 2)), out=best)
        state = rows.state
        score = state.setdefault(SCORE, torch.zeros(hkv, t, dtype=torch.float32, device=keys.device))
        score[:, replay.start : replay.end] = best.exp()

    @staticmethod
    def _plus_terms(rows: CacheRows, replay: Replay, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KVzip+'s log factors: `-log ||h_j||` per query of the pass `(q,)` (the state entering the layer's
        attention) and `log ||v_i W_O^h||` per query head and chunk slot `(Hkv, G, n)`, from the output
        projection's Gram matrices `G_h = W_O^h (W_O^h)^T` (`||v W||^2 = v G v^T`)."""
        state = rows.state
        hidden = state[HIDDEN].float()  # (q, d_model)
        gram = state[O_GRAM].view(rows.pos.shape[0], g, *state[O_GRAM].shape[1:])  # (Hkv, G, D, D)
        values = rows.values[0][:, replay.start : replay.end].float()  # (Hkv, n, D)
        squared = torch.einsum("knd,kgde,kne->kgn", values, gram, values)
        return -hidden.norm(dim=-1).log(), 0.5 * squared.clamp_min(0).log()

    def allocate(self, budget: int, layers: Sequence[CacheRows]) -> list[int]:
        """Which entries leave, over every layer and head (or per layer): each layer's kept total, and as its
        budget the count of its fullest head (the width of its buffers)."""
        score = torch.stack([self._scores(rows) for rows in layers])  # (L, Hkv, T)
        n, hkv, t = score.shape
        pos = torch.stack([rows.pos for rows in layers])
        if self.layerwise:
            leaving = [hkv * (t - budget)] * n
        # the lowest over everything; ties as within a layer (newest first, then the lower layer and head)
        else:
            flat = score.flatten()
            by_age = torch.argsort(-pos.flatten(), stable=True)
            lowest = by_age[torch.argsort(flat[by_age], stable=True)[: flat.numel() - budget * n * hkv]]
            leaving = torch.bincount(lowest // (hkv * t), minlength=n).tolist()
        widths = []
        for rows, layer_score, gone in zip(layers, score, leaving, strict=True):
            rows.extra[SCORE] = layer_score
            state = rows.state
            state[TOTAL], state[PROMPT] = hkv * t - gone, t
            left = (lowest_of_all_rows(rows, layer_score, gone) >= 0).sum(-1)  # nothing leaving: zeros
            widths.append(t - int(left.min()))
        return widths

    def _scores(self, rows: CacheRows) -> torch.Tensor:
        """One layer's replay scores `(Hkv, T)`, the first `n_sink` positions above every other."""
        score: torch.Tensor = rows.state.pop(SCORE)
        return score.masked_fill(rows.pos < self.n_sink, float("inf"))

    def compress(self, rows: CacheRows, step: Step) -> None:
        if not step.prompt and self.decoding == "once":
            return
        state = rows.state
        leaving = int(rows.valid.sum()) - state[TOTAL]
        if leaving <= 0:
            return
        generated = rows.pos >= state[PROMPT]  # above every prompt slot's score, older lower
        score = torch.where(generated, GENERATED * (1 + rows.pos.float() / 2**20), rows.extra[SCORE])
        free_logged(step, rows, lowest_of_all_rows(rows, score, leaving))


def _log_weights(
    rows_q: torch.Tensor,
    prompt: torch.Tensor,
    sink: int,
    spec: AttentionSpec,
    own_lse: torch.Tensor,
    lse: torch.Tensor | None,
) -> torch.Tensor:
    """Log attention weights `(Hkv, G * rows, n)` of a block of a pass's queries `(Hkv, G * rows, D)` on the
    chunk's n slots, `prompt` `(Hkv, sink + n, D)` being the sinks' keys and then the chunk's: their logits
    less each query's log-normaliser. That is `lse` `(Hkv, G, rows)` where the engine's attention gave it (a
    plain layer: one fused product), else the logsumexp of the logits over the sinks and the chunk beside the
    pass's own keys' `own_lse` `(Hkv, G, rows)`."""
    hkv, rows, _ = rows_q.shape
    if lse is not None:
        chunk = prompt[:, sink:].transpose(1, 2)
        return torch.baddbmm(-lse.reshape(hkv, rows, 1), rows_q, chunk, alpha=spec.scaling)
    seen = layer_logits(torch.bmm(rows_q, prompt.transpose(1, 2)).float(), spec)  # (Hkv, G * rows, sink + n)
    total = torch.logaddexp(seen.logsumexp(-1), own_lse.reshape(hkv, rows))
    return seen[..., sink:] - total[..., None]


def template_around(tokenizer: Any) -> tuple[str, str]:
    """What the chat template puts before a user's message and between it and the assistant's answer (`("",
    "\\n")` without one), as kvpress derives them: a dummy message with a separator, split at both."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "", "\n"
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    before, suffix = str(text).split(separator)
    return before.split(dummy)[0], suffix
