"""kvlens against NVIDIA kvpress, an independent implementation, where both define a policy the same way.

The reference values come from `scripts/crosscheck_kvpress.py` (its own virtualenv with kvpress;
the file records the versions and the command); this test needs no kvpress. Cases: StreamingLLM,
CaM with every Bernoulli draw 1, H2O as a raw-sum scorer with kvlens's recent window, and TOVA
without kvpress's newest-token pin; each compressed right after prefill and at every decode step.

What is structural is exact: the positions each compression removed, per step, layer and KV
head. The per-step NLL only guards against gross changes, within {nll_abs:.1e} absolute: ten
times the largest deviation `python scripts/float_envelope.py` measured between kvlens under
ATEN_CPU_CAPABILITY=default|avx2 x OMP_NUM_THREADS=1|2 and the reference (kvpress on an AVX2
EPYC), and between kvlens here and the previous reference written on an AVX-512 machine.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvlens.engine.loop import RunOptions, run
from kvlens.policies import make_policy

REFERENCE = json.loads((Path(__file__).parent / "data" / "kvpress_reference.json").read_text(encoding="utf-8"))
NLL_ATOL = 10 * 3.3e-5  # measured (docstring)
__doc__ = __doc__.format(nll_abs=NLL_ATOL)


def removed_by_step(decisions, steps: int, layers: int, kv_heads: int) -> list[list[list[list[int]]]]:
    """`[step][layer][kv_head]` the sorted positions that left the cache (evicted, or merged away)."""
    out = [[[[] for _ in range(kv_heads)] for _ in range(layers)] for _ in range(steps)]
    for row in decisions.itertuples():
        out[row.step][row.layer][row.kv_head].append(int(row.position))
    return [[[sorted(h) for h in layer] for layer in step] for step in out]


def test_the_reference_covers_every_policy_both_define_the_same_way():
    assert set(REFERENCE["cases"]) == {"streaming_llm", "cam", "h2o", "tova"}
    assert {case["policy"] for case in REFERENCE["cases"].values()} == {"streaming_llm", "cam", "h2o", "tova"}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_same_positions_removed_and_nll_as_kvpress(smol, case):
    spec = REFERENCE["cases"][case]
    r = run(smol, make_policy(spec["policy"], spec["params"]), REFERENCE["ids"], prefill=REFERENCE["prefill"],
            steps=REFERENCE["steps"], teacher=True, opts=RunOptions(budget=REFERENCE["budget"]))
    shape = smol.shape()
    got = removed_by_step(r.decisions, REFERENCE["steps"], shape["layers"], shape["kv_heads"])
    for step, (mine, theirs) in enumerate(zip(got, spec["removed"], strict=True)):
        assert mine == theirs, f"step {step}: kvlens and kvpress removed different positions"
    torch.testing.assert_close(r.tensors["steps/nll"].double(), torch.tensor(spec["nll"], dtype=torch.float64),
                               rtol=0, atol=NLL_ATOL)
    assert r.metrics["kv_slots_max"] == REFERENCE["budget"]
