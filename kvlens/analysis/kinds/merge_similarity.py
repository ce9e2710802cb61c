"""Future attention with and without one merge, per layer (WeightedKV Fig. 2)."""
from kvlens import analysis as an
from kvlens.analysis.registry import Analysis, Param, register_analysis
from kvlens.levels import RecordLevel


@register_analysis
class MergeSimilarity(Analysis):
    name = "merge-similarity"
    paper = "WeightedKV Fig. 2"
    level = RecordLevel.STATES
    params = (Param("step", 100, kind="int", help="the query row at which one token is merged"),
              Param("horizon", 800, kind="int", help="how many later rows are compared", minimum=1))

    def compute(self, run, step, horizon):
        return an.merge_future_similarity(run, step, horizon)

    def to_json(self, ms, **params) -> dict:
        flat = ms.cosine.flatten(1)
        return {"layers": ms.layers, "step": ms.step, "mean": flat.mean(1).tolist(),
                "std": flat.std(1, unbiased=False).tolist(), "merged_token": ms.merged.tolist()}

    def figure(self, run, step, horizon):
        from kvlens.figures.plots import merge_similarity_figure

        return merge_similarity_figure(run, step, horizon)
