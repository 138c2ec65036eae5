"""``jit`` that hands inputs passed through unchanged back as the inputs themselves.

``jax.jit`` copies an output that is an input returned as is, unless that input is
donated. A flush materialises a ``Trajectory`` whose big fields (observations,
actions, forward inputs) are the buffers themselves: compiled plainly, every flush
would copy them. :func:`forwarding_jit` finds, while tracing, which outputs are
inputs unchanged (the same tracer) and compiles only the others; the forwarded ones
are returned as the caller's arrays, with no copy and no dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def forwarding_jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.jit(fn)`` whose outputs that are inputs unchanged are not copied.

    ``fn``'s arguments are pytrees of arrays (close over static values). Each distinct
    input signature traces once, as with ``jax.jit``.
    """
    plans: dict[Any, tuple] = {}

    def compute(in_tree, *leaves):
        out = fn(*jax.tree.unflatten(in_tree, leaves))
        out_leaves, out_tree = jax.tree.flatten(out)
        position = {id(x): i for i, x in enumerate(leaves)}
        forwarded = tuple(position.get(id(o)) for o in out_leaves)
        plans[(in_tree, _signature(leaves))] = (out_tree, forwarded)
        return [o for o, f in zip(out_leaves, forwarded) if f is None]

    compiled = jax.jit(compute, static_argnums=0)

    def call(*args):
        leaves, in_tree = jax.tree.flatten(args)
        computed = iter(compiled(in_tree, *leaves))
        out_tree, forwarded = plans[(in_tree, _signature(leaves))]
        out = [leaves[f] if f is not None else next(computed) for f in forwarded]
        return jax.tree.unflatten(out_tree, out)

    return call


def _signature(leaves) -> tuple:
    return tuple([(x.shape, x.dtype) for x in leaves])  # dtype objects hash fast; str() does not
