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

Cameras (``--part video``), with LeRobot's encoder settings (libsvtav1, yuv420p, g=2, crf=30,
preset 12) on smooth synthetic frames (a disc moving over a shaded floor):

- ``encode``: frames/s of one stream, ``jaxtraj.lerobot.video.encode`` in this process and in
  the writer's encoder process (frames through a pipe, normal scheduling priority) against the
  floor, a plain single-threaded PyAV loop (``add_stream``, ``VideoFrame.from_ndarray``,
  ``encode``, ``mux``) with the same settings in this process, at 96x96 and 224x224;
- ``streams``: a writer with 1, 2 and 4 video cameras, one call, from ``add_episodes`` to
  ``close()``: aggregate frames/s against the floor run once per stream, one after another
  (the speed-up is what the encoder pool adds on this machine's cores);
- ``export``: the issue's recorder comparison, 20 episodes of 100 frames, 24 floats of state,
  7 of action, with and without one 96x96 video camera, from the first ``add_episodes`` to
  ``close()``; LeRobot's own recorder (0.6.1, ``create``/``add_frame``/``save_episode``/
  ``finalize``) needs Python 3.12 and cannot run here: its figures, measured on this machine,
  are recorded as given (``LEROBOT_RECORDER``);
- ``collect``: a lerobot-mode collector (the point mass of ``examples/export_lerobot.py``, 8
  environments, 8 chunks of 4 actions a step, a 96x96 camera) with the video writer against no
  writer: the training step's flush (the ``add`` that completes the step) and the time the
  encoders need to drain at ``close()``, the versions in alternating rounds (``--rounds``,
  default 3; ``--part collect`` runs this alone); ``add_episodes`` timed per call, and how
  often and how long it blocked on the encoder backlog (``max_pending_mb``: the default 512,
  and 8, about one step's frames, to show the bound at work). The example's ``step_halves``
  carries per-action observations (``EnvPart.action_obs``) with a camera per action, so each
  frame shows its own action's observation: the figures before that change rendered the
  chunk's observation only and are not comparable;
- ``bytes_per_frame``: the export's mp4 bytes against LeRobot's way with the same settings (an
  mp4 per episode, concatenated without re-encoding: the sum of the episodes' files).

    python benchmarks/lerobot.py [--quick] [--part all|parquet|video|collect] [--rounds N]

Writes ``benchmarks/results/lerobot.json`` (``"quick": true`` in it after ``--quick``); a run of
one part keeps the other part's results.
"""

from __future__ import annotations

import argparse
import json
import logging
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

# SVT-AV1 logs its configuration for every stream unless told not to (the writer sets this
# too); set before any encoder starts, so that both sides of a comparison log alike.
os.environ.setdefault("SVT_LOG", "1")

from jaxtraj.lerobot import LeRobotWriter, video  # noqa: E402
from jaxtraj.lerobot.format import DICTIONARY_COLUMNS, to_numpy  # noqa: E402

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
        name: to_numpy(table.column(name), spec["shape"][0])
        for name, spec in writer.features.items()
    }

    def run_stats():
        for name, values in columns.items():
            writer._stats[name].merged(values)
        {name: s.to_json() for name, s in writer._stats.items()}

    runs = {
        "add_episodes": run_writer,
        "write_table": run_table(compression="snappy", use_dictionary=DICTIONARY_COLUMNS),
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


# -- cameras ---------------------------------------------------------------------------------

# LeRobot's recorder on this machine (issue 12): 20 episodes x 100 frames, 24 + 7 floats, with
# and without one 96x96 video camera, default encoder. LeRobot needs Python 3.12: not runnable
# in this process.
LEROBOT_RECORDER = {"vectors_frames_per_s": 895.0, "one_96x96_camera_frames_per_s": 228.0}
EXPORT_FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [24], "names": None},
    "action": {"dtype": "float32", "shape": [7], "names": None},
}


def disc_frames(num: int, size: int, seed: int = 0) -> np.ndarray:
    """``[num, size, size, 3]`` uint8: a soft disc moving over a shaded floor."""
    y, x = np.mgrid[:size, :size].astype(np.float32) / (size - 1)
    t = np.arange(num, dtype=np.float32)[:, None, None] / 50 + seed
    cx, cy = 0.5 + 0.35 * np.cos(t), 0.5 + 0.35 * np.sin(1.3 * t)
    disc = np.clip((0.12 - np.hypot(x - cx, y - cy)) / 0.02, 0, 1)
    floor = 0.3 + 0.3 * x + 0.1 * y
    floor = np.broadcast_to(floor, disc.shape)
    rgb = np.stack([floor * (1 - disc) + disc, floor * (1 - disc) + 0.3 * disc, floor], -1)
    return (rgb * 255).round().astype(np.uint8)


def plain_encode(path: Path, frames: np.ndarray, fps: int, settings: video.VideoSettings) -> None:
    """The floor: one PyAV encode loop in one thread, the writer's settings."""
    import fractions

    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream(settings.codec, fps, options=settings.options())
        stream.pix_fmt = settings.pix_fmt
        stream.height, stream.width = frames.shape[1:3]
        stream.time_base = fractions.Fraction(1, fps)
        for i, frame in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(frame, format="rgb24")
            vf.pts = i
            for packet in stream.encode(vf):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_encode(size: int, num: int, repeats: int, workdir: Path) -> dict:
    """One stream: video.encode here and in the encoder process against the plain loop."""
    settings, frames = video.VideoSettings(), disc_frames(num, size)
    encoder = video.EncoderProcess()
    runs = {
        "plain PyAV loop": lambda: plain_encode(workdir / "plain.mp4", frames, 30, settings),
        "video.encode": lambda: video.encode(
            lambda i: workdir / f".ours-{i}.mp4.tmp", [frames], 30, settings, float("inf")
        ),
        "video.encode, encoder process": lambda: video.encode(
            lambda i: workdir / f".proc-{i}.mp4.tmp",
            [frames],
            30,
            settings,
            float("inf"),
            encoder=encoder,
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for r in range(repeats + 1):  # the first round warms up; the order alternates
            for name in sorted(runs, reverse=bool(r % 2)):
                t = timed(runs[name])
                if r:
                    times[name].append(t)
    finally:
        encoder.close()
    fps = {k: num / statistics.median(v) for k, v in times.items()}
    return {
        "size": size,
        "frames": num,
        "frames_per_s": fps,
        "ratio_to_plain": fps["video.encode"] / fps["plain PyAV loop"],
        "ratio_to_plain_encoder_process": fps["video.encode, encoder process"]
        / fps["plain PyAV loop"],
        "bytes_per_frame": (workdir / "plain.mp4").stat().st_size / num,
    }


def bench_streams(size: int, streams: int, num: int, repeats: int, workdir: Path) -> dict:
    """A writer with ``streams`` video cameras, one call of 4 episodes, add to close."""
    settings = video.VideoSettings()
    lengths = [num // 4] * 4
    cams = [f"observation.images.cam{i}" for i in range(streams)]
    features = {
        **EXPORT_FEATURES,
        **{c: {"dtype": "video", "shape": [size, size, 3], "names": None} for c in cams},
    }
    frames = [disc_frames(n, size, seed=i) for i, n in enumerate(lengths)]
    episodes = [
        {
            "observation.state": np.zeros((n, 24), np.float32),
            "action": np.zeros((n, 7), np.float32),
            **{c: f for c in cams},
        }
        for n, f in zip(lengths, frames)
    ]
    ours, plain = [], []
    for r in range(repeats + 1):
        root = workdir / f"streams-{size}-{streams}-{r}"

        def run():
            with LeRobotWriter(root, fps=30, features=features) as writer:
                writer.add_episodes(episodes, ["task"] * len(episodes))

        t_ours = timed(run)
        t_plain = sum(
            timed(lambda: plain_encode(workdir / "plain.mp4", np.concatenate(frames), 30, settings))
            for _ in range(streams)
        )
        shutil.rmtree(root)
        if r:
            ours.append(t_ours)
            plain.append(t_plain)
    total = streams * sum(lengths)
    return {
        "size": size,
        "streams": streams,
        "frames_per_stream": sum(lengths),
        "frames_per_s": {
            "writer (add_episodes to close)": total / statistics.median(ours),
            "plain PyAV loop, streams one after another": total / statistics.median(plain),
        },
        "speedup": statistics.median(plain) / statistics.median(ours),
    }


def export_episodes(camera: bool, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for e in range(20):
        episode = {
            "observation.state": rng.standard_normal((100, 24), dtype=np.float32),
            "action": rng.standard_normal((100, 7), dtype=np.float32),
        }
        if camera:
            episode["observation.images.top"] = disc_frames(100, 96, seed=e)
        out.append(episode)
    return out


def bench_export(repeats: int, workdir: Path) -> dict:
    """The issue's recorder comparison: 20 x 100 frames in 4 calls, add to close."""
    top = {"observation.images.top": {"dtype": "video", "shape": [96, 96, 3], "names": None}}
    result = {}
    for camera in (False, True):
        episodes = export_episodes(camera)
        features = {**EXPORT_FEATURES, **(top if camera else {})}
        times, sizes = [], []
        for r in range(repeats + 1):
            root = workdir / f"export-{camera}-{r}"

            def run():
                with LeRobotWriter(root, fps=30, features=features) as writer:
                    for call in range(4):
                        writer.add_episodes(episodes[5 * call : 5 * call + 5], ["task"] * 5)

            t = timed(run)
            sizes.append(sum(p.stat().st_size for p in root.glob("videos/*/*/*.mp4")))
            shutil.rmtree(root)
            if r:
                times.append(t)
        name = "one_96x96_camera" if camera else "vectors"
        result[name] = {"frames_per_s": 2000 / statistics.median(times), "video_bytes": sizes[-1]}
    result["lerobot_recorder_frames_per_s"] = LEROBOT_RECORDER
    result["ratio_to_lerobot"] = {
        "vectors": result["vectors"]["frames_per_s"] / LEROBOT_RECORDER["vectors_frames_per_s"],
        "one_96x96_camera": result["one_96x96_camera"]["frames_per_s"]
        / LEROBOT_RECORDER["one_96x96_camera_frames_per_s"],
    }
    # LeRobot's file: an mp4 per episode (same settings), concatenated without re-encoding.
    settings = video.VideoSettings()
    per_episode = 0
    for episode in export_episodes(True):
        plain_encode(workdir / "episode.mp4", episode["observation.images.top"], 30, settings)
        per_episode += (workdir / "episode.mp4").stat().st_size
    result["bytes_per_frame"] = {
        "jaxtraj": result["one_96x96_camera"]["video_bytes"] / 2000,
        "lerobot_way (an mp4 per episode, same settings)": per_episode / 2000,
    }
    return result


def bench_collect(steps: int, workdir: Path, rounds: int = 3) -> dict:
    """The example's collector, camera on, with the video writer against no writer.

    Every version runs ``rounds`` times, alternating (a fresh dataset each time); the flush
    medians are over every timed step of every round. ``add_episodes`` is timed in each call,
    and the writer counts the calls that waited for the encoder backlog (``max_pending_mb``).
    """
    import random
    import sys

    import jax

    # An in-process SVT-AV1 encode makes its thread SCHED_FIFO 99 when run as root (the plain
    # loops above, in this thread): the collector's steps would then outrank every encoder.
    policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
    if policy not in (None, os.SCHED_OTHER):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))

    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    from export_lerobot import OBS, A, K, env_reset, step_halves

    import jaxtraj

    B, T = 8, 8
    plan = jaxtraj.TrajectoryPlan(
        num_chunks=T, batch_size=B, mode="lerobot", lerobot_frame="action", max_episode_length=64
    )
    rng = jax.random.PRNGKey(0)
    params = {
        "w": 0.1 * jax.random.normal(rng, (OBS, K * A)),
        "v": 0.5 * jax.random.normal(jax.random.fold_in(rng, 1), (OBS,)),
    }
    env_state = env_reset(jax.random.fold_in(rng, 2), B)
    flags = (np.zeros((B, K), bool), np.zeros((B, K), bool))
    all_halves = []
    for step in range(steps + 1):
        halves, env_state, flags, rng = step_halves(params, env_state, flags, rng, step=step, T=T)
        if not step:
            examples = halves[:2]  # a policy half and an env half
        random.Random(step).shuffle(halves)
        all_halves.append(halves)
    features = jaxtraj.lerobot.features(plan, *examples)
    result = {"envs": B, "chunks": T, "actions_per_chunk": K, "steps": steps, "rounds": rounds}
    result["caller_policy_reset_from"] = policy
    # A step's frames of the camera: 8 envs x 32 actions x 96x96x3 bytes, about 7 MB.
    writers = {
        "no writer": lambda root: None,
        "video writer": lambda root: LeRobotWriter(root, fps=10, features=features),
        "video writer, encoder_threads=1": lambda root: LeRobotWriter(
            root, fps=10, features=features, encoder_threads=1
        ),
        "video writer, max_pending_mb=8": lambda root: LeRobotWriter(
            root, fps=10, features=features, max_pending_mb=8
        ),
    }
    # The writers are closed without TrajectoryCollector.end(): their warning about the
    # running episodes' frames is expected here.
    logging.getLogger("jaxtraj.lerobot.writer").setLevel(logging.ERROR)
    runs: dict[str, list[dict]] = {name: [] for name in writers}
    for round_ in range(rounds):
        # Alternating rounds, the order rotated each round, so that the machine's drift (other
        # sessions' load) hits every version alike.
        names = list(writers)
        names = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in names:
            root = workdir / f"collect-{round_}-{names.index(name)}-{len(runs[name])}"
            writer = writers[name](root)
            calls: list[float] = []
            if writer is not None:
                add = writer.add_episodes

                def timed_add(episodes, tasks, add=add):
                    start = time.perf_counter()
                    try:
                        return add(episodes, tasks)
                    finally:
                        calls.append(time.perf_counter() - start)

                writer.add_episodes = timed_add
            collector = jaxtraj.TrajectoryCollector(
                plan, *examples, writer=writer, tasks="reach the goal"
            )
            flush, step_times, frames = [], [], 0
            for step, halves in enumerate(all_halves):  # step 0 warms up (compiles)
                start = time.perf_counter()
                for part in halves[:-1]:
                    collector.add(part)
                last = time.perf_counter()
                out = collector.add(halves[-1])
                end = time.perf_counter()
                if step:
                    flush.append(end - last)
                    step_times.append(end - start)
                    frames += sum(len(f["action"]) for _, eps in out for _, f in eps)
            drain = timed(writer.close) if writer is not None else 0.0
            runs[name].append(
                {
                    "flush": flush,
                    "step": step_times,
                    "drain": drain,
                    "frames": frames,
                    "calls": calls,
                    "blocked_calls": writer.blocked_calls if writer is not None else 0,
                    "blocked_s": writer.blocked_s if writer is not None else 0.0,
                }
            )
            del collector
    for name, rs in runs.items():
        flushes = [f for r in rs for f in r["flush"]]
        calls = [c for r in rs for c in r["calls"]]
        result[name] = {
            "flush_ms": 1e3 * statistics.median(flushes),
            "flush_ms_per_round": [1e3 * statistics.median(r["flush"]) for r in rs],
            "flush_ms_p90": 1e3 * float(np.quantile(flushes, 0.9)),
            "step_ms": 1e3 * statistics.median(f for r in rs for f in r["step"]),
            "drain_at_close_ms": 1e3 * statistics.median(r["drain"] for r in rs),
            "frames_written": rs[0]["frames"],
            "add_episodes_calls": len(calls),
            "add_episodes_ms_median": 1e3 * statistics.median(calls) if calls else 0.0,
            "add_episodes_ms_max": 1e3 * max(calls) if calls else 0.0,
            "blocked_calls": sum(r["blocked_calls"] for r in rs),
            "blocked_ms_total": 1e3 * sum(r["blocked_s"] for r in rs),
        }
    result["flush_ratio"] = {
        name: result[name]["flush_ms"] / result["no writer"]["flush_ms"]
        for name in writers
        if name != "no writer"
    }
    result["flush_ratio_per_round"] = {
        name: [
            w / n
            for w, n in zip(
                result[name]["flush_ms_per_round"], result["no writer"]["flush_ms_per_round"]
            )
        ]
        for name in writers
        if name != "no writer"
    }
    return result


def bench_video(quick: bool, repeats: int, workdir: Path) -> dict:
    sizes = [96] if quick else [96, 224]
    return {
        "settings": {"codec": "libsvtav1", "pix_fmt": "yuv420p", "g": 2, "crf": 30, "preset": 12},
        "encode": [bench_encode(s, 1000 if s == 96 else 400, repeats, workdir) for s in sizes],
        "streams": [
            bench_streams(s, n, 400 if s == 96 else 160, repeats, workdir)
            for s in sizes
            for n in ((1, 2) if quick else (1, 2, 4))
        ],
        "export": bench_export(repeats, workdir),
        "collect": bench_collect(3 if quick else 8, workdir),
    }


def print_video(v: dict) -> None:
    for r in v["encode"]:
        f = r["frames_per_s"]
        print(
            f"encode {r['size']}x{r['size']}: video.encode {f['video.encode']:.0f} frames/s"
            f" ({r['ratio_to_plain']:.2f}x), in the encoder process"
            f" {f['video.encode, encoder process']:.0f}"
            f" ({r['ratio_to_plain_encoder_process']:.2f}x), plain PyAV loop"
            f" {f['plain PyAV loop']:.0f}"
        )
    for r in v["streams"]:
        f = r["frames_per_s"]
        print(
            f"{r['streams']} streams {r['size']}x{r['size']}:"
            f" writer {f['writer (add_episodes to close)']:.0f} frames/s, one loop per stream"
            f" {f['plain PyAV loop, streams one after another']:.0f} ({r['speedup']:.2f}x)"
        )
    e = v["export"]
    print(
        f"export 20x100: vectors {e['vectors']['frames_per_s']:.0f} frames/s"
        f" ({e['ratio_to_lerobot']['vectors']:.1f}x LeRobot's recorder), one 96x96 camera"
        f" {e['one_96x96_camera']['frames_per_s']:.0f} frames/s"
        f" ({e['ratio_to_lerobot']['one_96x96_camera']:.1f}x)"
    )
    b = e["bytes_per_frame"]
    print(f"bytes/frame: {b['jaxtraj']:.0f}, LeRobot's way {list(b.values())[1]:.0f}")
    print_collect(v["collect"])


def print_collect(c: dict) -> None:
    print(f"collect flush, medians of {c['rounds']} alternating rounds of {c['steps']} steps:")
    print(f"  no writer {c['no writer']['flush_ms']:.1f} ms")
    for name, ratio in c["flush_ratio"].items():
        r = c[name]
        rounds = ", ".join(f"{x:.2f}x" for x in c["flush_ratio_per_round"][name])
        print(
            f"  {name}: {r['flush_ms']:.1f} ms ({ratio:.2f}x; rounds {rounds}), drain at"
            f" close {r['drain_at_close_ms']:.0f} ms; add_episodes {r['add_episodes_calls']}"
            f" calls, median {r['add_episodes_ms_median']:.1f} ms, max"
            f" {r['add_episodes_ms_max']:.1f} ms, blocked {r['blocked_calls']} times,"
            f" {r['blocked_ms_total']:.0f} ms in all"
        )


def _version(module: str) -> str | None:
    """A module's version, or None where it is not installed (PyAV for --part parquet)."""
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyarrow": pa.__version__,
        "av": _version("av"),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        # Other work on the machine skews the timings, the threaded statistics most of all.
        "load_average_1m": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per size")
    parser.add_argument("--part", choices=["all", "parquet", "video", "collect"], default="all")
    parser.add_argument("--rounds", type=int, default=3, help="collect: alternating rounds")
    args = parser.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats = args.repeats or (5 if args.quick else 15)
    path = Path(__file__).parent / "results" / "lerobot.json"
    out = json.loads(path.read_text()) if path.is_file() else {}

    workdir = Path(tempfile.mkdtemp(prefix="lerobot-bench-"))
    try:
        if args.part in ("all", "parquet"):
            out.update(
                features=FEATURES,
                repeats=repeats,
                results=[bench_size(num, length, repeats, workdir) for num, length in sizes],
            )
        if args.part in ("all", "video"):
            out["video"] = bench_video(args.quick, max(1, repeats // 5), workdir)
        if args.part == "collect":
            out.setdefault("video", {})["collect"] = bench_collect(
                3 if args.quick else 8, workdir, args.rounds
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out.update(benchmark="lerobot", quick=args.quick, machine=machine_info())
    path.write_text(json.dumps(out, indent=2) + "\n")

    m = out["machine"]
    print(f"machine: {m['processor']}, {m['cpu_count']} cpus,", end=" ")
    print(f"numpy {m['numpy']}, pyarrow {m['pyarrow']}, av {m['av']}")
    if args.part in ("all", "parquet"):
        header = (
            f"{'call':>12} {'MB':>6} {'add_episodes':>13} {'write_table':>12} {'(defaults)':>11}"
        )
        print(header + f" {'ratio':>6} {'(defaults)':>10} {'ep/s':>8} {'MB/s':>7} {'stats':>6}")
        for r in out["results"]:
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
    if args.part in ("all", "video"):
        print_video(out["video"])
    if args.part == "collect":
        print_collect(out["video"]["collect"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
