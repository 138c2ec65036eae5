"""pmap over sources, and sharded pipeline mode, on 8 simulated CPU devices in their own
process (scripts/multidevice_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "multidevice_check.py"


def test_pmap_over_sources_and_sharded_pipeline_equal_single_device():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pmap over sources == facade" in proc.stdout
    assert "sharded == single-device" in proc.stdout
    assert "per-rank normalisation, sharded == NumPy" in proc.stdout
