"""The env process's wire: a chunk's step crosses as bytes, not pickles, where it holds
numeric arrays only, and arrives as it left (checked against the same env stepped here)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtraj import EnvTransition, TrajectoryKey
from jaxtraj.runners.bound import _FIELDS, ProcessBoundEnv
from jaxtraj.runners.service import EnvStep

Pair = collections.namedtuple("Pair", ["left", "right"])
CASES = 12
PICKLED = {4, 5, 11}  # the cases that cannot cross as bytes


class WireEnv:
    """A stand-in whose EnvStep changes with the chunk (the cases the wire must carry),
    each a function of the key and the actions alone; the actions come back in ``info``."""

    def reset(self):
        return {"state": np.zeros((3, 2), np.float32)}

    def step(self, key, actions):
        c, n = key.chunk_id, key.step_id  # n: a step's rows, for shapes that change
        rows = 3 if n == 0 else n
        x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + c
        obs = {"state": x, "b_image": np.full((rows, 2, 2, 3), c % 251, np.uint8)}
        flags = (np.arange(rows * 4).reshape(rows, 4) + c) % 7 == 0
        tr = EnvTransition(
            rewards=actions.reshape(rows, 4, -1).sum(-1).astype(np.float32),
            terminations=flags,
            truncations=np.zeros((rows, 4), bool),
        )
        final_obs, info, action_obs = obs, {"echo": actions.copy()}, None  # obs aliased
        case = c % CASES
        if case == 1:  # an episode ended: a final observation of its own
            final_obs = {k: v + 1 for k, v in obs.items()}
        elif case == 2:  # other dtypes, a 0-d array
            info.update(
                f64=x.astype(np.float64) / 3,
                i64=np.arange(rows, dtype=np.int64) - c,
                scalar=np.array(c, np.int32),
                none_left=None,
            )
        elif case == 3:  # views: transposed, Fortran-ordered
            obs = {"state": np.asfortranarray(x), "b_image": obs["b_image"].transpose(0, 2, 1, 3)}
            final_obs = {"state": x.T.copy().T, "b_image": obs["b_image"]}
        elif case == 4:  # a Python float: pickled
            info["python_float"] = float(c)
        elif case == 5:  # an object array: pickled
            info["names"] = np.array([f"env{i}" for i in range(rows)], dtype=object)
        elif case == 6:  # a custom node, per-action observations
            action_obs = Pair(np.repeat(x[:, None], 4, 1), np.ones((rows, 4), np.int16) * c)
        elif case == 7:  # complex values, an empty array
            info.update(z=x.astype(np.complex64) * 1j, empty=np.zeros((rows, 0), np.float32))
        elif case == 8:  # big-endian
            info.update(be=x.astype(">f4"), bz=x.astype(">c16"))
        elif case in (9, 10):  # keys equal but not the same: True, then 1
            info["flag"] = {True if case == 9 else 1: x}
        elif case == 11:  # keys JAX cannot sort: pickled (the process goes on)
            info.update({1: x, "a": x})
        return EnvStep(
            transition=tr, obs=obs, final_obs=final_obs, action_obs=action_obs, info=info
        )


def _same_leaf(g, w, where):
    assert type(g) is type(w), where
    if isinstance(w, dict):  # keys by type too (1 and True are one key to a tree's structure)
        assert [type(k) for k in g] == [type(k) for k in w] and list(g) == list(w), where
        for k in w:
            _same_leaf(g[k], w[k], (where, k))
    elif isinstance(w, np.ndarray):
        assert g.dtype == w.dtype and g.shape == w.shape, where
        assert g.flags.writeable, where  # the stand-in's arrays are
        if w.dtype == object:
            assert g.tolist() == w.tolist(), where
        else:
            assert g.tobytes() == np.ascontiguousarray(w).tobytes(), where
    else:
        assert g == w, where


def _check_same(got, want, where):
    assert type(got) is EnvStep, where
    # info key by key (JAX cannot flatten every dict: keys of mixed types), each key's type
    # too (1 and True are one key to JAX's tree structure, not to the env)
    name = lambda k: f"{type(k).__name__} {k!r}"  # noqa: E731
    got_info = {name(k): v for k, v in got.info.items()}
    want_info = {name(k): v for k, v in want.info.items()}
    assert sorted(got_info) == sorted(want_info), where
    for k in want_info:
        _same_leaf(got_info[k], want_info[k], (where, k))
    fields = lambda s: tuple(getattr(s, f) for f in _FIELDS if f != "info")  # noqa: E731
    got_leaves, got_def = jax.tree.flatten(fields(got))
    want_leaves, want_def = jax.tree.flatten(fields(want))
    assert got_def == want_def, where
    for g, w in zip(got_leaves, want_leaves):
        _same_leaf(g, w, where)
    # The same array twice is one array on arrival (as pickled): the final observation
    # is the observation where no episode ended. (Its dict may be a new one.)
    assert (got.final_obs["state"] is got.obs["state"]) == (
        want.final_obs["state"] is want.obs["state"]
    ), where
    assert (got.info["echo"] is got.obs["state"]) == (want.info["echo"] is want.obs["state"])


class _Tags:
    """The parent's end of the pipe, recording each reply's first byte."""

    def __init__(self, conn):
        self.conn, self.tags = conn, []

    def recv_bytes(self):
        data = self.conn.recv_bytes()
        self.tags.append(data[:1])
        return data

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_a_step_arrives_as_it_left_whatever_it_holds():
    here, there = WireEnv(), ProcessBoundEnv(WireEnv, "env_worker_0")
    try:
        there.reset()
        there._conn = wire = _Tags(there._conn)
        rng = np.random.default_rng(0)
        dtypes = (np.float32, np.float64, np.int32, np.dtype(">f8"))
        # Each case twice with one actions dtype (a template, then bytes read with it; the
        # values differ), 40 shapes (more templates than either side keeps), then the
        # first shape's cases again.
        keys = [(0, c + r * CASES, dtypes[c % 4]) for c in range(CASES) for r in (0, 1)]
        keys += [(n, c, np.float32) for n in range(1, 41) for c in (0, 1)]
        keys += [(0, c + r * CASES, np.float32) for c in range(CASES) for r in (0, 1)]
        keys += [(0, c, np.float32) for c in (9, 10, 9, 10)]  # True, 1, True, 1
        seen = collections.defaultdict(set)  # case -> the tags its replies came with
        for n, c, dtype in keys:
            key = TrajectoryKey(n, 0, 0, 0, c)
            rows = 3 if n == 0 else n
            actions = (rng.standard_normal((rows, 4, 2)) * 4).astype(dtype)
            there.send("step", key, actions)
            got = there.receive()
            seen[c % CASES].add(wire.tags[-1])
            _check_same(got, here.step(key, actions.copy()), (n, c))
            assert got.info["echo"].dtype == dtype and np.array_equal(got.info["echo"], actions)
            assert there.cpu_share is None or 0.0 <= there.cpu_share <= 1.0
        # Every case that can crossed as bytes, read with its template; the others pickled.
        assert {c for c in range(CASES) if b"R" in seen[c]} == set(range(CASES)) - PICKLED
        assert all(seen[c] == {pickle_tag} for c in PICKLED for pickle_tag in [b"\x80"])
        # Actions that are not numpy (a device array): pickled, as any call's arguments.
        key, actions = TrajectoryKey(0, 0, 0, 0, 0), jnp.ones((3, 4, 2), jnp.float32)
        got = there.call("step", key, actions)
        _check_same(got, here.step(key, np.asarray(actions)), "jax actions")
        # A step still in flight when the env is closed: its result is read past, not
        # taken for close()'s answer.
        there.send("step", key, np.ones((3, 4, 2), np.float32))
    finally:
        there.close()
    assert not there._process.is_alive()


def test_a_step_that_fails_is_raised_after_compact_ones():
    env = ProcessBoundEnv(FailsAt, "env_worker_1")
    try:
        for c in range(3):
            env.call("step", TrajectoryKey(0, 0, 0, 0, c), np.zeros((3, 4, 2), np.float32))
        with pytest.raises(RuntimeError, match="simulator crashed") as info:
            env.call("step", TrajectoryKey(0, 0, 0, 0, 3), np.zeros((3, 4, 2), np.float32))
        assert "in the env's process" in "".join(info.value.__notes__)
        # And the wire goes on: the next step's compact result is read as before.
        got = env.call("step", TrajectoryKey(0, 0, 0, 0, 8), np.ones((3, 4, 2), np.float32))
        _check_same(
            got,
            WireEnv().step(TrajectoryKey(0, 0, 0, 0, 8), np.ones((3, 4, 2), np.float32)),
            "after the failure",
        )
    finally:
        env.close()


def test_a_call_while_a_step_is_in_flight_gets_its_own_reply():
    """A call made while a send is in flight (a runner's on_flush reading the env mid-run)
    gets its own reply, not the step's; the step's result (or its error) is kept for
    receive(), which says it is in already."""
    env, here = ProcessBoundEnv(FailsAt, "env_worker_0"), WireEnv()
    key = lambda c: TrajectoryKey(0, 0, 0, 0, c)  # noqa: E731
    ones, twos = np.ones((3, 4, 2), np.float32), np.full((3, 4, 2), 2, np.float32)
    try:
        for c in range(2):  # a template first, then compact bytes
            env.send("step", key(c), ones)
            assert not env.received_early
            got = env.call("step", key(5 + c), twos)  # mid-flight
            _check_same(got, here.step(key(5 + c), twos.copy()), ("call", c))
            assert env.received_early
            _check_same(env.receive(), here.step(key(c), ones.copy()), ("in flight", c))
            assert not env.received_early
        env.send("step", key(3), ones)  # fails in the env's process
        _check_same(env.call("step", key(6), twos), here.step(key(6), twos.copy()), "after")
        with pytest.raises(RuntimeError, match="simulator crashed"):
            env.receive()
        _check_same(env.call("step", key(7), ones), here.step(key(7), ones.copy()), "then")
    finally:
        env.close()


class FailsAt(WireEnv):
    def step(self, key, actions):
        if key.chunk_id == 3:
            raise RuntimeError("simulator crashed")
        return super().step(key, actions)


class Point:
    """A tree node that only the env's process registers (in the env's constructor)."""

    def __init__(self, x, y):
        self.x, self.y = x, y


_REGISTERED = []


class ChildNodeEnv(WireEnv):
    def __init__(self):
        if not _REGISTERED:
            jax.tree_util.register_pytree_node(
                Point, lambda p: ((p.x, p.y), None), lambda _, xy: Point(*xy)
            )
            _REGISTERED.append(True)

    def step(self, key, actions):
        out = super().step(key, actions)
        x = out.obs["state"]
        return dataclasses.replace(out, obs={**out.obs, "point": Point(x, 2 * x)})


def test_a_tree_this_side_reads_otherwise_is_pickled_from_then_on():
    # Point is registered in the env's process only: here it is a leaf, so its template
    # cannot be read here, and the env's process is asked to pickle every reply instead.
    assert not _REGISTERED
    env = ProcessBoundEnv(ChildNodeEnv, "env_worker_0")
    try:
        env._conn = wire = _Tags(env._conn)
        for c in range(4):
            key, actions = TrajectoryKey(0, 0, 0, 0, c), np.full((3, 4, 2), c, np.float32)
            got = env.call("step", key, actions)
            want = WireEnv().step(key, actions)
            assert isinstance(got.obs["point"], Point)
            assert np.array_equal(got.obs["point"].x, want.obs["state"])
            assert np.array_equal(got.obs["point"].y, 2 * want.obs["state"])
            assert np.array_equal(got.transition.rewards, want.transition.rewards)
        assert wire.tags == [b"T", b"\x80", b"\x80", b"\x80"]
    finally:
        env.close()


class SchedEnv(WireEnv):
    """Reports the scheduling policy of the thread that built it, and of a thread it
    started while being built (as EnvPool starts its pool's threads)."""

    def __init__(self, default_policy: bool = False):
        if default_policy:  # what a factory that wants the default back does
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        seen = []
        thread = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        thread.start()
        thread.join()
        self.built = (os.sched_getscheduler(0), seen[0])

    def policies(self):
        return self.built, os.sched_getscheduler(0)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_an_env_process_runs_under_sched_batch_unless_its_factory_says_otherwise():
    before = os.sched_getscheduler(0)
    if before != os.SCHED_OTHER:
        pytest.skip(f"the tests run under scheduling policy {before}, not the default")
    env = ProcessBoundEnv(SchedEnv, "sched")
    try:
        assert env.policies() == ((os.SCHED_BATCH, os.SCHED_BATCH), os.SCHED_BATCH)
    finally:
        env.close()
    env = ProcessBoundEnv(functools.partial(SchedEnv, True), "sched_default")
    try:
        assert env.policies() == ((os.SCHED_OTHER, os.SCHED_OTHER), os.SCHED_OTHER)
    finally:
        env.close()
    assert os.sched_getscheduler(0) == before  # the runner's process is left as it was


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_an_env_process_keeps_a_policy_it_inherited():
    """Started from a thread under SCHED_IDLE (a policy set on purpose, as a real-time one
    would be), the env's process keeps it: only the default policy is changed."""
    seen = []

    def start():  # a thread of its own: the policy is per thread, the child inherits it
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            env = ProcessBoundEnv(SchedEnv, "sched_idle")
            try:
                seen.append(env.policies())
            finally:
                env.close()
        except BaseException as exc:  # noqa: BLE001 (raised below)
            seen.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    if isinstance(seen[0], BaseException):
        raise seen[0]
    assert seen[0] == ((os.SCHED_IDLE, os.SCHED_IDLE), os.SCHED_IDLE)


def _outcome(fn):
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001
        return exc


class ExitsAt(WireEnv):
    def step(self, key, actions):
        if key.chunk_id == 3:
            raise SystemExit("the simulator called sys.exit")
        return super().step(key, actions)


def test_replies_in_flight_stay_with_their_sends_whoever_reads_them():
    """Replies in flight go to their own sends whoever reads the pipe: close() with a
    failing step in flight does not raise the step's error; a template this side cannot
    read, read off by a call, still switches the wire to pickles; another thread's calls
    beside a loop that sends, polls and receives; a step that raised SystemExit, read off
    by another thread's call, is raised by its receive() (not lost, no hang)."""
    key = lambda c: TrajectoryKey(0, 0, 0, 0, c)  # noqa: E731
    ones, twos = np.ones((3, 4, 2), np.float32), np.full((3, 4, 2), 2, np.float32)
    env = ProcessBoundEnv(FailsAt, "env_worker_0")
    env.send("step", key(3), ones)  # fails in the env's process
    env.close()  # the env's own close() did not fail: nothing raised

    env = ProcessBoundEnv(ChildNodeEnv, "env_worker_0")
    try:
        for c in range(3):
            env.send("step", key(c), np.full((3, 4, 2), c, np.float32))
            got = env.call("step", key(8 + c), np.full((3, 4, 2), 8 + c, np.float32))
            want = WireEnv().step(key(8 + c), np.full((3, 4, 2), 8 + c, np.float32))
            assert np.array_equal(got.obs["point"].x, want.obs["state"])
            assert env.received_early
            want = WireEnv().step(key(c), np.full((3, 4, 2), c, np.float32))
            assert np.array_equal(env.receive().obs["point"].x, want.obs["state"])
    finally:
        env.close()

    env, here = ProcessBoundEnv(FailsAt, "env_worker_0"), WireEnv()
    errors, stop = [], threading.Event()

    def caller():
        j = 0
        try:
            while not stop.is_set():
                c = 12 * (1 + j % 5) + (j % 12 if j % 12 != 3 else 4)
                _check_same(env.call("step", key(c), twos), here.step(key(c), twos.copy()),
                            ("call", c))
                j += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        for c in range(60):
            if c % 12 == 3:
                continue
            env.send("step", key(c), ones)
            while not env.ready():
                env.connection.poll(0.005)
            _check_same(env.receive(), here.step(key(c), ones.copy()), ("loop", c))
    finally:
        stop.set()
        thread.join()
        env.close()
    assert not errors, errors

    env = ProcessBoundEnv(ExitsAt, "env_worker_0")
    try:
        env.send("step", key(3), ones)
        called = []
        thread = threading.Thread(target=lambda: called.append(
            _outcome(lambda: env.call("step", key(1), ones))))
        thread.start()
        thread.join(30)
        _check_same(called[0], here.step(key(1), ones.copy()), "the call")
        got = []
        thread = threading.Thread(target=lambda: got.append(_outcome(env.receive)), daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "receive() hung: the step's outcome was lost"
        assert isinstance(got[0], SystemExit)
    finally:
        env.close()


class PacedEnv(WireEnv):
    """Chunk 20's step waits (about none of it on CPU), chunk 21's computes (about all)."""

    def step(self, key, actions):
        if key.chunk_id == 20:
            time.sleep(0.2)
        if key.chunk_id == 21:
            end = time.perf_counter() + 0.2
            while time.perf_counter() < end:
                pass
        return super().step(key, actions)


def test_a_steps_cpu_share_is_its_own_whatever_calls_follow():
    """step_share (what the runner's batch_wait_s="auto" reads) is the share of the step
    receive() returned, not of a call another thread made since (cpu_share: the last
    call's), also where the step's result was read off by that call."""
    env = ProcessBoundEnv(PacedEnv, "env_worker_0")
    ones = np.ones((3, 4, 2), np.float32)
    try:
        env.send("step", TrajectoryKey(0, 0, 0, 0, 20), ones)
        env.receive()
        assert env.step_share is not None and env.step_share < 0.5
        env.call("step", TrajectoryKey(0, 0, 0, 0, 21), ones)  # another thread's, say
        assert env.cpu_share > 0.5 and env.step_share < 0.5
        env.send("step", TrajectoryKey(0, 0, 0, 0, 20), ones)
        env.call("step", TrajectoryKey(0, 0, 0, 0, 21), ones)  # reads the step off first
        env.receive()
        assert env.step_share < 0.5
    finally:
        env.close()
