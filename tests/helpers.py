"""Small deterministic parts shared by the tests (one set of shapes: few compiles), and
the comparisons every test file uses: ``reference()``, ``assert_same()``, ``snapshot()``."""

from __future__ import annotations

import chex
import jax
import numpy as np

from jaxtraj import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryCollector,
    TrajectoryKey,
    TrajectoryPlan,
    TrajectorySource,
)

T, E, B, K, A = 3, 2, 4, 2, 3
PLAN = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B, num_env_ranks=2)


def key(chunk, epoch=0, env_rank=0, step=0, stage=0):
    return TrajectoryKey(step, epoch, env_rank, stage, chunk)


def policy_part(chunk, epoch=0, env_rank=0, step=0, stage=0, rows=B):
    """A full policy half whose values encode its key, so mix-ups show."""
    tag = 1000 * step + 100 * env_rank + 10 * epoch + chunk
    r = np.arange(rows, dtype=np.float32)[:, None]
    return PolicyPart(
        source=TrajectorySource(key(chunk, epoch, env_rank, step, stage), B, 0),
        obs={
            "image": (np.full((rows, 2, 2, 3), tag % 251, np.uint8)),
            "state": (tag + r + np.zeros((rows, 5), np.float32)),
        },
        output=PolicyOutput(
            actions=tag + r[:, :, None] + np.arange(K * A, dtype=np.float32).reshape(1, K, A) / 10,
            prev_logprobs=-(tag + r[:, :, None]) + np.zeros((rows, K, A), np.float32),
            prev_values=(tag + np.arange(rows)).astype(np.float32) / 7,
            versions=np.full((rows,), step, np.int32),
            forward_inputs={"tokens": np.full((rows, 6), tag, np.int32)},
        ),
    )


def action_obs(chunk, epoch=0, env_rank=0, step=0, rows=B):
    """Per-action observations ``[rows, K, ...]`` of a chunk: action 0's is the policy
    half's observation, action ``k``'s adds ``k / 100`` to the state (and ``k`` to the
    image), so a frame that shows another action's observation is caught."""
    tag = 1000 * step + 100 * env_rank + 10 * epoch + chunk
    r = np.arange(rows, dtype=np.float32)[:, None, None]
    k = np.arange(K)
    return {
        "image": np.broadcast_to(
            ((tag + k) % 251).astype(np.uint8)[None, :, None, None, None], (rows, K, 2, 2, 3)
        ).copy(),
        "state": (tag + r + (k / 100)[None, :, None] + np.zeros((rows, K, 5))).astype(np.float32),
    }


def env_part(chunk, epoch=0, env_rank=0, step=0, stage=0, rows=B, done_at=None, per_action=False):
    """A full env half whose values encode its key (``per_action``: with
    :func:`action_obs`).

    ``rewards [rows, K]`` are action-level (``tag + row + action``); no truncations.
    ``terminations`` are ``done_at`` when given (``[rows]`` bool), else row ``r``
    terminates at chunk ``r % T`` (each row once per epoch). Chunk 0 carries an
    ``initial_transition`` (odd rows terminated before the first action); chunks 1 and
    ``T - 1`` carry ``final_values`` (``-tag``), the others none.
    """
    tag = 1000 * step + 100 * env_rank + 10 * epoch + chunk
    r = np.arange(rows)
    dones = (r % T) == chunk if done_at is None else np.asarray(done_at)
    initial = None
    if chunk == 0:
        z = np.zeros((rows,), bool)
        initial = EnvTransition(terminations=(r % 2 == 1), truncations=z)
    return EnvPart(
        source=TrajectorySource(key(chunk, epoch, env_rank, step, stage), B, 0),
        transition=EnvTransition(
            rewards=(tag + r[:, None] + np.arange(K)).astype(np.float32),
            terminations=dones,
            truncations=np.zeros((rows,), bool),
        ),
        initial_transition=initial,
        final_values=np.full((rows,), -tag, np.float32) if chunk == T - 1 or chunk == 1 else None,
        action_obs=action_obs(chunk, epoch, env_rank, step, rows) if per_action else None,
    )


def all_parts(env_rank=0, step=0, stage=0, per_action=False):
    out = []
    for e in range(E):
        for t in range(T):
            out.append(policy_part(t, e, env_rank, step, stage))
            out.append(env_part(t, e, env_rank, step, stage, per_action=per_action))
    return out


def reference(env_rank=0, step=0, fresh=False):
    """The ``Trajectory`` of step ``step`` of a clean collector fed ``all_parts`` of steps
    ``0 .. step`` in order, one at a time (the earlier steps too: the episodes that end in
    a step count from where they began, and the running sums carry over). ``fresh``: a
    collector that starts at ``step`` (``step_id=step``), with no episode under way."""
    c = TrajectoryCollector(PLAN, policy_part(0), env_part(0), step_id=step if fresh else 0)
    out = []
    for k in range(step if fresh else 0, step + 1):
        out = []
        for p in all_parts(env_rank, k):
            out += c.add(p)
    assert len(out) == 1
    return out[0][1]


def assert_same(a, b):
    """Same tree structure and bit-identical leaves (numpy or jax arrays alike)."""
    chex.assert_trees_all_equal(a, b)


def snapshot(state):
    """A host copy of every leaf, safe from later donation or in-place writes."""
    return jax.tree.map(lambda x: np.array(x, copy=True), state)


def collect_one(plan, parts, examples=None):
    """The one item a facade fed ``parts`` in their order flushes (examples: the first
    two parts unless given)."""
    c = TrajectoryCollector(plan, *(examples or parts[:2]))
    out = [item for p in parts for item in c.add(p)]
    assert len(out) == 1, f"{len(out)} items flushed"
    return out[0][1]


def collect_jit(plan, parts, examples=None):
    """The same through the jitted pure functions and a jitted rollout flush; any error
    the state records is raised."""
    import jaxtraj

    add_p = jax.jit(jaxtraj.add_policy, static_argnums=0)
    add_e = jax.jit(jaxtraj.add_env, static_argnums=0)
    state = jaxtraj.init(plan, *(examples or parts[:2]))
    for p in parts:
        state = (add_p if isinstance(p, PolicyPart) else add_e)(plan, state, p)
    jaxtraj.raise_if_error(state)
    traj, state = jax.jit(jaxtraj.rollout.flush, static_argnums=0)(plan, state, 0)
    jaxtraj.raise_if_error(state)
    return traj
