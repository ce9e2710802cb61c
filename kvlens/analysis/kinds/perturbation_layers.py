"""Output perturbation per layer, merging vs evicting the same slots, and its step x layer map."""
from kvlens.analysis.registry import Analysis, register_analysis


@register_analysis
class PerturbationLayers(Analysis):
    name = "perturbation-layers"
    paper = "CaM Fig. 1 (d), across layers"
    measured = True

    def compute(self, run):
        return {k: run.tensor(f"perturbation/{k}").float().mean(dim=(0, 2)) for k in ("used", "evict")}

    def to_json(self, per_layer) -> dict:
        return {k: v.tolist() for k, v in per_layer.items()}

    def figure(self, run):
        from kvlens.figures.attention import perturbation_layers_figure

        return perturbation_layers_figure(run)
