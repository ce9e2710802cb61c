"""Analyses of recorded runs: pure tensor functions reproducing the papers' figures.

| function | reproduces |
|---|---|
| `similarity_map(run, layer, head, kind, max_size=512)` | KVMerger Fig. 2, CORM Fig. 3 |
| `adjacency(run)`, `preceding_similarity(run, layer, token, window, kind)` | KVMerger Fig. 3a |
| `spectrum(run, kind)` | WeightedKV Fig. 1 |
| `corm_sparsity(run)` | CORM Fig. 1 |
| `attention_variance(run, layer, head, group)` | CaM Fig. 2 |
| `merging_ratio(run, threshold)`, `gaussian_set(run, layer, head, threshold)` | KVMerger Fig. 3b, 3d |
| `merge_future_similarity(run, step, horizon)` | WeightedKV Fig. 2 |
| `log_perplexity_curve(run)` | WeightedKV Fig. 4 |

Analyses over several texts or lengths, which run the model, are in `kvlens.analysis.sweeps`.
Each analysis the CLI, `Run.figure` and the app offer is declared once in `kvlens/analysis/kinds/`
(see `kvlens.analysis.registry`).
"""
from kvlens.analysis.attention_stats import (
    AttentionVariance,
    MergeSimilarity,
    Sparsity,
    aggregated_attention,
    attention_variance,
    corm_sparsity,
    merge_future_similarity,
)
from kvlens.analysis.merging import GaussianSet, MergingRatio, gaussian_set, merging_ratio
from kvlens.analysis.perplexity import PerplexityCurve, log_perplexity_curve
from kvlens.analysis.similarity import (
    Adjacency,
    SimilarityMap,
    adjacency,
    block_edges,
    preceding_similarity,
    similarity_map,
)
from kvlens.analysis.spectrum import Spectrum, singular_values, spectrum
from kvlens.analysis.states import attention_chunks, recorded_layers

__all__ = [
    "Adjacency", "AttentionVariance", "GaussianSet", "MergeSimilarity", "MergingRatio", "PerplexityCurve",
    "SimilarityMap", "Sparsity", "Spectrum", "adjacency", "aggregated_attention", "attention_chunks",
    "attention_variance", "block_edges", "corm_sparsity", "gaussian_set", "log_perplexity_curve",
    "merge_future_similarity", "merging_ratio", "preceding_similarity", "recorded_layers", "similarity_map",
    "singular_values", "spectrum",
]
