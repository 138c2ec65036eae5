"""Chunked-action PPO on gymnasium's MuJoCo Reacher-v5, collected by jaxtraj's AsyncRunner.

The loop a user writes around a host simulator, with nothing hand-written between the
simulator and the collector:

- two env ranks, each a gymnasium ``SyncVectorEnv`` of ``--envs`` Reacher-v5 wrapped by
  :class:`jaxtraj.envs.GymnasiumEnv` (an action chunk of ``K`` actions is ``K`` env steps;
  float64 observations cast to float32 at the boundary);
- a small flax actor-critic in this process: the runner's policy worker samples each
  chunk and, with ``value_fn``, runs terminal inference (``V(final obs)`` of episodes
  that ended, ``V(s_T)`` of the last chunk) with the current parameters: the env
  workers need no critic;
- ``runner.run(num_steps=1)`` once per training step (environments, PRNG stream and
  model version carry over between calls), GAE over chunks from
  :func:`jaxtraj.trajectory_targets`, a clipped PPO update, ``runner.update_policy``.

    pip install -e '.[examples,gymnasium]'
    python examples/gymnasium_mujoco.py [--iterations 60] [--envs 16]

A Reacher episode is 50 actions, so with ``K = 5`` and ``T = 10`` chunks a training step
holds one episode per environment, ended by the time limit at the last chunk (a
truncation: its reward takes ``gamma * V(final obs)``). Per iteration it prints the mean
episode return, the versions stamped on the step, and env steps per second.
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxtraj
from jaxtraj import PolicyOutput, TrajectoryPlan
from jaxtraj.envs import GymnasiumEnv, example_parts
from jaxtraj.runners.threads import AsyncRunner

K, T, OBS, ACT = 5, 10, 10, 2
G = 0.99  # discount per action; the plan's per chunk is G ** K


class ActorCritic(nn.Module):
    @nn.compact
    def __call__(self, obs):
        h = nn.tanh(nn.Dense(64)(obs))
        h = nn.tanh(nn.Dense(64)(h))
        mean = nn.Dense(K * ACT, kernel_init=nn.initializers.orthogonal(0.01))(h)
        value = nn.Dense(1)(nn.tanh(nn.Dense(64)(obs)))[..., 0]
        log_std = self.param("log_std", nn.initializers.constant(-1.0), (K * ACT,))
        return mean.reshape(obs.shape[:-1] + (K, ACT)), log_std.reshape(K, ACT), value


model = ActorCritic()


def log_prob(mean, log_std, actions):  # per action element
    return -0.5 * jnp.square((actions - mean) / jnp.exp(log_std)) - log_std - 0.9189385


@jax.jit
def _sample(params, obs, rng):
    mean, log_std, value = model.apply(params, obs)
    # rng [N, 2]: a PRNG key per row; each row's noise from its own key.
    noise = jax.vmap(lambda k: jax.random.normal(k, mean.shape[1:]))(rng)
    actions = mean + jnp.exp(log_std) * noise
    return actions, log_prob(mean, log_std, actions), value


def policy_fn(params, obs, rng):
    actions, logp, value = _sample(params, obs["state"], rng)
    return PolicyOutput(
        actions=np.asarray(actions),
        prev_logprobs=np.asarray(logp),
        prev_values=np.asarray(value),
        versions=np.zeros((obs["state"].shape[0],), np.int32),  # stamped by the runner
    )


_value = jax.jit(lambda params, obs: model.apply(params, obs)[2])


def value_fn(params, obs):
    """Terminal inference, on the policy side (the runner's policy worker calls it)."""
    return np.asarray(_value(params, obs["state"]))


def make_update(plan, optimizer, clip=0.2, epochs=8):
    def loss_fn(params, traj, adv, ret):
        mean, log_std, value = model.apply(params, traj.obs["state"])  # [E, T, B, ...]
        logp = log_prob(mean, log_std, traj.actions).sum(axis=(-2, -1))
        ratio = jnp.exp(logp - traj.prev_logprobs.sum(axis=(-2, -1)))
        clipped = jnp.clip(ratio, 1 - clip, 1 + clip)
        pg = -jnp.mean(jnp.minimum(ratio * adv, clipped * adv))
        return pg + 0.5 * jnp.mean(jnp.square(value - ret))

    @jax.jit
    def update(params, opt_state, traj):
        targets = jaxtraj.trajectory_targets(plan, traj)  # GAE over chunks
        adv = targets.advantages
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        for _ in range(epochs):
            grads = jax.grad(loss_fn)(params, traj, adv, targets.returns)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state

    return update


def episode_return(plan, traj) -> float:
    """Mean return per environment of a step's rewards, less the truncation bootstrap."""
    rewards = np.asarray(traj.rewards).sum(axis=(1, 3))  # [E, B]
    cut = np.asarray(traj.truncations)[:, 1:].any(axis=-1)  # [E, T, B]: truncated chunks
    # Only the last chunk's final value is kept (prev_values[:, T]); Reacher truncates
    # there and nowhere else.
    bootstrap = plan.gamma * np.asarray(traj.prev_values)[:, -1] * cut[:, -1]
    assert not cut[:, :-1].any()
    return float((rewards - bootstrap).mean())


def make_env(rank: int, envs: int) -> GymnasiumEnv:
    vec = gym.make_vec("Reacher-v5", num_envs=envs, vectorization_mode="sync")
    return GymnasiumEnv(vec, actions_per_chunk=K, seed=1000 * rank)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=60, help="training steps")
    parser.add_argument("--envs", type=int, default=16, help="environments per env rank")
    parser.add_argument("--ranks", type=int, default=2, help="env ranks (vector envs)")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)

    plan = TrajectoryPlan(
        num_chunks=T, batch_size=args.envs, num_env_ranks=args.ranks, gamma=G**K, gae_lambda=0.95
    )
    envs = [make_env(r, args.envs) for r in range(args.ranks)]
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, OBS)))
    # Example halves from the adapter's spec and one policy output (on zeros): the env
    # does not run.
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), envs[0].spec().obs)
    out = policy_fn(params, zeros, jax.random.split(jax.random.PRNGKey(0), args.envs))
    collector = jaxtraj.TrajectoryCollector(plan, *example_parts(envs[0], plan, out))
    runner = AsyncRunner(collector, envs, policy_fn, params, value_fn=value_fn)
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)
    update = make_update(plan, optimizer)
    steps = T * K * args.envs * args.ranks
    print(
        f"{args.ranks} env ranks x {args.envs} Reacher-v5, chunks of {K} actions, "
        f"{T} chunks per step ({steps} env steps per iteration)"
    )
    returns = []
    t0 = time.perf_counter()
    for it in range(args.iterations):
        t1 = time.perf_counter()
        items = runner.run(num_steps=1)  # one training step of every rank
        collect_s = time.perf_counter() - t1
        trajs = [traj for _, traj in items]
        # Each step holds exactly one 50-action episode per environment; its return is
        # the env's rewards: Trajectory.rewards also hold gamma * V(final obs) where the
        # time limit truncated it (the bootstrap GAE needs), taken out here.
        ret = float(np.mean([episode_return(plan, tr) for tr in trajs]))
        versions = sorted({int(v) for tr in trajs for v in np.unique(tr.versions)})
        for traj in trajs:
            params, opt_state = update(params, opt_state, traj)
        runner.update_policy(params)
        returns.append(ret)
        print(
            f"iter {it:3d}  episode return {ret:8.2f}  versions {versions}  "
            f"collect {collect_s:5.2f} s ({steps / collect_s:,.0f} env steps/s)"
        )
    for env in envs:
        env.close()
    total = time.perf_counter() - t0
    print(f"return {returns[0]:.2f} -> {np.mean(returns[-5:]):.2f} (last 5) in {total:.1f} s")
    return returns


if __name__ == "__main__":
    main()
