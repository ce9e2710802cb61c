"""Log-perplexity over position (WeightedKV Fig. 4: merging vs evicting over a long text)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.runs.run import Run


@dataclass
class PerplexityCurve:
    """`positions` `(N,)` of the scored tokens and `log_ppl` `(N,)`: the mean NLL of tokens up to
    each position (the log of the perplexity so far, as the paper's y axis)."""

    label: str
    positions: torch.Tensor
    log_ppl: torch.Tensor


def log_perplexity_curve(run: Run, label: str | None = None) -> PerplexityCurve:
    """Running mean of `steps/nll` `(N,)` over the run's scored (or generated) tokens."""
    nll = run.tensor("steps/nll").double()  # (N,)
    start = len(run.meta["prompt_tokens"])
    running = nll.cumsum(0) / torch.arange(1, nll.shape[0] + 1)
    label = label or run.meta["policy"]["name"]
    return PerplexityCurve(label, torch.arange(start, start + nll.shape[0]), running.float())
