"""Host simulators through the runners: environment steps per second against a plain
hand-written loop over the same vector env, the same jitted policy and the same chunking.

Three environments:

- ``hopper``: gymnasium Hopper-v5, ``gymnasium.make_vec(..., vectorization_mode="sync")``
  through :class:`jaxtraj.envs.GymnasiumEnv`, B = 8 environments in all (CPU-bound);
- ``halfcheetah``: EnvPool HalfCheetah-v4 (host API) through
  :class:`jaxtraj.envs.EnvPoolEnv`, B = 16 (CPU-bound);
- ``sleep1ms``: a latency-bound env, B = 8: a gymnasium ``SyncVectorEnv`` of sub-envs
  whose every step sleeps 1 ms (a stand-in for a remote simulator or a robot's control
  period; trivial dynamics, Hopper's shapes, 200-step episodes), through
  :class:`~jaxtraj.envs.GymnasiumEnv`. A vector env of ``n`` steps in ``n`` ms.

Every configuration runs the same jitted MLP Gaussian policy (2 x 64, tanh: an action
chunk ``[B, K, A]``, its log-probabilities ``[B, K]``, a value ``[B]``), a separate jitted
``value_fn`` for terminal inference (an epoch's last chunk and chunks that truncate an
episode), ``K = 4`` actions per chunk, ``T = 16`` chunks per training step, ``E = 1``:

- ``a``: the floor, a hand-written loop over one vector env of B: per chunk
  ``policy(obs) -> actions`` then K env steps (ended envs reset at once, as the adapters
  do), ``value_fn`` where a chunk needs it; no collector, no adapter;
- ``a_adapter``: the same loop stepping the adapter (``env.step(key, actions)``), to
  isolate the adapter's cost;
- ``a_collector`` (a'): loop ``a`` feeding ``TrajectoryCollector.add`` both halves of
  every chunk (rollout mode, flushed each step), to isolate the collector's cost;
- ``a_threads`` (a2): loop ``a`` twice over B/2, in two threads of this process at once,
  each with its own policy calls: about the most two thread ranks of the env could do
  here, the GIL included, with no hand-off, no call shared and nothing collected (not a
  strict bound on ``b`` and ``c``: its loops call the policy on B/2 rows each);
- ``b``: :class:`~jaxtraj.runners.threads.AsyncRunner`, two env ranks (two vector envs
  of B/2 each, each given as a factory, as the guides show: built in a thread of its own,
  which runs the rank's loop), ``value_fn`` on the policy side, ``run(num_steps=1)`` per
  training step;
  one ``policy_fn`` call serves the ranks ready (B rows, as the hand loop's), its default
  ``batch_wait_s="auto"`` (a wait where the ranks' envs compute, none where they wait:
  the wait it chose is recorded, ``batch_wait_ms``);
- ``b_proc``: ``b`` with ``env_workers="process"``: each rank's env built from a
  factory in a process of its own, the thread calling ``run`` serving both through their
  pipes and inserting the halves (a gymnasium step is Python holding the GIL: only
  processes step two in parallel);
- ``b0_proc``: ``b_proc`` with ``batch_wait_s=0``: no rank waits for another (the default
  before ``"auto"``);
- ``bw_proc``: ``b_proc`` with ``batch_wait_s=0.005``: a request waits up to 5 ms for
  the other rank's when that one is expected back within it (the ranks fall into step,
  one ``policy_fn`` call a chunk instead of up to two: less CPU, where CPUs are short);
- ``b1``, ``b1_proc``: ``b`` and ``b_proc`` with one env rank of B (``halfcheetah``
  only: EnvPool's own threads step the B envs on every core, as in the hand loop; what
  is left to overlap is inference and the collector's work);
- ``bt``, ``bt_proc``: ``b`` and ``b_proc`` with each rank's pool given its share of the
  cores (``num_threads`` = CPUs / ranks; ``halfcheetah`` only): EnvPool's default is a
  thread per core in every pool, so two ranks on two cores run four stepping threads;
- ``b4``, ``b4_proc``: ``b`` and ``b_proc`` with four env ranks of B/4 (``sleep1ms``
  only);
- ``c``, ``c_proc``: :class:`~jaxtraj.runners.threads.DecoupledRunner`, the same setups;
- ``d``: :class:`~jaxtraj.runners.ray.RayRunner`, two actors (each builds its adapter),
  policy and ``value_fn`` in the learner, one inference for the ranks whose observation
  is in (its default ``batch_wait_s="auto"``, as ``b``'s), ``transport="ray"`` (a Ray
  actor call per chunk); ``ray.init(num_cpus=2, ...)``;
- ``d_direct``: ``d`` with ``transport="direct"`` (what the default, ``"auto"``,
  picks where the actors reach the learner): each actor connects back to the learner once and the chunks go
  both ways on that connection (Ray places, restarts and kills the actors), instead of a
  Ray actor call per chunk;
- ``d_actor``: the same with the policy in the actors (``policy="actor"``, its default
  ``chunks_per_call``: one call of a training step's T chunks per actor);
- ``d4``, ``d4_direct``, ``d4_actor``: ``d``, ``d_direct`` and ``d_actor`` with four actors of B/4 (``sleep1ms``
  only; an eighth of a CPU each, so that the three sets of actors, alive across the
  rounds, fit in ``ray.init(num_cpus=2)``);
- ``a_1core``, ``b_1core``: ``a`` and ``b`` with every thread of this process pinned to
  one CPU (``os.sched_setaffinity``): what overlapping two ranks' env work with inference
  buys with a second core (not ``--quick``).

Measured in alternating rounds (each round runs every configuration once, rotating the
order; a repetition is ``--steps`` training steps after a warm-up, after which the
benchmark waits, at most ``--settle-s``, for the machine to be quiet: in one run every
runner configuration's first rounds read a third low), reported as medians;
the ratio to ``a`` is taken per round. The collector's share is the time spent inside
``collector.add`` (flushes included) and ``collector.check_structure`` over the wall
time (measured in whichever thread calls them: in the threaded runners that includes
waiting for the GIL).

``--camera`` adds each environment again with a drawn 64x64x3 uint8 image in the
observation (a few pixels set from the state: MuJoCo cannot render here).

Targets (issue 26), each printed as met or missed with the measured median ratio and the
machine, for AsyncRunner with thread workers and with process workers alike: ``b`` /
``b_proc`` (and ``bw_proc``) at least 1.0x ``a`` on ``hopper`` and ``halfcheetah``; on
``sleep1ms`` ``b`` / ``b_proc`` at least 1.8x ``a``, ``b4`` / ``b4_proc`` at least 3.4x
and ``d4`` / ``d4_direct`` / ``d4_actor`` at least 3x; ``d``, ``d_direct`` and ``d_actor``
(Ray with several chunks in flight per rank) at least 0.9x ``b`` and ``b_proc`` on
``hopper`` (the ratio per round of the two, measured side by side). Beside each, what
the CPU the configuration used allows (``cpu_ceiling``): the reference's wall time over
the configuration's CPU per training step (its process's threads and its env processes)
spread over every core, every core busy every moment; no schedule runs faster at that
CPU. Not for Ray's configurations, whose actors' CPU is not counted. Beside ``b``, what
two threads allow (``threads_allow``): ``a_threads`` against the reference, the median
of its per-round ratios.

What the machine allows (``env_scaling``, not ``--quick``): each env's raw vector env (no
adapter, no policy) stepping a training step's ``T * K`` vector steps with random
actions, in fresh processes: one of B (the hand loop's), one of B/2 alone, and two of B/2
at once. ``speedup_2_processes`` (B alone over the slower of the two at once) is what
stepping two ranks in parallel processes gains on the env's own work: near or below 1,
two env processes on this machine step no faster than one process of both (EnvPool's own
threads already use every core; or the VM's two vCPUs share one core's time), and the
runners can only gain what inference takes. EnvPool again with each B/2 pool on one
thread (``speedup_2_processes_one_thread``: the cores split between the ranks, as
``bt`` / ``bt_proc`` split them), and the 1 ms env as four B/4 at once
(``speedup_4_processes``): each a ceiling, the most a runner of those ranks could gain
over (a)'s env stepping with inference and collection free. EnvPool also through its
own asynchronous API (``speedup_async_two_groups``): two groups of B/2 over one pool of
B, each group's next step sent as soon as its last is back and the policy run on a
group's rows while the pool steps the other, nothing collected, against the hand loop
with the same policy, alternating in one process: the leanest overlap two ranks could
have over one pool, with no runner, adapter or collector in it.

    python benchmarks/host_env.py [--quick] [--camera] [--rounds 11] [--steps 4]

Writes ``benchmarks/results/host_env.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import statistics
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from collect import machine  # noqa: E402

import jaxtraj  # noqa: E402
from jaxtraj import (  # noqa: E402
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectoryPlan,
    TrajectorySource,
)
from jaxtraj.envs import EnvPoolEnv, EnvSpec, GymnasiumEnv, check_spec, example_parts  # noqa: E402
from jaxtraj.runners.service import key_rngs  # noqa: E402
from jaxtraj.runners.threads import AsyncRunner, DecoupledRunner, EnvStep  # noqa: E402

K, T, E, HIDDEN = 4, 16, 1, 64
IMAGE = (64, 64, 3)
f32 = jnp.float32

ENVS = {
    "hopper": dict(kind="gymnasium", task="Hopper-v5", B=8),
    "halfcheetah": dict(kind="envpool", task="HalfCheetah-v4", B=16),
    "sleep1ms": dict(kind="sleep", task="Sleep1ms", B=8),
}
CONFIGS = [
    "a", "a_adapter", "a_collector", "a_threads", "b", "b_proc", "b0_proc", "bw_proc", "b1",
    "b1_proc", "bt", "bt_proc", "b4", "b4_proc", "c",
    "c_proc", "d", "d_direct",
    "d_actor", "d4", "d4_direct", "d4_actor", "a_1core", "b_1core", "a_null", "b_null",
]
# configurations measured on some envs only
ONLY = {"b1": {"halfcheetah"}, "b1_proc": {"halfcheetah"}, "bt": {"halfcheetah"},
        "bt_proc": {"halfcheetah"},
        "b4": {"sleep1ms"}, "b4_proc": {"sleep1ms"}, "d4": {"sleep1ms"}, "d4_direct": {"sleep1ms"},
        "d4_actor": {"sleep1ms"}}
# On the latency-bound env: what is measured is overlap (the rest is the CPU-bound envs').
SLEEP_CONFIGS = {"a", "a_threads", "b", "b_proc", "b0_proc", "bw_proc", "b4", "b4_proc", "d",
                 "d_direct", "d4", "d4_direct", "d4_actor"}
RANKS = {"b1": 1, "b1_proc": 1, "b4": 4, "b4_proc": 4, "d4": 4, "d4_direct": 4, "d4_actor": 4}
# (env, configuration, reference configuration, the least ratio): issue 26's targets, for
# AsyncRunner with thread workers (b, b4) and process workers (b_proc, b4_proc) alike.
TARGETS = [
    ("hopper", "b", "a", 1.0),
    ("hopper", "b_proc", "a", 1.0),
    ("halfcheetah", "b", "a", 1.0),
    ("halfcheetah", "b_proc", "a", 1.0),
    ("hopper", "bw_proc", "a", 1.0),
    ("halfcheetah", "bw_proc", "a", 1.0),
    ("sleep1ms", "b", "a", 1.8),
    ("sleep1ms", "b_proc", "a", 1.8),
    ("sleep1ms", "b4", "a", 3.4),
    ("sleep1ms", "b4_proc", "a", 3.4),
    ("hopper", "d", "b", 0.9),
    ("hopper", "d", "b_proc", 0.9),
    ("hopper", "d_direct", "b", 0.9),
    ("hopper", "d_direct", "b_proc", 0.9),
    ("hopper", "d_actor", "b", 0.9),
    ("hopper", "d_actor", "b_proc", 0.9),
    ("sleep1ms", "d4", "a", 3.0),
    ("sleep1ms", "d4_direct", "a", 3.0),
    ("sleep1ms", "d4_actor", "a", 3.0),
]
# The target configuration of 2 env ranks in threads of this process: a_threads beside it.
THREAD_TARGET = "b"
REF = {"b_1core": "a_1core", "b_null": "a_null"}  # a second ratio, to a like-for-like (a)
LABELS = {
    "a": "(a) hand loop, 1 vector env (floor)",
    "a_adapter": "(a) hand loop over the adapter",
    "a_collector": "(a') hand loop + collector.add",
    "a_threads": "(a2) two hand loops of B/2 in 2 threads at once (what threads allow)",
    "b": "(b) AsyncRunner, 2 ranks",
    "b_proc": "(b) AsyncRunner, 2 ranks, env processes",
    "b0_proc": "(b0) AsyncRunner, 2 ranks, env processes, batch_wait_s 0",
    "bw_proc": "(bw) AsyncRunner, 2 ranks, env processes, batch_wait_s 5 ms",
    "b1": "(b1) AsyncRunner, 1 rank of B",
    "b1_proc": "(b1) AsyncRunner, 1 rank of B, env process",
    "bt": "(bt) AsyncRunner, 2 ranks, EnvPool threads split between them",
    "bt_proc": "(bt) AsyncRunner, 2 ranks, env processes, EnvPool threads split between them",
    "b4": "(b4) AsyncRunner, 4 ranks",
    "b4_proc": "(b4) AsyncRunner, 4 ranks, env processes",
    "c": "(c) DecoupledRunner, 2 ranks",
    "c_proc": "(c) DecoupledRunner, 2 ranks, env processes",
    "d": "(d) RayRunner, 2 actors, Ray transport",
    "d_direct": "(d) RayRunner, 2 actors, direct transport (the default)",
    "d_actor": "(d) RayRunner, 2 actors, policy in the actors",
    "d4": "(d4) RayRunner, 4 actors, Ray transport",
    "d4_direct": "(d4) RayRunner, 4 actors, direct transport (the default)",
    "d4_actor": "(d4) RayRunner, 4 actors, policy in the actors",
    "a_1core": "(a) on 1 core",
    "b_1core": "(b) on 1 core",
    "a_null": "(a) over an instant env (no simulation)",
    "b_null": "(b) over instant envs (no simulation)",
}


# --------------------------------------------------------------------------- envs


def draw(state: np.ndarray) -> np.ndarray:
    """A cheap 64x64x3 uint8 "camera" image per env: one bright pixel per state value
    (row from the value, column from its index) on black."""
    B, D = state.shape
    n = min(D, 8)
    img = np.zeros((B, *IMAGE), np.uint8)
    rows = np.clip(np.nan_to_num(state[:, :n]) * 8 + 32, 0, 63).astype(np.int64)
    cols = np.arange(n) * 8 + 4
    img[np.arange(B)[:, None], rows, cols[None, :], :] = 255
    return img


class CameraEnv:
    """An adapter with ``obs["image"]`` drawn from ``obs["state"]`` (obs and final_obs)."""

    def __init__(self, env):
        self.env, self.num_envs = env, env.num_envs

    @staticmethod
    def _with(obs):
        return {"state": obs["state"], "image": draw(obs["state"])}

    def reset(self):
        return self._with(self.env.reset())

    def step(self, key, actions):
        out = self.env.step(key, actions)
        obs = self._with(out.obs)
        final = obs if out.final_obs is out.obs else self._with(out.final_obs)
        return dataclasses.replace(out, obs=obs, final_obs=final)

    def spec(self) -> EnvSpec:
        s = self.env.spec()
        obs = dict(s.obs, image=jax.ShapeDtypeStruct((s.batch_size, *IMAGE), np.uint8))
        return dataclasses.replace(s, obs=obs)

    def check_against(self, example):
        check_spec(self.spec(), example)

    def close(self):
        self.env.close()


SLEEP_S, SLEEP_OBS, SLEEP_ACT, SLEEP_STEPS = 0.001, 11, 3, 200


def sleep_env():
    """One latency-bound gymnasium env: every step sleeps 1 ms (a remote simulator, a
    robot's control period); the state drifts with the action, 200-step episodes."""
    import gymnasium
    from gymnasium.wrappers import TimeLimit

    # Locals, not globals: a Ray actor gets this function pickled by value.
    sleep_s, obs_n, act_n = SLEEP_S, SLEEP_OBS, SLEEP_ACT

    class Sleep1ms(gymnasium.Env):
        observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (obs_n,), np.float32)
        action_space = gymnasium.spaces.Box(-1.0, 1.0, (act_n,), np.float32)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.x = self.np_random.normal(size=obs_n).astype(np.float32)
            return self.x.copy(), {}

        def step(self, action):
            time.sleep(sleep_s)
            a = np.asarray(action, np.float32)
            self.x = (0.99 * self.x + 0.01 * np.resize(a, obs_n)).astype(np.float32)
            return self.x.copy(), float(-np.square(self.x).sum()), False, False, {}

    return TimeLimit(Sleep1ms(), SLEEP_STEPS)


def make_raw(kind: str, task: str, n: int, seed: int, threads: int | None = None):
    if kind == "sleep":
        import gymnasium

        return gymnasium.vector.SyncVectorEnv([sleep_env] * n)
    if kind == "gymnasium":
        import gymnasium

        return gymnasium.make_vec(task, num_envs=n, vectorization_mode="sync")
    import envpool

    opts = {} if threads is None else {"num_threads": threads}
    return envpool.make(task, env_type="gymnasium", num_envs=n, seed=seed, **opts)


@dataclasses.dataclass
class EnvFactory:
    """``env_fn(rank)``: the adapter over ``n`` fresh environments (also in a Ray actor)."""

    kind: str
    task: str
    n: int
    seed: int
    camera: bool
    threads: int | None = None  # EnvPool's num_threads (None: its default, one per core)

    def __call__(self, rank: int = 0):
        seed = self.seed + 1000 * rank
        raw = make_raw(self.kind, self.task, self.n, seed, self.threads)
        if self.kind in ("gymnasium", "sleep"):
            env = GymnasiumEnv(raw, actions_per_chunk=K, seed=seed)
        else:
            env = EnvPoolEnv(raw, actions_per_chunk=K)
        return CameraEnv(env) if self.camera else env


class NullEnv:
    """An instant env of the same shapes: what is left of a training step without
    simulation (policy, value_fn, adapter-less hand-offs, the collector)."""

    def __init__(self, spec, camera):
        self.spec_ = spec
        self.num_envs = spec.batch_size
        B, D = spec.obs["state"].shape
        state = np.random.default_rng(0).standard_normal((B, D)).astype(np.float32)
        self.obs = CameraEnv._with({"state": state}) if camera else {"state": state}
        cut = spec.transition.valid_actions is not None  # the adapter's chunk_end="cut"
        tr = EnvTransition(
            rewards=np.ones((B, K), np.float32),
            terminations=np.zeros((B, K), bool),
            truncations=np.zeros((B, K), bool),
            valid_actions=np.ones((B, K), bool) if cut else None,
        )
        self.out = EnvStep(transition=tr, obs=self.obs, final_obs=self.obs)

    def spec(self):
        return self.spec_

    def check_against(self, example):
        check_spec(self.spec(), example)

    def reset(self):
        return self.obs

    def step(self, key, actions):
        return self.out

    def close(self):
        pass


class RawLoopEnv:
    """The hand loop's vector env, no adapter: one step of B envs, ended envs reset at
    once (gymnasium: ``reset(options={"reset_mask": done})``; EnvPool: ``pool.reset(ids)``)."""

    def __init__(self, kind, task, n, seed, threads=None):
        self.kind, self.raw = kind, make_raw(kind, task, n, seed, threads)
        if kind in ("gymnasium", "sleep"):
            obs, _ = self.raw.reset(seed=seed)
            self.act_dtype = np.float32
        else:
            obs, _ = self.raw.reset()
            self.act_dtype = np.float64
        self.obs = np.asarray(obs, np.float32)

    def step(self, a):
        """-> (obs after resets, rewards, terminations, truncations, obs before resets)."""
        raw, r, term, trunc, _ = self.raw.step(np.asarray(a, self.act_dtype))
        term, trunc = np.asarray(term, bool), np.asarray(trunc, bool)
        last = obs = np.asarray(raw, np.float32)
        done = term | trunc
        if done.any():
            if self.kind in ("gymnasium", "sleep"):
                fresh, _ = self.raw.reset(options={"reset_mask": done})
                obs = np.asarray(fresh, np.float32)
            else:
                ids = np.flatnonzero(done)
                fresh, _ = self.raw.reset(ids)
                obs = last.copy()
                obs[ids] = fresh
        return obs, r, term, trunc, last


# --------------------------------------------------------------------------- policy


def make_policy(obs_dim: int, A: int, camera: bool):
    """A jitted MLP Gaussian policy ``(params, obs, rng) -> PolicyOutput`` and a jitted
    ``value_fn(params, obs) -> [B]``."""

    def features(obs):
        x = obs["state"]
        if camera:
            img = obs["image"].astype(f32) / f32(255)
            x = jnp.concatenate([x, img.mean(axis=(1, 2, 3))[:, None]], axis=1)
        return x

    def mlp(layers, x):
        for w, b in layers[:-1]:
            x = jnp.tanh(x @ w + b)
        w, b = layers[-1]
        return x @ w + b

    def init(rng):
        d = obs_dim + (1 if camera else 0)
        ks = jax.random.split(rng, 6)

        def layer(k, i, o):
            return jax.random.normal(k, (i, o), f32) / f32(np.sqrt(i)), jnp.zeros((o,), f32)

        actor = [layer(ks[0], d, HIDDEN), layer(ks[1], HIDDEN, HIDDEN), layer(ks[2], HIDDEN, K * A)]
        critic = [layer(ks[3], d, HIDDEN), layer(ks[4], HIDDEN, HIDDEN), layer(ks[5], HIDDEN, 1)]
        return {"actor": actor, "critic": critic, "log_std": jnp.full((A,), -0.5, f32)}

    def value(params, obs):
        return mlp(params["critic"], features(obs))[:, 0]

    def policy(params, obs, rng):
        x = features(obs)
        B = x.shape[0]
        mean = mlp(params["actor"], x).reshape(B, K, A)
        log_std = params["log_std"]
        noise = jax.vmap(lambda k: jax.random.normal(k, (K, A), f32))(rng)  # a key per row
        logp = (-0.5 * noise**2 - log_std - f32(0.5 * np.log(2 * np.pi))).sum(-1)
        return PolicyOutput(
            actions=mean + jnp.exp(log_std) * noise,
            prev_logprobs=logp,
            prev_values=mlp(params["critic"], x)[:, 0],
            versions=jnp.zeros((B,), jnp.int32),
        )

    return init, jax.jit(policy), jax.jit(value)


def row_keys_spec(rows: int) -> jax.ShapeDtypeStruct:
    """The ``rng`` argument of a policy call of ``rows`` rows: a PRNG key per row."""
    return jax.ShapeDtypeStruct((rows, 2), np.uint32)


# --------------------------------------------------------------------------- timing


class CollectorTimer:
    """Wraps a collector's ``add`` and ``check_structure`` with a timer (any thread)."""

    def __init__(self, collector):
        self.add_s = self.check_s = 0.0
        self._lock = threading.Lock()
        collector.add = self._timed(collector.add, "add_s")
        collector.check_structure = self._timed(collector.check_structure, "check_s")

    def _timed(self, fn, total: str):
        def timed(part):
            t0 = time.perf_counter()
            try:
                return fn(part)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    setattr(self, total, getattr(self, total) + dt)

        return timed

    def total(self):
        with self._lock:
            return self.add_s, self.check_s


def cpu_times() -> list[int] | None:
    """The machine's CPU time counters (``/proc/stat``'s ``cpu`` line, in ticks), or
    ``None`` where there is none."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(start: list[int] | None, end: list[int] | None) -> float | None:
    """The share of CPU time the hypervisor gave other guests between two
    :func:`cpu_times` readings (``steal``, the 8th counter), or ``None``."""
    if not start or not end or len(start) < 8 or len(end) < 8:
        return None
    total = sum(end[:8]) - sum(start[:8])
    return (end[7] - start[7]) / total if total > 0 else None


def settle(max_s: float = 60.0, window_s: float = 0.5, busy_below: float = 0.25) -> float:
    """Wait until the machine is quiet, at most ``max_s``: its CPUs busy less than
    ``busy_below`` of one core over ``window_s`` (what the warm-up started, Ray's daemons
    and the idle workers it starts with, settle first). Returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < max_s:
        before = cpu_times()
        time.sleep(window_s)
        after = cpu_times()
        if before is None or after is None:  # no /proc/stat: nothing to wait for
            break
        # user .. steal (guest time is counted in user already, as in steal_share)
        d = [y - x for x, y in zip(before[:8], after[:8])]
        if (sum(d) - d[3] - d[4]) / max(sum(d), 1) * os.cpu_count() < busy_below:
            break
    return time.monotonic() - start


def env_process_cpu() -> float:
    """CPU seconds the env processes this process started (``multiprocessing``'s children:
    the ``_proc`` configurations' envs) have used so far (``/proc/<pid>/stat``). Those of
    the configurations not running sit blocked on their pipes, so a configuration's delta
    is its own env processes' CPU. In clock ticks (10 ms on Linux): a repetition's figure
    is that coarse."""
    import multiprocessing

    total = 0.0
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def pin(cpus) -> None:
    """Pin every thread of this process (XLA's, EnvPool's pools, Python's) to ``cpus``;
    threads started later inherit the calling thread's mask."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass


# --------------------------------------------------------------------------- contenders


class HandLoop:
    """Configurations a / a_adapter / a_collector: one vector env of B, the policy, K env
    steps per chunk; optionally the adapter, optionally a collector fed both halves."""

    def __init__(
        self,
        spec,
        B,
        params,
        policy_fn,
        value_fn,
        camera,
        seed,
        adapter=False,
        collector=False,
        obs_dim=None,
        A=None,
    ):
        self.B, self.params, self.camera = B, params, camera
        self.policy_fn, self.value_fn = policy_fn, value_fn
        self.adapter = None
        if adapter:
            self.adapter = (
                adapter
                if not isinstance(adapter, bool)
                else EnvFactory(spec["kind"], spec["task"], B, seed, camera)(0)
            )
            self.obs = self.adapter.reset()
        else:
            self.env = RawLoopEnv(spec["kind"], spec["task"], B, seed)
        self.step_id = 0
        self.prev = None
        self.collector = self.timer = None
        if collector:
            plan = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B)
            obs_spec = {"state": jax.ShapeDtypeStruct((B, obs_dim), np.float32)}
            if camera:
                obs_spec["image"] = jax.ShapeDtypeStruct((B, *IMAGE), np.uint8)
            flags = jax.ShapeDtypeStruct((B, K), np.dtype(bool))
            env_spec = EnvSpec(
                obs=obs_spec,
                actions=jax.ShapeDtypeStruct((B, K, A), np.float32),
                transition=EnvTransition(
                    rewards=jax.ShapeDtypeStruct((B, K), np.float32),
                    terminations=flags,
                    truncations=flags,
                ),
            )
            out = jax.eval_shape(policy_fn, params, obs_spec, row_keys_spec(B))
            self.collector = jaxtraj.TrajectoryCollector(plan, *example_parts(env_spec, plan, out))
            self.timer = CollectorTimer(self.collector)
        self.base_rng = jax.random.PRNGKey(7)

    def _obs(self, state):
        return {"state": state, "image": draw(state)} if self.camera else {"state": state}

    def train_step(self):
        B, params, col = self.B, self.params, self.collector
        # The runners' row keys (one device call per training step, as theirs).
        keys = [TrajectoryKey(self.step_id, 0, 0, 0, t) for t in range(T)]
        rngs = key_rngs(7, keys, B)
        for t in range(T):
            key = TrajectoryKey(self.step_id, 0, 0, 0, t)
            obs = self.obs if self.adapter is not None else self._obs(self.env.obs)
            out = self.policy_fn(params, obs, rngs[key.as_tuple()])
            if col is not None:
                out = jax.tree.map(np.asarray, out)
                out = out.replace(versions=np.zeros((B,), np.int32))
                col.add(PolicyPart(TrajectorySource(key, B, 0), obs, out))
            actions = np.asarray(out.actions)
            if self.adapter is not None:
                st = self.adapter.step(key, actions)
                self.obs, tr, final_obs = st.obs, st.transition, st.final_obs
                need = t == T - 1 or bool(tr.truncations.any())
            else:
                rewards = np.zeros((B, K), np.float32)
                terms, truncs = np.zeros((B, K), bool), np.zeros((B, K), bool)
                final, ended = None, np.zeros((B,), bool)
                for k in range(K):
                    o, r, te, tru, last = self.env.step(actions[:, k])
                    rewards[:, k], terms[:, k], truncs[:, k] = r, te, tru
                    done = te | tru
                    if done.any():
                        final = last if final is None else np.where(done[:, None], last, final)
                        ended |= done
                self.env.obs = o
                tr = EnvTransition(rewards=rewards, terminations=terms, truncations=truncs)
                need = t == T - 1 or bool(truncs.any())
                final_obs = None
                if need:
                    fo = o if final is None else np.where(ended[:, None], final, o)
                    final_obs = self._obs(fo)
            values = np.asarray(self.value_fn(params, final_obs)) if need else None
            if col is not None:
                prev = self.prev
                if prev is None:
                    prev = jax.tree.map(np.zeros_like, tr)
                col.add(
                    EnvPart(
                        TrajectorySource(key, B, 0),
                        tr,
                        initial_transition=prev.boundary() if t == 0 else None,
                        final_values=values,
                    )
                )
            self.prev = tr
        self.step_id += 1

    def run(self, steps):
        for _ in range(steps):
            self.train_step()


class TwoLoops:
    """Configuration a_threads (a2): two hand loops (:class:`HandLoop`, configuration a's
    loop) of B/2 each, in two threads of this process at once: each its own policy calls
    on its rows, its K raw env steps a chunk, its ``value_fn``; no runner, nothing
    collected, no hand-off, no call shared. About the most two thread ranks of this env
    could do, the GIL included, beside ``b`` and ``c`` (which also hand off, batch and
    collect) in the same round; not a strict bound, its loops calling the policy on B/2
    rows each where a runner calls it once on B."""

    def __init__(self, spec, B, params, policy_fn, value_fn, camera, seed, ranks=2):
        self.loops = [HandLoop(spec, B // ranks, params, policy_fn, value_fn, camera,
                               seed + 1000 * r) for r in range(ranks)]

    def run(self, steps):
        threads = [threading.Thread(target=loop.run, args=(steps,)) for loop in self.loops]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class Runner:
    """Configurations b / b4 / c / d / d_actor / d4: a runner over ``ranks`` env ranks of
    B / ranks each, run(num_steps=1) per training step."""

    def __init__(
        self, which, spec, B, params, policy_fn, value_fn, camera, seed, null=None, ranks=2
    ):
        part = B // ranks
        # "t": each rank's pool gets its share of the cores (EnvPool's default is a thread per
        # core in every pool: 2 ranks on 2 cores run 4 stepping threads)
        threads = max(1, len(os.sched_getaffinity(0)) // ranks) if which.startswith("bt") else None
        factory = EnvFactory(spec["kind"], spec["task"], part, seed, camera, threads)
        plan = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=part, num_env_ranks=ranks)
        ray_runner = which.startswith("d")
        # Every env built where it runs, from a factory (as the guides show): a thread of
        # its own that runs the rank's loop, an env process, or a Ray actor.
        envs = [functools.partial(factory, r) for r in range(ranks)]
        if null is not None:
            envs = [NullEnv(null, camera) for _ in range(ranks)]
        spec_env = factory(0) if null is None else envs[0]  # the example parts' shapes
        out = jax.eval_shape(policy_fn, params, spec_env.spec().obs, row_keys_spec(part))
        self.collector = jaxtraj.TrajectoryCollector(plan, *example_parts(spec_env, plan, out))
        self.timer = CollectorTimer(self.collector)
        if null is None:
            spec_env.close()
        if ray_runner:
            from jaxtraj.runners.ray import RayRunner

            opts = dict(transport="ray")  # d, d4: a Ray actor call per chunk
            if which.endswith("_actor"):  # several chunks in flight per rank
                opts = dict(policy="actor")  # one call of T chunks per rank and step
            if which.endswith("_direct"):  # chunks on a connection of each actor's own
                opts = dict(transport="direct")
            if ranks > 2:  # ray.init(num_cpus=2): d4's, d4_direct's and d4_actor's actors
                opts["actor_options"] = {"num_cpus": 1 / (2 * ranks)}  # share them (alive
                # side by side)
            self.runner = RayRunner(
                self.collector, factory, policy_fn, params, value_fn=value_fn, seed=seed, **opts
            )
        else:
            cls = DecoupledRunner if which.startswith("c") else AsyncRunner
            opts = {}
            if which.endswith("_proc"):  # each rank's env built and stepped in its process
                opts["env_workers"] = "process"
            if which.startswith("bw"):
                opts["batch_wait_s"] = 0.005
            if which.startswith("b0"):
                opts["batch_wait_s"] = 0.0
            self.runner = cls(self.collector, envs, policy_fn, params, value_fn=value_fn,
                              seed=seed, **opts)
        self.items = 0

    def run(self, steps):
        for _ in range(steps):
            self.items += len(self.runner.run(num_steps=1))


# --------------------------------------------------------------------------- the machine


def _step_raw(kind, task, n, steps, ready, go, out, threads=None):
    """A process: ``steps`` training steps' vector steps of a raw env of ``n``, timed
    from ``go`` (set once every process of the probe is ready)."""
    env = RawLoopEnv(kind, task, n, seed=0, threads=threads)
    A = env.raw.single_action_space.shape[0] if hasattr(env.raw, "single_action_space") else (
        env.raw.action_space.shape[-1])
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (steps * T * K + 16, n, A)).astype(np.float32)
    for a in actions[:16]:  # warm-up
        env.step(a)
    ready.put(None)
    go.wait()
    c0, t0 = time.process_time(), time.perf_counter()
    for a in actions[16:]:
        env.step(a)
    out.put(((time.perf_counter() - t0) / steps * 1e3, (time.process_time() - c0) / steps * 1e3))


def _async_groups(task, n, steps, reps, out):
    """A process: EnvPool's own asynchronous API, the leanest overlap two ranks could have
    over one pool of ``n``: two groups of ``n/2`` envs, each given its next step's actions
    as soon as its last step is back (a chunk's K steps, then the policy on its rows, in
    this thread, while the pool's threads step the other group); nothing collected, no
    adapter. Against the hand loop over a pool of ``n`` (a policy call on every row, then K
    synchronous steps), the same policy, alternating ``reps`` times ``steps`` training
    steps; ms per training step (hand loop, two groups)."""
    import envpool

    sync = envpool.make(task, env_type="gymnasium", num_envs=n, seed=0)
    obs_dim, A = sync.observation_space.shape[0], sync.action_space.shape[0]
    init, policy_fn, _ = make_policy(obs_dim, A, False)
    params = init(jax.random.PRNGKey(0))
    rows = np.asarray(jax.random.split(jax.random.PRNGKey(1), n))
    half = n // 2

    def act(obs, rng):
        return np.asarray(policy_fn(params, {"state": obs}, rng).actions)

    obs = sync.reset()[0].astype(np.float32)

    def hand(count):
        nonlocal obs
        for _ in range(count * T):
            a = act(obs, rows)
            for k in range(K):
                obs = sync.step(a[:, k])[0].astype(np.float32)

    pool = envpool.make(task, env_type="gymnasium", num_envs=n, batch_size=half, seed=0)
    pool.async_reset()
    last = np.zeros((n, obs_dim), np.float32)  # each env's last observation
    seen = 0
    while seen < n:
        o, *_, info = pool.recv()
        last[info["env_id"]] = o
        seen += len(info["env_id"])
    groups = [np.arange(g * half, (g + 1) * half) for g in range(2)]

    def two_groups(count):
        chunks, k, back, acts = [0, 0], [0, 0], [0, 0], [None, None]
        for g in range(2):
            acts[g] = act(last[groups[g]], rows[:half])
            pool.send(acts[g][:, 0], groups[g])
        left = 2
        while left:
            o, *_, info = pool.recv()
            ids = info["env_id"]
            last[ids] = o
            for g in range(2):
                back[g] += int(np.count_nonzero(ids // half == g))
                if back[g] < half:
                    continue
                back[g] = 0
                if k[g] < K - 1:
                    k[g] += 1
                else:  # the chunk is done: the next one's actions from its observations
                    chunks[g] += 1
                    if chunks[g] == count * T:
                        left -= 1
                        continue
                    acts[g], k[g] = act(last[groups[g]], rows[:half]), 0
                pool.send(acts[g][:, k[g]], groups[g])

    hand(1)  # warm-up (and the policy's compilations for n and n/2 rows)
    two_groups(1)
    times = {"hand": [], "groups": []}
    for _ in range(reps):
        for name, fn in (("hand", hand), ("groups", two_groups)):
            t0 = time.perf_counter()
            fn(steps)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    out.put((statistics.median(times["hand"]), statistics.median(times["groups"])))


def _async_probe(task, n, steps, reps):
    """:func:`_async_groups` in a fresh process: ``(hand loop, two groups)`` ms per
    training step."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_async_groups, args=(task, n, steps, reps, out))
    proc.start()
    got = out.get(timeout=600)
    proc.join(10)
    return got


def _probe(kind, task, sizes, steps, threads=None):
    """Each size's env in a process of its own, all stepping at once; ms per training step
    (wall, CPU) of each (``threads``: each EnvPool's ``num_threads``)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_step_raw, args=(kind, task, n, steps, ready, go, out, threads))
             for n in sizes]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    go.set()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(10)
    return got


def env_scaling(spec, steps: int, reps: int = 3) -> dict:
    """Raw env stepping, B in one process, B/2 alone, 2 x B/2 at once (medians of
    ``reps`` alternating repetitions): what parallel env processes gain on this machine.
    EnvPool also with each B/2 pool on one thread (``num_threads=1``, the cores split
    between the two); the 1 ms env also as 4 x B/4 at once (the 4-rank targets)."""
    B, kind, task = spec["B"], spec["kind"], spec["task"]
    probes = {
        "alone_B": lambda: _probe(kind, task, [B], steps),
        "alone_half": lambda: _probe(kind, task, [B // 2], steps),
        "two_halves_at_once": lambda: _probe(kind, task, [B // 2, B // 2], steps),
    }
    if kind == "envpool":
        probes["two_halves_at_once_one_thread_each"] = lambda: _probe(
            kind, task, [B // 2, B // 2], steps, threads=1)
    if kind == "sleep":
        probes["four_quarters_at_once"] = lambda: _probe(kind, task, [B // 4] * 4, steps)
    rows = {k: [] for k in probes}
    for _ in range(reps):
        for k, probe in probes.items():
            rows[k].append(max(probe()))  # at once: the slowest one sets the pace
    if kind == "envpool":  # the leanest overlap of two ranks over one pool
        hand_ms, groups_ms = _async_probe(task, B, steps, 2 * reps + 1)
    res = {k: {"ms_per_training_step": statistics.median(w for w, _ in v),
               "cpu_ms_per_training_step": statistics.median(c for _, c in v)}
           for k, v in rows.items()}
    alone = res["alone_B"]["ms_per_training_step"]
    res["speedup_2_processes"] = alone / res["two_halves_at_once"]["ms_per_training_step"]
    res["half_slowdown_at_once"] = (res["two_halves_at_once"]["ms_per_training_step"]
                                    / res["alone_half"]["ms_per_training_step"])
    for k, name in (("two_halves_at_once_one_thread_each", "speedup_2_processes_one_thread"),
                    ("four_quarters_at_once", "speedup_4_processes")):
        if k in res:
            res[name] = alone / res[k]["ms_per_training_step"]
    if kind == "envpool":
        res["async_two_groups"] = {"hand_loop_ms_per_training_step": hand_ms,
                                   "ms_per_training_step": groups_ms}
        res["speedup_async_two_groups"] = hand_ms / groups_ms
    return res


def scaling_line(name: str, sc: dict) -> str:
    return (
        f"{name}: raw env, ms per training step: B alone "
        f"{sc['alone_B']['ms_per_training_step']:.0f}, B/2 alone "
        f"{sc['alone_half']['ms_per_training_step']:.0f}, two B/2 at once "
        f"{sc['two_halves_at_once']['ms_per_training_step']:.0f} (each "
        f"{sc['half_slowdown_at_once']:.2f}x as slow as alone): stepping two processes at once "
        f"is {sc['speedup_2_processes']:.2f}x one process of B"
        + (f"; with one EnvPool thread each {sc['speedup_2_processes_one_thread']:.2f}x"
           if "speedup_2_processes_one_thread" in sc else "")
        + (f"; four B/4 at once {sc['speedup_4_processes']:.2f}x"
           if "speedup_4_processes" in sc else "")
        + (f"; two groups of B/2 over one asynchronous pool of B, the policy inline, "
           f"nothing collected, {sc['speedup_async_two_groups']:.2f}x the hand loop"
           if "speedup_async_two_groups" in sc else "")
    )


# --------------------------------------------------------------------------- the bench


def bench_env(name, spec, configs, rounds, steps, camera, seed=0, settle_s=60.0):
    B = spec["B"]
    probe = EnvFactory(spec["kind"], spec["task"], 1, seed, False)(0).spec()
    obs_dim, A = probe.obs["state"].shape[1], probe.actions.shape[2]
    init, policy_fn, value_fn = make_policy(obs_dim, A, camera)
    params = init(jax.random.PRNGKey(0))
    common = dict(params=params, policy_fn=policy_fn, value_fn=value_fn, camera=camera, seed=seed)
    made = {}

    def null_spec(n):  # the adapter's spec (image included), for an instant env
        env = EnvFactory(spec["kind"], spec["task"], n, seed, camera)(0)
        out = env.spec()
        env.close()
        return out

    for c in configs:
        base = c.split("_1core")[0]
        if c == "a_null":
            made[c] = HandLoop(spec, B, adapter=NullEnv(null_spec(B), camera), **common)
            continue
        if c == "b_null":
            made[c] = Runner("b", spec, B, null=null_spec(B // 2), **common)
            continue
        if base in made:
            made[c] = made[base]
            continue
        if base == "a":
            made[c] = HandLoop(spec, B, **common)
        elif base == "a_adapter":
            made[c] = HandLoop(spec, B, adapter=True, **common)
        elif base == "a_collector":
            made[c] = HandLoop(spec, B, collector=True, obs_dim=obs_dim, A=A, **common)
        elif base == "a_threads":
            made[c] = TwoLoops(spec, B, **common)
        else:
            made[c] = Runner(base, spec, B, ranks=RANKS.get(base, 2), **common)
        made[base] = made[c]
    # Warm-up: compiles (both policy batch shapes), actor start-up, first flushes.
    for c in configs:
        if "_1core" not in c:
            made[c].run(2)
    # Then the machine settles (in one run every runner configuration's first 3 of 7
    # rounds read a third low, something else holding a core: Ray's daemons starting?).
    settled_s = settle(settle_s)
    print(f"  {name}: the machine settled in {settled_s:.1f} s", flush=True)
    all_cpus = os.sched_getaffinity(0)
    one = {min(all_cpus)}
    per_step = T * K * B
    sps = {c: [] for c in configs}
    share = {c: [] for c in configs}
    add_share = {c: [] for c in configs}
    cpu = {c: [] for c in configs}  # ms of this process's CPU (all its threads) per step
    env_cpu = {c: [] for c in configs}  # ms of its env processes' CPU per training step
    for r in range(rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for c in order:
            obj = made[c]
            timer = getattr(obj, "timer", None)
            before = timer.total() if timer else (0.0, 0.0)
            if c.endswith("_1core"):
                pin(one)
            try:
                kids0, cpu0, t0 = env_process_cpu(), time.process_time(), time.perf_counter()
                obj.run(steps)
                wall = time.perf_counter() - t0
                cpu[c].append(1e3 * (time.process_time() - cpu0) / steps)
                env_cpu[c].append(1e3 * (env_process_cpu() - kids0) / steps)
            finally:
                if c.endswith("_1core"):
                    pin(all_cpus)
            sps[c].append(steps * per_step / wall)
            if timer:
                add, check = (x - y for x, y in zip(timer.total(), before))
                share[c].append((add + check) / wall)
                add_share[c].append(add / wall)
        print(
            f"  {name} round {r + 1}/{rounds}: "
            + ", ".join(f"{c} {sps[c][-1]:.0f}" for c in configs),
            flush=True,
        )
    res = {
        "B": B,
        "obs_dim": int(obs_dim),
        "action_dim": int(A),
        "camera": camera,
        "task": spec["task"],
        "library": spec["kind"],
        "settled_s": settled_s,  # waited after the warm-up for the machine to be quiet
        "configs": {},
    }
    for c in configs:
        ratios = [x / a for x, a in zip(sps[c], sps["a"])]
        entry = {
            "label": LABELS[c],
            "steps_per_s_median": statistics.median(sps[c]),
            "ms_per_training_step_median": 1e3 * per_step / statistics.median(sps[c]),
            "steps_per_s": sps[c],
            "ratio_to_a_median": statistics.median(ratios),
            "ratio_to_a_per_round": ratios,
            # CPU per training step: this process's threads (the calling thread, the
            # runners' workers, XLA's), and (the _proc configurations) their env processes'
            "cpu_ms_per_training_step_median": statistics.median(cpu[c]),
        }
        if c.endswith("_proc"):
            entry["env_process_cpu_ms_per_training_step_median"] = statistics.median(env_cpu[c])
        ref = REF.get(c)
        if ref in sps and ref != c:
            entry["ratio_to"] = ref
            entry["ratio_to_ref_median"] = statistics.median(
                [x / a for x, a in zip(sps[c], sps[ref])]
            )
        runner = getattr(made[c], "runner", None)
        if getattr(runner, "batch_wait_s", None) == "auto":  # what "auto" chose, at the end
            entry["batch_wait_ms"] = 1e3 * runner._wait()
            entry["env_cpu_share"] = list(runner._due.share)
        if share[c]:
            entry["collector_share_median"] = statistics.median(share[c])
            entry["collector_add_share_median"] = statistics.median(add_share[c])
        res["configs"][c] = entry
    for obj in {id(o): o for o in made.values()}.values():
        runner = getattr(obj, "runner", None)
        if runner is not None and hasattr(runner, "close"):
            runner.close()
    return res


def env_configs(name: str, configs: list[str]) -> list[str]:
    """The configurations measured on env ``name``: the latency-bound env measures
    overlap (hand loop, thread and Ray runners), ``b4`` / ``d4`` run only there."""
    base = name.split("_camera")[0]
    out = [c for c in configs if base in ONLY.get(c, {base})]
    if base == "sleep1ms":
        out = [c for c in out if c in SLEEP_CONFIGS]
    return out


def cpu_ceiling(cfg: dict, c: str, ref: str, cpus: int) -> float | None:
    """The most configuration ``c`` could run at, as a ratio to ``ref``, at the CPU it used:
    its CPU per training step (this process's threads and its env processes) spread over
    every core, every moment busy, against ``ref``'s wall time. None where its CPU is not
    all counted (Ray's actors run in processes of Ray's)."""
    if c.startswith("d") or "cpu_ms_per_training_step_median" not in cfg[c]:
        return None
    used = cfg[c]["cpu_ms_per_training_step_median"]
    used += cfg[c].get("env_process_cpu_ms_per_training_step_median", 0.0)
    return cfg[ref]["ms_per_training_step_median"] / (used / cpus) if used > 0 else None


def per_round(cfg: dict, c: str, ref: str) -> list[float]:
    """Configuration ``c``'s ratio to ``ref`` in each round (measured side by side)."""
    return [x / y for x, y in zip(cfg[c]["steps_per_s"], cfg[ref]["steps_per_s"])]


def targets(results: dict, machine_line: str, cpus: int | None = None) -> list[dict]:
    """Issue 26's targets: each the median over rounds of the per-round ratio of a
    configuration to its reference, measured side by side; met or missed; with
    ``cpus``, the ratio the configuration's CPU allows (:func:`cpu_ceiling`)."""
    out = []
    for env, c, ref, least in TARGETS:
        cfg = results.get(env, {}).get("configs", {})
        entry = {"env": env, "config": c, "reference": ref, "target": least,
                 "machine": machine_line}
        if c not in cfg or ref not in cfg:
            entry.update(ratio=None, status="not measured")
        else:
            rounds = per_round(cfg, c, ref)
            ratio = statistics.median(rounds)
            entry.update(
                ratio=ratio, ratio_per_round=rounds,
                status="met" if ratio >= least else "missed",
            )
            if cpus:
                entry["cpu_ceiling"] = cpu_ceiling(cfg, c, ref, cpus)
            if c == THREAD_TARGET and "a_threads" in cfg:  # two hand loops in threads
                entry["threads_allow"] = statistics.median(per_round(cfg, "a_threads", ref))
        out.append(entry)
    return out


def targets_table(rows: list[dict]) -> str:
    lines = ["| env | configuration | against | target | measured | status | CPU allows | "
             "threads allow |", "|---|---|---|---:|---:|---|---:|---:|"]
    for t in rows:
        got = "-" if t["ratio"] is None else f"{t['ratio']:.3f}x"  # 3.395x: under 3.4x
        most = "-" if t.get("cpu_ceiling") is None else f"{t['cpu_ceiling']:.2f}x"
        threads = "-" if t.get("threads_allow") is None else f"{t['threads_allow']:.2f}x"
        lines.append(
            f"| {t['env']} | {LABELS[t['config']]} | {LABELS[t['reference']]} | "
            f">= {t['target']:.1f}x | {got} | {t['status']} | {most} | {threads} |"
        )
    lines.append(
        "\nCPU allows: the ratio at which the configuration would run, at the CPU it used "
        "per training step (its process's threads and its env processes), were every core "
        "busy every moment: above it no schedule can go without spending less CPU. Threads "
        "allow (2 thread ranks): (a2) against the reference in the same rounds, two hand "
        "loops of B/2 in two threads at once, nothing collected."
    )
    return "\n".join(lines)


def cores_line(res) -> str:
    """One line: what the runners gain from a second core (b against a, 1 vs 2 cores)."""
    cfg = res["configs"]
    if not {"a", "b", "a_1core", "b_1core"} <= set(cfg):
        return "More cores: not measured here (run without --quick for the 1-core pass)."
    two, one = cfg["b"]["ratio_to_a_median"], cfg["b_1core"]["ratio_to_ref_median"]
    gain_a = cfg["a"]["steps_per_s_median"] / cfg["a_1core"]["steps_per_s_median"]
    gain_b = cfg["b"]["steps_per_s_median"] / cfg["b_1core"]["steps_per_s_median"]
    return (
        f"More cores: (b)/(a) is {one:.2f}x on 1 core and {two:.2f}x on 2; the second core "
        f"speeds (a) up {gain_a:.2f}x and (b) {gain_b:.2f}x (the runner overlaps two ranks' "
        f"env work with inference; the hand loop steps one vector env after the policy)."
    )


def table(results) -> str:
    lines = []
    for res in results.values():
        lines.append(
            f"\n**{res['task']}** ({res['library']}, B={res['B']}, K={K}, T={T}, E={E}"
            f"{', camera 64x64x3 uint8' if res['camera'] else ''})\n"
        )
        lines.append(
            "| configuration | env steps/s | ms / training step | ratio to (a) | collector share |"
        )
        lines.append("|---|---:|---:|---:|---:|")
        for e in res["configs"].values():
            ratio = f"{e['ratio_to_a_median']:.2f}x"
            if "ratio_to" in e:
                ratio += f" ({e['ratio_to_ref_median']:.2f}x of {LABELS[e['ratio_to']][:3]} "
                ratio += f"{e['ratio_to'].split('_', 1)[1].replace('1core', 'on 1 core')})"
            sh = e.get("collector_share_median")
            if sh is not None:
                sh = f"{100 * sh:.1f}% (add {100 * e['collector_add_share_median']:.1f}%)"
            lines.append(
                f"| {e['label']} | {e['steps_per_s_median']:.0f} | "
                f"{e['ms_per_training_step_median']:.1f} | {ratio} | {sh or '-'} |"
            )
        lines.append("")
        lines.append(cores_line(res))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1 step, no 1-core runs")
    parser.add_argument("--camera", action="store_true", help="also with a 64x64x3 image")
    parser.add_argument("--envs", default=",".join(ENVS))
    parser.add_argument("--configs", default=None, help="comma-separated, of " + ",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="training steps per repetition")
    parser.add_argument("--out", default=str(HERE / "results" / "host_env.json"))
    parser.add_argument("--no-scaling", action="store_true",
                        help="skip the raw env probe of what parallel env processes gain")
    parser.add_argument("--settle-s", type=float, default=60.0,
                        help="after the warm-up, wait at most this long for the machine to "
                        "be quiet (under a quarter of a core busy) before the first round")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 11)
    steps = args.steps or (1 if args.quick else 4)
    default = [c for c in CONFIGS if not (args.quick and c.endswith("_1core"))]
    configs = args.configs.split(",") if args.configs else default
    assert configs[0] == "a" and set(configs) <= set(CONFIGS), configs
    if any(c.startswith("d") for c in configs):
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cases = [(n, False) for n in args.envs.split(",")]
    if args.camera:
        cases += [(n, True) for n in args.envs.split(",")]
    t_start = time.perf_counter()
    load_start, cpu_start = os.getloadavg(), cpu_times()
    results = {}
    for name, camera in cases:
        key = name + ("_camera" if camera else "")
        print(f"{key}: {ENVS[name]['task']} B={ENVS[name]['B']}", flush=True)
        results[key] = bench_env(key, ENVS[name], env_configs(key, configs), rounds, steps,
                                 camera, settle_s=args.settle_s)
    if any(c.startswith("d") for c in configs):
        ray.shutdown()
    scaling = {}
    if not args.quick and not args.no_scaling:  # what two env processes gain here
        for name in args.envs.split(","):
            scaling[name] = env_scaling(ENVS[name], steps=2 if name == "sleep1ms" else 4)
            print(scaling_line(name, scaling[name]), flush=True)
    out = {
        "benchmark": "host_env",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "jax_backend": jax.default_backend(),
        "sizes": {"K": K, "T": T, "E": E, "hidden": HIDDEN, "image": list(IMAGE)},
        "rounds": rounds,
        "training_steps_per_repetition": steps,
        "seconds": time.perf_counter() - t_start,
        # Other processes' load on this shared machine (1-minute load average, start / end):
        # near or above the CPU count, the "second core" is mostly someone else's.
        "load_average_1min": [load_start[0], os.getloadavg()[0]],
        # CPU time the hypervisor gave other guests during the run (a VM's "steal"): a
        # noisy run is marked as one.
        "cpu_steal_share": steal_share(cpu_start, cpu_times()),
        "results": results,
        "env_scaling": scaling,
    }
    m = out["machine"]
    machine_line = (
        f"{m['cpu_model']}, {m['cpu_count']} CPUs, jax {m['jax']} ({out['jax_backend']})"
    )
    out["targets"] = targets(results, machine_line, m["cpu_count"])
    path = pathlib.Path(args.out)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"\n{machine_line}; "
        f"medians of {rounds} alternating rounds of {steps} training steps; 1-min load "
        f"average {out['load_average_1min'][0]:.1f} -> {out['load_average_1min'][1]:.1f}"
        + ("" if out["cpu_steal_share"] is None
           else f"; CPU steal {100 * out['cpu_steal_share']:.1f}%")
    )
    print(table(results))
    print(f"\nTargets (issue 26) on {machine_line}:\n")
    print(targets_table(out["targets"]))
    for name, sc in scaling.items():
        print(scaling_line(name, sc))
    print(f"\nwrote {path} ({out['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
