"""The prompt and generated text as text, each token coloured by what the cache held at one step.

`kept_text(run, step)` counts, for every position, how many recorded (layer, KV head) pairs keep it in their
cache when step `step` attends; `kept_text(run, step, layer, head)` gives one query head's status of each
position instead (kept, evicted, merged away, holding merged values, sink, not yet seen: the colours of
`kvlens.figures.attention.STATUS`) and its KV head's merge provenance. Both read `layer_cache` of every
recorded layer (`weights` `(R, Hq, P)`, `status` `(R, Hkv, P)`): step k is generated token k, its query the
token at position prompt length - 1 + k, and the cache it attends to holds the decisions of steps < k.
`kept_text_html(view)` draws the view as a self-contained HTML fragment (inline styles, a tooltip per token).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import torch

from kvlens.errors import KvlensError
from kvlens.figures.attention import (
    FUTURE,
    HOLDS_MERGE,
    KEPT,
    MERGED_AWAY,
    SINK,
    STATUS,
    layer_cache,
    recorded_attention_layers,
)
from kvlens.figures.inspect_token import merged_into, slot_provenance
from kvlens.runs import token_text
from kvlens.runs.run import Run

CACHED = (KEPT, HOLDS_MERGE, SINK)  # the status codes of a position held in a slot
LOW, HIGH = (255, 255, 255), (0, 114, 178)  # the count colours: kept by no pair (white) to every pair (blue)
QUERY_OUTLINE = "2px solid #111111"


@dataclass(frozen=True)
class KeptText:
    """Every token of a run at step `step`, N = prompt + new tokens: `texts` (N,) their text (a token
    holding part of a character: its group's, marked `(k/n)`), `flow` (N,) their shares of the running text;
    `kept` (N,) how many of the `pairs` recorded (layer, KV head) pairs hold each position; `attention` (N,)
    what each received at this step: the chosen query head's (NaN where it is not cached) or, with no head
    chosen, the mean over every recorded query head (0 where not cached, NaN where no head caches it). With a
    head: `status` (N,) its status codes, `merged_into` {position: slots holding its merged values} and
    `holds` {slot: {position: weight}} of its KV head; otherwise `status` is None and both are empty."""

    policy: str
    step: int
    layers: list[int]
    layer: int | None
    head: int | None
    kv_head: int | None
    prompt_len: int
    texts: list[str]
    flow: list[str]
    kept: list[int]
    pairs: int
    attention: list[float]
    status: list[int] | None
    merged_into: dict[int, list[int]]
    holds: dict[int, dict[int, float]]

    @property
    def query_position(self) -> int:
        """The position of the token whose query step `step` computes."""
        return self.prompt_len - 1 + self.step


def kept_text(run: Run, step: int, layer: int | None = None, head: int | None = None) -> KeptText:
    """The view of step `step`: counts over every recorded head, or query head `head` of `layer` (see
    above)."""
    layers = recorded_attention_layers(run)
    if (layer is None) != (head is None):
        raise KvlensError(
            "Give both a layer and a query head (that head's cache), or neither (how many recorded "
            "heads keep each token)."
        )
    if layer not in (None, *layers):
        layer_cache(run, layer)  # the one sentence for a layer that was not recorded
    caches = [layer_cache(run, n) for n in layers]
    weights = torch.stack([w for w, _ in caches])  # (L, R, Hq, P)
    status = torch.stack([s for _, s in caches])  # (L, R, Hkv, P)
    n_rows, hq, n_pos = weights.shape[1:]
    hkv = status.shape[2]
    if not 0 <= step < n_rows:
        raise KvlensError(f"Step {step} is out of range: this run recorded steps 0 to {n_rows - 1}.")
    if head is not None and not 0 <= head < hq:
        raise KvlensError(f"Head {head} is out of range: the model has query heads 0 to {hq - 1}.")
    prompt_len = len(run.meta.prompt_tokens)
    n_tokens = prompt_len + len(run.meta.tokens)
    pad = n_tokens - n_pos  # the last generated token was never fed back: no step saw it
    kept = torch.isin(status[:, step], torch.tensor(CACHED, dtype=status.dtype)).sum((0, 1))  # (P,)
    joint = token_text.context(run.meta)
    texts = ([joint.label(i) for i in range(len(joint.spans))] + [""] * n_tokens)[:n_tokens]
    flow = ([joint.flow(i) for i in range(len(joint.spans))] + [""] * n_tokens)[:n_tokens]
    common = dict(
        policy=run.meta.policy.name,
        step=step,
        layers=layers,
        layer=layer,
        head=head,
        prompt_len=prompt_len,
        texts=texts,
        flow=flow,
        kept=kept.tolist() + [0] * pad,
        pairs=len(layers) * hkv,
    )
    if head is None:
        row = weights[:, step].flatten(0, 1)  # (L * Hq, P)
        mean = row.nan_to_num(0.0).mean(0).masked_fill(kept == 0, float("nan"))
        return KeptText(
            **common,
            kv_head=None,
            attention=mean.tolist() + [math.nan] * pad,
            status=None,
            merged_into={},
            holds={},
        )
    index = layers.index(layer)
    kv_head = head // (hq // hkv)
    holds = slot_provenance(run, layer, kv_head, step)
    return KeptText(
        **common,
        kv_head=kv_head,
        attention=weights[index, step, head].tolist() + [math.nan] * pad,
        status=status[index, step, kv_head].tolist() + [FUTURE] * pad,
        merged_into=merged_into(holds),
        holds=holds,
    )


def _hex(rgb) -> str:
    return "#" + "".join(f"{round(c):02x}" for c in rgb)


def _count_colour(kept: int, pairs: int) -> str:
    share = kept / max(pairs, 1)  # kept <= pairs: 0 when there are no pairs
    return _hex(lo + (hi - lo) * share for lo, hi in zip(LOW, HIGH))


def _ink(background: str) -> str:
    """Dark text on a light background, white on a dark one."""
    r, g, b = (int(background[i : i + 2], 16) for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def _quoted(text: str) -> str:
    return "«" + text.replace("\n", "⏎") + "»"


def _tooltip(view: KeptText, p: int) -> str:
    """The hover lines of position `p`."""
    where = f"prompt token {p}" if p < view.prompt_len else f"generated token {p - view.prompt_len}"
    lines = [f"position {p} ({where}) {_quoted(view.texts[p])}"]
    if p > view.query_position:
        return "\n".join([*lines, f"not yet seen at step {view.step}"])
    if p == view.query_position:
        lines.append(f"the query of step {view.step}")
    if view.status is not None:
        lines.append(
            f"layer {view.layer}, head {view.head} (KV head {view.kv_head}): {STATUS[view.status[p]][0]}"
        )
    weight = view.attention[p]
    whose = f"head {view.head}" if view.head is not None else "mean over the recorded query heads"
    lines.append(
        f"attention at step {view.step}: "
        + ("not cached" if math.isnan(weight) else f"{weight:.4f}")
        + f" ({whose})"
    )
    lines.append(f"kept by {view.kept[p]} of {view.pairs} recorded (layer, KV head) pairs")
    if p in view.merged_into:
        lines.append("merged into slots " + ", ".join(map(str, view.merged_into[p])))
    elif view.status is not None and view.status[p] == MERGED_AWAY:
        lines.append("the slots it was merged into have been evicted since")
    if p in view.holds:
        lines.append("holds positions " + ", ".join(f"{q} ({w:.3g})" for q, w in view.holds[p].items()))
    return "\n".join(lines)


def _token(view: KeptText, p: int) -> str:
    """One token's span: its colour (a white line at its right edge), the query's outline, generated tokens
    underlined, its tooltip."""
    seen = p <= view.query_position
    style = ["padding:1px 0", "border-radius:2px"]
    if not seen:
        style.append("color:#9a9a9a")
    else:
        background = (
            STATUS[view.status[p]][1] if view.status is not None else _count_colour(view.kept[p], view.pairs)
        )
        style += [f"background:{background}", f"color:{_ink(background)}", "box-shadow:inset -1px 0 #ffffff"]
    if p == view.query_position:
        style += [f"outline:{QUERY_OUTLINE}", "outline-offset:1px"]
    if p >= view.prompt_len:
        style += ["text-decoration:underline", "text-decoration-color:#777777", "text-underline-offset:4px"]
    return (
        f'<span style="{";".join(style)}" title="{html.escape(_tooltip(view, p))}">'
        f"{html.escape(view.flow[p])}</span>"
    )


def _swatch(background: str, label: str) -> str:
    return (
        f'<span style="display:inline-block;width:12px;height:12px;background:{background};'
        f'border:1px solid #999;vertical-align:-2px;margin:0 4px 0 10px"></span>{html.escape(label)}'
    )


def _legend(view: KeptText) -> str:
    if view.status is None:
        colours = "".join(
            _swatch(_count_colour(k, view.pairs), str(k))
            for k in sorted({0, view.pairs // 3, 2 * view.pairs // 3, view.pairs})
        )
        colours = f"kept by how many of the {view.pairs} recorded (layer, KV head) pairs:{colours}"
    else:
        colours = "".join(
            _swatch(STATUS[code][1], STATUS[code][0]) for code in sorted(STATUS) if code != FUTURE
        )
    rest = (
        '<span style="color:#9a9a9a;margin-left:10px">grey text: not yet seen</span>'
        f'<span style="outline:{QUERY_OUTLINE};margin-left:12px;padding:0 3px">outlined</span>: the query'
        "<span "
        'style="text-decoration:underline;text-underline-offset:3px;margin-left:12px">underlined</span>: '
        "generated"
    )
    return f'<div style="font-size:12px;color:#444;margin:4px 0 8px">{colours}{rest}</div>'


def kept_text_html(view: KeptText) -> str:
    """The view as a self-contained HTML fragment: a caption, a one-line legend and the text, whitespace
    kept."""
    q = view.query_position
    query = _quoted(view.texts[q]) if q < len(view.texts) else "?"
    produced = view.prompt_len + view.step
    made = "".join(f"; it produced {_quoted(text)}" for text in view.texts[produced : produced + 1])
    whose = (
        f"layer {view.layer}, query head {view.head} (KV head {view.kv_head})"
        if view.head is not None
        else f"layers {', '.join(map(str, view.layers))}, every KV head"
    )
    caption = (
        f"The cache of {view.policy} at step {view.step} ({whose}): the query is {query} at position "
        f"{q}{made}. Hover a token for its attention and provenance."
    )
    tokens = "".join(_token(view, p) for p in range(len(view.texts)))
    return (
        '<div class="kvlens-kept-text" style="font-family:-apple-system,\'Segoe UI\',Helvetica,Arial,'
        'sans-serif;color:#111">'
        f'<div style="font-size:13px;color:#333">{html.escape(caption)}</div>{_legend(view)}'
        '<div style="white-space:pre-wrap;overflow-wrap:break-word;line-height:1.9;font-size:15px">'
        f"{tokens}</div></div>"
    )
