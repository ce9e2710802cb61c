"""The Run page's live figure: per-step perturbation of a measured run arrives while it runs."""

from __future__ import annotations

import torch

from kvlens.ui.live import Live, RunSettings


def test_live_figure_plots_per_step_perturbation_of_a_measured_run(tiny):
    settings = RunSettings(
        policy="cam",
        params={"base": "h2o", "mask": "always"},
        budget=12,
        text="Merging keeps what eviction drops. " * 3,
        teacher=True,
        new_tokens=10,
        prefill=60,
        record="summary",
        measure=True,
    )
    live = Live(names=tiny.tokenizer.convert_ids_to_tokens)
    run = settings.work(tiny)(lambda e: live.add([e]), None)
    assert live.text == run.meta.text
    used = live.perturbation["perturbation_used"]
    assert [s for s, _ in used] == list(range(1, 10))  # every decode step, as it happened
    want = run.tensors["perturbation/used"].mean(dim=(1, 2))  # (steps - 1,)
    assert torch.allclose(torch.tensor([v for _, v in used]), want, atol=1e-6)
    fig = live.figure()
    lines = {t.name: t for t in fig.data if t.type == "scatter"}
    assert list(lines["cache used (merged)"].y) == [v for _, v in used]
    assert len(lines["same evictions, no merge"].y) == 9
    assert len(fig.layout.annotations) == 4  # NLL, slots, perturbation, attention row


def test_live_figure_without_measurement_has_three_panels(tiny):
    settings = RunSettings(
        policy="h2o",
        params={},
        budget=12,
        text="Short prompt for a live run. " * 3,
        teacher=False,
        new_tokens=6,
        record="summary",
    )
    live = Live()
    settings.work(tiny)(lambda e: live.add([e]), None)
    assert not live.perturbation and len(live.figure().layout.annotations) == 3
