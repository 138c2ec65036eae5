"""Environment stepping, policy inference and collection in one jitted ``lax.scan``.

For JAX environments: gymnax's Pendulum, 32 environments vmapped, chunks of K = 4
actions, a linear Gaussian policy. ``sync.make_collect`` compiles one training step of
collection (T chunks: inference, K environment steps with auto-reset, terminal
inference where time limits cut episodes, both inserts) into one call; the rollout
flush then hands the ``Trajectory`` to the Actor.

    python examples/sync_runner.py
"""

from __future__ import annotations

import gymnax
import jax
import jax.numpy as jnp
import numpy as np

import jaxtraj
from jaxtraj import PolicyOutput
from jaxtraj.runners import sync

B, T, K = 32, 25, 4  # 100 actions a step: the 200-step time limit ends step 1
env, env_params = gymnax.make("Pendulum-v1")


def policy_fn(params, obs, rng):
    """A linear Gaussian over the whole chunk: actions [B, K, 1]; ``rng [B, 2]``, a
    PRNG key per row (each row's noise from its own key)."""
    mean = (obs @ params["w"]).reshape(-1, K, 1)
    noise = 0.5 * jax.vmap(lambda k: jax.random.normal(k, (K, 1)))(rng)
    logp = -0.5 * (noise / 0.5) ** 2 - jnp.log(0.5 * jnp.sqrt(2 * jnp.pi))
    return PolicyOutput(actions=mean + noise, prev_logprobs=logp, prev_values=value_fn(params, obs))


def value_fn(params, obs):
    return obs @ params["v"]


def main():
    rng = jax.random.PRNGKey(0)
    params = {"w": 0.1 * jax.random.normal(rng, (3, K)), "v": jnp.zeros((3,))}
    plan = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B)
    state = jaxtraj.init(
        plan, *sync.example_parts(env, env_params, policy_fn, value_fn, params, B, K)
    )
    carry = sync.reset(env, env_params, rng, B, K)
    collect = sync.make_collect(plan, env, env_params, policy_fn, value_fn)
    flush = jax.jit(jaxtraj.rollout.flush, static_argnums=0, donate_argnums=1)
    for _ in range(3):
        state, carry = collect(state, carry, params)  # one compiled call per training step
        traj, state = flush(plan, state)
        jaxtraj.raise_if_error(state)
        print(
            f"step {int(traj.step_id)}: actions {tuple(traj.actions.shape)}, rewards "
            f"{tuple(traj.rewards.shape)} mean {float(np.mean(traj.rewards)):+.2f}, truncations "
            f"{int(np.asarray(traj.truncations).sum())}, V(s_T) {tuple(traj.prev_values[:, -1].shape)}"
        )


if __name__ == "__main__":
    with jax.numpy_rank_promotion("allow"):  # gymnax's Pendulum broadcasts its [1] action
        main()
