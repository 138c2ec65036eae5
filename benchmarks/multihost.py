"""Pipeline flush across 2 processes (jax.distributed on loopback, 4 CPU devices each)
against a single process flushing the same data, in one run.

4 sources x T = 64 chunks x B = 64 environments of the parts of
``benchmarks/collect.py`` without the image. Each process owns 2 sources and inserts
their parts; the flush is one global program over a (sources=2, actor=4) mesh. The
single-process reference flushes all 4 sources on one device in each process.

    python benchmarks/multihost.py [--quick]

Writes ``benchmarks/results/multihost.json`` (from process 0).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def worker(pid: int, port: str, quick: bool, out: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np
    from collect import at_step, examples, machine, make_parts

    import jaxtraj

    T, B, repeats = (16, 16, 2) if quick else (64, 64, 5)
    plan = jaxtraj.TrajectoryPlan(
        num_chunks=T,
        batch_size=B,
        num_env_ranks=4,
        mode="pipeline",
        actor_ranks=4,
        micro_batch_size=512,
    )

    def parts_of(rank, step):
        ps = at_step(make_parts(B, T, image=False, seed=rank), step)
        return [
            p.replace(source=p.source.replace(key=p.source.key.replace(env_rank=rank))) for p in ps
        ]

    pe, ee = examples(parts_of(0, 0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("sources", "actor"))
    mine = [(2 * pid, 0), (2 * pid + 1, 0)]
    multi = jaxtraj.TrajectoryCollector(plan, pe, ee, sources=mine, mesh=mesh, auto_flush=False)
    with jax.default_device(jax.local_devices()[0]):
        single = jaxtraj.TrajectoryCollector(plan, pe, ee, auto_flush=False)
    times = {"multi": [], "single": []}
    for step in range(repeats + 1):
        multi.add_many([p for r, _ in mine for p in parts_of(r, step)])
        with jax.default_device(jax.local_devices()[0]):
            single.add_many([p for r in range(4) for p in parts_of(r, step)])
        for name, c in (("multi", multi), ("single", single)):
            t0 = time.perf_counter()
            items = c.flush(0)
            jax.block_until_ready([mb for _, mb in items])
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
    if pid == 0:
        report = {
            "benchmark": "multihost",
            "machine": machine(),
            "processes": 2,
            "devices": len(jax.devices()),
            "epoch": {"S": 4, "T": T, "B": B},
            "multi_host_flush_ms": med["multi"],
            "single_process_flush_ms": med["single"],
            "ratio": med["multi"] / med["single"],
        }
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
        print(
            f"pipeline flush, 4x{T}x{B}: 2 processes {med['multi']:.1f} ms, one process "
            f"{med['single']:.1f} ms, ratio {report['ratio']:.2f}",
            flush=True,
        )
    jax.distributed.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "multihost.json")
    )
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], args.quick, args.out)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    flags = ["--quick"] if args.quick else []
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(pid), port, "--out", args.out, *flags]
        )
        for pid in range(2)
    ]
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise SystemExit(f"workers exited with {codes}")


if __name__ == "__main__":
    main()
