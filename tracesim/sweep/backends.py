"""Execution backends: a local process pool (default) and Dask distributed.

Neither is a scheduler of ours. ``local`` is a :class:`concurrent.futures.ProcessPoolExecutor`
(spawn context) with at most one task in flight per worker, so a worker that dies (killed, out
of memory) costs exactly the task it was running: the pool is rebuilt and that task is
resubmitted, up to ``retries`` times. ``dask`` submits every task to a ``distributed`` cluster
(a :class:`distributed.LocalCluster`, or an existing one by address), whose scheduler reruns
tasks of dead workers itself; ``retries`` covers exceptions.

Both set numba / BLAS threads explicitly per worker and warm the JIT up once per worker (the
local pool's initializer; a Dask :class:`~distributed.WorkerPlugin`). Workers of the local pool
and of a LocalCluster exit within about a second when the driver dies, even by ``kill -9``
(:mod:`tracesim.orphans`).
"""

from __future__ import annotations

import logging
import multiprocessing
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from tracesim.sweep.tasks import Task
from tracesim.sweep.worker import execute_task, init_worker

__all__ = ["BACKENDS", "BackendReport", "Events", "run_dask", "run_local"]

BACKENDS = ("local", "dask")


@dataclass
class Events:
    """Callbacks the driver passes to a backend (progress bar, bookkeeping)."""

    done: Callable[[Task, dict[str, Any]], None]
    retry: Callable[[Task, BaseException], None]
    failed: Callable[[Task, BaseException], None]


@dataclass
class BackendReport:
    """What a backend ran: description and worker set-up figures."""

    description: str
    workers: int
    threads_per_worker: int
    notes: list[str] = field(default_factory=list)


def _context() -> multiprocessing.context.BaseContext:
    """forkserver (workers fork from a server that imported tracesim once), else spawn.

    Never plain fork: the driver may hold threads (numba's OpenMP pool, tqdm, Dask).
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tracesim.sweep.worker", "tracesim.replay"])
        return ctx
    return multiprocessing.get_context("spawn")


def driver_identity() -> tuple[int, str | None]:
    """This process's pid and start time: what workers watch (:mod:`tracesim.orphans`)."""
    import os

    from tracesim.orphans import process_start

    return os.getpid(), process_start(os.getpid())


def make_pool(workers: int, threads: int, warm: bool = True) -> ProcessPoolExecutor:
    """The local backend's pool: forkserver (else spawn) workers that set their threads, warm
    the JIT up and exit when this driver dies."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=_context(),
                               initializer=init_worker,
                               initargs=(threads, warm, driver_identity()))


def run_local(tasks: Sequence[Task], out_dir: str, spec_hash: str, events: Events, *,
              workers: int, threads: int, retries: int = 2,
              warm: bool = True) -> BackendReport:
    """Run tasks on a spawn-context process pool of ``workers`` processes.

    Tasks are submitted in the given order (largest first), one in flight per worker. A task
    that raises, or whose worker dies, is resubmitted up to ``retries`` times, then reported
    failed; the others go on.
    """
    queue: deque[Task] = deque(tasks)
    attempts: dict[str, int] = {}
    restarts = 0

    def handle(task: Task, exc: BaseException) -> None:
        attempts[task.key] = attempts.get(task.key, 0) + 1
        if attempts[task.key] <= retries:
            queue.appendleft(task)
            events.retry(task, exc)
        else:
            events.failed(task, exc)

    while queue:
        pool = make_pool(workers, threads, warm)
        inflight: dict[Any, Task] = {}
        broken = False
        try:
            while (queue or inflight) and not broken:
                while queue and len(inflight) < workers:
                    task = queue.popleft()
                    inflight[pool.submit(execute_task, task, out_dir, spec_hash,
                                         threads)] = task
                finished, _ = wait(inflight, return_when=FIRST_COMPLETED)
                for fut in finished:
                    task = inflight.pop(fut)
                    try:
                        events.done(task, fut.result())
                    except BrokenProcessPool as exc:
                        broken = True
                        handle(task, exc)
                    except Exception as exc:
                        handle(task, exc)
            if broken:
                # Every other in-flight task was running on the dead pool: settle them too.
                wait(inflight)
                for fut, task in inflight.items():
                    exc = fut.exception()
                    if exc is None:
                        events.done(task, fut.result())
                    else:
                        handle(task, exc)
                restarts += 1
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    notes = [f"process pool rebuilt {restarts} time(s) after a worker died"] if restarts else []
    return BackendReport(f"local process pool ({workers} x {threads} thread(s), spawn)",
                         workers, threads, notes)


def _plugin_class():
    from distributed import WorkerPlugin

    class SweepWorkerPlugin(WorkerPlugin):
        """Set numba / BLAS threads and warm the JIT up on every (re)started worker.

        The warm-up runs on the worker's task thread (its default executor), so it never
        overlaps a task and leaves the event loop responsive.
        """

        name = "tracesim-sweep"

        def __init__(self, threads: int, warm: bool = True,
                     driver: tuple[int, str | None] | None = None) -> None:
            self.threads = int(threads)
            self.warm = bool(warm)
            self.driver = driver  # a LocalCluster's workers exit with the driver

        async def setup(self, worker: Any) -> None:
            import asyncio

            loop = asyncio.get_running_loop()
            await loop.run_in_executor(worker.executors["default"], init_worker,
                                       self.threads, self.warm, self.driver)

    return SweepWorkerPlugin


def run_dask(tasks: Sequence[Task], out_dir: str, spec_hash: str, events: Events, *,
             workers: int, threads: int, retries: int = 2, scheduler: str | None = None,
             warm: bool = True) -> BackendReport:
    """Run tasks on Dask distributed.

    Parameters
    ----------
    scheduler : str, optional
        Address of an existing scheduler (``tcp://host:8786``); ``workers`` is then ignored.
        Default: a :class:`distributed.LocalCluster` of ``workers`` processes, one task slot
        each, with ``NUMBA_NUM_THREADS`` / BLAS limits of ``threads`` and the workers'
        statistical profiler off.
    """
    from distributed import Client, LocalCluster, as_completed

    env = {name: str(threads) for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS",
                                           "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    cluster = None
    if scheduler is None:
        import dask

        # The workers' statistical profiler costs ~5% of a core for nothing a sweep needs.
        with dask.config.set({"distributed.worker.profile.enabled": False}):
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                   dashboard_address=None, silence_logs=logging.ERROR,
                                   env=env)
        client = Client(cluster)
        where = f"dask LocalCluster ({workers} x {threads} thread(s))"
    else:
        client = Client(scheduler, timeout="10s")
        workers = len(client.nthreads())
        where = f"dask scheduler {scheduler} ({workers} worker(s) now)"
    try:
        # workers of our own LocalCluster watch this driver; a shared scheduler's are not ours
        driver = driver_identity() if cluster is not None else None
        client.register_plugin(_plugin_class()(threads, warm, driver))
        by_key = {}
        futures = []
        for task in tasks:
            fut = client.submit(execute_task, task, out_dir, spec_hash, threads,
                                key=f"tracesim-sweep-{task.key}", pure=False, retries=retries)
            by_key[fut.key] = task
            futures.append(fut)
        for fut in as_completed(futures):
            task = by_key[fut.key]
            if fut.status == "finished":
                events.done(task, fut.result())
            else:
                events.failed(task, fut.exception())
            fut.release()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return BackendReport(where, workers, threads)
