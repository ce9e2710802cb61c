"""Benchmarks: perplexity tables, needle-in-a-haystack heatmaps, speed and memory with target ratios."""
