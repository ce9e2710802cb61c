"""Write the documentation's generated pages and the README's generated blocks.

    python scripts/gen_docs.py           # write them
    python scripts/gen_docs.py --check   # exit 1, naming the files, if any is not what its source gives

Sources: the command line's parsers, the policy and analysis registries, `results/*.json` and the kvpress
cross-check's reference file. Nothing here is typed by hand: edit the source, then regenerate.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from docgen import analysis_page, cli_page, policy_page, results_page  # noqa: E402
from docgen.common import ROOT, replace_block  # noqa: E402

PAGES = {
    "docs/cli.md": cli_page.page,
    "docs/policies.md": policy_page.page,
    "docs/analyses.md": analysis_page.page,
    "docs/results.md": results_page.page,
}
README_BLOCKS = {"policies": policy_page.readme_table, "results": results_page.readme_summary}


def expected() -> dict[str, str]:
    """Every generated file's path (relative to the repository) and the text it must have."""
    out = {path: build() for path, build in PAGES.items()}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name, build in README_BLOCKS.items():
        readme = replace_block(readme, name, build())
    out["README.md"] = readme
    return out


def main(argv: list[str]) -> int:
    stale = []
    for path, text in expected().items():
        target = ROOT / path
        if target.exists() and target.read_text(encoding="utf-8") == text:
            continue
        stale.append(path)
        if "--check" not in argv:
            target.write_text(text, encoding="utf-8")
    if "--check" in argv and stale:
        print(f"Out of date: {', '.join(stale)}; run `make docs-gen`.", file=sys.stderr)
        return 1
    print("\n".join(f"wrote {p}" for p in stale) if stale else "the generated docs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
