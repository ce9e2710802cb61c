"""Gaussian-kernel merge weights over one KVMerger merging set, pivot marked (KVMerger Fig. 3d)."""
from kvlens import analysis as an
from kvlens.analysis.registry import LAYER, THRESHOLD, Analysis, Param, register_analysis
from kvlens.analysis.states import layer_or_middle
from kvlens.levels import RecordLevel


@register_analysis
class Gaussian(Analysis):
    name = "gaussian"
    paper = "KVMerger Fig. 3d"
    level = RecordLevel.STATES
    params = (LAYER,
              Param("head", int, 0, "KV head"),
              THRESHOLD,
              Param("token", int, None, "show the merging set holding this token (default: the largest set)"),
              Param("sigma", float, (), "extra sigma values besides the paper's formula (repeat the flag)", many=True))

    def _args(self, run, layer, head, threshold, token, sigma):
        return layer_or_middle(run, layer), head, threshold, token, (None, *sigma)

    def compute(self, run, **params):
        return an.gaussian_set(run, *self._args(run, **params))

    def to_json(self, gs, **params) -> dict:
        return {"layer": gs.layer, "head": gs.head, "threshold": gs.threshold, "positions": gs.positions,
                "pivot": gs.pivot,
                "weights": {("paper" if s is None else str(s)): w.tolist() for s, w in gs.weights.items()}}

    def figure(self, run, **params):
        from kvlens.plots import gaussian_figure

        return gaussian_figure(run, *self._args(run, **params))
