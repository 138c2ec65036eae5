"""Smoke test of benchmarks/host_env.py at tiny sizes (one round of one training step,
Hopper only, no Ray): it runs and writes its JSON with every configuration asked for."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_host_env_benchmark_smoke(tmp_path):
    pytest.importorskip("gymnasium")
    pytest.importorskip("mujoco")
    out = tmp_path / "host_env.json"
    configs = "a,a_adapter,a_collector,a_threads,b,b_proc,b0_proc,bw_proc,c,a_null,b_null"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "host_env.py"),
            "--envs",
            "hopper",
            "--configs",
            configs,
            "--rounds",
            "1",
            "--steps",
            "1",
            "--out",
            str(out),
            "--no-scaling",
            "--settle-s",
            "5",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    res = json.loads(out.read_text())["results"]["hopper"]
    assert set(res["configs"]) == set(configs.split(","))
    assert 0 <= res["settled_s"] < 10  # waited for a quiet machine, at most --settle-s
    for entry in res["configs"].values():
        assert entry["steps_per_s_median"] > 0
    assert 0 < res["configs"]["b"]["collector_share_median"] < 1
    # CPU per training step: the env processes of b_proc step the envs, so they use CPU.
    assert res["configs"]["b_proc"]["env_process_cpu_ms_per_training_step_median"] > 0
    assert all(e["cpu_ms_per_training_step_median"] > 0 for e in res["configs"].values())
    # batch_wait_s="auto" (b, b_proc): Hopper's env processes compute, so it waited.
    auto = res["configs"]["b_proc"]
    assert sum(auto["env_cpu_share"]) / 2 >= 0.5 and auto["batch_wait_ms"] > 0
    assert "batch_wait_ms" in res["configs"]["b"] and "batch_wait_ms" not in res["configs"]["b0_proc"]


def test_env_scaling_probe_times_one_and_two_env_processes():
    pytest.importorskip("gymnasium")
    pytest.importorskip("mujoco")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import host_env
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    sc = host_env.env_scaling(host_env.ENVS["hopper"], steps=1, reps=1)
    alone, two = sc["alone_B"]["ms_per_training_step"], sc["two_halves_at_once"]["ms_per_training_step"]
    assert alone > 0 and two > 0 and sc["alone_half"]["cpu_ms_per_training_step"] > 0
    assert sc["speedup_2_processes"] == pytest.approx(alone / two)
    assert "stepping two processes at once" in host_env.scaling_line("hopper", sc)


def test_env_scaling_reports_the_ceilings_of_split_pools_and_four_ranks(monkeypatch):
    """EnvPool also with each B/2 pool on one thread, the 1 ms env also as four B/4 at
    once: each probe's slowest process sets its pace, each ceiling is B alone over it
    (the probes stood in for by fixed timings: the processes are the test above's)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import host_env
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    asked = []

    def probe(kind, task, sizes, steps, threads=None):
        asked.append((kind, tuple(sizes), threads))
        ms = {(16,): 60.0, (8,): 40.0, (8, 8): 70.0, (2, 2, 2, 2): 10.0}.get(tuple(sizes), 80.0)
        return [(ms + n, ms) for n in range(len(sizes))]  # the last one the slowest

    monkeypatch.setattr(host_env, "_probe", probe)
    monkeypatch.setattr(host_env, "_async_probe", lambda task, n, steps, reps: (50.0, 62.5))
    pool = host_env.env_scaling({"kind": "envpool", "task": "T", "B": 16}, steps=1, reps=1)
    assert pool["speedup_async_two_groups"] == pytest.approx(0.8)  # hand loop 50 ms / 62.5
    assert "one asynchronous pool of B, the policy inline, nothing collected, 0.80x" in (
        host_env.scaling_line("halfcheetah", pool))
    assert ("envpool", (8, 8), 1) in asked and ("envpool", (8, 8), None) in asked
    assert pool["two_halves_at_once"]["ms_per_training_step"] == 71.0
    assert pool["speedup_2_processes_one_thread"] == pytest.approx(60.0 / 71.0)
    assert "four_quarters_at_once" not in pool
    assert "with one EnvPool thread each 0.85x" in host_env.scaling_line("halfcheetah", pool)
    asked.clear()
    sleep = host_env.env_scaling({"kind": "sleep", "task": "S", "B": 8}, steps=1, reps=1)
    assert [a for a in asked if a[1] == (2, 2, 2, 2)] == [("sleep", (2, 2, 2, 2), None)]
    assert sleep["four_quarters_at_once"]["ms_per_training_step"] == 13.0
    assert sleep["speedup_4_processes"] == pytest.approx(40.0 / 13.0)  # B = 8 alone: 40 ms
    assert "two_halves_at_once_one_thread_each" not in sleep
    assert "four B/4 at once 3.08x" in host_env.scaling_line("sleep1ms", sleep)


def test_async_groups_probe_steps_two_groups_over_one_pool():
    """EnvPool's asynchronous API, two groups of B/2 over one pool of B, against the hand
    loop over a pool of B: both time a training step (a tiny one here)."""
    pytest.importorskip("envpool")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import host_env
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    class Out:
        def put(self, item):
            self.item = item

    out = Out()
    with jax.numpy_rank_promotion("allow"):  # the benchmark's policy broadcasts its biases
        host_env._async_groups("HalfCheetah-v4", 4, 1, 1, out)
    hand, groups = out.item
    assert 0 < hand < 60_000 and 0 < groups < 60_000


def test_targets_report_what_the_cpu_used_allows():
    """A configuration's CPU ceiling: (a)'s ms per training step over its CPU per step
    (its process's and its env processes') spread over the cores; none for Ray's, whose
    actors' CPU is not counted."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import host_env
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cfg = {
        "a": {"ms_per_training_step_median": 20.0, "cpu_ms_per_training_step_median": 30.0,
              "steps_per_s": [100.0, 110.0]},
        "b": {"ms_per_training_step_median": 40.0, "cpu_ms_per_training_step_median": 50.0,
              "steps_per_s": [50.0, 55.0]},
        "b_proc": {"ms_per_training_step_median": 30.0, "cpu_ms_per_training_step_median": 10.0,
                   "env_process_cpu_ms_per_training_step_median": 40.0,
                   "steps_per_s": [60.0, 70.0]},
        "d_direct": {"ms_per_training_step_median": 30.0, "cpu_ms_per_training_step_median": 5.0,
                     "steps_per_s": [60.0, 66.0]},
    }
    rows = host_env.targets({"halfcheetah": {"configs": cfg}, "hopper": {"configs": cfg}},
                            "machine", cpus=2)
    got = {(t["env"], t["config"], t["reference"]): t for t in rows}
    b = got[("halfcheetah", "b", "a")]
    assert b["ratio"] == pytest.approx(0.5) and b["status"] == "missed"
    assert b["cpu_ceiling"] == pytest.approx(20.0 / (50.0 / 2))  # 0.8x: 1.0x out of reach
    assert got[("halfcheetah", "b_proc", "a")]["cpu_ceiling"] == pytest.approx(20.0 / 25.0)
    assert got[("hopper", "d_direct", "b")]["cpu_ceiling"] is None
    table = host_env.targets_table(rows)
    assert "| CPU allows |" in table and "| 0.80x |" in table
    assert "threads_allow" not in b  # no (a2) measured


def test_targets_report_what_two_bare_threads_allow():
    """Beside the runner of 2 thread ranks: (a2), two hand loops of B/2 in two threads at
    once, against the same reference, the median of its per-round ratios; none beside a
    runner of env processes."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import host_env
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cfg = {
        "a": {"ms_per_training_step_median": 20.0, "steps_per_s": [100.0, 100.0, 100.0]},
        "a_threads": {"ms_per_training_step_median": 15.0, "steps_per_s": [120.0, 170.0, 125.0]},
        "b": {"ms_per_training_step_median": 19.0, "steps_per_s": [105.0, 110.0, 100.0]},
        "b_proc": {"ms_per_training_step_median": 18.0, "steps_per_s": [110.0, 112.0, 111.0]},
    }
    rows = host_env.targets({"hopper": {"configs": cfg}}, "machine")
    got = {(t["env"], t["config"], t["reference"]): t for t in rows}
    assert got[("hopper", "b", "a")]["threads_allow"] == pytest.approx(1.25)  # 1.2, 1.7, 1.25
    assert "threads_allow" not in got[("hopper", "b_proc", "a")]
    table = host_env.targets_table(rows)
    assert "| threads allow |" in table and "| 1.25x |" in table
