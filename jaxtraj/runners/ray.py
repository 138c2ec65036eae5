"""Environment workers as Ray actors, across machines, feeding the learner's collector.

One Ray actor per env rank steps a vector of host environments (MuJoCo, a robot, any
:class:`~jaxtraj.runners.service.Env`) and returns :class:`~jaxtraj.EnvPart` s; one
consumer in the learner process (the thread calling :meth:`RayRunner.run`) feeds the
:class:`~jaxtraj.TrajectoryCollector`. Policy inference runs where the user puts it:

- ``policy="learner"`` (default, Sebulba-style): in the learner process, on its
  accelerator. For each env rank the learner infers a chunk's actions from the rank's
  last observation, sends the actions to the rank's actor, which executes them and
  returns what the env did (the env half; with ``transport="direct"`` the
  :class:`~jaxtraj.runners.service.EnvStep`, the env half made in the learner) and the
  next observation, and inserts the
  :class:`~jaxtraj.PolicyPart` while the actor steps. One inference serves every rank
  whose observation is in (``max_batch``, ``batch_wait_s``: rows joined, a PRNG key per
  row, as in :class:`~jaxtraj.runners.threads.AsyncRunner`). One chunk per rank is in
  flight (the next chunk needs this one's observation); ranks run in parallel. A chunk
  travels as a Ray actor call (``transport="ray"``) or on a connection each actor opens
  to the learner once (``transport="direct"``: a tenth of the round trip; the default,
  a rank whose actor cannot reach the learner going over to Ray calls).
- ``policy="actor"``: a copy of the policy in every env actor. The learner broadcasts
  parameters once per :meth:`RayRunner.update_policy` (``ray.put``); each actor call
  produces ``chunks_per_call`` chunks, both halves, and at most ``max_in_flight`` calls
  per actor are outstanding (backpressure: memory is bounded by
  ``ranks x max_in_flight x chunks_per_call`` chunks): several chunks in flight per
  rank.

Keys and PRNG keys are made one training step at a time (not for the whole run), so the
learner's memory does not grow with ``num_steps``.

Parts travel as numpy arrays through Ray's object store: the arrays are serialised as
out-of-band buffers (pickle protocol 5), read zero-copy (read-only) on the learner's side,
and copied once by the collector into its staging. The same transport-independent
service-loop logic as the threaded runner (:mod:`jaxtraj.runners.service`): chunk keys,
key-derived randomness (:func:`~jaxtraj.runners.service.key_rng`), version stamping,
env halves, the consumer; so a Ray run equals an :class:`~jaxtraj.runners.threads.AsyncRunner`
run over the same environments, policy, seeds and keys (with ``policy="actor"``, an
``AsyncRunner(max_batch=1)`` run: a policy call per rank's chunk, whose numerics, a
matmul's, may differ in the last bits from a call on every rank's rows).

Faults. A worker whose process dies (``RayActorError``) is restarted by Ray (the runner
allows ``max_restarts`` failures without progress) and redoes its chunk from the last
point the learner received: the actor's state is restored with ``env.set_state(snapshot)`` when the environment
offers ``get_state`` / ``set_state`` (a snapshot comes back with every result), else by
``env.reset()`` and replaying the actions the learner recorded since. The redone chunk
has the same key, randomness and actions, so the step's :class:`~jaxtraj.Trajectory` is
bit-identical to an undisturbed run. With ``TrajectoryPlan(resend="accept_identical")``
a half that reaches the collector twice is accepted once, if identical. A worker that
is alive but has not answered a request for ``stall_timeout_s`` (a hung simulator) is
killed, so Ray restarts it and it redoes its chunk. At the end of a run the runner checks
with ``collector.missing()`` that no half of the collected steps is missing. A worker that fails more than
``max_restarts`` times, or whose environment raises, stops the run: every actor is
shut down, the results already returned are inserted, and :class:`RunnerError` names
the worker and the key; what was collected stays in the collector, or, flushed, on the
error's ``undelivered``. ``close()`` (or the
context manager) and a ``KeyboardInterrupt`` in :meth:`RayRunner.run` shut every actor
down.
"""

from __future__ import annotations

try:
    import ray
    import ray.exceptions
except ImportError as exc:  # pragma: no cover - exercised in a process without Ray
    raise ImportError(
        "jaxtraj.runners.ray needs Ray, an optional dependency: pip install 'jaxtraj[ray]'"
    ) from exc

import errno
import hashlib
import hmac
import ipaddress
import operator
import os
import pickle
import queue
import secrets
import socket
import struct
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any

import jax
import numpy as np

from jaxtraj.collector import TrajectoryCollector
from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.runners.bound import (
    _PICKLED,
    _RAW,
    _STEP,
    _TEMPLATE,
    CpuMeter,
    _batch_scheduling,
    _dumps,
    _portable,
    _request,
    _send_reply,
    _step_request,
    _StepReaders,
    _StepReplies,
    checked_env,
)
from jaxtraj.runners.service import (
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
    check_env_ranks,
    check_run_start,
    check_seeds,
    checked_batch_wait,
    checked_env_step,
    checked_num_steps,
    checked_policy_output,
    chunk_keys,
    complete_env_part,
    env_part,
    join_rows,
    rank_order,
    sendable_actions,
    split_rows,
    stamp_versions,
    sub_env_seeds,
)
from jaxtraj.types import PolicyPart, TrajectoryKey, TrajectorySource

__all__ = ["EnvWorker", "RayRunner", "RunnerError", "EnvStep", "Env"]

PyTree = Any
_POLL_S = 0.05
_CONNECT_POLL_S = 0.005
_CONNECT_WAIT_S = 10.0  # after a direct connection closed: how long Ray may take to say why
_DIAL_S = 30.0  # how long an actor tries to reach the learner's address
_AUTO_DIAL_S = 5.0  # the same with transport="auto", which falls back to Ray's transport
_HANDSHAKE_S = 5.0  # how long either side of a connection waits for the other's next word
_ACCEPT_POLL_S = 0.2  # how often the accept thread looks whether the runner closed
_LIVENESS_S = 1.0  # how often the learner asks Ray whether connected actors still live
_RETRY_S = 0.1
#: After this long without an actor's first answer, the runner warns that Ray may be
#: unable to place it (a start takes seconds: importing JAX, building the env).
START_WARN_S = 60.0
#: A rank whose env has no ``get_state()`` keeps every chunk's actions since its reset
#: (a restart replays them): at this many, the runner warns once.
REPLAY_WARN = 100_000


class Unrestored(RuntimeError):
    """An env actor's env is not where the learner left it: Ray restarted the actor's
    process (its env built afresh) while the learner had nothing in flight to it. It
    steps again once the learner restores it (the learner does, on this error)."""


class EnvWorker:
    """The body of one env actor: one env rank, ``B`` host environments.

    :class:`RayRunner` runs it as a Ray actor; it is a plain class so it can be tested
    and benchmarked in-process too.

    Args:
      env_fn: ``env_fn(env_rank) -> Env``, called in the actor's process.
      env_rank: the rank this actor owns.
      plan: the collector's plan (batch size, for the env halves).
      policy_fn: the policy, when inference runs in the actor (``policy="actor"``).
      stamp: whether the plan keeps ``versions`` (stamped with the model version).
      value_fn: terminal inference in the actor (``policy="actor"``: the actor's copy
        of the policy side).
      layout: the collector's layout the values are shaped to.
      sched_batch: run the actor's thread, and the threads it starts from then on (the
        env's own), under Linux's ``SCHED_BATCH`` where it runs under the default
        policy, as :class:`RayRunner`'s actors do with the policy in the learner: the
        learner wakes them every chunk, and their waking then no longer preempts it (as
        an env process's: why, the price, and how an env opts out, first thing in its
        ``env_fn``: :class:`~jaxtraj.runners.bound.ProcessBoundEnv`). Ray's own threads in
        the actor, started before, keep their policy. Not for an ``EnvWorker`` made in
        the learner's own process.
    """

    def __init__(
        self,
        env_fn: Callable[[int], Env],
        env_rank: int,
        plan: TrajectoryPlan,
        policy_fn: PolicyFn | None = None,
        stamp: bool = True,
        value_fn: ValueFn | None = None,
        layout: Any = None,
        sched_batch: bool = False,
    ):
        if sched_batch:  # before env_fn: the env's own threads inherit it
            _batch_scheduling()
        self.env, self.plan = checked_env(env_fn(env_rank), f"env_worker_{env_rank}"), plan
        self.policy_fn, self.stamp = policy_fn, stamp
        self.value_fn, self.layout = value_fn, layout
        # what a row of the policy's actions must be (checked where a layout is given)
        self._action_rows = None if layout is None else action_rows(layout)
        self.obs: PyTree = None
        self.prev = None  # the last chunk's EnvTransition (chunk 0 carries its flags)
        # Reset or restored by the learner: until then a step is refused (an actor Ray
        # restarted holds a fresh env, not the one the learner's chunks came from).
        self._restored = False
        self._meter: tuple[int, CpuMeter] | None = None  # (thread, its meter)

    def _metered_step(self, key: TrajectoryKey, actions: Any) -> tuple[Any, float | None]:
        """``env.step(key, actions)`` and the share of it on CPU, by a meter of this
        process's CPU (EnvPool's threads too) kept for the thread that steps (the one Ray
        runs this actor's calls in: the meter reads its run delay)."""
        me = threading.get_ident()
        if self._meter is None or self._meter[0] != me:
            if self._meter is not None:
                self._meter[1].close()
            self._meter = (me, CpuMeter(time.process_time))
        meter = self._meter[1]
        meter.start()
        out = self.env.step(key, actions)
        return out, meter.share()

    def pid(self) -> int:
        return os.getpid()

    def sub_env_seeds(self) -> list[int] | None:
        """The seeds this actor's env gives its sub-environments, where it says
        (:func:`~jaxtraj.runners.service.sub_env_seeds`)."""
        return sub_env_seeds(self.env)

    def env_call(self, method: str, args: tuple, kwargs: dict, started: bool = False) -> Any:
        """``env.<method>(*args, **kwargs)`` here (:meth:`RayRunner.call_env`);
        ``started``: the learner reset this rank's env (an actor restarted since then
        refuses, :class:`Unrestored`: its env is not that one)."""
        if started:
            self._check_restored()
        return getattr(self.env, method)(*args, **kwargs)

    def _check_restored(self) -> None:
        if not self._restored:
            raise Unrestored(
                "this env actor was restarted (its env built afresh) and not yet restored "
                "to where the learner's chunks left it"
            )

    def reset(self) -> PyTree:
        """Reset every environment; the first observation."""
        self.obs, self.prev = self.env.reset(), None
        self._restored = True
        return self.obs

    def step(self, key: tuple, actions: Any) -> tuple[Any, EnvStep, Any, float | None]:
        """Execute chunk ``key``'s actions: ``(env half, the env's EnvStep, snapshot,
        the share of the step on CPU)``; the learner completes the half (terminal
        inference on ``EnvStep.final_obs``)."""
        self._check_restored()
        key = TrajectoryKey(*key)
        out, share = self._metered_step(key, actions)
        part = env_part(self.plan, key, out, self.prev)
        self.obs, self.prev = out.obs, out.transition
        # Only what the learner reads travels back (not per-action observations).
        step = EnvStep(out.transition, out.obs, final_obs=out.final_obs)
        return part, step, self._snapshot(), share

    def run(
        self, keys: Sequence[tuple], rngs: Sequence[Any], params: Any, version: int
    ) -> tuple[list, Any]:
        """Infer and execute chunks ``keys`` in order, sampling with ``rngs`` (each
        chunk's row keys ``[B, 2]``, :func:`~jaxtraj.runners.service.row_rngs` of its
        :func:`~jaxtraj.runners.service.key_rng`): ``([(policy half, env half)],
        snapshot)``."""
        self._check_restored()
        out = []
        bsz = self.plan.batch_size
        for k, rng in zip(keys, rngs):
            key = TrajectoryKey(*k)
            output = checked_policy_output(self.policy_fn(params, self.obs, rng), bsz,
                                           self.plan.nonfinite == "reject", self._action_rows)
            output = stamp_versions(output, version, self.stamp)
            policy = PolicyPart(TrajectorySource(key, bsz, 0), self.obs, output)
            step = self.env.step(key, output.actions)
            part = env_part(self.plan, key, step, self.prev)
            part = complete_env_part(self.plan, self.layout, part, step, self.value_fn, params)
            out.append((policy, part))
            self.obs, self.prev = step.obs, step.transition
        return out, self._snapshot()

    def _step_whole(
        self, key: TrajectoryKey, actions: Any
    ) -> tuple[None, EnvStep, Any, float | None]:
        """``transport="direct"``: execute chunk ``key``'s actions; ``(None, the env's
        EnvStep, snapshot, the share of the step on CPU)``, the env half made in the
        learner (from the same EnvStep and the previous chunk's transition, which the
        learner keeps)."""
        self._check_restored()
        out, share = self._metered_step(key, actions)
        checked_env_step(out)
        self.obs, self.prev = out.obs, out.transition
        # Not the info kept per action: no runner reads it (nor pays for its bytes).
        return None, replace(out, info=None), self._snapshot(), share

    def restore(self, snapshot: Any, prev: Any, replay: Sequence[tuple]) -> PyTree:
        """Return to a point the learner received: ``env.set_state(snapshot)``, or a
        reset and the recorded ``(key, actions)`` replayed. The observation there."""
        if snapshot is not None:
            obs = self.env.set_state(snapshot)
        else:
            obs = self.env.reset()
            for key, actions in replay:
                obs = self.env.step(TrajectoryKey(*key), actions).obs
        self.obs, self.prev = obs, prev
        self._restored = True
        return obs

    def _snapshot(self) -> Any:
        get = getattr(self.env, "get_state", None)
        return None if get is None else get()

    def serve(self, address: Any, authkey: bytes, index: int, dial_s: float = _DIAL_S) -> int:
        """``transport="direct"``: connect to the learner at ``address`` and execute its
        requests (``reset``, ``step``, ``restore``) in order, each answered ``(ok,
        value)`` (a step sent as bytes: its EnvStep as bytes, where it can be), until the
        learner closes the connection. Runs in the thread that built
        the env (the actor's), as Ray's calls do; returns the requests served. An address
        it cannot reach within ``dial_s`` raises ``ConnectionError``."""
        conn = _dial(address, authkey, index, dial_s)
        served = 0
        compact: _StepReplies | None = _StepReplies()
        try:
            while True:
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):  # the learner closed it, or is gone
                    return served
                message = None
                if data[:1] == _STEP:  # a step sent as bytes: its EnvStep whole, the env
                    # half made in the learner; as bytes too where it can be
                    _, (key, actions), _ = _request(data)
                    try:
                        value = self._step_whole(key, actions)
                    except Exception as exc:  # noqa: BLE001 (raised in the learner)
                        reply = (False, _portable(exc, traceback.format_exc()))
                    else:
                        reply = (True, value)
                        if compact is not None and value[2] is None:
                            message = compact(value[1], value[3])
                    method = "step"
                else:
                    method, args = pickle.loads(data)
                    if method == _PICKLED:  # the learner cannot read this actor's templates
                        compact = None
                        continue
                    if method not in _SERVED:
                        reply = (False, ValueError(
                            f"not a request of the direct transport: {method!r}"))
                    else:
                        try:
                            reply = (True, getattr(self, method)(*args))
                        except Exception as exc:  # noqa: BLE001 (raised in the learner)
                            reply = (False, _portable(exc, traceback.format_exc()))
                if message is None:
                    _send_reply(conn, reply, f"the learner (its {method} request)")
                else:
                    conn.send_bytes(message)
                served += 1
        finally:
            conn.close()


_SERVED = ("reset", "step", "restore", "env_call")  # what the learner asks over a direct
# connection


def _mac(key: bytes, who: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, who + nonce, hashlib.sha256).digest()


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the other side closed the connection during the handshake")
        data += chunk
    return data


def _tuned(sock: socket.socket) -> Connection:
    """A handshaken socket as a blocking :class:`~multiprocessing.connection.Connection`
    (framed messages), small messages sent at once (no Nagle), and a peer that vanishes
    (a node lost, no FIN) found by TCP keepalive within about 25 s."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux (elsewhere the system's defaults)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return Connection(sock.detach())


def _dial(address: Any, key: bytes, index: int, dial_s: float = _DIAL_S) -> Connection:
    """An actor's side of ``transport="direct"``: connect to the learner at ``address``,
    check that it holds the runner's key, prove ours, and say which rank this is. Each
    side proves the key on a nonce of the other's (HMAC-SHA256) before anything is
    unpickled."""
    try:
        sock = socket.create_connection(tuple(address), timeout=dial_s)
    except OSError as exc:
        raise ConnectionError(f"cannot reach the learner at {tuple(address)}: {exc!r}") from exc
    try:
        sock.settimeout(_HANDSHAKE_S)
        mine = secrets.token_bytes(32)
        sock.sendall(mine)
        theirs = _exactly(sock, 64)
        if not hmac.compare_digest(theirs[32:], _mac(key, b"learner", mine)):
            raise ConnectionError(f"the listener at {tuple(address)} does not hold the runner's key")
        sock.sendall(_mac(key, b"actor", theirs[:32]) + struct.pack("<i", index))
        return _tuned(sock)
    except BaseException:
        sock.close()
        raise


def _admit(sock: socket.socket, key: bytes) -> tuple[int, Connection] | None:
    """The learner's side of :func:`_dial`: ``(rank index, connection)``, or ``None`` for
    a client that does not prove the key within :data:`_HANDSHAKE_S` (closed)."""
    try:
        sock.settimeout(_HANDSHAKE_S)
        theirs = _exactly(sock, 32)
        mine = secrets.token_bytes(32)
        sock.sendall(mine + _mac(key, b"learner", theirs))
        answer = _exactly(sock, 36)
        if hmac.compare_digest(answer[:32], _mac(key, b"actor", mine)):
            return struct.unpack("<i", answer[32:])[0], _tuned(sock)
    except OSError:  # ConnectionError, a timeout
        pass
    sock.close()
    return None


@dataclass(frozen=True)
class _Failure:
    """A request that raised (in place of its result); ``env``: the environment raised
    (else its process, or the transport, failed)."""

    exc: BaseException
    env: bool = False


def _unrestored(exc: BaseException) -> bool:
    """Whether ``exc`` (as Ray raises it, or as a direct connection's answer) is an
    actor's :class:`Unrestored`."""
    return isinstance(exc, Unrestored) or isinstance(getattr(exc, "cause", None), Unrestored)


#: A request sent over a rank's direct connection (its answer comes back on it, in order).
_DIRECT = object()


_EVERY_INTERFACE = ("", "0.0.0.0", "::")  # direct_address hosts that listen on every interface


def _ray_client() -> bool:
    """Whether the learner is connected through Ray Client: off the cluster, where the
    actors seldom reach it."""
    try:
        return bool(ray.util.client.ray.is_connected())
    except Exception:  # an API that differs: not a client we know of
        return False


def _ray_tls() -> bool:
    """Whether Ray's own connections use TLS (``RAY_USE_TLS``): the direct transport's
    are authenticated, not encrypted, so ``transport="auto"`` keeps to Ray's."""
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true")


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _checked_direct_address(address: Any, transport: str) -> tuple[str | None, int]:
    """``RayRunner``'s ``direct_address``: ``(host, port)``, ``host`` a string or
    ``None``, ``port`` an int in ``[0, 65535]``; only with ``transport="direct"`` (or
    ``"auto"``, which it makes direct)."""
    if transport == "ray":
        raise ValueError(
            f"direct_address is where transport='direct' listens; transport is {transport!r}"
        )
    ok = isinstance(address, (tuple, list)) and len(address) == 2
    host, port = address if ok else (None, None)
    try:  # an integer of any kind (a NumPy one too), not a bool
        port = None if isinstance(port, bool) else operator.index(port)
    except TypeError:
        port = None
    if (not ok or not (host is None or isinstance(host, str))
            or port is None or not 0 <= port <= 65535):
        raise ValueError(
            "direct_address must be (host, port): host a string or None (the node's "
            f"address), port an int in [0, 65535] (0: one the system picks); got {address!r}"
        )
    return host, port


def _fetch(refs: list) -> list:
    """The results of ``refs`` (ready ones) in one call; a :class:`_Failure` for each
    that raised."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayError:
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                out.append(_Failure(exc))
        return out


@dataclass
class _Rank:
    """The learner's view of one env rank."""

    index: int
    rank: int
    actor: Any = None
    key_at: Callable[[int], TrajectoryKey] | None = None  # the n-th key of this run
    total: int = 0  # chunks this run
    n: int = 0  # chunks received
    sent: int = 0  # chunks requested (policy="actor")
    obs: PyTree = None
    started: bool = False
    actions: Any = None  # the chunk in flight's actions (policy="learner")
    pending: deque = field(default_factory=deque)  # (kind, ref, payload), in order
    snapshot: Any = None
    prev: Any = None
    replay: list = field(default_factory=list)  # (key, actions) since the restore point
    failures: int = 0  # failures since the last progress
    progress_at: float = 0.0  # when it last answered (or was first asked)
    ping_at: float | None = None  # when to ask a restarting actor again whether it is up
    created_at: float | None = None  # when its actor was created (None: warned, or up)
    direct: bool = False  # its chunks go on a connection of its own (else as Ray calls)
    conn: Any = None  # transport="direct": the connection to its actor, once it connected
    loop: Any = None  # transport="direct": the ref of the actor's serve call
    # transport="direct": how to read its connection's steps sent as bytes, by template
    readers: _StepReaders = field(default_factory=_StepReaders)
    # transport="direct": answers to its requests that call_env read off the connection
    # ahead of its own (in order; the loop takes them before the connection's)
    early: deque = field(default_factory=deque)
    # its actor's answer to which seeds its env gives its sub-envs, until checked
    seeds_ref: Any = None

    @property
    def name(self) -> str:
        return f"env_worker_{self.rank}"

    def key(self) -> tuple | None:
        if not self.total:
            return None
        return self.key_at(min(self.n, self.total - 1)).as_tuple()


class RayRunner:
    """Environment workers as Ray actors; policy inference in the learner (default) or
    in the actors; one consumer in the learner feeding the collector.

    Args:
      collector: the :class:`TrajectoryCollector` to feed; only the thread calling
        :meth:`run` touches it.
      env_fn: ``env_fn(env_rank) -> Env``, picklable; called in each actor's process
        with the actor's env rank (one callable for every rank, not
        :class:`~jaxtraj.runners.threads.AsyncRunner`'s list of factories).
      policy_fn: ``policy_fn(params, obs, rng) -> PolicyOutput`` for ``N`` rows, ``rng``
        ``[N, 2]`` a PRNG key per row (:data:`~jaxtraj.runners.service.PolicyFn`;
        picklable when ``policy="actor"``); the runner stamps ``versions``. In the
        learner one call serves every rank whose observation is in, ``N = max_batch *
        B`` rows (padded), as :class:`~jaxtraj.runners.threads.AsyncRunner` does; in an
        actor, ``N = B``, its own rank's chunk (as ``AsyncRunner(max_batch=1)``).
      params: the initial policy parameters (version 0).
      value_fn: ``value_fn(params, obs) -> [B]``, terminal inference on the policy side
        (picklable when ``policy="actor"``): ``final_values = value_fn(params,
        EnvStep.final_obs)`` for the chunks that need them, in the learner (or, with
        ``policy="actor"``, in the actor's copy of the policy side, with the parameters
        it was sent), so the environments need no critic. ``None``: env halves carry
        the env's own ``EnvStep.final_values`` (or none): the :mod:`jaxtraj.envs`
        adapters give none, so with them a run stops at its first chunk that needs one
        (``MISSING_FINAL_VALUES``) unless ``value_fn`` is given.
      num_steps: training steps each :meth:`run` collects.
      step_id: the first training step.
      stage_id: the stage of every key.
      env_ranks: the env ranks, one actor each; default ``range(plan.num_env_ranks)``.
      seed: base seed of :func:`~jaxtraj.runners.service.key_rng` (the row keys are
        computed in the learner, one training step at a time, also when the policy runs
        in the actors).
      policy: ``"learner"`` (Sebulba-style) or ``"actor"``. With ``"learner"`` the
        actors run under Linux's ``SCHED_BATCH`` (see :class:`EnvWorker`).
      chunks_per_call: with ``policy="actor"``, chunks per actor call (batched in one
        transfer). Default: a training step's (``num_epochs * num_chunks``), one call
        per rank and training step, the fastest measured (the parameters cannot change
        within a :meth:`run` anyway); fewer lose less to a restart.
      max_in_flight: with ``policy="actor"``, outstanding calls per actor.
      max_restarts: failures of one worker without progress in between before the run
        stops (Ray itself restarts the actors without limit).
      stall_timeout_s: kill (and so restart) a worker that has not answered a request
        for this long; ``None``: never.
      actor_options: extra ``ray.remote`` options of the env actors (``num_cpus``,
        ``resources``, ``scheduling_strategy``: where they are placed).
      on_flush: where flushed items go (as :class:`~jaxtraj.runners.threads.AsyncRunner`).
      output_queue: where flushed items go when ``on_flush`` is ``None``; with neither,
        :meth:`run` returns them.
      max_batch, batch_wait_s: with ``policy="learner"``, the most ranks one inference
        serves (default all) and how long the learner waits, after the first rank's
        observation is in, for the others' expected within the wait (0: the ranks in
        when it serves), as :class:`~jaxtraj.runners.threads.AsyncRunner`'s: the
        trajectories do not depend on the batching. ``"auto"`` (default) decides as
        ``AsyncRunner``'s does, from each actor's share of a step on CPU (its
        process's CPU time, EnvPool's threads included, over the time it could run,
        measured in the actor and sent back with the step): where the envs compute, a
        wait up to the longest of the ranks' step times, so that they fall into step
        and one inference serves them all; where they wait (a clock, I/O, a remote
        simulator), none; an env that computes in processes of its own (gymnasium's
        ``AsyncVectorEnv``) reads as waiting. On the Hopper workload with the direct
        transport, one inference a chunk instead of two (16 calls a training step
        instead of 31): 1.16x the hand loop against 1.05x with no wait.
      transport: with ``policy="learner"``, how a chunk's actions reach its actor and
        its result comes back. ``"auto"`` (default): ``"direct"``, and a rank whose
        actor cannot connect to the learner (refused, or no answer within 5 s: a
        firewall between nodes) goes over to ``"ray"``, with a warning naming it; the
        others keep their connections, and an actor made again, after :meth:`close`,
        tries again. ``"ray"`` for a learner connected through Ray Client (off the
        cluster) and where Ray's own connections use TLS (``RAY_USE_TLS``: the direct
        connections are authenticated, not encrypted). :attr:`transport` says which
        was chosen once the actors are made; :attr:`transports`, how each rank's
        chunks travel once :meth:`run` has connected them. ``"ray"``: a Ray actor
        call per chunk, through the object store.
        ``"direct"``: each actor connects back to the learner once (TCP; each side
        proves a key made per runner, HMAC-SHA256 on the other's nonce, before anything
        is unpickled; the learner listens on its node's address, or ``direct_address``,
        which the actors must be able to reach), and the chunks go both ways on that
        connection: a step's actions, and the EnvStep it returns (the env half made in
        the learner from it), as their arrays' bytes where they are numeric numpy
        arrays, else pickled (an env with ``get_state`` has its results pickled, with
        the snapshot); Ray still places, restarts and kills the actors. A round trip
        costs ~0.2 ms against Ray's ~2.6 ms on a 2-core machine, so chunks shorter than
        a few ms (fast simulators, small batches) are not bound by the transport. Faults
        are handled the same: a closed connection is a dead actor, restarted, restored
        and redoing its chunk. Asked for (or by ``direct_address``), an actor that
        cannot connect (refused, or no answer within 30 s) stops :meth:`run` with a
        :class:`RunnerError` naming its rank. The trajectories do not depend on it.
      direct_address: with ``transport="direct"`` (which it asks for with
        ``"auto"``), ``(host, port)`` the learner listens on. ``None`` (default): this
        node's address (Ray's ``get_node_ip_address``) and a port the system picks. A
        ``port`` of ``0`` lets the system pick; give one where a cluster's firewall
        opens only some ports.
        ``host`` ``None``: the node's address; ``""``, ``"0.0.0.0"`` or ``"::"``: every
        interface (IPv4 and IPv6 with ``"::"`` where the system allows), the actors
        dialing the node's address; any other (an IPv4 or IPv6 address, or a name,
        resolved on the learner's node): the address bound, which the actors must
        reach (a loopback one, other nodes cannot: a warning says so). A port in use,
        or a host that is not this node's, stops :meth:`run` before anything is
        collected, with an error naming it.
      allow_shared_seeds: let env ranks seed sub-environments alike. By default the
        first :meth:`run` waits for each actor to build its env and say which seeds it
        gives its sub-environments, and refuses ranks that share one
        (``ValueError``, before any chunk is stepped), as
        :class:`~jaxtraj.runners.threads.AsyncRunner` does: give rank ``r`` e.g.
        ``seed=1000 * r``.

    Example::

        ray.init()                                   # or RAY_ADDRESS=... for a cluster
        with RayRunner(collector, make_env, policy_fn, params, num_steps=1) as runner:
            for it in range(iterations):
                items = runner.run()                 # one training step, every rank
                params = train(params, stack_ranks(items))  # [R, E, T, B, ...]
                runner.update_policy(params)
    """

    def __init__(
        self,
        collector: TrajectoryCollector,
        env_fn: Callable[[int], Env],
        policy_fn: PolicyFn,
        params: Any,
        *,
        value_fn: ValueFn | None = None,
        num_steps: int = 1,
        step_id: int = 0,
        stage_id: int = 0,
        env_ranks: Sequence[int] | None = None,
        seed: int = 0,
        policy: str = "learner",
        chunks_per_call: int | None = None,
        max_in_flight: int = 2,
        max_restarts: int = 3,
        stall_timeout_s: float | None = None,
        actor_options: dict | None = None,
        on_flush: Callable[[str, Any], None] | None = None,
        output_queue: Any = None,
        max_batch: int | None = None,
        batch_wait_s: float | str = "auto",
        transport: str = "auto",
        direct_address: tuple[str | None, int] | None = None,
        allow_shared_seeds: bool = False,
    ):
        if policy not in ("learner", "actor"):
            raise ValueError(f"policy must be 'learner' or 'actor', got {policy!r}")
        if transport not in ("auto", "ray", "direct"):
            raise ValueError(
                f"transport must be 'auto', 'ray' or 'direct', got {transport!r}"
            )
        if direct_address is not None:
            direct_address = _checked_direct_address(direct_address, transport)
            transport = "direct"  # an address to listen on: the direct transport asked
        if transport == "direct" and policy != "learner":
            raise ValueError(
                "transport='direct' (asked for, or by a direct_address) carries the chunks "
                "of policy='learner' (with policy='actor' the actors' results go through "
                "Ray, several chunks a call)"
            )
        if transport == "auto" and policy == "actor":
            transport = "ray"  # the actors' results go through Ray, several chunks a call
        # "auto": direct, a rank whose actor cannot reach the learner falling back to Ray's
        self._fallback = transport == "auto"
        if chunks_per_call is None:  # a training step's chunks per call
            chunks_per_call = collector.plan.num_epochs * collector.plan.num_chunks
        if chunks_per_call < 1 or max_in_flight < 1:
            raise ValueError(
                f"chunks_per_call and max_in_flight must be >= 1, got "
                f"{chunks_per_call}, {max_in_flight}"
            )
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        batch_wait_s = checked_batch_wait(batch_wait_s, auto=True)
        self.collector, self.plan = collector, collector.plan
        self.env_fn, self.policy_fn, self.policy = env_fn, policy_fn, policy
        self.value_fn = value_fn
        ranks = range(self.plan.num_env_ranks) if env_ranks is None else env_ranks
        self.env_ranks = [int(r) for r in ranks]
        check_env_ranks(collector, self.env_ranks, stage_id)
        if not callable(env_fn):
            raise TypeError(
                f"env_fn must be one callable, env_fn(env_rank) -> Env, called in each actor "
                f"with its rank; got {type(env_fn).__name__} (a list of factories is "
                "AsyncRunner's: give RayRunner e.g. lambda rank: factories[rank])"
            )
        self.num_steps, self.step_id, self.stage_id = checked_num_steps(num_steps), step_id, stage_id
        self.seed, self.on_flush, self.output_queue = seed, on_flush, output_queue
        self.chunks_per_call, self.max_in_flight = chunks_per_call, max_in_flight
        self.max_restarts, self.stall_timeout_s = max_restarts, stall_timeout_s
        self.actor_options = dict(actor_options or {})
        n_ranks = len(self.env_ranks)
        self.max_batch = n_ranks if max_batch is None else min(max_batch, n_ranks)
        self._slots, self.batch_wait_s = self.max_batch, batch_wait_s
        # When each rank's observation is expected, and how CPU-bound its steps are
        # (batch_wait_s="auto"), across runs.
        self._due = _Due(n_ranks)
        self._ready: list[_Rank] = []  # ranks whose next chunk waits for inference
        self._ready_at: float | None = None
        self.calls = 0  # policy_fn calls in the learner, last run
        self._params, self._version = params, 0
        self._params_ref: tuple[int, Any] | None = None  # (version, object ref)
        self._lock = threading.Lock()
        self._stamp = collector.layout.policy.output.versions is not None
        self._action_spec = action_spec(collector.layout)
        self._action_rows = action_rows(collector.layout)
        self._obs_check = ObservationCheck(collector)
        self._ranks = [_Rank(i, r) for i, r in enumerate(self.env_ranks)]
        self._consumer = Consumer(collector, on_flush, output_queue)
        self._draining = False
        self._one_run = RunGuard()  # a run() inside a run is refused
        self._close_asked = False  # close() called during a run: the run stops, then closes
        self._replay_warned = False
        self.restarts = 0  # worker restarts handled over this runner's life
        self.transport, self.direct_address = transport, direct_address
        self.allow_shared_seeds = allow_shared_seeds
        self._seeds: dict[int, list[int] | None] = {}  # rank: its sub-envs' seeds (built)
        self._listener: socket.socket | None = None  # transport="direct": where actors dial
        self._address: tuple | None = None  # the address the actors are given
        self._connected: queue.Queue = queue.Queue()  # (rank index, connection) admitted
        self._liveness_at = 0.0  # when to ask Ray next whether connected actors live

    # -- public ----------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The model version stamped on new chunks."""
        return self._version

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

    def update_policy(self, params: Any) -> int:
        """Swap in new parameters (thread-safe, also during :meth:`run`); returns the new
        version. Chunks requested after the call use them and carry the new version
        (with ``policy="actor"``: broadcast once to every actor through the object
        store, with their next call)."""
        with self._lock:
            self._params, self._version = params, self._version + 1
            return self._version

    def keys(self, env_rank: int) -> list[TrajectoryKey]:
        """The keys env rank ``env_rank`` produces in the next :meth:`run`, in order."""
        return chunk_keys(self.plan, env_rank, self.step_id, self.num_steps, self.stage_id)

    def actors(self) -> list[Any]:
        """The env actors' handles (started on first use), in ``env_ranks`` order.

        With the direct transport an actor serves its connection from the first
        :meth:`run` until :meth:`close`, and runs one call at a time: a call of your own
        made to it meanwhile (between runs, from an ``on_flush``) waits for
        :meth:`close`. Reach its env with :meth:`call_env`."""
        self._start()
        return [w.actor for w in self._ranks]

    def call_env(self, env_rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """``env.<method>(*args, **kwargs)`` on env rank ``env_rank``'s env, in its actor
        (in the thread that built it): its result, or what it raised, raised here.

        Call it from the thread that calls :meth:`run` (an ``on_flush``: served between
        the rank's chunks) or between runs. With the direct transport it goes on the
        rank's connection, which its actor serves from the first run until
        :meth:`close` (a Ray call of your own to the actor meanwhile would wait for
        :meth:`close`); a rank still connecting is waited for; else it is a Ray call.

        Raises:
          ValueError: no such env rank here.
          RuntimeError: the rank's actor is being restarted (call again later), or its
            connection broke (the run restarts it).
        """
        try:
            w = self._ranks[self.env_ranks.index(int(env_rank))]
        except ValueError:
            raise ValueError(
                f"env rank {env_rank} is not one of this runner's: {self.env_ranks}"
            ) from None
        self._start()
        if w.direct and w.conn is None and w.pending and w.pending[0][0] != "connect":
            raise RuntimeError(  # waiting for a ping, or for Ray's word on a lost one
                f"{w.name}'s actor is being restarted: call_env again once it is back"
            )
        deadline = time.monotonic() + _DIAL_S
        while w.direct and w.conn is None and w.pending:  # connecting: its serve call
            # holds the actor; its connection may be in (the run's loop takes it so)
            self._accept()
            if w.conn is not None:
                break
            done, _ = ray.wait([w.pending[0][1]], timeout=_CONNECT_POLL_S)
            if done:  # its serve call ended (it could not connect): the actor is free
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{w.name}'s actor did not connect within {_DIAL_S:.0f} s")
        request = (method, args, kwargs, w.started)
        if not (w.direct and w.conn is not None):  # not serving a connection: a Ray call
            ref = w.actor.env_call.remote(*request)
            try:  # (an actor starting, its env building, is not stalled)
                return ray.get(ref, timeout=self.stall_timeout_s if w.started else None)
            except ray.exceptions.GetTimeoutError:
                self._stalled_call(w, method)
            except Exception as exc:
                if _unrestored(exc):
                    raise RuntimeError(
                        f"{w.name}'s actor was restarted (its process died; Ray built its env "
                        "afresh): the run restores it, call_env again after the next run() "
                        "or from its on_flush"
                    ) from exc
                raise
        try:
            # The answers to the requests in flight come first: read, kept for the run.
            for _ in range(sum(p[1] is _DIRECT for p in w.pending) - len(w.early)):
                w.early.append(self._recv_call(w, method))
            w.conn.send_bytes(_dumps(("env_call", request)))
            data = self._recv_call(w, method)
        except (EOFError, OSError) as exc:  # the run's loop restarts the rank
            raise RuntimeError(f"{w.name}'s connection to its actor broke: {exc!r}") from exc
        ok, value = pickle.loads(data)
        if not ok:
            raise value
        return value

    def _recv_call(self, w: _Rank, method: str) -> bytes:
        """The next answer on rank ``w``'s connection, for :meth:`call_env`: within
        ``stall_timeout_s``, where set."""
        stall = self.stall_timeout_s if w.started else None  # (not while its env resets)
        if stall is not None and not w.conn.poll(stall):
            self._stalled_call(w, method)
        return w.conn.recv_bytes()

    def _stalled_call(self, w: _Rank, method: str) -> None:
        """Rank ``w``'s actor did not answer :meth:`call_env` within ``stall_timeout_s``:
        killed (Ray restarts it; a run restores it), and the call raises."""
        ray.kill(w.actor, no_restart=False)
        raise RuntimeError(
            f"{w.name} did not answer call_env({method!r}) within stall_timeout_s="
            f"{self.stall_timeout_s} s (its env hung, or a step in flight did): its actor "
            "was killed, and Ray restarts it (the run restores it)"
        )

    @property
    def transports(self) -> dict[int, str]:
        """How each env rank's chunks travel, by env rank: ``"direct"`` or ``"ray"``
        (with ``transport="auto"``, a rank whose actor could not connect to the learner
        went over to ``"ray"``: known once :meth:`run` has tried); before the actors
        are made, :attr:`transport`."""
        return {
            w.rank: self.transport if w.actor is None else "direct" if w.direct else "ray"
            for w in self._ranks
        }

    def close(self) -> None:
        """Shut every env actor down (Ray does not restart them). Called during a
        :meth:`run` (from ``on_flush``, or another thread), it stops the run, which
        raises :class:`RunnerError` and then shuts them down; a run whose chunks are all
        in by then ends as usual (its items returned or delivered), then shuts them
        down."""
        with self._one_run.lock:
            if self._one_run.running:
                self._close_asked = True
                return
        for w in self._ranks:
            if w.conn is not None:
                w.conn.close()
                w.conn = None
            if w.actor is not None:
                try:
                    ray.kill(w.actor, no_restart=True)
                except Exception:  # already gone
                    pass
            w.actor, w.started, w.pending, w.ping_at = None, False, deque(), None
            w.obs, w.snapshot, w.prev, w.replay, w.loop = None, None, None, [], None
            w.early, w.readers, w.actions, w.seeds_ref = deque(), _StepReaders(), None, None
        self._seeds = {}  # the next actors are asked afresh
        if self._listener is not None:
            self._unlisten()

    def __enter__(self) -> RayRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, num_steps: int | None = None) -> list[tuple[str, Any]]:
        """Collect ``num_steps`` training steps (default: the constructor's) from every env
        rank; block until done.

        Environments continue from where the previous :meth:`run` left them, and the
        next :meth:`run` collects the following steps.

        Returns:
          The flushed ``(queue_key, item)`` pairs when neither ``on_flush`` nor
          ``output_queue`` is given, else ``[]``.

        Raises:
          RunnerError: a worker failed for good, or the collector rejected a half;
            every actor is shut down first; what was collected stays in the collector,
            or, flushed, on the error's ``undelivered`` (the items this call would have
            returned).
        """
        n = self.num_steps if num_steps is None else checked_num_steps(num_steps)
        try:
            with self._one_run:
                self._close_asked = False
                return self._run(n)
        finally:
            if self._close_asked:  # close() was called during the run: done now
                self.close()

    def _run(self, n: int) -> list[tuple[str, Any]]:
        check_run_start(self.collector, self.env_ranks, self.stage_id, self.step_id, n)
        self._run_steps = n
        self._start()
        try:
            self._check_seeds()
        except BaseException:  # refused (or interrupted): the actors shut down
            self.close()
            raise
        self._consumer = consumer = Consumer(self.collector, self.on_flush, self.output_queue,
                                             lambda: self._draining)
        # Row keys one training step at a time (memory does not grow with n); keys by
        # index, no list of them.
        self._rngs = StepRngs(self.plan, self.seed, self.env_ranks, self.stage_id)
        self._ready, self._ready_at, self.calls = [], None, 0
        # Env halves received, completed and inserted once the ranks ready are served
        # (off the path to the actions): (rank, env half, its EnvStep).
        self._behind: deque = deque()
        self._due.new_run()  # no step in flight; what the steps took carries on
        for w in self._ranks:
            w.key_at = self._keyer(w.rank)
            w.total, w.n, w.sent, w.failures = n * self.plan.num_epochs * self.plan.num_chunks, 0, 0, 0
        try:
            for w in self._ranks:
                w.progress_at = time.monotonic()
                self._submit(w)
            stall_at = time.monotonic()
            while any(w.n < w.total for w in self._ranks):
                if self._close_asked:
                    raise RunnerError("runner", None, RuntimeError(
                        "close() was called during run(): the run stopped, its actors shut "
                        "down; what was collected is in the collector, or, flushed, on this "
                        "error's undelivered"), consumer.delivered)
                now = time.monotonic()
                self._warn_unstarted(now)
                for w in self._ranks:
                    if w.ping_at is not None and now >= w.ping_at:
                        w.ping_at = None
                        w.pending.append(("ping", w.actor.pid.remote(), None))
                self._accept()
                self._serve_ready()
                self._catch_up()
                heads = {w.pending[0][1]: w for w in self._ranks
                         if w.pending and w.pending[0][1] is not _DIRECT}
                direct = {w.conn: w for w in self._ranks
                          if w.pending and w.pending[0][1] is _DIRECT}
                refs = list(heads)
                wait_s = _POLL_S
                if self._ready_at is not None:  # ranks wait for a batched inference
                    wait_s = max(0.0, min(wait_s, self._ready_at + self._wait() - now))
                if any(w.pending and w.pending[0][0] == "connect" for w in self._ranks):
                    wait_s = min(wait_s, _CONNECT_POLL_S)  # an actor connecting: look again soon
                for w in [w for w in direct.values() if w.early]:  # read by call_env
                    self._receive_direct(w)
                    wait_s = 0.0
                if direct:
                    # Answers on the direct connections; Ray's refs (a rank starting or
                    # restarting) looked at in between.
                    for conn in wait_connections(list(direct), 0.0 if refs else wait_s):
                        self._receive_direct(direct[conn])
                    wait_s = 0.0
                if refs:  # every head that is ready, fetched in one call; else wait for one
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                    if not ready and wait_s > 0:
                        ready, _ = ray.wait(refs, num_returns=1, timeout=wait_s)
                    for ref, result in zip(ready, _fetch(ready)):
                        self._receive(heads[ref], result)
                elif not direct:
                    time.sleep(wait_s)
                if self.stall_timeout_s is not None and time.monotonic() > stall_at:
                    stall_at = time.monotonic() + min(self.stall_timeout_s / 4, 1.0)
                    self._kill_stalled()
                if self._listener is not None:
                    self._check_connected()
            self._catch_up()
            self._check_complete()
        except BaseException as exc:  # KeyboardInterrupt included
            try:
                if not isinstance(exc, KeyboardInterrupt):
                    self._drain()
                else:  # the env halves already received are collected all the same
                    self._catch_up_quietly()
            finally:  # the actors shut down even if an on_flush interrupts the drain too
                self.close()
                # With what the drain could not deliver, the items run() would have
                # returned (flushed: out of the collector), on the error and the runner.
                delivered, unhanded = consumer.failed_run()
            if isinstance(exc, KeyboardInterrupt):
                raise
            if isinstance(exc, RunnerError):
                raise RunnerError(exc.worker, exc.key, exc.cause, delivered, unhanded,
                                  exc.what) from exc.cause
            raise RunnerError("consumer", None, exc, delivered, unhanded) from exc
        self.step_id += n
        return rank_order(consumer.kept)

    # -- actors ----------------------------------------------------------------------

    def _start(self) -> None:
        todo = [w for w in self._ranks if w.actor is None]
        if not todo:
            return
        # Ray restarts a dead actor without limit; the runner bounds failures without
        # progress (max_restarts) and shuts the actor down when it gives up.
        cls = ray.remote(EnvWorker).options(
            max_restarts=-1, max_task_retries=0, **self.actor_options
        )
        actor = self.policy == "actor"
        policy_fn = self.policy_fn if actor else None
        value_fn = self.value_fn if actor else None
        layout = self.collector.layout if actor else None
        self._check_placement(len(todo))
        if self.transport == "auto":  # decided once, when the first actors are made
            self.transport = "ray" if _ray_client() or _ray_tls() else "direct"
        direct = self.transport == "direct"
        if direct and self._listener is None:
            try:
                self._listen()
            except OSError as exc:
                if not self._fallback:
                    raise
                warnings.warn(
                    f"RayRunner: the learner cannot listen for the actors ({exc}): these "
                    "actors' chunks go as Ray calls", RuntimeWarning, stacklevel=3,
                )
                direct = False  # (actors made again after close() try again)
        for w in todo:
            w.direct = direct
            w.actor = cls.remote(
                self.env_fn, w.rank, self.plan, policy_fn, self._stamp, value_fn, layout,
                sched_batch=not actor,  # the learner wakes it every chunk
            )
        made = time.monotonic()  # one time for the actors made together: named in one warning
        for w in todo:
            w.created_at = made
        for w in todo:  # each actor's first call, answered once built (checked in run())
            w.seeds_ref = w.actor.sub_env_seeds.remote()

    def _check_seeds(self) -> None:
        """Refuse ranks whose sub-environments share a seed (as the threaded runners do),
        asked of the actors made since the last check (:meth:`_start`) before any chunk
        of the run is requested: the run waits for them to be built (a slow start warned
        about as the run's loop does). An actor that fails to build its env says
        nothing here: the run's first request to it fails, naming its rank."""
        asked = [w for w in self._ranks if w.seeds_ref is not None]
        if self.allow_shared_seeds:
            for w in asked:
                w.seeds_ref = None
            return
        pending = [w.seeds_ref for w in asked]
        while pending:
            if self._close_asked:  # from another thread (actors Ray cannot place, say)
                raise RunnerError("runner", None, RuntimeError(
                    "close() was called during run(), while it waited for the env actors "
                    "to start: the run stopped before any chunk, its actors shut down"))
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            if pending:
                self._warn_unstarted(time.monotonic())
        for w in asked:
            try:
                self._seeds[w.rank] = ray.get(w.seeds_ref)
            except Exception:  # noqa: BLE001  (reported by the run, naming the rank)
                self._seeds[w.rank] = None
            w.seeds_ref = None
        ranks = [r for r in self.env_ranks if r in self._seeds]
        check_seeds([self._seeds[r] for r in ranks], ranks)

    def _check_placement(self, count: int) -> None:
        """Warn when ``count`` new actors can never all be placed on the cluster as it
        is: Ray would leave the rest pending, and :meth:`run` would wait for them (a
        cluster that is only busy gets the warning of :data:`START_WARN_S`)."""
        each = self.actor_options.get("num_cpus", 1)  # Ray places an actor on 1 CPU by default
        if not each:
            return
        # An actor given num_cpus holds them while it lives; by default it holds none
        # once placed, so the actors then need one CPU at a time.
        need = each * count if "num_cpus" in self.actor_options else each
        total = ray.cluster_resources().get("CPU", 0.0)
        if need > total + 1e-9:
            warnings.warn(
                f"RayRunner: {count} env actors (env ranks {[w.rank for w in self._ranks]}) "
                f"need {need:g} CPUs to be placed (num_cpus={each:g} each), and the cluster "
                f"has {total:g}: Ray leaves the rest pending until it grows, and run() waits "
                "for them. Lower actor_options' num_cpus, or give Ray more CPUs.",
                RuntimeWarning, stacklevel=4,
            )

    def _warn_unstarted(self, now: float) -> None:
        late = [w for w in self._ranks
                if not w.started and w.created_at is not None and now - w.created_at > START_WARN_S]
        if late:
            for w in late:
                w.created_at = None  # once per actor
            warnings.warn(
                f"RayRunner: the actors of env ranks {[w.rank for w in late]} have not "
                f"answered {START_WARN_S:g} s after they were created. Ray may be unable to "
                f"place them: {ray.available_resources().get('CPU', 0.0):g} CPUs free of "
                f"{ray.cluster_resources().get('CPU', 0.0):g}, actor_options="
                f"{self.actor_options!r} (actors of runners not closed hold their CPUs).",
                RuntimeWarning, stacklevel=3,
            )

    def _params_for_actors(self) -> tuple[Any, int]:
        with self._lock:
            params, version = self._params, self._version
        if self._params_ref is None or self._params_ref[0] != version:
            self._params_ref = (version, ray.put(params))  # one broadcast per version
        return self._params_ref[1], version

    def _submit(self, w: _Rank) -> None:
        """Request what rank ``w`` does next (nothing while a request is outstanding,
        with the policy in the learner)."""
        if self._draining:
            return
        if not w.started:
            if not w.pending:
                if w.direct:
                    self._connect(w)  # then the reset, on the connection
                else:
                    w.pending.append(("reset", w.actor.reset.remote(), None))
            return
        if self.policy == "learner":
            if not w.pending and w.n < w.total and w not in self._ready:
                self._ready.append(w)  # its observation is in: inferred with the others
                if self._ready_at is None:  # (served by run's loop once every result
                    self._ready_at = time.monotonic()  # fetched with it is in)
            return
        ref = None
        while len(w.pending) < self.max_in_flight and w.sent < w.total:
            keys = [w.key_at(i) for i in range(w.sent, min(w.sent + self.chunks_per_call, w.total))]
            ref = ref or self._params_for_actors()
            rngs = [self._rngs(k) for k in keys]
            batch = [k.as_tuple() for k in keys]
            w.pending.append(("run", w.actor.run.remote(batch, rngs, ref[0], ref[1]), batch))
            w.sent += len(batch)

    def _keyer(self, rank: int) -> Callable[[int], TrajectoryKey]:
        """The ``n``-th key env rank ``rank`` produces in this run."""
        T, E, step0, stage = self.plan.num_chunks, self.plan.num_epochs, self.step_id, self.stage_id

        def key_at(n: int) -> TrajectoryKey:
            s, rest = divmod(n, E * T)
            return TrajectoryKey(step0 + s, rest // T, rank, stage, rest % T)

        return key_at

    def _wait(self) -> float:
        """How long an inference waits for other ranks: ``batch_wait_s``, or with
        ``"auto"`` what the ranks' steps say (:meth:`~jaxtraj.runners.service._Due.auto_wait`)."""
        return self._due.auto_wait() if self.batch_wait_s == "auto" else self.batch_wait_s

    def _serve_ready(self) -> None:
        """With the policy in the learner: one inference for the ranks whose observation
        is in, once ``max_batch`` of them are, or no other rank can join (done,
        restarting, or not expected back within the wait), or ``batch_wait_s`` has
        passed since the first."""
        if not self._ready or self._draining:
            return
        deadline = self._ready_at + self._wait()
        waiting = [  # a restarting rank (pinged, or being restored) is not waited for
            w for w in self._ranks if w not in self._ready and w.n < w.total and w.pending
            and (w.pending[-1][0] in ("step", "reset") or w.pending[-1][0] == "connect"
                 and not w.started)  # a first connection, not a restart's
            and self._due.by(w.index, deadline)
        ]
        late = time.monotonic() >= deadline
        if len(self._ready) < self._slots and waiting and not late:
            return
        batch = sorted(self._ready[: self._slots], key=lambda w: w.index)
        self._ready = self._ready[self._slots :]
        self._ready_at = time.monotonic() if self._ready else None
        self._infer(batch)

    def _infer(self, batch: list[_Rank]) -> None:
        """One policy inference in the learner for the next chunk of every rank in
        ``batch`` (rows joined and padded to ``max_batch * B``, a key per row); each
        rank's actions go to its actor, then its policy half to the collector."""
        bsz = self.plan.batch_size
        keys = [w.key_at(w.n) for w in batch]
        with self._lock:
            params, version = self._params, self._version
        try:
            obs, rng = join_rows([w.obs for w in batch], [self._rngs(k) for k in keys],
                                 self._slots)
            output = checked_policy_output(self.policy_fn(params, obs, rng),
                                           self._slots * bsz, self.plan.nonfinite == "reject",
                                           self._action_rows)
            # The actors step while the rest of the output is made into policy halves.
            actions = sendable_actions(output, self._action_spec, self._slots)
        except Exception as exc:
            raise RunnerError("policy_worker", keys[0].as_tuple(), exc, self.delivered) from exc
        if actions is not None:
            for j, (w, key) in enumerate(zip(batch, keys)):
                self._step(w, key, actions[j * bsz : (j + 1) * bsz])
        try:
            output = stamp_versions(output, version, self._stamp)
            parts = []
            for w, key, own in zip(batch, keys, split_rows(output, len(batch), bsz)):
                part = PolicyPart(TrajectorySource(key, bsz, 0), w.obs, own)
                self.collector.check_structure(part)
                parts.append(part)
        except Exception as exc:
            raise RunnerError("policy_worker", keys[0].as_tuple(), exc, self.delivered) from exc
        self.calls += 1
        if actions is None:  # checked first
            for w, key, part in zip(batch, keys, parts):  # the actors step while we insert
                self._step(w, key, part.output.actions)
        self._consumer.consume_all([("policy_worker", part) for part in parts])

    def _step(self, w: _Rank, key: TrajectoryKey, actions: Any) -> None:
        """Rank ``w``'s actor executes chunk ``key``'s ``actions`` (kept for a restart's
        replay)."""
        w.actions = actions
        self._call(w, "step", (key.as_tuple(), actions), key)
        self._due.started(w.index, time.monotonic())

    def _receive(self, w: _Rank, result: Any) -> None:
        """Handle the result of rank ``w``'s oldest request (a :class:`_Failure` if it
        raised)."""
        kind, _, payload = w.pending.popleft()
        w.progress_at = time.monotonic()
        if kind == "connect" and not isinstance(result, _Failure):  # its serve call ended
            result = _Failure(ConnectionError(  # before it connected
                f"{w.name}'s actor ended its serve call ({result!r}) without connecting to "
                f"the learner at {self._address}"))
        if kind == "lost" and not isinstance(result, _Failure):  # the serve call returned:
            result = _Failure(payload)  # the connection broke, the actor lives (restart it)
        if kind == "lost" and not isinstance(result.exc, ray.exceptions.RayTaskError):
            self._restart(w, result.exc)  # it died (Ray's word), or the connection broke
            return
        if isinstance(result, _Failure):
            exc = result.exc
            if _unrestored(exc):  # Ray restarted the actor while nothing was in flight to
                self._restart(w, exc)  # it: its env is a fresh one, restored first
                return
            if result.env or isinstance(exc, ray.exceptions.RayTaskError):  # the env raised
                cause = getattr(exc, "cause", None) or exc
                # its dial failed (an OSError: refused, timed out, not the runner's key)
                if kind == "connect" and self._fallback and isinstance(cause, OSError):
                    if not self._draining:  # (a run that fails: nothing to go on with)
                        self._fall_back(w, cause)
                    return
                if kind in ("connect", "lost"):  # its serve call raised (not the env)
                    cause = ConnectionError(
                        f"{w.name}'s actor did not connect to the learner, or its connection "
                        f"failed (transport='direct'; its node must reach the learner's "
                        f"address, else use transport='ray'): {type(cause).__name__}: {cause}"
                    )
                # Its requests behind this one run from the state before it (policy="actor":
                # the next chunks' runs): nothing of them is collected (the drain skips it).
                w.pending.clear()
                raise RunnerError(w.name, w.key(), cause, self.delivered) from exc
            if kind == "ping" and isinstance(exc, ray.exceptions.ActorUnavailableError):
                w.ping_at = time.monotonic() + _RETRY_S  # still restarting: ask again soon
                return
            self._restart(w, exc)  # the process died, or its result was lost
            return
        if kind == "reset":
            w.obs, w.started = result, True
            w.snapshot, w.prev, w.replay = None, None, []
            self._checked_obs(w, result)
        elif kind == "ping":  # the restarted actor is up: back to the restore point
            self._redo(w)
            return
        elif kind == "restore":  # the actor is back at the learner's restore point
            if payload:  # its chunk's step was left for now (transport="direct")
                self._step_again(w)
                return
            if w.pending and w.pending[0][0] == "step":  # asked with the restore: its
                self._due.started(w.index, time.monotonic())  # time starts now
        elif kind == "step":
            self._due.back(w.index, time.monotonic())
            part, out, snapshot, share = result
            self._due.cpu(w.index, share)
            if part is None:  # transport="direct": the env half is made here
                try:
                    part = env_part(self.plan, payload, out, w.prev)
                except Exception as exc:
                    raise RunnerError(w.name, payload.as_tuple(), exc, self.delivered) from exc
            obs = out.obs
            self._checked_obs(w, obs)  # before the policy sees it
            self._behind.append((w, part, out))  # completed and inserted after the serving
            self._advance(w, [(payload.as_tuple(), w.actions)], part.transition, snapshot)
            # Done: a restart from here redoes no step (its next chunk's actions are
            # not inferred yet)
            w.obs, w.actions = obs, None
        else:  # "run"
            pairs, snapshot = result
            for policy, _ in pairs:
                self._checked_obs(w, policy.obs)
            done = [(p.source.key.as_tuple(), np.array(p.output.actions)) for p, _ in pairs]
            try:
                self._consumer.consume_all([(self._worker(w, p), p) for pair in pairs for p in pair])
            finally:  # (a flushed item not delivered: the halves are in all the same)
                self._advance(w, done, pairs[-1][1].transition, snapshot)
        self._submit(w)

    def _catch_up(self) -> None:
        """The env halves received: terminal inference in the learner (with the current
        parameters), then inserted, in the order they came back. Left until the ranks
        whose observation is in are served, so that a chunk's insert does not hold up
        its rank's next actions."""
        while self._behind:
            w, part, out = self._behind.popleft()
            with self._lock:
                params = self._params
            try:
                part = complete_env_part(
                    self.plan, self.collector.layout, part, out, self.value_fn, params
                )
            except Exception as exc:
                raise RunnerError("policy_worker", part.source.key.as_tuple(), exc,
                                  self.delivered) from exc
            self._insert(w, part)

    def _advance(self, w: _Rank, done: list, prev: Any, snapshot: Any) -> None:
        """Rank ``w`` received ``done``: move its restore point there."""
        w.n += len(done)
        # Copies: a view into a received object would pin all of it in the object store.
        w.prev, w.snapshot = jax.tree.map(np.array, prev), snapshot
        if snapshot is not None:
            w.replay = []
        else:  # (appended in place: copying it every chunk cost its length each time)
            w.replay.extend(done)
            if len(w.replay) >= REPLAY_WARN and not self._replay_warned:
                self._replay_warned = True
                warnings.warn(
                    f"RayRunner: {w.name}'s env has no get_state(), so a restart of its "
                    f"actor replays every chunk since its reset: {REPLAY_WARN} chunks' "
                    "actions are kept and would be replayed, more each chunk. Give the env "
                    "get_state() / set_state(snapshot) (restored in one call, nothing kept)",
                    RuntimeWarning, stacklevel=2,
                )
        w.failures = 0  # "keeps failing": failures without progress in between

    def _worker(self, w: _Rank, part: Any) -> str:
        """Who made ``part`` of rank ``w``: the learner's policy worker or the rank."""
        return "policy_worker" if isinstance(part, PolicyPart) and self.policy == "learner" else w.name

    def _insert(self, w: _Rank, part: Any) -> None:
        self._consumer.consume(self._worker(w, part), part)

    def _checked_obs(self, w: _Rank, obs: PyTree) -> None:
        try:
            self._obs_check(obs, w.key_at(min(w.n, w.total - 1)))
        except CollectorError as exc:
            raise RunnerError(w.name, w.key(), exc, self.delivered) from exc

    def _restart(self, w: _Rank, exc: BaseException) -> None:
        """Rank ``w``'s actor died: Ray restarts it (requests fail while it restarts, so
        the runner pings it until it answers); then it is restored to the last point
        received and redoes what was in flight."""
        w.failures += 1
        if self._draining or w.failures > self.max_restarts:
            raise RunnerError(w.name, w.key(), exc, self.delivered) from exc
        self.restarts += 1
        self._unready(w)
        if w.conn is not None:
            w.conn.close()
            w.conn = None
        w.pending.clear()  # later requests went to the dead process: redo them too
        w.early.clear()
        w.sent = w.n
        w.pending.append(("ping", w.actor.pid.remote(), None))

    def _unready(self, w: _Rank) -> None:
        """Rank ``w`` no longer waits for an inference (its actor is restarting)."""
        if w in self._ready:
            self._ready.remove(w)
            if not self._ready:
                self._ready_at = None

    def _redo(self, w: _Rank) -> None:
        if w.direct and w.conn is None:
            self._connect(w)  # the restarted actor connects; then this again
            return
        if w.started:
            replay = [(k, a) for k, a in w.replay]
            again = self.policy == "learner" and w.n < w.total and w.actions is not None
            # Over a connection the chunk's step is asked once the restore is answered:
            # asked at once, a large answer (camera observations) and a large step
            # (long chunks) could each wait for the other to be read, neither side reading.
            later = again and w.direct
            if not self._call(w, "restore", (w.snapshot, w.prev, replay), later):
                return  # the connection broke at once: restarting again
            if again:
                if not later:
                    self._step_again(w)
                return
        self._submit(w)

    def _step_again(self, w: _Rank) -> None:
        """Rank ``w``, restored, executes its chunk's actions again (the chunk's policy
        half is in); not while the run drains after a failure."""
        if self._draining:
            return
        key = w.key_at(w.n)
        if self._call(w, "step", (key.as_tuple(), w.actions), key):
            self._due.started(w.index, time.monotonic())

    # -- transport="direct" -----------------------------------------------------------

    def _call(self, w: _Rank, method: str, args: tuple, payload: Any = None) -> bool:
        """Ask rank ``w``'s actor to run ``method(*args)``: on its direct connection, or
        as a Ray call; its answer is the next in ``w.pending`` after those before. False:
        the connection broke (the rank is being restarted, nothing was asked)."""
        if not w.direct:
            w.pending.append((method, getattr(w.actor, method).remote(*args), payload))
            return True
        message = None
        if method == "step":  # as bytes where the actions are a numeric array (payload:
            # the chunk's key)
            message = _step_request(method, (payload, args[1]), {})
        try:
            w.conn.send_bytes(message or _dumps((method, args)))
        except OSError as exc:  # its process is gone (the answer would not come)
            self._lost(w, exc)
            return False
        w.pending.append((method, _DIRECT, payload))
        return True

    def _listen(self) -> None:
        """Listen for the actors on ``direct_address``, by default this node's address
        and a port the system picks (a random key per runner): a
        thread accepts, and each connection is admitted (:func:`_admit`) in a thread of
        its own, so a client that never speaks holds up no one (:meth:`_unlisten` ends
        them)."""
        node = ray.util.get_node_ip_address()
        host, port = self.direct_address or (None, 0)
        bind = node if host is None else host
        every = bind in _EVERY_INTERFACE
        try:
            listener = socket.create_server(
                (bind, port),
                family=socket.AF_INET6 if ":" in bind else socket.AF_INET,
                backlog=64,
                dualstack_ipv6=bind == "::" and socket.has_dualstack_ipv6(),
            )
        except OSError as exc:  # socket.gaierror too: a host that does not resolve
            why = ("the port is in use: give another (0: one the system picks)"
                   if exc.errno == errno.EADDRINUSE else
                   f"is {bind!r} an address of this node, the port one it may use?")
            raise OSError(
                exc.errno,
                f"transport='direct': the learner cannot listen on {(bind, port)} "
                f"(direct_address={self.direct_address!r}): {exc.strerror or exc}; {why} "
                "Or use transport='ray'.",
            ) from exc
        self._authkey = secrets.token_bytes(32)
        self._listener = listener
        listener.settimeout(_ACCEPT_POLL_S)
        # Where the actors dial: the node's address when listening on every interface,
        # else the address bound (a host name resolved here, as the learner's node does).
        where = listener.getsockname()
        self._address = (node if every else where[0], where[1])
        if not every and _loopback(where[0]) and not _loopback(node):
            warnings.warn(
                f"transport='direct': the learner listens on {where[0]} (direct_address="
                f"{self.direct_address!r}), a loopback address: actors on other nodes "
                f"cannot reach it (this node's address is {node})",
                stacklevel=3,
            )
        # A queue per listener: a handshake that ends after close() reaches no later run.
        self._connected = admitted = queue.Queue()
        key, stop = self._authkey, threading.Event()
        self._accepting = stop

        def admit(sock: socket.socket) -> None:
            found = _admit(sock, key)
            if found is not None:
                admitted.put(found)

        def accept() -> None:
            while not stop.is_set():
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError:  # out of descriptors, a reset: not a reason to spin
                    time.sleep(_ACCEPT_POLL_S)
                    continue
                threading.Thread(target=admit, args=(sock,), daemon=True).start()

        self._acceptor = threading.Thread(target=accept, name="jaxtraj-ray-accept", daemon=True)
        self._acceptor.start()

    def _unlisten(self) -> None:
        """Stop listening (the accept thread sees it within :data:`_ACCEPT_POLL_S`);
        connections admitted but not taken are closed."""
        listener, self._listener = self._listener, None
        self._accepting.set()
        self._acceptor.join(timeout=2 * _ACCEPT_POLL_S + 1.0)
        listener.close()
        while not self._connected.empty():  # connections that came too late
            self._connected.get_nowait()[1].close()

    def _connect(self, w: _Rank) -> None:
        """Have rank ``w``'s actor connect (its serve call), answered in :meth:`_accept`."""
        dial_s = _AUTO_DIAL_S if self._fallback else _DIAL_S
        w.loop = w.actor.serve.remote(self._address, self._authkey, w.index, dial_s)
        w.pending.append(("connect", w.loop, None))

    def _accept(self) -> None:
        """The connections that came in: each rank waiting for its own goes on (a reset,
        or a restore and the chunk it was doing); any other is closed."""
        while True:
            try:
                index, conn = self._connected.get_nowait()
            except queue.Empty:
                return
            w = self._ranks[index] if 0 <= index < len(self._ranks) else None
            if w is None or not w.pending or w.pending[0][0] != "connect" or w.conn is not None:
                conn.close()  # not expected (an actor of a failed attempt, a closed run)
                continue
            w.pending.popleft()
            w.conn, w.progress_at = conn, time.monotonic()
            w.readers = _StepReaders()  # a new connection numbers its templates afresh
            if w.started:
                self._redo(w)
            else:
                self._call(w, "reset", ())

    def _receive_direct(self, w: _Rank) -> None:
        """The answer to rank ``w``'s oldest request, from its connection (or read off
        it already by :meth:`call_env`)."""
        try:
            data = w.early.popleft() if w.early else w.conn.recv_bytes()
        except (EOFError, OSError) as exc:  # the actor's process is gone
            self._lost(w, exc)
            return
        tag = data[:1]
        if tag == _RAW:  # a step's EnvStep as bytes
            try:
                out = w.readers.read(data)
            except Exception as exc:  # noqa: BLE001 (a template this side lacks, a reply
                # cut short: named, not a crash)
                raise RunnerError(w.name, w.key(), exc, self.delivered) from exc
            (share,) = struct.unpack_from("<d", data, 8)  # NaN: not measured
            self._receive(w, (None, out, None, None if share != share else share))
            return
        try:
            if tag == _TEMPLATE:
                ok, value, share = pickle.loads(memoryview(data)[2:])
            else:
                ok, value = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 (e.g. a class the learner cannot import)
            kind = w.pending[0][0]
            raise RunnerError(w.name, w.key(), TypeError(
                f"the actor's answer to {kind} cannot be read in the learner: "
                f"{type(exc).__name__}: {exc}"), self.delivered) from exc
        if tag == _TEMPLATE:  # a step's EnvStep, and how to read the next of its kind
            if not w.readers.learn(data, value):
                try:  # every reply pickled from now on
                    w.conn.send_bytes(_dumps((_PICKLED, ())))
                except OSError:  # the connection broke: the next receive says so
                    pass
            value = (None, value, None, share)
        self._receive(w, value if ok else _Failure(value, env=True))

    def _lost(self, w: _Rank, exc: BaseException) -> None:
        """Rank ``w``'s connection broke. What follows waits for Ray's word on its serve
        call (without holding up the other ranks): the actor died (Ray's error, the
        cause), or lives (restarted all the same); no word within
        :data:`_CONNECT_WAIT_S`: a restart, the broken connection the cause."""
        w.conn.close()
        w.conn = None
        w.pending.clear()
        w.early.clear()
        self._unready(w)  # not inferred for while it restarts (its redo asks again)
        broke = ConnectionError(f"{w.name}'s connection to its actor broke: {exc!r}")
        if w.loop is None:
            self._restart(w, broke)
            return
        w.pending.append(("lost", w.loop, broke))
        w.progress_at = time.monotonic()

    def _fall_back(self, w: _Rank, cause: BaseException) -> None:
        """``transport="auto"``: rank ``w``'s actor could not reach the learner (its serve
        call raised): its chunks go as Ray calls from now on (until its actor is made
        again, after :meth:`close`), the others' stay on their connections."""
        w.direct, w.loop = False, None
        warnings.warn(
            f"RayRunner: {w.name}'s actor cannot reach the learner at {self._address} "
            f"({type(cause).__name__}: {cause}); its chunks go as Ray calls (about ten "
            "times the round trip of a direct connection). Open that address's port to "
            "the actors' nodes (direct_address=(None, port) sets the port, and asks for "
            "transport='direct': an actor that still cannot connect then stops the run), "
            "or ask for transport='ray' to not try.",
            RuntimeWarning, stacklevel=4,
        )
        if not any(r.direct for r in self._ranks):
            self._unlisten()
        self._redo(w)  # its reset, or its restore and its chunk, as Ray calls

    def _check_connected(self) -> None:
        """Ranks whose connection broke and Ray has not said why within
        :data:`_CONNECT_WAIT_S` are restarted; once a second, connected actors Ray says
        are gone (a node lost without a word on the connection) are too."""
        now = time.monotonic()
        for w in self._ranks:
            if w.pending and w.pending[0][0] == "lost" and now - w.progress_at > _CONNECT_WAIT_S:
                self._restart(w, w.pending[0][2])
        if now < self._liveness_at:
            return
        self._liveness_at = now + _LIVENESS_S
        serving = {w.loop: w for w in self._ranks if w.conn is not None and w.loop is not None}
        if serving:
            ended, _ = ray.wait(list(serving), num_returns=len(serving), timeout=0)
            for ref in ended:  # its serve call ended while connected: the actor is gone
                self._lost(serving[ref], ConnectionError("Ray reports its serve call ended"))

    def _kill_stalled(self) -> None:
        """Kill every actor that has a chunk outstanding and has not answered for
        ``stall_timeout_s``: Ray restarts it, the request fails, the chunk is redone."""
        now = time.monotonic()
        for w in self._ranks:
            # Not while the actor starts or restarts (reset, ping): that takes seconds.
            working = w.pending and w.pending[0][0] in ("step", "run", "restore")
            if w.actor is not None and working and now - w.progress_at > self.stall_timeout_s:
                w.progress_at = now  # once per timeout
                ray.kill(w.actor, no_restart=False)

    def _check_complete(self) -> None:
        """Nothing lost: every half of the steps just collected reached the collector."""
        end = self.step_id + self._run_steps
        ours = {(w.rank, self.stage_id) for w in self._ranks}
        lost = [
            (k, half)
            for k, half, _ in self.collector.missing()
            if k[0] < end and (k[2], k[3]) in ours
        ]
        if lost:
            key, half = lost[0]
            cause = CollectorError(key, ErrorCode.SOURCE_TIMEOUT, f"{len(lost)} halves lost")
            raise RunnerError(f"env_worker_{key[2]}", key, cause, self.delivered)

    def _drain(self, in_flight_s: float = 10.0) -> None:
        """After a failure: insert the results that already came back, in order, and
        those of the chunks the actors are executing as they come (for up to
        ``in_flight_s`` in all, as the threaded runners join their workers), so that a
        chunk an env executed keeps its env half."""
        self._draining = True
        try:
            self._catch_up_quietly()
            deadline = time.monotonic() + in_flight_s
            for w in self._ranks:
                while w.pending:
                    kind, head = w.pending[0][0], w.pending[0][1]
                    # a chunk executing is waited for; anything else only taken if it is in
                    left = max(0.0, deadline - time.monotonic()) if kind in ("step", "run") else 0.0
                    try:
                        if head is _DIRECT:  # (answers call_env read ahead are in too)
                            if not w.early and (w.conn is None or not w.conn.poll(left)):
                                break
                            self._receive_direct(w)
                            continue
                        ready, _ = ray.wait([head], timeout=left)
                        if not ready:
                            break
                        self._receive(w, _fetch(ready)[0])
                    except RunnerError as exc:  # a flushed item not delivered: its half is in,
                        if exc.delivery:  # the next may go on
                            continue
                        break  # the first failure is the one reported
                    except Exception:  # noqa: BLE001
                        break
            self._catch_up_quietly()
            self._consumer.insert_held()
        finally:  # (an on_flush may interrupt it: the next run submits again)
            self._draining = False

    def _catch_up_quietly(self) -> None:
        """:meth:`_catch_up` after a failure: a half that fails is left out (the first
        failure is the one reported), the others are inserted."""
        while self._behind:
            try:
                self._catch_up()
            except Exception:  # noqa: BLE001
                pass
