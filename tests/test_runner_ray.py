"""The Ray runner on a local Ray instance: equal to the threaded runner, restarts a killed
worker bit-identically, stops with a named error on a persistent failure.

The module fixture starts a local Ray instance (2 CPUs, no dashboard) and shuts it down.
Its workers import this module (the environments below are pickled by reference), so
the fixture puts ``tests/`` on their ``PYTHONPATH``.
"""

from __future__ import annotations

import functools
import importlib
import os
import pathlib
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ray = pytest.importorskip("ray")

# Ray starts its processes with a fork (then exec): JAX warns about forking a
# multithreaded process, harmless here since the child execs at once.
pytestmark = pytest.mark.filterwarnings(
    "ignore:os.fork\\(\\) was called:RuntimeWarning",
    "ignore::pytest.PytestUnraisableExceptionWarning",
)

import jaxtraj  # noqa: E402
from jaxtraj import EnvTransition, PolicyOutput, TrajectoryKey, TrajectoryPlan  # noqa: E402
from jaxtraj.runners.service import RunnerError  # noqa: E402
from jaxtraj.runners.threads import AsyncRunner, EnvStep  # noqa: E402

B, T, E, RANKS, STEPS, OBS, K, A, SEED = 4, 3, 2, 2, 2, 3, 2, 3, 0
PARAMS = {
    "w": 0.3 * jax.random.normal(jax.random.PRNGKey(1), (OBS, K * A)),
    "v": 0.5 * jax.random.normal(jax.random.PRNGKey(2), (OBS,)),
}


class PointEnv:
    """``B`` point masses in NumPy; every random draw comes from the chunk's key, so a
    restarted worker that redoes a chunk draws the same numbers.

    Args:
      die_at: a key at which the process exits (``os._exit``): once if ``marker`` is a
        path (the file records that it happened), else every time.
      raise_at: a key at which ``step`` raises.
      hang_at: a key at which ``step`` hangs, once (``marker`` records it).
      snapshots: offer ``get_state`` / ``set_state`` (else a restart replays).
    """

    def __init__(
        self,
        rank,
        die_at=None,
        marker=None,
        raise_at=None,
        snapshots=True,
        hang_at=None,
        critic=True,
        delay_s=0.0,
    ):
        self.rank, self.die_at, self.marker, self.raise_at = rank, die_at, marker, raise_at
        self.hang_at, self.critic, self.delay_s = hang_at, critic, delay_s
        self.rand = np.random.default_rng(rank)  # simulator delays only
        if snapshots:
            self.get_state = lambda: (self.pos.copy(), self.t.copy())
            self.set_state = self._set_state

    def _set_state(self, state):
        self.pos, self.t = (np.array(x) for x in state)
        return self.obs()

    def obs(self):
        return {"state": self.pos.copy()}

    def reset(self):
        self.pos = np.random.default_rng(100 + self.rank).normal(size=(B, OBS)).astype(np.float32)
        self.t = np.zeros((B,), np.int32)
        return self.obs()

    def step(self, key, actions):
        if key.as_tuple() == self.die_at:
            if self.marker is None or not os.path.exists(self.marker):
                if self.marker is not None:
                    pathlib.Path(self.marker).touch()
                os._exit(1)  # the worker process dies mid-step
        if key.as_tuple() == self.hang_at and not os.path.exists(self.marker):
            pathlib.Path(self.marker).touch()
            time.sleep(600)  # a hung simulator: alive, silent
        if key.as_tuple() == self.raise_at:
            raise RuntimeError("simulator crashed")
        if self.delay_s:
            time.sleep(self.rand.uniform(0, self.delay_s))
        rng = np.random.default_rng([SEED + 1, *(int(v) for v in key.fields())])
        noise = rng.normal(size=(B, OBS)).astype(np.float32)
        self.pos = self.pos + 0.1 * np.asarray(actions).mean(axis=1)[:, :OBS] + 0.01 * noise
        self.t = self.t + 1
        rewards = -np.square(self.pos).sum(-1).astype(np.float32)
        terms = np.abs(self.pos).max(-1) > 2.0
        truncs = (self.t >= 4) & ~terms
        final = (self.pos @ np.asarray(PARAMS["v"])).astype(np.float32)
        final_obs = self.obs()  # where an episode ends: the observation it ended on
        done = terms | truncs
        fresh = rng.normal(size=(B, OBS)).astype(np.float32)
        self.pos = np.where(done[:, None], fresh, self.pos)
        self.t = np.where(done, 0, self.t).astype(np.int32)
        return EnvStep(
            transition=EnvTransition(rewards=rewards, terminations=terms, truncations=truncs),
            obs=self.obs(),
            # critic=False: no critic here; the runner's value_fn reads final_obs.
            final_values=final if self.critic else None,
            final_obs=None if self.critic else final_obs,
        )


def value_fn(params, obs):
    """The policy side's critic: what PointEnv(critic=True) computes itself."""
    return (np.asarray(obs["state"]) @ np.asarray(params["v"])).astype(np.float32)


def policy_fn(params, obs, rng):
    s = jnp.asarray(obs["state"])
    mean = (s @ params["w"]).reshape(-1, K, A)
    noise = jax.vmap(lambda k: jax.random.normal(k, (K, A)))(jnp.asarray(rng))  # key per row
    return PolicyOutput(
        actions=np.asarray(mean + 0.1 * noise),
        prev_logprobs=np.asarray(-0.5 * jnp.square(noise)),
        prev_values=np.asarray(s @ params["v"]),
        versions=np.zeros((s.shape[0],), np.int32),
    )


def make_collector(**plan_kw):
    plan = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B, num_env_ranks=RANKS, **plan_kw)
    key = TrajectoryKey(0, 0, 0, 0, 0)
    env = PointEnv(0)
    obs = env.reset()
    out = policy_fn(PARAMS, obs, jax.random.split(jax.random.PRNGKey(0), B))
    st = env.step(key, out.actions)
    src = jaxtraj.TrajectorySource(key, B, 0)
    p = jaxtraj.PolicyPart(src, obs, out)
    e = jaxtraj.EnvPart(
        src,
        st.transition,
        initial_transition=st.transition.boundary(),
        final_values=st.final_values,
    )
    return jaxtraj.TrajectoryCollector(plan, p, e)


def by_source(items):
    return {(int(tr.step_id), int(tr.env_rank)): tr for _, tr in items}


def assert_same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def ray_instance():
    tests = str(pathlib.Path(__file__).parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([tests] + ([old] if old else []))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old


def threaded(**kw):
    runner = AsyncRunner(
        make_collector(), [PointEnv(r) for r in range(RANKS)], policy_fn, PARAMS,
        num_steps=STEPS, seed=SEED, **kw
    )
    ref = by_source(runner.run())
    assert sorted(ref) == [(s, r) for s in range(STEPS) for r in range(RANKS)]
    return ref


@pytest.fixture(scope="module")
def reference():
    """The threaded runner's trajectories for the same envs, policy and seeds (one
    policy call for both ranks' rows, as the Ray runner's learner makes)."""
    return threaded()


@pytest.fixture(scope="module")
def reference_per_rank():
    """The threaded runner's with one policy call per rank's chunk (max_batch=1), what
    the Ray actors compute with policy="actor"."""
    return threaded(max_batch=1)


def ray_runner(collector, env_fn=PointEnv, **kw):
    from jaxtraj.runners.ray import RayRunner

    kw.setdefault("num_steps", STEPS)
    return RayRunner(collector, env_fn, policy_fn, PARAMS, seed=SEED, **kw)


@pytest.mark.parametrize(
    "options",
    [{"transport": "ray"}, {}, {"policy": "actor", "chunks_per_call": 2, "max_in_flight": 2}],
    ids=["policy_in_learner_ray", "policy_in_learner_auto", "policy_in_actors_batched"],
)
def test_ray_runner_equals_threaded_runner(ray_instance, reference, reference_per_rank, options):
    ref = reference_per_rank if options.get("policy") == "actor" else reference
    with ray_runner(make_collector(), **options) as runner:
        got = by_source(runner.run())
        # the default on this one-node cluster: direct (policy in the learner), else Ray
        want = "ray" if options.get("policy") == "actor" else options.get("transport", "direct")
        assert runner.transport == want
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_same(got[k], ref[k])


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_learner_inference_is_batched_and_bit_identical_whatever_the_batching(
    ray_instance, reference, transport
):
    """One policy call for every rank whose observation is in: always (a long wait),
    rarely (no wait, random simulator delays), across run(num_steps=1) calls: the
    threaded runner's trajectories every time, whichever the transport (with "direct",
    envs without snapshots: their steps cross as bytes)."""
    chunks = STEPS * E * T
    snapshots = transport != "direct"
    steady = functools.partial(PointEnv, snapshots=snapshots)
    slow = functools.partial(PointEnv, delay_s=0.01, snapshots=snapshots)
    for env_fn, wait, calls in ((steady, 5.0, chunks), (slow, 0.0, None)):
        with ray_runner(make_collector(), env_fn, batch_wait_s=wait, transport=transport) as runner:
            got = by_source(runner.run())
            if calls is None:
                assert runner.calls > chunks  # some calls served one rank
            else:
                assert runner.calls == calls  # one per chunk index
        for k in reference:
            assert_same(got[k], reference[k])
    got = {}
    with ray_runner(make_collector(), slow, num_steps=1, batch_wait_s=0.0,
                    transport=transport) as runner:
        for _ in range(STEPS):
            got.update(by_source(runner.run()))
    for k in reference:
        assert_same(got[k], reference[k])


class _PacedPointEnv(PointEnv):
    """A PointEnv whose every step takes 3 ms more: spinning on a CPU (a simulator that
    computes) or sleeping (one that waits on a clock or I/O)."""

    def __init__(self, rank, how):
        super().__init__(rank, snapshots=False)
        self.how = how

    def step(self, key, actions):
        if self.how == "sleep":
            time.sleep(0.003)
        else:
            end = time.perf_counter() + 0.003
            while time.perf_counter() < end:
                pass
        return super().step(key, actions)


@pytest.mark.parametrize(
    "transport,how", [("direct", "spin"), ("direct", "sleep"), ("ray", "spin")]
)
def test_auto_wait_batches_computing_actors_and_not_waiting_ones(
    ray_instance, reference, transport, how
):
    """The default batch_wait_s="auto", as AsyncRunner's: each actor measures its share
    of a step on CPU and sends it back with the step (as bytes or through Ray); actors
    that compute are waited for (a wait up to their step time), actors that wait are not;
    the trajectories are the reference's. (How many calls the wait saves depends on the
    machine's load: benchmarks/host_env.py measures it; a long fixed wait batching every
    chunk is tested above.)"""
    env_fn = functools.partial(_PacedPointEnv, how=how)
    with ray_runner(make_collector(), env_fn, transport=transport) as runner:
        assert runner.batch_wait_s == "auto"
        got = by_source(runner.run())
        shares, wait, took = list(runner._due.share), runner._wait(), list(runner._due.took)
    assert None not in shares and None not in took
    mean, case = sum(shares) / len(shares), (transport, how, shares, wait, took)
    if how == "spin":
        assert mean >= 0.5 and wait == pytest.approx(min(max(took), 0.05)), case
    else:
        assert mean < 0.5 and wait == 0.0, case
    for k in reference:
        assert_same(got[k], reference[k])


@pytest.mark.parametrize(
    "policy,snapshots,transport",
    [("learner", True, "ray"), ("learner", True, "direct"), ("learner", False, "direct"),
     ("actor", False, "ray")],
    ids=["snapshot", "snapshot_direct", "replay_direct", "replay"],
)
def test_killed_worker_is_restarted_and_the_step_is_bit_identical(
    ray_instance, reference, reference_per_rank, tmp_path, policy, snapshots, transport
):
    """A worker's process dies mid-step: Ray restarts it, the runner restores it (its
    snapshot, or a reset and a replay) and it redoes its chunk, over a new connection
    with transport="direct"."""
    reference = reference if policy == "learner" else reference_per_rank
    die_at = (1, 0, 1, 0, 1)  # step 1, epoch 0, rank 1, chunk 1: mid-step
    marker = str(tmp_path / "died")
    env_fn = functools.partial(_env_dying_once, die_at=die_at, marker=marker, snapshots=snapshots)
    collector = make_collector(resend="accept_identical")
    extra = {"transport": transport} if policy == "learner" else {}
    with ray_runner(collector, env_fn, policy=policy, **extra) as runner:
        got = by_source(runner.run())
        assert runner.restarts == 1
    assert os.path.exists(marker)  # it did die
    assert sorted(got) == sorted(reference)
    assert {k[0] for k, _, _ in collector.missing()} == {STEPS}  # only the next step waits
    for k in reference:
        assert_same(got[k], reference[k])


def _env_dying_once(rank, die_at, marker, snapshots):
    return PointEnv(
        rank, die_at=die_at if rank == die_at[2] else None, marker=marker, snapshots=snapshots
    )


def _env_hanging_once(rank, hang_at, marker):
    return PointEnv(rank, hang_at=hang_at if rank == hang_at[2] else None, marker=marker)


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_hung_worker_is_killed_restarted_and_the_step_is_bit_identical(
    ray_instance, reference, tmp_path, transport
):
    hang = (0, 1, 0, 0, 2)
    marker = str(tmp_path / "hung")
    env_fn = functools.partial(_env_hanging_once, hang_at=hang, marker=marker)
    with ray_runner(make_collector(), env_fn, stall_timeout_s=2.0, transport=transport) as runner:
        got = by_source(runner.run())
        assert runner.restarts == 1
    assert os.path.exists(marker)
    for k in reference:
        assert_same(got[k], reference[k])


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_persistent_failure_names_worker_and_key_and_keeps_the_data(
    ray_instance, reference, transport
):
    fail = (1, 0, 1, 0, 1)
    env_fn = functools.partial(_env_dying_once, die_at=fail, marker=None, snapshots=True)
    collector = make_collector()
    delivered = []
    runner = ray_runner(
        collector, env_fn, max_restarts=1, on_flush=lambda q, tr: delivered.append(tr),
        transport=transport,
    )
    with pytest.raises(RunnerError) as info:
        runner.run()
    err = info.value
    assert err.worker == "env_worker_1" and err.key == fail
    assert "env_worker_1" in str(err) and str(fail) in str(err)
    assert isinstance(err.cause, ray.exceptions.RayActorError)  # Ray's word, either transport
    assert runner.restarts == 1 and all(w.actor is None for w in runner._ranks)  # shut down
    # Step 0 of both ranks was delivered intact; step 1 of rank 1 is kept up to the failure.
    got = {(int(tr.step_id), int(tr.env_rank)): tr for tr in delivered}
    assert {(0, 0), (0, 1)} <= set(got) and err.delivered == len(delivered)
    assert_same(got[(0, 1)], reference[(0, 1)])
    assert collector.current_step(1) == 1
    missing = {(k, half) for k, half, _ in collector.missing() if k[2] == 1}
    assert ((1, 0, 1, 0, 0), "env") not in missing  # chunk 0 of step 1 stayed collected
    assert (fail, "env") in missing and (fail, "policy") not in missing


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_environment_exception_names_worker_and_key(ray_instance, transport):
    fail = (0, 1, 0, 0, 2)
    env_fn = functools.partial(_env_raising, raise_at=fail)
    runner = ray_runner(make_collector(), env_fn, num_steps=1, transport=transport)
    with pytest.raises(RunnerError) as info:
        runner.run()
    assert info.value.worker == "env_worker_0" and info.value.key == fail
    assert "simulator crashed" in str(info.value) and runner.restarts == 0


def _env_failing_late(rank, fail_at):
    """Rank ``fail_at[2]`` raises at ``fail_at`` a second late: the other's step is in."""

    class Late(PointEnv):
        def step(self, key, actions):
            if key.as_tuple() == fail_at:
                time.sleep(1.0)
            return super().step(key, actions)

    return Late(rank, raise_at=fail_at if rank == fail_at[2] else None)


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_the_items_a_failed_run_would_have_returned_are_on_the_error(
    ray_instance, reference, transport
):
    """As the threaded runners: rank 0's step 0, complete and flushed when rank 1 fails,
    is on the error's undelivered (it was lost with run()'s return)."""
    fail = (0, E - 1, 1, 0, T - 1)
    env_fn = functools.partial(_env_failing_late, fail_at=fail)
    with ray_runner(make_collector(), env_fn, num_steps=1, transport=transport) as runner:
        with pytest.raises(RunnerError, match="simulator crashed") as info:
            runner.run()
    err = info.value
    assert err.worker == "env_worker_1" and err.key == fail and err.delivered == 0
    assert runner.delivered == 0 and len(runner.undelivered) == 1
    (queue_key, item), = err.undelivered
    assert queue_key == "default"
    assert_same(item, reference[(0, 0)])


def _unwrapped_gymnasium(rank):
    import gymnasium as gym

    return gym.make_vec("CartPole-v1", num_envs=B, vectorization_mode="sync")


def test_an_unwrapped_gymnasium_env_is_refused_naming_the_adapter(ray_instance):
    """As the threaded runners: the actor refuses it as it is built."""
    runner = ray_runner(make_collector(), _unwrapped_gymnasium, num_steps=1, max_restarts=0)
    with pytest.raises(RunnerError, match=r"env_worker_\d.*got a gymnasium env "
                       r"\(SyncVectorEnv\).*wrap it in jaxtraj\.envs\.GymnasiumEnv"):
        runner.run()


def _env_failing_to_build(rank):
    if rank == 1:
        raise OSError("no licence for the simulator")
    return PointEnv(rank)


def test_an_env_that_cannot_be_built_names_the_worker_without_colour_codes(ray_instance):
    """A factory that raises in its actor: the error names the rank and says the factory's
    exception, without the terminal colour codes Ray's error text carries."""
    runner = ray_runner(make_collector(), _env_failing_to_build, num_steps=1, max_restarts=0)
    with pytest.raises(RunnerError) as info:
        runner.run()
    assert info.value.worker == "env_worker_1"
    said = str(info.value)
    assert "no licence for the simulator" in said and "\x1b" not in said


def _short_logprobs(params, obs, rng):
    out = policy_fn(params, obs, rng)
    return out.replace(prev_logprobs=out.prev_logprobs[:, :-1])


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_a_bad_policy_output_beside_good_actions_names_the_field(ray_instance, transport):
    """The actions go to the actors before the rest of the output is checked (they are
    what the layout holds): a bad log-probability is still refused naming the field, and
    no policy half gets in."""
    from jaxtraj.runners.ray import RayRunner

    collector = make_collector()
    runner = RayRunner(collector, PointEnv, _short_logprobs, PARAMS, seed=SEED, num_steps=1,
                       transport=transport)
    with pytest.raises(RunnerError) as info:
        runner.run()
    assert info.value.worker == "policy_worker" and info.value.key[4] == 0
    assert "prev_logprobs" in str(info.value)
    assert all(w.actor is None for w in runner._ranks)
    assert {k for k, half, _ in collector.missing() if half == "policy"} == {
        (0, e, r, 0, t) for e in range(E) for r in range(RANKS) for t in range(T)}


class _UnsendableEnv(PointEnv):
    def reset(self):
        super().reset()
        return {"state": self.pos.copy(), "hook": lambda: None}  # does not pickle


def test_direct_transport_names_a_reply_that_cannot_be_sent(ray_instance):
    runner = ray_runner(make_collector(), _UnsendableEnv, num_steps=1, transport="direct")
    with pytest.raises(RunnerError) as info:
        runner.run()
    assert info.value.worker in ("env_worker_0", "env_worker_1")
    assert "the env's reply (dict) cannot be sent to the learner (its reset request)" in str(
        info.value
    )
    assert runner.restarts == 0 and all(w.actor is None for w in runner._ranks)


def test_transport_arguments_are_checked():
    from jaxtraj.runners.ray import RayRunner

    with pytest.raises(
        ValueError, match="transport must be 'auto', 'ray' or 'direct', got 'grpc'"
    ):
        RayRunner(make_collector(), PointEnv, policy_fn, PARAMS, transport="grpc")
    with pytest.raises(ValueError, match="transport='direct' .* carries the chunks of policy='learner'"):
        RayRunner(make_collector(), PointEnv, policy_fn, PARAMS, policy="actor", transport="direct")
    # the default with the policy in the actors: their results go through Ray
    assert RayRunner(make_collector(), PointEnv, policy_fn, PARAMS, policy="actor").transport == "ray"
    # before the actors are made the default is undecided
    assert RayRunner(make_collector(), PointEnv, policy_fn, PARAMS).transport == "auto"
    # env ranks the collector does not own: refused before any actor is made
    with pytest.raises(ValueError, match=f"env rank {RANKS} \\(stage 0\\) is not a source"):
        RayRunner(make_collector(), PointEnv, policy_fn, PARAMS, env_ranks=[0, RANKS])
    # AsyncRunner's list of factories: named, before any actor is made
    with pytest.raises(TypeError, match="env_fn must be one callable.*got list"):
        RayRunner(make_collector(), [PointEnv, PointEnv], policy_fn, PARAMS)


def test_the_default_transport_is_direct_but_for_ray_client_and_tls(ray_instance, monkeypatch):
    """transport="auto" is direct (each rank going over to Ray calls where its actor
    cannot reach the learner), but for a learner connected through Ray Client (off the
    cluster) and where Ray's own connections use TLS (the direct ones are not encrypted)."""
    from jaxtraj.runners import ray as ray_runners

    for client, tls, want in ((False, None, "direct"), (True, None, "ray"),
                              (False, "1", "ray"), (False, "0", "direct")):
        monkeypatch.setattr(ray.util.client.ray, "is_connected", lambda c=client: c)
        if tls is None:
            monkeypatch.delenv("RAY_USE_TLS", raising=False)
        else:
            monkeypatch.setenv("RAY_USE_TLS", tls)
        assert ray_runners._ray_client() is client
        runner = ray_runner(make_collector(), num_steps=1)
        try:
            assert runner.transports == {r: "auto" for r in range(RANKS)}
            runner.actors()
            assert runner.transport == want
            assert runner.transports == {r: want for r in range(RANKS)}
            assert (runner._listener is not None) is (want == "direct")
        finally:
            runner.close()

    def no_client():
        raise RuntimeError("an API that differs")

    monkeypatch.setattr(ray.util.client.ray, "is_connected", no_client)
    assert not ray_runners._ray_client()


def test_auto_transport_goes_through_ray_where_the_learner_cannot_listen(
    ray_instance, reference, monkeypatch
):
    """transport="auto" and no address to listen on: a warning, every chunk a Ray call,
    the reference's trajectories; asked for, the error."""
    import errno
    import socket

    def cannot(*args, **kwargs):
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

    monkeypatch.setattr(socket, "create_server", cannot)
    with pytest.warns(RuntimeWarning, match="the learner cannot listen for the actors"):
        with ray_runner(make_collector(), num_steps=1) as runner:
            runner.actors()
            assert runner.transports == {r: "ray" for r in range(RANKS)}
            got = by_source(runner.run())
    for k in got:
        assert_same(got[k], reference[k])
    with ray_runner(make_collector(), num_steps=1, transport="direct") as runner:
        with pytest.raises(OSError, match="the learner cannot listen on"):
            runner.actors()


def _env_unreachable(rank, unreachable, die_at=None, marker=None, error=None):
    """A PointEnv whose actor cannot reach the learner: ranks in ``unreachable`` from the
    start, or (``marker``) the rank that died at ``die_at``, once restarted (a node
    behind a firewall). Built in the actor's process, so refusing its connections there
    stands for the network refusing them (``error``: raising that instead, not a
    network's error)."""
    import socket

    env = PointEnv(rank, die_at=die_at if die_at and rank == die_at[2] else None,
                   marker=marker, snapshots=False)
    restarted = die_at is not None and rank == die_at[2] and os.path.exists(marker)
    if rank in unreachable or restarted:  # (another rank's actor may start late: not it)
        def refused(address, *args, **kwargs):
            raise error or ConnectionRefusedError(111, "Connection refused (a firewall)")

        socket.create_connection = refused
    return env


def test_auto_transport_sends_a_rank_that_cannot_reach_the_learner_through_ray(
    ray_instance, reference
):
    """transport="auto": rank 1's actor cannot connect to the learner, so its chunks go
    as Ray calls (a warning names it and says the way out) while rank 0 keeps its
    connection; the trajectories are the reference's."""
    env_fn = functools.partial(_env_unreachable, unreachable=(1,))
    with pytest.warns(RuntimeWarning) as warned:
        with ray_runner(make_collector(), env_fn) as runner:
            got = by_source(runner.run())
            assert runner.transport == "direct"
            assert runner.transports == {0: "direct", 1: "ray"}
            assert runner._ranks[0].conn is not None and runner._ranks[1].conn is None
            assert runner.restarts == 0
    messages = [str(w.message) for w in warned if "cannot reach the learner" in str(w.message)]
    assert len(messages) == 1
    assert messages[0].startswith(f"RayRunner: env_worker_1's actor cannot reach the learner at "
                                  f"{runner._address} (ConnectionError")
    assert "Connection refused" in messages[0] and "transport='ray'" in messages[0]
    for k in reference:
        assert_same(got[k], reference[k])

    # every rank unreachable: the listener is closed, every chunk a Ray call
    env_fn = functools.partial(_env_unreachable, unreachable=tuple(range(RANKS)))
    with pytest.warns(RuntimeWarning, match="cannot reach the learner"):
        with ray_runner(make_collector(), env_fn) as runner:
            got = by_source(runner.run())
            assert runner.transports == {r: "ray" for r in range(RANKS)}
            assert runner._listener is None
    for k in reference:
        assert_same(got[k], reference[k])

    # asked for: the same actor stops the run, naming its rank
    with ray_runner(make_collector(), env_fn, num_steps=1, transport="direct") as runner:
        with pytest.raises(RunnerError, match="did not connect to the learner"):
            runner.run()

    # an error of the actor's that is not the network's (a bug, another jaxtraj on its
    # node) is not taken for an unreachable learner: it stops the run, named
    env_fn = functools.partial(_env_unreachable, unreachable=(1,), error=TypeError("a bug"))
    with ray_runner(make_collector(), env_fn, num_steps=1) as runner:
        with pytest.raises(RunnerError, match="TypeError: a bug") as info:
            runner.run()
    assert info.value.worker == "env_worker_1"


def test_auto_transport_sends_a_restarted_actor_that_cannot_reach_the_learner_through_ray(
    ray_instance, reference, tmp_path
):
    """A rank's actor dies mid-step and Ray restarts it where it cannot reach the learner:
    it is restored (a reset and a replay) and redoes its chunk as Ray calls; the step is
    bit-identical."""
    die_at, marker = (1, 0, 1, 0, 1), str(tmp_path / "died")
    env_fn = functools.partial(_env_unreachable, unreachable=(), die_at=die_at, marker=marker)
    collector = make_collector(resend="accept_identical")
    with pytest.warns(RuntimeWarning, match="env_worker_1's actor cannot reach the learner"):
        with ray_runner(collector, env_fn) as runner:
            got = by_source(runner.run())
            assert runner.restarts == 1
            assert runner.transports == {0: "direct", 1: "ray"}
    assert os.path.exists(marker)  # it did die
    for k in reference:
        assert_same(got[k], reference[k])


class _SchedPointEnv(PointEnv):
    """Records the scheduling policy of the thread that built it and of a thread it started
    while being built (as EnvPool starts its pool's threads), and writes the policy of the
    thread it steps in to ``<log>-<rank>`` (the direct transport's loop holds the actor's
    thread while connected: no call reaches it then)."""

    def __init__(self, rank, log):
        super().__init__(rank)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        thread.start()
        thread.join()
        self.built = (os.sched_getscheduler(0), seen[0])
        self.log = f"{log}-{rank}"

    def step(self, key, actions):
        pathlib.Path(self.log).write_text(str(os.sched_getscheduler(0)))
        return super().step(key, actions)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.parametrize("policy", ["learner", "actor"])
def test_env_actors_run_under_sched_batch_where_the_learner_wakes_them(
    ray_instance, policy, tmp_path
):
    """With the policy in the learner, as env processes do (tests/test_process_wire.py):
    an actor woken by the learner every chunk does not take the learner's CPU; its env
    steps in that thread (the direct transport's loop, the default here). With the policy
    in the actors, the policy they inherit."""
    before = os.sched_getscheduler(0)
    if before != os.SCHED_OTHER:
        pytest.skip(f"the tests run under scheduling policy {before}, not the default")
    want = os.SCHED_BATCH if policy == "learner" else before
    log = str(tmp_path / "stepped")
    env_fn = functools.partial(_SchedPointEnv, log=log)
    runner = ray_runner(make_collector(), env_fn=env_fn, num_steps=1, policy=policy)
    try:
        for actor in runner.actors():  # before the run: the direct loop not yet started
            got = ray.get(actor.__ray_call__.remote(
                lambda w: (w.env.built, os.sched_getscheduler(0))), timeout=60)
            assert got == ((want, want), want)
        assert len(runner.run()) == RANKS
    finally:
        runner.close()
    assert [int(pathlib.Path(f"{log}-{r}").read_text()) for r in range(RANKS)] == [want] * RANKS
    assert os.sched_getscheduler(0) == before  # the learner's thread is left as it was


def _free_port() -> int:
    """A port nobody listens on (bound, then closed)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_direct_transport_names_the_rank_whose_actor_cannot_connect(ray_instance):
    """An actor that cannot reach the learner (given a port nobody listens on) stops the
    run with a RunnerError naming its rank, the address it tried and the way out."""
    nowhere = ("127.0.0.1", _free_port())  # nobody listens there: refused
    runner = ray_runner(make_collector(), num_steps=1, transport="direct")
    runner.actors()  # the actors made, the learner listening; then a wrong address given
    runner._address = nowhere
    with pytest.raises(RunnerError) as info:
        runner.run()
    assert info.value.worker in ("env_worker_0", "env_worker_1")
    message = str(info.value)
    assert "did not connect to the learner" in message and "transport='ray'" in message
    assert f"cannot reach the learner at {nowhere}" in message
    assert all(w.actor is None for w in runner._ranks) and runner._listener is None


def test_direct_transport_admits_only_the_runners_actors(ray_instance, reference, monkeypatch):
    """A client that does not prove the runner's key is closed before anything of it is
    unpickled, one that never speaks holds up no one, and the run is the reference's."""
    import socket

    import jaxtraj.runners.ray as ray_module

    monkeypatch.setattr(ray_module, "_HANDSHAKE_S", 1.0)
    with ray_runner(make_collector(), transport="direct") as runner:
        runner.actors()  # the actors made, the learner listening
        silent = socket.create_connection(runner._address)  # connects, never speaks
        wrong = socket.create_connection(runner._address, timeout=10)
        wrong.sendall(b"n" * 32)  # a nonce; the learner proves the key on it
        proof = wrong.recv(64)
        assert len(proof) == 64
        wrong.sendall(b"x" * 32 + (0).to_bytes(4, "little"))  # a wrong proof for rank 0
        assert wrong.recv(1) == b""  # closed on it
        with pytest.raises(ConnectionError, match="does not hold the runner's key"):
            ray_module._dial(runner._address, b"not the key", 0)  # nor do we trust it
        got = by_source(runner.run())
        acceptor = runner._acceptor
        silent.close()
        wrong.close()
    assert not acceptor.is_alive() and runner._listener is None  # close() ended both
    for k in reference:
        assert_same(got[k], reference[k])


def _env_raising(rank, raise_at):
    return PointEnv(rank, raise_at=raise_at if rank == raise_at[2] else None)


def test_policy_update_is_broadcast_and_stamped(ray_instance):
    collector = make_collector()
    with ray_runner(collector, policy="actor", num_steps=1, max_in_flight=1) as runner:
        first = by_source(runner.run())
        assert runner.update_policy(PARAMS) == 1
        second = by_source(runner.run())  # the next step, environments continue
    assert sorted(first) == [(0, r) for r in range(RANKS)]
    assert sorted(second) == [(1, r) for r in range(RANKS)]
    assert all((np.asarray(tr.versions) == 0).all() for tr in first.values())
    assert all((np.asarray(tr.versions) == 1).all() for tr in second.values())


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_keyboard_interrupt_shuts_the_actors_down(ray_instance, transport):
    def interrupt(queue_key, traj):
        raise KeyboardInterrupt

    collector = make_collector()
    runner = ray_runner(collector, on_flush=interrupt, transport=transport)
    actors = runner.actors()
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    assert all(w.actor is None for w in runner._ranks)
    # ray.kill is asynchronous: a call sent right after it may still be served. The actor
    # must be gone within the deadline.
    deadline, gone = time.monotonic() + 30, False
    while not gone and time.monotonic() < deadline:
        try:
            ray.get(actors[0].pid.remote(), timeout=30)
            time.sleep(0.1)
        except ray.exceptions.RayActorError:
            gone = True
    assert gone, "the env worker actor is still alive 30 s after the interrupt"
    assert collector.current_step(0) + collector.current_step(1) >= 1  # the flush happened


def test_import_without_ray_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    monkeypatch.delitem(sys.modules, "jaxtraj.runners.ray", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'jaxtraj\[ray\]'"):
        importlib.import_module("jaxtraj.runners.ray")


@pytest.mark.parametrize(
    "options",
    [{"transport": "ray"}, {"transport": "direct"}, {"policy": "actor", "chunks_per_call": 2}],
    ids=["value_in_learner", "value_in_learner_direct", "value_in_actors"],
)
def test_terminal_inference_on_the_policy_side_env_actors_need_no_critic(
    ray_instance, reference, reference_per_rank, options
):
    reference = reference_per_rank if options.get("policy") == "actor" else reference
    # The reference (env critic) truncates mid-epoch and bootstraps the last chunk.
    assert any(np.asarray(tr.truncations)[:, 1:-1].any() for tr in reference.values())
    # "direct": no snapshots, so each step's EnvStep (final_obs included) crosses as bytes
    direct = options.get("transport") == "direct"
    env_fn = functools.partial(PointEnv, critic=False, snapshots=not direct)
    with ray_runner(make_collector(), env_fn, value_fn=value_fn, **options) as runner:
        got = by_source(runner.run())
    assert sorted(got) == sorted(reference)
    for k in reference:
        assert_same(got[k], reference[k])


def test_run_once_per_training_step_carries_envs_keys_and_versions(ray_instance):
    steps = 10
    ref = by_source(
        AsyncRunner(
            make_collector(),
            [PointEnv(r) for r in range(RANKS)],
            policy_fn,
            PARAMS,
            num_steps=steps,
            seed=SEED,
        ).run()
    )
    env_fn = functools.partial(PointEnv, critic=False)
    got = {}
    with ray_runner(make_collector(), env_fn, value_fn=value_fn, num_steps=1) as runner:
        for it in range(steps):
            items = by_source(runner.run())
            assert sorted(items) == [(it, r) for r in range(RANKS)]
            got.update(items)
            assert runner.update_policy(PARAMS) == it + 1
    for (s, r), tr in got.items():
        np.testing.assert_array_equal(np.asarray(tr.versions), s)  # version s in step s
        # Environments continue across calls: the same as one uninterrupted run.
        assert_same(tr.replace(versions=None), ref[(s, r)].replace(versions=None))


def test_actors_that_cannot_be_placed_are_warned_about_not_waited_for_silently(
    ray_instance, reference, monkeypatch
):
    """Actors asking for more CPUs than the cluster has are named at start; actors that
    wait behind another runner's (which holds the CPUs until it is closed) are named once
    the wait passes START_WARN_S, and the run goes on when the CPUs free up."""
    import threading

    import jaxtraj.runners.ray as ray_module

    never = ray_runner(make_collector(), num_steps=1, actor_options={"num_cpus": 2})
    with pytest.warns(RuntimeWarning, match=r"need 4 CPUs .* the cluster has 2"):
        never.actors()
    never.close()

    blocker = ray_runner(make_collector(), num_steps=1, actor_options={"num_cpus": 1})
    blocker.run()  # its two actors are up and hold both CPUs
    monkeypatch.setattr(ray_module, "START_WARN_S", 1.0)
    closing = threading.Timer(3.0, blocker.close)
    closing.start()
    try:
        with ray_runner(make_collector(), num_steps=1, actor_options={"num_cpus": 1}) as runner:
            with pytest.warns(RuntimeWarning, match=r"env ranks \[0, 1\] have not answered"):
                got = by_source(runner.run())
    finally:
        closing.join()
    assert sorted(got) == [(0, r) for r in range(RANKS)]
    for k in got:
        assert_same(got[k], reference[k])


@pytest.mark.parametrize("host", [None, "0.0.0.0", "::"])
def test_direct_transport_listens_where_it_is_told(ray_instance, reference, host):
    """direct_address=(host, port): the learner listens on that port (a firewall's open
    one; on every interface with "0.0.0.0" and "::", the actors dialing the node's
    address), and the run is the reference's."""
    import socket

    if host == "::" and not socket.has_dualstack_ipv6():
        pytest.skip("no dual-stack IPv6 sockets here")
    port = _free_port()
    with ray_runner(make_collector(), num_steps=1, transport="direct",
                    direct_address=(host, port)) as runner:
        got = by_source(runner.run())
        listening = runner._listener.getsockname()
        assert listening[1] == port and runner._address[1] == port
        if host is not None:  # every interface; the actors were given the node's address
            assert listening[0] == host
            assert runner._address[0] == ray.util.get_node_ip_address()
    assert sorted(got) == [(0, r) for r in range(RANKS)]
    for k in got:
        assert_same(got[k], reference[k])


def test_direct_transport_names_a_port_in_use(ray_instance, reference):
    """A port taken by another listener, or a host not of this node, stops run() before
    anything is collected (no actor made), the error naming the address, the argument
    and the likely cause; the collector then takes a new runner's steps as if nothing
    had happened."""
    import socket

    collector = make_collector()
    waiting = collector.missing()  # a fresh collector's: all of step 0
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        runner = ray_runner(collector, num_steps=1, transport="direct",
                            direct_address=("127.0.0.1", port))
        with pytest.raises(OSError, match=rf"cannot listen on \('127.0.0.1', {port}\) "
                                          rf"\(direct_address=\('127.0.0.1', {port}\)\).*"
                                          "the port is in use"):
            runner.run()
    assert runner._listener is None and all(w.actor is None for w in runner._ranks)
    runner.close()
    elsewhere = ray_runner(collector, num_steps=1, transport="direct",
                           direct_address=("192.0.2.1", 0))  # TEST-NET-1: no node's
    with pytest.raises(OSError, match="is '192.0.2.1' an address of this node"):
        elsewhere.run()
    assert elsewhere._listener is None and all(w.actor is None for w in elsewhere._ranks)
    assert collector.missing() == waiting  # nothing inserted
    with ray_runner(collector, num_steps=1, transport="direct") as runner:
        got = by_source(runner.run())
    assert sorted(got) == [(0, r) for r in range(RANKS)]
    for k in got:
        assert_same(got[k], reference[k])


def test_direct_address_is_checked():
    from jaxtraj.runners.ray import RayRunner

    with pytest.raises(ValueError, match="direct_address is where transport='direct' listens"):
        RayRunner(make_collector(), PointEnv, policy_fn, PARAMS, transport="ray",
                  direct_address=(None, 0))
    with pytest.raises(ValueError, match="carries the chunks of policy='learner'"):
        RayRunner(make_collector(), PointEnv, policy_fn, PARAMS, policy="actor",
                  direct_address=(None, 0))
    # with the default transport an address to listen on asks for the direct one
    runner = RayRunner(make_collector(), PointEnv, policy_fn, PARAMS, direct_address=(None, 0))
    assert runner.transport == "direct"
    for bad in [5000, ("h",), ("h", "80"), ("h", 70000), ("h", -1), (1, 80), ("h", True)]:
        with pytest.raises(ValueError, match="direct_address must be \\(host, port\\)"):
            RayRunner(make_collector(), PointEnv, policy_fn, PARAMS, transport="direct",
                      direct_address=bad)
    runner = RayRunner(make_collector(), PointEnv, policy_fn, PARAMS, transport="direct",
                       direct_address=("h", np.int64(8000)))  # any integer
    assert runner.direct_address == ("h", 8000) and type(runner.direct_address[1]) is int


def test_direct_transport_warns_of_a_loopback_address(ray_instance):
    """A host name that resolves to a loopback address here (Debian's /etc/hosts maps
    the machine's own name so) is one other nodes cannot reach: a warning says so, and
    the actors are given the address bound, not the name."""
    from jaxtraj.runners.ray import _loopback

    node = ray.util.get_node_ip_address()
    if _loopback(node):
        pytest.skip(f"this node's address {node} is itself a loopback one")
    runner = ray_runner(make_collector(), transport="direct", direct_address=("localhost", 0))
    with pytest.warns(UserWarning, match="a loopback address: actors on other nodes cannot"):
        runner.actors()
    try:
        assert _loopback(runner._address[0])
    finally:
        runner.close()


def test_direct_transport_sends_steps_as_bytes_and_equals_the_threaded_runner(
    ray_instance, reference
):
    """transport="direct": a chunk's actions cross as bytes, and so does the EnvStep of an
    env without snapshots (read by template; the env half made in the learner from it
    and the previous chunk's transition); across run(num_steps=1) calls, the threaded
    runner's trajectories. An env with snapshots (the other tests' PointEnv) has its
    result pickled, the env half made in the learner all the same."""
    from jaxtraj.runners import bound
    from jaxtraj.runners import ray as ray_module

    sent, read = [], []
    step_request, reader_call = ray_module._step_request, bound._StepReader.__call__

    def counted_request(*args):
        message = step_request(*args)
        sent.append(message is not None)
        return message

    def counted_read(self, message):
        read.append(message[:1])
        return reader_call(self, message)

    # Some chunk 0 carries its previous chunk's flags (an episode ended there): the env
    # half made in the learner must take them from the transition it kept.
    assert any(np.asarray(tr.dones)[:, 0].any() for tr in reference.values())
    env_fn = functools.partial(PointEnv, snapshots=False)
    got = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray_module, "_step_request", counted_request)
        patch.setattr(bound._StepReader, "__call__", counted_read)
        with ray_runner(make_collector(), env_fn, num_steps=1, transport="direct") as runner:
            for _ in range(STEPS):
                got.update(by_source(runner.run()))
            assert all(len(w.readers.by_number) == 1 for w in runner._ranks)  # one template a rank
    chunks = STEPS * E * T * RANKS
    assert sent == [True] * chunks  # every step's actions as bytes
    # every step's result but each rank's first (its template, pickled) read as bytes
    assert read == [b"R"] * (chunks - RANKS)
    assert sorted(got) == sorted(reference)
    for k in reference:
        assert_same(got[k], reference[k])


class _ActorOnlyNode:
    """A pytree node registered in the actors' processes only (by the env below): in the
    learner it is one opaque leaf, so a step's template reads as another tree there."""

    def __init__(self, x):
        self.x = x


class _ActorOnlyNodeEnv(PointEnv):
    def __init__(self, rank):
        super().__init__(rank, snapshots=False)
        try:
            jax.tree_util.register_pytree_node(
                _ActorOnlyNode, lambda n: ((n.x,), None), lambda _, xs: _ActorOnlyNode(*xs))
        except ValueError:  # registered already in this process
            pass

    def step(self, key, actions):
        out = super().step(key, actions)  # an env critic: nothing in the learner reads final_obs
        return EnvStep(out.transition, out.obs, final_values=out.final_values,
                       final_obs=_ActorOnlyNode(out.obs["state"]))


def test_direct_transport_pickles_every_reply_after_a_template_the_learner_reads_otherwise(
    ray_instance, reference
):
    """A step's EnvStep holds a node the learner does not know: its template cannot be
    read there, so the learner asks the actor to pickle every reply after it, and the run
    goes on with the threaded runner's trajectories (nothing read as bytes)."""
    from jaxtraj.runners import bound

    read = []
    reader_call = bound._StepReader.__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bound._StepReader, "__call__",
                      lambda self, message: (read.append(message[:1]), reader_call(self, message))[1])
        with ray_runner(make_collector(), _ActorOnlyNodeEnv, transport="direct") as runner:
            got = by_source(runner.run())
            assert all(not w.readers.by_number for w in runner._ranks)  # no template was readable
    assert read == []
    assert sorted(got) == sorted(reference)
    for k in reference:
        assert_same(got[k], reference[k])


class CountingEnv(PointEnv):
    """A PointEnv that counts its steps, for call_env to read."""

    steps = 0

    def step(self, key, actions):
        self.steps += 1
        return super().step(key, actions)

    def seen(self, tag):
        return tag, self.rank, self.steps


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_call_env_reaches_each_ranks_env_from_on_flush_and_between_runs(
    ray_instance, reference, transport
):
    """call_env runs an env's method in its actor: before the first run, from an on_flush
    mid-run (with the direct transport, the answers in flight on the rank's connection
    read first and kept for the run; a rank still connecting waited for), and between
    runs, where a Ray call to an actor serving its connection would wait for close();
    the trajectories are unchanged; a rank it does not have is named, an error raised
    in the env is raised here."""
    runner, seen, got = None, [], {}

    def on_flush(_, tr):
        got[(int(tr.step_id), int(tr.env_rank))] = tr
        seen.append([runner.call_env(r, "seen", "flush") for r in range(RANKS)])

    runner = ray_runner(make_collector(), CountingEnv, on_flush=on_flush, transport=transport,
                        num_steps=1)
    with runner:
        assert runner.call_env(1, "seen", "before") == ("before", 1, 0)
        for _ in range(STEPS):
            runner.run()
        between = [runner.call_env(r, "seen", tag="between") for r in range(RANKS)]
        with pytest.raises(ValueError, match="env rank 7 is not one of"):
            runner.call_env(7, "seen", "x")
        with pytest.raises(AttributeError):
            runner.call_env(0, "no_such_method")
        assert runner.call_env(1, "seen", "after an error") == ("after an error", 1, STEPS * E * T)
        assert runner.transports == {r: transport for r in range(RANKS)}
    assert sorted(got) == sorted(reference)
    for k in reference:
        assert_same(got[k], reference[k])
    assert len(seen) == STEPS * RANKS
    assert all([c[1] for c in calls] == list(range(RANKS)) for calls in seen)
    assert any(c[2] < STEPS * E * T for calls in seen for c in calls)  # some mid-run
    assert between == [("between", r, STEPS * E * T) for r in range(RANKS)]


# -- from a review: restarts while nothing is in flight, call_env bounded, failures ------


class SelfResetEnv(PointEnv):
    """A PointEnv that steps as soon as it is built (its constructor resets it), as a
    simulator whose model has a state once loaded: an actor Ray restarts holds one."""

    def __init__(self, rank, **kw):
        super().__init__(rank, **kw)
        self.reset()


class DieIdleEnv(SelfResetEnv):
    """Rank 0 answers chunk ``at`` (step, epoch, chunk), then its process exits 0.3 s
    later (once: ``marker``), while it waits in the learner for a batched inference:
    rank 1 takes ``slow_s`` over the same chunk."""

    def __init__(self, rank, at, marker, slow_s, snapshots=True):
        super().__init__(rank, snapshots=snapshots)
        self.at, self.marker, self.slow_s = at, marker, slow_s

    def step(self, key, actions):
        out = super().step(key, actions)
        k = key.as_tuple()
        if (k[0], k[1], k[4]) == self.at:
            if self.rank == 0 and not os.path.exists(self.marker):
                pathlib.Path(self.marker).touch()
                threading.Thread(target=lambda: (time.sleep(0.3), os._exit(1)),
                                 daemon=True).start()
            if self.rank == 1:
                time.sleep(self.slow_s)
        return out


class EndOfRunDeathEnv(PointEnv):
    """Rank 1 dies 0.3 s after answering its last chunk of step 0 (once: ``died``), and
    its restarted process builds slowly; rank 0 holds its own last chunk until ``go``
    exists (made once the learner saw rank 1 lost): the run's last chunks are in while
    rank 1's restart is under way."""

    def __init__(self, rank, died, go):
        if rank == 1 and os.path.exists(died):
            time.sleep(3.0)
        super().__init__(rank, snapshots=False)
        self.died, self.go = died, go

    def step(self, key, actions):
        out = super().step(key, actions)
        if key.as_tuple() == (0, E - 1, 1, 0, T - 1) and not os.path.exists(self.died):
            pathlib.Path(self.died).touch()
            threading.Thread(target=lambda: (time.sleep(0.3), os._exit(1)), daemon=True).start()
        if key.as_tuple() == (0, E - 1, 0, 0, T - 1):
            end = time.monotonic() + 30
            while not os.path.exists(self.go) and time.monotonic() < end:
                time.sleep(0.001)
        return out


def assert_runs_equal(got, reference):
    """The same (step, rank) trajectories, bit for bit."""
    assert sorted(got) == sorted(reference)
    for k in reference:
        assert_same(got[k], reference[k])


def _wait_restarted(actor, pid, within_s=60.0):
    """Until Ray's restart of ``actor`` (whose process was ``pid``) answers."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if ray.get(actor.pid.remote(), timeout=5) != pid:
                return
        except Exception:  # noqa: BLE001  (restarting)
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the actor was not restarted within {within_s} s")


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_an_actor_restarted_between_runs_is_restored_before_it_steps(
    ray_instance, transport
):
    """Ray restarts an actor that died with nothing in flight to it: its env is a fresh
    one, which steps at once. It is restored first (the next run's chunks equal the
    threaded runner's), and call_env meanwhile says so instead of reading the fresh env."""
    reference = threaded(max_batch=1)  # num_steps=1 runs batch nothing here either
    with ray_runner(make_collector(), SelfResetEnv, num_steps=1, transport=transport,
                    batch_wait_s=0.0, max_batch=1) as runner:
        got = by_source(runner.run())
        actor = runner.actors()[1]
        pid = ray.get(actor.pid.remote()) if transport == "ray" else None
        ray.kill(actor, no_restart=False)
        if transport == "ray":
            _wait_restarted(actor, pid)
            with pytest.raises(RuntimeError, match="env_worker_1's actor was restarted"):
                runner.call_env(1, "get_state")
        got.update(by_source(runner.run()))
        assert runner.restarts == 1
    assert_runs_equal(got, reference)


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_an_actor_that_dies_while_its_rank_waits_for_inference_redoes_nothing_stale(
    ray_instance, reference, tmp_path, transport
):
    """A rank's actor dies while the rank waits in the learner for a batched inference
    (nothing in flight to it): restored, it steps its next chunk's actions (not its last
    chunk's again, nor while its connection is down)."""
    marker = str(tmp_path / "died")
    env_fn = functools.partial(DieIdleEnv, at=(0, 0, 1), marker=marker, slow_s=4.0,
                               snapshots=transport == "ray")
    collector = make_collector(resend="accept_identical")
    with ray_runner(collector, env_fn, transport=transport, batch_wait_s=10.0) as runner:
        got = by_source(runner.run())
        assert runner.restarts == 1
    assert os.path.exists(marker)
    assert_runs_equal(got, reference)


def test_a_rank_restarting_as_a_run_ends_goes_on_right_in_the_next(ray_instance, tmp_path):
    """A rank's actor dies after its last chunk of a run, and the run ends while Ray
    restarts it: the next run restores it and goes on from there (not with the last
    chunk's actions again)."""
    reference = threaded(max_batch=1)
    died, go = str(tmp_path / "died"), str(tmp_path / "go")
    runner = ray_runner(make_collector(), functools.partial(EndOfRunDeathEnv, died=died, go=go),
                        num_steps=1, transport="direct", max_batch=1)
    stop = threading.Event()

    def watch():  # the learner saw rank 1 lost: rank 0 may finish its last chunk
        while not stop.is_set():
            try:
                lost = runner._ranks[1].pending[0][0] in ("lost", "ping")
            except IndexError:  # (emptied meanwhile by the run's thread)
                lost = False
            if lost:
                pathlib.Path(go).touch()
                return
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()
    with runner:
        got = by_source(runner.run())
        stop.set()
        got.update(by_source(runner.run()))
        assert runner.restarts == 1
    assert_runs_equal(got, reference)


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_call_env_to_a_hung_env_gives_up_after_stall_timeout(ray_instance, tmp_path, transport):
    """call_env from on_flush to a rank whose env hangs: with stall_timeout_s the call
    raises (the actor killed, to be restarted) instead of blocking the run forever."""
    hung = tmp_path / "hung"  # made as rank 1's env hangs, in its first chunk
    env_fn = functools.partial(_env_hanging_once, hang_at=(0, 0, 1, 0, 0), marker=str(hung))
    runner = None

    def on_flush(_, tr):
        end = time.monotonic() + 30
        while not hung.exists() and time.monotonic() < end:  # (its actor may start late)
            time.sleep(0.01)
        runner.call_env(1, "get_state")

    # (a stall timeout longer than rank 0's run: rank 1 is not killed before the flush)
    runner = ray_runner(make_collector(), env_fn, num_steps=1, transport=transport,
                        batch_wait_s=0.0, stall_timeout_s=6.0, on_flush=on_flush)
    _up(runner)  # both actors built: the ranks start their chunks together
    start = time.monotonic()
    with runner, pytest.raises(RunnerError, match="env_worker_1 did not answer call_env") as info:
        runner.run()
    assert info.value.worker == "on_flush" and time.monotonic() - start < 30


def test_answers_call_env_read_ahead_are_collected_after_a_failure(ray_instance, tmp_path):
    """Direct transport: answers call_env read off a rank's connection are inserted by
    the drain after a failure, and close() leaves none behind."""
    collector, seen, stepped = make_collector(), [], tmp_path / "stepped"
    runner = None

    def on_flush(_, tr):
        end = time.monotonic() + 30
        while not stepped.exists() and time.monotonic() < end:  # rank 1 has a step in
            time.sleep(0.01)  # flight (its actor may start late)
        assert stepped.exists(), "rank 1 did not step within 30 s"
        seen.append(runner.call_env(1, "seen", "x"))
        raise ValueError("a bug in on_flush")

    env_fn = functools.partial(_slow_counting_env, stepped=str(stepped))
    runner = ray_runner(collector, env_fn, num_steps=1, transport="direct",
                        batch_wait_s=0.0, on_flush=on_flush)
    _up(runner)
    with pytest.raises(RunnerError, match="on_flush failed on queue 'default'") as info:
        runner.run()
    assert isinstance(info.value.cause, ValueError) and info.value.undelivered
    answered = seen[0][2]  # rank 1's steps answered before call_env's own answer
    missing = [k for k, half, _ in collector.missing() if k[2] == 1 and half == "env"]
    assert answered >= 1 and E * T - len(missing) == answered  # each inserted
    assert all(not w.early for w in runner._ranks)


def _up(runner):
    """Until every actor of ``runner`` is built and answers."""
    ray.get([actor.pid.remote() for actor in runner.actors()], timeout=120)


def _slow_counting_env(rank, stepped):
    """Rank 1 steps in 0.3 s, and says (``stepped``) that its first step is done."""
    env = CountingEnv(rank)
    if rank == 1:
        step = env.step

        def slow(key, actions):
            time.sleep(0.3)
            out = step(key, actions)
            pathlib.Path(stepped).touch()
            return out

        env.step = slow
    return env


def test_close_or_run_during_a_run_stops_it_named(ray_instance):
    """close() from on_flush stops the run with a named error, then shuts the actors
    down; run() from on_flush is refused."""
    runner = None

    def closing(_, tr):
        runner.close()

    # (two steps: step 0's flushes come with chunks still to run; a close asked in a
    # run's last flush ends it normally, then closes)
    runner = ray_runner(make_collector(), num_steps=2, transport="ray", on_flush=closing)
    with pytest.raises(RunnerError, match=r"close\(\) was called during run\(\)"):
        runner.run()
    assert all(w.actor is None for w in runner._ranks)

    def rerun(_, tr):
        runner.run()

    runner = ray_runner(make_collector(), num_steps=1, transport="ray", on_flush=rerun)
    with runner, pytest.raises(RunnerError, match=r"run\(\) is already running"):
        runner.run()


def test_a_collector_at_another_step_is_refused_before_any_actor_starts(ray_instance):
    runner = ray_runner(make_collector(), step_id=1)
    with pytest.raises(ValueError, match="the collector accepts training step 0"):
        runner.run()
    assert all(w.actor is None for w in runner._ranks)
    with pytest.raises(ValueError, match="num_steps must be an integer"):
        runner.run(num_steps=1.5)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="num_steps must be an integer"):
            ray_runner(make_collector(), num_steps=bad)


class SlowStartEnv(PointEnv):
    """A simulator that takes 3 s to load."""

    def __init__(self, rank):
        time.sleep(3.0)
        super().__init__(rank)


def test_call_env_before_the_first_run_waits_for_a_slow_start_whatever_stall_timeout_s(
    ray_instance
):
    """stall_timeout_s bounds call_env on an env that hangs, not on an actor still
    building its env (as the run's own stall check lets a start take its time)."""
    with ray_runner(make_collector(), SlowStartEnv, num_steps=1, transport="ray",
                    stall_timeout_s=1.0) as runner:
        obs = runner.call_env(0, "reset")
        assert obs["state"].shape == (B, OBS)
        assert len(runner.run()) == RANKS and runner.restarts == 0


def test_a_replayed_rank_keeps_its_record_in_place_and_warns_when_long(
    ray_instance, monkeypatch
):
    """An env without get_state: its rank keeps (key, actions) since its reset for a
    restart's replay, appended in place (not copied each chunk), with a warning once long."""
    from jaxtraj.runners import ray as ray_runners

    monkeypatch.setattr(ray_runners, "REPLAY_WARN", 2 * E * T)
    env_fn = functools.partial(_no_snapshots)
    with ray_runner(make_collector(), env_fn, num_steps=1, transport="ray") as runner:
        runner.run()
        record = runner._ranks[0].replay
        with pytest.warns(RuntimeWarning, match="has no get_state"):
            runner.run()
        assert runner._ranks[0].replay is record and len(record) == 2 * E * T


def _no_snapshots(rank):
    return PointEnv(rank, snapshots=False)


class LoggingEnv(PointEnv):
    """Records each chunk it executed (a file named by its key in ``folder``); rank 1's
    steps take ``slow_s``, so its chunk is in flight when rank 0's next call is made."""

    def __init__(self, rank, folder, slow_s=0.0):
        super().__init__(rank, snapshots=False, critic=False)
        self.folder, self.slow_s = folder, slow_s

    def step(self, key, actions):
        if self.rank == 1:
            pathlib.Path(self.folder, "stepping").touch()
            time.sleep(self.slow_s)
        out = super().step(key, actions)
        pathlib.Path(self.folder, "_".join(map(str, key.as_tuple()))).touch()
        return out


@pytest.mark.parametrize("transport", ["ray", "direct"])
def test_a_failed_run_keeps_the_env_half_of_a_chunk_in_flight(ray_instance, tmp_path, transport):
    """A policy call that fails while another rank's chunk is executing: that chunk's
    result is awaited (bounded) and its env half collected, as the threaded runners do."""
    folder = str(tmp_path)

    def fails_while_rank_1_steps(params, obs, rng):  # rank 0 asks again meanwhile
        if pathlib.Path(folder, "stepping").exists():
            raise RuntimeError("policy crashed")
        return policy_fn(params, obs, rng)

    collector = make_collector()
    env_fn = functools.partial(LoggingEnv, folder=folder, slow_s=1.0)
    with RayRunnerOf(collector, env_fn, fails_while_rank_1_steps, max_batch=1,
                     batch_wait_s=0.0, value_fn=value_fn, transport=transport) as runner:
        with pytest.raises(RunnerError, match="policy crashed"):
            runner.run()
    ran = {tuple(int(x) for x in p.name.split("_")) for p in pathlib.Path(folder).iterdir()
           if p.name != "stepping"}
    assert (0, 0, 1, 0, 0) in ran  # rank 1's first chunk ran (it was in flight)
    missing = {(k, half) for k, half, *_ in collector.missing()}
    assert sorted(k for k in ran if (k, "env") in missing) == []


def RayRunnerOf(collector, env_fn, policy_fn_, **kw):
    from jaxtraj.runners.ray import RayRunner

    return RayRunner(collector, env_fn, policy_fn_, PARAMS, seed=SEED, **kw)


class SeededEnv(PointEnv):
    """Says which seeds it gives its sub-environments, as GymnasiumEnv does."""

    def __init__(self, rank, seed_of):
        super().__init__(rank, snapshots=False)
        self.seed, self.num_envs = seed_of(rank), B


def test_ranks_seeded_alike_are_refused_unless_allowed(ray_instance):
    """As AsyncRunner: a factory that forgets the rank (every rank seed 7) is refused
    before any chunk is stepped; allow_shared_seeds=True lets it run; seeds B apart run."""
    same = functools.partial(SeededEnv, seed_of=lambda rank: 7)
    calls = []

    def counted(params, obs, rng):
        calls.append(1)
        return policy_fn(params, obs, rng)

    runner = RayRunnerOf(make_collector(), same, counted)
    with pytest.raises(ValueError, match=r"env ranks 0 and 1 both seed a sub-environment "
                       r"with 7.*allow_shared_seeds=True"):
        runner.run()
    assert calls == []  # refused before any chunk's inference
    with RayRunnerOf(make_collector(), same, policy_fn, allow_shared_seeds=True) as runner:
        assert len(runner.run()) == RANKS
    apart = functools.partial(SeededEnv, seed_of=lambda rank: 1000 * rank)
    with RayRunnerOf(make_collector(), apart, policy_fn) as runner:
        assert len(runner.run()) == RANKS


def _first_rows(params, obs, rng):
    """A policy written for one rank's B rows: the first B of whatever it is given."""
    return jax.tree.map(lambda x: x[:B], policy_fn(params, obs, rng))


def test_a_policy_returning_too_few_rows_is_named_by_the_learner(ray_instance):
    with RayRunnerOf(make_collector(), PointEnv, _first_rows, transport="ray",
                     num_steps=1) as runner:
        with pytest.raises(RunnerError, match=rf"policy_fn was given {RANKS * B} rows .* "
                           rf"PolicyOutput\.actions of shape \({B}, {K}, {A}\)") as info:
            runner.run()
    assert info.value.worker == "policy_worker"


def _flat_actions(params, obs, rng):
    out = policy_fn(params, obs, rng)
    return out.replace(actions=out.actions.reshape(out.actions.shape[0], -1))


@pytest.mark.parametrize("policy", ["learner", "actor"])
def test_flat_actions_are_named_as_the_policy_returned_them(ray_instance, policy):
    """Actions [N, K * A] are refused as the call's, not as one rank's slice."""
    rows = RANKS * B if policy == "learner" else B
    with RayRunnerOf(make_collector(), PointEnv, _flat_actions, policy=policy,
                     num_steps=1) as runner:
        with pytest.raises(RunnerError, match=rf"PolicyOutput\.actions of shape \({rows}, "
                           rf"{K * A}\) for its {rows} rows: each row's actions must be "
                           rf"of shape \({K}, {A}\) .*: reshape them to \({rows}, {K}, {A}\)"):
            runner.run()


def test_an_env_worker_in_process_without_a_layout_runs_unchecked_shapes():
    """EnvWorker is a plain class, usable in-process; with no layout (its default) it has
    no action shape to check against and runs as before (from a review: the new check
    read the missing layout)."""
    from jaxtraj.runners.ray import EnvWorker
    from jaxtraj.runners.service import key_rng, row_rngs

    plan = TrajectoryPlan(num_chunks=T, batch_size=B)
    worker = EnvWorker(PointEnv, 0, plan, policy_fn=policy_fn, stamp=False)
    worker.reset()
    key = TrajectoryKey(0, 0, 0, 0, 0)
    out, _ = worker.run([key.as_tuple()], [np.asarray(row_rngs(key_rng(0, key), B))], PARAMS, 0)
    (policy, env), = out
    assert np.shape(policy.output.actions) == (B, K, A) and env.source.key == key


def test_close_from_another_thread_stops_a_run_waiting_for_its_actors(ray_instance):
    """A run waiting for actors Ray cannot place (the case a user closes it from another
    thread for) stops on close(), as the run's loop does (the seed check's wait did not
    look: from a review)."""
    runner = RayRunnerOf(make_collector(), PointEnv, policy_fn,
                         actor_options={"resources": {"no_such_resource": 1}})
    outcome = []

    def target():
        try:
            runner.run()
            outcome.append("returned")
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    time.sleep(1.0)
    runner.close()  # during the run: asks it to stop
    t.join(15.0)
    assert not t.is_alive(), "run() still waiting 15 s after close()"
    assert isinstance(outcome[0], RunnerError) and "close() was called" in str(outcome[0])
    assert all(w.actor is None for w in runner._ranks)


def _fail_first_call(params, obs, rng, marker):
    """The first policy call of all the actors' fails (an atomic marker file)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return policy_fn(params, obs, rng)
    os.close(fd)
    time.sleep(0.5)  # the same actor's next run is queued behind this one
    raise RuntimeError("policy crashed")


def test_an_actors_runs_behind_its_failed_one_are_not_collected(ray_instance, tmp_path):
    """policy="actor": after a rank's run fails, its runs queued behind it executed from
    the state before the failed chunk; the drain, waiting for chunks in flight, must not
    take them under their later keys (from a review)."""
    policy = functools.partial(_fail_first_call, marker=str(tmp_path / "failed"))
    collector = make_collector()
    with RayRunnerOf(collector, PointEnv, policy, policy="actor", chunks_per_call=1,
                     max_in_flight=2, num_steps=1) as runner:
        with pytest.raises(RunnerError, match="policy crashed") as info:
            runner.run()
    rank = info.value.key[2]
    missing = {(k, half) for k, half, *_ in collector.missing()}
    assert [t for t in range(T) if ((0, 0, rank, 0, t), "policy") not in missing] == []


def test_allow_shared_seeds_set_after_a_refusal_lets_the_runner_run(ray_instance):
    same = functools.partial(SeededEnv, seed_of=lambda rank: 7)
    runner = RayRunnerOf(make_collector(), same, policy_fn, num_steps=1)
    try:
        with pytest.raises(ValueError, match="both seed a sub-environment"):
            runner.run()
        runner.allow_shared_seeds = True  # as the message says (the next run asks afresh)
        assert len(runner.run()) == RANKS
    finally:
        runner.close()
