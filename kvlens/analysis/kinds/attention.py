"""The query-row x position attention map of one layer and head, kept/evicted/merged/sink marked (CaM Fig.
1a-c).

Reads a `--record attention` run's per-step rows (`attn/{layer}` `(R, Hq, Smax)`, `attn_pos/{layer}`
`(R, Hkv, Smax)`) through `kvlens.figures.attention.attention_grid` (which the app's Attention page
and token inspector use too): `weights` and `status` `(R', P')`, block-pooled to at most
`max_cells` per side.
"""

from kvlens.analysis.registry import Analysis, Param, nan_to_none, register_analysis
from kvlens.figures.attention import STATUS, attention_grid, attention_map_figure, recorded_attention_layers
from kvlens.figures.wording import if_none
from kvlens.levels import RecordLevel


@register_analysis
class AttentionAnalysis(Analysis):
    name = "attention"
    paper = "CaM Fig. 1 (a)-(c)"
    level = RecordLevel.ATTENTION
    params = (
        Param(
            "layer",
            None,
            kind="int",
            optional=True,
            help="layer (default: the middle layer with attention rows)",
        ),
        Param("head", 0, kind="int", help="query head"),
        Param(
            "step", None, kind="int", optional=True, help="query row marked by a guide line (default: none)"
        ),
        Param(
            "max_cells",
            512,
            kind="int",
            help="at most this many cells per side (longer runs are block-pooled)",
            minimum=1,
        ),
    )

    def compute(self, run, layer, head, max_cells, **params):
        layers = recorded_attention_layers(run)
        return attention_grid(run, if_none(layer, layers[len(layers) // 2]), head, max_cells)

    def to_json(self, grid, **params) -> dict:
        return {
            "layer": grid.layer,
            "head": grid.head,
            "prompt_tokens": grid.prompt_len,
            "rows": grid.rows,
            "cols": grid.cols,
            "block": list(grid.block),
            "weights": nan_to_none(grid.weights),
            "status": grid.status.tolist(),
            "status_codes": {code: name for code, (name, _) in STATUS.items()},
        }

    def figure(self, run, step, **params):
        return attention_map_figure(run, self.compute(run, **params), step)
