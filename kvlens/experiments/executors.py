"""Where a grid's cells run: in this process (the default), in N local worker processes, or on a Ray cluster.

A worker loads the model once (`Job.load`) and then runs cells (`outcome`); each outcome goes
back to the caller, which alone writes the results file (`kvlens.experiments.grid.Results`). The two
engines are the standard library's `ProcessPoolExecutor` and Ray actors (`ray.util.ActorPool`).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from kvlens.errors import KvlensError, one_line


@dataclass(frozen=True)
class Job:
    """What every worker needs: how to load the model, and the texts that cells name by id."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    texts: tuple[tuple[str, str], ...] = ()

    def load(self):
        from kvlens.engine.models import load_model

        return load_model(
            self.model, device=self.device, dtype=self.dtype, trust_remote_code=self.trust_remote_code
        )


def task(name: str) -> Callable:
    """The function `(model, texts, cell) -> metrics` of a cell's task."""
    if name == "ppl":
        from kvlens.experiments.sweep import ppl_cell

        return ppl_cell
    if name == "needle":
        from kvlens.experiments.bench.needle import needle_cell

        return needle_cell
    if name == "tasks":
        from kvlens.experiments.bench.tasks import tasks_cell

        return tasks_cell
    raise KvlensError(f"Unknown cell task '{name}'.")


def outcome(model, texts: dict[str, str], cell: dict) -> dict:
    """`{"row": metrics}` of one cell, or `{"error": one sentence}` if it failed."""
    try:
        return {"row": task(cell["task"])(model, texts, cell)}
    except KvlensError as err:
        return {"error": str(err)}
    except Exception as err:  # a cell that fails for any reason is recorded and retried next time
        return {"error": one_line(f"{type(err).__name__}: {(str(err).splitlines() or ['no message'])[0]}")}


def in_process(model_loader: Callable, job: Job) -> Callable[[list[dict]], Iterator[tuple[dict, dict]]]:
    """Run cells one after another in this process, on `model_loader()` (called once, if any cell is left)."""

    def outcomes(cells):
        model, texts = model_loader() if cells else None, dict(job.texts)
        for cell in cells:
            yield cell, outcome(model, texts, cell)

    return outcomes


_worker: dict = {}  # a worker process's model and texts


def _start_worker(job: Job, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    _worker.update(model=job.load(), texts=dict(job.texts))


def _run_in_worker(cell: dict) -> dict:
    result = outcome(_worker["model"], _worker["texts"], cell)
    _give_back_memory()
    return result


def _give_back_memory() -> None:
    """Return a finished cell's freed memory to the system (glibc keeps it for the process otherwise: a task
    cell at 2048 tokens left 3.8 GB resident after it ended, 1.1 GB after this), so that workers side by side
    do not each hold their largest cell's peak."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None  # glibc only
    if trim is not None:
        trim(0)


def processes(job: Job, workers: int) -> Callable[[list[dict]], Iterator[tuple[dict, dict]]]:
    """Run cells on `workers` local processes (spawned, each loading the model once and using its share of the
    CPUs)."""

    def outcomes(cells):
        if not cells:
            return
        threads = max(1, (os.cpu_count() or 1) // workers)
        pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(job, threads),
        )
        try:
            futures = {pool.submit(_run_in_worker, cell): cell for cell in cells}
            for future in as_completed(futures):
                yield futures[future], future.result()
        except BrokenProcessPool:
            raise KvlensError(
                "A worker process died (could it load the model? see its error above)."
            ) from None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    return outcomes


class _RayWorker:
    """A Ray actor: loads the model once, then runs cells."""

    def __init__(self, job: Job, threads: int):
        _start_worker(job, threads)

    def run(self, cell: dict) -> tuple[dict, dict]:
        return cell, _run_in_worker(cell)


def ray_cluster(
    job: Job, workers: int | None, address: str | None, object_store_bytes: int = 100 << 20
) -> Callable[[list[dict]], Iterator[tuple[dict, dict]]]:
    """Run cells on Ray actors: on the cluster at `address`, or on a local Ray started here (and stopped
    after).

    One actor per worker, each holding a GPU when the cluster has GPUs and the device is not `cpu`
    (default: one per GPU, else one per CPU; more actors share them); each loads the model once.
    """

    def outcomes(cells):
        if not cells:
            return
        try:
            import ray
            from ray.util import ActorPool
        except ImportError:
            raise KvlensError("--ray needs Ray: pip install 'kvlens[ray]'.") from None
        if address:
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            except ConnectionError as err:
                reason = str(err).splitlines()[0]
                raise KvlensError(f"Could not reach the Ray cluster at '{address}': {reason}") from None
        else:
            ray.init(
                num_cpus=workers or os.cpu_count(),
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=object_store_bytes,
            )
        try:
            resources = ray.cluster_resources()
            gpus = int(resources.get("GPU", 0)) * (job.device != "cpu")
            cpus = int(resources.get("CPU", 1))
            n = workers or gpus or cpus
            # more actors than GPUs (or CPUs) share them, rather than waiting for a free one forever
            share = (
                {"num_gpus": min(1.0, gpus / n), "num_cpus": 0} if gpus else {"num_cpus": min(1.0, cpus / n)}
            )
            actor = ray.remote(**share)(_RayWorker)
            pool = ActorPool([actor.remote(job, 1) for _ in range(n)])
            yield from pool.map_unordered(lambda a, cell: a.run.remote(cell), cells)
        except ray.exceptions.RayActorError as err:
            raise KvlensError(
                f"A Ray worker died (could it load model '{job.model}'?): {str(err).splitlines()[0]}"
            ) from None
        finally:
            ray.shutdown()

    return outcomes


def executor(model_loader: Callable, job: Job, workers: int | None, ray: str | None):
    """The executor one flag chose: Ray (`ray` is an address, or "" for a local cluster), `workers`
    local processes, or this process (`model_loader()` gives the model)."""
    if workers is not None and workers < 1:
        raise KvlensError(f"--workers must be at least 1; got {workers}.")
    if ray is not None:
        return ray_cluster(job, workers, ray or None)
    if workers:
        return processes(job, workers)
    return in_process(model_loader, job)
