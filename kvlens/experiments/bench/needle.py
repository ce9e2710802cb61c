"""Needle in a haystack over context lengths x depths, per policy (KVMerger Fig. 5).

The haystack is whole sentences of the bundled texts; a synthetic fact (the needle) is put at the
sentence boundary nearest a share `depth` of the haystack's tokens (0 = first, 1 = last), a
question follows, and the model answers
greedily. A cell scores 1 when the answer appears in the output, compared on lowercase letters
and digits only (so "Blue harbor 42" counts for 'blue-harbor-42'), else 0.
"""

from __future__ import annotations

import re

from kvlens.engine.loop import RunOptions, run
from kvlens.engine.models import LoadedModel
from kvlens.errors import KvlensError
from kvlens.experiments.api import encode
from kvlens.experiments.bench.common import label
from kvlens.experiments.grid import digest, plan
from kvlens.policies import make_policy

NEEDLE = "The secret passphrase is 'blue-harbor-42'."
QUESTION = "What is the secret passphrase in the text above? Answer with the passphrase only."
ANSWER = "blue-harbor-42"


def normalise(text: str) -> str:
    """Lowercase letters and digits only."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


def score(output: str, answer: str) -> float:
    """1.0 if `answer` appears in `output` (letters and digits, any case), else 0.0."""
    key = normalise(answer)
    if not key:
        raise KvlensError("The needle's answer has no letters or digits to look for.")
    return float(key in normalise(output))


def sentences(text: str) -> list[str]:
    """Split prose into sentences at '.', '?' or '!' followed by whitespace."""
    return [s.strip() for s in re.split(r"(?<=[.?!])\s+", " ".join(text.split())) if s.strip()]


def haystack(
    model: LoadedModel,
    filler: list[str],
    length: int,
    depth: float,
    needle: str = NEEDLE,
    question: str = QUESTION,
    chat: bool = True,
) -> list[int]:
    """Prompt ids of about `length` tokens: filler sentences with `needle` at `depth` in [0, 1], then
    `question`."""
    if not 0 <= depth <= 1:
        raise KvlensError(f"A needle depth must be in [0, 1]; got {depth}.")
    tail = f"\n\n{question}"
    room = length - len(encode(model, f"{needle} {tail}", chat))
    chosen, starts, used = [], [], 0  # starts[i]: filler tokens before sentence i
    for sent in filler:
        n = len(model.tokenizer(" " + sent).input_ids)
        if used + n > room:
            break
        chosen.append(sent)
        starts.append(used)
        used += n
    if len(chosen) < 2:
        raise KvlensError(f"A context of {length} tokens leaves no room for a haystack; use a longer length.")
    starts.append(used)
    at = min(
        range(len(starts)), key=lambda i: abs(starts[i] - depth * used)
    )  # sentence boundary nearest depth
    chosen.insert(at, needle)
    return encode(model, " ".join(chosen) + tail, chat)


def plan_needle(
    policies: list[tuple[str, dict]],
    lengths: list[int],
    depths: list[float],
    *,
    budget: int | float | None,
    filler_text: str,
    model: str,
    max_new_tokens: int = 16,
    chat: bool = True,
    needle: str = NEEDLE,
    question: str = QUESTION,
    answer: str = ANSWER,
) -> list[dict]:
    """The `needle` cells: every policy at every (context length, depth); the haystack is text id
    `haystack`."""
    bad = [d for d in depths if not 0 <= d <= 1]
    if bad:
        raise KvlensError(f"A needle depth must be in [0, 1]; got {bad[0]}.")
    return plan(
        "needle",
        policies,
        [budget],
        {"length": lengths, "depth": depths},
        {
            "model": model,
            "text": "haystack",
            "text_digest": digest(filler_text),
            "max_new_tokens": max_new_tokens,
            "chat": chat,
            "needle": needle,
            "question": question,
            "answer": answer,
        },
    )


def needle_cell(model: LoadedModel, texts: dict[str, str], cell: dict) -> dict:
    """One `needle` cell: build the haystack, answer greedily, score. `prompt_tokens` is the actual length."""
    ids = haystack(
        model,
        sentences(texts[cell["text"]]),
        cell["length"],
        cell["depth"],
        cell["needle"],
        cell["question"],
        cell["chat"],
    )
    n = cell["max_new_tokens"]
    r = run(
        model,
        make_policy(cell["policy"], cell["params"]),
        ids,
        prefill=len(ids),
        steps=n,
        teacher=False,
        opts=RunOptions(budget=cell["budget"], max_new_tokens=n, seed=cell["seed"], log_decisions=False),
    )
    text = r.meta.text
    return {
        "prompt_tokens": len(ids),
        "budget_slots": r.meta.budget.slots,
        "score": score(text, cell["answer"]),
        "output": text,
    }


def summarise(rows: list[dict]) -> list[dict]:
    """Per policy: mean score overall and per length (over depths)."""
    out = []
    for policy in dict.fromkeys(label(r) for r in rows):
        mine = [r for r in rows if label(r) == policy]
        by_len: dict[int, list[float]] = {}
        for c in mine:
            by_len.setdefault(c["length"], []).append(c["score"])
        out.append(
            {
                "policy": policy,
                "score": sum(c["score"] for c in mine) / len(mine),
                "by_length": {str(n): sum(v) / len(v) for n, v in by_len.items()},
            }
        )
    return out


def short_titles(labels: list[str]) -> list[str]:
    """Each policy label's name alone (`cam:score=...` -> `cam`), numbered where one name has several
    settings; the full label is in the hover."""
    names = [lab.split(":")[0] for lab in labels]
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if names.count(name) == 1 else f"{name} ({seen[name]})")
    return out


def figure(result: dict):
    """One heatmap per policy (its name as the subplot title, its settings in the hover): depth (rows) x
    context length (columns), green = found."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    import kvlens.figures.plots  # noqa: F401  registers the "kvlens" paper template

    cfg, rows = (
        result["config"],
        result.get("rows", result.get("cells")),
    )  # `cells`: files from before the grid
    policies = list(dict.fromkeys(label(r) for r in rows))
    fig = make_subplots(
        rows=1,
        cols=len(policies),
        subplot_titles=short_titles(policies),
        shared_yaxes=True,
        horizontal_spacing=0.02,
    )
    score_of = {(label(r), r["length"], r["depth"]): r["score"] for r in rows}
    for i, policy in enumerate(policies, 1):
        z = [[score_of.get((policy, n, d)) for n in cfg["lengths"]] for d in cfg["depths"]]
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=[str(n) for n in cfg["lengths"]],
                y=[f"{d:.0%}" for d in cfg["depths"]],
                zmin=0,
                zmax=1,
                colorscale=[[0, "#d73027"], [1, "#1a9850"]],
                showscale=False,
                name=policy,
                meta={"value": "score: the share of the expected string found (1: found, 0: missed)"},
                hovertemplate=f"{policy}<br>%{{x}} tokens, depth %{{y}}: %{{z}}<extra></extra>",
                xgap=2,
                ygap=2,
            ),
            1,
            i,
        )
        fig.update_xaxes(title_text="context tokens", row=1, col=i)
    fig.update_yaxes(title_text="needle depth", row=1, col=1, autorange="reversed")
    fig.update_layout(
        title=f"Needle in a haystack (green = found; budget {cfg['budget']} for compressing policies)",
        width=max(500, 230 * len(policies)),
        height=420,
        template="kvlens",
    )
    return fig
