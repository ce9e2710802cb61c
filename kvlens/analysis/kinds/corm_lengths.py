"""Compression rate CORM reaches against sequence length, over the bundled texts (CORM Fig. 4)."""
from kvlens.analysis.registry import TEXTS, Analysis, Param, register_analysis
from kvlens.lists import parse_list
from kvlens.texts import bundled


@register_analysis
class CormLengths(Analysis):
    name = "corm-lengths"
    paper = "CORM Fig. 4"
    inputs = "model"
    params = (TEXTS,
              Param("lengths", "256,512,1024,2048", kind="text", help="comma-separated sequence lengths"),
              Param("settings", (), kind="text",
                    help="a corm parameter, KEY=VALUE (e.g. window=64); repeat for several",
                    many=True, cli="--set"))

    def compute(self, model, texts, lengths, settings):
        from kvlens.analysis import sweeps
        from kvlens.policies import parse_settings

        lengths = sorted(parse_list(lengths, "--lengths", int, minimum=2))
        return sweeps.corm_over_lengths(model, bundled(texts), lengths, parse_settings("corm", settings))

    def to_json(self, res, **params) -> dict:
        return {"lengths": res.lengths, "params": res.params, "compression": res.mean(),
                "texts": dict(zip(res.labels, res.ratio.tolist(), strict=True))}

    def figure(self, model, **params):
        from kvlens.figures.plots import corm_lengths_figure, model_label

        res = self.compute(model, **params)
        used = ", ".join(f"{k}={v}" for k, v in res.params.items())
        note = f"<br><sup>{model_label(model.spec)}, corm {used}, mean of {len(res.labels)} texts</sup>"
        return corm_lengths_figure(res.lengths, res.mean(), note=note)
