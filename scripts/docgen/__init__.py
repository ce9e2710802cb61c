"""Generators of the documentation's reference pages and the README's generated blocks.

Each module builds one page (or block) as a string from its source of truth: the command line's argparse
parsers, the policy registry, the analysis registry, the `results/*.json` files. `scripts/gen_docs.py`
writes them; `tests/docs/test_docs.py` regenerates them and fails on any difference.
"""
