"""App-side helpers that need Streamlit: cached loading, the shared sidebar, generated policy
widgets, charts with export buttons, and live runs in a worker thread.

Pages (`pages/*.py`) hold widgets and layout only: a browse page starts with
`run = browse_page(...)` (`kvlens.ui.page`) and draws registered analyses with
`run_figure(run, KIND, ...)` (`kvlens.ui.state`); Run and Compare share `kvlens.ui.jobs.PageJob`.
Session keys shared between modules are declared in `kvlens.ui.session`; a page's own widget keys
are prefixed per page (`run_`, `attn_`, `sim_`, `spec_`, `merge_`, `pert_`, `cmp_`, `bench_`).
"""
