"""Run a tracesim sweep on a SLURM cluster through dask-jobqueue (example; not run in tests).

Every job is one SLURM allocation running ``--cores`` Dask worker processes with one task slot
and one numba/BLAS thread each (the layout that scales best for many tasks). The trace store
and the output directory must be on a filesystem that every node sees (workers read the store
and ``OUT/configs.json`` from their paths and write their task files under ``OUT/tasks/``).

Usage, on the login node, inside the project's environment::

    python docs/examples/sweep_slurm.py data/sweeps/example.yaml --jobs 4 --cores 16 \
        --memory 64GB --walltime 02:00:00 --queue cpu --account myproject

Rerun the same command after a time-out or a preemption: finished tasks are skipped.
"""

from __future__ import annotations

import argparse


def main() -> None:
    from dask_jobqueue import SLURMCluster
    from distributed import Client

    from tracesim.sweep import run_sweep

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("--jobs", type=int, default=4, help="SLURM jobs (nodes) to request")
    p.add_argument("--cores", type=int, default=16, help="cores per job = workers per job")
    p.add_argument("--memory", default="64GB", help="memory per job")
    p.add_argument("--walltime", default="02:00:00")
    p.add_argument("--queue", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--venv", default=".venv", help="virtual environment to activate")
    p.add_argument("--out", default=None, help="output directory (shared filesystem)")
    args = p.parse_args()

    threads = 1  # numba / BLAS threads per worker; workers per job = cores / threads
    cluster = SLURMCluster(
        queue=args.queue,
        account=args.account,
        cores=args.cores,
        processes=args.cores // threads,  # one Dask worker process per core, 1 task slot each
        memory=args.memory,
        walltime=args.walltime,
        job_script_prologue=[
            f"source {args.venv}/bin/activate",
            f"export NUMBA_NUM_THREADS={threads} OMP_NUM_THREADS={threads}",
            f"export OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads}",
        ],
    )
    cluster.scale(jobs=args.jobs)
    client = Client(cluster)
    client.wait_for_workers(1)  # tasks start as soon as the first job runs
    try:
        summary = run_sweep(args.spec, scheduler=cluster.scheduler_address,
                            threads_per_worker=threads, out=args.out)
    finally:
        client.close()
        cluster.close()
    print(f"{summary.tasks} -> {summary.results}")


if __name__ == "__main__":
    main()
