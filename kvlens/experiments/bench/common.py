"""Shared pieces of the benchmarks: policy specs and labels, medians, peak memory, environment, saving
results."""

from __future__ import annotations

import csv
import json
import platform
import statistics
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from kvlens.errors import KvlensError
from kvlens.figures.wording import suffix
from kvlens.policies import make_policy, parse_settings
from kvlens.version import __version__


@dataclass(frozen=True)
class PolicySpec:
    """A policy with its parameters, as benchmarks name it: `cam` or `cam:base=h2o,span=8`."""

    name: str
    params: tuple = ()

    @property
    def label(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params)

    @property
    def budget_free(self) -> bool:
        return make_policy(self.name, dict(self.params)).budget_free

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        """`name` or `name:key=value,key=value`; parameters are checked against the policy."""
        name, _, rest = text.strip().partition(":")
        params = parse_settings(name, [s for s in rest.split(",") if s]) if rest else {}
        make_policy(name, params)
        return cls(name, tuple(sorted(params.items())))


def parse_policies(text: str) -> list[PolicySpec]:
    """A list of policy specs separated by ';', or by ',' where the next part is a name rather than a
    parameter (parameters are always `key=value`, a policy `name` or `name:key=value`): `full,h2o` and
    `cam:base=h2o,span=8;tova` both read as expected. A policy given twice (the same name and parameters) is
    refused: its results would be one."""
    specs = []
    for chunk in text.split(";"):
        group: list[str] = []
        for piece in chunk.split(","):
            if group and "=" in piece and ":" not in piece.partition("=")[0]:
                group[-1] += "," + piece  # `key=value`: a parameter of the policy before it
            else:
                group.append(piece)
        specs += [PolicySpec.parse(g) for g in group if g.strip()]
    if not specs:
        raise KvlensError("Give at least one policy.")
    labels = [s.label for s in specs]
    if twice := next((x for i, x in enumerate(labels) if x in labels[:i]), None):
        raise KvlensError(f"Policy '{twice}' is given twice; give each policy once.")
    return specs


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def mean(values) -> float | None:
    """The mean of some numbers, None without any."""
    values = list(values)
    return statistics.fmean(values) if values else None


def spread(values) -> dict:
    """mean, sample standard deviation, min and max of a list of numbers."""
    values = list(values)
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def bootstrap(groups: list[list[float]], seed: int = 0, resamples: int = 9999) -> tuple[float, float]:
    """95 % bootstrap interval of the mean of the groups' means (each group, e.g. a task at one length, weighs
    the same however many values it holds), through `scipy.stats.bootstrap`: each group is a sample of its
    own, resampled within itself (`paired=False`: a value never moves to another group) `resamples` times by
    numpy's generator seeded with `seed`; the interval is BCa (bias-corrected and accelerated).

    Degenerate inputs: a group that resampling cannot move (one value, or all its values equal) enters the
    mean as a constant (scipy resamples samples of two values or more); when no group can move, the interval
    is (mean, mean); when BCa is undefined (nan, e.g. the whole bootstrap distribution on one side of the
    estimate) the interval is the percentile one of the same resamples. ValueError when a group is empty or
    there is none."""
    from scipy import stats

    arrays = [np.asarray(g, dtype=float) for g in groups]
    if not arrays or any(a.size == 0 for a in arrays):
        raise ValueError("bootstrap needs at least one group, each with at least one value.")
    varying = [a for a in arrays if np.ptp(a) > 0]
    fixed = sum(float(a.mean()) for a in arrays if np.ptp(a) == 0)
    if not varying:
        mean = fixed / len(arrays)
        return mean, mean

    def statistic(*samples, axis=-1):
        return (fixed + sum(np.mean(s, axis=axis) for s in samples)) / len(arrays)

    # BCa's nan (an infinite bias correction) is handled below: no warning for it
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        res = stats.bootstrap(
            varying,
            statistic,
            n_resamples=resamples,
            paired=False,
            vectorized=True,
            method="BCa",
            rng=np.random.default_rng(seed),
        )
        low, high = res.confidence_interval
        if np.isnan(low) or np.isnan(high):
            low, high = stats.bootstrap(
                varying, statistic, n_resamples=0, method="percentile", bootstrap_result=res
            ).confidence_interval
    return float(low), float(high)


class PeakRSS:
    """Samples the process's resident memory in a thread: `with PeakRSS() as m: ...; m.peak` (bytes). On a
    CUDA `device`, also the GPU's peak (`m.device_peak`, `torch.cuda.max_memory_allocated` since entry;
    None elsewhere)."""

    def __init__(self, interval_s: float = 0.005, device: torch.device | None = None):
        self.interval_s = interval_s
        self.proc = psutil.Process()
        self.peak = 0
        self.cuda = device if device is not None and device.type == "cuda" else None
        self.device_peak: int | None = None
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            torch.cuda.reset_peak_memory_stats(self.cuda)
        self.start = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            self.device_peak = torch.cuda.max_memory_allocated(self.cuda)


def label(row: dict) -> str:
    """A row's policy as benchmarks name it: `cam` or `cam:base=h2o` (the parameters that differ from the
    defaults)."""
    from kvlens.policies import changed_params

    changed = changed_params(row["policy"], row.get("params") or {})
    return row["policy"] + suffix(":{}", ",".join(f"{k}={v}" for k, v in changed.items()))


def environment(model=None) -> dict:
    """Where the numbers were measured: machine, threads, versions, and the model if it was loaded here."""
    env = {
        "kvlens_version": __version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": psutil.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "load_average": list(psutil.getloadavg()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if model is not None:
        env.update(
            model=model.spec,
            shape=model.shape(),
            device=str(model.device),
            dtype=str(model.dtype).removeprefix("torch."),
        )
        if model.device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(model.device)
            env["cuda"] = torch.version.cuda
    return env


def save_results(result: dict, rows: list[dict], fig, out_dir: str | Path, stem: str) -> list[Path]:
    """Write `{stem}.json` (the whole result), `{stem}.csv` (`rows`) and `{stem}.png` (`fig`, if given: plotly
    is imported only then)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.csv"]
    paths[0].write_text(json.dumps(result, indent=1, default=str))
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(next(iter(rows), {})))
        writer.writeheader()
        writer.writerows(rows)
    if fig is not None:
        from kvlens.figures.export import image_bytes

        paths.append(out / f"{stem}.png")
        paths[-1].write_bytes(image_bytes(fig, "png"))
    return paths
