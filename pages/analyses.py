"""Analyses: any registered analysis (`kvlens analyze --list`) of the open run, with widgets generated from
its parameters; the analysis and its parameters are kept in the link."""

from kvlens.analysis.registry import analyses
from kvlens.ui.analysis_widgets import analysis_widgets, pick_analysis
from kvlens.ui.charts import chart
from kvlens.ui.page import analysis_need, browse_page, meets
from kvlens.ui.state import run_figure

run = browse_page(
    "Analyses",
    "Every registered analysis of one run, with its parameters: the figure `kvlens figure` "
    "exports and `kvlens.load_run(...).figure(...)` returns.",
)
readers = [name for name, cls in analyses().items() if cls.inputs != "model"]  # those that read runs
kind = pick_analysis(readers, "an_kind")  # in the URL with its parameters
if meets(analysis_need(kind), "an_offer"):
    params = analysis_widgets(kind, "an")
    if params is not None:
        chart(
            run_figure(run, kind, **params), f"an_{kind}", name=kind, config={"run": str(run.path), **params}
        )
