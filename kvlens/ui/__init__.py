"""App-side helpers that need Streamlit: cached loading, the shared sidebar, generated policy
widgets, charts with export buttons, and live runs in a worker thread.

Pages (`pages/*.py`) hold widgets and layout only; they call these helpers and the builders in
`kvlens.analysis` / `kvlens.plots*`. Session-state keys are prefixed per page (`app_`, `run_`,
`attn_`, `sim_`, `spec_`, `merge_`, `pert_`, `cmp_`, `bench_`).
"""
