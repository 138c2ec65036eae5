"""LeRobotWriter.add_episodes against pyarrow writing the same table in one call.

For each call size (episodes per call x frames per episode) the same episodes go to:

- ``add_episodes``: ``LeRobotWriter.add_episodes`` on a dataset that already holds a few calls,
  which validates and casts the arrays, builds the table with LeRobot's bookkeeping columns,
  writes the data file, rewrites the episodes-metadata file, updates the statistics (exact
  moments and the quantile histogram) and commits ``stats.json``, its state and ``info.json``;
- ``write_table``: ``pq.write_table`` of the very table ``add_episodes`` wrote (read back, not
  timed), with the writer's parquet options (snappy, dictionary encoding on the integer
  bookkeeping columns only), to one file: the floor for writing these bytes;
- ``write_table (defaults)``: the same with pyarrow's default options, which dictionary-encode
  every column, as LeRobot's own writer does.

The features are a typical robot-learning step: ``observation.state`` float32 [32],
``action`` float32 [8], ``next.reward`` float32, ``next.done`` and ``next.truncated`` bool,
plus the five bookkeeping columns (154 bytes a frame uncompressed). Times are medians of
several calls after a warm-up; the implementations alternate call by call so that drift in
the machine's speed hits all alike. Reported per size: ms per call, episodes/s, MB/s
(uncompressed column bytes, 10**6 bytes a MB), the ratio to ``write_table`` (the target is at
most 1.5) and to ``write_table (defaults)``, and the share of ``add_episodes`` spent on
statistics (the same update run alone).

    python benchmarks/lerobot.py [--quick]

Writes ``benchmarks/results/lerobot.json`` (``"quick": true`` in it after ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxtraj import lerobot_writer
from jaxtraj.lerobot_writer import LeRobotWriter

FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [32], "names": None},
    "action": {"dtype": "float32", "shape": [8], "names": None},
    "next.reward": {"dtype": "float32", "shape": [1], "names": None},
    "next.done": {"dtype": "bool", "shape": [1], "names": None},
    "next.truncated": {"dtype": "bool", "shape": [1], "names": None},
}
# (episodes per call, frames per episode)
SIZES = [(16, 200), (64, 200), (256, 200), (1024, 50)]
QUICK_SIZES = [(16, 200), (64, 200)]
WARMUP_CALLS = 3


def make_episodes(rng: np.random.Generator, num: int, length: int) -> list[dict[str, np.ndarray]]:
    episodes = []
    for _ in range(num):
        done = np.zeros(length, dtype=bool)
        done[-1] = True
        episodes.append(
            {
                "observation.state": rng.standard_normal((length, 32), dtype=np.float32),
                "action": rng.uniform(-1, 1, (length, 8)).astype(np.float32),
                "next.reward": rng.standard_normal(length, dtype=np.float32),
                "next.done": done,
                "next.truncated": np.zeros(length, dtype=bool),
            }
        )
    return episodes


def bench_size(num: int, length: int, repeats: int, workdir: Path) -> dict:
    rng = np.random.default_rng(0)
    batches = [make_episodes(rng, num, length) for _ in range(2)]
    tasks = [f"task {i % 4}" for i in range(num)]
    root = workdir / f"ds-{num}x{length}"
    writer = LeRobotWriter(root, fps=30, features=FEATURES)
    for i in range(WARMUP_CALLS):
        writer.add_episodes(batches[i % 2], tasks)
    last = max(root.glob("data/*/*.parquet"))
    table = pq.read_table(last)
    nbytes = table.nbytes
    frames = num * length

    def run_writer():
        writer.add_episodes(batches[0], tasks)

    def run_table(**options):
        def run():
            pq.write_table(table, workdir / "baseline.parquet", **options)

        return run

    # The statistics update alone, on the columns add_episodes feeds it.
    columns = {
        name: lerobot_writer._to_numpy(table.column(name), spec["shape"][0])
        for name, spec in writer.features.items()
    }

    def run_stats():
        for name, values in columns.items():
            writer._stats[name].merged(values)
        {name: s.to_json() for name, s in writer._stats.items()}

    runs = {
        "add_episodes": run_writer,
        "write_table": run_table(
            compression="snappy", use_dictionary=lerobot_writer._DICTIONARY_COLUMNS
        ),
        "write_table (defaults)": run_table(),
        "statistics": run_stats,
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    file_mb = last.stat().st_size / 1e6
    result = {
        "episodes_per_call": num,
        "frames_per_episode": length,
        "frames_per_call": frames,
        "uncompressed_mb": nbytes / 1e6,
        "file_mb": file_mb,
        "ms": ms,
        "episodes_per_s": {k: num / (v / 1e3) for k, v in ms.items() if k != "statistics"},
        "mb_per_s": {k: nbytes / 1e6 / (v / 1e3) for k, v in ms.items() if k != "statistics"},
        "ratio_to_write_table": ms["add_episodes"] / ms["write_table"],
        "ratio_to_write_table_defaults": ms["add_episodes"] / ms["write_table (defaults)"],
        "statistics_share": ms["statistics"] / ms["add_episodes"],
    }
    shutil.rmtree(root)
    return result


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyarrow": pa.__version__,
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        # Other work on the machine skews the timings, the threaded statistics most of all.
        "load_average_1m": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per size")
    args = parser.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats = args.repeats or (5 if args.quick else 15)

    workdir = Path(tempfile.mkdtemp(prefix="lerobot-bench-"))
    try:
        results = [bench_size(num, length, repeats, workdir) for num, length in sizes]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    out = {
        "benchmark": "lerobot",
        "quick": args.quick,
        "machine": machine_info(),
        "features": FEATURES,
        "repeats": repeats,
        "results": results,
    }
    path = Path(__file__).parent / "results" / "lerobot.json"
    path.write_text(json.dumps(out, indent=2) + "\n")

    m = out["machine"]
    print(f"machine: {m['processor']}, {m['cpu_count']} cpus,", end=" ")
    print(f"numpy {m['numpy']}, pyarrow {m['pyarrow']}")
    header = f"{'call':>12} {'MB':>6} {'add_episodes':>13} {'write_table':>12} {'(defaults)':>11}"
    print(header + f" {'ratio':>6} {'(defaults)':>10} {'ep/s':>8} {'MB/s':>7} {'stats':>6}")
    for r in results:
        ms = r["ms"]
        print(
            f"{r['episodes_per_call']:>5} x {r['frames_per_episode']:<4}"
            f" {r['uncompressed_mb']:6.1f}"
            f" {ms['add_episodes']:10.1f} ms {ms['write_table']:9.1f} ms"
            f" {ms['write_table (defaults)']:8.1f} ms"
            f" {r['ratio_to_write_table']:6.2f} {r['ratio_to_write_table_defaults']:10.2f}"
            f" {r['episodes_per_s']['add_episodes']:8.0f} {r['mb_per_s']['add_episodes']:7.1f}"
            f" {r['statistics_share']:6.0%}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
