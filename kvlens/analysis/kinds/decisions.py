"""Every eviction and merge of one layer and KV head, step x original position (the run's decision log)."""
from kvlens.analysis.registry import Analysis, Param, register_analysis


@register_analysis
class Decisions(Analysis):
    name = "decisions"
    paper = "the decision log (every compressing policy)"
    params = (Param("layer", 0, kind="int", help="layer"), Param("kv_head", 0, kind="int", help="KV head"))

    def compute(self, run, layer, kv_head):
        d = run.decisions
        return d[(d["layer"] == layer) & (d["kv_head"] == kv_head)]

    def to_json(self, rows, **params) -> dict:
        return {**params, "evictions": int((rows["action"] == "evict").sum()),
                "merges": int((rows["action"] == "merge").sum()),
                **{k: rows[k].tolist() for k in ("step", "action", "position")}}

    def figure(self, run, layer, kv_head):
        from kvlens.figures.attention import decision_timeline_figure

        return decision_timeline_figure(run, layer, kv_head)
