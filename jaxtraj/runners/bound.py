"""Environments built, and always stepped, in one thread, or one process, of their own.

Simulators bind state to the thread that creates them: MuJoCo's OpenGL context (GLX, EGL,
OSMesa) is current only in the thread that made it, so a camera rendered from another
thread comes out black (every pixel zero), silently. A runner given a *factory* (a
callable that builds the env) instead of an env wraps it in :class:`ThreadBoundEnv`: the
factory runs in a dedicated thread, and every call the runner makes (``reset``,
``step``, ``spec``, ``check_against``, ``close``) is executed in that thread, whichever
worker thread of whichever ``run()`` makes it. The thread runners run a rank's whole
worker loop in that thread (:meth:`ThreadBoundEnv.job`), so a chunk's step is a direct
call there; a call from any other thread is handed over, one queue round trip each.

:class:`ProcessBoundEnv` does the same in a process of its own (``env_workers="process"``
of the host runners): a simulator stepped in Python holds the GIL, and threads of one
process take turns at it, so CPU-bound Python environments only run in parallel with
inference, and with each other, in processes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import multiprocessing
import os
import pickle
import queue
import signal
import struct
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxtraj.runners.service import EnvStep, sub_env_seeds
from jaxtraj.types import TrajectoryKey

_STOP = object()


def is_factory(env: Any) -> bool:
    """A callable that is not itself an environment (no ``step``), or an env class (its
    ``step`` unbound): an env factory."""
    return callable(env) and (isinstance(env, type) or not callable(getattr(env, "step", None)))


def checked_env(env: Any, name: str, built: bool = False) -> Any:
    """``env`` (a factory's, or given ``built``), refused (``TypeError`` naming ``name``
    and what to do) where it is no runner env: it has no ``reset()`` / ``step()``, or it
    is a gymnasium or EnvPool env not wrapped in its adapter (its ``step(action)`` steps
    once, with no chunk key: its ``(obs, info)`` would be refused at the first
    observation, naming neither)."""
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        got, fix = ("was given", "give") if built else ("the env factory returned", "return")
        raise TypeError(
            f"{name}: {got} {type(env).__name__}, not an environment "
            f"(it has no {' or '.join(missing)}()): {fix} an env such as "
            "jaxtraj.envs.GymnasiumEnv(...)"
        )
    origins = {c.__module__.split(".")[0] for c in type(env).__mro__}
    library = next((lib for lib in ("envpool", "gymnasium", "gym") if lib in origins), None)
    # An EnvPool pool (step(action, env_id=None)), or a gymnasium env: step(action), where
    # a runner env's is step(key, actions).
    if library == "envpool" or (library is not None and _positional(env.step) < 2):
        adapter = "EnvPoolEnv" if library == "envpool" else "GymnasiumEnv"
        raise TypeError(
            f"{name}: got {_LIBRARIES[library]} env ({type(env).__name__}), whose "
            f"step(action) steps once: wrap it in jaxtraj.envs.{adapter}(..., "
            f"actions_per_chunk=K) (or build it with jaxtraj.envs.{adapter}.make(...)), "
            "which steps K actions a chunk"
        )
    return env


_LIBRARIES = {"envpool": "an EnvPool", "gymnasium": "a gymnasium", "gym": "a gym"}


def _positional(fn: Any) -> int:
    """How many positional arguments ``fn`` takes (many, where it takes ``*args`` or
    cannot say)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


class _Bound:
    """What both bound envs forward: the env protocol's calls, executed by ``call``
    where the env lives.

    Attributes:
      cpu_share: the share of its last call's time the env spent on CPU, in ``[0, 1]``:
        its process's CPU time (every thread of it: EnvPool's own included) or
        (:class:`ThreadBoundEnv`) its thread's, over the call's wall time less the time
        the calling thread waited for a CPU (Linux's scheduler statistics, where
        readable): about 1 for a simulator that computes, however short of CPUs the
        machine is, near 0 for one that waits (a clock, a robot, I/O). ``None`` before
        a call. The runners' ``batch_wait_s="auto"`` reads it.
    """

    cpu_share: float | None = None

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def reset(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("reset", *args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("step", *args, **kwargs)

    def spec(self) -> Any:
        return self.call("spec")

    def render(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("render", *args, **kwargs)


class ThreadBoundEnv(_Bound):
    """An environment built by ``factory()`` in a thread of its own; every method call is
    executed there, the env's own methods too (``env.render()``, ``env.my_method(x)``:
    the call is handed to the env's thread and its result handed back). Attributes that
    are not methods (``num_envs``, ``seed``, ...) read the env's own, in the caller's
    thread.

    Args:
      factory: builds the environment (``reset()``, ``step(key, actions)``; the
        :mod:`jaxtraj.envs` adapters).
      name: names the thread (``jaxtraj-<name>``) and errors.

    Raises:
      TypeError: the factory returned something that is not an environment.
      Exception: whatever the factory raised, as it raised it.
    """

    def __init__(self, factory: Callable[[], Any], name: str = "env"):
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        # While a job runs in the env's thread, calls from other threads go to the job's
        # inbox, which it serves between its own steps (see job()).
        self._inbox: Any = None
        self._lock = threading.Lock()
        self._closed = False  # set (under _lock) before close() queues _STOP
        ready: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._serve, args=(factory, ready), name=f"jaxtraj-{name}", daemon=True
        )
        self._thread.start()
        ok, value = ready.get()
        if not ok:
            self._thread.join()
            raise value
        self._env = value

    def _serve(self, factory: Callable[[], Any], ready: queue.SimpleQueue) -> None:
        try:
            env = checked_env(factory(), self.name)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            ready.put((False, exc))
            return
        ready.put((True, env))
        meter = CpuMeter(time.thread_time)
        while True:
            item = self._calls.get()
            if item is _STOP:
                meter.close()
                return
            self.serve(item, meter)

    @staticmethod
    def serve(item: EnvCall, meter: CpuMeter | None = None) -> None:
        """Execute a call handed over from another thread, here (the env's thread), and
        reply: its result, or the exception it raised (raised in the caller's thread)."""
        fn, args, kwargs, reply = item
        if meter is not None:
            meter.start()
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 (raised in the caller's thread)
            reply.put((False, exc, None))
            return
        reply.put((True, value, None if meter is None else meter.share()))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``env.<method>(*args, **kwargs)``, executed in the env's thread: directly where
        the caller is that thread (a job's, see :meth:`job`), else handed over (to the
        running job, which serves it between its steps, or to the thread itself)."""
        if threading.current_thread() is self._thread:
            return getattr(self._env, method)(*args, **kwargs)
        return self._hand_over(method, args, kwargs)

    def _hand_over(self, method: str, args: tuple, kwargs: dict, closing: bool = False) -> Any:
        reply: queue.SimpleQueue = queue.SimpleQueue()
        item = EnvCall(getattr(self._env, method), args, kwargs, reply)
        with self._lock:  # nothing is queued behind _STOP: close() sets _closed first
            if (self._closed and not closing) or not self._thread.is_alive():
                raise RuntimeError(f"{self.name}: the env's thread has ended (closed)")
            (self._calls if self._inbox is None else self._inbox).put(item)
        ok, value, share = reply.get()
        if not ok:
            raise value
        self.cpu_share = share
        return value

    def local(self) -> Any:
        """The env itself, called from its own thread (a job's); else this wrapper."""
        return self._env if threading.current_thread() is self._thread else self

    def job(self, fn: Callable[..., Any], *args: Any, inbox: Any, name: str | None = None
            ) -> _Job:
        """``fn(*args)`` to run in the env's thread, not waiting for it: a runner's env
        worker loop, whose steps are then direct calls where the env was built (no
        hand-off a chunk). The job reads as a thread: ``start()``, ``join(timeout)``,
        ``is_alive()``, ``name``. ``fn`` handles its own errors (the runners' guard
        records them).

        While it runs, a call from another thread (``env.render()`` from an ``on_flush``)
        is put on ``inbox`` (a queue ``fn`` reads anyway, e.g. for its actions) as an
        :class:`EnvCall`: ``fn`` passes what it reads of that type to :meth:`serve`, and
        serves ``inbox`` while it waits for anything else. What is left there when ``fn``
        returns is served then."""
        return _Job(self, fn, args, name or f"jaxtraj-{self.name}", inbox)

    def alive(self) -> bool:
        """Whether the env's thread still serves calls (not closed)."""
        return not self._closed and self._thread.is_alive()

    def check_against(self, example: Any) -> None:
        check = getattr(self._env, "check_against", None)
        if check is not None:
            self.call("check_against", example)

    def close(self) -> None:
        """Close the env (in its thread) and end the thread. During a run, the rank's loop
        serves the close between chunks and then fails the run, naming the rank."""
        with self._lock:
            first, self._closed = not self._closed, True
        try:
            if first and self._thread.is_alive() and callable(getattr(self._env, "close", None)):
                if threading.current_thread() is self._thread:
                    self._env.close()
                else:
                    self._hand_over("close", (), {}, closing=True)
        finally:
            self._calls.put(_STOP)
            if threading.current_thread() is not self._thread:
                self._thread.join()

    def sub_env_seeds(self) -> list[int] | None:
        """The seeds the env gives its sub-environments (its attributes, read here)."""
        return sub_env_seeds(self._env)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._env, name)
        if callable(value):  # a method: executed in the env's thread, as reset and step
            return functools.partial(self.call, name)
        return value


class EnvCall(NamedTuple):
    """A call to a :class:`ThreadBoundEnv`'s env from another thread, handed to the env's
    thread: ``fn(*args, **kwargs)``, its outcome put on ``reply``."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    reply: Any


class _Job:
    """Work handed to a :class:`ThreadBoundEnv`'s thread without waiting for it (see
    :meth:`ThreadBoundEnv.job`); joined like a thread."""

    def __init__(self, env: ThreadBoundEnv, fn: Callable[..., Any], args: tuple, name: str,
                 inbox: Any):
        self.env, self.fn, self.args, self.name, self.inbox = env, fn, args, name, inbox
        self._done = threading.Event()
        self._started = False

    def _run(self) -> None:
        env = self.env
        try:
            self.fn(*self.args)
        finally:
            with env._lock:
                env._inbox = None  # calls from now on go to the env's thread itself
            while True:  # the calls handed to the job that it left: served now
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if type(item) is EnvCall:
                    env.serve(item)
            self._done.set()

    def start(self) -> None:
        env = self.env
        self._started = True
        with env._lock:  # from now on calls from other threads go to the job's inbox
            if not env._closed and env._thread.is_alive():
                env._inbox = self.inbox
                env._calls.put((self._run, (), {}, _DISCARD))  # ahead of any _STOP
                return
        # Closed meanwhile: fn runs in a thread of its own, where the env's calls fail.
        threading.Thread(target=self._plain, name=self.name, daemon=True).start()

    def _plain(self) -> None:
        try:
            self.fn(*self.args)
        finally:
            self._done.set()

    def join(self, timeout: float | None = None) -> None:
        if self._started:
            self._done.wait(timeout)

    def is_alive(self) -> bool:
        return self._started and not self._done.is_set()


class _Discard:
    """A reply queue that keeps nothing (a job's: it reports through itself)."""

    def put(self, item: Any) -> None:
        pass


_DISCARD = _Discard()


# --------------------------------------------------------------------------- processes


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# -- the wire -------------------------------------------------------------------------
#
# A call and its reply cross the pipe pickled. A chunk's step, the hot path (a round trip
# a chunk), crosses compact where it holds numeric arrays only: the request as its key's
# ints, the actions' dtype and shape, then their bytes (``_STEP``); the reply as the bytes
# of its EnvStep's arrays (``_RAW``), once one pickled EnvStep of the same structure,
# dtypes and shapes (``_TEMPLATE``) has told the parent how to read them. Unpickling an
# array costs ~10 us, reading one from bytes ~2. A pickled message starts with pickle's
# PROTO opcode (``b"\x80"``), never with one of these tags. What differs from pickling:
# every array arrives as its own C-ordered, writable array (the same array twice, once),
# and dicts in JAX's order of their keys. What JAX cannot flatten (keys of mixed types)
# or a template cannot carry is pickled; so is every reply after a template the parent
# reads as another tree (a node registered in the env's process only).
_STEP, _TEMPLATE, _RAW = b"S", b"T", b"R"
_PICKLED = "__pickled__"  # the parent's request that every reply be pickled (none answers it)
_NUMERIC = frozenset("biufc")  # dtype kinds that cross as bytes
_FIELDS = tuple(f.name for f in dataclasses.fields(EnvStep))
_ALIGN = 16  # each array's bytes start at a multiple of it (after a 16-byte head)


def _layout(leaves: list) -> tuple | None:
    """``(dtype, shape, first)`` per leaf, ``first`` the index of the earliest leaf that
    is the same array (its bytes cross once, and it arrives as one array, as pickled);
    ``None`` where a leaf is not a numeric numpy array."""
    seen: dict[int, int] = {}
    out = []
    for j, leaf in enumerate(leaves):
        if type(leaf) is not np.ndarray or leaf.dtype.kind not in _NUMERIC:
            return None
        out.append((leaf.dtype.str, leaf.shape, seen.setdefault(id(leaf), j)))
    return tuple(out)


def _step_request(method: str, args: tuple, kwargs: dict) -> bytes | None:
    """``step(key, actions)`` as a ``_STEP`` message, where the actions are a numeric
    numpy array; else ``None`` (pickled)."""
    if method != "step" or kwargs or len(args) != 2:
        return None
    key, actions = args
    if type(key) is not TrajectoryKey or type(actions) is not np.ndarray:
        return None
    fields = key.fields()
    if actions.dtype.kind not in _NUMERIC or any(type(v) is not int for v in fields):
        return None  # (a key of arrays crosses as it is, pickled)
    head = _dumps((fields, actions.dtype.str, actions.shape))
    return b"".join((_STEP, struct.pack("<I", len(head)), head, actions.tobytes()))


def _message(method: str, args: tuple, kwargs: dict) -> bytes:
    """A call's request: compact for a step of numeric actions, else pickled."""
    return _step_request(method, args, kwargs) or _dumps((method, _host(args), _host(kwargs)))


def _request(message: bytes) -> tuple[Any, tuple, dict]:
    """``(method, args, kwargs)`` of a request (in the env's process)."""
    if message[:1] != _STEP:
        return pickle.loads(message)
    (n,) = struct.unpack_from("<I", message, 1)
    fields, dtype, shape = pickle.loads(message[5 : 5 + n])
    # A copy: an array of its own, writable (the message's bytes are not).
    actions = np.frombuffer(message, dtype, offset=5 + n).reshape(shape).copy()
    return "step", (TrajectoryKey(*fields), actions), {}


class _StepReplies:
    """The env's process's side of a step's reply: ``_RAW`` where the parent has the
    template of its structure, dtypes and shapes (and which arrays are the same: the
    final observation is the observation but where an episode ended); ``_TEMPLATE``
    (pickled, numbered) where it has not; ``None`` (pickled as any reply) where it is not
    an EnvStep of numeric arrays, or cannot be sent so: what JAX cannot flatten or
    compare, a template that does not pickle)."""

    most = 32  # templates kept (both sides): past it the numbering starts again

    def __init__(self) -> None:
        # (treedef, its text, layout) -> its template's number. The text: keys that are
        # equal but not the same (1 and True) make equal treedefs, not equal texts.
        self.sent: dict[tuple, int] = {}

    def __call__(self, value: Any, share: float | None) -> bytes | None:
        if type(value) is not EnvStep:
            return None
        try:
            return self._compact(value, share)
        except Exception:  # noqa: BLE001 (pickled as any reply, which says what is wrong)
            return None

    def _compact(self, value: EnvStep, share: float | None) -> bytes | None:
        leaves, treedef = jax.tree.flatten(tuple(getattr(value, f) for f in _FIELDS))
        layout = _layout(leaves)
        if layout is None:
            return None
        signature = (treedef, str(treedef), layout)
        number = self.sent.get(signature)
        if number is None:
            if len(self.sent) == self.most:
                self.sent.clear()  # the parent's are overwritten as they are sent again
            number = len(self.sent)
            message = _TEMPLATE + bytes((number,)) + _dumps((True, value, share))
            self.sent[signature] = number
            return message
        # 16 bytes: the tag, the template's number, 6 bytes of padding, the CPU share
        parts = [struct.pack("<cB6xd", _RAW, number, float("nan") if share is None else share)]
        for j, leaf in enumerate(leaves):
            if layout[j][2] == j:
                data = leaf.tobytes()
                parts += (data, bytes(-len(data) % _ALIGN))
        return b"".join(parts)


class _StepReaders:
    """The parent's side of one connection: its templates, by number, and how to read a
    ``_RAW`` reply with them."""

    def __init__(self) -> None:
        self.by_number: dict[int, _StepReader] = {}

    def learn(self, message: bytes, template: EnvStep) -> bool:
        """Keep a ``_TEMPLATE`` reply's template. False where its tree reads as another
        one here (a node registered in the other process only): the caller asks the other
        side to pickle every reply from then on."""
        try:
            self.by_number[message[1]] = _StepReader(template)
        except Exception:  # noqa: BLE001
            return False
        return True

    def read(self, message: bytes) -> EnvStep:
        """The EnvStep of a ``_RAW`` reply.

        Raises:
          RuntimeError: it names a template this side does not have.
        """
        reader = self.by_number.get(message[1])
        if reader is None:
            raise RuntimeError(
                f"a step's result names template {message[1]}, which this side does not "
                "have (its template could not be read)"
            )
        return reader(message)


class _StepReader:
    """How to read a ``_RAW`` reply of one template."""

    def __init__(self, template: EnvStep):
        leaves, self.treedef = jax.tree.flatten(tuple(getattr(template, f) for f in _FIELDS))
        self.leaves = []  # (dtype, shape, first, offset, count)
        offset = 16
        for j, (dtype, shape, first) in enumerate(_layout(leaves)):
            dtype, count = np.dtype(dtype), int(np.prod(shape, dtype=np.int64))
            self.leaves.append((dtype, shape, first, offset, count))
            if first == j:
                size = count * dtype.itemsize
                offset += size + (-size % _ALIGN)

    def __call__(self, message: bytes) -> EnvStep:
        leaves: list = []
        for j, (dtype, shape, first, offset, count) in enumerate(self.leaves):
            if first != j:
                leaves.append(leaves[first])
            else:  # a copy: an array of its own (a view would keep the whole reply alive),
                # writable
                leaves.append(np.frombuffer(message, dtype, count, offset).reshape(shape).copy())
        return EnvStep(*jax.tree.unflatten(self.treedef, leaves))


class CpuMeter:
    """The share of a call's time on CPU, measured in the thread that makes the call:
    ``cpu_clock`` (``time.thread_time``: this thread's; ``time.process_time``: every
    thread of the process) over the call's wall time less the time this thread waited
    for a CPU (the run delay of Linux's ``/proc/thread-self/schedstat``; elsewhere none
    is taken out), clipped to ``[0, 1]``. Time waiting for a CPU is not time the env
    waited on its own account: a computing env on a machine short of CPUs still reads
    about 1. Used by one thread (the file is that thread's); ``close`` when done."""

    def __init__(self, cpu_clock: Callable[[], float]):
        self.cpu_clock = cpu_clock
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None
        self.start()

    def _delay(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1]) * 1e-9
        except (OSError, ValueError, IndexError):
            return 0.0

    def start(self) -> None:
        """A call starts."""
        self._cpu, self._wall, self._waited = self.cpu_clock(), time.perf_counter(), self._delay()

    def share(self) -> float | None:
        """The share since :meth:`start` (``None`` for a call too short to time)."""
        ran = time.perf_counter() - self._wall - (self._delay() - self._waited)
        if ran <= 0:
            return None
        return min(1.0, max(0.0, (self.cpu_clock() - self._cpu) / ran))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # one dropped unclosed (an EnvWorker in this process)
        try:
            self.close()
        except Exception:  # noqa: BLE001 (at interpreter exit, os may be gone)
            pass


def _host(tree: Any) -> Any:
    """Device arrays (``jax.Array``) in call arguments as numpy: what crosses to the
    env's process is host data, and the process need not start a JAX backend."""
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def _portable(exc: BaseException, tb: str) -> BaseException:
    """An exception the parent can unpickle, with the child's traceback as a note:
    ``exc`` itself where it round-trips, else a ``RuntimeError`` naming its type."""
    try:
        pickle.loads(_dumps(exc))
    except Exception:  # noqa: BLE001 (its type's constructor does not take its args)
        exc = RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
    exc.add_note(f"in the env's process:\n{tb.rstrip()}")
    return exc


def _send_reply(conn: Any, reply: tuple, to: str) -> None:
    """Send ``reply`` ``(ok, value, *more)`` on ``conn``; a value that does not pickle
    goes as a ``TypeError`` saying so (``to``: whom it was for), ``more`` as ``None``."""
    try:
        conn.send_bytes(_dumps(reply))
    except Exception as exc:  # noqa: BLE001 (the value does not pickle)
        err = TypeError(
            f"the env's reply ({type(reply[1]).__name__}) cannot be sent to {to}: "
            f"{type(exc).__name__}: {exc}"
        )
        conn.send_bytes(_dumps((False, err, *[None] * (len(reply) - 2))))


def _batch_scheduling() -> None:
    """Run the calling thread, and the threads it starts from now on, under Linux's
    ``SCHED_BATCH`` (why: :class:`ProcessBoundEnv`), where it runs under the default
    policy: a real-time or idle policy it inherited is kept. Nothing where the platform
    has no such policy or refuses it."""
    policy = getattr(os, "SCHED_BATCH", None)
    setter = getattr(os, "sched_setscheduler", None)
    if policy is None or setter is None:
        return
    try:
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            setter(0, policy, os.sched_param(0))
    except OSError:
        pass


def _env_process(conn: Any, payload: bytes, name: str) -> None:
    """The env's process: build it, then execute calls until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Before the factory: the env's own threads (EnvPool's) inherit it. A factory that
    # wants the default policy back sets it (os.sched_setscheduler(0, os.SCHED_OTHER, ...)).
    _batch_scheduling()

    def reply(ok: bool, value: Any, share: float | None = None) -> None:
        _send_reply(conn, (ok, value, share), f"the runner's process ({name})")

    try:
        env = checked_env(pickle.loads(payload)(), name)
    except BaseException as exc:  # noqa: BLE001 (handed to the parent)
        reply(False, _portable(exc, traceback.format_exc()))
        return
    reply(True, None)
    meter = CpuMeter(time.process_time)  # every thread of the env's process (EnvPool's)
    compact = _StepReplies()
    while True:
        try:
            method, args, kwargs = _request(conn.recv_bytes())
        except EOFError:  # the parent has gone
            return
        if method == _PICKLED:  # the parent cannot read this process's templates
            compact = None
            continue
        if method is None:  # stop: close the env, say so, and exit without teardown
            try:
                close = getattr(env, "close", None)
                if callable(close):
                    close()
            except BaseException as exc:  # noqa: BLE001 (reported, then the exit)
                reply(False, _portable(exc, traceback.format_exc()))
            else:
                reply(True, None)
            conn.close()
            os._exit(0)  # the env is closed; an interpreter's teardown (JAX's) takes seconds
        meter.start()
        try:
            if method == "__getattr__":
                value = getattr(env, args[0])
                # A method is called remotely (a proxy), never shipped with its env.
                value = _Callable if callable(value) else value
            elif method == "sub_env_seeds":
                value = sub_env_seeds(env)
            else:
                value = getattr(env, method)(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 (raised in the parent)
            reply(False, _portable(exc, traceback.format_exc()))
            continue
        share = meter.share()
        message = compact(value, share) if method == "step" and compact is not None else None
        if message is None:
            reply(True, value, share)
        else:
            conn.send_bytes(message)


class _Callable:
    """Marker: the attribute asked for is a method of the env (called remotely)."""


class _ProcessEnded(RuntimeError):
    """The env's process ended (its pipe closed) instead of answering."""


class ProcessBoundEnv(_Bound):
    """An environment built by ``factory()`` in a process of its own; every method call
    is executed there, its arguments and result pickled across a pipe (a chunk's step,
    where it holds numeric arrays, as their bytes: see ``_step_request``).

    What a simulator whose step is Python holding the GIL (gymnasium's MuJoCo
    environments: about 40% of a Hopper step) needs to run in parallel with inference
    and with the other ranks: threads of one process take turns at the GIL. A call
    costs a pipe round trip and the pickling of its arguments and result (a chunk of
    ``K`` steps is one call: the chunk's actions in, its :class:`EnvStep` out; those
    cross as their arrays' bytes where they are numeric numpy arrays, about half the
    pickling's cost).

    On Linux the process's thread runs under ``SCHED_BATCH`` where it would run under the
    default policy (an inherited real-time or idle policy is kept), set before the factory
    is called so that the threads the env starts (EnvPool's) inherit it: the same nice
    level and share of the CPUs, but its wake-up, as the runner's thread sends it a
    chunk's actions, no longer preempts that thread, which goes on serving the other
    ranks (on 2 cores, gymnasium Hopper in 2 env processes: the two sends of a chunk took
    0.33 ms of the runner's thread under the default policy, 0.04 ms under
    ``SCHED_BATCH``). The price: woken while every CPU is busy, the env waits for the
    running thread's turn to end (a few ms at most) instead of taking its CPU. An env
    whose own timing matters (a robot's control loop, woken by its hardware on time) sets
    another policy first thing in its factory, before it builds anything:
    ``os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))``, or a real-time one.

    The process is started with ``multiprocessing``'s ``spawn`` method (forking a
    process that runs JAX's threads is unsafe): the factory must be picklable (a
    module-level function, a class instance, a ``functools.partial`` of them; lambdas
    and closures where ``cloudpickle`` is installed), and a script that builds runners
    with process workers must guard its entry point with ``if __name__ == "__main__":``
    (the process imports the script's module).

    Args:
      factory: builds the environment (``reset()``, ``step(key, actions)``) in the
        env's process.
      name: names the process (``jaxtraj-<name>``) and errors.
      context: the ``multiprocessing`` start method.
      wait: wait for the env to be built (else :meth:`wait_built` does, before the
        first call).

    Raises:
      TypeError: the factory cannot be pickled, or returned something that is not an
        environment.
      Exception: whatever the factory raised, with the process's traceback as a note.
      RuntimeError: (from any call) the env's process has ended.
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        name: str = "env",
        context: str = "spawn",
        wait: bool = True,
    ):
        self.name = name
        payload = self._pickle_factory(factory)
        ctx = multiprocessing.get_context(context)
        self._conn, child = ctx.Pipe(duplex=True)
        self._lock = threading.Lock()
        self._sent = 0  # send()s whose reply is still in the pipe
        # Replies of send()s that a call() read first (outcome tuples), for receive()
        self._early: collections.deque = collections.deque()
        self._process = ctx.Process(
            target=_env_process, args=(child, payload, name), name=f"jaxtraj-{name}",
            daemon=True,
        )
        self._process.start()
        child.close()  # the child's end lives in the child: its exit closes the pipe
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._conn, self._process)
        self._built = False
        self._readers = _StepReaders()  # how to read a step's compact result
        if wait:
            self.wait_built()

    def wait_built(self) -> None:
        """Wait until the factory has built the env in its process (``wait=False``
        starts the process and returns at once: several envs build in parallel).

        Raises:
          TypeError, Exception: what the build raised (the process has ended).
        """
        if self._built:
            return
        with self._lock:
            if self._built:
                return
            try:
                self._receive()
            except BaseException as exc:
                self._closed = True
                self._finalizer()
                if isinstance(exc, _ProcessEnded):  # before it could answer
                    raise RuntimeError(
                        f"{exc} before its env was built: its output above says why. A "
                        "script that starts env processes must guard its entry point with "
                        "`if __name__ == \"__main__\":` (the process imports the script's "
                        "module, multiprocessing's spawn)"
                    ) from None
                raise
            self._built = True

    def _pickle_factory(self, factory: Callable[[], Any]) -> bytes:
        try:
            return _dumps(factory)
        except Exception as exc:  # noqa: BLE001 (retried with cloudpickle, else explained)
            try:
                import cloudpickle
            except ImportError:
                cloudpickle = None
            if cloudpickle is not None:
                try:
                    return cloudpickle.dumps(factory)
                except Exception:  # noqa: BLE001
                    pass
            raise TypeError(
                f"{self.name}: the env factory {factory!r} cannot be sent to the env's process "
                f"({type(exc).__name__}: {exc}): give a module-level function, a class "
                "instance or a functools.partial of one, whose arguments pickle too (not a "
                "built env or pool: let the factory build it, e.g. GymnasiumEnv.make, "
                "EnvPoolEnv.make; cloudpickle, where installed, also takes lambdas and "
                "closures), or use thread workers"
            ) from exc

    def _receive(self) -> Any:
        return self._parse(self._read())

    def _read(self) -> bytes:
        try:
            return self._conn.recv_bytes()
        except (EOFError, OSError):
            self._process.join(1.0)
            raise _ProcessEnded(
                f"{self.name}: the env's process ended (exit code {self._process.exitcode})"
            ) from None

    def _parse(self, data: bytes) -> Any:
        tag = data[:1]
        if tag == _RAW:
            try:
                out = self._readers.read(data)
            except RuntimeError as exc:
                raise RuntimeError(f"{self.name}: {exc}") from None
            (share,) = struct.unpack_from("<d", data, 8)
            self.cpu_share = None if share != share else share
            return out
        ok, value, share = pickle.loads(memoryview(data)[2:] if tag == _TEMPLATE else data)
        if not ok:
            raise value
        if tag == _TEMPLATE and not self._readers.learn(data, value):
            try:  # every reply pickled from now on
                self._conn.send_bytes(_dumps((_PICKLED, (), {})))
            except OSError:  # the process ended: the next call says so
                pass
        self.cpu_share = share
        return value

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``env.<method>(*args, **kwargs)``, executed in the env's process. Made while a
        :meth:`send` is in flight (an ``on_flush`` of the runner's, mid-run), it runs
        after that one, whose result it keeps for :meth:`receive`."""
        self.wait_built()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the env's process has ended (closed)")
            message = _message(method, args, kwargs)
            while self._sent > 0:  # the replies before this call's: kept, in order
                data = self._read()  # _ProcessEnded: raised here
                self._sent -= 1
                try:
                    value = self._parse(data)
                except BaseException as exc:  # noqa: BLE001 (the receive() it belongs to raises it)
                    self._early.append((False, exc, None))
                else:
                    self._early.append((True, value, self.cpu_share))
            self._send_locked(message)
            return self._receive()

    def _send_locked(self, message: bytes) -> None:
        """Send ``message`` down the pipe (the caller holds ``_lock``)."""
        try:
            self._conn.send_bytes(message)
        except (BrokenPipeError, OSError):
            self._process.join(1.0)
            raise RuntimeError(
                f"{self.name}: the env's process ended (exit code {self._process.exitcode})"
            ) from None

    def send(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Start ``env.<method>(*args, **kwargs)`` in the env's process and return at once;
        :meth:`receive` returns its result. For one caller (a runner's worker) that
        keeps its sends and receives in step; :meth:`call` is both."""
        self.wait_built()
        if self._closed:
            raise RuntimeError(f"{self.name}: the env's process has ended (closed)")
        message = _message(method, args, kwargs)
        with self._lock:
            self._send_locked(message)
            self._sent += 1

    def receive(self) -> Any:
        """The result of the oldest :meth:`send` not yet received (blocks until it is in:
        :meth:`ready` tells when it is: a readable :attr:`connection` may instead hold
        the reply to another thread's :meth:`call`)."""
        with self._lock:
            if self._early:
                ok, value, share = self._early.popleft()
                if not ok:
                    raise value
                self.cpu_share = self.step_share = share
                return value
            if self._closed:
                raise RuntimeError(f"{self.name}: the env's process has ended (closed)")
            if self._sent <= 0 and self._process.is_alive():  # else: _read says it ended
                raise RuntimeError(f"{self.name}: receive() with no send() in flight")
            data = self._read()
            self._sent -= 1
            value = self._parse(data)
            self.step_share = self.cpu_share
            return value

    #: :attr:`cpu_share` of the result :meth:`receive` returned last: a call made by
    #: another thread since does not change it.
    step_share: float | None = None

    def ready(self) -> bool:
        """Whether :meth:`receive` returns without waiting: a :meth:`send` is in flight
        and its result is in (kept by a :meth:`call`, or on the pipe), or the process has
        ended. A readable pipe alone does not say so: it may hold the reply to another
        thread's call (which that call reads)."""
        with self._lock:
            if self._early or self._closed:
                return True
            if self._sent <= 0:
                return False
            try:
                return self._conn.poll(0)
            except OSError:  # closed: receive() says so
                return True

    def alive(self) -> bool:
        """Whether the env's process still serves calls (not closed)."""
        return not self._closed and self._process.is_alive()

    @property
    def received_early(self) -> bool:
        """Whether the oldest :meth:`send`'s result was read off the pipe by a
        :meth:`call` made meanwhile (:meth:`receive` returns it at once; the pipe no
        longer says it is in)."""
        return bool(self._early)

    @property
    def connection(self) -> Any:
        """The parent's end of the pipe (for ``multiprocessing.connection.wait``: readable
        when a reply is in, a send's or another thread's call's; :meth:`ready` says which)."""
        return self._conn

    def check_against(self, example: Any) -> None:
        try:
            check = self.call("__getattr__", "check_against")
        except AttributeError:  # an env without one: checked on its first observation
            return
        if check is _Callable:
            self.call("check_against", example)

    def sub_env_seeds(self) -> list[int] | None:
        """The seeds the env gives its sub-environments (read in its process)."""
        return self.call("sub_env_seeds")

    def close(self) -> None:
        """Close the env (in its process) and end the process."""
        with self._lock:  # no receive() or call() reads the pipe meanwhile
            if self._closed:
                return
            self._closed = True
            in_flight, self._sent = self._sent, 0
            if self._finalizer.detach() is None:
                return
            error = _shutdown(self._conn, self._process, in_flight=in_flight)
        if error is not None:
            raise error

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = self.call("__getattr__", name)
        if value is _Callable:
            return functools.partial(self.call, name)
        return value


def _shutdown(conn: Any, process: Any, timeout_s: float = 5.0, in_flight: int = 0
              ) -> BaseException | None:
    """Ask the env's process to close its env and exit; end it if it does not. Returns
    what the env's ``close()`` raised, if anything."""
    try:
        if process.is_alive():
            conn.send_bytes(_dumps((None, (), {})))
            while conn.poll(timeout_s):  # a step still in flight answers first
                data = conn.recv_bytes()
                if in_flight > 0:  # a send's reply, whatever it holds
                    in_flight -= 1
                    continue
                if data[:1] in (_RAW, _TEMPLATE):  # a step's result, not the answer
                    continue
                ok, value, _ = pickle.loads(data)
                if not ok:
                    return value
    except (EOFError, OSError):
        pass
    finally:
        process.join(timeout_s)
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        conn.close()
