"""Mean cosine similarity of adjacent tokens' states per layer (KVMerger Fig. 3a, summarised)."""
from kvlens import analysis as an
from kvlens.analysis.registry import Analysis, register_analysis
from kvlens.levels import RecordLevel


@register_analysis
class Adjacency(Analysis):
    name = "adjacency"
    paper = "KVMerger Fig. 3a (summary over tokens)"
    level = RecordLevel.STATES

    def compute(self, run):
        return an.adjacency(run)

    def to_json(self, adj) -> dict:
        return {"layers": len(adj.layers), **{k: adj.per_layer(k) for k in ("query", "key", "value")}}

    def figure(self, run):
        from kvlens.figures.plots import adjacency_figure

        return adjacency_figure(run)
