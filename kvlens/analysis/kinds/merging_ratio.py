"""Layer-wise compression ratio of KVMerger's merging sets over the bundled texts (KVMerger Fig. 3b)."""
from kvlens.analysis.registry import TEXTS, THRESHOLD, Analysis, Param, register_analysis
from kvlens.texts import bundled


@register_analysis
class MergingRatio(Analysis):
    name = "merging-ratio"
    paper = "KVMerger Fig. 3b"
    inputs = "model"
    params = (TEXTS,
              Param("tokens", 1024, kind="int", help="tokens of each text", minimum=2),
              THRESHOLD)

    def compute(self, model, texts, tokens, threshold):
        from kvlens.analysis import sweeps

        return sweeps.merging_ratio_over_texts(model, bundled(texts), tokens, threshold)

    def to_json(self, res, threshold, tokens, **params) -> dict:
        return {"threshold": threshold, "tokens": tokens, "layers": next(iter(res.values())).layers,
                "texts": {label: r.per_layer().tolist() for label, r in res.items()}}

    def figure(self, model, **params):
        from kvlens.figures.plots import merging_ratio_figure, model_label

        res = self.compute(model, **params)
        note = f" ({model_label(model.spec)}, first {params['tokens']} tokens of {len(res)} texts)"
        return merging_ratio_figure(list(res.values()), list(res), note)
