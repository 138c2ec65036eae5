"""Checkpoint and restore of a collector mid-step, against numpy writing and reading the
same bytes (``np.savez`` / ``np.load``), in one run.

The collector holds half a training step of the realistic parts of
``benchmarks/collect.py`` (B = 64 environments, T = 64 chunks: image, state, actions,
log-probabilities, values, tokens, action-level rewards), so partial slots included.

Restore is the whole of ``jaxtraj.checkpoint.restore``: building the fresh collector,
checks and checksums, reading, and the arrays on the device. For reference, orbax's
``StandardCheckpointer`` saving and restoring the same tree (arrays only, into numpy
targets, no collector, no checksums) is timed too when orbax is installed. The calls take
turns, so on a shared machine each meets the same load as its numpy counterpart.

    python benchmarks/checkpoint.py [--quick] [--B 64 --T 64]

Writes ``benchmarks/results/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from collect import examples, machine, make_parts

import jaxtraj
from jaxtraj import TrajectoryPlan, checkpoint


def median_times(fns, repeats):
    """Median seconds of each ``fn(i)``, the first call left out; the functions take
    turns, so on a shared machine each pair meets the same load."""
    times = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn(i)
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts[1:]) for ts in times]


def orbax_calls(tree, root):
    """Save and restore calls of orbax's StandardCheckpointer on ``tree``, or None."""
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        return None
    target = jax.tree.map(lambda x: np.zeros(np.shape(x), x.dtype), tree)

    def save(i):
        with ocp.StandardCheckpointer() as ckpt:  # leaving it waits for the write
            ckpt.save(root / f"orbax{i}", tree)

    def restore(i):
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.restore(root / f"orbax{i}", target)

    return save, restore


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "checkpoint.json")
    )
    parser.add_argument("--B", type=int, default=None, help="environments; default 64 (--quick: 16)")
    parser.add_argument("--T", type=int, default=None, help="chunks; default 64 (--quick: 16)")
    args = parser.parse_args()
    B, T = (16, 16) if args.quick else (64, 64)
    B, T = args.B or B, args.T or T
    parts = make_parts(B, T)
    plan = TrajectoryPlan(num_chunks=T, batch_size=B)
    c = jaxtraj.TrajectoryCollector(plan, *examples(parts))
    c.add_many(parts[: len(parts) // 2])
    tree = c.state_dict()
    arrays = [np.asarray(x) for x in jax.tree.leaves(tree)]
    nbytes = sum(a.nbytes for a in arrays)
    root = Path(tempfile.mkdtemp(dir=os.environ.get("JAXTRAJ_BENCH_DIR")))
    try:

        def restore(i):
            collector = checkpoint.restore(root / f"ck{i}", plan, *examples(parts))
            jax.block_until_ready(collector.states)

        def np_load(i):
            with np.load(root / f"np{i}.npz") as f:
                [f[k] for k in f.files]

        orbax = orbax_calls(tree, root) or ()
        save_s, np_save_s, *orbax_save = median_times(
            [
                lambda i: checkpoint.save(c, root / f"ck{i}"),
                lambda i: np.savez(root / f"np{i}.npz", *arrays),
                *orbax[:1],
            ],
            args.repeats,
        )
        restore_s, np_load_s, *orbax_restore = median_times(
            [restore, np_load, *orbax[1:]], args.repeats
        )
    finally:
        shutil.rmtree(root)
    report = {
        "benchmark": "checkpoint",
        "machine": machine(),
        "B": B,
        "T": T,
        "bytes": nbytes,
        "save_ms": save_s * 1e3,
        "restore_ms": restore_s * 1e3,
        "numpy_save_ms": np_save_s * 1e3,
        "numpy_load_ms": np_load_s * 1e3,
        "save_x_numpy": save_s / np_save_s,
        "restore_x_numpy": restore_s / np_load_s,
        "checkpoint_format": checkpoint.FORMAT,
    }
    if orbax:
        report.update(
            orbax_save_ms=orbax_save[0] * 1e3,
            orbax_restore_ms=orbax_restore[0] * 1e3,
            orbax_restore_x_numpy=orbax_restore[0] / np_load_s,
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"checkpoint of {nbytes / 2**20:.1f} MiB: save {save_s * 1e3:.1f} ms "
        f"({report['save_x_numpy']:.2f}x np.savez {np_save_s * 1e3:.1f} ms), restore "
        f"{restore_s * 1e3:.1f} ms ({report['restore_x_numpy']:.2f}x np.load {np_load_s * 1e3:.1f} ms)"
    )
    if orbax:
        print(
            f"orbax StandardCheckpointer, arrays only: save {orbax_save[0] * 1e3:.1f} ms, "
            f"restore {orbax_restore[0] * 1e3:.1f} ms "
            f"({report['orbax_restore_x_numpy']:.2f}x np.load)"
        )


if __name__ == "__main__":
    main()
