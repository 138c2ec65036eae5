"""LeRobotWriter with cameras: video and image features, read back with pyarrow and PyAV alone.

Frames are small (32x32 and 32x48 video, 16x16 image) smooth synthetic images, so every test encodes in
milliseconds. A decoded video frame must match its original within ``PSNR_DB`` (SVT-AV1 and
libx264 at crf 30 give about 38 dB on these); image features are lossless PNG and match
exactly. Crashes are simulated at every file commit and for real with SIGKILL; a stuck or dying
encoder inside the encoder process (``video.FAULT_ENV``), with a 2 s watchdog. The last test
loads a collector-written dataset with LeRobot itself, skipped where LeRobot is not installed
(see docs/lerobot.md).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtraj.lerobot import LeRobotWriter, files, video
from jaxtraj.lerobot.images import decode_png
from jaxtraj.lerobot.stats import downsample, sample_indices
from jaxtraj.lerobot.writer import LeRobotWriteError

FPS = 10
PSNR_DB = 30.0
TOP, WRIST, SIDE = "observation.images.top", "observation.images.wrist", "observation.images.side"
FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [3], "names": None},
    TOP: {"dtype": "video", "shape": [32, 32, 3], "names": None},
    WRIST: {"dtype": "video", "shape": [32, 48, 3], "names": None},
    SIDE: {"dtype": "image", "shape": [16, 16, 3], "names": None},
}
VIDEO_INFO_KEYS = {
    "video.height",
    "video.width",
    "video.codec",
    "video.pix_fmt",
    "video.fps",
    "video.channels",
    "has_audio",
    "video.g",
    "video.crf",
    "video.preset",
}


def camera(seed: int, length: int, height: int, width: int) -> np.ndarray:
    """A smooth moving pattern, ``[length, height, width, 3]`` uint8, unique per seed."""
    t = np.arange(length, dtype=np.float64)[:, None, None]
    y, x = np.mgrid[:height, :width].astype(np.float64)
    phase = seed * 0.7
    r = 128 + 90 * np.sin((x + 2 * t) / 7.0 + phase)
    g = 128 + 90 * np.cos((y - t) / 9.0 + phase)
    b = np.broadcast_to(40 + 3 * t + 10 * (seed % 7), r.shape)
    return np.stack([r, g, b], -1).clip(0, 255).astype(np.uint8)


def make_episode(seed: int, length: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "observation.state": rng.normal(size=(length, 3)).astype(np.float32),
        TOP: camera(seed, length, 32, 32),
        WRIST: camera(seed + 1000, length, 32, 48),
        SIDE: camera(seed + 2000, length, 16, 16),
    }


def batch(first_seed: int, lengths) -> tuple[list[dict], list[str]]:
    episodes = [make_episode(first_seed + i, n) for i, n in enumerate(lengths)]
    return episodes, [f"task {(first_seed + i) % 2}" for i in range(len(lengths))]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / max(mse, 1e-12)))


def read_episodes(root: Path) -> dict[str, np.ndarray]:
    paths = sorted(root.glob("meta/episodes/*/*.parquet"))
    table = pa.concat_tables([pq.read_table(p) for p in paths], promote_options="default")
    return {name: table.column(name).to_numpy() for name in table.column_names if name != "tasks"}


def check_videos(root: Path, episodes: list[dict], strict: bool = True) -> dict:
    """Every invariant of the committed cameras against the episodes that went in."""
    info = json.loads((root / "meta/info.json").read_text())
    n_ep = info["total_episodes"]
    assert (
        info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    )
    meta = read_episodes(root)
    if strict:
        assert len(meta["episode_index"]) == n_ep
    lengths = meta["length"][:n_ep]
    assert [len(e[TOP]) for e in episodes[:n_ep]] == lengths.tolist()
    fps = info["fps"]
    decoded: dict[Path, np.ndarray] = {}
    for key in (TOP, WRIST):
        spec = info["features"][key]
        assert spec["dtype"] == "video" and spec["names"] == ["height", "width", "channels"]
        assert VIDEO_INFO_KEYS <= set(spec["info"]) and spec["info"]["has_audio"] is False
        assert (spec["info"]["video.height"], spec["info"]["video.width"]) == tuple(
            spec["shape"][:2]
        )
        prefix = f"videos/{key}/"
        previous = None
        for ep in range(n_ep):
            loc = (int(meta[prefix + "chunk_index"][ep]), int(meta[prefix + "file_index"][ep]))
            start, end = meta[prefix + "from_timestamp"][ep], meta[prefix + "to_timestamp"][ep]
            # An episode spans exactly its frames; episodes follow each other within a file.
            assert end - start == pytest.approx(lengths[ep] / fps)
            if previous is not None and previous[0] == loc:
                assert start == pytest.approx(previous[1])
            else:
                assert start == 0.0
            previous = (loc, end)
            path = root / info["video_path"].format(
                video_key=key, chunk_index=loc[0], file_index=loc[1]
            )
            if path not in decoded:
                decoded[path] = video.decode(path)
            frames = decoded[path][round(start * fps) : round(end * fps)]
            assert len(frames) == lengths[ep]
            assert psnr(frames, episodes[ep][key]) >= PSNR_DB, (key, ep)
        for path, frames in decoded.items():
            if key in path.as_posix():
                assert video.num_frames(path) == len(frames)
    # Only committed video files exist once the folder is consistent, none half-written.
    if strict:
        assert {p for p in root.glob("videos/*/*/*.mp4")} == set(decoded)
        assert not [p for p in root.rglob("*") if files.is_tmp(p)]

    data = pa.concat_tables([pq.read_table(p) for p in sorted(root.glob("data/*/*.parquet"))])
    assert TOP not in data.column_names and WRIST not in data.column_names
    assert data.schema.field(SIDE).type == pa.struct(
        [("bytes", pa.binary()), ("path", pa.string())]
    )
    data = data.slice(0, int(lengths.sum()))
    pngs = data.column(SIDE).combine_chunks().field("bytes").to_pylist()
    want = np.concatenate([e[SIDE] for e in episodes[:n_ep]])
    np.testing.assert_array_equal(np.stack([decode_png(p) for p in pngs]), want)
    np.testing.assert_allclose(
        data.column("timestamp").to_numpy(),
        np.concatenate([np.arange(n) / fps for n in lengths]),
        rtol=1e-6,
    )

    if not strict:  # a crash between renames may have published the next call's statistics
        return info
    stats = json.loads((root / "meta/stats.json").read_text())
    for key in (TOP, WRIST, SIDE):
        s = {k: np.asarray(v) for k, v in stats[key].items()}
        for name in ("min", "max", "mean", "std", "q01", "q10", "q50", "q90", "q99"):
            assert s[name].shape == (3, 1, 1), (key, name)
        sampled = np.concatenate(
            [downsample(e[key][sample_indices(len(e[key]))]) for e in episodes[:n_ep]]
        )
        assert s["count"].tolist() == [len(sampled)]
        pixels = sampled.reshape(-1, 3) / 255.0
        np.testing.assert_allclose(s["mean"].reshape(3), pixels.mean(0), rtol=1e-9)
        np.testing.assert_allclose(s["std"].reshape(3), pixels.std(0), rtol=1e-6)
        np.testing.assert_array_equal(s["min"].reshape(3), pixels.min(0))
        np.testing.assert_array_equal(s["max"].reshape(3), pixels.max(0))
        np.testing.assert_allclose(s["q50"].reshape(3), np.quantile(pixels, 0.5, axis=0))
        np.testing.assert_allclose(s["q99"].reshape(3), np.quantile(pixels, 0.99, axis=0))
    return info


def test_cameras_written_as_lerobot_features(tmp_path):
    root = tmp_path / "ds"
    calls = [batch(0, [12, 7, 20]), batch(3, [5, 9])]
    with LeRobotWriter(root, fps=FPS, features=FEATURES) as writer:
        for episodes, tasks in calls:
            writer.add_episodes(episodes, tasks)
    info = check_videos(root, calls[0][0] + calls[1][0])
    assert (info["total_episodes"], info["total_frames"]) == (5, 53)
    assert info["features"][TOP]["info"]["video.codec"] == "av1"
    assert info["features"][TOP]["info"]["video.crf"] == 30
    assert info["features"][TOP]["info"]["video.g"] == 2
    assert info["features"][SIDE] == {
        "dtype": "image",
        "shape": [16, 16, 3],
        "names": ["height", "width", "channels"],
    }
    # Every episode shares one file (the cap is 200 MB), across calls.
    meta = read_episodes(root)
    assert meta[f"videos/{TOP}/file_index"].tolist() == [0, 0, 0, 0, 0]


def test_file_size_cap_and_chunks(tmp_path):
    root = tmp_path / "ds"
    episodes, tasks = batch(0, [30, 30, 30, 30, 30])
    # A cap below one episode's bytes: episodes spread over files, two files per chunk.
    with LeRobotWriter(
        root, fps=FPS, features=FEATURES, video_files_size_in_mb=1e-3, chunks_size=2
    ) as writer:
        writer.add_episodes(episodes, tasks)
    check_videos(root, episodes)
    meta = read_episodes(root)
    locs = list(zip(meta[f"videos/{TOP}/chunk_index"], meta[f"videos/{TOP}/file_index"]))
    distinct = sorted(set(locs))
    assert len(distinct) >= 3 and locs == sorted(locs)
    assert distinct == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)][: len(distinct)]


@pytest.mark.parametrize("cap", [None, 0.004])
def test_many_small_calls_fill_one_video_file_up_to_the_cap(tmp_path, cap):
    """Issue 19 item 6: 30 calls of 1-3 short episodes. With LeRobot's caps: one data file and
    one mp4 per camera; with a small video cap, files roll over, each within the cap."""
    rng = np.random.default_rng(5)
    calls = [batch(10 * c, rng.integers(2, 5, size=int(rng.integers(1, 4)))) for c in range(30)]
    root = tmp_path / "ds"
    with LeRobotWriter(
        root, fps=FPS, features=FEATURES, video_files_size_in_mb=cap, encoder_workers=1
    ) as writer:
        for episodes, tasks in calls:
            writer.add_episodes(episodes, tasks)
    everything = [e for episodes, _ in calls for e in episodes]
    check_videos(root, everything)  # every frame within PSNR_DB, timestamps continue
    for key in (TOP, WRIST):
        paths = sorted(root.glob(f"videos/{key}/*/*.mp4"))
        if cap is None:
            assert len(paths) == 1
        else:
            assert len(paths) >= 3
            for path in paths[:-1]:
                assert path.stat().st_size <= cap * 2**20
    assert len(list(root.glob("data/*/*.parquet"))) == 1


def test_h264_and_resume_keeps_the_settings(tmp_path):
    root = tmp_path / "ds"
    first, second = batch(0, [8, 4]), batch(2, [6])
    with LeRobotWriter(root, fps=FPS, features=FEATURES, video_codec="h264", crf=23) as writer:
        writer.add_episodes(*first)
    with LeRobotWriter.open(root) as writer:
        assert writer.add_episodes(*second) == range(2, 3)
    info = check_videos(root, first[0] + second[0])
    assert info["features"][TOP]["info"]["video.codec"] == "h264"
    assert info["features"][TOP]["info"]["video.crf"] == 23
    with pytest.raises(ValueError, match="features differ"):
        LeRobotWriter(root, fps=FPS, features=FEATURES)  # libsvtav1: another dataset


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"dtype": "video", "shape": [3, 32, 32]}, r"needs shape \[H, W, 3\]"),
        ({"dtype": "video", "shape": [15, 32, 3]}, "even height and width"),
        ({"dtype": "video", "shape": [32, 16, 3]}, "at least 32"),
        ({"dtype": "image", "shape": [16, 16, 4]}, r"needs shape \[H, W, 3\]"),
    ],
)
def test_bad_camera_features(tmp_path, spec, match):
    with pytest.raises(ValueError, match=match):
        LeRobotWriter(tmp_path / "ds", fps=FPS, features={TOP: spec})
    assert not (tmp_path / "ds").exists()


def test_bad_camera_frames_are_refused_before_anything_is_queued(tmp_path):
    with LeRobotWriter(tmp_path / "ds", fps=FPS, features=FEATURES) as writer:
        episodes, tasks = batch(0, [5])
        episodes[0][TOP] = episodes[0][TOP].astype(np.float32)
        with pytest.raises(ValueError, match="expected uint8"):
            writer.add_episodes(episodes, tasks)
        episodes, tasks = batch(0, [5])
        episodes[0][WRIST] = episodes[0][WRIST][:4]
        with pytest.raises(ValueError, match=r"expected uint8 \[5, 32, 48, 3\]"):
            writer.add_episodes(episodes, tasks)
        assert writer.num_episodes == 0


class Gate:
    """Holds every video encode until released, counting those that started."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        self.started = 0
        real = video.encode

        def held(*args, **kwargs):
            self.started += 1
            assert self.release.wait(30)
            return real(*args, **kwargs)

        monkeypatch.setattr(video, "encode", held)


def test_add_returns_while_encoding_and_close_waits(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    writer = LeRobotWriter(tmp_path / "ds", fps=FPS, features=FEATURES)
    episodes, tasks = batch(0, [6, 6])
    start = time.perf_counter()
    assert writer.add_episodes(episodes, tasks) == range(0, 2)
    assert time.perf_counter() - start < 5  # the encoders are held: nothing was encoded
    assert (writer.num_episodes, writer.committed_episodes) == (2, 0)
    info = json.loads((tmp_path / "ds/meta/info.json").read_text())
    assert info["total_episodes"] == 0
    gate.release.set()
    writer.close()
    assert writer.committed_episodes == 2
    check_videos(tmp_path / "ds", episodes)
    with pytest.raises(ValueError, match="closed"):
        writer.add_episodes(episodes, tasks)


def test_pending_frames_are_bounded(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    one_call = sum(
        a.nbytes for e in batch(0, [6])[0] for k, a in e.items() if k != "observation.state"
    )
    writer = LeRobotWriter(
        tmp_path / "ds", fps=FPS, features=FEATURES, max_pending_mb=1.5 * one_call / (1 << 20)
    )
    calls = [batch(i, [6]) for i in range(3)]
    writer.add_episodes(*calls[0])  # accepted: under the bound
    second = threading.Thread(target=writer.add_episodes, args=calls[1])
    second.start()
    second.join(0.3)
    assert second.is_alive()  # blocked, not dropped
    gate.release.set()
    second.join(30)
    writer.add_episodes(*calls[2])
    writer.close()
    check_videos(tmp_path / "ds", [e for episodes, _ in calls for e in episodes])


def test_encoder_error_names_the_episode_and_stops_the_writer(tmp_path, monkeypatch):
    root = tmp_path / "ds"
    writer = LeRobotWriter(root, fps=FPS, features=FEATURES)
    first = batch(0, [5, 5])
    writer.add_episodes(*first)
    writer.wait()

    real = video.encode

    def failing(part_path, episodes, *args, **kwargs):
        if len(episodes) == 3:  # the second call: its episode 3 (the second) breaks
            episodes = [episodes[0], episodes[1][:, :, :, :2], episodes[2]]
        return real(part_path, episodes, *args, **kwargs)

    monkeypatch.setattr(video, "encode", failing)
    writer.add_episodes(*batch(2, [4, 4, 4]))
    with pytest.raises(LeRobotWriteError, match="episode 3") as err:
        writer.close()
    assert "episodes 2 to 4 were not written" in str(err.value)
    with pytest.raises(LeRobotWriteError):
        writer.add_episodes(*first)
    # The folder is as the first call left it; reopening finds nothing to drop.
    monkeypatch.setattr(video, "encode", real)
    assert not [p for p in root.rglob("*") if files.is_tmp(p)]
    assert LeRobotWriter.open(root).committed_episodes == 2
    check_videos(root, first[0])


class OutOfOrder:
    """PyAV, its encoder handing packets out as SVT-AV1 now and then does: out of frame order.

    A stream's packets are held until the flush, then handed out in frame order but for the
    frames ``swap`` (whose packets trade places) and ``drop`` (whose packet never comes).
    """

    def __init__(self, av, swap=(0, 0), drop=None):
        self._av, self.swap, self.drop = av, swap, drop

    def __getattr__(self, name):
        return getattr(self._av, name)

    def open(self, *args, **kwargs):
        container = self._av.open(*args, **kwargs)
        fake = self

        class Container:
            def __getattr__(self, name):
                return getattr(container, name)

            def add_stream(self, *args, **kwargs):
                return Stream(container.add_stream(*args, **kwargs))

        class Stream:
            def __init__(self, stream):
                object.__setattr__(self, "_stream", stream)
                object.__setattr__(self, "_held", [])

            def __getattr__(self, name):
                return getattr(self._stream, name)

            def __setattr__(self, name, value):
                setattr(self._stream, name, value)

            def encode(self, frame=None):
                self._held.extend(self._stream.encode(frame))
                if frame is not None:
                    return []
                packets = sorted(self._held, key=lambda p: p.pts)
                a, b = fake.swap
                packets[a], packets[b] = packets[b], packets[a]
                return [p for p in packets if p.pts != fake.drop]

        return Container()


def stream_packets(path: Path) -> list[tuple[int, int, bytes]]:
    import av

    with av.open(str(path)) as container:
        return [(p.pts, p.dts, bytes(p)) for p in container.demux(video=0) if p.size]


def test_av1_packets_out_of_frame_order_are_written_in_order(tmp_path):
    """SVT-AV1 now and then hands out frame k + 25's packet in frame k's place (seen under CPU
    load; the muxer then refused frame k's, EINVAL): the file is written in frame order, as an
    encode in order is, and a frame whose packet never comes fails the encode."""
    import av

    episodes = [camera(0, 40, 32, 32), camera(1, 9, 32, 32)]

    def encode(av, name):
        with video._same_scheduling():  # as video.encode in process (SVT-AV1 may make it FIFO)
            return video._encode(
                av,
                lambda i: tmp_path / f".{name}-{i}.tmp",
                episodes,
                FPS,
                video.VideoSettings(),
                float("inf"),
                2,
            )

    (reference,), _ = encode(av, "reference")
    (swapped,), placed = encode(OutOfOrder(av, swap=(3, 28)), "swapped")
    assert placed == [video.Placed(0, 0, 40), video.Placed(0, 40, 9)]
    assert stream_packets(swapped) == stream_packets(reference)
    pts = [p[0] for p in stream_packets(swapped)]  # in the muxer's time base
    assert len(pts) == 49 and pts == sorted(set(pts))
    assert psnr(video.decode(swapped), np.concatenate(episodes)) >= PSNR_DB
    with pytest.raises(RuntimeError, match="episode 3: .* no packet for frame 3 of 49"):
        encode(OutOfOrder(av, drop=3), "dropped")
    assert not list(tmp_path.glob(".dropped-*"))


# -- the encoder's watchdog: a stuck encode is killed and redone, or reported in time ---------

TIMEOUT = 2.0  # the watchdog of one attempt in these tests; a legitimate one takes ~20 ms


def fresh_encoders(monkeypatch) -> list[video.EncoderProcess]:
    """Give each writer a new encoder process (no idle one of an earlier test); collect them."""
    made: list[video.EncoderProcess] = []

    def take():
        made.append(video.EncoderProcess())
        return made[-1]

    monkeypatch.setattr(video, "take_encoder", take)
    return made


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def partial_videos(root: Path) -> list[Path]:
    return [p for p in root.glob("videos/*/.call-*") if files.is_tmp(p)]


def close_within(writer, seconds, encoders, seen=None) -> BaseException | None:
    """``writer.close()``, failing the test (not hanging it) if it takes over ``seconds``.

    Meanwhile, adds to ``seen`` the hidden video files that exist while the encodes run.
    """
    outcome: list[BaseException | None] = []

    def run():
        try:
            writer.close()
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.perf_counter() + seconds
    while thread.is_alive() and time.perf_counter() < deadline:
        if seen is not None:
            seen.update(partial_videos(writer.root))
        thread.join(0.05)
    if thread.is_alive():  # the watchdog failed: end the stuck processes so the run can end
        while thread.is_alive():
            for encoder in encoders:
                for pid in encoder.pids:
                    if alive(pid):
                        os.kill(pid, signal.SIGKILL)
            thread.join(0.5)
        pytest.fail(f"close() did not return within {seconds} s")
    return outcome[0]


@pytest.mark.parametrize("fault", ["hang", "crash"])
def test_a_stuck_or_dead_encoder_is_replaced_and_the_job_redone(
    tmp_path, monkeypatch, caplog, fault
):
    caplog.set_level(logging.WARNING, logger=video.__name__)
    encoders = fresh_encoders(monkeypatch)
    root = tmp_path / "ds"
    first, second = batch(0, [5, 6]), batch(2, [40, 4, 5])
    # The second call's top-camera job: its first attempt encodes episode 2 (long enough for the
    # encoder to write some of it), then hangs for ever in a native call holding the GIL (or
    # its process aborts), its mp4 half written.
    monkeypatch.setenv(video.FAULT_ENV, f"{fault}:1:{TOP}/.call-2-")
    writer = LeRobotWriter(root, fps=FPS, features=FEATURES, encode_timeout_s=TIMEOUT)
    writer.add_episodes(*first)
    writer.wait()
    start = time.perf_counter()
    writer.add_episodes(*second)
    seen: set[Path] = set()
    assert close_within(writer, TIMEOUT + 30, encoders, seen) is None
    elapsed = time.perf_counter() - start
    if fault == "hang":
        assert TIMEOUT <= elapsed < TIMEOUT + 20  # the watchdog fired, once
        assert any(p.parent.name == TOP for p in seen)  # the stuck attempt had begun its mp4
    [encoder] = encoders
    # One process for the first call and the failed attempt, a fresh one for the retry (and
    # the wrist camera's job); the first is gone, not left hanging.
    assert len(encoder.pids) == 2 and not alive(encoder.pids[0])
    why = "no answer within 2 s" if fault == "hang" else "the encoder process died"
    assert "episodes 2 to 4: encoding attempt 1 of 3 failed, trying again" in caplog.text
    assert why in caplog.text
    assert writer.committed_episodes == 5
    # Frame counts, metadata, decoded frames, statistics; no partial or unreferenced mp4.
    check_videos(root, first[0] + second[0])


def test_an_encode_failing_every_attempt_is_reported_in_time(tmp_path, monkeypatch):
    encoders = fresh_encoders(monkeypatch)
    root = tmp_path / "ds"
    first, second = batch(0, [5, 6]), batch(2, [40, 4, 5])
    # Every attempt hangs once episode 2 is partly written.
    monkeypatch.setenv(video.FAULT_ENV, f"hang:99:{TOP}/.call-2-")
    writer = LeRobotWriter(
        root, fps=FPS, features=FEATURES, encode_timeout_s=TIMEOUT, encode_retries=1
    )
    writer.add_episodes(*first)
    writer.wait()
    start = time.perf_counter()
    writer.add_episodes(*second)
    seen: set[Path] = set()
    err = close_within(writer, 2 * TIMEOUT + 30, encoders, seen)
    elapsed = time.perf_counter() - start
    assert isinstance(err, LeRobotWriteError)
    message = str(err)
    assert "episodes 2 to 4 were not written" in message
    assert f"feature {TOP!r}" in message and "2 attempt(s) failed" in message
    assert message.count(f"no answer within {TIMEOUT:g} s: the encoder process was killed") == 2
    assert 2 * TIMEOUT <= elapsed < 2 * TIMEOUT + 20  # two attempts, each cut at the timeout
    [encoder] = encoders
    assert len(encoder.pids) == 2 and not any(alive(pid) for pid in encoder.pids)
    with pytest.raises(LeRobotWriteError, match="episodes 2 to 4"):
        writer.add_episodes(*first)
    # The hung attempts had written files; they are gone. What was committed before is intact,
    # and no metadata names anything of the failed call.
    assert {p.name.split(".mp4")[0] for p in seen if p.parent.name == TOP} == {".call-2-0"}
    assert not [p for p in root.rglob("*") if files.is_tmp(p)]
    check_videos(root, first[0])
    monkeypatch.delenv(video.FAULT_ENV)
    with LeRobotWriter.open(root) as writer:
        assert writer.add_episodes(*second) == range(2, 5)
    check_videos(root, first[0] + second[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling policies")
def test_the_encoder_process_never_runs_real_time(tmp_path):
    """SVT-AV1 makes its threads SCHED_FIFO 99 where it may (root): not in the encoder process."""
    encoder = video.EncoderProcess()
    try:
        encoder._start()
        pid = encoder.pid
        status = Path(f"/proc/{pid}/status").read_text()
        effective = int(status.split("CapEff:")[1].split()[0], 16)
        assert not effective & (1 << 23)  # CAP_SYS_NICE
        policies, threads, done = set(), set(), threading.Event()

        def watch():
            while not done.is_set():
                for task in Path(f"/proc/{pid}/task").iterdir():
                    try:
                        policies.add(os.sched_getscheduler(int(task.name)))
                        threads.add(task.name)
                    except OSError:
                        pass
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            frames = [camera(0, 300, 96, 96)]
            video.encode(
                lambda i: tmp_path / f".part-{i}.tmp",
                frames,
                FPS,
                video.VideoSettings(),
                float("inf"),
                encoder=encoder,
                timeout_s=60,
            )
        finally:
            done.set()
            watcher.join()
        assert len(threads) > 3  # the encoder's own threads were seen
        assert policies <= {os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE}
    finally:
        encoder.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling policies")
def test_an_in_process_encode_leaves_its_thread_as_it_was(tmp_path):
    seen = []

    def run():
        before = os.sched_getscheduler(0), os.sched_getparam(0)
        video.encode(
            lambda i: tmp_path / f".part-{i}.tmp",
            [camera(0, 20, 32, 32)],
            FPS,
            video.VideoSettings(),
            float("inf"),
        )
        seen.append((before, (os.sched_getscheduler(0), os.sched_getparam(0))))

    thread = threading.Thread(target=run)  # SVT-AV1 may make it SCHED_FIFO 99 (root)
    thread.start()
    thread.join()
    [(before, after)] = seen
    assert after == before


def test_default_encode_timeout_is_generous_and_scales():
    def frames(n, h, w):
        return [np.zeros((n, h, w, 3), np.uint8)]

    assert video.default_timeout(frames(100, 96, 96)) == 60.0
    assert video.default_timeout(frames(20_000, 96, 96)) == pytest.approx(200.0)
    assert video.default_timeout(frames(20_000, 480, 640)) == pytest.approx(200.0 * 3.072)


class Killed(BaseException):
    """Stands for the process dying: nothing in the writer catches a BaseException."""


def test_crash_at_every_commit_resumes_without_gaps(tmp_path):
    first, second = batch(0, [5, 8]), batch(2, [6, 7])
    # Count the second call's renames: data, videos, stats.json, the statistics cache moved
    # aside and replaced, the episodes metadata, info.json.
    renames, real = [0], files.commit
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            files,
            "commit",
            lambda tmp, path: (renames.__setitem__(0, renames[0] + 1), real(tmp, path)),
        )
        with LeRobotWriter(tmp_path / "count", fps=FPS, features=FEATURES) as writer:
            writer.add_episodes(*first)
            writer.wait()
            renames[0] = 0
            writer.add_episodes(*second)
    assert renames[0] >= 8
    for k in range(renames[0]):
        root = tmp_path / f"crash-{k}"
        with LeRobotWriter(root, fps=FPS, features=FEATURES) as w:
            w.add_episodes(*first)
        seen = [0]
        real = files.commit

        def dying(tmp, path, k=k):
            if seen[0] == k:
                raise Killed
            seen[0] += 1
            real(tmp, path)

        writer = LeRobotWriter.open(root)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(files, "commit", dying)
            writer.add_episodes(*second)
            with pytest.raises(LeRobotWriteError):
                writer.close()
            assert seen[0] == k
        committed = json.loads((root / "meta/info.json").read_text())["total_episodes"]
        check_videos(root, first[0] + second[0], strict=False)
        assert committed == 2  # info.json is the last rename
        # Reopening drops the tail (video files included: the frames the second call
        # appended to the first call's mp4); the call is then redone.
        with LeRobotWriter.open(root) as writer:
            assert writer.num_frames == 13
            assert [video.num_frames(p) for p in sorted(root.glob("videos/*/*/*.mp4"))] == [13] * 2
            writer.add_episodes(*second)
        check_videos(root, first[0] + second[0])
        assert len(list(root.glob("videos/*/*/*.mp4"))) == 2  # one file per camera


SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from test_lerobot_video import FEATURES, batch
    from jaxtraj.lerobot import LeRobotWriter
    writer = LeRobotWriter(sys.argv[1], fps=10, features=FEATURES, video_files_size_in_mb=0.002)
    for call in range(100_000):
        writer.add_episodes(*batch(3 * call, [5, 9, 7]))
        print(call, flush=True)
    """
).format(tests=str(Path(__file__).parent))


def test_sigkilled_while_encoding_resumes_without_gaps(tmp_path):
    root = tmp_path / "ds"
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.time() + 60
        committed = 0
        while committed < 6 and time.time() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
            try:
                committed = json.loads((root / "meta/info.json").read_text())["total_episodes"]
            except (OSError, ValueError):
                pass
        assert committed >= 6
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    everything = [e for call in range(200) for e in batch(3 * call, [5, 9, 7])[0]]
    check_videos(root, everything, strict=False)
    writer = LeRobotWriter.open(root, encoder_workers=1)
    done = writer.num_episodes
    assert done % 3 == 0 and done >= 6
    check_videos(root, everything)
    # Appending goes on from the last committed episode: no gap, no duplicate.
    assert writer.add_episodes(*batch(done, [5, 9, 7])) == range(done, done + 3)
    writer.close()
    check_videos(root, everything[: done + 3])


def test_resume_rebuilds_camera_stats_from_the_files(tmp_path):
    root = tmp_path / "ds"
    episodes, tasks = batch(0, [10, 12])
    with LeRobotWriter(root, fps=FPS, features=FEATURES) as writer:
        writer.add_episodes(episodes, tasks)
    before = json.loads((root / "meta/stats.json").read_text())
    (root / "meta/.jaxtraj-stats.npz").unlink()
    LeRobotWriter.open(root).close()
    after = json.loads((root / "meta/stats.json").read_text())
    assert after[SIDE] == before[SIDE]  # PNG is lossless
    for key in (TOP, WRIST):  # rebuilt from the decoded (lossy) videos
        assert after[key]["count"] == before[key]["count"]
        np.testing.assert_allclose(after[key]["mean"], before[key]["mean"], atol=0.02)
        np.testing.assert_allclose(after[key]["std"], before[key]["std"], atol=0.02)


# -- the collector's side: cameras travel with the frames on device -------------------------


CAMERA_KINDS = {TOP: "video", WRIST: "video", SIDE: "image"}


def collector_run(root: Path, steps: int = 3):
    """A lerobot-mode collector whose observations hold three cameras, written by the writer.

    Returns the writer (closed) and every episode it was handed, in episode-index order.
    """
    import dataclasses

    from helpers import PLAN, B, K, T, all_parts

    import jaxtraj

    plan = dataclasses.replace(PLAN, mode="lerobot", num_env_ranks=1, max_episode_length=16)

    def cameras(part, step, k=0):
        tag = int(part.source.key.epoch_id) * T + int(part.source.key.chunk_id) + 100 * step
        views = {}
        for key, shape in (("top", (32, 32)), ("wrist", (32, 48)), ("side", (16, 16))):
            views[key] = np.stack(
                [camera(tag + 7 * b + len(key) + 3 * k, 1, *shape)[0] for b in range(B)]
            )
        return views

    def with_cameras(part, step):
        if hasattr(part, "obs"):
            return part.replace(obs={"state": part.obs["state"], **cameras(part, step)})
        # Env halves: the observation of each action, cameras included (action 0's is
        # the policy half's).
        seen = [cameras(part, step, k) for k in range(K)]
        per_action = {key: np.stack([v[key] for v in seen], axis=1) for key in seen[0]}
        return part.replace(action_obs={"state": part.action_obs["state"], **per_action})

    parts = [
        [with_cameras(p, step) for p in all_parts(step=step, per_action=True)]
        for step in range(steps)
    ]
    features = jaxtraj.lerobot.features(plan, parts[0][0], parts[0][1], cameras=CAMERA_KINDS)
    writer = LeRobotWriter(root, fps=FPS, features=features)
    c = jaxtraj.TrajectoryCollector(plan, parts[0][0], parts[0][1], writer=writer, tasks="pick")
    written, steps_of = [], []
    for step, step_parts in enumerate(parts):
        for p in step_parts:
            done = [frames for _, eps in c.add(p) for _, frames in eps]
            written += done
            steps_of += [step] * len(done)
    writer.close()
    # Some episodes crossed a training step: written in a step, they began in the one before
    # (helpers' states count 1000 per step).
    assert any(f["observation.state"][0, 0] < 1000 * s for f, s in zip(written, steps_of))
    return writer, written


def test_collector_writes_camera_episodes_across_steps(tmp_path):
    root = tmp_path / "ds"
    writer, written = collector_run(root)
    info = json.loads((root / "meta/info.json").read_text())
    assert {k: info["features"][k]["dtype"] for k in CAMERA_KINDS} == CAMERA_KINDS
    assert info["features"][WRIST]["shape"] == [32, 48, 3]
    assert info["total_episodes"] == len(written) > 0
    for frames in written:
        assert frames[TOP].shape == (len(frames["action"]), 32, 32, 3)
    check_videos(root, written)


def test_lerobot_loads_a_collector_dataset_with_cameras(tmp_path, lerobot_dataset):
    """LeRobot 0.6.1's loader, offline, pyav backend: two video cameras and an image camera."""
    root = tmp_path / "ds"
    _, episodes = collector_run(root)
    lengths = [len(e[TOP]) for e in episodes]
    bounds = np.cumsum([0, *lengths])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = lerobot_dataset.LeRobotDataset("local/jaxtraj_cams", root=root, video_backend="pyav")
        assert len(ds) == bounds[-1] and ds.num_episodes == len(episodes)
        assert set(ds.meta.video_keys) == {TOP, WRIST} and ds.meta.image_keys == [SIDE]
        for i in range(len(ds)):
            item = ds[i]
            ep = int(np.searchsorted(bounds, i, side="right") - 1)
            frame = i - bounds[ep]
            assert int(item["episode_index"]) == ep and int(item["frame_index"]) == frame
            for key in (TOP, WRIST, SIDE):
                got = (np.asarray(item[key]).transpose(1, 2, 0) * 255).round().astype(np.uint8)
                want = episodes[ep][key][frame]
                if key == SIDE:
                    np.testing.assert_array_equal(got, want)
                else:
                    assert psnr(got, want) >= PSNR_DB, (key, i)
        for key in (TOP, WRIST, SIDE):
            for stat in ("min", "max", "mean", "std", "q01", "q99"):
                assert tuple(ds.meta.stats[key][stat].shape) == (3, 1, 1), (key, stat)
        # delta_timestamps: the neighbours of a frame, padded at the episode's edges.
        windowed = lerobot_dataset.LeRobotDataset(
            "local/jaxtraj_cams",
            root=root,
            video_backend="pyav",
            delta_timestamps={TOP: [-0.1, 0.0, 0.1]},
        )
        for i in (int(bounds[1]), int(bounds[1] + 3), int(bounds[2] - 1), int(bounds[-1] - 1)):
            item = windowed[i]
            ep = int(np.searchsorted(bounds, i, side="right") - 1)
            frame = i - bounds[ep]
            pad = item[f"{TOP}_is_pad"].tolist()
            assert pad == [frame == 0, False, frame == lengths[ep] - 1]
            got = (np.asarray(item[TOP]).transpose(0, 2, 3, 1) * 255).round().astype(np.uint8)
            for j, offset in enumerate((-1, 0, 1)):
                if not pad[j]:
                    assert psnr(got[j], episodes[ep][TOP][frame + offset]) >= PSNR_DB


def test_a_camera_constant_over_an_episode_is_warned_naming_feature_and_episodes(tmp_path, caplog):
    """A MuJoCo camera rendered in a thread without its OpenGL context comes out black: the
    writer says so, naming the feature and the episodes (a one-frame episode is not flagged)."""
    episodes, tasks = batch(0, [4, 5, 1])
    episodes[1][TOP] = np.zeros_like(episodes[1][TOP])  # black, as a context-less render
    episodes[2][TOP] = np.zeros_like(episodes[2][TOP])  # one frame: constant by nature
    writer = LeRobotWriter(tmp_path / "ds", fps=FPS, features=FEATURES)
    with caplog.at_level("WARNING", logger="jaxtraj.lerobot.writer"):
        writer.add_episodes(episodes, tasks)
        writer.close()
    warned = [r.getMessage() for r in caplog.records if "constant" in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"camera feature {TOP!r} is constant over episode(s) 1 (every pixel 0" in warned[0]
