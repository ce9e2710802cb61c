"""Attention variance of single tokens against that of group means over later steps (CaM Fig. 2)."""
from kvlens import analysis as an
from kvlens.analysis.registry import LAYER, Analysis, Param, register_analysis
from kvlens.analysis.states import layer_or_middle
from kvlens.levels import RecordLevel


@register_analysis
class Variance(Analysis):
    name = "variance"
    paper = "CaM Fig. 2"
    level = RecordLevel.STATES
    params = (LAYER,
              Param("head", None, kind="int", optional=True,
                    help="query head (default: the mean over the layer's heads)"),
              Param("group", 64, kind="int", help="tokens per group (CaM's m)", minimum=1))

    def compute(self, run, layer, head, group):
        return an.attention_variance(run, layer_or_middle(run, layer), head, group)

    def to_json(self, res, **params) -> dict:
        return {"layer": res.layer, "head": res.head, "group": res.group, "rows": list(res.rows),
                "starts": res.starts.tolist(), "group_var": res.group_var.tolist(),
                "token_var_mean": res.token_var.mean(1).tolist()}

    def figure(self, run, layer, head, group):
        from kvlens.figures.plots import variance_figure

        return variance_figure(run, layer_or_middle(run, layer), head, group)
