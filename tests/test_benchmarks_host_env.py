"""Smoke test of benchmarks/host_env.py at tiny sizes (one round of one training step,
Hopper only, no Ray): it runs and writes its JSON with every configuration asked for."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_host_env_benchmark_smoke(tmp_path):
    pytest.importorskip("gymnasium")
    pytest.importorskip("mujoco")
    out = tmp_path / "host_env.json"
    configs = "a,a_adapter,a_collector,b,b_proc,b0_proc,bw_proc,c,a_null,b_null"
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
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    res = json.loads(out.read_text())["results"]["hopper"]
    assert set(res["configs"]) == set(configs.split(","))
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
