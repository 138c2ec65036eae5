"""LeRobotWriter: the LeRobot v3.0 folder it writes, read back with pyarrow alone.

Every test reads the dataset the way LeRobot's loader does (``meta/info.json``, the globs
``data/*/*.parquet`` and ``meta/episodes/*/*.parquet``, ``meta/tasks.parquet``) and checks it
against the episodes that went in. Crashes are simulated in process at every file commit, and
for real in subprocesses (``os._exit`` and SIGKILL). The last test loads the folder with LeRobot
itself and is skipped where LeRobot is not installed (see docs/lerobot.md).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtraj.lerobot import DEFAULT_FEATURES, QUANTILES, LeRobotWriter, files
from jaxtraj.lerobot.format import tasks_table

FPS = 10
FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [6], "names": [f"j{i}" for i in range(6)]},
    "observation.velocity": {"dtype": "float64", "shape": [2], "names": None},
    "action": {"dtype": "float32", "shape": [3], "names": {"motors": ["a", "b", "c"]}},
    "next.reward": {"dtype": "float32", "shape": [1], "names": None},
    "next.done": {"dtype": "bool", "shape": [1], "names": None},
    "next.truncated": {"dtype": "bool", "shape": [1], "names": None},
    "intervention": {"dtype": "int8", "shape": [1], "names": None},
}
GLOBS = ("data/*/*.parquet", "meta/episodes/*/*.parquet")
TASKS = ["pick the cube", "place the cube", "push the button"]


def make_episode(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
    """One episode as a collector hands it over: default numpy dtypes, cast by the writer."""
    done = np.zeros(length, dtype=bool)
    done[-1] = True
    return {
        "observation.state": rng.normal(3.0, 2.0, size=(length, 6)),
        "observation.velocity": rng.normal(size=(length, 2)),
        "action": rng.uniform(-1, 1, size=(length, 3)).astype(np.float32),
        "next.reward": rng.normal(size=(length, 1)),
        "next.done": done,
        "next.truncated": np.zeros(length, dtype=bool),
        "intervention": (rng.uniform(size=length) < 0.2).astype(np.int8),
    }


def make_batch(rng: np.random.Generator, num: int, lo: int = 5, hi: int = 40):
    episodes = [make_episode(rng, int(rng.integers(lo, hi))) for _ in range(num)]
    tasks = [TASKS[int(rng.integers(len(TASKS)))] for _ in range(num)]
    return episodes, tasks


def new_writer(root: Path, **kwargs) -> LeRobotWriter:
    return LeRobotWriter(root, fps=FPS, features=FEATURES, robot_type="so101", **kwargs)


def expected_columns(episodes, tasks):
    """The data columns the writer must produce for these episodes, first episode 0."""
    task_ids = {t: i for i, t in enumerate(dict.fromkeys(tasks))}
    out = {
        name: np.concatenate(
            [np.asarray(e[name]).reshape(len(e[name]), -1) for e in episodes]
        ).astype(spec["dtype"])
        for name, spec in FEATURES.items()
    }
    lengths = [len(e["next.done"]) for e in episodes]
    frame = np.concatenate([np.arange(n) for n in lengths])
    out["frame_index"] = frame[:, None]
    out["timestamp"] = (frame / FPS).astype(np.float32)[:, None]
    out["episode_index"] = np.repeat(np.arange(len(lengths)), lengths)[:, None]
    out["index"] = np.arange(sum(lengths))[:, None]
    out["task_index"] = np.repeat([task_ids[t] for t in tasks], lengths)[:, None]
    return out


def column_to_numpy(column: pa.ChunkedArray) -> np.ndarray:
    array = column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), -1)
    return array.to_numpy(zero_copy_only=False)[:, None]


def location(path: Path) -> tuple[int, int]:
    return int(path.parent.name.split("-")[1]), int(path.stem.split("-")[1])


def load(root: Path) -> dict:
    """Read the folder as LeRobot does: info.json, then the globs, in sorted path order."""
    info = json.loads((root / "meta/info.json").read_text())
    data_paths = sorted(root.glob("data/*/*.parquet"))
    meta_paths = sorted(root.glob("meta/episodes/*/*.parquet"))
    data = pa.concat_tables([pq.read_table(p) for p in data_paths]) if data_paths else None
    episodes = pa.concat_tables([pq.read_table(p) for p in meta_paths]) if meta_paths else None
    tasks_path = root / "meta/tasks.parquet"
    tasks = pq.read_table(tasks_path) if tasks_path.exists() else None
    stats_path = root / "meta/stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else None
    return dict(
        info=info,
        data=data,
        data_paths=data_paths,
        episodes=episodes,
        meta_paths=meta_paths,
        tasks=tasks,
        stats=stats,
    )


def check_dataset(root: Path, strict: bool = True) -> dict:
    """Assert every invariant on the committed part; with strict, that nothing lies beyond it.

    After a crash (strict=False) the files may hold an uncommitted tail past info.json's totals,
    which LeRobot's loader does not index; everything info.json commits must be exact.
    """
    d = load(root)
    info = d["info"]
    n_ep, n_fr, n_tasks = info["total_episodes"], info["total_frames"], info["total_tasks"]
    assert info["splits"] == {"train": f"0:{n_ep}"}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if ".tmp-" in path.name:
            assert not any(fnmatch.fnmatch(rel, g) for g in GLOBS), rel
    if n_ep == 0:
        assert not strict or (d["data"] is None and d["episodes"] is None)
        return d
    data, episodes = d["data"], d["episodes"]
    assert data.num_rows >= n_fr and episodes.num_rows >= n_ep
    if strict:
        assert data.num_rows == n_fr and episodes.num_rows == n_ep
        assert d["tasks"].num_rows == n_tasks
    index = data.column("index").to_numpy()[:n_fr]
    np.testing.assert_array_equal(index, np.arange(n_fr))
    ep = {c: episodes.column(c).to_pylist()[:n_ep] for c in episodes.column_names}
    assert ep["episode_index"] == list(range(n_ep))
    assert ep["dataset_from_index"][0] == 0 and ep["dataset_to_index"][-1] == n_fr
    assert ep["dataset_from_index"][1:] == ep["dataset_to_index"][:-1]
    assert [b - a for a, b in zip(ep["dataset_from_index"], ep["dataset_to_index"])] == ep["length"]
    episode_index = data.column("episode_index").to_numpy()[:n_fr]
    frame_index = data.column("frame_index").to_numpy()[:n_fr]
    for i in range(n_ep):
        rows = slice(ep["dataset_from_index"][i], ep["dataset_to_index"][i])
        assert (episode_index[rows] == i).all()
        np.testing.assert_array_equal(frame_index[rows], np.arange(ep["length"][i]))
    # Each episode lies whole in the file its metadata names, at the offset the files imply.
    offset = 0
    for path in d["data_paths"]:
        file_eps = pq.read_table(path, columns=["episode_index"]).column(0).to_numpy()
        committed = file_eps[file_eps < n_ep]
        for i in np.unique(committed):
            assert (ep["data/chunk_index"][i], ep["data/file_index"][i]) == location(path)
            assert np.sum(file_eps == i) == ep["length"][i]
            assert ep["dataset_from_index"][i] == offset + np.flatnonzero(file_eps == i)[0]
        offset += len(file_eps)
    row = 0
    for path in d["meta_paths"]:
        ids = pq.read_table(path, columns=["episode_index"]).column(0).to_pylist()
        for i in ids:
            if i < n_ep:
                assert i == row
                assert (ep["meta/episodes/chunk_index"][i], ep["meta/episodes/file_index"][i]) == (
                    location(path)
                )
                row += 1
    tasks = d["tasks"]
    assert tasks.num_rows >= n_tasks
    assert tasks.column("task_index").to_pylist()[:n_tasks] == list(range(n_tasks))
    task_strings = tasks.column("task").to_pylist()
    task_index = data.column("task_index").to_numpy()[:n_fr]
    for i in range(n_ep):
        assert task_strings[task_index[ep["dataset_from_index"][i]]] == ep["tasks"][i][0]
    return d


def snapshot(root: Path) -> dict[str, bytes]:
    if not root.exists():
        return {}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_info_json(tmp_path):
    root = tmp_path / "ds"
    writer = new_writer(root)
    info = json.loads((root / "meta/info.json").read_text())
    assert info["total_episodes"] == 0 and info["splits"] == {"train": "0:0"}
    rng = np.random.default_rng(0)
    episodes, tasks = make_batch(rng, 4)
    assert writer.add_episodes(episodes, tasks) == range(0, 4)
    info = json.loads((root / "meta/info.json").read_text())
    lengths = [len(e["next.done"]) for e in episodes]
    assert info == {
        "codebase_version": "v3.0",
        "fps": FPS,
        "features": {**FEATURES, **DEFAULT_FEATURES},
        "total_episodes": 4,
        "total_frames": sum(lengths),
        "total_tasks": len(set(tasks)),
        "chunks_size": 1000,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": None,
        "robot_type": "so101",
        "splits": {"train": "0:4"},
    }
    assert all("names" in spec and "/" not in name for name, spec in info["features"].items())
    assert list(info["features"])[-5:] == [
        "timestamp",
        "frame_index",
        "episode_index",
        "index",
        "task_index",
    ]
    assert (writer.num_episodes, writer.num_frames) == (4, sum(lengths))
    assert writer.tasks == tuple(dict.fromkeys(tasks))


def test_data_columns_types_and_values(tmp_path):
    root = tmp_path / "ds"
    writer = new_writer(root)
    rng = np.random.default_rng(1)
    episodes, tasks = make_batch(rng, 5)
    writer.add_episodes(episodes, tasks)
    d = check_dataset(root)
    features = {**FEATURES, **DEFAULT_FEATURES}
    for path in d["data_paths"]:
        schema = pq.read_schema(path)
        assert schema.names == list(features)
        for name, spec in features.items():
            scalar = pa.from_numpy_dtype(np.dtype(spec["dtype"]))
            width = spec["shape"][0]
            field_type = schema.field(name).type
            if width == 1:
                assert field_type == scalar, name
            else:
                assert field_type == pa.list_(scalar, width), name
                assert pa.types.is_fixed_size_list(field_type)
    expected = expected_columns(episodes, tasks)
    for name, values in expected.items():
        got = column_to_numpy(d["data"].column(name))
        assert got.dtype == np.dtype(features[name]["dtype"]), name
        np.testing.assert_array_equal(got, values, err_msg=name)


def test_file_rollover_and_chunks(tmp_path):
    root = tmp_path / "ds"
    # 95 bytes a frame: about 120 frames a file, 2 files a chunk.
    writer = new_writer(root, data_files_size_in_mb=0.01, chunks_size=2)
    rng = np.random.default_rng(2)
    all_episodes, all_tasks = [], []
    for _ in range(4):
        episodes, tasks = make_batch(rng, 9)
        writer.add_episodes(episodes, tasks)
        all_episodes += episodes
        all_tasks += tasks
    # An episode over the limit on its own gets a file of its own.
    big, _ = make_batch(rng, 1, lo=200, hi=201)
    writer.add_episodes(big, ["huge"])
    all_episodes += big
    all_tasks += ["huge"]
    d = check_dataset(root)
    locations = [location(p) for p in d["data_paths"]]
    assert len(locations) >= 8
    assert locations == [(i // 2, i % 2) for i in range(len(locations))]
    frame_nbytes = sum(
        np.dtype(s["dtype"]).itemsize * s["shape"][0]
        for s in {**FEATURES, **DEFAULT_FEATURES}.values()
    )
    for path in d["data_paths"]:
        table = pq.read_table(path)
        if len(np.unique(table.column("episode_index").to_numpy())) > 1:
            assert table.num_rows * frame_nbytes <= 0.01 * 2**20
    assert pq.read_table(d["data_paths"][-1]).num_rows == 200
    expected = expected_columns(all_episodes, all_tasks)
    np.testing.assert_array_equal(
        column_to_numpy(d["data"].column("observation.state")), expected["observation.state"]
    )


def test_episode_metadata_rows_and_rollover(tmp_path):
    root = tmp_path / "ds"
    writer = new_writer(root, data_files_size_in_mb=0.01, chunks_size=2)
    rng = np.random.default_rng(3)
    total = 0
    for _ in range(3):
        # Short episodes, many rows: ~90 bytes a row, so the 10 KiB limit rolls the metadata.
        episodes, tasks = make_batch(rng, 60, lo=1, hi=3)
        writer.add_episodes(episodes, tasks)
        total += 60
    d = check_dataset(root)
    assert len(d["meta_paths"]) >= 2
    assert [location(p) for p in d["meta_paths"]] == [
        (i // 2, i % 2) for i in range(len(d["meta_paths"]))
    ]
    episodes = d["episodes"]
    assert episodes.num_rows == total
    assert episodes.schema.names == [
        "episode_index",
        "tasks",
        "length",
        "data/chunk_index",
        "data/file_index",
        "dataset_from_index",
        "dataset_to_index",
        "meta/episodes/chunk_index",
        "meta/episodes/file_index",
    ]
    assert episodes.schema.field("tasks").type == pa.list_(pa.string())
    for name in episodes.schema.names:
        if name != "tasks":
            assert episodes.schema.field(name).type == pa.int64(), name


def test_tasks_parquet(tmp_path):
    root = tmp_path / "ds"
    writer = new_writer(root)
    rng = np.random.default_rng(4)
    episodes, _ = make_batch(rng, 3)
    writer.add_episodes(episodes, ["b task", "a task", "b task"])
    episodes, _ = make_batch(rng, 2)
    writer.add_episodes(episodes, ["c task", "a task"])
    table = pq.read_table(root / "meta/tasks.parquet")
    assert table.column_names == ["task_index", "task"]
    assert table.column("task").to_pylist() == ["b task", "a task", "c task"]
    assert table.column("task_index").to_pylist() == [0, 1, 2]
    pandas_meta = json.loads(table.schema.metadata[b"pandas"])
    assert pandas_meta["index_columns"] == ["task"]
    assert [c["name"] for c in pandas_meta["columns"]] == ["task_index", "task"]
    assert writer.tasks == ("b task", "a task", "c task")


def test_tasks_parquet_pandas_index():
    pd = pytest.importorskip("pandas")
    table = tasks_table(["pick", "place"])
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    frame = pd.read_parquet(pa.BufferReader(buffer.getvalue()))
    assert frame.index.name == "task"
    assert list(frame.index) == ["pick", "place"]
    assert list(frame["task_index"]) == [0, 1]
    assert frame.iloc[1].name == "place"


def assert_stats(stats: dict, data: pa.Table):
    """stats.json against numpy on the written data; quantiles within the bucket bound."""
    features = {**FEATURES, **DEFAULT_FEATURES}
    assert list(stats) == list(features)
    for name in features:
        x = column_to_numpy(data.column(name)).astype(np.float64)
        s = stats[name]
        assert set(s) == {"min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99"}
        assert s["count"] == [len(x)]
        np.testing.assert_array_equal(s["min"], x.min(0), err_msg=name)
        np.testing.assert_array_equal(s["max"], x.max(0), err_msg=name)
        np.testing.assert_allclose(s["mean"], x.mean(0), rtol=1e-9, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(s["std"], x.std(0), rtol=1e-7, atol=1e-12, err_msg=name)
        ordered = np.sort(x.astype(np.float32).astype(np.float64), axis=0)
        for key, q in QUANTILES.items():
            rank = q * (len(x) - 1)
            lo, hi = ordered[int(np.floor(rank))], ordered[int(np.ceil(rank))]
            exact = lo + (rank - np.floor(rank)) * (hi - lo)
            bound = 2.0**-7 * np.maximum(np.abs(lo), np.abs(hi)) + 1e-30
            assert (np.abs(np.asarray(s[key]) - exact) <= bound).all(), (name, key)


def test_stats_match_numpy_and_stay_current(tmp_path):
    root = tmp_path / "ds"
    writer = new_writer(root)
    rng = np.random.default_rng(5)
    for _ in range(3):
        episodes, tasks = make_batch(rng, 6, lo=20, hi=80)
        writer.add_episodes(episodes, tasks)
        d = load(root)
        assert_stats(d["stats"], d["data"])


def test_stats_do_not_depend_on_how_calls_split_episodes(tmp_path):
    rng = np.random.default_rng(6)
    episodes, tasks = make_batch(rng, 9)
    one = new_writer(tmp_path / "one")
    one.add_episodes(episodes, tasks)
    three = new_writer(tmp_path / "three")
    for i in range(0, 9, 3):
        three.add_episodes(episodes[i : i + 3], tasks[i : i + 3])
    a = json.loads((tmp_path / "one/meta/stats.json").read_text())
    b = json.loads((tmp_path / "three/meta/stats.json").read_text())
    for name in a:
        for key in ("min", "max", "count", *QUANTILES):
            assert a[name][key] == b[name][key], (name, key)
        for key in ("mean", "std"):
            np.testing.assert_allclose(a[name][key], b[name][key], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("reopen", ["open", "constructor"])
def test_resume_appends_without_gaps(tmp_path, reopen):
    root = tmp_path / "ds"
    rng = np.random.default_rng(7)
    batches = [make_batch(rng, 4) for _ in range(3)]
    writer = new_writer(root, data_files_size_in_mb=0.01, chunks_size=2)
    writer.add_episodes(*batches[0])
    writer.add_episodes(*batches[1])
    del writer
    if reopen == "open":
        writer = LeRobotWriter.open(root)
    else:
        writer = new_writer(root)  # file sizes come from the dataset when not given
    assert writer.num_episodes == 8
    assert writer.add_episodes(*batches[2]) == range(8, 12)
    d = check_dataset(root)
    episodes = [e for batch in batches for e in batch[0]]
    tasks = [t for batch in batches for t in batch[1]]
    expected = expected_columns(episodes, tasks)
    for name, values in expected.items():
        np.testing.assert_array_equal(column_to_numpy(d["data"].column(name)), values, name)
    assert_stats(d["stats"], d["data"])
    assert json.loads((root / "meta/info.json").read_text())["data_files_size_in_mb"] == 0.01


def test_resume_rebuilds_lost_stats_state(tmp_path):
    root = tmp_path / "ds"
    rng = np.random.default_rng(8)
    writer = new_writer(root)
    writer.add_episodes(*make_batch(rng, 5))
    before = json.loads((root / "meta/stats.json").read_text())
    (root / "meta/.jaxtraj-stats.npz").unlink()
    (root / "meta/stats.json").unlink()
    LeRobotWriter.open(root)
    after = json.loads((root / "meta/stats.json").read_text())
    assert before.keys() == after.keys()
    for name in before:
        for key in before[name]:
            np.testing.assert_allclose(before[name][key], after[name][key], rtol=1e-12)


def test_empty_call_and_empty_dataset_reopen(tmp_path):
    root = tmp_path / "ds"
    writer = new_writer(root)
    assert writer.add_episodes([], []) == range(0, 0)
    assert sorted(snapshot(root)) == ["meta/info.json"]
    writer = LeRobotWriter.open(root)
    assert writer.num_episodes == 0
    writer.add_episodes(*make_batch(np.random.default_rng(9), 2))
    check_dataset(root)


def mutate_info(root: Path, **changes):
    info = json.loads((root / "meta/info.json").read_text())
    info.update(changes)
    (root / "meta/info.json").write_text(json.dumps(info))


@pytest.mark.parametrize(
    "case, match",
    [
        ("other features", "features differ"),
        ("other fps", "fps"),
        ("other robot", "robot_type"),
        ("other size", "data_files_size_in_mb"),
        ("v2.1", "codebase_version"),
        ("not a dataset", "not empty and has no meta/info.json"),
        ("open without info", "no meta/info.json"),
        ("video feature", "dtype 'video'"),
        ("totals that do not add up", "does not match info.json"),
    ],
)
def test_incompatible_folder_is_refused_untouched(tmp_path, case, match):
    root = tmp_path / "ds"
    new_writer(root).add_episodes(*make_batch(np.random.default_rng(10), 2))
    if case == "v2.1":
        mutate_info(root, codebase_version="v2.1")
    if case == "video feature":
        video = {"dtype": "video", "shape": [3, 8, 8], "names": ["channels", "height", "width"]}
        features = {**FEATURES, **DEFAULT_FEATURES, "observation.images.top": video}
        mutate_info(root, features=features)
    if case == "totals that do not add up":
        # One episode fewer (a tail to drop) but a frame count that does not add up.
        mutate_info(root, total_episodes=1, total_frames=1)
    if case in ("not a dataset", "open without info"):
        (root / "meta/info.json").unlink()
    before = snapshot(root)
    with pytest.raises(ValueError, match=match):
        if case == "other features":
            LeRobotWriter(root, fps=FPS, features={**FEATURES, "extra": FEATURES["action"]})
        elif case == "other fps":
            LeRobotWriter(root, fps=FPS + 1, features=FEATURES, robot_type="so101")
        elif case == "other robot":
            LeRobotWriter(root, fps=FPS, features=FEATURES, robot_type="aloha")
        elif case == "other size":
            new_writer(root, data_files_size_in_mb=5)
        elif case in ("open without info", "video feature", "totals that do not add up"):
            LeRobotWriter.open(root)
        else:
            new_writer(root)
    assert snapshot(root) == before


@pytest.mark.parametrize(
    "features, kwargs, match",
    [
        ({"a/b": FEATURES["action"]}, {}, "contains '/'"),
        ({"index": FEATURES["action"]}, {}, "written by the writer"),
        ({"cam": {"dtype": "video", "shape": [3, 8, 8], "names": None}}, {}, "dtype 'video'"),
        ({"x": {"dtype": "float32", "shape": [2, 3], "names": None}}, {}, "shape must be"),
        ({"x": {"dtype": "float32", "shape": [0], "names": None}}, {}, "shape must be"),
        ({"x": {"dtype": "float32", "shape": [2], "names": ["a"]}}, {}, "names must be 2"),
        ({"x": {"dtype": "float32", "shape": [2], "unit": "m"}}, {}, "unknown keys"),
        ({}, {}, "non-empty dict"),
        (FEATURES, {"fps": 0}, "fps"),
        (FEATURES, {"fps": 2.5}, "fps"),
        (FEATURES, {"data_files_size_in_mb": 0}, "data_files_size_in_mb"),
        (FEATURES, {"chunks_size": 0}, "chunks_size"),
        (FEATURES, {"encode_timeout_s": 0}, "encode_timeout_s"),
        (FEATURES, {"encode_timeout_s": "5"}, "encode_timeout_s"),
        (FEATURES, {"encode_retries": -1}, "encode_retries"),
        (FEATURES, {"encode_retries": 1.0}, "encode_retries"),
    ],
)
def test_bad_configuration_writes_nothing(tmp_path, features, kwargs, match):
    root = tmp_path / "ds"
    with pytest.raises(ValueError, match=match):
        LeRobotWriter(root, **{"fps": FPS, "features": features, **kwargs})
    assert not root.exists()


def _bad_inputs():
    rng = np.random.default_rng(11)

    def ep(**changes):
        e = make_episode(rng, 10)
        for k, v in changes.items():
            if v is None:
                del e[k]
            else:
                e[k] = v
        return e

    cases = [
        ("missing feature", [ep(action=None)], ["t"], "missing features \\['action'\\]"),
        ("undeclared feature", [{**ep(), "extra": np.zeros(10)}], ["t"], "undeclared.*extra"),
        ("reserved feature", [{**ep(), "index": np.arange(10)}], ["t"], "undeclared.*index"),
        ("wrong width", [ep(action=np.zeros((10, 4)))], ["t"], "'action' has shape \\[10, 4\\]"),
        ("wrong rank", [ep(action=np.zeros(10))], ["t"], "'action' has shape \\[10\\]"),
        ("scalar [L, 2]", [ep(**{"next.reward": np.zeros((10, 2))})], ["t"], "next.reward"),
        ("length mismatch", [ep(**{"next.done": np.zeros(9, bool)})], ["t"], "has 9 frames"),
        ("float into bool", [ep(**{"next.done": np.zeros(10)})], ["t"], "dtype float64"),
        ("float into int", [ep(intervention=np.zeros(10))], ["t"], "same_kind"),
        ("int out of range", [ep(intervention=np.full(10, 300))], ["t"], "outside int8"),
        ("strings", [ep(action=np.full((10, 3), "x"))], ["t"], "dtype <U1"),
        ("nan", [ep(), ep(action=np.full((10, 3), np.nan))], ["t", "t"], "episode 1.*non-finite"),
        ("overflow", [ep(**{"next.reward": np.full(10, 1e300)})], ["t"], "non-finite"),
        (
            "empty episode",
            [ep(**{k: np.asarray(v)[:0] for k, v in ep().items()})],
            ["t"],
            "no frames",
        ),
        ("empty task", [ep()], [""], "non-empty string"),
        ("blank task", [ep()], ["  "], "non-empty string"),
        ("no task", [ep()], [None], "non-empty string"),
        ("task count", [ep(), ep()], ["t"], "2 episodes but 1 tasks"),
        ("one dict", ep(), ["t"], "list of dicts"),
        ("tasks as str", [ep()], "t", "list of strings"),
    ]
    return [pytest.param(*case[1:], id=case[0]) for case in cases]


@pytest.mark.parametrize("episodes, tasks, match", _bad_inputs())
def test_bad_episodes_write_nothing(tmp_path, episodes, tasks, match):
    root = tmp_path / "ds"
    writer = new_writer(root)
    writer.add_episodes(*make_batch(np.random.default_rng(12), 2))
    before = snapshot(root)
    with pytest.raises(ValueError, match=match):
        writer.add_episodes(episodes, tasks)
    assert snapshot(root) == before
    assert writer.num_episodes == 2
    writer.add_episodes(*make_batch(np.random.default_rng(13), 1))
    check_dataset(root)


class Killed(BaseException):
    """Stands for the process dying: nothing in the writer catches a BaseException."""


def count_commits(tmp_path: Path, batches) -> list[int]:
    """How many files each call commits (data, metadata, tasks, stats, info)."""
    counts, total = [], [0]
    real = files.commit

    def counting(tmp, path):
        total[0] += 1
        real(tmp, path)

    writer = new_writer(tmp_path / "count", data_files_size_in_mb=0.01, chunks_size=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(files, "commit", counting)
        for batch in batches:
            before = total[0]
            writer.add_episodes(*batch)
            counts.append(total[0] - before)
    return counts


def dying_commit(k: int, rename: bool, renamed: list | None = None):
    """A ``files.commit`` that kills the writer at its ``k``-th commit: before the rename,
    or (``rename``) just after it; ``renamed`` collects the paths committed before."""
    real, seen = files.commit, [0]

    def dying(tmp, path):
        if seen[0] == k:
            if rename:
                real(tmp, path)
            raise Killed
        seen[0] += 1
        if renamed is not None:
            renamed.append(path)
        real(tmp, path)

    return dying


def test_crash_at_every_commit_leaves_a_loadable_dataset(tmp_path):
    rng = np.random.default_rng(14)
    # The third call spans two data files, two metadata files and a new task.
    batches = [make_batch(rng, 3), make_batch(rng, 30, lo=1, hi=4), make_batch(rng, 6, 20, 30)]
    batches[2][1][0] = "a brand new task"
    commits = count_commits(tmp_path, batches)
    assert commits[2] >= 7
    reference = None
    for k in range(commits[2]):
        for rename in (False, True):
            root = tmp_path / f"crash-{k}-{rename}"
            writer = new_writer(root, data_files_size_in_mb=0.01, chunks_size=2)
            writer.add_episodes(*batches[0])
            writer.add_episodes(*batches[1])
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(files, "commit", dying_commit(k, rename))
                with pytest.raises(Killed):
                    writer.add_episodes(*batches[2])
            last_commit = rename and k == commits[2] - 1
            if not rename:
                assert any(".tmp-" in p.name for p in root.rglob("*"))
            d = check_dataset(root, strict=False)
            assert d["info"]["total_episodes"] == (39 if last_commit else 33)
            # Reopening drops the uncommitted tail; the crashed call is then redone.
            writer = LeRobotWriter.open(root)
            assert not any(".tmp-" in p.name for p in root.rglob("*"))
            check_dataset(root, strict=True)
            if not last_commit:
                writer.add_episodes(*batches[2])
            d = check_dataset(root, strict=True)
            assert_stats(d["stats"], d["data"])
            # The same files as a run that never crashed; statistics may differ in the last
            # bits where they were rebuilt from the data files.
            contents = {
                p.relative_to(root).as_posix(): pq.read_table(p)
                if p.suffix == ".parquet"
                else p.read_bytes()
                for p in root.rglob("*")
                if p.is_file() and p.name not in (".jaxtraj-stats.npz", "stats.json")
            }
            if reference is None:
                reference = contents
            assert contents.keys() == reference.keys()
            for name, content in contents.items():
                assert content == reference[name], name


def test_many_small_calls_fill_one_file_up_to_the_cap(tmp_path):
    """Issue 19 item 6: episodes of successive calls follow each other in the current file."""
    rng = np.random.default_rng(21)
    batches = [make_batch(rng, int(rng.integers(1, 4)), lo=2, hi=8) for _ in range(30)]
    episodes = [e for b in batches for e in b[0]]
    tasks = [t for b in batches for t in b[1]]
    for cap in (None, 0.004):  # LeRobot's 100 MB, and about 44 frames a file
        root = tmp_path / f"cap-{cap}"
        writer = new_writer(root, data_files_size_in_mb=cap)
        for batch in batches:
            writer.add_episodes(*batch)
        d = check_dataset(root)
        expected = expected_columns(episodes, tasks)
        for name, values in expected.items():
            np.testing.assert_array_equal(column_to_numpy(d["data"].column(name)), values, name)
        assert_stats(d["stats"], d["data"])
        if cap is None:  # one data file and one episodes-metadata file for the 30 calls
            assert (len(d["data_paths"]), len(d["meta_paths"])) == (1, 1)
            continue
        # Files fill up to the cap and no further; the next episode would have passed it.
        frame = sum(  # bytes a frame as the cap counts them
            np.dtype(s["dtype"]).itemsize * s["shape"][0]
            for s in {**FEATURES, **DEFAULT_FEATURES}.values()
        )
        rows = [pq.ParquetFile(p).metadata.num_rows for p in d["data_paths"]]
        lengths = [len(e["next.done"]) for e in episodes]
        first = np.cumsum([0, *rows])[:-1]
        starts = np.cumsum([0, *lengths])
        for k, n in enumerate(rows):
            assert n * frame <= cap * 2**20
            if k + 1 < len(rows):  # the next file's first episode did not fit here
                after = lengths[int(np.searchsorted(starts, first[k + 1]))]
                assert (n + after) * frame > cap * 2**20
        assert len(rows) >= 4
        # Resumed, a writer goes on filling the last file.
        before = rows[-1]
        writer = LeRobotWriter.open(root)
        writer.add_episodes(*make_batch(rng, 1, lo=2, hi=3))
        after = [pq.ParquetFile(p).metadata.num_rows for p in sorted(root.glob(GLOBS[0]))]
        assert after[:-1] == rows[:-1] and after[-1] > before
        check_dataset(root)


def test_crash_at_every_commit_of_an_appending_call(tmp_path):
    """A call that appends to the committed data file, killed before and after each rename."""
    rng = np.random.default_rng(22)
    batches = [make_batch(rng, 2, lo=2, hi=6) for _ in range(4)]
    batches[3][1][0] = "a brand new task"
    commits = count_commits(tmp_path, batches)
    reference = None
    for k in range(commits[3]):
        for rename in (False, True):
            root = tmp_path / f"crash-{k}-{rename}"
            writer = new_writer(root)
            for batch in batches[:3]:
                writer.add_episodes(*batch)
            renamed = []
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(files, "commit", dying_commit(k, rename, renamed))
                with pytest.raises(Killed):
                    writer.add_episodes(*batches[3])
            if k == 1:  # the data file, rewritten in place of the committed one, comes first
                assert [p.relative_to(root).as_posix() for p in renamed] == [
                    "data/chunk-000/file-000.parquet"
                ]
            last_commit = rename and k == commits[3] - 1
            d = check_dataset(root, strict=False)
            assert d["info"]["total_episodes"] == (8 if last_commit else 6)
            writer = LeRobotWriter.open(root)
            assert not any(files.is_tmp(p) for p in root.rglob("*"))
            d = check_dataset(root, strict=True)
            assert_stats(d["stats"], d["data"])
            if not last_commit:
                writer.add_episodes(*batches[3])
            d = check_dataset(root, strict=True)
            assert_stats(d["stats"], d["data"])
            assert len(d["data_paths"]) == 1
            if reference is None:
                reference = d["data"]
            assert d["data"].equals(reference)


def count_writes(root: Path, batches) -> list[int]:
    """How many files each call writes (parquet, npz and json), before any is renamed."""
    counts = []
    writer = new_writer(root, data_files_size_in_mb=0.01, chunks_size=2)
    for batch in batches:
        with killed_at_write(None) as seen:
            writer.add_episodes(*batch)
        counts.append(seen[0])
    return counts


@contextlib.contextmanager
def killed_at_write(k: int | None):
    """Count file writes; the process "dies" as the k-th write (from 0) starts, if k is given."""
    seen = [0]
    with pytest.MonkeyPatch.context() as mp:
        for owner, name in ((pq, "write_table"), (np, "savez"), (Path, "write_bytes")):
            real = getattr(owner, name)

            def dying(*args, real=real, **kwargs):
                if seen[0] == k:
                    raise Killed
                seen[0] += 1
                return real(*args, **kwargs)

            mp.setattr(owner, name, dying)
        yield seen


def test_killed_while_writing_leaves_only_committed_files(tmp_path):
    """Issue 11: until a call commits, LeRobot's globs find only committed rows.

    The call is killed as each of its files starts to be written (the earlier ones written
    whole), and the folder is then read the way LeRobot reads it: every file the globs match,
    with nothing past info.json's totals.
    """
    rng = np.random.default_rng(17)
    batches = [make_batch(rng, 3), make_batch(rng, 30, lo=1, hi=4), make_batch(rng, 6, 20, 30)]
    batches[2][1][0] = "a brand new task"
    writes = count_writes(tmp_path / "count", batches)
    # Data files, metadata files, tasks, stats.json, the cache and info.json.
    assert writes[2] >= 7
    reference = None
    for k in range(writes[2]):
        root = tmp_path / f"kill-{k}"
        writer = new_writer(root, data_files_size_in_mb=0.01, chunks_size=2)
        writer.add_episodes(*batches[0])
        writer.add_episodes(*batches[1])
        with killed_at_write(k), pytest.raises(Killed):
            writer.add_episodes(*batches[2])
        d = check_dataset(root, strict=True)
        assert (d["info"]["total_episodes"], d["data"].num_rows) == (33, writer.num_frames)
        assert d["episodes"].column("episode_index").to_pylist() == list(range(33))
        writer = LeRobotWriter.open(root)
        assert writer.add_episodes(*batches[2]) == range(33, 39)
        d = check_dataset(root, strict=True)
        assert_stats(d["stats"], d["data"])
        if reference is None:
            reference = d["data"]
        assert d["data"].equals(reference)


def test_publishing_renames_metadata_then_info_last(tmp_path):
    """After the writes, a call only renames: data, tasks, stats, episodes metadata, info.json.

    A kill between two of these renames is the one moment a reader can see rows beyond
    info.json's totals; the episodes metadata, the rows LeRobot indexes, goes just before
    info.json to keep that moment short.
    """
    rng = np.random.default_rng(18)
    writer = new_writer(tmp_path / "ds", data_files_size_in_mb=0.01, chunks_size=2)
    writer.add_episodes(*make_batch(rng, 30, lo=1, hi=4))
    order = []
    real = files.commit

    def recording(tmp, path):
        order.append(path.relative_to(tmp_path / "ds").as_posix())
        real(tmp, path)

    batch = make_batch(rng, 6, 20, 30)
    batch[1][0] = "a brand new task"
    writes_before = []
    publish = files.publish

    def counting_publish(staged):
        writes_before.append(seen[0])
        publish(staged)

    with killed_at_write(None) as seen, pytest.MonkeyPatch.context() as mp:
        mp.setattr(files, "commit", recording)
        mp.setattr(files, "publish", counting_publish)
        writer.add_episodes(*batch)
    assert writes_before == [seen[0]]  # every file was written before the first rename
    kinds = [p.split("/")[0] if p.startswith("data/") else p for p in order]
    data = [p for p in kinds if p == "data"]
    assert len(data) >= 2 and kinds[: len(data)] == data
    assert kinds[len(data) :][:3] == [
        "meta/tasks.parquet",
        "meta/stats.json",
        "meta/.jaxtraj-stats.npz",
    ]
    metadata = kinds[len(data) + 3 : -1]
    assert metadata and all(p.startswith("meta/episodes/") for p in metadata)
    assert kinds[-1] == "meta/info.json"


def damage(root: Path, case: str) -> Path:
    """Break one committed file in the middle of the dataset; return it."""
    if "data" in case:
        path = sorted(root.glob("data/*/*.parquet"))[1]
    else:
        path = sorted(root.glob("meta/episodes/*/*.parquet"))[0]
    if case.startswith("missing"):
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


@pytest.mark.parametrize(
    "case", ["truncated data", "missing data", "truncated episodes", "missing episodes"]
)
def test_resume_refuses_a_damaged_or_missing_committed_file(tmp_path, case):
    """Issue 12: every committed file is checked on open, not only the last data file."""
    root = tmp_path / "ds"
    rng = np.random.default_rng(19)
    writer = new_writer(root, data_files_size_in_mb=0.01, chunks_size=2)
    for _ in range(3):
        writer.add_episodes(*make_batch(rng, 60, lo=1, hi=3))
    assert len(list(root.glob("data/*/*.parquet"))) >= 3
    assert len(list(root.glob("meta/episodes/*/*.parquet"))) >= 2
    path = damage(root, case)
    before = snapshot(root)
    with pytest.raises(ValueError, match=str(path.relative_to(tmp_path))):
        LeRobotWriter.open(root)
    assert snapshot(root) == before


@pytest.mark.parametrize("case", ["truncated", "garbage", "empty"])
def test_resume_rebuilds_a_damaged_stats_cache(tmp_path, case):
    """Issue 13: the statistics cache is only a shortcut; a damaged one is rebuilt."""
    root = tmp_path / "ds"
    rng = np.random.default_rng(20)
    writer = new_writer(root)
    writer.add_episodes(*make_batch(rng, 5))
    cache = root / "meta/.jaxtraj-stats.npz"
    content = cache.read_bytes()
    cache.write_bytes(
        {"truncated": content[: len(content) // 2], "garbage": b"x" * 1000, "empty": b""}[case]
    )
    writer = LeRobotWriter.open(root)
    with np.load(cache) as state:  # rewritten whole
        assert int(state["num_frames"]) == writer.num_frames
    writer.add_episodes(*make_batch(rng, 2))
    d = check_dataset(root)
    assert_stats(d["stats"], d["data"])


SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from jaxtraj.lerobot import LeRobotWriter, files
    features = {features!r}
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "exit":
        # Die for real in the middle of the fourth call, between two file commits.
        real, seen = files.commit, [0]
        def dying(tmp, path):
            seen[0] += 1
            if seen[0] == 3 * 6 + 3:
                os._exit(17)
            real(tmp, path)
        files.commit = dying
    writer = LeRobotWriter(root, fps=10, features=features, robot_type="so101")
    rng = np.random.default_rng(0)
    for call in range(100_000):
        episodes = []
        for _ in range(4):
            length = int(rng.integers(5, 30))
            episodes.append({{
                name: rng.normal(size=(length, spec["shape"][0])).astype(spec["dtype"])
                if spec["dtype"].startswith("float") else np.zeros((length, 1), spec["dtype"])
                for name, spec in features.items()
            }})
        writer.add_episodes(episodes, ["task %d" % (call % 3)] * 4)
        print(call, flush=True)
    """
).format(features=FEATURES)


def run_script(tmp_path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "append_loop.py"
    script.write_text(SCRIPT)
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(tmp_path / "ds")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def check_after_kill_and_resume(root: Path):
    d = check_dataset(root, strict=False)
    committed = d["info"]["total_episodes"]
    assert committed > 0 and committed % 4 == 0
    writer = LeRobotWriter.open(root)
    assert (writer.num_episodes, writer.num_frames) == (committed, d["info"]["total_frames"])
    episodes, tasks = make_batch(np.random.default_rng(15), 3)
    assert writer.add_episodes(episodes, tasks) == range(committed, committed + 3)
    d = check_dataset(root, strict=True)
    assert_stats(d["stats"], d["data"])


def test_process_exits_mid_call(tmp_path):
    proc = run_script(tmp_path, "exit")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 17, err
    assert out.split() == ["0", "1", "2"]
    check_after_kill_and_resume(tmp_path / "ds")


def test_process_sigkilled_while_appending(tmp_path):
    proc = run_script(tmp_path, "loop")
    try:
        # Let it commit a few calls, then kill it wherever it is.
        for _ in range(5):
            assert proc.stdout.readline(), proc.stderr.read()
        time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    check_after_kill_and_resume(tmp_path / "ds")


def test_lerobot_loads_the_dataset(tmp_path, lerobot_dataset):
    """LeRobot's own loader, offline, on a dataset written in two sessions (docs/lerobot.md)."""
    root = tmp_path / "ds"
    rng = np.random.default_rng(16)
    batches = [make_batch(rng, 5), make_batch(rng, 4)]
    new_writer(root, data_files_size_in_mb=0.01, chunks_size=2).add_episodes(*batches[0])
    LeRobotWriter.open(root).add_episodes(*batches[1])
    episodes = batches[0][0] + batches[1][0]
    tasks = batches[0][1] + batches[1][1]
    expected = expected_columns(episodes, tasks)
    lengths = [len(e["next.done"]) for e in episodes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = lerobot_dataset.LeRobotDataset("local/jaxtraj_test", root=root)
        assert len(ds) == sum(lengths)
        assert ds.num_episodes == len(episodes)
        assert ds.meta.total_tasks == len(set(tasks))
        assert ds.fps == FPS
        boundaries = np.cumsum([0, *lengths])
        for i in sorted({0, len(ds) - 1, *boundaries[1:-1], *(boundaries[1:-1] - 1)}):
            item = ds[int(i)]
            ep = int(np.searchsorted(boundaries, i, side="right") - 1)
            assert item["task"] == tasks[ep]
            for name in expected:
                got = np.asarray(item[name]).reshape(-1)
                # LeRobot hands float64 features over as float32 tensors (torch's default).
                want = expected[name][i].reshape(-1).astype(got.dtype)
                np.testing.assert_array_equal(got, want, name)
        for ep in range(len(episodes)):
            row = ds.meta.episodes[ep]
            assert (row["dataset_from_index"], row["dataset_to_index"]) == (
                boundaries[ep],
                boundaries[ep + 1],
            )
            assert row["tasks"] == [tasks[ep]]
        assert ds.meta.stats["observation.state"]["mean"].shape == (6,)
        # Windows stop at episode boundaries, as they do on LeRobot's own datasets.
        windowed = lerobot_dataset.LeRobotDataset(
            "local/jaxtraj_test", root=root, delta_timestamps={"action": [0.0, 0.1]}
        )
        last = int(boundaries[1] - 1)
        assert windowed[last]["action_is_pad"].tolist() == [False, True]
