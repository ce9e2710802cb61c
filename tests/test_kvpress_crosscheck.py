"""kvlens against NVIDIA kvpress, an independent implementation, where both define a policy the same way.

The reference values come from `scripts/crosscheck_kvpress.py` (its own virtualenv with kvpress;
the file records the versions and the command); this test needs no kvpress. Cases: StreamingLLM,
CaM with every Bernoulli draw 1, H2O as a raw-sum scorer with kvlens's recent window, and TOVA
without kvpress's newest-token pin; each compressed right after prefill and at every decode step.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvlens.engine import RunOptions, run
from kvlens.policies import make_policy

REFERENCE = json.loads((Path(__file__).parent / "data" / "kvpress_reference.json").read_text(encoding="utf-8"))


def test_the_reference_covers_every_policy_both_define_the_same_way():
    assert set(REFERENCE["cases"]) == {"streaming_llm", "cam", "h2o", "tova"}
    assert {case["policy"] for case in REFERENCE["cases"].values()} == {"streaming_llm", "cam", "h2o", "tova"}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_per_step_nll_matches_kvpress(smol, case):
    spec = REFERENCE["cases"][case]
    r = run(smol, make_policy(spec["policy"], spec["params"]), REFERENCE["ids"], prefill=REFERENCE["prefill"],
            steps=REFERENCE["steps"], teacher=True, opts=RunOptions(budget=REFERENCE["budget"]))
    torch.testing.assert_close(r.tensors["steps/nll"].double(), torch.tensor(spec["nll"], dtype=torch.float64),
                               rtol=1e-4, atol=1e-6)
    assert r.metrics["kv_slots_max"] == REFERENCE["budget"]
