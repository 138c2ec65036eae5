"""Strict numerics for every test, as equinox's test suite has them: no implicit rank
promotion, no implicit dtype promotion (``jax_numpy_dtype_promotion="strict"``), and
warnings are errors (``pyproject.toml``).

Both settings are global, set here before any test module runs, so they reach worker
threads too (the runners'). A test marked ``standard_dtype_promotion`` runs under JAX's
standard promotion instead (a thread-local context, the test's own thread): only the
tests listed in ``RELAXED`` below, each with the reason. The multi-device and multi-host
scripts (own processes) set the same flags themselves; the examples run as users run them.

Compiled programs are kept on disk (JAX's persistent compilation cache, in ``.cache/xla``
beside the checkout, ignored by git): a second run of the suite skips XLA's compiles (on
2 cores it took a quarter off the suite's time when measured; a fresh clone's first run
gains nothing measurable; the README gives today's times). A hit is the executable a
compile would give (keyed by the program, the compile options, the devices and the JAX
version), so it changes no result. This process only: the processes the tests start (spawned
env processes, Ray actors, examples, multi-device scripts) compile as users' do. Two of
this process's threads compiling one program at once can read an entry while it is
written; JAX then warns and compiles (``pyproject.toml`` lets that warning pass).
``JAX_COMPILATION_CACHE_DIR`` puts it elsewhere; ``JAX_ENABLE_COMPILATION_CACHE=false``
turns it off.
"""

import os
import pathlib

import jax
import pytest

_XLA_CACHE = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "xla"
jax.config.update("jax_compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(_XLA_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small programs too
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# test node id prefix -> why it needs standard dtype promotion.
RELAXED = {
    # examples/ppo.py trains with optax.adam, whose bias correction (optax
    # scale_by_adam, through optax.tree_utils) mixes an int32 count with float32
    # under strict promotion: a third-party limit, not jaxtraj's.
    "test_ppo.py::": "optax scale_by_adam mixes int32 and float32",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "standard_dtype_promotion(reason): run under JAX's standard dtype promotion",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.nodeid.split("/")[-1]
        for prefix, reason in RELAXED.items():
            if name.startswith(prefix):
                item.add_marker(pytest.mark.standard_dtype_promotion(reason))


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    if request.node.get_closest_marker("standard_dtype_promotion") is None:
        yield
        return
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture
def lerobot_dataset(tmp_path, monkeypatch):
    """LeRobot's ``lerobot.datasets.lerobot_dataset``, offline (no hub, a private
    ``HF_HOME``); the test is skipped where LeRobot is not installed (docs/lerobot.md)."""
    import warnings

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("lerobot.datasets.lerobot_dataset")
