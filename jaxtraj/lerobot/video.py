"""Camera frames to mp4 with PyAV, as LeRobot records them, and back.

Encoder settings default to LeRobot's (``VideoEncoderConfig`` in LeRobot 0.6.1): ``libsvtav1``,
``yuv420p``, a keyframe every 2 frames (``g=2``), ``crf=30``, SVT-AV1 preset 12 and
``fast-decode=0``; ``h264`` (libx264) is the other choice. Frame ``k`` of a file has
``pts = k`` in a ``1/fps`` time base, so an episode that starts at frame ``s`` of its file has
``from_timestamp = s / fps``: LeRobot decodes the frame at ``from_timestamp + timestamp``.

Several episodes go into one file, one after another; a file is closed once its size passes the
cap (checked between episodes, as LeRobot does; the frames the encoder still holds are counted
at the mean size of those it has written), and the next episode starts a new file. An episode is
never split across files.

Across calls the writer goes on filling a camera's current file (:func:`append`): the combined
file is written under a new hidden name by remuxing, without re-encoding, the current file's
packets (those before its committed frame count) and then the new call's, their timestamps
shifted to follow on; the writer renames it over the current file when it commits the call. The
file in place is never modified, so a killed writer leaves either the old file or the whole new
one.

The writer encodes in a separate process, one job (one call's frames of one camera) at a time,
under a watchdog (:class:`EncoderProcess`): on this 2-core VM an SVT-AV1 encode occasionally
never returns, and a native call that never returns can only be ended by ending its process.
A job that passes its timeout gets its process killed (the encoder's threads die with it), its
partial files deleted, and is sent again from the frames the parent still holds, to a fresh
process; a job that fails every attempt raises ``RuntimeError`` naming its episodes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

_log = logging.getLogger(__name__)

CODECS = ("libsvtav1", "h264")
# What LeRobot stores as ``video.codec`` (the stream's canonical name), and back.
_CANONICAL = {"libsvtav1": "av1", "h264": "h264"}
_ENCODER = {"av1": "libsvtav1", "libsvtav1": "libsvtav1", "h264": "h264"}
SVTAV1_DEFAULT_PRESET = 12


@dataclass(frozen=True)
class VideoSettings:
    """How camera features are encoded; the defaults are LeRobot's.

    Attributes:
        codec: ``"libsvtav1"`` (AV1, LeRobot's default) or ``"h264"`` (libx264).
        crf: Constant rate factor; lower is better quality and larger files.
        g: GOP size, the keyframe interval in frames (LeRobot seeks to keyframes).
        preset: Speed/quality preset; None is 12 for libsvtav1 and libx264's own default.
        pix_fmt: The stream's pixel format.
        fast_decode: SVT-AV1 fast-decode tuning (0 disables it), h264 ``tune=fastdecode``.
        threads: Threads of one encoder (SVT-AV1 ``lp``, libx264 ``threads``); None lets the
            codec decide (LeRobot's ``encoder_threads``). Not recorded in ``info``.
    """

    codec: str = "libsvtav1"
    crf: int = 30
    g: int = 2
    preset: int | str | None = None
    pix_fmt: str = "yuv420p"
    fast_decode: int = 0
    threads: int | None = None

    def __post_init__(self):
        if self.codec not in CODECS:
            raise ValueError(f"video codec must be one of {CODECS}, got {self.codec!r}")
        if self.pix_fmt != "yuv420p":
            raise ValueError(f"only pix_fmt 'yuv420p' is supported, got {self.pix_fmt!r}")
        for name in ("crf", "g", "fast_decode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"video {name} must be an int >= 0, got {value!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(
                f"encoder threads must be a positive int or None, got {self.threads!r}"
            )
        if self.g < 1:
            raise ValueError(f"video g must be >= 1, got {self.g!r}")
        if self.preset is None and self.codec == "libsvtav1":
            object.__setattr__(self, "preset", SVTAV1_DEFAULT_PRESET)

    def options(self) -> dict[str, str]:
        """The codec options PyAV passes to the encoder (as LeRobot's ``get_codec_options``)."""
        opts = {"g": str(self.g), "crf": str(self.crf)}
        if self.preset is not None:
            opts["preset"] = str(self.preset)
        if self.codec == "libsvtav1":
            params = f"fast-decode={max(0, min(2, self.fast_decode))}"
            opts["svtav1-params"] = params + (f":lp={self.threads}" if self.threads else "")
        else:
            if self.fast_decode:
                opts["tune"] = "fastdecode"
            if self.threads:
                opts["threads"] = str(self.threads)
        return opts

    def info(self, shape: Sequence[int], fps: int) -> dict[str, Any]:
        """A video feature's ``info`` block, with the keys LeRobot's ``get_video_info`` writes."""
        return {
            "video.height": int(shape[0]),
            "video.width": int(shape[1]),
            "video.codec": _CANONICAL[self.codec],
            "video.pix_fmt": self.pix_fmt,
            "video.fps": int(fps),
            "video.channels": int(shape[2]),
            "has_audio": False,
            "video.g": self.g,
            "video.crf": self.crf,
            "video.preset": self.preset,
            "video.fast_decode": self.fast_decode,
            "video.video_backend": "pyav",
            "video.extra_options": {},
            "is_depth_map": False,
        }

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> VideoSettings:
        """The settings a video feature's ``info`` block records."""
        codec = info.get("video.codec")
        if codec not in _ENCODER:
            raise ValueError(f"video codec {codec!r} is not one this writer encodes ({CODECS})")
        kwargs = {"codec": _ENCODER[codec]}
        for key in ("crf", "g", "preset", "pix_fmt", "fast_decode"):
            if info.get(f"video.{key}") is not None:
                kwargs[key] = info[f"video.{key}"]
        return cls(**kwargs)


@dataclass(frozen=True)
class Placed:
    """Where an episode's frames went: file part ``part``, from ``start`` for ``length``."""

    part: int
    start: int
    length: int


def encode(
    part_path: Callable[[int], Path],
    episodes: Sequence[np.ndarray],
    fps: int,
    settings: VideoSettings,
    max_bytes: float,
    first_episode: int = 0,
    *,
    encoder: EncoderProcess | None = None,
    timeout_s: float | None = None,
    retries: int = 0,
    cancelled: Callable[[], bool] | None = None,
) -> tuple[list[Path], list[Placed]]:
    """Encode episodes ``[L, H, W, 3]`` uint8 one after another into mp4 files.

    Args:
        part_path: The path to write file part ``i`` to (a temporary name: its suffix is not
            ``.mp4``, so the container format is given explicitly).
        episodes: Each episode's frames.
        fps: Frames per second.
        settings: The encoder settings.
        max_bytes: A file is closed after the episode that takes it past this size.
        first_episode: The first episode's index, for error messages.
        encoder: Encode in this supervised process (the writer's way); None encodes in this
            process, without a watchdog (the calling thread's scheduling policy is put back
            afterwards: SVT-AV1 makes it ``SCHED_FIFO`` 99 where it may).
        timeout_s: With ``encoder``: the watchdog of one attempt, in seconds; None is
            :func:`default_timeout`.
        retries: With ``encoder``: attempts after the first one that failed (timed out, the
            process died, or the encoder raised); each starts from the frames again.
        cancelled: With ``encoder``: checked before each attempt; once true, no more attempts.

    Returns:
        The files written, and per episode where its frames are.

    Raises:
        RuntimeError: naming the episode being encoded when the encoder failed (with
            ``encoder``: the job's episodes, and why each attempt failed); no file is left.
    """
    # SVT-AV1 prints its configuration to stderr for every stream; errors only, unless the
    # user chose a level (the encoder process inherits this).
    os.environ.setdefault("SVT_LOG", "1")
    if encoder is None:
        import av

        with _ONE_ENCODER, _same_scheduling():
            return _encode(av, part_path, episodes, fps, settings, max_bytes, first_episode)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    for frames in episodes:
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4:
            raise ValueError("episodes must be uint8 arrays [L, H, W, C]")
    timeout = default_timeout(episodes) if timeout_s is None else float(timeout_s)
    # An episode is never split, so there are at most as many parts as episodes.
    paths = [part_path(i) for i in range(len(episodes))]
    job = {
        "paths": [str(path) for path in paths],
        "shapes": [tuple(frames.shape) for frames in episodes],
        "fps": int(fps),
        "settings": {
            name: getattr(settings, name)
            for name in ("codec", "crf", "g", "preset", "pix_fmt", "fast_decode", "threads")
        },
        "max_bytes": float(max_bytes),
        "first_episode": int(first_episode),
        "fault": os.environ.get(FAULT_ENV),
    }
    return _run_job(
        encoder,
        job,
        episodes,
        paths,
        timeout,
        retries,
        cancelled,
        _episodes_name(first_episode, len(episodes)),
    )


def _run_job(encoder, job, episodes, paths, timeout, retries, cancelled, name):
    """Attempts at one job in the encoder process, each under the watchdog; see ``encode``."""
    failures: list[str] = []
    with _ONE_ENCODER:
        for attempt in range(retries + 1):
            if cancelled is not None and cancelled():
                failures.append("no further attempt: cancelled")
                break
            try:
                answer = encoder.run({**job, "attempt": attempt}, episodes, timeout)
                result = _check_answer(answer, paths, episodes)
            except EncoderFailed as err:
                failures.append(f"attempt {attempt + 1}: {err}")
                if attempt < retries:
                    _log.warning(
                        "%s: encoding attempt %d of %d failed, trying again in a fresh encoder "
                        "process: %s",
                        name,
                        attempt + 1,
                        retries + 1,
                        err,
                    )
                # The next attempt gets a fresh process; this one is gone (killed, dead, or
                # ended here), so nothing writes these files any more.
                encoder.close()
                for path in paths:
                    path.unlink(missing_ok=True)
                continue
            return result
    tried = sum(f.startswith("attempt") for f in failures)
    verb = "not appended" if job.get("remux") else "not encoded"
    raise RuntimeError(f"{name}: {verb}, {tried} attempt(s) failed: {'; '.join(failures)}")


def append(
    current: Path,
    keep_frames: int,
    new: Path,
    out: Path,
    fps: int,
    name: str,
    *,
    encoder: EncoderProcess | None = None,
    timeout_s: float | None = None,
    retries: int = 0,
    cancelled: Callable[[], bool] | None = None,
) -> Path:
    """Write ``out``: ``current``'s first ``keep_frames`` frames, then every frame of ``new``.

    Packets are copied, not re-encoded (:func:`remux`); ``new``'s frames follow at
    ``keep_frames``, ``keep_frames + 1``, ... (in ``1/fps`` units). Both files must come from
    the same encoder settings. ``current`` and ``new`` are left as they are.

    Args:
        current: The camera's committed file.
        keep_frames: Its committed frames (a killed writer may have left more).
        new: A call's freshly encoded file (its frames from ``pts = 0``).
        out: Where the combined file is written (a hidden temporary name).
        fps: Frames per second.
        name: What the error message names (the call's episodes).
        encoder, timeout_s, retries, cancelled: As for :func:`encode`; None runs in this
            process. ``timeout_s`` None is 60 s plus 1 ms per frame of the combined file.

    Raises:
        RuntimeError: the remux failed every attempt; ``out`` is not left.
    """
    if encoder is None:
        import av

        remux(av, current, keep_frames, new, out, fps)
        return out
    if timeout_s is None:
        timeout_s = TIMEOUT_FLOOR_S + 0.001 * (keep_frames + num_frames(new))
    job = {
        "remux": [str(current), int(keep_frames), str(new)],
        "paths": [str(out)],
        "shapes": [],
        "fps": int(fps),
        "fault": os.environ.get(FAULT_ENV),
    }
    _run_job(encoder, job, [], [out], float(timeout_s), retries, cancelled, name)
    return out


def remux(av, current: Path, keep_frames: int, new: Path | None, out: Path, fps: int) -> None:
    """Copy ``current``'s packets before frame ``keep_frames``, then ``new``'s, into ``out``.

    The mp4 muxer keeps its own time base (1/10240 at 10 fps, say), so frame counts are turned
    into each input's ticks. A call's file is one encoder session, flushed at its end, and
    sessions follow each other whole: the packets shown before ``keep_frames`` are exactly the
    committed sessions, and they reference no later frame. ``new`` None only truncates.
    """
    try:
        with av.open(str(out), "w", format="mp4") as output:
            with av.open(str(current)) as source:
                stream = source.streams.video[0]
                # opaque: the template's codec parameters (the AV1 sequence header included)
                # are copied as they are, without looking up an encoder for the stream.
                target = output.add_stream_from_template(stream, opaque=True)
                end = int(Fraction(int(keep_frames), int(fps)) / stream.time_base)
                for packet in source.demux(stream):
                    if packet.dts is None or packet.pts is None or packet.pts >= end:
                        continue  # the demuxer's final empty packet; frames past the commit
                    packet.stream = target
                    output.mux(packet)
            if new is not None:
                with av.open(str(new)) as source:
                    stream = source.streams.video[0]
                    shift = int(Fraction(int(keep_frames), int(fps)) / stream.time_base)
                    for packet in source.demux(stream):
                        if packet.dts is None or packet.pts is None:
                            continue
                        packet.pts += shift
                        packet.dts += shift
                        packet.stream = target
                        output.mux(packet)
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def default_timeout(episodes: Sequence[np.ndarray]) -> float:
    """The watchdog of one encode attempt when none is given, in seconds.

    Generous: 10 ms a frame (more for frames over 100,000 pixels, in proportion), at least
    60 s. The 2-core VM encodes 96x96 frames at about 0.3 ms each and 224x224 at about 0.8 ms.
    """
    frames = sum(len(e) for e in episodes)
    height, width = episodes[0].shape[1:3] if episodes else (0, 0)
    per_frame = TIMEOUT_PER_FRAME_S * max(1.0, height * width / 100_000)
    return max(TIMEOUT_FLOOR_S, frames * per_frame)


TIMEOUT_FLOOR_S = 60.0
TIMEOUT_PER_FRAME_S = 0.01


def _episodes_name(first: int, count: int) -> str:
    return f"episode {first}" if count == 1 else f"episodes {first} to {first + count - 1}"


def _check_answer(answer, paths: list[Path], episodes: Sequence[np.ndarray]):
    """The encoder process's answer as ``encode`` returns it; raises ``EncoderFailed``."""
    if answer[0] == "error":
        raise EncoderFailed(answer[1])
    _, written, placed = answer
    written = [Path(p) for p in written]
    placed = [Placed(*p) for p in placed]
    # Only whole answers count: every episode placed, in files this job named, all there.
    if (
        [p.length for p in placed] != [len(e) for e in episodes]
        or written != paths[: len(written)]
        or any(p.part >= len(written) for p in placed)
        or not all(path.is_file() for path in written)
    ):
        raise EncoderFailed("the encoder process gave an inconsistent answer")
    return written, placed


# Encoders run one at a time in a process: in stress runs with two SVT-AV1 encoders at once
# (PyAV 18.1, 224x224) an encode intermittently hung or had a packet refused by the muxer
# (EINVAL; likely the out-of-order packets that ``_FrameOrder`` now puts back in order, not
# checked with two encoders). One SVT-AV1 stream already spreads over the cores; the pool
# still overlaps encoding with PNGs, parquet and statistics, and with collection. The lock
# also serialises the jobs of every writer's encoder process.
_ONE_ENCODER = threading.Lock()


class _FrameOrder:
    """An AV1 stream's packets, handed on in frame order.

    SVT-AV1 (PyAV 18.1's, ``g=2``, its threads at normal priority, the CPU contended) now and
    then hands out one frame's packet early: frame ``k + 25``'s in frame ``k``'s place, and
    frame ``k``'s in frame ``k + 25``'s. Each packet's bytes and timestamps are those of an
    encode in order; only the order is wrong, and the mp4 muxer refuses the late one ("non
    monotonically increasing dts", ``EINVAL``). On the 2-core VM with a busy process beside
    it: 21 of 2958 encodes of 49 frames in one process, 2 of 50 in fresh encoder processes
    (``benchmarks/encoder_stress.py``); none seen without the load. An AV1 stream is decoded
    in presentation order (one shown frame per temporal unit), so holding a packet back until
    the frames before it have come restores exactly the encoder's stream. The frames' ``pts``
    are ``0, 1, ...`` in the codec's ``1/fps`` time base.
    """

    def __init__(self):
        self._next = 0
        self._held: dict[int, Any] = {}

    def __call__(self, packet) -> list:
        """The packets that can be muxed now that ``packet`` came, in order."""
        self._held[int(packet.pts)] = packet
        ready = []
        while self._next in self._held:
            ready.append(self._held.pop(self._next))
            self._next += 1
        return ready

    @property
    def done(self) -> int:
        """How many frames' packets have been handed on: every one before the first missing."""
        return self._next


def _encode(av, part_path, episodes, fps, settings, max_bytes, first_episode, on_episode=None):
    paths: list[Path] = []
    placed: list[Placed] = []
    container = stream = order = None
    count = written = packets = 0
    height, width = episodes[0].shape[1:3]

    def mux(packet):
        # libx264's packets come in dts order (not pts order: B-frames); AV1's may not.
        for ready in (packet,) if order is None else order(packet):
            container.mux(ready)

    def close():
        for packet in stream.encode():
            mux(packet)
        if order is not None and order.done != count:
            raise RuntimeError(f"the encoder gave no packet for frame {order.done} of {count}")
        container.close()

    try:
        for i, frames in enumerate(episodes):
            # The encoder holds back a few frames (its lookahead): count them at the mean
            # size of those already out.
            held = count - packets
            if container is not None and written + held * written / max(packets, 1) >= max_bytes:
                try:
                    close()
                except Exception as err:
                    raise RuntimeError(
                        f"episode {first_episode + i - 1}: encoding failed: {err}"
                    ) from err
                container = None
            if container is None:
                paths.append(part_path(len(paths)))
                container = av.open(str(paths[-1]), "w", format="mp4")
                stream = container.add_stream(settings.codec, fps, options=settings.options())
                stream.pix_fmt = settings.pix_fmt
                stream.width, stream.height = int(width), int(height)
                stream.time_base = Fraction(1, fps)
                order = _FrameOrder() if settings.codec == "libsvtav1" else None
                count = written = packets = 0
            placed.append(Placed(len(paths) - 1, count, len(frames)))
            if on_episode is not None:
                on_episode(i)
            try:
                for frame in frames:
                    vf = av.VideoFrame.from_ndarray(frame, format="rgb24")
                    vf.pts = count
                    count += 1
                    for packet in stream.encode(vf):
                        written += packet.size
                        packets += 1
                        mux(packet)
            except Exception as err:
                raise RuntimeError(f"episode {first_episode + i}: encoding failed: {err}") from err
        if container is not None:
            try:
                close()
            except Exception as err:
                last = first_episode + len(episodes) - 1
                raise RuntimeError(f"episode {last}: encoding failed: {err}") from err
    except BaseException:
        if container is not None:
            try:
                container.close()
            except Exception:
                pass
        for path in paths:
            path.unlink(missing_ok=True)
        raise
    return paths, placed


def num_frames(path: Path) -> int:
    """Frames in an mp4 file, from its stream header (0 if it has no readable video stream)."""
    import av

    with av.open(str(path)) as container:
        streams = container.streams.video
        return int(streams[0].frames) if streams else 0


def decode(path: Path) -> np.ndarray:
    """Every frame of an mp4 file, ``[n, H, W, 3]`` uint8 RGB."""
    import av

    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return np.stack(frames)


# -- the supervised encoder process -----------------------------------------------------------


class EncoderFailed(Exception):
    """One attempt of an encode job failed: timed out, the process died, or the encoder raised."""


class EncoderProcess:
    """A child process that encodes jobs one at a time, watched by a timer in this process.

    The child is a fresh interpreter that runs this file (it imports numpy and PyAV, not jax
    or jaxtraj), started on the first job and again after a failed attempt. A job goes to its
    stdin as a pickled header followed by the frames' raw bytes; the answer comes back on its
    stdout (what the codecs print goes to stderr). The child ends when its stdin closes (this
    object closed or collected, or this process gone) or when it finds its parent changed.

    ``run`` arms a timer of ``timeout_s`` before sending the job; if no answer has come when
    it fires, the child is killed with SIGKILL: the blocking write or read returns, and the
    attempt fails with :class:`EncoderFailed`. A hung native encoder cannot be stopped in any
    other way. Not thread-safe: ``encode`` calls it under a lock.

    Args:
        startup_timeout_s: How long a new child may take to import PyAV and say it is ready.
    """

    def __init__(self, startup_timeout_s: float = 60.0):
        self._startup_timeout_s = float(startup_timeout_s)
        self._proc: subprocess.Popen | None = None
        self._end: weakref.finalize | None = None
        self.pids: list[int] = []  # every child started, in order (for tests and diagnosis)

    @property
    def pid(self) -> int | None:
        """The running child's process id, if one is running."""
        return None if self._proc is None else self._proc.pid

    def run(self, job: dict[str, Any], episodes: Sequence[np.ndarray], timeout_s: float):
        """One attempt at ``job``: the child's answer, or ``EncoderFailed``."""
        if self._proc is not None and self._proc.poll() is not None:
            self._stop()
        if self._proc is None:
            self._start()
        proc = self._proc
        with _Watchdog(proc, timeout_s) as dog:
            try:
                _send(proc.stdin, job)
                for frames in episodes:
                    _write_all(proc.stdin, memoryview(np.ascontiguousarray(frames)).cast("B"))
                answer = _receive(proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as err:
                proc.kill()
                self._stop()
                if dog.fired:
                    raise EncoderFailed(
                        f"no answer within {timeout_s:g} s: the encoder process was killed"
                    ) from None
                raise EncoderFailed(
                    f"the encoder process died (exit status {proc.returncode})"
                    if proc.returncode
                    else f"the encoder process failed: {err!r}"
                ) from None
        return answer

    def close(self) -> None:
        """End the child (it finishes the job it holds, if any); idempotent."""
        self._stop()

    def _start(self) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
        )
        self._proc = proc
        self._end = weakref.finalize(self, _end_process, proc)
        _widen_pipe(proc.stdin)
        self.pids.append(proc.pid)
        with _Watchdog(proc, self._startup_timeout_s) as dog:
            try:
                answer = _receive(proc.stdout)
                if answer != ("ready", proc.pid):
                    raise EOFError(f"unexpected greeting {answer!r}")
            except (OSError, EOFError, pickle.UnpicklingError) as err:
                proc.kill()
                self._stop()
                why = "did not start in time" if dog.fired else f"failed to start: {err!r}"
                raise EncoderFailed(f"the encoder process {why}") from None

    def _stop(self) -> None:
        if self._end is not None:
            self._end()
        self._proc = self._end = None


# A closed writer's encoder process waits here, idle, for the next writer (a new process costs
# about 0.2 s of CPU to import numpy and PyAV), and is ended after SPARE_IDLE_S unused.
SPARE_IDLE_S = 10.0
_spare_lock = threading.Lock()
_spare: tuple[EncoderProcess, threading.Timer] | None = None


def take_encoder() -> EncoderProcess:
    """An encoder process for a writer: the one a closed writer left, or a new one."""
    global _spare
    with _spare_lock:
        if _spare is None:
            return EncoderProcess()
        (encoder, timer), _spare = _spare, None
    timer.cancel()
    return encoder


def give_back(encoder: EncoderProcess) -> None:
    """A closed writer's encoder process: kept for the next writer a while, or ended."""
    global _spare
    if encoder.pid is not None:
        with _spare_lock:
            if _spare is None:
                timer = threading.Timer(SPARE_IDLE_S, _end_spare, args=(encoder,))
                timer.daemon = True
                _spare = (encoder, timer)
                timer.start()
                return
    encoder.close()


def _end_spare(encoder: EncoderProcess) -> None:
    global _spare
    with _spare_lock:
        if _spare is None or _spare[0] is not encoder:
            return  # taken by a writer meanwhile
        _spare = None
    encoder.close()


def _end_process(proc: subprocess.Popen) -> None:
    """Close the child's stdin (it exits), and kill it if it does not within a few seconds."""
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _Watchdog:
    """Kills ``proc`` unless the ``with`` block ends within ``timeout_s``."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float):
        self.fired = False
        self._proc = proc
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        self._proc.kill()

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()


_HEADER = struct.Struct("<Q")
# Run this file in a fresh interpreter, without the current folder on sys.path (so nothing there
# shadows numpy or av), as ``__main__``.
_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"


def _widen_pipe(pipe) -> None:
    """Give the pipe 1 MiB (Linux's default cap) rather than 64 KiB: frames cross it in a
    third of the time, with a sixteenth of the wake-ups."""
    try:
        import fcntl

        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass  # not Linux, or a lower cap: the default size works, more slowly


def _send(pipe, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    _write_all(pipe, memoryview(_HEADER.pack(len(data)) + data))


def _receive(pipe) -> Any:
    (size,) = _HEADER.unpack(_read_exact(pipe, _HEADER.size))
    return pickle.loads(_read_exact(pipe, size))


def _write_all(pipe, data: memoryview) -> None:
    while data:
        sent = pipe.write(data)
        if sent is None:  # pragma: no cover - a blocking pipe never says "would block"
            continue
        data = data[sent:]


def _read_into(pipe, buffer: memoryview) -> None:
    while buffer:
        got = pipe.readinto(buffer)
        if not got:
            raise EOFError("the pipe closed")
        buffer = buffer[got:]


def _read_exact(pipe, size: int) -> bytes:
    data = bytearray(size)
    _read_into(pipe, memoryview(data))
    return bytes(data)


# -- the child's side ---------------------------------------------------------------------------

# Test hook, read when a job is sent and acted on by the child: "<hang|crash>:<attempts>:<text>"
# makes the first <attempts> attempts of every job whose first file path contains <text> hang
# for ever in a native call that holds the GIL (as a stuck encoder would), or abort, when its
# second episode starts: its first episode is encoded, and its file open (or, past the size
# cap, closed and the next one open).
FAULT_ENV = "JAXTRAJ_TEST_ENCODER_FAULT"


def _serve() -> None:
    """The encoder process's loop: a job in, an answer out, until stdin closes."""
    _no_realtime_priority()
    import av

    inp = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the answers
    os.environ.setdefault("SVT_LOG", "1")
    # A Ctrl-C at the terminal is the caller's to handle: the child ends when its stdin closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _send(out, ("ready", os.getpid()))
    buffer = np.empty(0, dtype=np.uint8)
    while True:
        try:
            job = _receive(inp)
            shapes = job["shapes"]
            sizes = [int(np.prod(shape)) for shape in shapes]
            total = sum(sizes)
            # One buffer for every job, its pages mapped once; a new one when it does not fit
            # or is over four times too large.
            if not total <= buffer.size <= 4 * total:
                buffer = np.empty(0, dtype=np.uint8)
                buffer = np.empty(total, dtype=np.uint8)
            frames = buffer[:total]
            _read_into(inp, memoryview(frames))
        except EOFError:
            return
        offsets = np.cumsum([0, *sizes])
        episodes = [
            frames[offsets[i] : offsets[i + 1]].reshape(shape) for i, shape in enumerate(shapes)
        ]
        fault = _fault(job)
        if job.get("remux"):
            current, keep, new = job["remux"]
            try:
                if fault is not None:
                    fault(1)
                remux(av, Path(current), keep, Path(new), Path(job["paths"][0]), job["fps"])
                answer = ("ok", list(job["paths"]), [])
            except Exception as err:
                answer = ("error", f"appending to {current}: {err}")
            _send(out, answer)
            continue
        try:
            paths, placed = _encode(
                av,
                lambda part: Path(job["paths"][part]),
                episodes,
                job["fps"],
                VideoSettings(**job["settings"]),
                job["max_bytes"],
                job["first_episode"],
                fault,
            )
            answer = ("ok", [str(p) for p in paths], [(p.part, p.start, p.length) for p in placed])
        except Exception as err:
            answer = ("error", str(err))
        _send(out, answer)


@contextlib.contextmanager
def _same_scheduling():
    """Put the calling thread's scheduling policy back as it was (Linux)."""
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0)
    except (AttributeError, OSError):
        yield
        return
    try:
        yield
    finally:
        try:
            if (os.sched_getscheduler(0), os.sched_getparam(0)) != before:
                os.sched_setscheduler(0, *before)
        except OSError:
            pass


def _no_realtime_priority() -> None:
    """Keep the encoder's threads at normal priority, as for an unprivileged user.

    SVT-AV1 creates its threads with ``SCHED_FIFO`` priority 99 where it may (root, or
    ``CAP_SYS_NICE``); elsewhere it warns and goes on at normal priority. Real-time threads
    leave normal ones, the caller's training loop included, only what the kernel's real-time
    throttling reserves (5% by default): on the 2-core VM a 5 ms numpy job took a median of
    37-110 ms while such an encoder ran, 6 ms once the encoder lost ``CAP_SYS_NICE``. So this
    process gives up ``CAP_SYS_NICE`` (its ``RLIMIT_RTPRIO``, 0 by default, then applies), and
    any real-time policy it inherited.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        if os.sched_getscheduler(0) not in (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        import ctypes

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inherit")]

        libc = ctypes.CDLL(None, use_errno=True)
        header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
        data = (Data * 2)()
        if libc.capget(ctypes.byref(header), data) != 0:
            return
        cap_sys_nice = 1 << 23  # in the first word
        if data[0].permitted & cap_sys_nice or data[0].effective & cap_sys_nice:
            for name in ("effective", "permitted", "inherit"):
                setattr(data[0], name, getattr(data[0], name) & ~cap_sys_nice)
            libc.capset(ctypes.byref(header), data)
    except (OSError, AttributeError, ValueError):
        pass  # not possible here: the encoder runs as the platform lets it


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _fault(job: dict[str, Any]) -> Callable[[int], None] | None:
    spec = job.get("fault")
    if not spec:
        return None
    kind, attempts, text = spec.split(":", 2)
    if job["attempt"] >= int(attempts) or text not in job["paths"][0]:
        return None
    if kind not in ("hang", "crash"):
        raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r}")

    def fault(episode: int) -> None:
        if episode < 1:
            return
        if kind == "crash":
            os.abort()
        import ctypes

        libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL during the call
        while True:
            libc.pause()

    return fault


if __name__ == "__main__":
    _serve()
