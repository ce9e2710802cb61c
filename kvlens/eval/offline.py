"""Local files stay local: lm-eval's data loading without the `datasets` library's network calls."""

from __future__ import annotations


def quiet_datasets() -> None:
    """`datasets` sends a request to its S3 bucket to count every load of a packaged builder (json, parquet),
    local files included, unless told not to: kvlens turns that count off, so a task on local data contacts no
    host (a task whose data is on a hub still downloads it)."""
    import datasets.config

    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
