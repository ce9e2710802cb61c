"""Log-perplexity of the tokens so far against position, one curve per run (WeightedKV Fig. 4)."""
from kvlens import analysis as an
from kvlens.analysis.registry import Analysis, Param, register_analysis
from kvlens.levels import RecordLevel


def _labels(runs: list, label: list) -> list:
    """One label per run (None: its policy)."""
    return (label + [None] * len(runs))[:len(runs)]


@register_analysis
class Perplexity(Analysis):
    name = "perplexity"
    paper = "WeightedKV Fig. 4"
    inputs = "runs"
    level = RecordLevel.SUMMARY
    params = (Param("label", (), kind="text",
                    help="legend label of each run, in order (default: its policy)", many=True),)

    def compute(self, runs, label):
        return [an.log_perplexity_curve(r, lab) for r, lab in zip(runs, _labels(runs, label), strict=True)]

    def to_json(self, curves, **params) -> dict:
        return {"runs": [{"label": c.label, "positions": c.positions.tolist(), "log_ppl": c.log_ppl.tolist()}
                         for c in curves]}

    def figure(self, runs, label):
        from kvlens.figures.plots import perplexity_figure

        return perplexity_figure(runs, _labels(runs, label))
