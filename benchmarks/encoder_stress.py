"""Stress the supervised encoder process: many encodes and remuxes, counted by outcome.

Each round does what ``LeRobotWriter`` does for two cameras (32x32 and 32x48, 10 fps, as in
``tests/test_lerobot_video.py``) over two calls: call 1 (episodes of 5 and 6 frames) is encoded
per camera, then call 2 (40, 4 and 5 frames), then each camera's call-2 file is appended to its
call-1 file (:func:`jaxtraj.lerobot.video.append`, a remux in the encoder process). Every job
goes through :func:`jaxtraj.lerobot.video.encode` / ``append`` with an ``EncoderProcess``, no
retries, and is counted as ``ok`` or by the kind of error it raised.

``--fresh job`` gives every job a new encoder process (the writer's case after a failed
attempt: the retry is the first job of a fresh process); ``--fresh round`` one process per
round (the writer's usual case). ``--fault crash`` makes call 2's first job of each camera
abort its process once its first episode is written and redoes it in a fresh process, as
the writer does (the retry is what is counted). ``--load`` runs busy-loop processes beside
(``--load-procs``, default one: the other core of a 2-core machine).

Before ``jaxtraj.lerobot.video`` put SVT-AV1's packets back in frame order (``_FrameOrder``),
``libsvtav1`` with ``--load busy`` failed 2 of 50 call-2 encodes (``EINVAL`` from the muxer);
``h264``, and either codec without the load, none.

Each configuration (codec x load) runs for ``--seconds`` or ``--rounds``, whichever comes
first; the counts go to stdout and, with ``--json``, to a file. Run::

    python benchmarks/encoder_stress.py [--codec libsvtav1|h264|both] [--load none|busy|both]
        [--fresh job|round] [--fault none|crash] [--seconds S] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("SVT_LOG", "1")

from jaxtraj.lerobot import video  # noqa: E402

FPS = 10
CAMERAS = {"top": (32, 32), "wrist": (32, 48)}
CALLS = ([5, 6], [40, 4, 5])
STEPS = ("encode-1", "encode-2", "remux")
TIMEOUT_S = 20.0  # a legitimate job takes ~20-50 ms; only a stuck one reaches this


def camera(seed: int, length: int, height: int, width: int) -> np.ndarray:
    """The tests' smooth moving pattern, ``[length, height, width, 3]`` uint8."""
    t = np.arange(length, dtype=np.float64)[:, None, None]
    y, x = np.mgrid[:height, :width].astype(np.float64)
    phase = seed * 0.7
    r = 128 + 90 * np.sin((x + 2 * t) / 7.0 + phase)
    g = 128 + 90 * np.cos((y - t) / 9.0 + phase)
    b = np.broadcast_to(40 + 3 * t + 10 * (seed % 7), r.shape)
    return np.stack([r, g, b], -1).clip(0, 255).astype(np.uint8)


def kind(err: BaseException) -> str:
    """An error's kind, for counting."""
    text = str(err)
    if "Errno 22" in text or "Invalid argument" in text:
        return "EINVAL"
    if "no answer within" in text:
        return "timeout"
    if "died" in text:
        return "died"
    if "inconsistent answer" in text:
        return "inconsistent"
    return "other: " + text[-120:]


class Round:
    """One round's jobs, each counted under its step (``encode-1``, ``encode-2``, ``remux``)."""

    def __init__(self, folder: Path, settings: video.VideoSettings, fresh: str, fault: str):
        self.folder, self.settings, self.fresh, self.fault = folder, settings, fresh, fault
        self.encoder = video.EncoderProcess()
        self.processes = 0

    def _job(self, run):
        try:
            return run(self.encoder)
        finally:
            if self.fresh == "job":
                self._replace()

    def _replace(self):
        self.processes += len(self.encoder.pids)
        self.encoder.close()
        self.encoder = video.EncoderProcess()

    def encode(self, name: str, episodes: list[np.ndarray], fault: bool):
        def part(i: int) -> Path:
            return self.folder / f".{name}-{i}.mp4.tmp"

        def run(encoder):
            return video.encode(
                part, episodes, FPS, self.settings, 1e9, encoder=encoder, timeout_s=TIMEOUT_S
            )

        if fault:
            # The writer's case: an attempt dies with its first file half written, the process
            # is replaced and the job sent again; what is counted is that retry.
            os.environ[video.FAULT_ENV] = f"crash:1:{self.folder.name}/.{name}-"
            try:
                self._job(run)
            except RuntimeError:
                pass
            else:
                raise AssertionError("the injected crash did not happen")
            finally:
                del os.environ[video.FAULT_ENV]
            for i in range(len(episodes)):
                part(i).unlink(missing_ok=True)
            self._replace()
        return self._job(run)

    def append(self, current: Path, keep: int, new: Path, out: Path):
        return self._job(
            lambda encoder: video.append(
                current, keep, new, out, FPS, out.name, encoder=encoder, timeout_s=TIMEOUT_S
            )
        )

    def close(self):
        self.processes += len(self.encoder.pids)
        self.encoder.close()


def one_round(folder: Path, settings, fresh, fault, counts, errors, seed) -> None:
    folder.mkdir()
    r = Round(folder, settings, fresh, fault)
    try:
        written: dict[str, list[Path]] = {}
        for c, lengths in enumerate(CALLS):
            for cam, (h, w) in CAMERAS.items():
                episodes = [camera(seed + 10 * c + i, n, h, w) for i, n in enumerate(lengths)]
                step = f"encode-{c + 1}"
                try:
                    paths, _ = r.encode(f"{cam}-{c}", episodes, fault == "crash" and c == 1)
                except RuntimeError as err:
                    counts[step][kind(err)] += 1
                    errors.append(f"{step} {cam}: {err}")
                    return
                counts[step]["ok"] += 1
                written.setdefault(cam, []).append(paths[0])
        for cam, (first, second) in written.items():
            out = folder / f".{cam}-joined.mp4.tmp"
            try:
                r.append(first, sum(CALLS[0]), second, out)
                frames = video.num_frames(out)
                if frames != sum(CALLS[0]) + sum(CALLS[1]):
                    raise RuntimeError(f"appended file has {frames} frames")
            except RuntimeError as err:
                counts["remux"][kind(err)] += 1
                errors.append(f"remux {cam}: {err}")
                return
            counts["remux"]["ok"] += 1
    finally:
        r.close()
        counts["processes"]["started"] += r.processes
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def busy_loops(count: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]


def run_config(codec, load, args, workdir: Path) -> dict:
    settings = video.VideoSettings(codec=codec)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    errors: list[str] = []
    loads = busy_loops(args.load_procs) if load == "busy" else []
    start = time.perf_counter()
    rounds = 0
    try:
        while rounds < args.rounds and time.perf_counter() - start < args.seconds:
            folder = workdir / f"{codec}-{load}-{rounds}"
            one_round(folder, settings, args.fresh, args.fault, counts, errors, seed=rounds)
            rounds += 1
    finally:
        for proc in loads:
            proc.kill()
            proc.wait()
    elapsed = time.perf_counter() - start
    result = {
        "codec": codec,
        "load": load,
        "fresh": args.fresh,
        "fault": args.fault,
        "rounds": rounds,
        "seconds": round(elapsed, 1),
        "counts": {step: dict(c) for step, c in counts.items()},
        "failed_jobs": sum(n for s in STEPS for k, n in counts[s].items() if k != "ok"),
        "errors": errors[:20],
    }
    jobs = sum(counts[s]["ok"] for s in STEPS)
    print(
        f"{codec:9} load={load:4} fresh={args.fresh} fault={args.fault}: {rounds} rounds in "
        f"{elapsed:.0f} s, {jobs} jobs ok, {result['failed_jobs']} failed: "
        + json.dumps(result["counts"]),
        flush=True,
    )
    for line in errors[:5]:
        print("   ", line, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codec", choices=["libsvtav1", "h264", "both"], default="both")
    parser.add_argument("--load", choices=["none", "busy", "both"], default="both")
    parser.add_argument("--load-procs", type=int, default=1)
    parser.add_argument("--fresh", choices=["job", "round"], default="job")
    parser.add_argument("--fault", choices=["none", "crash"], default="none")
    parser.add_argument("--seconds", type=float, default=60.0, help="per configuration")
    parser.add_argument("--rounds", type=int, default=10**9, help="per configuration")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    codecs = ["libsvtav1", "h264"] if args.codec == "both" else [args.codec]
    loads = ["none", "busy"] if args.load == "both" else [args.load]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for codec in codecs:
            for load in loads:
                results.append(run_config(codec, load, args, Path(tmp)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
