"""Host-thread runners: AsyncRunner and DecoupledRunner against a synchronous reference."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import pathlib
import random
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtraj
from jaxtraj import EnvTransition, PolicyOutput, TrajectoryKey, TrajectoryPlan
from jaxtraj.runners.threads import (
    AsyncRunner,
    DecoupledRunner,
    EnvStep,
    RunnerError,
    key_rng,
    row_rngs,
)

_spec = importlib.util.spec_from_file_location(
    "collect_rollout", pathlib.Path(__file__).parents[1] / "examples" / "collect_rollout.py"
)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

B, T, E, RANKS, SEED = 4, 3, 2, 2, 0
PARAMS = {
    "w": 0.1 * jax.random.normal(jax.random.PRNGKey(1), (ex.OBS, ex.K * ex.A)),
    "v": 0.5 * jax.random.normal(jax.random.PRNGKey(2), (ex.OBS,)),
}


class PointEnv:
    """The example's point-mass task as a runner env; randomness from the chunk key."""

    def __init__(self, rank, delay_s=0.0, fail_at=None, bad_obs_at=None, log=None, critic=True):
        self.rank, self.delay_s, self.fail_at, self.bad_obs_at = rank, delay_s, fail_at, bad_obs_at
        self.rand = random.Random(rank)
        self.log, self.critic, self.resets = log, critic, 0
        self.final_log = {}  # key -> the observation each env ended the chunk on

    def reset(self):
        self.resets += 1
        self.state = ex.env_reset(jax.random.PRNGKey(100 + self.rank), B)
        return {"state": np.asarray(ex.observe(self.state))}

    def step(self, key, actions):
        if self.delay_s:
            time.sleep(self.rand.uniform(0, self.delay_s))
        if self.fail_at is not None and key.as_tuple() == self.fail_at:
            raise RuntimeError("simulator crashed")
        self.state, r, term, trunc, final_obs, _ = ex.env_step_chunk(
            self.state, jnp.asarray(actions), key_rng(SEED + 1, key)
        )
        obs = {"state": np.asarray(ex.observe(self.state))}
        self.final_log[key.as_tuple()] = np.asarray(final_obs)
        if self.bad_obs_at is not None and key.as_tuple() == self.bad_obs_at:
            obs = {"state": np.zeros((B, ex.OBS + 1), np.float32)}
        if self.log is not None:
            self.log[key.as_tuple()] = obs["state"]
        return EnvStep(
            transition=EnvTransition(
                rewards=np.asarray(r), terminations=np.asarray(term), truncations=np.asarray(trunc)
            ),
            obs=obs,
            # critic=False: no critic in the env worker, the policy side's value_fn runs
            # terminal inference on final_obs.
            final_values=np.asarray(final_obs @ PARAMS["v"]) if self.critic else None,
            final_obs=None if self.critic else {"state": np.asarray(final_obs)},
        )


def value_fn(params, obs):
    """The critic of the policy side: what PointEnv(critic=True) computes itself."""
    return np.asarray(jnp.asarray(obs["state"]) @ params["v"])


_RAND = random.Random(0)  # only the policy worker thread draws from it


def policy_fn(params, obs, rng, delay_s=0.0):
    if delay_s:
        time.sleep(_RAND.uniform(0, delay_s))
    actions, logp, value = ex.policy(params, jnp.asarray(obs["state"]), rng)
    return PolicyOutput(
        actions=np.asarray(actions),
        prev_logprobs=np.asarray(logp),
        prev_values=np.asarray(value),
        versions=np.zeros((obs["state"].shape[0],), np.int32),
        forward_inputs={"obs": np.asarray(obs["state"])},
    )


def make_collector(auto_flush=True, **plan_kw):
    plan = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B, num_env_ranks=RANKS, **plan_kw)
    key = TrajectoryKey(0, 0, 0, 0, 0)
    env = PointEnv(0)
    obs = env.reset()
    out = policy_fn(PARAMS, obs, row_rngs(key_rng(SEED, key), B))
    p = jaxtraj.PolicyPart(jaxtraj.TrajectorySource(key, B, 0), obs, out)
    st = env.step(key, out.actions)
    e = jaxtraj.EnvPart(
        jaxtraj.TrajectorySource(key, B, 0),
        st.transition,
        next_obs=st.obs if plan.collect_transitions else None,
        initial_transition=st.transition.boundary(),
        final_values=st.final_values,
    )
    return jaxtraj.TrajectoryCollector(plan, p, e, auto_flush=auto_flush)


def sync_reference(num_steps, ranks_per_call=RANKS):
    """The same envs, policy and keys in one thread, in order: per chunk index, one
    policy call on every rank's rows joined (``ranks_per_call`` ranks a call, each
    chunk's rows with its own row keys), then each rank's env steps."""
    collector = make_collector()
    out = []
    envs = [PointEnv(rank) for rank in range(RANKS)]
    obs = [env.reset() for env in envs]
    prev = [None] * RANKS
    for s in range(num_steps):
        for e in range(E):
            for t in range(T):
                keys = [TrajectoryKey(s, e, rank, 0, t) for rank in range(RANKS)]
                outs = []
                for lo in range(0, RANKS, ranks_per_call):
                    group = range(lo, min(lo + ranks_per_call, RANKS))
                    joined = {"state": np.concatenate([obs[r]["state"] for r in group])}
                    rng = np.concatenate([row_rngs(key_rng(SEED, keys[r]), B) for r in group])
                    o = policy_fn(PARAMS, joined, rng)
                    outs += [jax.tree.map(lambda x, j=j: x[j * B : (j + 1) * B], o)
                             for j in range(len(group))]
                for rank, (env, key, o) in enumerate(zip(envs, keys, outs)):
                    src = jaxtraj.TrajectorySource(key, B, 0)
                    out += collector.add(jaxtraj.PolicyPart(src, obs[rank], o))
                    st = env.step(key, o.actions)
                    init = None
                    if t == 0:
                        before = prev[rank] or jax.tree.map(np.zeros_like, st.transition)
                        init = before.boundary()
                    part = jaxtraj.EnvPart(
                        src, st.transition, initial_transition=init, final_values=st.final_values
                    )
                    out += collector.add(part)
                    obs[rank], prev[rank] = st.obs, st.transition
    return {(int(tr.step_id), int(tr.env_rank)): tr for _, tr in out}


def runner_threads():
    return [t for t in threading.enumerate() if t.name.startswith("jaxtraj-")]


def assert_same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_async_matches_sync_reference_with_shuffled_delayed_arrivals():
    ref = sync_reference(2)
    runner = AsyncRunner(
        make_collector(),
        [PointEnv(r, delay_s=0.003) for r in range(RANKS)],
        lambda p, o, k: policy_fn(p, o, k, delay_s=0.002),
        PARAMS,
        num_steps=2,
        seed=SEED,
        jitter_s=0.004,
        queue_size=4,
    )
    items = runner.run()
    got = {(int(tr.step_id), int(tr.env_rank)): tr for _, tr in items}
    assert sorted(got) == sorted(ref) == [(s, r) for s in range(2) for r in range(RANKS)]
    for k in ref:
        assert_same(got[k], ref[k])
    assert runner_threads() == []
    assert max(runner.max_qsize.values()) <= 4


def test_jitter_is_a_transport_delay_parts_overtake_and_producers_do_not_wait():
    """``jitter_s`` holds each part back at the consumer until it is due: parts of one
    producer arrive out of their publication order, the result is the reference's, and
    publishing a part does not wait for its delay."""
    ref = sync_reference(1)
    published, arrived, waited = [], [], []
    runner = AsyncRunner(
        make_collector(),
        [PointEnv(r) for r in range(RANKS)],
        policy_fn,
        PARAMS,
        num_steps=1,
        seed=SEED,
        jitter_s=0.2,
    )
    publish, consume = runner._publish, runner._consumer.__class__.consume

    def logged_publish(worker, part, rand, env=None):
        published.append((worker, part.source.key.as_tuple(), type(part).__name__))
        t0 = time.perf_counter()
        publish(worker, part, rand, env)
        waited.append(time.perf_counter() - t0)

    def logged_consume(consumer, worker, part):
        arrived.append((worker, part.source.key.as_tuple(), type(part).__name__))
        consume(consumer, worker, part)

    runner._publish = logged_publish
    cls = runner._consumer.__class__  # run() makes its own consumer: patched on the class
    cls.consume = logged_consume  # (one step: no part is held back and consumed twice)
    try:
        items = runner.run()
    finally:
        cls.consume = consume
    assert sorted(arrived) == sorted(published) and len(arrived) == 2 * RANKS * E * T
    got = {(int(tr.step_id), int(tr.env_rank)): tr for _, tr in items}
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_same(got[k], ref[k])
    by_worker = lambda log, w: [k for x, k, _ in log if x == w]
    overtaken = [w for w, _, _ in published if by_worker(arrived, w) != by_worker(published, w)]
    assert overtaken, "no part overtook an earlier one of its producer"
    # Sleeping producers would spend ~100 ms a part publishing, ~2.4 s over the 24 parts.
    assert sum(waited) < 0.6, sum(waited)


def test_policy_update_mid_collection_shows_in_versions():
    seen = []

    class SlowEnv(PointEnv):
        def step(self, key, actions):
            if key.as_tuple() == (0, 1, 0, 0, 0):  # rank 0 reaches epoch 1: update
                seen.append(runner.update_policy(PARAMS))
            return super().step(key, actions)

    envs = [SlowEnv(0), PointEnv(1)]
    runner = AsyncRunner(make_collector(), envs, policy_fn, PARAMS, num_steps=1)
    items = runner.run()
    assert seen == [1] and runner.version == 1
    traj = {int(tr.env_rank): tr for _, tr in items}[0]
    v = np.asarray(traj.versions)  # [E, T, B]
    assert (v[0] == 0).all()  # epoch 0 was inferred before the update
    assert (v[1, 1:] == 1).all()  # after it, chunks carry the new version
    assert set(np.unique(v)) == {0, 1}


def test_env_failure_stops_cleanly_names_worker_and_key():
    delivered = []
    collector = make_collector()
    fail = (1, 0, 1, 0, 1)  # step 1, epoch 0, rank 1, chunk 1
    runner = AsyncRunner(
        collector,
        [PointEnv(0), PointEnv(1, fail_at=fail)],
        policy_fn,
        PARAMS,
        num_steps=3,
        on_flush=lambda q, tr: delivered.append(tr),
    )
    with pytest.raises(RunnerError) as info:
        runner.run()
    err = info.value
    assert err.worker == "env_worker_1" and err.key == fail
    assert "env_worker_1" in str(err) and str(fail) in str(err) and "simulator crashed" in str(err)
    assert runner_threads() == []
    # Step 0 of rank 1 was delivered intact; what step 1 collected is still in the collector.
    ref = sync_reference(1)
    got = {(int(tr.step_id), int(tr.env_rank)): tr for tr in delivered}
    assert (0, 1) in got and err.delivered == len(delivered)
    assert_same(got[(0, 1)], ref[(0, 1)])
    assert collector.current_step(1) == 1
    missing_rank1 = [k for k, _, _ in collector.missing() if k[2] == 1]
    assert (1, 0, 1, 0, 0) not in missing_rank1  # chunk 0 of step 1 stayed collected
    assert fail in missing_rank1
    # Its environments are mid-step, out of step with the collector: it refuses to go on
    # (a second run would re-send step 1's first halves), naming the failure; nothing changes.
    before = collector.missing()
    with pytest.raises(RuntimeError, match="last run failed.*env_worker_1") as again:
        runner.run()
    assert "new runner" in str(again.value) and collector.missing() == before


def test_wrong_env_observation_shape_names_env_worker():
    bad = (0, 0, 1, 0, 1)
    runner = AsyncRunner(
        make_collector(), [PointEnv(0), PointEnv(1, bad_obs_at=bad)], policy_fn, PARAMS
    )
    with pytest.raises(RunnerError) as info:
        runner.run()
    assert info.value.worker == "env_worker_1" and info.value.key == bad
    assert isinstance(info.value.cause, jaxtraj.CollectorError)
    assert "observation" in str(info.value) and "shape" in str(info.value)
    assert runner_threads() == []


def test_wrong_policy_chunk_size_names_policy_worker():
    def short_chunks(params, obs, rng):
        out = policy_fn(params, obs, rng)
        return out.replace(actions=out.actions[:, :-1], prev_logprobs=out.prev_logprobs[:, :-1])

    collector = make_collector()
    runner = AsyncRunner(collector, [PointEnv(0), PointEnv(1)], short_chunks, PARAMS)
    with pytest.raises(RunnerError) as info:
        runner.run()
    assert info.value.worker == "policy_worker"
    assert info.value.key is not None and info.value.key[4] == 0
    # Refused as the call returned it, before its rows are split among the ranks.
    assert isinstance(info.value.cause, ValueError)
    assert re.search(r"PolicyOutput\.actions of shape \(\d+, 3, 2\) for its \d+ rows: each "
                     r"row's actions must be of shape \(4, 2\)", str(info.value))
    assert runner_threads() == []
    assert len(collector.missing()) == 2 * RANKS * E * T  # nothing bad got in


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_bad_policy_output_beside_good_actions_names_the_field(workers):
    """The actions go out before the rest of the output is checked (where they are what
    the layout holds: rows, shape, dtype): a bad log-probability is still refused, naming
    the field, and no policy half of it gets in; actions of another dtype are refused
    before any env gets them."""
    for bad, field, sent in ((_short_logprobs, "prev_logprobs", True),
                             (_float64_actions, "actions", False)):
        collector = make_collector()
        envs = [PointEnv(0), PointEnv(1)]
        if workers == "process":
            envs = [functools.partial(PointEnv, r) for r in range(RANKS)]
        runner = AsyncRunner(collector, envs, bad, PARAMS, env_workers=workers)
        replied, reply = [], runner._reply
        runner._reply = lambda i, key, actions: (replied.append(key.as_tuple()),
                                                  reply(i, key, actions))
        with runner, pytest.raises(RunnerError) as info:
            runner.run()
        assert info.value.worker == "policy_worker" and info.value.key[4] == 0
        assert field in str(info.value)
        assert "STRUCTURE_MISMATCH" in repr(info.value.cause.code)
        assert runner_threads() == []
        assert {k for k, half, _ in collector.missing() if half == "policy"} == {
            (0, e, r, 0, t) for e in range(E) for r in range(RANKS) for t in range(T)}
        # The refused call's actions went out before the refusal, or (another dtype) never.
        if sent:
            assert info.value.key in replied
            assert set(replied) <= {(0, 0, r, 0, 0) for r in range(RANKS)}
        else:
            assert replied == []


def _short_logprobs(params, obs, rng):
    out = policy_fn(params, obs, rng)
    return out.replace(prev_logprobs=out.prev_logprobs[:, :-1])


def _float64_actions(params, obs, rng):
    out = policy_fn(params, obs, rng)
    return out.replace(actions=np.asarray(out.actions, np.float64))


def test_decoupled_runner_boundary_observations():
    log = {}
    collector = make_collector(collect_transitions=True)
    runner = DecoupledRunner(
        collector,
        [PointEnv(r, delay_s=0.002, log=log) for r in range(RANKS)],
        policy_fn,
        PARAMS,
        num_steps=1,
        max_batch=RANKS,
        jitter_s=0.002,
    )
    items = runner.run()
    assert runner_threads() == []
    assert len(items) == RANKS
    for _, tr in items:
        r = int(tr.env_rank)
        nxt, obs = np.asarray(tr.next_obs["state"]), np.asarray(tr.obs["state"])
        for e in range(E):
            for t in range(T):
                # next_obs: the true post-action observation (explicit boundary) ...
                np.testing.assert_array_equal(nxt[e, t], log[(0, e, r, 0, t)])
                # ... while the policy of chunk t+1 saw the pre-chunk-t observation.
                flat = e * T + t
                if flat >= 1 and t + 1 < T:
                    prev_key = (0, e, r, 0, t - 1) if t >= 1 else (0, e - 1, r, 0, T - 1)
                    np.testing.assert_array_equal(obs[e, t + 1], log[prev_key])
        # Policy outputs are consistent with the observation they were computed from.
        np.testing.assert_allclose(
            np.asarray(tr.prev_values)[:, :T], obs @ np.asarray(PARAMS["v"]), rtol=1e-5, atol=1e-6
        )


def test_keyboard_interrupt_in_consumer_stops_workers():
    def interrupt(queue_key, traj):
        raise KeyboardInterrupt

    collector = make_collector()
    runner = AsyncRunner(
        collector, [PointEnv(0), PointEnv(1)], policy_fn, PARAMS, num_steps=3, on_flush=interrupt
    )
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    assert runner_threads() == []
    assert collector.current_step(0) + collector.current_step(1) >= 1  # the flush happened


def run_steps(cls, steps, per_call=False, **kw):
    """``steps`` training steps of ``cls`` over delayed envs with a value_fn: in one
    ``run`` or one ``run(num_steps=1)`` per step; the trajectories by (step, rank), the
    policy calls and the rows of each call."""
    rows = []

    def counting(params, obs, rng):
        assert obs["state"].shape[0] == rng.shape[0]
        rows.append(rng.shape[0])
        return policy_fn(params, obs, rng)

    delay_s = kw.pop("env_delay_s", 0.0)
    if kw.get("env_workers") == "process":  # factories, built in the envs' processes
        envs = [functools.partial(PointEnv, r, critic=False, delay_s=delay_s)
                for r in range(RANKS)]
    else:
        envs = [PointEnv(r, critic=False, delay_s=delay_s) for r in range(RANKS)]
    runner = cls(make_collector(), envs, counting, PARAMS, value_fn=value_fn, seed=SEED,
                 num_steps=steps, **kw)
    items, calls = [], 0
    with runner:
        for _ in range(steps if per_call else 1):
            items += runner.run(num_steps=1 if per_call else steps)
            calls += runner.calls
    assert runner_threads() == []
    return {(int(tr.step_id), int(tr.env_rank)): tr for _, tr in items}, calls, rows


@pytest.mark.parametrize("cls", [AsyncRunner, DecoupledRunner])
def test_trajectories_are_bit_identical_whatever_the_batching(cls):
    """One policy_fn call serves every ready rank (rows padded to max_batch * B, a key
    per row from the chunk's key): batched always (a long wait), rarely (no wait,
    random env delays, jitter), across run(num_steps=1) calls, the same trajectories;
    AsyncRunner's equal the synchronous loop's."""
    steps, chunks = 2, 2 * E * T
    noisy = dict(batch_wait_s=0.0, env_delay_s=0.004, jitter_s=0.003)
    for per_call in (False, True):
        batched, calls, rows = run_steps(cls, steps, per_call, batch_wait_s=5.0)
        assert calls == chunks and set(rows) == {RANKS * B}  # one call per chunk index
        unbatched, calls, rows = run_steps(cls, steps, per_call, **noisy)
        assert calls > chunks and set(rows) == {RANKS * B}  # some calls served one rank
        assert sorted(batched) == sorted(unbatched)
        for k in batched:
            assert_same(unbatched[k], batched[k])
        if cls is AsyncRunner:  # the synchronous loop's, in one run or one call a step
            ref = sync_reference(steps)
            for k in ref:
                assert_same(batched[k], ref[k])
        # (DecoupledRunner's first chunk of a call is inferred from the observation the
        # last call left, a fresh one, where one run's is one chunk stale: by design.)


def test_a_batched_call_waits_only_for_ranks_expected_within_the_wait():
    """The runners' estimate of when each rank asks next (its step in flight's start
    plus an exponential average of what its steps took), written out by hand: a rank never seen
    may come at any time; one whose steps take longer than the wait is not waited for."""
    from jaxtraj.runners.service import _Due

    due = _Due(2)
    assert due.by(0, 0.0) and due.by(1, 0.0)  # nothing known yet: either may come
    due.started(0, 10.0)
    assert due.by(0, 10.001)  # in flight, duration unknown
    due.back(0, 10.2)  # took 0.2 s
    assert due.by(0, 10.3)  # not in flight: it asks now
    due.started(0, 11.0)
    assert not due.by(0, 11.1) and due.by(0, 11.201)  # back at 11.2
    due.back(0, 11.4)  # took 0.4 s: each new step half the weight, 0.5 * (0.2 + 0.4)
    due.started(0, 12.0)
    assert not due.by(0, 12.29) and due.by(0, 12.301)  # back at 12.3
    due.back(1, 5.0)  # a result without a start (a reset): no duration
    assert due.took[1] is None


def test_auto_wait_is_the_longest_step_where_envs_compute_and_none_where_they_wait():
    """batch_wait_s="auto", by hand: each rank's share of a step on CPU is an exponential
    average (each new step half the weight); where the ranks' mean is at least 0.5 the
    wait is the longest of their step times (at most 50 ms), else 0; 0 until measured."""
    from jaxtraj.runners.service import AUTO_WAIT_MAX_S, _Due

    due = _Due(2)
    assert due.auto_wait() == 0.0  # nothing measured
    due.started(0, 0.0)
    due.back(0, 0.004)  # rank 0's step took 4 ms
    assert due.auto_wait() == 0.0  # no CPU share yet
    due.cpu(0, 0.9)
    assert due.auto_wait() == pytest.approx(0.004)
    due.started(1, 0.0)
    due.back(1, 0.006)
    due.cpu(1, None)  # not measured: ignored
    due.cpu(1, 0.7)
    assert due.auto_wait() == pytest.approx(0.006)  # the longest step
    due.cpu(0, 0.1)  # rank 0: 0.5 * (0.9 + 0.1) = 0.5; the mean 0.6 still computes
    assert due.share[0] == pytest.approx(0.5) and due.auto_wait() == pytest.approx(0.006)
    due.cpu(1, 0.1)  # rank 1: 0.4; the mean 0.45 mostly waits
    assert due.auto_wait() == 0.0
    due.cpu(0, 1.0), due.cpu(1, 1.0)
    due.started(1, 1.0)
    due.back(1, 1.5)  # 0.5 * (0.006 + 0.5)
    assert due.auto_wait() == AUTO_WAIT_MAX_S
    due.started(0, 2.0)
    due.new_run()  # a new run: nothing in flight, what was learnt kept
    assert due.start == [None, None] and due.auto_wait() == AUTO_WAIT_MAX_S


_HASHED = bytes(1 << 16)


class PacedEnv(PointEnv):
    """A PointEnv whose every step first computes (``"spin"``: hashing, in C with the GIL
    released, as a simulator's physics) or waits (``"sleep"``: a remote simulator, a
    robot's control period)."""

    def __init__(self, rank, how, pace_s=0.01):
        super().__init__(rank, critic=False)
        self.how, self.pace_s = how, pace_s

    def step(self, key, actions):
        if self.how == "sleep":
            time.sleep(self.pace_s)
        else:
            end = time.perf_counter() + self.pace_s
            while time.perf_counter() < end:
                hashlib.sha256(_HASHED)
        return super().step(key, actions)


def test_auto_wait_batches_computing_envs_and_not_waiting_ones_wherever_they_step():
    """The default batch_wait_s="auto" measures each rank's share of a step on CPU where
    it steps (the env worker thread, a factory's thread, an env process): envs that
    compute are waited for, envs that wait are not; the trajectories are the reference's."""
    ref = sync_reference(2)
    cases = [("thread", False), ("thread", True), ("process", True)]
    for workers, factory in cases:
        for how in ("spin", "sleep"):
            envs = [functools.partial(PacedEnv, r, how) for r in range(RANKS)]
            if not factory:
                envs = [f() for f in envs]
            with AsyncRunner(make_collector(), envs, policy_fn, PARAMS, value_fn=value_fn,
                             seed=SEED, env_workers=workers) as runner:
                assert runner.batch_wait_s == "auto"
                got = {(int(tr.step_id), int(tr.env_rank)): tr for _, tr in runner.run()}
                got.update({(int(tr.step_id), int(tr.env_rank)): tr for _, tr in runner.run()})
                shares, wait, calls = list(runner._due.share), runner._wait(), runner.calls
            case, mean = (workers, factory, how, shares, wait, calls), sum(shares) / len(shares)
            if how == "spin":  # the second run, measured: the ranks mostly share a call
                assert mean >= 0.5 and wait > 0 and calls < RANKS * E * T, case
            else:
                assert mean < 0.5 and wait == 0.0, case
            for k in ref:
                assert_same(got[k], ref[k])


@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize("cls", [AsyncRunner, DecoupledRunner])
def test_max_batch_one_is_one_call_per_rank_and_chunk(cls, workers):
    steps = 1
    got, calls, rows = run_steps(cls, steps, max_batch=1, env_delay_s=0.002,
                                 env_workers=workers)
    assert calls == RANKS * E * T and set(rows) == {B}
    if cls is AsyncRunner:  # the per-rank loop's numerics (B rows a call)
        ref = sync_reference(steps, ranks_per_call=1)
        for k in ref:
            assert_same(got[k], ref[k])


def test_batching_arguments_are_checked():
    envs = [PointEnv(r) for r in range(RANKS)]
    with pytest.raises(ValueError, match="max_batch"):
        AsyncRunner(make_collector(), envs, policy_fn, PARAMS, max_batch=0)
    for bad in (-1, float("nan"), float("inf"), True, "0.005", None):
        with pytest.raises(ValueError, match="batch_wait_s must be 'auto' or a finite"):
            DecoupledRunner(make_collector(), envs, policy_fn, PARAMS, batch_wait_s=bad)
    assert AsyncRunner(make_collector(), envs, policy_fn, PARAMS, max_batch=8).max_batch == RANKS
    runner = AsyncRunner(make_collector(), envs, policy_fn, PARAMS, batch_wait_s=np.float32(0.5))
    assert runner.batch_wait_s == 0.5 and type(runner.batch_wait_s) is float


def test_terminal_inference_runs_on_the_policy_side_env_workers_need_no_critic():
    ref = sync_reference(2)  # final values from the env's own critic
    # The reference truncates mid-epoch (the bootstrap enters rewards there) and reads
    # V(s_T) on the last chunk: both are what value_fn must supply.
    assert any(np.asarray(tr.truncations)[:, 1:-1].any() for tr in ref.values())
    runner = AsyncRunner(
        make_collector(),
        [PointEnv(r, critic=False) for r in range(RANKS)],
        policy_fn,
        PARAMS,
        value_fn=value_fn,
        num_steps=2,
        seed=SEED,
        jitter_s=0.001,
    )
    got = {(int(tr.step_id), int(tr.env_rank)): tr for _, tr in runner.run()}
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_same(got[k], ref[k])


def test_without_a_value_fn_a_critic_free_env_is_rejected_naming_the_env_worker():
    collector = make_collector()
    runner = AsyncRunner(
        collector, [PointEnv(r, critic=False) for r in range(RANKS)], policy_fn, PARAMS
    )
    with pytest.raises(RunnerError, match="value_fn") as info:
        runner.run()
    assert info.value.worker.startswith("env_worker_")
    assert info.value.cause.code == jaxtraj.ErrorCode.MISSING_FINAL_VALUES
    assert collector.missing()  # what was collected stays; the step waits for the rest


@pytest.mark.parametrize("cls", [AsyncRunner, DecoupledRunner])
def test_run_once_per_training_step_carries_envs_keys_and_versions(cls):
    steps = 10
    envs = [PointEnv(r, critic=False, log={}) for r in range(RANKS)]
    runner = cls(make_collector(), envs, policy_fn, PARAMS, value_fn=value_fn, seed=SEED)
    got = {}
    for it in range(steps):
        items = runner.run(num_steps=1)  # one training step
        assert {int(tr.step_id) for _, tr in items} == {it}
        got.update({(int(tr.step_id), int(tr.env_rank)): tr for _, tr in items})
        assert runner.update_policy(PARAMS) == it + 1
    assert sorted(got) == [(s, r) for s in range(steps) for r in range(RANKS)]
    assert [env.resets for env in envs] == [1] * RANKS  # no reset between calls
    for (s, _r), tr in got.items():
        np.testing.assert_array_equal(np.asarray(tr.versions), s)  # version s in step s
    if cls is AsyncRunner:  # the same trajectories as one uninterrupted loop
        ref = sync_reference(steps)
        for k in ref:
            assert_same(got[k].replace(versions=None), ref[k].replace(versions=None))
    else:  # step s + 1 starts from the observation step s's last chunk left
        for (s, r), tr in got.items():
            if s:
                last = envs[r].log[(s - 1, E - 1, r, 0, T - 1)]
                np.testing.assert_array_equal(np.asarray(tr.obs["state"])[0, 0], last)
    assert runner.step_id == steps


def test_nan_reward_from_an_env_is_non_finite_naming_the_env_worker_and_key():
    bad = (0, 1, 1, 0, 2)  # epoch 1, rank 1, chunk 2

    class NanEnv(PointEnv):
        def step(self, key, actions):
            out = super().step(key, actions)
            if key.as_tuple() == bad:
                rewards = np.array(out.transition.rewards)
                rewards[1] = np.nan
                out = EnvStep(out.transition.replace(rewards=rewards), out.obs, out.final_values)
            return out

    collector = make_collector()
    runner = AsyncRunner(collector, [PointEnv(0), NanEnv(1)], policy_fn, PARAMS)
    with pytest.raises(RunnerError) as info:
        runner.run()
    err = info.value
    assert err.worker == "env_worker_1" and err.key == bad
    assert err.cause.code == jaxtraj.ErrorCode.NON_FINITE and "NON_FINITE" in str(err)
    # What was collected stays: rank 1's earlier chunks are in (the parts queue is FIFO
    # without jitter), the rejected half is still missing.
    missing = {(k, h) for k, h, _ in collector.missing()}
    assert not {k for k, _ in missing if k[2] == 1 and k[1:] < bad[1:]}
    assert (bad, "env") in missing


def test_collect_transitions_take_the_observation_each_episode_ended_on():
    """With collect_transitions, every chunk's next state comes from EnvStep.final_obs: the
    observation an episode ended on where one ended, the next observation elsewhere (an
    epoch's last chunk included, whether or not an episode ended in it)."""
    envs = [PointEnv(r, critic=False) for r in range(RANKS)]
    runner = AsyncRunner(
        make_collector(collect_transitions=True), envs, policy_fn, PARAMS,
        value_fn=value_fn, num_steps=2, seed=SEED,
    )
    trajs = [tr for _, tr in runner.run()]
    assert len(trajs) == 2 * RANKS
    ended_somewhere = False
    for tr in trajs:
        s, r = int(tr.step_id), int(tr.env_rank)
        done = np.asarray(tr.dones)[:, 1:].reshape(E, T, B, -1).any(-1)
        for e in range(E):
            for t in range(T):
                want = envs[r].final_log[(s, e, r, 0, t)]
                np.testing.assert_array_equal(np.asarray(tr.next_obs["state"])[e, t], want)
                ended_somewhere |= bool(done[e, t].any())
    assert ended_somewhere  # the pre-reset observation was needed somewhere


class SeededEnv(PointEnv):
    """A PointEnv that says how it seeds its sub-environments, as GymnasiumEnv does."""

    def __init__(self, rank, seed):
        super().__init__(rank)
        self.seed, self.num_envs = seed, B


def test_ranks_whose_sub_environments_share_a_seed_are_refused_unless_asked():
    with pytest.raises(ValueError, match=r"env ranks 0 and 1 both seed a sub-environment with 1"):
        AsyncRunner(make_collector(), [SeededEnv(r, seed=r) for r in range(RANKS)], policy_fn,
                    PARAMS)
    AsyncRunner(make_collector(), [SeededEnv(r, seed=1000 * r) for r in range(RANKS)], policy_fn,
                PARAMS)  # seeded apart
    AsyncRunner(make_collector(), [SeededEnv(r, seed=r) for r in range(RANKS)], policy_fn,
                PARAMS, allow_shared_seeds=True)  # asked for


def test_run_returns_items_by_env_rank_and_stack_ranks_stacks_one_step():
    from jaxtraj.runners.service import stack_ranks

    ref = sync_reference(1)
    runner = AsyncRunner(make_collector(), [PointEnv(r, delay_s=0.002 * (RANKS - r))
                                            for r in range(RANKS)], policy_fn, PARAMS, seed=SEED)
    items = runner.run()
    assert [int(tr.env_rank) for _, tr in items] == list(range(RANKS))  # rank 1 finished first
    batch = stack_ranks(items)
    assert np.asarray(batch.rewards).shape[0] == RANKS
    for r in range(RANKS):
        np.testing.assert_array_equal(np.asarray(batch.rewards)[r], np.asarray(ref[(0, r)].rewards))
    with pytest.raises(ValueError, match="several training steps"):
        stack_ranks(items + [("default", ref[(0, 0)].replace(step_id=np.int32(1)))])
    # The stack's episodes list each rank's, with its index (to_list failed on them).
    stacked = batch.episodes.to_list()
    assert len(stacked) == sum(int(tr.episodes.count()) for _, tr in items) > 0
    for r, (_, tr) in enumerate(items):
        assert [{k: v for k, v in e.items() if k != "item"} for e in stacked
                if e["item"] == r] == tr.episodes.to_list()
    with pytest.raises(ValueError, match=r"are no flush's"):
        batch.episodes.replace(env_rank=np.zeros((RANKS, 1, 1), np.int32)).to_list()


def test_env_ranks_the_collector_does_not_own_are_refused_before_any_env_is_built():
    built = []

    def factory(r):
        built.append(r)
        return PointEnv(r)

    envs = [functools.partial(factory, r) for r in range(RANKS + 1)]
    with pytest.raises(ValueError, match=rf"env rank {RANKS} \(stage 0\) is not a source this "
                       rf"collector owns .*plan.num_env_ranks={RANKS}\): a runner's env ranks "
                       rf"must be among them \(env ranks \[0, 1, {RANKS}\]"):
        AsyncRunner(make_collector(), envs, policy_fn, PARAMS)
    with pytest.raises(ValueError, match=r"env rank 0 is given twice \(env_ranks \[0, 0\]\)"):
        AsyncRunner(make_collector(), envs[:2], policy_fn, PARAMS, env_ranks=[0, 0])
    with pytest.raises(ValueError, match="env rank 0 \\(stage 1\\) is not a source"):
        AsyncRunner(make_collector(), envs[:1], policy_fn, PARAMS, stage_id=1)
    assert built == []


@pytest.mark.parametrize("how", ["thread", "process", "built"])
def test_an_unwrapped_gymnasium_or_envpool_env_is_refused_naming_its_adapter(how):
    """A factory (or env) giving a gymnasium vector env instead of GymnasiumEnv: refused
    as the runner is built, naming the rank and the adapter (from a newcomer's trial: it
    ran, and the first observation was refused, naming neither)."""
    gym = pytest.importorskip("gymnasium")
    cases = [(functools.partial(gym.make_vec, "CartPole-v1", num_envs=B,
                                vectorization_mode="sync"), "a gymnasium", "GymnasiumEnv")]
    if importlib.util.find_spec("envpool") is not None:
        import envpool

        cases.append((functools.partial(envpool.make, "CartPole-v1", env_type="gymnasium",
                                        num_envs=B), "an EnvPool", "EnvPoolEnv"))
    for factory, what, adapter in cases:
        env = factory() if how == "built" else factory
        workers = "process" if how == "process" else "thread"
        with pytest.raises(RunnerError, match=rf"env_worker_1.*got {what} env .*wrap it in "
                           rf"jaxtraj\.envs\.{adapter}\(\.\.\., actions_per_chunk=K\)"):
            AsyncRunner(make_collector(), [PointEnv(0) if how == "built" else
                                           functools.partial(PointEnv, 0), env],
                        policy_fn, PARAMS, env_workers=workers)
        assert runner_threads() == [] and jaxtraj_children() == []


def test_env_factories_run_in_a_thread_of_their_own_and_bad_ones_name_the_rank():
    from jaxtraj.runners.bound import ThreadBoundEnv

    built_in, stepped_in, workers = {}, {}, {}

    class Recording(PointEnv):
        def __init__(self, rank):
            super().__init__(rank)
            built_in[rank] = threading.current_thread().name

        def step(self, key, actions):
            name = threading.current_thread().name
            stepped_in.setdefault(self.rank, set()).add(name)
            # the runner's loop for this rank runs here: no second thread of the rank's
            # name hands each chunk over (one hand-off a chunk, each way, saved)
            workers.setdefault(self.rank, set()).add(
                sum(t.name == name for t in threading.enumerate()))
            return super().step(key, actions)

        def where(self, tag):  # an env's own method, called by the user through the runner
            return tag, threading.current_thread().name

    ref = sync_reference(2)
    runner = AsyncRunner(make_collector(), [lambda r=r: Recording(r) for r in range(RANKS)],
                         policy_fn, PARAMS, seed=SEED)
    assert all(isinstance(env, ThreadBoundEnv) for env in runner.envs)
    for r, env in enumerate(runner.envs):  # its methods run in its thread, attributes read
        assert env.where(tag=r) == (r, f"jaxtraj-env_worker_{r}") and env.rank == r
    got = {}
    for _ in range(2):  # two runs: new worker threads, the same env threads
        got.update({(int(tr.step_id), int(tr.env_rank)): tr for _, tr in runner.run()})
    for k in ref:
        assert_same(got[k], ref[k])  # the same trajectories as envs given directly
    for r in range(RANKS):
        assert stepped_in[r] == {built_in[r]} == {f"jaxtraj-env_worker_{r}"}
        assert workers[r] == {1}
    runner.envs[0].close()  # closed under the runner: the next run names the rank, no hang
    with pytest.raises(RunnerError, match="env rank 0.s env was closed") as info:
        runner.run()
    assert info.value.worker == "env_worker_0"
    for env in runner.envs[1:]:
        env.close()

    def broken():
        raise OSError("no display")

    closed = []

    class Closing(PointEnv):
        def close(self):
            closed.append(self.rank)

    for bad, match in ((broken, "no display"), (lambda: 42, "not an environment")):
        with pytest.raises(RunnerError, match=match) as info:
            AsyncRunner(make_collector(), [lambda: Closing(0), bad], policy_fn, PARAMS)
        assert info.value.worker == "env_worker_1"
    assert closed == [0, 0]  # the rank built before the bad one was closed both times


# --------------------------------------------------------------------------- env processes


class PidEnv(PointEnv):
    """A PointEnv that records the process it was built in and each step ran in."""

    def __init__(self, rank, **kw):
        super().__init__(rank, **kw)
        self.built_pid, self.step_pids = os.getpid(), set()

    def step(self, key, actions):
        self.step_pids.add(os.getpid())
        return super().step(key, actions)


class DyingEnv(PointEnv):
    """A PointEnv whose process exits (as a segfaulting simulator's would) at one key."""

    def __init__(self, rank, die_at):
        super().__init__(rank)
        self.die_at = die_at

    def step(self, key, actions):
        if key.as_tuple() == self.die_at:
            os._exit(3)
        return super().step(key, actions)


def test_process_workers_build_and_step_each_env_in_its_process_with_the_same_trajectories():
    """env_workers="process": each factory runs in a process of its own, which every step
    runs in; the trajectories are the synchronous loop's, batched (a long wait) or not (no
    wait, random env delays, jitter), across run(num_steps=1) calls; DecoupledRunner's are
    its thread workers'. (A process costs seconds to start here: few are started.)"""
    steps = 3
    ref = sync_reference(steps)
    envs = [functools.partial(PidEnv, r, delay_s=0.003) for r in range(RANKS)]
    runner = AsyncRunner(make_collector(), envs, policy_fn, PARAMS, seed=SEED,
                         env_workers="process", batch_wait_s=5.0)
    read = []  # what an on_flush read of the envs mid-run (each env's process's answer)

    def on_flush(_, tr):
        got[(int(tr.step_id), int(tr.env_rank))] = tr
        read.append([env.step_pids for env in runner.envs])

    with runner:
        got, calls = {}, []
        for s in range(steps):
            if s == 1:  # rarely batched from here on
                runner.batch_wait_s, runner.jitter_s = 0.0, 0.003
            if s == 2:  # the last step's items to an on_flush that reads the envs meanwhile
                runner.on_flush = on_flush
            got.update({(int(tr.step_id), int(tr.env_rank)): tr for _, tr in runner.run()})
            calls.append(runner.calls)
        pids = [env.built_pid for env in runner.envs]
        assert len(set(pids)) == RANKS and os.getpid() not in pids
        assert [env.step_pids for env in runner.envs] == [{p} for p in pids]
        assert read == [[{p} for p in pids]] * RANKS
        assert runner_threads() == []  # one worker thread a run, no thread per env
    assert calls[0] == E * T and max(calls[1:]) > E * T  # batched, then not always
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_same(got[k], ref[k])
    assert all(not env._process.is_alive() for env in runner.envs)  # closed by the with
    noisy = dict(batch_wait_s=0.0, env_delay_s=0.004, jitter_s=0.003)
    threads, _, _ = run_steps(DecoupledRunner, 2, per_call=True, batch_wait_s=5.0)
    procs, _, _ = run_steps(DecoupledRunner, 2, per_call=True, env_workers="process", **noisy)
    assert sorted(procs) == sorted(threads)
    for k in threads:
        assert_same(procs[k], threads[k])


def _locked_factory():
    lock = threading.Lock()  # no pickler sends a lock to another process
    return lambda: (lock, PointEnv(1))[1]


class SlowAtEnv(PointEnv):
    """A PointEnv whose step at one key takes ``delay_s``."""

    def __init__(self, rank, slow_at, delay_s):
        super().__init__(rank)
        self.slow_at, self.slow_s = slow_at, delay_s

    def step(self, key, actions):
        if key.as_tuple() == self.slow_at:
            time.sleep(self.slow_s)
        return super().step(key, actions)


class DiesIdleEnv(PointEnv):
    """A PointEnv whose process exits shortly after it answered one key's step, while
    it has no step to run."""

    def __init__(self, rank, die_after):
        super().__init__(rank)
        self.die_after = die_after

    def step(self, key, actions):
        out = super().step(key, actions)
        if key.as_tuple() == self.die_after:  # after the step: its answer goes out first
            threading.Timer(0.2, os._exit, (3,)).start()
        return out


def test_process_workers_bad_factories_and_crashes_name_the_rank():
    from jaxtraj.runners.bound import ProcessBoundEnv

    with pytest.raises(RunnerError, match="env_worker_0.*give env rank 0 a factory"):
        AsyncRunner(make_collector(), [PointEnv(0), functools.partial(PointEnv, 1)], policy_fn,
                    PARAMS, env_workers="process")
    with pytest.raises(ValueError, match="env_workers must be 'thread' or 'process'"):
        AsyncRunner(make_collector(), [PointEnv(0)], policy_fn, PARAMS, env_workers="fork")
    # A process that ends before its env is built (a script without the __main__ guard
    # re-running itself in the child): named, with what to check.
    with pytest.raises(RunnerError, match=r"env_worker_0.*exit code 2\) before its env was "
                       r"built.*if __name__ == \"__main__\":"):
        AsyncRunner(make_collector(), [functools.partial(os._exit, 2)], policy_fn, PARAMS,
                    env_workers="process")
    with pytest.raises(TypeError, match="env_worker_1: the env factory .* cannot be sent"):
        ProcessBoundEnv(_locked_factory(), "env_worker_1")  # refused before any process
    with pytest.raises(TypeError, match="env_worker_1: the env factory returned int, not an"):
        ProcessBoundEnv(int, "env_worker_1")
    # A factory that raises: a RunnerError naming the rank, its exception with the process's
    # traceback as a note; the rank built first is closed.
    with pytest.raises(RunnerError, match="env_worker_1.*ZeroDivisionError") as info:
        AsyncRunner(make_collector(), [functools.partial(PointEnv, 0),
                                       functools.partial(divmod, 1, 0)], policy_fn, PARAMS,
                    env_workers="process")
    assert "in the env's process" in "".join(getattr(info.value.cause, "__notes__", []))
    assert jaxtraj_children() == []
    # An env whose process dies mid-run (a crashing simulator): named, with the key.
    fail = (0, 0, 1, 0, 1)
    runner = AsyncRunner(make_collector(), [functools.partial(PointEnv, 0),
                                            functools.partial(DyingEnv, 1, fail)], policy_fn,
                         PARAMS, env_workers="process")
    with runner, pytest.raises(RunnerError, match=r"process ended \(exit code 3\)") as info:
        runner.run()
    assert info.value.worker == "env_worker_1" and info.value.key == fail
    assert runner_threads() == []
    assert jaxtraj_children() == []
    # One that dies with no step to run (its request waits for rank 0's slow step): named,
    # with no key (it was running none), not an AttributeError of the runner's.
    runner = AsyncRunner(make_collector(), [functools.partial(SlowAtEnv, 0, (0, 0, 0, 0, 0), 1.0),
                                            functools.partial(DiesIdleEnv, 1, (0, 0, 1, 0, 0))],
                         policy_fn, PARAMS, env_workers="process", batch_wait_s=5.0)
    with runner, pytest.raises(RunnerError, match=r"process ended \(exit code 3\)") as info:
        runner.run()
    assert info.value.worker == "env_worker_1" and info.value.key is None
    assert runner_threads() == []
    assert jaxtraj_children() == []


def test_process_workers_failure_keeps_every_chunk_received():
    """A failure mid-run over env processes: every chunk whose result came in is in the
    collector. The policy fails on its second call, chunk 1's, served as soon as a rank's
    chunk 0 is back (no batch wait), before that chunk's env half is made (work off the
    path to the actions): it is made for the drain. The error names the chunk that
    failed."""
    calls = []

    def second_call_fails(params, obs, rng):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("policy crashed")
        return policy_fn(params, obs, rng)

    collector = make_collector()
    # No wait for the other rank: a rank's chunk 1 is served as soon as its chunk 0 is in.
    runner = AsyncRunner(collector, [functools.partial(PointEnv, r) for r in range(RANKS)],
                         second_call_fails, PARAMS, env_workers="process", batch_wait_s=0.0)
    with runner, pytest.raises(RunnerError, match="policy crashed") as info:
        runner.run()
    err = info.value
    assert err.worker == "policy_worker" and err.key[:2] == (0, 0) and err.key[4] == 1
    missing = collector.missing()
    # The rank whose chunk 1 was being served: both halves of its chunk 0 are in.
    assert not [h for k, h, _ in missing if k == (0, 0, err.key[2], 0, 0)]
    # Each rank's chunks are collected in order with no hole: what a rank still misses of
    # the step, of either half, is the end of the step's chunks.
    order = [(e, t) for e in range(E) for t in range(T)]
    for rank in range(RANKS):
        for half in ("policy", "env"):
            left = sorted((k[1], k[4]) for k, h, _ in missing if k[2] == rank and h == half)
            assert left == order[len(order) - len(left):], (rank, half, left)
    assert jaxtraj_children() == []


def jaxtraj_children():
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.name.startswith("jaxtraj-")]


def test_env_methods_called_during_a_run_are_served_between_its_chunks():
    """A factory-built env's thread runs its rank's loop during run(); a call to the env
    from another thread meanwhile (an on_flush reading the envs, the parts queue small
    enough that the run needs the consumer back to go on) is served between chunks, in
    the env's thread, not after the run: no deadlock, and the trajectories are unchanged."""

    class Counting(PointEnv):
        def chunks_seen(self):
            return threading.current_thread().name, len(self.final_log)

    runner, seen, got = None, [], {}

    def on_flush(_, tr):
        got[(int(tr.step_id), int(tr.env_rank))] = tr
        seen.append([env.chunks_seen() for env in runner.envs])

    for value in (None, value_fn):  # env workers publish their halves / the policy side
        seen.clear()
        got.clear()
        runner = AsyncRunner(make_collector(), [lambda r=r: Counting(r) for r in range(RANKS)],
                             policy_fn, PARAMS, seed=SEED, on_flush=on_flush, queue_size=1,
                             value_fn=value)
        thread = threading.Thread(target=runner.run, kwargs={"num_steps": 3}, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "run() hung: an env call from on_flush was never served"
        assert len(seen) == 3 * RANKS
        for calls in seen:  # every call ran in its env's own thread
            assert [name for name, _ in calls] == [f"jaxtraj-env_worker_{r}" for r in range(RANKS)]
        assert any(n < 3 * E * T for calls in seen for _, n in calls)  # some during the run
        ref = sync_reference(3)
        for k in ref:
            assert_same(got[k], ref[k])
        for env in runner.envs:
            env.close()


class _Closing(PointEnv):
    """A PointEnv that counts the chunks stepped after it was closed, and can be kept
    busy in its thread (``hold``)."""

    def __init__(self, rank, busy=None, delay_s=0.0):
        super().__init__(rank)
        self.busy, self.delay_s, self.closed, self.after_close = busy, delay_s, False, 0

    def hold(self, seconds):
        self.busy.set()
        time.sleep(seconds)

    def chunks_seen(self):
        return threading.current_thread().name, len(self.final_log)

    def step(self, key, actions):
        self.after_close += self.closed
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().step(key, actions)

    def close(self):
        self.closed = True


def _run_aside(runner, num_steps):
    """runner.run(num_steps) in a thread: (the thread, {"out" or "exc": ...})."""
    box = {}

    def go():
        try:
            box["out"] = runner.run(num_steps=num_steps)
        except BaseException as exc:  # noqa: BLE001
            box["exc"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, box


def test_env_calls_and_closes_from_other_threads_during_a_run_never_hang_it():
    """Around a run whose ranks' loops run in their envs' threads: a call made while the
    env's thread is busy as the run starts is served by the run, not queued behind it;
    an env closed mid-run (from an on_flush, or another thread) stops the run at once,
    naming the rank; an env closed as a run starts (close() queued behind a call in its
    thread) fails the run naming it, and no run hangs."""
    busy = threading.Event()
    runner, seen = None, []

    def on_flush(_, tr):
        seen.append([env.chunks_seen() for env in runner.envs])

    runner = AsyncRunner(make_collector(), [lambda r=r: _Closing(r, busy) for r in range(RANKS)],
                         policy_fn, PARAMS, seed=SEED, on_flush=on_flush, queue_size=1,
                         batch_wait_s=0.0)
    threading.Thread(target=runner.envs[1].hold, args=(2.0,), daemon=True).start()
    busy.wait(10)  # env 1's thread busy as the run starts: its job queued behind the call
    thread, box = _run_aside(runner, 3)
    thread.join(30)
    assert not thread.is_alive(), "run() hung: on_flush's call queued behind env 1's job"
    assert "exc" not in box and len(seen) == 3 * RANKS

    def closing(_, tr):
        if runner.envs[1].alive():
            runner.envs[1].close()

    runner.on_flush = closing
    thread, box = _run_aside(runner, 3)
    thread.join(30)
    assert not thread.is_alive(), "run() hung: close() from on_flush"
    assert isinstance(box.get("exc"), RunnerError) and box["exc"].worker == "env_worker_1"
    assert runner.envs[1]._env.after_close == 0
    runner.envs[0].close()

    started = threading.Event()

    class Stepping(_Closing):
        def step(self, key, actions):
            started.set()
            return super().step(key, actions)

    runner = AsyncRunner(make_collector(),
                         [lambda r=r: Stepping(r, delay_s=0.01) for r in range(RANKS)],
                         policy_fn, PARAMS, seed=SEED)
    thread, box = _run_aside(runner, 3)
    started.wait(30)
    runner.envs[1].close()  # from this thread, mid-run
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(box.get("exc"), RunnerError) and box["exc"].worker == "env_worker_1"
    assert runner.envs[1]._env.after_close <= 1  # the chunk in flight, at most
    runner.envs[0].close()

    busy.clear()
    runner = AsyncRunner(make_collector(), [lambda r=r: _Closing(r, busy) for r in range(RANKS)],
                         policy_fn, PARAMS, seed=SEED)
    threading.Thread(target=runner.envs[1].hold, args=(1.0,), daemon=True).start()
    busy.wait(10)
    closer = threading.Thread(target=runner.envs[1].close, daemon=True)  # behind the hold
    closer.start()
    time.sleep(0.2)
    thread, box = _run_aside(runner, 1)
    thread.join(30)
    assert not thread.is_alive(), "run() hung: env 1's job queued behind its close"
    assert isinstance(box.get("exc"), RunnerError) and box["exc"].worker == "env_worker_1"
    runner.envs[0].close()
    closer.join(30)  # env 1's thread ends once its hold is over
    assert not closer.is_alive() and runner_threads() == []


def test_process_envs_read_by_another_thread_and_failing_together_neither_hang_nor_hide():
    """Env processes: a thread of the user's reading the envs while a (decoupled) run goes
    on, and an on_flush reading them too, leave the trajectories as they are and hang
    nothing (the reply to a call is not taken for a step's); both ranks failing at once
    raise the run's RunnerError out of the with block, every process ended."""
    ref, _, _ = run_steps(DecoupledRunner, 2, batch_wait_s=5.0)
    envs = [functools.partial(PointEnv, r, critic=False, delay_s=0.004) for r in range(RANKS)]
    runner = DecoupledRunner(make_collector(), envs, policy_fn, PARAMS, value_fn=value_fn,
                             seed=SEED, num_steps=2, batch_wait_s=0.0, env_workers="process")
    got, read, stop, errors = {}, [], threading.Event(), []

    def on_flush(_, tr):
        got[(int(tr.step_id), int(tr.env_rank))] = tr
        read.append([env.rank for env in runner.envs])

    def reader():
        try:
            while not stop.is_set():
                assert [env.rank for env in runner.envs] == list(range(RANKS))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    runner.on_flush = on_flush
    thread = threading.Thread(target=reader, daemon=True)
    with runner:
        runner.envs[0].wait_built()
        thread.start()
        try:
            runner.run()
        finally:
            stop.set()
            thread.join()
    assert not errors, errors
    assert read and all(r == list(range(RANKS)) for r in read)
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_same(got[k], ref[k])

    envs = [functools.partial(PointEnv, r, fail_at=(0, 0, r, 0, 1)) for r in range(RANKS)]
    runner = AsyncRunner(make_collector(), envs, policy_fn, PARAMS, seed=SEED,
                         env_workers="process", batch_wait_s=5.0)
    with pytest.raises(RunnerError, match="simulator crashed"):
        with runner:
            runner.run()
    assert all(not env._process.is_alive() for env in runner.envs)
