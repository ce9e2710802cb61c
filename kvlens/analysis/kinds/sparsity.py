"""Layer-wise and head-wise attention sparsity, CORM's definition (CORM Fig. 1)."""
from kvlens import analysis as an
from kvlens.analysis.registry import Analysis, register_analysis
from kvlens.levels import RecordLevel


@register_analysis
class Sparsity(Analysis):
    name = "sparsity"
    paper = "CORM Fig. 1"
    level = RecordLevel.STATES

    def compute(self, run):
        return an.corm_sparsity(run)

    def to_json(self, sp) -> dict:
        return {"layers": sp.layers, "sparsity": sp.sparsity.mean(1).tolist(),
                "sparsity_per_head": sp.sparsity.tolist()}

    def figure(self, run):
        from kvlens.figures.plots import sparsity_figure

        return sparsity_figure(run)
