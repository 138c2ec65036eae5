"""Environment and policy in host threads, halves reaching the collector out of order.

Two environment workers (the point-mass task of ``collect_rollout.py``, with random
simulator delays) and one policy worker run in threads with bounded queues; the
collector receives each chunk's policy half and env half from different threads, in
whatever order they finish (``runner.update_policy(params)`` publishes new weights
mid-collection; the version travels in ``versions``). ``--decoupled`` runs the decoupled variant: the
environment asks for the next chunk before it executes the current one, the policy
serves several environments per call, and every env half carries its boundary
observation explicitly.

    python examples/async_runner.py [--decoupled] [--steps 2]
"""

from __future__ import annotations

import argparse
import threading

import jax
import jax.numpy as jnp
import numpy as np
from collect_rollout import OBS, A, K, env_reset, env_step_chunk, observe, policy

import jaxtraj
from jaxtraj import EnvTransition, PolicyOutput, TrajectoryKey
from jaxtraj.runners.threads import AsyncRunner, DecoupledRunner, EnvStep, key_rng, row_rngs

B, T = 8, 6


class PointMass:
    """One environment rank: ``B`` point masses, randomness from the chunk's key."""

    def __init__(self, rank, params):
        self.rank, self.params = rank, params
        self.rand = np.random.default_rng(rank)

    def reset(self):
        self.state = env_reset(jax.random.PRNGKey(rank_seed(self.rank)), B)
        return {"state": np.asarray(observe(self.state))}

    def step(self, key, actions):
        threading.Event().wait(self.rand.uniform(0, 0.002))  # a simulator that takes time
        self.state, r, term, trunc, final_obs, _ = env_step_chunk(
            self.state, jnp.asarray(actions), key_rng(1, key)
        )
        return EnvStep(
            transition=EnvTransition(
                rewards=np.asarray(r), terminations=np.asarray(term), truncations=np.asarray(trunc)
            ),
            obs={"state": np.asarray(observe(self.state))},
            final_values=np.asarray(final_obs @ self.params["v"]),  # terminal inference
        )


def rank_seed(rank):
    return 100 + rank


def policy_fn(params, obs, rng):
    """``obs`` rows ``[N, ...]`` of one or several env ranks (the runner joins every
    ready rank's into one call), ``rng [N, 2]``: a PRNG key per row."""
    actions, logp, value = policy(params, jnp.asarray(obs["state"]), rng)
    return PolicyOutput(
        actions=np.asarray(actions),
        prev_logprobs=np.asarray(logp),
        prev_values=np.asarray(value),
        versions=np.zeros((obs["state"].shape[0],), np.int32),  # stamped by the runner
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoupled", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rng = jax.random.PRNGKey(0)
    params = {
        "w": 0.1 * jax.random.normal(rng, (OBS, K * A)),
        "v": 0.5 * jax.random.normal(jax.random.fold_in(rng, 1), (OBS,)),
    }
    plan = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B, num_env_ranks=2)
    # One example of each half fixes the collector's buffers.
    env, key = PointMass(0, params), TrajectoryKey(0, 0, 0, 0, 0)
    obs = env.reset()
    out = policy_fn(params, obs, row_rngs(key_rng(0, key), B))
    step = env.step(key, out.actions)
    src = jaxtraj.TrajectorySource(key, B, 0)
    collector = jaxtraj.TrajectoryCollector(
        plan,
        jaxtraj.PolicyPart(src, obs, out),
        jaxtraj.EnvPart(
            src,
            step.transition,
            initial_transition=step.transition.boundary(),
            final_values=step.final_values,
            next_obs=step.obs,
        ),
    )

    flushed = []

    def on_flush(queue_key, trajectory):  # the Actor's queue
        flushed.append(trajectory)

    kind = DecoupledRunner if args.decoupled else AsyncRunner
    runner = kind(
        collector,
        [PointMass(r, params) for r in range(2)],
        policy_fn,
        params,
        num_steps=args.steps,
        on_flush=on_flush,
    )
    runner.run()
    print(f"{kind.__name__}: {len(flushed)} trajectories, max queue sizes {runner.max_qsize}")
    for traj in flushed:
        versions = sorted(set(np.asarray(traj.versions).ravel().tolist()))
        print(
            f"  step {int(traj.step_id)} env_rank {int(traj.env_rank)}: actions "
            f"{tuple(traj.actions.shape)}, mean reward {float(np.mean(traj.rewards)):+.3f}, "
            f"policy versions {versions}"
        )


if __name__ == "__main__":
    main()
