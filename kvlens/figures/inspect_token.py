"""One generated token's attention row over the cache, as a run recorded it (the app's token inspector).

Step k is generated (or scored) token k: row k of `attn/{layer}` is the forward that produced it, whose
query is the token before it (the last prompt token for k = 0), and the cache it attended to holds the
decisions of steps < k (`kvlens.figures.attention.attention_grid`, read unpooled). Every position seen so
far gets a status (kept, sink, holds merged values, merged away, evicted) and merged slots their
provenance, replayed from the decision log up to that step (`kvlens.figures.provenance.replay`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlens.errors import KvlensError
from kvlens.figures import provenance
from kvlens.figures.attention import FUTURE, STATUS, attention_grid, recorded_attention_layers
from kvlens.levels import RecordLevel
from kvlens.policies import policy_class
from kvlens.runs import token_text
from kvlens.runs.run import Run


@dataclass(frozen=True)
class TokenRow:
    """The attention row of step `step` in `layer` and query `head` (KV head `kv_head`).

    `positions` are every position seen so far (0 .. `query_position`) and `texts` their tokens' text;
    `weights[i]` is the attention position i received (NaN where it was not in the cache), `status[i]` its
    status name
    (`plots_attention.STATUS`). `provenance` maps each slot holding merged values to {source position:
    weight}; `merged_into` each merged-away position to the slots that hold it."""

    step: int
    layer: int
    head: int
    kv_head: int
    token: str
    query: str
    query_position: int
    positions: list[int]
    texts: list[str]
    weights: list[float]
    status: list[str]
    provenance: dict[int, dict[int, float]]
    merged_into: dict[int, list[int]]

    @property
    def in_cache(self) -> int:
        """How many slots the query attended to (the query itself included)."""
        return sum(not math.isnan(w) for w in self.weights)


def token_strings(run: Run) -> list[str]:
    """The text of each generated (or scored) token, in step order, decoded jointly
    (`kvlens.runs.token_text`): a token holding part of a character shows its group, marked `(k/n)`."""
    text = token_text.generated(run.meta)
    return [text.label(i) for i in range(len(text.spans))]


def has_rows(run: Run) -> bool:
    """Whether the run kept attention rows (`--record attention`)."""
    level = run.meta.record.level
    return RecordLevel.parse(str(level)).includes(RecordLevel.ATTENTION) and any(
        n.startswith("attn/") for n in run.tensors
    )


def _text_at(texts: list[str], i: int) -> str:
    """`texts[i]`, or "" past the end (the last generated token was never fed back: no row shows it)."""
    return "".join(texts[i : i + 1])


def inspect_token(run: Run, step: int, layer: int, head: int) -> TokenRow:
    """The attention row of generated token `step` in `layer` and query head `head` (see module docstring)."""
    if not has_rows(run):
        level = run.meta.record.level
        raise KvlensError(
            f"This run was recorded at '{level}', which keeps no attention rows; record it with "
            f"--record {RecordLevel.ATTENTION} to inspect tokens."
        )
    strings = token_strings(run)
    n_rows = run.tensor(f"attn/{recorded_attention_layers(run)[0]}").shape[0]
    if not 0 <= step < n_rows:
        raise KvlensError(
            f"Step {step} is out of range: this run recorded rows for tokens 0 to {n_rows - 1}."
        )
    grid = attention_grid(run, layer, head, max_cells=1 << 30)  # one cell per position and row: no pooling
    query_position = grid.prompt_len - 1 + step
    joint = token_text.context(run.meta)
    context = [joint.label(i) for i in range(len(joint.spans))]
    kv_head = head // (run.shape["heads"] // run.shape["kv_heads"])
    seen = [i for i, code in enumerate(grid.status[step].tolist()) if code != FUTURE]
    prov = slot_provenance(run, layer, kv_head, step)
    return TokenRow(
        step=step,
        layer=layer,
        head=head,
        kv_head=kv_head,
        token=_text_at(strings, step),
        query=_text_at(context, query_position),
        query_position=query_position,
        positions=seen,
        texts=[_text_at(context, i) for i in seen],
        weights=[float(grid.weights[step, i]) for i in seen],
        status=[STATUS[int(grid.status[step, i])][0] for i in seen],
        provenance=prov,
        merged_into=merged_into(prov),
    )


def slot_provenance(run: Run, layer: int, kv_head: int, step: int) -> dict[int, dict[int, float]]:
    """{slot: {source position: weight}} of the slots holding merged values when step `step` attended
    (decisions of steps before it); sources a Bernoulli draw of 0 added with weight 0 are left out."""
    rule = policy_class(run.meta.policy.name).merge_rule
    d = run.decisions
    if rule is None or d is None or not len(d):
        return {}
    d = d[(d["layer"] == layer) & (d["kv_head"] == kv_head) & (d["step"] < step)]
    slots = provenance.replay(d, rule).get((layer, kv_head), {})
    out = {slot: {p: w for p, w in sorted(src.items()) if w > 0} for slot, src in sorted(slots.items())}
    return {slot: src for slot, src in out.items() if set(src) != {slot}}


def merged_into(provenance: dict[int, dict[int, float]]) -> dict[int, list[int]]:
    """{position: the slots holding its merged values} of a `slot_provenance` (a slot's own position left
    out)."""
    into: dict[int, list[int]] = {}
    for slot, sources in provenance.items():
        for source in sources:
            if source != slot:
                into.setdefault(source, []).append(slot)
    return {p: sorted(slots) for p, slots in sorted(into.items())}
