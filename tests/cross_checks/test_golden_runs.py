"""Every policy decides exactly as it did before the slot-reusing cache (`scripts/make_golden_runs.py`).

Structural facts are exact: every decision row (step, layer, KV head, action, position, merge
targets, draw) and every kept count. Floats only guard against gross changes, within the
envelope `python scripts/float_envelope.py` measured across ATen kernel sets and thread counts
(ATEN_CPU_CAPABILITY=default|avx2 x OMP_NUM_THREADS=1|2 on an AVX2 EPYC, against values stored
on an AVX-512 one): per-step NLL at most {nll_abs:.1e} apart, per-step sums of merge weights
and probabilities {weights_rel:.1e} relative, perturbation summaries {pert_rel:.1e} relative
({pert_abs:.1e} absolute). The tolerances below are ten times those.
"""

from __future__ import annotations

import json

import pytest
import torch

from scripts.make_golden_runs import MEASURED, check_case, one, stored_rows
from tests.conftest import TEST_DATA

GOLDEN = json.loads((TEST_DATA / "golden_runs.json").read_text(encoding="utf-8"))
ENVELOPE = {
    "nll_abs": 3.3e-5,
    "weights_rel": 1.0e-6,
    "pert_rel": 6.0e-4,
    "pert_abs": 1.6e-4,
}  # measured (docstring)
__doc__ = __doc__.format(**ENVELOPE)


def check_floats(got: dict, want: dict) -> None:
    torch.testing.assert_close(
        torch.tensor(got["nll"], dtype=torch.float64),
        torch.tensor(want["nll"], dtype=torch.float64),
        rtol=0,
        atol=10 * ENVELOPE["nll_abs"],
    )
    assert got["weights"] == pytest.approx(want["weights"], rel=10 * ENVELOPE["weights_rel"], abs=1e-9)
    for key, value in want.get("perturbation", {}).items():
        assert got["perturbation"][key] == pytest.approx(
            value, rel=10 * ENVELOPE["pert_rel"], abs=10 * ENVELOPE["pert_abs"]
        ), key


def rerun(model, case: str) -> dict:
    want = GOLDEN["cases"][case]
    measure = case.endswith(":measured")
    assert not measure or case.removesuffix(":measured") in MEASURED
    return one(model, GOLDEN["ids"], want["policy"], want["params"], measure=measure)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(GOLDEN["cases"]))
def test_policy_decides_as_recorded(smol, case):
    got, want = rerun(smol, case), GOLDEN["cases"][case]
    problem = check_case(got, want, stored_rows(case))
    assert problem is None, problem
    check_floats(got, want)


@pytest.mark.slow
def test_one_flipped_decision_fails_and_float_noise_passes(smol):
    """The golden check can fail: one stored position changed is caught; NLLs 1e-6 relative apart pass."""
    got, want, rows = rerun(smol, "h2o"), GOLDEN["cases"]["h2o"], stored_rows("h2o")
    assert check_case(got, want, rows) is None
    flipped = rows.copy()
    flipped.loc[100, "position"] = int(flipped.position[100]) + 1
    assert "decision row" in check_case(got, want, flipped)
    miscounted = {**want, "kv_slots": json.loads(json.dumps(want["kv_slots"]))}
    miscounted["kv_slots"][5][7][1] += 1
    assert "step 5, layer 7" in check_case(got, miscounted, rows)
    check_floats({**got, "nll": [x * (1 + 1e-6) for x in got["nll"]]}, want)
    with pytest.raises(AssertionError):
        check_floats({**got, "nll": [x + 1e-2 for x in got["nll"]]}, want)
