"""Kept slots per KV head after each step's compression, against the tokens seen and the budget."""
from kvlens.analysis.registry import Analysis, register_analysis


@register_analysis
class Occupancy(Analysis):
    name = "occupancy"
    paper = "cache occupancy over steps (every policy)"

    def compute(self, run):
        return run.tensor("steps/kv_slots").flatten(1)  # (steps + 1, L * Hkv)

    def to_json(self, kept) -> dict:
        return {"mean": kept.float().mean(1).tolist(), "min": kept.amin(1).tolist(), "max": kept.amax(1).tolist()}

    def figure(self, run):
        from kvlens.figures.attention import occupancy_figure

        return occupancy_figure(run)
