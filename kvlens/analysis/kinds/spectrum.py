"""Normalised singular values of the key and value caches per layer (WeightedKV Fig. 1)."""
from kvlens import analysis as an
from kvlens.analysis.registry import Analysis, Param, register_analysis
from kvlens.levels import RecordLevel


@register_analysis
class Spectrum(Analysis):
    name = "spectrum"
    paper = "WeightedKV Fig. 1"
    level = RecordLevel.STATES
    params = (Param("components", 64, kind="int", help="singular values kept per head", minimum=1),)

    def compute(self, run, components):
        return {kind: an.spectrum(run, kind, components) for kind in ("key", "value")}

    def to_json(self, specs, **params) -> dict:
        return {"layers": len(specs["key"].layers),
                **{k: {"singular_values": s.values.mean(1).tolist(), "energy_top8": s.energy_top.mean(1).tolist()}
                   for k, s in specs.items()}}

    def figure(self, run, components):
        from kvlens.figures.plots import spectrum_figure

        return spectrum_figure(run, components)
