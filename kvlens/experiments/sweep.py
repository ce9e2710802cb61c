"""Policies x budgets x texts x prompt lengths (x seeds): one row of metrics per cell (`kvlens sweep`, `bench
ppl`).

The paper-style comparisons are one sweep each: perplexity of every policy at a few budgets
(WeightedKV Table I, CORM Table 3), perturbation of merging vs eviction against the budget (CaM
Fig. 1(d), with `measure=True`: a `cam` row carries both its own `perturbation_used` and the
perturbation of its base's evictions `perturbation_evict`), and a budget-free policy's reached
compression against the sequence length (CORM Fig. 4, several `prefills`). Budget-free
policies run once per text, prompt length and seed, whatever the budgets.

A cell (`kvlens.experiments.grid`) of task `ppl` is teacher-forced perplexity: prefill `prefill` tokens of
text `text`, then score the next `tokens` one at a time (`kvlens.experiments.api.perplexity`).
"""

from __future__ import annotations

from kvlens.engine.loop import RunOptions
from kvlens.engine.perturbation import summary
from kvlens.errors import KvlensError
from kvlens.experiments.api import perplexity
from kvlens.experiments.grid import digest, plan, present
from kvlens.kvcache.quantize import Storage


def plan_ppl(
    policies: list[tuple[str, dict]],
    budgets: list,
    texts: dict[str, str],
    prefills: list[int],
    *,
    tokens: int,
    model: str,
    measure: bool = False,
    seeds: list[int] | None = None,
    prefill_chunk: int | None = None,
) -> list[dict]:
    """The `ppl` cells of a sweep, validated before any model work (`prefill_chunk`: a chunked prefill)."""
    if not texts or not prefills:
        raise KvlensError("A sweep needs at least one text and one prompt length.")
    if tokens < 1 or min(prefills) < 1:
        raise KvlensError("--prefill and --tokens must all be at least 1.")
    cells = []
    for text_id, text in texts.items():  # texts outermost: a text's digest sits beside its id
        cells += plan(
            "ppl",
            policies,
            budgets,
            {"prefill": prefills},
            {
                "model": model,
                "text": text_id,
                "text_digest": digest(text),
                "tokens": tokens,
                "measure": measure,
                **present(prefill_chunk=prefill_chunk),
            },
            seeds,
        )
    return cells


def ppl_cell(model, texts: dict[str, str], cell: dict) -> dict:
    """The metrics of one `ppl` cell: perplexity, what the cache kept (slots, bytes, shares), speed, and
    (measured cells) the perturbation summary. A cell's `storage` (`Storage.describe()`, optional) quantizes,
    its `prefill_chunk` (optional) feeds the prompt in chunks."""
    prefill, tokens = cell["prefill"], cell["tokens"]
    run = perplexity(
        model,
        texts[cell["text"]],
        cell["policy"],
        cell["params"],
        prefill=prefill,
        tokens=tokens,
        opts=RunOptions(
            budget=cell["budget"],
            seed=cell["seed"],
            log_decisions=False,
            storage=Storage.of(cell.get("storage")),
            prefill_chunk=cell.get("prefill_chunk"),
        ),
        measure=cell["measure"],
    )
    m = run.metrics
    cached = prefill + tokens - 1  # tokens in a full cache at the last step
    out = {
        "budget_slots": run.meta.budget.slots,
        "nll": m["nll"],
        "ppl": m["ppl"],
        "kept_final_mean": m["kv_slots_final_mean"],
        "kept_share": m["kv_slots_final_mean"] / cached,
        "kv_bytes_final": m["kv_bytes_final"],
        "kv_bytes_peak": m["kv_bytes_peak"],
        "kv_bytes_prefill": m["kv_bytes_prefill"],
        "bytes_share": m["kv_bytes_final"] / (m["kv_bytes_prompt"] * cached / prefill),
        "ms_per_token": m["ms_per_token"],
    }
    if "perturbation/kl" in run.tensors:
        out.update(summary(run.tensors))
    return out
