"""Gaussian-kernel merge weights over one KVMerger merging set, pivot marked (KVMerger Fig. 3d).

Drawn under both of the paper's sigma rules (the policy's default, §6.3's mean distance to the
pivot, first; Eq. 7 of §5.2 beside it), plus any fixed sigma values.
"""
from kvlens import analysis as an
from kvlens.analysis.merging import RULES, SIGMA_SOURCES
from kvlens.analysis.registry import LAYER, THRESHOLD, Analysis, Param, register_analysis
from kvlens.analysis.states import layer_or_middle
from kvlens.errors import KvlensError
from kvlens.levels import RecordLevel


@register_analysis
class Gaussian(Analysis):
    name = "gaussian"
    paper = "KVMerger Fig. 3d"
    level = RecordLevel.STATES
    params = (LAYER,
              Param("head", 0, kind="int", help="KV head"),
              THRESHOLD,
              Param("token", None, kind="int", optional=True,
                    help="show the merging set holding this token (default: the largest set)"),
              Param("rule", RULES, kind="text",
                    help="sigma rules drawn: mean_distance (§6.3, the kvmerger policy's default) "
                    "and eq7 (Eq. 7, §5.2); repeat the flag", many=True),
              Param("sigma", (), kind="float",
                    help="fixed sigma values drawn besides the rules (repeat the flag)", many=True))

    def _args(self, run, layer, head, threshold, token, rule, sigma):
        unknown = [r for r in rule if r not in RULES]
        if unknown:
            raise KvlensError(f"rule takes {' or '.join(RULES)}; got {unknown[0]!r}.")
        return layer_or_middle(run, layer), head, threshold, token, (*rule, *sigma)

    def compute(self, run, **params):
        return an.gaussian_set(run, *self._args(run, **params))

    def to_json(self, gs, **params) -> dict:
        cited = {r: " in KVMerger ".join(SIGMA_SOURCES[r]) for r in gs.weights if isinstance(r, str)}
        return {"layer": gs.layer, "head": gs.head, "threshold": gs.threshold, "positions": gs.positions,
                "pivot": gs.pivot, "sigma_rules": cited,
                "weights": {str(s): w.tolist() for s, w in gs.weights.items()}}

    def figure(self, run, **params):
        from kvlens.figures.plots import gaussian_figure

        return gaussian_figure(run, *self._args(run, **params))
