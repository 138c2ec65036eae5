"""Environments built, and always stepped, in one thread of their own.

Simulators bind state to the thread that creates them: MuJoCo's OpenGL context (GLX, EGL,
OSMesa) is current only in the thread that made it, so a camera rendered from another
thread comes out black (every pixel zero), silently. A runner given a *factory* (a
callable that builds the env) instead of an env wraps it in :class:`ThreadBoundEnv`: the
factory runs in a dedicated thread, and every call the runner makes (``reset``,
``step``, ``spec``, ``check_against``, ``close``) is executed in that thread, whichever
worker thread of whichever ``run()`` makes it. A hand-off costs one queue round trip per
call (a chunk of ``K`` env steps is one call).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()


def is_factory(env: Any) -> bool:
    """A callable that is not itself an environment (no ``step``): an env factory."""
    return callable(env) and not callable(getattr(env, "step", None))


class ThreadBoundEnv:
    """An environment built by ``factory()`` in a thread of its own; every method call is
    executed there. Attributes (``num_envs``, ``seed``, ...) read the env's own.

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
            env = factory()
            missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
            if missing:
                raise TypeError(
                    f"{self.name}: the env factory returned {type(env).__name__}, not an "
                    f"environment (it has no {' or '.join(missing)}()): return an env such as "
                    "jaxtraj.envs.GymnasiumEnv(...)"
                )
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            ready.put((False, exc))
            return
        ready.put((True, env))
        while True:
            item = self._calls.get()
            if item is _STOP:
                return
            fn, args, kwargs, reply = item
            try:
                reply.put((True, fn(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 (raised in the caller's thread)
                reply.put((False, exc))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``env.<method>(*args, **kwargs)``, executed in the env's thread."""
        if not self._thread.is_alive():
            raise RuntimeError(f"{self.name}: the env's thread has ended (closed)")
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._calls.put((getattr(self._env, method), args, kwargs, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def reset(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("reset", *args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("step", *args, **kwargs)

    def spec(self) -> Any:
        return self.call("spec")

    def check_against(self, example: Any) -> None:
        check = getattr(self._env, "check_against", None)
        if check is not None:
            self.call("check_against", example)

    def render(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("render", *args, **kwargs)

    def close(self) -> None:
        """Close the env (in its thread) and end the thread."""
        try:
            if self._thread.is_alive() and callable(getattr(self._env, "close", None)):
                self.call("close")
        finally:
            self._calls.put(_STOP)
            self._thread.join()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._env, name)
