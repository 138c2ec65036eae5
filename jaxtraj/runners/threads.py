"""Host-thread runners: environment workers and a policy worker feeding one collector.

Threads and queues::

    env worker r (one per env rank; an env built from a factory: its env's own thread)
      --requests (at most two each)--> policy worker
    policy worker: one policy_fn call for every rank whose request is ready
    policy worker --actions (one reply queue per env rank, one reply at most)--> env worker r
      (which also carries the calls other threads make to a factory-built env during the
      run: served by its worker between chunks)
    env workers, policy worker --parts (bounded)--> consumer --> TrajectoryCollector
      (the policy worker puts the halves of one round, its policy halves and the env
      halves it completed, as one item: one hand-off a round, not one a half)
    consumer --> on_flush(queue_key, item) | output_queue | the list run() returns

With ``env_workers="process"`` there are no worker threads: the thread that calls
:meth:`AsyncRunner.run` waits on every env process's pipe, serves the ready ranks in one
``policy_fn`` call, sends each its actions, and inserts the halves while the processes
step (one thread: no hand-offs, no turns at the GIL). A result in comes first: the inserts
are done a piece at a time, the pipes looked at between pieces.

The consumer is the thread that calls :meth:`AsyncRunner.run`: it is the only thread
that touches the collector (the facade is not thread-safe). Parts reach it out of
order: the two halves of a chunk come from two producers, and ``jitter_s`` delays
each part's arrival by a random amount (a transport delay: the part is held back at
the consumer until it is due, in due order; its producer does not wait).

Every blocking ``put``/``get`` polls a stop event, so a failing worker stops all the
others within ~50 ms. The first failure wins: :meth:`run` drains the parts already
published by healthy workers into the collector (their flushes are delivered), joins
every thread, and raises :class:`RunnerError` naming the worker and the key it was
working on. What was collected stays in the collector (``collector.missing()`` lists
what the interrupted step still waits for), or, flushed (the items ``run`` would have
returned, or not delivered), on the error's ``undelivered``. A ``KeyboardInterrupt`` in
``run`` stops the workers the same way and is re-raised; the flushed items it left are on
the runner's ``undelivered``.

The policy worker batches: one ``policy_fn`` call serves every env rank whose
observation is ready (up to ``max_batch``, after a bounded wait ``batch_wait_s``), on
the ranks' rows joined and padded to a fixed ``max_batch * B`` rows. Randomness is
derived from each chunk's key (:func:`key_rng`, one key per row: :func:`row_rngs`),
never from arrival order or from which ranks shared a call, so :class:`AsyncRunner`
produces the same trajectories whatever the timing, and the same as a synchronous loop
that calls the policy once per chunk index on every rank's rows with the same keys.

What does not depend on the transport (the environment protocol, chunk keys, key-derived
randomness, env halves, version stamping, the consumer) lives in
:mod:`jaxtraj.runners.service` and is shared with the Ray runner
(:mod:`jaxtraj.runners.ray`): one contract, two transports.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import math
import queue
import random
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxtraj.collector import TrajectoryCollector
from jaxtraj.runners.bound import (
    CpuMeter,
    EnvCall,
    ProcessBoundEnv,
    ThreadBoundEnv,
    _Bound,
    checked_env,
    is_factory,
)
from jaxtraj.runners.service import (  # noqa: F401  (re-exported: the public names)
    Consumer,
    Env,
    EnvStep,
    ObservationCheck,
    PolicyFn,
    RunGuard,
    RunnerError,
    StepRngs,
    ValueFn,
    _Due,
    action_rows,
    action_spec,
    check_env,
    check_env_ranks,
    check_run_start,
    check_seeds,
    checked_batch_wait,
    checked_env_step,
    checked_num_steps,
    checked_policy_output,
    checked_seconds,
    chunk_keys,
    complete_env_part,
    env_part,
    join_rows,
    key_rng,
    key_rngs,
    rank_order,
    row_rngs,
    sendable_actions,
    split_rows,
    stack_ranks,
    stamp_versions,
    sub_env_seeds,
)
from jaxtraj.types import PolicyPart, TrajectoryKey, TrajectorySource

PyTree = Any
_POLL_S = 0.05


class _Stopped(Exception):
    """Raised inside a worker when another thread asked everyone to stop."""


class AsyncRunner:
    """Environment workers and a policy worker in host threads, one consumer feeding the
    collector.

    Args:
      collector: the :class:`TrajectoryCollector` to feed (rollout, pipeline or lerobot
        mode); only the thread calling :meth:`run` touches it.
      envs: one :class:`Env` per env rank; ``envs[r]`` owns rank ``env_ranks[r]``. Or a
        factory per rank (a callable returning the env): it is called in a thread of the
        env's own, and every call to the env runs in that thread across :meth:`run` calls
        (:class:`~jaxtraj.runners.bound.ThreadBoundEnv`): what a simulator that binds
        rendering to a thread needs (a MuJoCo camera renders black from another thread).
        During a run that thread runs the rank's worker loop (a chunk's step is a direct
        call); a call to the env from another thread meanwhile (``runner.envs[r].render()``
        in an ``on_flush``) is served there between chunks.
        A factory that raises, or returns something that is not an env (a gymnasium
        or EnvPool env not wrapped in its adapter included), is a :class:`RunnerError`
        naming the rank; the ranks built before it are closed.
        :attr:`envs` holds them, one per rank, those built from factories wrapped
        (their methods run where the env lives). An env rank the collector does not own
        (more envs than the plan's ``num_env_ranks``), or one given twice, is a
        ``ValueError`` before any env is built.
      policy_fn: ``policy_fn(params, obs, rng) -> PolicyOutput`` for ``N`` rows: ``obs``
        leaves ``[N, ...]``, ``rng`` ``[N, 2]``, one PRNG key per row
        (:data:`~jaxtraj.runners.service.PolicyFn`). One call serves every rank whose
        observation is ready: ``N = max_batch * B`` always, rank after rank in env-rank
        order, the rows of ranks not in the call padding (copies, dropped). Chunk
        ``key``'s rows get ``row_rngs(key_rng(seed, key), B)``, so a row's sample never
        depends on the batching. The runner stamps ``versions`` with the current model
        version, where the collector keeps them (its example policy output has
        ``versions``; else they stay ``None``).
      params: the initial policy parameters (version 0).
      value_fn: ``value_fn(params, obs) -> [B]``, terminal inference on the policy side:
        the policy worker computes ``final_values = value_fn(params, EnvStep.final_obs)``
        with the current parameters for the chunks that need them (an epoch's last
        chunk, chunks that cut an episode), so env workers need no critic. ``None``:
        env halves carry the env's own ``EnvStep.final_values`` (or none).
      num_steps: training steps each :meth:`run` collects (each: every epoch and chunk
        of the plan).
      step_id: the first training step.
      stage_id: the stage of every key.
      env_ranks: the env rank of each env; default ``range(len(envs))``.
      seed: base seed of :func:`key_rng` (policy sampling).
      on_flush: ``on_flush(queue_key, item)`` called for each flushed item; else
        ``output_queue.put((queue_key, item))``; else :meth:`run` returns the items.
      queue_size: bound of the parts queue (requests and replies need none: an env worker
        has at most two requests and one reply outstanding). The halves the policy worker
        publishes in one round (at most ``max_batch`` policy halves and the env halves
        that rode with their requests) take one place.
      jitter_s: each part arrives ``uniform(0, jitter_s)`` after it is published
        (simulated transport delays, seeded by ``seed``): the consumer holds it back until
        it is due and takes parts in due order, so later parts overtake earlier ones,
        from the same producer too; the producers never wait for it.
      allow_shared_seeds: let env ranks seed sub-environments alike. By default a runner
        refuses envs whose sub-environments share a seed across ranks (``GymnasiumEnv``
        and EnvPool seed sub-env ``i`` with ``seed + i``: ``seed=rank`` gives rank 0's
        sub-env 1 rank 1's sub-env 0's seed); give rank ``r`` e.g. ``seed=1000 * r``.
      max_batch: the most env ranks one ``policy_fn`` call serves (default: all of
        them). Every call has ``max_batch * B`` rows, padded where fewer ranks are
        ready, so a jitted policy compiles once and its numerics (a matmul's depend on
        the row count) are the same whichever ranks shared a call: trajectories are
        bit-identical however requests were batched. ``max_batch=1``: one call per
        rank's chunk, ``B`` rows (what a per-rank hand loop, or Ray's
        ``policy="actor"``, computes).
      batch_wait_s: after the first request of a call arrives, how long the policy
        worker (with env processes, the thread calling :meth:`run`) waits for the
        other ranks' before calling ``policy_fn`` with those that are ready (with env
        processes, in whole ms rounded up). It waits only for ranks expected within the
        wait (a rank's step in flight started when its actions were sent; an
        exponential average of what its steps took says when it is back): never for a
        rank with nothing left to ask, nor for one whose step will be back later. 0:
        every request already in when a call starts joins it, and no rank waits for
        another.

        ``"auto"`` (default) decides from what the ranks' steps measure: each env's
        share of a step on CPU (:class:`~jaxtraj.runners.bound.CpuMeter`: CPU time over
        the time it could run, so a computing env on a machine short of CPUs still
        reads about 1). Where the ranks' envs compute (on average at least half a step
        on CPU: gymnasium MuJoCo in env processes, EnvPool in env processes), CPUs are
        short, and a call waits up to the longest of the ranks' step times (each an
        exponential average of the time from a rank's actions to its next request; at
        most 50 ms), so the ranks fall into step and one call serves them all: every
        call saved is CPU the simulators get. Where they mostly wait (a remote
        simulator, a robot's control period, EnvPool stepping in threads of its own
        outside a rank's thread) the CPUs idle and waiting would only delay: 0. Until
        both are measured (the runner's first steps), 0. In threads, a GIL-bound env's
        time waiting for the GIL counts as waiting, so several thread ranks of such envs
        may read as waiting: they belong in processes (``env_workers="process"``), or
        give a number. Measured on 2 cores (``benchmarks/host_env.py``, ratio to a hand
        loop, four runs of 2026-12-05): gymnasium Hopper with 2 process ranks 1.33x,
        1.27x, 1.19x and 1.28x with ``"auto"``, against 1.13x, 1.29x, 1.14x and 1.19x
        with 0 and 1.32x, 1.22x, 1.10x and 1.28x with 5 ms (the machine's noise is of
        that order); a 1 ms latency-bound env 1.79x, 1.72x, 1.72x and 1.78x (``"auto"``
        chose 0). A performance
        knob only: the trajectories do not depend on it.
      env_workers: where factories build and step their envs: ``"thread"`` (a thread
        of the env's own, :class:`~jaxtraj.runners.bound.ThreadBoundEnv`) or
        ``"process"`` (a process of its own,
        :class:`~jaxtraj.runners.bound.ProcessBoundEnv`): what CPU-bound Python
        simulators (gymnasium MuJoCo) need to run in parallel with inference and with
        each other, as threads of one process share its GIL. Processes need picklable
        factories and a script guarded by ``if __name__ == "__main__":``; a chunk costs
        a pipe round trip. On Linux the env processes run under ``SCHED_BATCH`` (why,
        the price, and how an env opts out:
        :class:`~jaxtraj.runners.bound.ProcessBoundEnv`). Trajectories do not depend on
        it. :meth:`close` (or ``with``) ends the threads or processes.

    A runner carries across calls: each :meth:`run` collects the training steps after
    the previous one's, from where the environments are (no reset between calls), with
    the PRNG stream and the model version carried on. Keys and PRNG keys are made one
    training step at a time, so memory does not grow with ``num_steps``.

    Example::

        runner = AsyncRunner(collector, envs, policy_fn, params, value_fn=value_fn)
        for it in range(iterations):
            items = runner.run(num_steps=1)   # one training step, any order inside
            params, opt_state = update(params, opt_state, items)
            runner.update_policy(params)
    """

    pipelined = False  # DecoupledRunner: request the next chunk before stepping this one

    def __init__(
        self,
        collector: TrajectoryCollector,
        envs: Sequence[Env],
        policy_fn: PolicyFn,
        params: Any,
        *,
        value_fn: ValueFn | None = None,
        num_steps: int = 1,
        step_id: int = 0,
        stage_id: int = 0,
        env_ranks: Sequence[int] | None = None,
        seed: int = 0,
        on_flush: Callable[[str, Any], None] | None = None,
        output_queue: queue.Queue | None = None,
        queue_size: int = 64,
        jitter_s: float = 0.0,
        allow_shared_seeds: bool = False,
        max_batch: int | None = None,
        batch_wait_s: float | str = "auto",
        env_workers: str = "thread",
    ):
        self.collector, self.plan = collector, collector.plan
        self.policy_fn, self.value_fn = policy_fn, value_fn
        envs = list(envs)
        self.env_ranks = list(range(len(envs)) if env_ranks is None else env_ranks)
        if len(self.env_ranks) != len(envs):
            raise ValueError(f"{len(envs)} envs but {len(self.env_ranks)} env_ranks")
        check_env_ranks(collector, self.env_ranks, stage_id)
        if env_workers not in ("thread", "process"):
            raise ValueError(f"env_workers must be 'thread' or 'process', got {env_workers!r}")
        num_steps = checked_num_steps(num_steps)
        jitter_s = checked_seconds("jitter_s", jitter_s)
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        batch_wait_s = checked_batch_wait(batch_wait_s, auto=True)
        self.env_workers = env_workers
        self.envs = []
        try:
            for env, r in zip(envs, self.env_ranks):
                self.envs.append(self._built(env, r))
            for env, r in zip(self.envs, self.env_ranks):  # processes build in parallel
                if isinstance(env, ProcessBoundEnv):
                    try:
                        env.wait_built()
                    except Exception as exc:
                        raise RunnerError(f"env_worker_{r}", None, exc) from exc
            for env in self.envs:
                check_env(env, collector)  # spaces against the examples, before any thread
            if not allow_shared_seeds:
                check_seeds([sub_env_seeds(e) for e in self.envs], self.env_ranks)
        except BaseException:  # the ranks built so far stop cleanly (their error is not this one)
            with contextlib.suppress(Exception):
                self.close()
            raise
        self.num_steps, self.step_id, self.stage_id = num_steps, step_id, stage_id
        self.seed, self.on_flush, self.output_queue = seed, on_flush, output_queue
        self.jitter_s = jitter_s
        self.max_batch = len(self.envs) if max_batch is None else min(max_batch, len(self.envs))
        self._slots = self.max_batch
        self.batch_wait_s = batch_wait_s
        # When each rank will ask next, and how CPU-bound its steps are (batch_wait_s="auto"):
        # kept across runs.
        self._due = _Due(len(self.envs))
        self._params, self._version = params, 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failure: tuple[str, tuple | None, BaseException] | None = None
        self._failed_on: str | None = None  # what it failed on, where not a chunk
        # Requests and replies are bounded by the protocol (an env worker has at most two
        # requests and one reply outstanding): C-level SimpleQueues, several times cheaper a
        # hand-off than queue.Queue's Python locks. Parts keep a bound (backpressure).
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._parts: queue.Queue = queue.Queue(queue_size)
        self._replies = [queue.SimpleQueue() for _ in self.envs]
        self._held_replies = [collections.deque() for _ in self.envs]  # see _serve_calls
        self._threads: list[threading.Thread] = []
        self._held: list = []  # parts in transit at the consumer (jitter_s): a heap
        self._batch: collections.deque = collections.deque()  # a round's halves, not yet consumed
        self._outbox: list = []  # the policy worker's halves of its current round
        self.max_qsize = {"requests": 0, "parts": 0, "replies": 0}
        self._consumer = Consumer(collector, on_flush, output_queue)
        # The buffers' layout (shapes only), to check each half in its own worker.
        self._layout = collector.layout
        self._obs_check = ObservationCheck(collector)  # once per observation signature
        self._stamp = self._layout.policy.output.versions is not None
        self._action_spec = action_spec(self._layout)
        self._action_rows = action_rows(self._layout)
        # Per env: (observation, last chunk's transition) where the last run left it.
        self._carry: list[tuple[PyTree, Any] | None] = [None] * len(self.envs)
        self._rng_steps = StepRngs(self.plan, seed, self.env_ranks, stage_id)
        self.calls = 0  # policy_fn calls of the last run
        self._broken: str | None = None  # the failure that ended the last run, if any
        self._one_run = RunGuard()  # a run() inside a run is refused

    # -- public ----------------------------------------------------------------------

    @property
    def delivered(self) -> int:
        """How many flushed items the last :meth:`run` delivered (returned, or given to
        ``on_flush`` / ``output_queue``; after a failure, those given to them)."""
        return self._consumer.delivered

    @property
    def undelivered(self) -> list[tuple[str, Any]]:
        """The last run's flushed items not handed over, after it failed or was
        interrupted (``KeyboardInterrupt``): as :class:`RunnerError`'s ``undelivered``,
        out of the collector, so only there."""
        return list(self._consumer.undelivered)

    @property
    def version(self) -> int:
        """The model version the policy worker stamps on new chunks."""
        return self._version

    def update_policy(self, params: Any) -> int:
        """Swap in new parameters (thread-safe, during :meth:`run`); returns the new version.

        Requests served after the call use ``params`` and carry the new version.
        """
        with self._lock:
            self._params, self._version = params, self._version + 1
            return self._version

    def keys(self, env_rank: int) -> list[TrajectoryKey]:
        """The keys env rank ``env_rank`` produces in the next :meth:`run`, in order."""
        return chunk_keys(self.plan, env_rank, self.step_id, self.num_steps, self.stage_id)

    def run(self, num_steps: int | None = None) -> list[tuple[str, Any]]:
        """Collect ``num_steps`` training steps (default: the constructor's) after the
        previous call's; block until done.

        The environments continue where the previous call left them (the first call
        resets them), and :attr:`step_id` advances by ``num_steps``.

        Returns:
          The flushed ``(queue_key, item)`` pairs when neither ``on_flush`` nor
          ``output_queue`` is given, else ``[]`` (the queue key routes an item to its
          consumer: ``plan.queue_key``, ``"default"``, for rollout trajectories,
          ``"actor_<r>"`` for pipeline micro-batches); in the order of
          :func:`~jaxtraj.runners.service.rank_order` (by training step, epoch, then env
          rank): :func:`~jaxtraj.runners.service.stack_ranks` stacks one step's for one
          update.

        Raises:
          RunnerError: a worker (or the collector, on a rejected part) failed; all
            threads are stopped and joined first. What was collected stays in the
            collector, or, flushed, on the error's ``undelivered`` (the items this call
            would have returned). The runner cannot run again after it (its environments
            are mid-step): a later call raises ``RuntimeError`` saying so.
        """
        n = self.num_steps if num_steps is None else checked_num_steps(num_steps)
        with self._one_run:
            return self._run(n)

    def _run(self, n: int) -> list[tuple[str, Any]]:
        if self._broken is not None:
            raise RuntimeError(
                f"this runner's last run failed ({self._broken}): its environments are "
                "mid-step, out of step with the collector, so it cannot continue. What was "
                "collected is in the collector (collector.missing() lists what the step "
                "waits for) or on its RunnerError's undelivered; build a new runner, and a "
                "new collector or a restored checkpoint"
            )
        check_run_start(self.collector, self.env_ranks, self.stage_id, self.step_id, n)
        for env, r in zip(self.envs, self.env_ranks):
            if isinstance(env, (ThreadBoundEnv, ProcessBoundEnv)) and not env.alive():
                raise RunnerError(f"env_worker_{r}", None, RuntimeError(
                    f"env rank {r}'s env was closed (its thread or process has ended): "
                    "build a new runner"
                ))
        self._run_steps = n
        self._stop.clear()
        self._failure = None
        # Fresh queues: nothing of an earlier run is served or executed in this one.
        self._requests, self._parts = queue.SimpleQueue(), queue.Queue(self._parts.maxsize)
        # Items with halves made as the run stopped, not put on their queue: the drain's.
        self._unsent_requests: list = []
        self._unsent_parts: list = []
        self._replies = [queue.SimpleQueue() for _ in self.envs]
        self._held_replies = [collections.deque() for _ in self.envs]  # see _serve_calls
        self._consumer = consumer = Consumer(self.collector, self.on_flush, self.output_queue,
                                             self._stop.is_set)
        self._rng_steps = StepRngs(self.plan, self.seed, self.env_ranks, self.stage_id)
        self._due.new_run()
        self.calls = 0
        per_env = n * self.plan.num_epochs * self.plan.num_chunks
        total = 2 * len(self.envs) * per_env
        # Requests the policy worker serves: one per chunk; with terminal inference also
        # (non-pipelined) each env's last chunk's terminal request, or (pipelined) one per
        # chunk's env half. Without it env workers publish their halves themselves.
        terminal = (per_env if self.pipelined else 1) if self.value_fn is not None else 0
        requests = len(self.envs) * (per_env + terminal)
        self._held = held = []  # (due, order, worker, part)
        self._batch = batch = collections.deque()
        self._outbox = []
        self._order = 0
        if self.env_workers == "process":
            # The calling thread serves every env process through its pipe and inserts
            # the halves while the processes step: no worker threads, no hand-offs, no
            # threads taking turns at the GIL.
            self._threads = []
            try:
                self._guard("policy_worker", self._process_worker, None)
            except BaseException as exc:  # raised outside the guard's reach
                self._fail("consumer", None, exc)
            finally:
                self._stop.set()
        else:
            self._threads = [self._env_thread(i, r) for i, r in enumerate(self.env_ranks)]
            self._threads.append(
                threading.Thread(
                    target=self._guard,
                    args=("policy_worker", self._policy_worker, requests),
                    name="jaxtraj-policy_worker",
                    daemon=True,
                )
            )
            received = order = 0
            try:
                for t in self._threads:
                    t.start()
                while received < total and self._failure is None:
                    if held:
                        now = time.monotonic()
                        if held[0][0] <= now:  # the next part is due: it arrives
                            _, _, worker, part = heapq.heappop(held)
                            received += 1
                            consumer.consume(worker, part)
                            continue
                        wait = min(held[0][0] - now, _POLL_S)
                    else:
                        wait = _POLL_S
                    try:
                        due, worker, part = self._parts.get(timeout=wait)
                    except queue.Empty:
                        continue
                    if due:
                        heapq.heappush(held, (due, order, worker, part))
                        order += 1
                        continue
                    if worker is None:  # the policy worker's round: (worker, half) pairs
                        batch.extend(part)
                        while batch:
                            w, p = batch.popleft()
                            received += 1
                            consumer.consume(w, p)
                        continue
                    received += 1
                    consumer.consume(worker, part)
            except BaseException as exc:  # KeyboardInterrupt included
                self._fail("consumer", None, exc)
            finally:
                self._stop.set()
                self._join()
        if self._failure is None:
            try:
                consumer.check_held()
            except RunnerError as exc:
                self._fail(exc.worker, exc.key, exc)
        if self._failure is not None:
            worker, key, exc = self._failure
            self._broken = f"{worker} at key {key}: {type(exc).__name__}"  # before the drain:
            try:
                self._drain()  # a KeyboardInterrupt in it leaves the runner marked broken
            finally:  # run()'s items go on the error (and the runner's undelivered)
                delivered, unhanded = consumer.failed_run()
            if isinstance(exc, KeyboardInterrupt):
                raise exc
            raise RunnerError(worker, key, exc, delivered, unhanded, self._failed_on) from exc
        self.step_id += n
        return rank_order(consumer.kept)

    def close(self) -> None:
        """Close the environments this runner built from factories (their threads or
        processes end); envs given built are the caller's to close. Idempotent; also on
        leaving a ``with`` block."""
        first = None
        for env in getattr(self, "envs", []):  # every one, whatever one raises
            if isinstance(env, (ThreadBoundEnv, ProcessBoundEnv)):
                try:
                    env.close()
                except Exception as exc:  # noqa: BLE001  (raised once all are closed)
                    first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> AsyncRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _built(self, env: Any, rank: int) -> Any:
        """An env as given, or, for a factory, built in a thread (or process) of its own
        that every later call to it runs in (:mod:`jaxtraj.runners.bound`)."""
        name = f"env_worker_{rank}"
        if not is_factory(env):
            if self.env_workers == "process":
                raise RunnerError(name, None, TypeError(
                    f"env_workers='process' builds each env in its own process: give env "
                    f"rank {rank} a factory (a picklable callable returning the env), not "
                    f"a built {type(env).__name__}"
                ))
            try:
                return checked_env(env, name, built=True)
            except TypeError as exc:
                raise RunnerError(name, None, exc) from exc
        try:
            if self.env_workers == "process":  # built in parallel: see wait_built
                return ProcessBoundEnv(env, name, wait=False)
            return ThreadBoundEnv(env, name)
        except Exception as exc:
            raise RunnerError(name, None, exc) from exc

    def _key(self, rank: int, n: int) -> TrajectoryKey:
        """The ``n``-th key env rank ``rank`` produces in this run (no list of them)."""
        T, E = self.plan.num_chunks, self.plan.num_epochs
        s, rest = divmod(n, E * T)
        return TrajectoryKey(self.step_id + s, rest // T, rank, self.stage_id, rest % T)

    def _rng(self, key: TrajectoryKey) -> np.ndarray:
        """The chunk's row keys ``[B, 2]`` (:func:`~jaxtraj.runners.service.row_rngs` of
        its :func:`key_rng`), made for a whole training step of every rank in one device
        call when first asked; older steps are dropped (policy worker only)."""
        return self._rng_steps(key)

    # -- workers ---------------------------------------------------------------------

    def _guard(self, name: str, fn: Callable, arg: Any) -> None:
        ctx = {"key": None}
        try:
            fn(arg, ctx)
        except _Stopped:
            pass
        except BaseException as exc:
            self._fail(name, ctx["key"], exc)

    def _fail(self, worker: str, key: Any, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failed_on = None
                if isinstance(exc, RunnerError):
                    self._failed_on = exc.what
                    worker, key, exc = exc.worker, exc.key, exc.cause
                if key is not None and not isinstance(key, tuple):
                    key = key.as_tuple()
                self._failure = (worker, key, exc)
        self._stop.set()

    def _put(self, q: queue.Queue, item: Any, name: str, env: int | None = None,
             keep: list | None = None) -> None:
        """Put ``item`` on ``q``, waiting while it is full; ``env``: the index of the env
        whose worker waits, which meanwhile serves the calls handed to it. Once the run
        stops, an item that carries halves is appended to ``keep`` (the drain takes it
        from there: halves made as another worker failed); any other (actions) is not
        sent: no env starts a chunk after the stop."""
        while not self._stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
            except queue.Full:
                if env is not None:
                    self._serve_calls(env)
                continue
            size = q.qsize()
            if size > self.max_qsize[name]:
                self.max_qsize[name] = size
            return
        if keep is not None:
            keep.append(item)
        raise _Stopped

    def _get(self, q: queue.Queue) -> Any:
        while not self._stop.is_set():
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        raise _Stopped

    def _publish(self, worker: str, part: Any, rand: random.Random, env: int | None = None
                 ) -> None:
        due = time.monotonic() + rand.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0
        if self.env_workers == "process":  # jitter_s only (else _emit keeps it for _flush):
            heapq.heappush(self._held, (due, self._order, worker, part))  # held here
            self._order += 1
            return
        self._put(self._parts, (due, worker, part), "parts", env, keep=self._unsent_parts)

    def _actions(self, i: int) -> Any:
        """Env ``i``'s actions for its next chunk (its worker), serving meanwhile the calls
        to the env that other threads handed to it (an env built from a factory, whose
        thread runs the worker: ``ThreadBoundEnv.job``)."""
        held = self._held_replies[i]
        if held:
            return held.popleft()
        while True:
            item = self._get(self._replies[i])
            if type(item) is not EnvCall:
                return item
            self._serve_call(i, item)

    def _serve_calls(self, i: int) -> None:
        """Serve the calls to env ``i`` handed to its worker while it waits on something
        else; actions that came meanwhile are kept, in order, for :meth:`_actions`."""
        while True:
            try:
                item = self._replies[i].get_nowait()
            except queue.Empty:
                return
            if type(item) is EnvCall:
                self._serve_call(i, item)
            else:
                self._held_replies[i].append(item)

    def _serve_call(self, i: int, item: EnvCall) -> None:
        """Serve a call handed to env ``i``'s worker; if it closed the env (``close()``
        from another thread), the rank stops here, as its next step through the closed
        env would."""
        ThreadBoundEnv.serve(item)
        env = self.envs[i]
        if isinstance(env, ThreadBoundEnv) and not env.alive():
            raise RuntimeError(f"{env.name}: the env's thread has ended (closed)")

    def _arrive(self) -> float | None:
        """``env_workers="process"``: insert the held parts now due (jitter_s), in due
        order; returns how long until the next one is due (``None``: none held)."""
        held = self._held
        while held:
            left = held[0][0] - time.monotonic()
            if left > 0:
                return left
            _, _, worker, part = heapq.heappop(held)
            self._consumer.consume(worker, part)
        return None

    def _emit(self, worker: str, part: Any, rand: random.Random) -> None:
        """A half the policy worker publishes: with ``jitter_s``, at once (each half its
        own transport delay); else kept for the round's one hand-off (:meth:`_flush`)."""
        if self.jitter_s:
            self._publish(worker, part, rand)
        else:
            self._outbox.append((worker, part))

    def _flush(self) -> None:
        """Publish the policy worker's halves of this round as one item (after the
        round's replies: the env workers step before the consumer inserts); with
        ``env_workers="process"``, insert them (the env processes step meanwhile)."""
        if self.env_workers == "process":  # the calling thread inserts
            self._batch.extend(self._outbox)
            self._outbox = []
            while self._batch:  # left for the drain if the collector rejects one
                self._consumer.consume(*self._batch.popleft())
        elif self._outbox:
            out, self._outbox = self._outbox, []  # (not left for _leave_outbox to put again)
            self._put(self._parts, (0.0, None, out), "parts", keep=self._unsent_parts)

    def _check(self, part: Any, key: TrajectoryKey) -> None:
        """Structure check of a half in its producer's thread (cached by signature)."""
        self.collector.check_structure(part)

    def _check_obs(self, obs: PyTree, key: TrajectoryKey) -> None:
        self._obs_check(obs, key)

    def _env_thread(self, i: int, rank: int) -> Any:
        """Env rank ``rank``'s worker for this run: an env built from a factory runs it
        in its own thread (each step a direct call where the env lives, no hand-off a
        chunk); an env given built, in a thread started for the run."""
        name = f"env_worker_{rank}"
        env = self.envs[i]
        if isinstance(env, ThreadBoundEnv) and env.alive():  # calls from other threads
            # meanwhile come in with its actions (served between chunks: _actions)
            return env.job(self._guard, name, self._env_worker, i, inbox=self._replies[i],
                           name=f"jaxtraj-{name}")
        return threading.Thread(target=self._guard, args=(name, self._env_worker, i),
                                name=f"jaxtraj-{name}", daemon=True)

    def _env_worker(self, i: int, ctx: dict) -> None:
        """Env rank ``env_ranks[i]``: request each chunk's actions, execute them, and hand
        the env half (with what terminal inference needs) to the policy worker, which
        completes and publishes it, as in the seed; without a ``value_fn`` there is
        nothing to complete and the env worker publishes it."""
        env = self.envs[i]
        if isinstance(env, ThreadBoundEnv):  # in its thread (a job): the env itself
            env = env.local()
        # An env stepped in this thread is measured here (its share on CPU); a bound env
        # stepped elsewhere measures itself where it runs.
        meter = None if isinstance(env, _Bound) else CpuMeter(time.thread_time)
        try:
            self._env_steps(i, ctx, meter, env)
        finally:
            if meter is not None:
                meter.close()

    def _env_steps(self, i: int, ctx: dict, meter: CpuMeter | None, env: Any) -> None:
        name, rank = f"env_worker_{self.env_ranks[i]}", self.env_ranks[i]
        rand = random.Random(self.seed * 7919 + 2 * i + 1)  # its parts' transport delays
        count = self._run_steps * self.plan.num_epochs * self.plan.num_chunks
        key = ctx["key"] = self._key(rank, 0)
        if self._carry[i] is None:
            obs, prev = env.reset(), None
            self._check_obs(obs, key)
            self._carry[i] = (obs, prev)
        obs, prev = self._carry[i]
        pending = None  # (env worker, EnvStep, EnvPart) of the last executed chunk
        if self.pipelined:
            self._put(self._requests, (i, key, obs, None), "requests")
        for n in range(count):
            key = ctx["key"] = self._key(rank, n)
            if not self.pipelined:
                # The previous chunk's env half rides with this chunk's request.
                self._put(self._requests, (i, key, obs, pending), "requests",
                          keep=self._unsent_requests)
                pending = None
            actions = self._actions(i)
            if self.pipelined and n + 1 < count:
                # Decoupled: the policy infers the next chunk from this (stale) observation
                # while the environment executes this chunk.
                self._put(self._requests, (i, self._key(rank, n + 1), obs, None), "requests")
            out = self._step(i, env, key, actions, meter)
            # Decoupled: an explicit boundary, the next policy saw a stale observation.
            part = env_part(self.plan, key, out, prev, out.obs if self.pipelined else None)
            self._check_obs(out.obs, key)
            self._check(part, key)
            obs, prev = out.obs, out.transition
            self._carry[i] = (obs, prev)
            if self.value_fn is None:  # no terminal inference to run: publish it now
                self._publish(name, part, rand, i)
                continue
            pending = (name, out, part)
            if self.pipelined:
                self._put(self._requests, (i, None, None, pending), "requests",
                          keep=self._unsent_requests)
                pending = None
        if pending is not None:  # the last chunk's terminal request: no actions asked
            self._put(self._requests, (i, None, None, pending), "requests",
                      keep=self._unsent_requests)

    def _step(self, i: int, env: Any, key: TrajectoryKey, actions: Any,
              meter: CpuMeter | None) -> EnvStep:
        """Env ``i``'s step of chunk ``key`` (env worker thread), and the share of its
        time the env spent on CPU (``batch_wait_s="auto"``): a bound env's own figure
        (its thread's or process's, ``meter`` None), else this thread's (``meter``)."""
        if meter is None:
            out = env.step(key, actions)
            share = env.cpu_share
        else:
            meter.start()
            out = env.step(key, actions)
            share = meter.share()
        self._due.cpu(i, share)  # rank i's worker is the one writer of its entry
        return checked_env_step(out)

    def _wait(self) -> float:
        """How long a call waits for other ranks: ``batch_wait_s``, or with ``"auto"``
        what the ranks' steps say (:meth:`~jaxtraj.runners.service._Due.auto_wait`)."""
        return self._due.auto_wait() if self.batch_wait_s == "auto" else self.batch_wait_s

    def _complete(self, pending: tuple, params: Any, rand: random.Random, ctx: dict) -> None:
        """Terminal inference for an env half (the policy side's), then publish it under
        the env worker that produced it."""
        worker, out, part = pending
        ctx["key"] = part.source.key
        done = complete_env_part(self.plan, self._layout, part, out, self.value_fn, params)
        if done is not part:  # final values added: check them (the env worker checked the rest)
            self._check(done, done.source.key)
        self._emit(worker, done, rand)

    def _policy_worker(self, count: int, ctx: dict) -> None:
        """Serve every env rank's requests: terminal inference for env halves at once;
        action requests joined, one ``policy_fn`` call for all ranks whose observation
        is ready (up to :attr:`max_batch`, waiting at most :attr:`batch_wait_s` after
        the first for the others), rows padded to ``max_batch * B``."""
        rand = random.Random(self.seed * 7919)
        per_env = self._run_steps * self.plan.num_epochs * self.plan.num_chunks
        asks = [per_env] * len(self.envs)  # action requests each rank has still to make
        ready: list[tuple] = []  # (env index, key, obs): action requests to serve

        def take(item: tuple) -> None:
            i, key, obs, pending = item
            if key is not None:  # when it asked (before this side's own work on the item)
                self._due.back(i, time.monotonic())
            if pending is not None:
                with self._lock:
                    params = self._params
                self._complete(pending, params, rand, ctx)
            if key is not None:
                asks[i] -= 1
                ready.append((i, key, obs))

        try:
            self._rounds(count, ready, asks, take, rand, ctx)
        finally:
            self._leave_outbox()

    def _leave_outbox(self) -> None:
        """Failed or stopped mid-round: the halves made are left for the drain."""
        if self._outbox:
            self._unsent_parts.append((0.0, None, self._outbox))
            self._outbox = []

    def _rounds(self, count: int, ready: list, asks: list, take: Callable, rand: random.Random,
                ctx: dict) -> None:
        """The policy worker's loop: a round takes the requests ready (up to the slots,
        waiting at most :attr:`batch_wait_s`), serves them in one call, then publishes
        the round's halves in one hand-off."""
        slots = self._slots
        served = 0
        while served < count:
            take(self._get(self._requests))
            served += 1
            if not ready:
                self._flush()
                continue
            deadline = time.monotonic() + self._wait()
            while served < count:
                asking = {r[0] for r in ready}
                waiting = [i for i, n in enumerate(asks)
                           if n and i not in asking and self._due.by(i, deadline)]
                if len(ready) >= slots or not waiting:
                    break
                try:  # a request already queued is ready: no wait
                    item = self._requests.get_nowait()
                except queue.Empty:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        item = self._requests.get(timeout=min(left, _POLL_S))
                    except queue.Empty:
                        if self._stop.is_set():
                            raise _Stopped from None
                        continue
                take(item)
                served += 1
            if ready:
                self._serve(sorted(ready), rand, ctx)
                ready.clear()
            self._flush()

    def _serve(self, batch: list[tuple], rand: random.Random, ctx: dict) -> None:
        """One ``policy_fn`` call for the action requests ``batch`` (env index, key,
        observation), each chunk's rows with its own row keys; reply and publish."""
        bsz = self.plan.batch_size
        with self._lock:
            params, version = self._params, self._version
        ctx["key"] = batch[0][1]
        obs, rng = join_rows([o for _, _, o in batch], [self._rng(k) for _, k, _ in batch],
                             self._slots)
        output = checked_policy_output(self.policy_fn(params, obs, rng), self._slots * bsz,
                                       self.plan.nonfinite == "reject", self._action_rows)
        # The envs step while the rest of the output is made into policy halves.
        actions = sendable_actions(output, self._action_spec, self._slots)
        if actions is not None:
            for j, (i, key, _) in enumerate(batch):
                ctx["key"] = key
                self._reply(i, key, actions[j * bsz : (j + 1) * bsz])
        output = stamp_versions(output, version, self._stamp)
        for (i, key, o), own in zip(batch, split_rows(output, len(batch), bsz)):
            ctx["key"] = key
            part = PolicyPart(TrajectorySource(key, bsz, 0), o, own)
            self._check(part, key)
            if actions is None:  # checked first
                self._reply(i, key, own.actions)
            self._emit("policy_worker", part, rand)
        self.calls += 1

    def _reply(self, i: int, key: TrajectoryKey, actions: Any) -> None:
        """Hand chunk ``key``'s actions to env ``i``: its worker thread's reply queue,
        or (``env_workers="process"``) the env's process, which starts the step (held
        until the step in flight is back, when pipelined)."""
        if self.env_workers != "process":
            self._due.started(i, time.monotonic())
            self._put(self._replies[i], actions, "replies")
        elif self._stepping[i] is not None:
            self._held_actions[i] = (key, actions)
        else:
            self._send_step(i, key, actions, self._carry[i][0])

    def _send_step(self, i: int, key: TrajectoryKey, actions: Any, obs: PyTree) -> None:
        """Start env ``i``'s step of chunk ``key`` in its process; pipelined, ask for the
        next chunk's actions from ``obs``, the observation the env has as it starts."""
        try:
            self.envs[i].send("step", key, actions)
        except Exception as exc:
            raise RunnerError(f"env_worker_{self.env_ranks[i]}", key.as_tuple(), exc) from exc
        self._stepping[i] = key
        self._due.started(i, time.monotonic())
        if self.pipelined:
            self._ask(i, obs)

    def _ask(self, i: int, obs: PyTree) -> None:
        """Env ``i``'s next action request (from ``obs``), if it has one left to make."""
        if self._asked[i] < self._per_env:
            self._ready.append((i, self._key(self.env_ranks[i], self._asked[i]), obs))
            self._asked[i] += 1

    def _process_worker(self, _: Any, ctx: dict) -> None:
        """``env_workers="process"``: the calling thread is every env rank's worker, the
        policy worker and the consumer. It takes each executed chunk from its env's
        process (whichever is in first), serves the ranks whose observation is ready in
        one ``policy_fn`` call (:attr:`max_batch`, :attr:`batch_wait_s`), sending each its
        actions, then completes and checks the env halves as the env workers and the
        policy worker would, and inserts the halves while the env processes step: one
        piece at a time (an env half made, or one half inserted), the pipes looked at
        between pieces, so that a rank whose result is in waits at most a piece while
        the work behind is under its bound (past it the work is caught up first). The
        same requests, keys and rows as the threads' (pipelined too), so the same
        trajectories."""
        try:
            self._serve_processes(ctx)
        finally:
            self._leave_outbox()

    def _serve_processes(self, ctx: dict) -> None:
        plan, n_env = self.plan, len(self.envs)
        self._per_env = per_env = self._run_steps * plan.num_epochs * plan.num_chunks
        rand = random.Random(self.seed * 7919)
        rands = [random.Random(self.seed * 7919 + 2 * i + 1) for i in range(n_env)]
        names = [f"env_worker_{r}" for r in self.env_ranks]
        self._stepping = stepping = [None] * n_env  # the key each env is executing
        self._held_actions = held = [None] * n_env  # actions waiting for the step in flight
        self._asked = asked = [0] * n_env  # action requests made in this run
        self._ready = ready = []  # (env index, key, obs): action requests to serve
        done = [0] * n_env  # chunks executed (results received)
        wait = _Readable([env.connection for env in self.envs])  # env i's result is in
        expect = self._due  # when each rank will ask next
        for i, env in enumerate(self.envs):
            if self._carry[i] is None:
                key = ctx["key"] = self._key(self.env_ranks[i], 0)
                try:
                    obs = env.reset()
                    self._check_obs(obs, key)
                except Exception as exc:
                    raise RunnerError(names[i], key.as_tuple(), exc) from exc
                self._carry[i] = (obs, None)
            self._ask(i, self._carry[i][0])
        halves: collections.deque = collections.deque()  # (env index, key, EnvStep, prev)

        def env_half() -> None:
            """The env half of the oldest chunk received: made, checked, completed."""
            i, key, out, prev = halves.popleft()
            ctx["key"] = key
            part = env_part(plan, key, out, prev, out.obs if self.pipelined else None)
            try:
                self._check(part, key)
            except Exception as exc:
                raise RunnerError(names[i], key.as_tuple(), exc) from exc
            if self.value_fn is None:  # no terminal inference to run
                self._emit(names[i], part, rands[i])
            else:
                with self._lock:
                    params = self._params
                self._complete((names[i], out, part), params, rand, ctx)

        def backlog() -> int:
            """Work off the path to the actions: env halves to make, halves to insert."""
            return len(halves) + len(self._outbox) + len(self._batch)

        def piece() -> None:
            """One piece of that work (an env half made, or one half inserted): between
            pieces the pipes are looked at again, so a rank whose result is in is served
            first and (the work behind under its bound) waits at most a piece, not a
            round's inserts."""
            if halves:
                env_half()
                return
            if self._outbox:
                self._batch.extend(self._outbox)
                self._outbox = []
            if self._batch:  # popped first: the rest is left for the drain if one is rejected
                self._consumer.consume(*self._batch.popleft())

        # The work behind is bounded: past 8 pieces a rank (about 3 a chunk: its env
        # half to make, both halves to insert), a learner short of CPU catches up before
        # it serves again.
        most_behind = 8 * n_env

        def serve() -> None:
            """Results in first, then the ranks ready served, then (no result in) one
            piece of the work behind."""
            deadline = None
            while min(done) < per_env:
                timeout = _POLL_S
                if ready and backlog() <= most_behind:
                    # Serve now if every rank that will ask soon has asked, the call is
                    # full, or the wait is over (a rank asks again when its step is back;
                    # pipelined, when the step it holds actions for starts).
                    asking = {r[0] for r in ready}
                    now = time.monotonic()
                    deadline = now + self._wait() if deadline is None else deadline
                    coming = [i for i in range(n_env) if i not in asking and asked[i] < per_env
                              and (held[i] if self.pipelined else stepping[i]) is not None
                              and expect.by(i, deadline)]
                    if len(ready) >= self._slots or not coming or now >= deadline:
                        # The first to ask, up to the call's slots (the rest: the next call).
                        batch = sorted(ready[: self._slots], key=lambda r: r[0])
                        del ready[: self._slots]
                        deadline = None
                        self._serve(batch, rand, ctx)
                        continue
                    timeout = min(deadline - now, _POLL_S)
                due = self._arrive()  # parts in transit (jitter_s) that are due
                if due is not None:
                    timeout = min(timeout, due)
                behind = backlog()
                # results an env call from an on_flush read off a pipe first: in already
                early = [i for i, env in enumerate(self.envs) if env.received_early]
                got = wait(0.0 if behind or early else timeout)
                if early:
                    got = early + [i for i in got if i not in early]
                for i in got:
                    env = self.envs[i]
                    # readable with nothing of the runner's to read: the reply to another
                    # thread's call (read by that call), unless the process has ended
                    if stepping[i] is None and env.alive():
                        continue
                    if stepping[i] is not None and not env.ready():
                        continue
                    key = ctx["key"] = stepping[i]
                    stepping[i] = None
                    expect.back(i, time.monotonic())
                    try:
                        out = checked_env_step(self.envs[i].receive())
                    except Exception as exc:  # key None: its process ended with no step to run
                        raise RunnerError(names[i], key and key.as_tuple(), exc) from exc
                    expect.cpu(i, self.envs[i].step_share)  # not a call's meanwhile
                    try:  # before the policy sees it, and before the env steps on from it
                        self._check_obs(out.obs, key)
                    except Exception as exc:
                        raise RunnerError(names[i], key.as_tuple(), exc) from exc
                    if held[i] is not None:  # the next chunk's actions: its step starts at once
                        (k, actions), held[i] = held[i], None
                        self._send_step(i, k, actions, out.obs)
                    # Its env half is made later, off the path to the actions.
                    halves.append((i, key, out, self._carry[i][1]))
                    self._carry[i] = (out.obs, out.transition)
                    done[i] += 1
                    if not self.pipelined:
                        self._ask(i, out.obs)
                if not got and behind:
                    piece()

        def in_flight(timeout_s: float) -> None:
            """After a failure: the steps the env processes are executing, received as
            they finish (for up to ``timeout_s``, as the thread workers are joined), so
            that the chunks they executed keep their env halves. An env whose result
            cannot be received (it raised, or its process ended) is left."""
            deadline = time.monotonic() + timeout_s
            while any(k is not None for k in stepping):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                early = [i for i, env in enumerate(self.envs) if env.received_early]
                progressed = False
                for i in early or wait(min(left, _POLL_S)):
                    env, key = self.envs[i], stepping[i]
                    if key is None:
                        continue
                    try:
                        if not env.ready():
                            continue
                        progressed, stepping[i] = True, None
                        out = checked_env_step(env.receive())
                        self._check_obs(out.obs, key)
                    except Exception:  # noqa: BLE001  (the run's failure is the one reported)
                        progressed, stepping[i] = True, None
                        continue
                    halves.append((i, key, out, self._carry[i][1]))
                    self._carry[i] = (out.obs, out.transition)
                if not progressed:  # a pipe readable with nothing of ours (an env whose
                    time.sleep(min(left, 0.005))  # process ended): no busy loop

        try:
            serve()
        except BaseException as exc:
            # The chunks the envs executed are collected: those in flight received, and
            # the env halves of all made for the drain to insert (each that can be; a
            # failure making one is not the one reported, nor the key it was at).
            failed_at = ctx["key"]
            if not isinstance(exc, KeyboardInterrupt):
                in_flight(10.0)
            while halves:
                try:
                    env_half()
                except Exception:  # noqa: BLE001
                    continue
            ctx["key"] = failed_at
            raise
        while halves:
            env_half()
        self._flush()
        while self._held:  # the last parts in transit arrive
            time.sleep(self._arrive() or 0.0)

    # -- consumer --------------------------------------------------------------------

    def _drain(self) -> None:
        """After a failure: insert the parts healthy workers already published (those in
        transit first, in due order)."""
        held = [(0.0, n, w, p) for n, (w, p) in enumerate(self._batch)]
        held += sorted(self._held)
        self._batch, self._held = collections.deque(), []
        for _, worker, part in _emptied(self._parts, self._unsent_parts):
            pairs = part if worker is None else [(worker, part)]
            held += [(0.0, len(held), w, p) for w, p in pairs]
        # Env halves of chunks the envs executed, still waiting in the requests for the
        # policy side's terminal inference: completed here (one whose value_fn fails
        # is lost with the run; the others are not).
        for *_, pending in _emptied(self._requests, self._unsent_requests):
            if pending is None:
                continue
            worker, out, part = pending
            with self._lock:
                params = self._params
            try:
                done = complete_env_part(self.plan, self._layout, part, out, self.value_fn,
                                         params)
            except Exception:  # noqa: BLE001  (the run's failure is the one reported)
                continue
            held.append((0.0, len(held), worker, done))
        for _, _, worker, part in held:
            try:
                self._consumer.consume(worker, part)
            except Exception:  # noqa: BLE001  (the first failure is the one reported; the
                continue  # parts behind it are healthy: a rejected part changed nothing)
        self._consumer.insert_held()

    def _join(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive and self._failure is None:
            self._fail("runner", None, RuntimeError(f"threads still running: {alive}"))


def _emptied(q: Any, into: list) -> list:
    """``into``, with every item ``q`` holds appended (none waited for)."""
    while True:
        try:
            into.append(q.get_nowait())
        except queue.Empty:
            return into


class _Readable:
    """The env processes' pipes to wait on, registered once (``select.poll``:
    ``multiprocessing.connection.wait`` builds a selector per call, a cost on every turn
    of the process loop); ``wait(timeout_s)`` returns the indices of those with a reply
    (or an end) to read."""

    def __init__(self, connections: Sequence[Any]):
        self.connections = list(connections)
        self.poll = select.poll() if hasattr(select, "poll") else None
        # What a wait returns (a file descriptor, or without poll(2) the connection) -> i
        self.index = {}
        for i, conn in enumerate(self.connections):
            if self.poll is None:
                self.index[conn] = i
                continue
            self.poll.register(conn.fileno(), select.POLLIN)
            self.index[conn.fileno()] = i

    def __call__(self, timeout_s: float) -> list[int]:
        if self.poll is None:  # no poll(2) (Windows): multiprocessing's wait
            from multiprocessing.connection import wait

            return [self.index[c] for c in wait(self.connections, timeout_s)]
        # Whole milliseconds, rounded up (a wait shorter than 1 ms is not a busy loop), never
        # negative (poll(2) reads a negative timeout as no timeout at all).
        ms = max(0, math.ceil(timeout_s * 1e3))
        return [self.index[fd] for fd, _ in self.poll.poll(ms)]


class DecoupledRunner(AsyncRunner):
    """Environment and policy at different rates, with explicit boundary observations.

    Two decouplings over :class:`AsyncRunner`:

    - **Pipelined inference**: env worker ``r`` requests chunk ``t + 1``'s actions with
      its current observation *before* executing chunk ``t``, so inference overlaps
      execution. Chunk ``t + 1``'s ``PolicyPart.obs`` is then the observation the
      policy actually conditioned on (one chunk stale), and chunk ``t``'s
      ``EnvPart.next_obs`` carries the true post-action observation as an explicit
      boundary override (what ``Trajectory.next_obs`` holds with
      ``collect_transitions``).

    It batches as :class:`AsyncRunner` does (``max_batch``, ``batch_wait_s``: one
    ``policy_fn`` call for every rank whose request is ready, each row with its own
    key), and takes the same arguments.

    Example::

        runner = DecoupledRunner(collector, envs, policy, params, batch_wait_s=0.002)
        items = runner.run()
    """

    pipelined = True
