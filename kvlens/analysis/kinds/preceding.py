"""Similarity of token t's state to each of the tokens before it, per head (KVMerger Fig. 3a)."""
from kvlens import analysis as an
from kvlens.analysis.registry import LAYER, Analysis, Param, nan_to_none, register_analysis
from kvlens.analysis.states import layer_or_middle, parse_states
from kvlens.levels import RecordLevel


@register_analysis
class Preceding(Analysis):
    name = "preceding"
    paper = "KVMerger Fig. 3a"
    level = RecordLevel.STATES
    params = (LAYER,
              Param("token", None, kind="int", optional=True, help="token t (default: the last prompt token)"),
              Param("window", 32, kind="int", help="how many tokens before t", minimum=1),
              Param("state", "key", kind="text", help="query, key or value"))

    def _args(self, run, layer, token, window, state):
        token = len(run.meta["prompt_tokens"]) - 1 if token is None else token
        return layer_or_middle(run, layer), token, window, parse_states(state, many=False)[0]

    def compute(self, run, **params):
        layer, token, window, state = self._args(run, **params)
        return {"layer": layer, "token": token, "state": state,
                "similarity": an.preceding_similarity(run, layer, token, window, state)}

    def to_json(self, result, **params) -> dict:
        return {**result, "similarity": nan_to_none(result["similarity"])}

    def figure(self, run, **params):
        from kvlens.figures.plots import preceding_figure

        return preceding_figure(run, *self._args(run, **params))
