"""Axes of whole numbers over a short span tick at whole numbers only."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlens.figures.plots import integer_ticks


def test_short_whole_number_axes_tick_at_every_integer_and_others_are_left_alone():
    fig = make_subplots(rows=1, cols=2)
    fig.add_trace(go.Scatter(x=[0, 1, 2, 3], y=[0.5, 0.25, 0.1, 0.2]), row=1, col=1)
    fig.add_trace(go.Scatter(x=list(range(0, 400, 10)), y=[1] * 40), row=1, col=2)
    integer_ticks(fig)
    assert fig.layout.xaxis.dtick == 1  # four steps: no tick at 0.5
    assert fig.layout.yaxis.dtick is None  # fractions
    assert fig.layout.xaxis2.dtick is None  # a long axis keeps plotly's spacing
    assert fig.layout.yaxis2.dtick == 1  # a constant whole number


def test_an_axis_drawn_from_zero_counts_zero_in_its_span():
    """48 kept slots at every step on an axis from 0 (the Runs page's overlay) keep plotly's spacing, not 49
    tick labels on top of each other; 3 slots from 0 still tick at every integer."""
    fig = make_subplots(rows=1, cols=2)
    fig.add_trace(go.Scatter(x=[0, 1, 2], y=[48, 48, 48]), row=1, col=1)
    fig.add_trace(go.Scatter(x=[0, 1, 2], y=[3, 3, 2]), row=1, col=2)
    fig.update_yaxes(rangemode="tozero")
    integer_ticks(fig)
    assert fig.layout.yaxis.dtick is None and fig.layout.yaxis2.dtick == 1
