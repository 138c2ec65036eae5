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
    configs = "a,a_adapter,a_collector,b,b_proc,c,a_null,b_null"
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
