"""Collect one training step of a small vectorised environment through jaxtraj.

A point-mass reaching task (pure JAX, auto-reset) runs ``B`` environments on each
of two environment ranks. Policy inference emits action chunks of ``K`` actions; the
environment executes them. The two halves of every chunk are published separately
and reach the collector shuffled, as they would from asynchronous workers. When a
rank's training step is complete the collector flushes a ``Trajectory`` for it:
this script prints what the Actor receives.

    python examples/collect_rollout.py [--envs 16] [--chunks 8] [--epochs 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import random

import jax
import jax.numpy as jnp
import numpy as np

import jaxtraj
from jaxtraj import EnvPart, EnvTransition, PolicyPart, TrajectoryKey, TrajectoryPlan

K, A, OBS = 4, 2, 4  # actions per chunk, action dims, observation dims
MAX_STEPS = 20  # time limit (truncation) in actions


def env_reset(rng, n):
    pos = jax.random.uniform(rng, (n, 2), minval=-1.0, maxval=1.0)
    goal = jnp.zeros((n, 2))
    return {"pos": pos, "goal": goal, "t": jnp.zeros((n,), jnp.int32)}


def observe(s):
    return jnp.concatenate([s["pos"], s["goal"]], axis=-1)


@jax.jit
def env_step_chunk(state, actions, rng):
    """Execute ``actions [B, K, A]``; auto-reset inside the chunk.

    Returns the new state, rewards, terminations and truncations ``[B, K]``, the
    final observation of each environment: the one before its last reset in the chunk
    (what terminal inference bootstraps a truncation from), else the current one, and
    the observation each action was taken from ``[B, K, OBS]`` (after a reset, the new
    episode's).
    """

    def one(carry, a):
        s, final, rng = carry
        rng, sub = jax.random.split(rng)
        pos = jnp.clip(s["pos"] + 0.1 * jnp.clip(a, -1, 1), -2, 2)
        dist = jnp.linalg.norm(pos - s["goal"], axis=-1)
        reward = -dist
        t = s["t"] + 1
        terminated = dist < 0.1
        truncated = (t >= MAX_STEPS) & ~terminated
        done = terminated | truncated
        fresh = env_reset(sub, pos.shape[0])
        keep = lambda new, old: jnp.where(done[:, None], new, old)
        nxt = {"pos": keep(fresh["pos"], pos), "goal": s["goal"], "t": jnp.where(done, 0, t)}
        final = {"pos": keep(pos, final["pos"]), "any": final["any"] | done}
        return (nxt, final, rng), (reward, terminated, truncated, observe(s))

    final = {"pos": state["pos"], "any": jnp.zeros(state["t"].shape, bool)}
    (state, final, _), (r, term, trunc, seen) = jax.lax.scan(
        one, (state, final, rng), jnp.swapaxes(actions, 0, 1)
    )
    final_pos = jnp.where(final["any"][:, None], final["pos"], state["pos"])
    final_obs = jnp.concatenate([final_pos, state["goal"]], axis=-1)
    return state, r.T, term.T, trunc.T, final_obs, jnp.swapaxes(seen, 0, 1)


@jax.jit
def policy(params, obs, rng):
    """A linear-Gaussian chunk policy with a linear critic: ``obs [N, OBS]``, ``rng
    [N, 2]`` (a PRNG key per row: each row's noise is drawn from its own key, so a
    row's sample does not depend on which rows share the call)."""
    mean = (obs @ params["w"]).reshape(obs.shape[0], K, A)
    noise = jax.vmap(lambda k: jax.random.normal(k, (K, A)))(rng) * 0.3
    actions = mean + noise
    logp = -0.5 * (noise / 0.3) ** 2 - jnp.log(0.3 * jnp.sqrt(2 * jnp.pi))
    value = obs @ params["v"]
    return actions, logp, value


def run_chunk(params, state, rng, key, initial_flags, per_action_obs=False):
    """One action chunk: policy inference, then the environment executes it.

    Args:
      initial_flags: chunk zero's ``(terminations, truncations)`` before its first
        action (the previous chunk's flags), ``None`` for other chunks.
      per_action_obs: the env half carries the observation of every action
        (``action_obs``: what a dataset frame shows).

    Returns:
      ``(policy_part, env_part, state, flags, rng)``: both halves of the chunk, the
      environments after it, and its ``(terminations, truncations)``.
    """
    B = state["t"].shape[0]
    obs = observe(state)
    rng, k1, k2 = jax.random.split(rng, 3)
    actions, logp, value = policy(params, obs, jax.random.split(k1, B))  # a key per row
    fields = dict(zip(("step_id", "epoch_id", "env_rank", "stage_id", "chunk_id"), key.fields()))
    policy_part = PolicyPart.at(
        **fields,
        obs={"state": np.asarray(obs)},
        actions=np.asarray(actions),
        prev_logprobs=np.asarray(logp),
        prev_values=np.asarray(value),
        versions=np.zeros((B,), np.int32),
        forward_inputs={"obs": np.asarray(obs)},
    )
    state, r, term, trunc, final_obs, seen = env_step_chunk(state, actions, k2)
    term, trunc = np.asarray(term), np.asarray(trunc)
    initial = None
    if initial_flags is not None:  # the boundary before the first action
        initial = EnvTransition(terminations=initial_flags[0], truncations=initial_flags[1])
    env_part = EnvPart.at(
        **fields,
        rewards=np.asarray(r),
        terminations=term,  # the transition's flag fields; initial_transition has the same
        truncations=trunc,
        initial_transition=initial,
        # Terminal inference: V(final obs) bootstraps truncations; on the last chunk it
        # is also V(s_T).
        final_values=np.asarray(final_obs @ params["v"]),
        action_obs={"state": np.asarray(seen)} if per_action_obs else None,
    )
    return policy_part, env_part, state, (term, trunc), rng


def collect(args):
    B, T, E, ranks = args.envs, args.chunks, args.epochs, 2
    plan = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B, num_env_ranks=ranks)
    rng = jax.random.PRNGKey(args.seed)
    params = {
        "w": 0.1 * jax.random.normal(rng, (OBS, K * A)),
        "v": 0.5 * jax.random.normal(jax.random.fold_in(rng, 1), (OBS,)),
    }
    halves = []
    for rank in range(ranks):
        rng, sub = jax.random.split(rng)
        state = env_reset(sub, B)
        flags = (np.zeros((B, K), bool), np.zeros((B, K), bool))
        for epoch in range(E):
            for chunk in range(T):
                key = TrajectoryKey(
                    step_id=0, epoch_id=epoch, env_rank=rank, stage_id=0, chunk_id=chunk
                )
                policy_part, env_part, state, flags, rng = run_chunk(
                    params, state, rng, key, flags if chunk == 0 else None
                )
                halves.append(policy_part)
                # Routing may split a source batch: send some env halves in two fragments.
                halves += env_part.split([B // 2, B - B // 2]) if chunk % 2 else [env_part]
    random.Random(args.seed).shuffle(halves)  # arrival order of asynchronous workers

    policy_example = next(h for h in halves if isinstance(h, PolicyPart))
    env_example = next(h for h in halves if isinstance(h, EnvPart))
    collector = jaxtraj.TrajectoryCollector(plan, policy_example, env_example)
    flushed = []
    for part in halves:
        flushed += collector.add(part)
    return plan, len(halves), flushed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    plan, n_halves, flushed = collect(args)
    print(f"jaxtraj {jaxtraj.__version__} on {jax.default_backend()}: {plan}")
    print(f"{n_halves} halves arrived shuffled; {len(flushed)} trajectories flushed\n")
    for queue_key, traj in flushed:
        print(
            f"queue {queue_key!r}: Trajectory(step={int(traj.step_id)}, env_rank={int(traj.env_rank)})"
        )
        for path, leaf in jax.tree_util.tree_flatten_with_path(traj)[0]:
            if np.ndim(leaf) > 0:
                name = jax.tree_util.keystr(path)
                print(f"  {name:<28} {str(leaf.dtype):<8} {tuple(leaf.shape)}")
        dones = np.asarray(traj.dones[:, 1:]).any(-1)
        targets = jaxtraj.trajectory_targets(plan, traj)  # what the Actor computes next
        print(
            f"  GAE advantages {tuple(targets.advantages.shape)}: mean {float(targets.advantages.mean()):+.3f}, "
            f"std {float(targets.advantages.std()):.3f}; returns mean {float(targets.returns.mean()):+.3f}"
        )
        bootstrap = np.asarray(traj.prev_values[:, -1, :3]).astype(float).round(3).tolist()
        print(f"  mean reward {float(np.mean(traj.rewards)):+.3f}, episode ends {int(dones.sum())}")
        print(f"  bootstrap V(s_T) of the first envs per epoch: {bootstrap}\n")


if __name__ == "__main__":
    main()
