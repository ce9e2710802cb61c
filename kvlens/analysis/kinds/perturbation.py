"""Output perturbation over steps, merging vs evicting the same slots, attention loss and KL (CaM Fig. 1d)."""
from kvlens.analysis.registry import Analysis, register_analysis


@register_analysis
class Perturbation(Analysis):
    name = "perturbation"
    paper = "CaM Fig. 1 (d), over steps"
    measured = True

    def compute(self, run):
        means = {k: run.tensor(f"perturbation/{k}").float().mean(dim=(1, 2)) for k in ("used", "evict",
                                                                                      "attention_loss")}
        return {**means, "kl": run.tensor("perturbation/kl").float()}

    def to_json(self, per_step) -> dict:
        return {k: v.tolist() for k, v in per_step.items()}

    def figure(self, run):
        from kvlens.figures.attention import perturbation_steps_figure

        return perturbation_steps_figure(run)
