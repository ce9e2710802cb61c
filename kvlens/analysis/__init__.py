"""Analyses of recorded runs, reproducing the papers' figures: one file per analysis kind in
`kvlens/analysis/kinds/` (its computation, result, JSON and figure), declared to the registry
(`kvlens.analysis.registry`) that `kvlens analyze`, `kvlens figure`, `Run.figure` and the app go
through; `kvlens.analysis.states` reads the recorded prefill states the kinds share.
"""
