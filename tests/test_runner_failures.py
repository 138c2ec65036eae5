"""Host runners under failure and bad input: nothing collected is lost silently, no run
hangs, and the error names what was wrong (from a review of the runners)."""

from __future__ import annotations

import functools
import os
import pathlib
import queue
import threading
import time

import jax
import numpy as np
import pytest
from test_runners_threads import (
    PARAMS,
    RANKS,
    B,
    E,
    PointEnv,
    T,
    assert_same,
    make_collector,
    policy_fn,
    sync_reference,
    value_fn,
)

from jaxtraj import CollectorError
from jaxtraj.runners.service import Consumer
from jaxtraj.runners.threads import AsyncRunner, DecoupledRunner, RunnerError


class Rank0Env(PointEnv):
    """An env class whose constructor takes nothing: itself a factory."""

    def __init__(self):
        super().__init__(0)


class CloseRaises(PointEnv):
    def close(self):
        raise RuntimeError(f"close of rank {self.rank} failed")


class TupleEnv(PointEnv):
    """Returns a gymnasium step's tuple, not an EnvStep, from chunk 1 on."""

    def step(self, key, actions):
        out = super().step(key, actions)
        if int(key.chunk_id) >= 1:
            return out.obs, out.transition.rewards, out.transition.terminations, None, {}
        return out


def runner_of(envs, **kw):
    return AsyncRunner(make_collector(), envs, policy_fn, PARAMS, **kw)


def test_a_collector_at_another_step_or_not_flushing_is_refused_before_anything_runs():
    collector = make_collector()
    runner = AsyncRunner(collector, [PointEnv(r) for r in range(RANKS)], policy_fn, PARAMS,
                         step_id=1)
    with pytest.raises(ValueError, match=r"env rank 0: the collector accepts training step 0, "
                       r"the runner's next is step 1"):
        runner.run()  # its halves could only be held, and lost as the run ended
    runner.step_id = 0  # as the message says; nothing went in before (no DUPLICATE now)
    assert len(runner.run()) == RANKS

    manual = make_collector(auto_flush=False)
    runner = AsyncRunner(manual, [PointEnv(r) for r in range(RANKS)], policy_fn, PARAMS)
    with pytest.raises(ValueError, match="auto_flush=False"):
        runner.run(num_steps=2)
    assert runner.run(num_steps=1) == []  # complete, flushed by the caller
    assert len([x for scope in manual.ready() for x in manual.flush(*scope)]) == RANKS
    assert runner.run(num_steps=1) == [] and len(manual.ready()) == RANKS


def test_an_on_flush_error_names_the_item_and_nothing_flushed_is_lost():
    delivered, failed = [], []

    def on_flush(queue_key, tr):
        item = (int(tr.step_id), int(tr.env_rank))
        if not failed:
            failed.append(item)
            raise OSError("disk full")
        delivered.append(item)

    collector = make_collector()
    runner = AsyncRunner(collector, [PointEnv(r, delay_s=0.002) for r in range(RANKS)],
                         policy_fn, PARAMS, num_steps=2, jitter_s=0.02, on_flush=on_flush)
    with pytest.raises(RunnerError) as info:
        runner.run()
    err = info.value
    assert err.worker == "on_flush" and isinstance(err.cause, OSError)
    assert f"on queue 'default', step {failed[0][0]}, env rank {failed[0][1]}" in str(err)
    undelivered = [(int(t.step_id), int(t.env_rank)) for _, t in err.undelivered]
    assert undelivered[0] == failed[0]
    flushed = {(s, r) for r in range(RANKS) for s in range(collector.current_step(r))}
    assert flushed == set(delivered) | set(undelivered)  # each item delivered or handed over
    assert len(delivered) + len(undelivered) == len(flushed)
    with pytest.raises(RuntimeError, match="last run failed"):
        runner.run()


def test_after_a_failure_every_healthy_half_published_goes_into_the_collector():
    def on_flush(queue_key, tr):  # fails on every item, in the drain too
        raise OSError("writer down")

    collector = make_collector()
    runner = AsyncRunner(collector, [PointEnv(r) for r in range(RANKS)], policy_fn, PARAMS,
                         num_steps=3, on_flush=on_flush, batch_wait_s=0.0)
    published, put = [], runner._put

    def recording_put(q, item, name, env=None, keep=None):
        put(q, item, name, env, keep)  # (raises, nothing queued, once the run stops)
        if name == "parts":
            _, worker, part = item
            published.extend(part if worker is None else [(worker, part)])

    runner._put = recording_put
    with pytest.raises(RunnerError) as info:
        runner.run()
    assert info.value.undelivered  # the items the drain's flushes made, on_flush failing
    dropped = []
    for _, part in published:  # a half the collector would still take was dropped
        try:
            collector.add(part)
        except Exception:  # noqa: BLE001  (in already, or of a step not current)
            continue
        dropped.append(part.source.key.as_tuple())
    assert dropped == []


def test_a_full_output_queue_does_not_hang_a_run_whose_worker_failed():
    out = queue.Queue(maxsize=1)  # nobody reads it during the run
    envs = [PointEnv(0), PointEnv(1, fail_at=(1, 0, 1, 0, 1))]
    runner = runner_of(envs, num_steps=2, output_queue=out)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("exc", _raised(runner.run)), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "run() hung on the full output queue"
    err = box["exc"]
    assert isinstance(err, RunnerError) and err.worker == "env_worker_1"
    assert out.qsize() == 1 and err.undelivered  # the item that did not fit is on the error


def _raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_an_interrupt_in_the_drain_leaves_the_runner_marked_broken():
    def interrupt(queue_key, tr):
        raise KeyboardInterrupt

    runner = runner_of([PointEnv(r) for r in range(RANKS)], num_steps=3, on_flush=interrupt)
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    runner.on_flush = None
    with pytest.raises(RuntimeError, match="last run failed"):
        runner.run()


def test_run_inside_a_run_is_refused():
    runner = None

    def on_flush(queue_key, tr):
        runner.run()

    runner = runner_of([PointEnv(r) for r in range(RANKS)], on_flush=on_flush)
    with pytest.raises(RunnerError, match="run\\(\\) is already running") as info:
        runner.run()
    assert info.value.worker == "on_flush"


def test_close_closes_every_env_when_one_close_raises():
    runner = runner_of([lambda: CloseRaises(0), lambda: PointEnv(1)])
    runner.run()
    with pytest.raises(RuntimeError, match="close of rank 0 failed"):
        runner.close()
    assert [env.alive() for env in runner.envs] == [False, False]


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0, "0.01", True])
def test_jitter_s_must_be_finite_seconds(bad):
    with pytest.raises(ValueError, match="jitter_s must be a finite number of seconds"):
        runner_of([PointEnv(r) for r in range(RANKS)], jitter_s=bad)


def test_num_steps_must_be_an_integer_and_a_bad_one_breaks_nothing():
    with pytest.raises(ValueError, match="num_steps must be an integer >= 1, got 2.0"):
        runner_of([PointEnv(r) for r in range(RANKS)], num_steps=2.0)
    runner = runner_of([PointEnv(r) for r in range(RANKS)])
    for bad in (1.5, True, 0, np.float32(1)):
        with pytest.raises(ValueError, match="num_steps must be an integer >= 1"):
            runner.run(num_steps=bad)
    assert len(runner.run(num_steps=np.int64(1))) == RANKS  # not broken


@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize("cls", [AsyncRunner, DecoupledRunner])
def test_a_step_that_returns_no_envstep_names_the_rank(cls, workers):
    envs = [functools.partial(TupleEnv, r) for r in range(RANKS)]
    with cls(make_collector(), envs, policy_fn, PARAMS, env_workers=workers) as runner:
        with pytest.raises(RunnerError, match="env.step must return an EnvStep, got tuple") as info:
            runner.run()
    assert info.value.worker.startswith("env_worker_")


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_an_env_class_is_a_factory_and_a_closed_env_is_named(workers):
    envs = [Rank0Env, functools.partial(PointEnv, 1)]
    with AsyncRunner(make_collector(), envs, policy_fn, PARAMS, env_workers=workers) as runner:
        assert len(runner.run()) == RANKS  # the class built where it runs
        runner.envs[1].close()
        with pytest.raises(RunnerError, match="env rank 1's env was closed") as info:
            runner.run()
        assert info.value.worker == "env_worker_1"


def test_halves_held_for_the_next_step_go_in_when_the_flush_before_fails():
    """A half of step 1 arrives before step 0 is complete (held); step 0's flush then
    fails in on_flush: the held half still goes in (and the failure is raised)."""
    published = []
    clean = AsyncRunner(make_collector(), [PointEnv(r) for r in range(RANKS)], policy_fn, PARAMS,
                        num_steps=2)
    put = clean._put

    def recording_put(q, item, name, env=None, keep=None):
        put(q, item, name, env, keep)
        if name == "parts":
            _, worker, part = item
            published.extend(part if worker is None else [(worker, part)])

    clean._put = recording_put
    clean.run()
    rank0 = [(w, p) for w, p in published if int(p.source.key.env_rank) == 0]
    step0 = [x for x in rank0 if int(x[1].source.key.step_id) == 0]
    step1 = [x for x in rank0 if int(x[1].source.key.step_id) == 1]

    def on_flush(queue_key, item):
        raise OSError("disk full")

    collector = make_collector()
    consumer = Consumer(collector, on_flush=on_flush)
    consumer.consume(*step1[0])  # ahead of its step: held
    with pytest.raises(RunnerError, match="on_flush failed on queue 'default', step 0"):
        for w, p in step0:
            consumer.consume(w, p)
    assert consumer.held == [] and len(consumer.undelivered) == 1
    with pytest.raises(CollectorError, match="DUPLICATE"):  # it is in
        collector.add(step1[0][1])


class LoggingEnv(PointEnv):
    """Records each chunk it executed (a file named by its key in ``folder``: seen from
    the test whether the env ran in a thread or a process of its own)."""

    def __init__(self, rank, folder):
        super().__init__(rank, critic=False)  # terminal inference on the policy side
        self.folder = folder

    def step(self, key, actions):
        out = super().step(key, actions)
        pathlib.Path(self.folder, "_".join(map(str, key.as_tuple()))).touch()
        return out


def executed_chunks_without_env_half(folder, collector):
    ran = {tuple(int(x) for x in p.name.split("_")) for p in pathlib.Path(folder).iterdir()}
    assert ran  # something ran before the failure
    missing = {(k, half) for k, half, *_ in collector.missing()}
    return sorted(k for k in ran if (k, "env") in missing)


@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize("cls", [AsyncRunner, DecoupledRunner])
def test_a_failed_run_keeps_the_env_half_of_every_chunk_an_env_executed(tmp_path, cls, workers):
    """A policy call that fails while an executed chunk's env half waits for terminal
    inference (in the requests with threads, in its pipe with processes): the half is
    completed and collected all the same (from a review: 1 of 4 halves lost before)."""
    folder, calls = str(tmp_path), []

    def second_call_fails(params, obs, rng):
        calls.append(1)
        if len(calls) == 2:
            deadline = time.monotonic() + 60
            while not any(pathlib.Path(folder).iterdir()) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # that chunk's result is on its way to the policy side
            raise RuntimeError("policy crashed")
        return policy_fn(params, obs, rng)

    collector = make_collector()
    envs = [functools.partial(LoggingEnv, r, folder) for r in range(RANKS)]
    with cls(collector, envs, second_call_fails, PARAMS, value_fn=value_fn, max_batch=1,
             batch_wait_s=0.0, env_workers=workers) as runner:
        with pytest.raises(RunnerError, match="policy crashed") as info:
            runner.run()
    assert info.value.worker == "policy_worker"
    assert executed_chunks_without_env_half(folder, collector) == []


@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize("cls", [AsyncRunner, DecoupledRunner])
def test_a_failing_on_flush_loses_no_env_half_made_as_the_run_stops(tmp_path, cls, workers):
    """The halves the env workers make as the run stops go in (the drain takes them);
    before, most such runs lost some."""
    folder = str(tmp_path)

    def on_flush(queue_key, item):
        raise RuntimeError("on_flush failed")

    collector = make_collector()
    envs = [functools.partial(LoggingEnv, r, folder) for r in range(RANKS)]
    with cls(collector, envs, policy_fn, PARAMS, value_fn=value_fn, on_flush=on_flush,
             env_workers=workers, num_steps=3) as runner:
        with pytest.raises(RunnerError, match="on_flush failed"):
            runner.run()
    assert executed_chunks_without_env_half(folder, collector) == []


def nan_row_5(params, obs, rng):
    """A NaN action in row 5 of the call; before, the env that stepped it had its NaN
    rewards refused, blamed for them."""
    out = policy_fn(params, obs, rng)
    return out.replace(actions=_nan_at(out.actions, 5))


def _nan_at(actions, row):
    actions = np.array(actions)
    actions[row, 0, 0] = np.nan
    return actions


def flat_actions(params, obs, rng):
    """Actions [N, K * A]: before, refused as one rank's slice [B, K * A] (from a
    newcomer's trial)."""
    out = policy_fn(params, obs, rng)
    return out.replace(actions=out.actions.reshape(out.actions.shape[0], -1))


def per_rank_policy(params, obs, rng):
    """Written for one rank's B rows: the first B of whatever it is given."""
    out = policy_fn(params, obs, rng)
    return jax.tree.map(lambda x: x[:B], out)


@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize("bad, match", [
    (per_rank_policy, r"policy_fn was given 8 rows .* returned PolicyOutput\.actions of shape "
                      r"\(4, \d+, \d+\)"),
    (lambda p, o, r: (policy_fn(p, o, r).actions, None),
     r"policy_fn returned a tuple: it must return a jaxtraj\.PolicyOutput"),
    (flat_actions, r"policy_fn returned PolicyOutput\.actions of shape \(8, \d+\) for its 8 "
                   r"rows: each row's actions must be of shape \(4, \d+\) \(the plan's K = 4 "
                   r"actions a chunk, as the env takes them\): reshape them to \(8, 4, \d+\)"),
    (nan_row_5, r"policy_fn returned non-finite actions \(rows \[5\] of 8: nan\); none "
                r"reached an env"),
])
def test_a_policy_output_of_the_wrong_kind_or_rows_is_named_on_every_call(workers, bad, match):
    """Every call, however many ranks it served (it always has max_batch * B rows): a
    per-rank policy failed only when two ranks shared a call, and then as one rank's
    slice coming out short (from a newcomer's trial)."""
    envs = [functools.partial(PointEnv, r) for r in range(RANKS)]
    with AsyncRunner(make_collector(), envs, bad, PARAMS, env_workers=workers,
                     batch_wait_s=0.0) as runner:
        with pytest.raises(RunnerError, match=match) as info:
            runner.run()
    assert info.value.worker == "policy_worker" and info.value.key[-1] == 0  # the first call


class Recorded(PointEnv):
    """Records its last observation (shared through ``seen``) and the chunks it ran."""

    def __init__(self, rank, seen):
        super().__init__(rank)
        self.seen = seen

    def reset(self):
        obs = super().reset()
        self.seen["obs", self.rank] = obs["state"]
        return obs

    def step(self, key, actions):
        out = super().step(key, actions)
        self.seen["obs", self.rank] = out.obs["state"]
        self.seen.setdefault("ran", set()).add(key.as_tuple())
        return out

    def close(self):
        pass


def test_no_chunk_is_started_after_the_run_stopped():
    """A policy call that returns as the run stops sends no actions: no env steps a chunk
    whose policy half would never be made (from a review of the fix above, whose first
    version sent them; timing-based there: it failed in most runs)."""
    seen, state = {}, {"calls": 0, "closer": None}

    def policy(params, obs, rng):
        state["calls"] += 1
        rank1 = np.array_equal(np.asarray(obs["state"]), seen.get(("obs", 1)))
        if state["calls"] > 4 and rank1 and state["closer"] is None:
            runner = state["runner"]
            state["closer"] = threading.Thread(target=runner.envs[0].close, daemon=True)
            state["closer"].start()  # rank 0's loop serves it between chunks and fails
            deadline = time.monotonic() + 5.0
            while not runner._stop.is_set() and time.monotonic() < deadline:
                time.sleep(0.001)
        return policy_fn(params, obs, rng)

    envs = [functools.partial(Recorded, r, seen) for r in range(RANKS)]
    collector = make_collector()
    runner = AsyncRunner(collector, envs, policy, PARAMS, max_batch=1, batch_wait_s=0.0,
                         num_steps=2)
    state["runner"] = runner
    try:
        with pytest.raises(RunnerError):
            runner.run()
    finally:
        if state["closer"] is not None:
            state["closer"].join(10)
        runner.close()
    missing = {(k, h) for k, h, *_ in collector.missing()}
    assert [k for k in seen.get("ran", ()) if (k, "policy") in missing] == []


def test_a_round_flushed_after_the_stop_is_kept_once():
    """The policy worker's round, flushed as the run stops, then left at its end: the
    drain gets it once (it went on the parts queue twice before)."""
    from jaxtraj.runners.threads import _Stopped

    runner = AsyncRunner(make_collector(), [PointEnv(r) for r in range(RANKS)], policy_fn,
                         PARAMS)
    runner._unsent_parts, runner._outbox = [], [("policy_worker", "half a"),
                                                ("policy_worker", "half b")]
    runner._stop.set()
    with pytest.raises(_Stopped):
        runner._flush()  # as _rounds does after a round
    runner._leave_outbox()  # as the policy worker's finally does
    assert runner._parts.qsize() == 0
    assert runner._unsent_parts == [(0.0, None, [("policy_worker", "half a"),
                                                 ("policy_worker", "half b")])]


class DiesOrSlow(PointEnv):
    """Rank 0's process exits at chunk 1; rank 1's chunk 1 takes 1.5 s."""

    def step(self, key, actions):
        if int(key.chunk_id) == 1 and int(key.epoch_id) == 0:
            if self.rank == 0:
                time.sleep(0.2)  # rank 1 is stepping by then
                os._exit(1)
            time.sleep(1.5)
        return super().step(key, actions)


def test_waiting_for_a_step_in_flight_does_not_spin_on_an_ended_env():
    """After a failure the steps in flight are awaited; an env whose process ended keeps
    its pipe readable, which made that wait a busy loop (a core for up to 10 s)."""
    envs = [functools.partial(DiesOrSlow, r) for r in range(RANKS)]
    with AsyncRunner(make_collector(), envs, policy_fn, PARAMS, env_workers="process",
                     max_batch=1, batch_wait_s=0.0) as runner:
        runner.envs[0].call("reset")  # built (spawn, imports) before the clock starts
        runner.envs[1].call("reset")
        cpu0, wall0 = time.process_time(), time.monotonic()
        with pytest.raises(RunnerError, match="process ended"):
            runner.run()
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert wall > 1.2  # it waited for rank 1's step in flight
    assert cpu < 0.5 * wall, f"the learner spun: {cpu:.2f} s of CPU in {wall:.2f} s"


@pytest.mark.parametrize("layout, returned, message", [
    ((3, 2), (6,), r"must be of shape \(3, 2\) \(the plan's K = 3 .*: reshape them to \(4, 3, 2\)"),
    ((6,), (3, 2), r"must be of shape \(6,\) \(the plan's K = 3 .*: reshape them to \(4, 6\)"),
    ((2,), (1, 2), r"must be of shape \(2,\) \(the plan's K = 1 .*: reshape them to \(4, 2\)"),
    ((), (1,), r"must be of shape \(\) \(the plan's K = 1 .*: reshape them to \(4,\)"),
    ((3, 2), (3, 3), r"must be of shape \(3, 2\) \(the plan's K = 3 [^:]*$"),
])
def test_actions_of_another_shape_a_row_are_named_with_the_layouts_k(layout, returned, message):
    """Chunked [B, K, A], flat [B, K * A], K = 1 [B, A] and scalar [B] layouts: K is the
    layout's, and the reshape offered is to its shape (from a review: a flat layout was
    told to reshape to [N, K, A], K read off the row's first axis, [B] an IndexError)."""
    from jaxtraj import PolicyOutput
    from jaxtraj.runners.service import checked_policy_output

    k = 3 if layout in ((3, 2), (6,)) else 1
    good = PolicyOutput(actions=np.zeros((4, *layout), np.float32))
    assert checked_policy_output(good, 4, per_row=(layout, k)) is good
    with pytest.raises(ValueError, match=rf"PolicyOutput\.actions of shape \(4, "
                       rf"{', '.join(map(str, returned))},?\) for its 4 rows: each row's actions " + message):
        checked_policy_output(PolicyOutput(actions=np.zeros((4, *returned), np.float32)), 4,
                              per_row=(layout, k))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_nonfinite_actions_are_refused_whatever_the_float_dtype(dtype):
    import jax.numpy as jnp

    from jaxtraj import PolicyOutput
    from jaxtraj.runners.service import checked_policy_output

    actions = jnp.zeros((4, 2, 3), jnp.dtype(dtype)).at[1, 0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match=r"non-finite actions \(rows \[1\] of 4"):
        checked_policy_output(PolicyOutput(actions=actions), 4)
    checked_policy_output(PolicyOutput(actions=actions), 4, finite=False)  # allowed


class SlowRank0(PointEnv):
    def step(self, key, actions):
        if self.rank == 0:
            time.sleep(0.2)  # the next chunk's actions are held by the time it is back
        return super().step(key, actions)


def test_an_env_whose_observation_is_refused_steps_no_further(monkeypatch):
    """DecoupledRunner with env processes: the held next chunk was sent before the
    returned observation was checked; when it was refused, that next step's half was then
    made with an older chunk's transition as its boundary (from a review)."""
    import jaxtraj.runners.threads as threads

    bad, after = (0, 0, 0, 0, 2), (0, 1, 0, 0, 0)
    made, real = set(), threads.env_part

    def spy(plan, key, out, prev, next_obs=None):
        made.add(key.as_tuple())
        return real(plan, key, out, prev, next_obs)

    monkeypatch.setattr(threads, "env_part", spy)
    envs = [functools.partial(SlowRank0, r, bad_obs_at=bad) for r in range(RANKS)]
    with DecoupledRunner(make_collector(), envs, policy_fn, PARAMS, env_workers="process",
                         max_batch=1, batch_wait_s=0.0) as runner:
        with pytest.raises(RunnerError, match="observation"):
            runner.run()
    assert (0, 0, 0, 0, 1) in made and after not in made


class LateFailure(PointEnv):
    """Fails at ``fail_at`` after ``wait_s``: the other ranks' step is complete by then."""

    def __init__(self, rank, fail_at, wait_s):
        super().__init__(rank, fail_at=fail_at)
        self.wait_s = wait_s

    def step(self, key, actions):
        if key.as_tuple() == self.fail_at:
            time.sleep(self.wait_s)
        return super().step(key, actions)


@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize("cls", [AsyncRunner, DecoupledRunner])
def test_the_items_a_failed_run_would_have_returned_are_on_the_error(cls, workers):
    """Rank 0's step is complete (flushed: out of the collector) when rank 1 fails: its
    trajectory is on the error's undelivered, not lost with run()'s return (from a
    newcomer's trial: it was only in the runner's private consumer)."""
    last = (0, E - 1, 1, 0, T - 1)
    envs = [functools.partial(PointEnv, 0),
            functools.partial(LateFailure, 1, fail_at=last, wait_s=1.0)]
    collector = make_collector()
    with cls(collector, envs, policy_fn, PARAMS, env_workers=workers) as runner:
        with pytest.raises(RunnerError, match="simulator crashed") as info:
            runner.run()
    err = info.value
    assert err.worker == "env_worker_1" and err.key == last
    (queue_key, item), = err.undelivered
    assert queue_key == "default" and int(item.env_rank) == 0 and int(item.step_id) == 0
    assert err.delivered == 0 and runner.delivered == 0 and len(runner.undelivered) == 1
    assert "1 flushed item(s) not delivered" in str(err)
    assert (last, "env", B) in collector.missing()  # the failed chunk's half only
    if cls is AsyncRunner:  # the same trajectory as a run that succeeds
        assert_same(item, sync_reference(1)[(0, 0)])


class LateInterrupt(LateFailure):
    def step(self, key, actions):
        if key.as_tuple() == self.fail_at:
            time.sleep(self.wait_s)
            raise KeyboardInterrupt
        return super().step(key, actions)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_the_items_an_interrupted_run_would_have_returned_are_on_the_runner(workers):
    """A KeyboardInterrupt is re-raised as it is: rank 0's flushed step is on the runner's
    undelivered (from a review: it was only in the runner's private consumer)."""
    last = (0, E - 1, 1, 0, T - 1)
    envs = [functools.partial(PointEnv, 0),
            functools.partial(LateInterrupt, 1, fail_at=last, wait_s=1.0)]
    with AsyncRunner(make_collector(), envs, policy_fn, PARAMS, env_workers=workers) as runner:
        with pytest.raises(KeyboardInterrupt):
            runner.run()
    (queue_key, item), = runner.undelivered
    assert queue_key == "default" and int(item.env_rank) == 0 and runner.delivered == 0
    assert_same(item, sync_reference(1)[(0, 0)])
