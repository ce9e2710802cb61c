"""Token x token cosine similarity of one head's prefill states (KVMerger Fig. 2, CORM Fig. 3)."""
from kvlens import analysis as an
from kvlens.analysis.registry import LAYER, Analysis, Param, nan_to_none, register_analysis
from kvlens.analysis.states import layer_or_middle, parse_states
from kvlens.levels import RecordLevel


@register_analysis
class Similarity(Analysis):
    name = "similarity"
    paper = "KVMerger Fig. 2, CORM Fig. 3"
    level = RecordLevel.STATES
    params = (LAYER,
              Param("head", 0, kind="int", help="KV head (a query head for queries)"),
              Param("state", "key", kind="text",
                    help="query, key or value; a figure also takes several, comma-separated "
                                         "(key,value: panels on one colour scale)"),
              Param("max_size", 512, kind="int",
                    help="at most this many cells per side (longer prompts are block-averaged)",
                    minimum=1))

    def compute(self, run, layer, head, state, max_size):
        return an.similarity_map(run, layer_or_middle(run, layer), head, parse_states(state, many=False)[0], max_size)

    def to_json(self, m, **params) -> dict:
        return {"layer": m.layer, "head": m.head, "state": m.kind, "tokens": m.tokens, "block": m.block,
                "edges": m.edges.tolist(), "matrix": nan_to_none(m.matrix)}

    def figure(self, run, layer, head, state, max_size):
        from kvlens.figures.plots import similarity_figure

        return similarity_figure(run, layer_or_middle(run, layer), head, parse_states(state), max_size)
