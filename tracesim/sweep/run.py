"""Running a sweep: plan, skip finished tasks, execute on a backend, publish the results
dataset (parts + manifest), summarize."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tracesim.atomic import (
    DirLock,
    atomic_write_text,
    check_file_targets,
    remove_stale_tmp,
)
from tracesim.digests import prereg_record
from tracesim.errors import UsageError
from tracesim.sweep.backends import BACKENDS, Events, run_dask, run_local
from tracesim.sweep.compact import SUMMARY_FILE, tasks_digest, write_json
from tracesim.sweep.dataset import MANIFEST_FILE, PARTS_DIR, write_dataset
from tracesim.sweep.spec import SpecError, SweepSpec, load_spec, parse_spec
from tracesim.sweep.tasks import TaskPlan, plan_tasks, task_file_ok
from tracesim.sweep.worker import write_configs

__all__ = ["SweepSummary", "default_workers", "resolve_spec", "run_sweep"]


@dataclass
class SweepSummary:
    """What a sweep run did (also written to ``results/summary.json``).

    Attributes
    ----------
    complete : bool
        Every task finished and the dataset ``results/`` (parts and ``manifest.json``,
        :mod:`tracesim.sweep.dataset`) holds all their rows.
    tasks : dict
        ``total``, ``done`` (run now), ``skipped`` (finished before), ``failed``,
        ``retries``.
    task_time_s : dict
        Sums over the tasks run now of their ``wall`` and process ``cpu`` seconds on the
        workers (``cpu`` well below ``wall`` means the workers did not get their cores).
    """

    name: str
    output: str
    results: str | None
    spec_hash: str
    tasks_digest: str
    version: str
    complete: bool
    tasks: dict[str, int]
    n_rows: int
    n_configs: int
    seeds: list[int]
    record: str
    wall_time_s: float
    backend: str
    workers: int
    threads_per_worker: int
    stores: list[dict[str, str]]
    prereg: dict[str, str] | None
    task_time_s: dict[str, float] = field(default_factory=dict)
    failures: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    created: str = ""
    #: ``manifest.json``, its sha256, and the configuration ids (absent: incomplete sweep)
    results_file: str | None = None
    results_sha256: str | None = None
    config_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_spec(spec_or_path: SweepSpec | Mapping | str | os.PathLike,
                 out: str | os.PathLike | None = None) -> SweepSpec:
    """A :class:`SweepSpec` from a spec object, a mapping or a YAML path (``out`` overrides)."""
    if isinstance(spec_or_path, SweepSpec):
        if out is None:
            return spec_or_path
        return parse_spec(spec_or_path.raw, source=spec_or_path.source,
                          base_dir=(Path(spec_or_path.source).parent
                                    if spec_or_path.source != "<dict>" else None), output=out)
    if isinstance(spec_or_path, Mapping):
        return parse_spec(spec_or_path, output=out)
    return load_spec(spec_or_path, output=out)


def default_workers(n_tasks: int | None = None) -> int:
    """One worker per available core (at most one per task)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = max(1, int(cores or 1))
    return max(1, min(n, n_tasks)) if n_tasks else n


def _threads(workers: int, threads: int | None) -> int:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads_per_worker = {threads}: expected >= 1")
        return int(threads)
    # One worker = one core: a second numba thread per worker only adds parallel-region
    # overhead and idle time at the end of each layer, and makes --workers 1 use two cores.
    return 1


def _prepare(spec: SweepSpec, plan: TaskPlan, out_dir: Path) -> None:
    (out_dir / "tasks").mkdir(parents=True, exist_ok=True)
    # The output lock is held: temporary files left here belong to killed runs.
    remove_stale_tmp(out_dir / "tasks", recursive=True)
    remove_stale_tmp(out_dir / "results")
    remove_stale_tmp(out_dir)
    write_configs(out_dir, plan, spec)
    write_json(out_dir / "spec.json", {"source": spec.source, "spec": spec.raw,
                                       "spec_hash": plan.spec_hash})
    atomic_write_text(out_dir / "spec.yaml", yaml.safe_dump(spec.raw, sort_keys=False))


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="task", desc="sweep", disable=not enabled,
                dynamic_ncols=True, smoothing=0.1)


def run_sweep(spec_or_path: SweepSpec | Mapping | str | os.PathLike, *,
              backend: str = "local", workers: int | None = None,
              threads_per_worker: int | None = None, scheduler: str | None = None,
              out: str | os.PathLike | None = None, progress: bool = True,
              retries: int = 2, warm_up: bool = True) -> SweepSummary:
    """Run (or resume) a sweep and compact its results.

    Parameters
    ----------
    spec_or_path : SweepSpec, mapping or path
        A validated spec, a spec mapping, or a YAML file (see ``docs/sweeps.md``).
    backend : {"local", "dask"}
    workers : int, optional
        Worker processes (default: one per core, at most one per pending task). Ignored with
        ``scheduler``.
    threads_per_worker : int, optional
        numba / BLAS threads per worker (default 1: one worker is one core).
    scheduler : str, optional
        Address of an existing Dask scheduler (implies ``backend="dask"``).
    out : path, optional
        Output directory (overrides the spec's ``output``).
    progress : bool
        tqdm bar of tasks done / failed / remaining, with ETA.
    retries : int
        Resubmissions of a failed task (exception or dead worker) before it counts as failed.

    Returns
    -------
    SweepSummary
    """
    from tracesim.version import __version__

    t0 = time.perf_counter()
    if scheduler is not None:
        backend = "dask"
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r}: expected one of {BACKENDS}")
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
        raise ValueError(f"retries = {retries!r}: expected an int in [0, 100]")
    for name, value in (("workers", workers), ("threads_per_worker", threads_per_worker)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= 1024):
            raise ValueError(f"{name} = {value!r}: expected an int in [1, 1024]")
    spec = resolve_spec(spec_or_path, out)
    if spec.output is None:
        raise SpecError(f"{spec.source}: output: missing; give 'output: DIR' in the spec or "
                        "--out DIR")
    out_dir = spec.output
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecError(f"{spec.source}: output: {out_dir} is not a directory, expected a "
                        "directory (or a path that can be created)")
    # hashed before any work: an unreadable prereg (a FIFO, a /proc file) fails at once
    prereg_doc = prereg_record(spec.prereg, spec.source)
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = DirLock(out_dir, "sweep")
    try:
        # a file in the way of the results directory is refused before hours of tasks
        if (out_dir / "results").is_symlink() or (
                (out_dir / "results").exists() and not (out_dir / "results").is_dir()):
            raise UsageError(f"{out_dir / 'results'}: is not a directory, expected the "
                             "sweep's results directory (or nothing)")
        check_file_targets(out_dir / "results", [MANIFEST_FILE, "summary.json"])
        plan = plan_tasks(spec)
        _prepare(spec, plan, out_dir)
        pending = [t for t in plan.tasks if not task_file_ok(out_dir, t)]
        n_workers = workers or default_workers(len(pending))
        threads = _threads(n_workers, threads_per_worker)
        skipped = len(plan.tasks) - len(pending)
        counts = {"total": len(plan.tasks), "done": 0, "skipped": skipped, "failed": 0,
                  "retries": 0}
        failures: list[dict[str, str]] = []
        busy = {"wall": 0.0, "cpu": 0.0}
        notes: list[str] = [f"skipped grid combinations: {s}" for s in spec.skipped]
        bar = _progress(len(plan.tasks), skipped, progress)

        def post() -> None:
            left = len(plan.tasks) - counts["done"] - counts["skipped"] - counts["failed"]
            bar.set_postfix(done=counts["done"], failed=counts["failed"],
                            retried=counts["retries"], left=left, refresh=False)

        def done(task, info) -> None:
            counts["done"] += 1
            busy["wall"] += float(info.get("seconds", 0.0))
            busy["cpu"] += float(info.get("cpu_s", 0.0))
            post()
            bar.update(1)

        def retry(task, exc) -> None:
            counts["retries"] += 1
            post()
            bar.refresh()

        def failed(task, exc) -> None:
            counts["failed"] += 1
            failures.append({"task": task.path, "error": f"{type(exc).__name__}: {exc}"})
            post()
            bar.update(1)

        events = Events(done=done, retry=retry, failed=failed)
        post()
        try:
            if pending and backend == "local":
                report = run_local(pending, str(out_dir), plan.spec_hash, events,
                                   workers=n_workers, threads=threads, retries=retries,
                                   warm=warm_up)
            elif pending:
                report = run_dask(pending, str(out_dir), plan.spec_hash, events,
                                  workers=n_workers, threads=threads, retries=retries,
                                  scheduler=scheduler, warm=warm_up)
            else:
                report = None
        finally:
            bar.close()
        if report is not None:
            notes += report.notes
            n_workers, threads = report.workers, report.threads_per_worker
        results = out_dir / "results"
        digest = tasks_digest(plan.tasks)
        complete = counts["failed"] == 0
        n_rows = sum(t.rows for t in plan.tasks) if complete else 0
        if not complete:
            # the dataset of an earlier plan must not pass for this run's results
            (results / MANIFEST_FILE).unlink(missing_ok=True)
            (results / "results.parquet").unlink(missing_ok=True)
            shutil.rmtree(results / PARTS_DIR, ignore_errors=True)

        def make_summary(record: dict[str, Any]) -> SweepSummary:
            record = dict(record)
            rows = record.pop("n_rows", n_rows)
            return SweepSummary(
                name=spec.name, output=str(out_dir), results=str(results) if complete else None,
                spec_hash=plan.spec_hash, tasks_digest=digest, version=__version__,
                complete=complete, tasks=counts, n_rows=rows, n_configs=len(spec.policies),
                seeds=list(spec.seeds), record=spec.record,
                wall_time_s=round(time.perf_counter() - t0, 3), backend=backend,
                workers=n_workers, threads_per_worker=threads,
                stores=[{"name": s.name, "path": str(s.path)} for s in spec.stores],
                prereg=prereg_doc,
                task_time_s={k: round(v, 3) for k, v in busy.items()},
                failures=failures, notes=notes,
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), **record)

        ids = [p.id for p in spec.policies]
        if complete and (counts["done"] or not ((results / MANIFEST_FILE).is_file()
                                                and _same_results(out_dir, plan, digest))):
            # parts, manifest and summary (with the manifest's sha256) swapped in as one unit
            made: list[SweepSummary] = []

            def summary_doc(record: dict[str, Any]) -> dict[str, Any]:
                made.append(make_summary(record))
                return made[-1].to_dict()

            write_dataset(out_dir, plan.tasks, [s.name for s in spec.stores], ids,
                          {"spec_hash": plan.spec_hash, "tasks_digest": digest}, summary_doc)
            return made[-1]
        if complete:
            from tracesim.safeio import read_json

            old = read_json(out_dir / SUMMARY_FILE, "sweep summary")
            record = {k: old.get(k) for k in ("results_file", "results_sha256", "n_rows",
                                              "config_ids")}
        else:
            record = {}
        summary = make_summary(record)
        write_json(out_dir / SUMMARY_FILE, summary.to_dict())
        return summary
    finally:
        lock.release()


def _same_results(out_dir: Path, plan: TaskPlan, digest: str) -> bool:
    """Whether the existing results dataset was published from exactly these task files."""
    from tracesim.safeio import read_json

    try:
        old = read_json(out_dir / SUMMARY_FILE, "sweep summary")
    except (OSError, ValueError):
        return False
    if not isinstance(old, dict):
        return False
    return (old.get("complete") is True and old.get("tasks_digest") == digest
            and old.get("results_file") == MANIFEST_FILE
            and old.get("n_rows") == sum(t.rows for t in plan.tasks))
