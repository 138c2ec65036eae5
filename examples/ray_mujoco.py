"""MuJoCo environments in Ray actors, a JAX policy in the learner, collected by jaxtraj.

Each env actor (``jaxtraj.runners.ray.RayRunner``, one per env rank) steps ``--envs``
gymnasium ``Reacher-v5`` environments (state observations, no rendering) on the host
CPU, through :class:`jaxtraj.envs.GymnasiumEnv` (no adapter to write). The learner
process (this script) runs a small Gaussian MLP policy that emits an action chunk of
``K`` actions per call, Sebulba-style: for every rank it infers a chunk, sends the
actions to the rank's actor and receives what the envs did back (``--transport direct``,
which the default ``auto`` picks for every actor that reaches the learner: on a connection
each actor opens to the learner, the step's arrays as their bytes, the env half made in the
learner; ``ray``, which ``auto`` falls back to for an actor that cannot reach it (a
firewall between machines, warned about): a Ray call per chunk, through the object store,
the env half made in the actor); the collector joins the halves and flushes one
``Trajectory`` per rank and training step. The policy is trained with a few clipped policy-gradient updates per step on
critic-free discounted returns (``TrajectoryPlan(advantage="returns")``), and every
update is published with ``runner.update_policy`` (the version travels in
``Trajectory.versions``).

    pip install -e '.[ray]'            # ray, gymnasium[mujoco], mujoco<4
    python examples/ray_mujoco.py [--actors 2] [--envs 16] [--iterations 100] [--transport auto]
        [--direct-port 0]

On a cluster, start Ray on every machine (``ray start --head`` on one, ``ray start
--address=HEAD:6379`` on the others) and run the same script on the learner node with
``RAY_ADDRESS=HEAD:6379`` (or ``--address``); see docs/guides/ray.md for placing the env
actors on CPU nodes and the learner on an accelerator node.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import optax
import ray

import jaxtraj
from jaxtraj import PolicyOutput, TrajectoryPlan
from jaxtraj.envs import GymnasiumEnv, example_parts
from jaxtraj.runners.ray import RayRunner
from jaxtraj.targets import trajectory_targets

K = 5  # actions per chunk: a Reacher episode (50 steps) is 10 chunks
T = 10  # chunks per epoch: one episode per environment and training step
OBS, ACT = 10, 2


def make_env(rank: int, envs: int) -> GymnasiumEnv:
    """One env rank (called in its actor's process): ``envs`` gymnasium Reacher-v5 in a
    ``SyncVectorEnv``, executed ``K`` actions a chunk by :class:`jaxtraj.envs.GymnasiumEnv`.

    Seeded by the rank: a restarted actor rebuilds its env, resets with the same seed and
    replays its actions, reproducing the same states (what ``RayRunner`` relies on when an
    environment offers no ``get_state``).
    """
    vec = gym.make_vec("Reacher-v5", num_envs=envs, vectorization_mode="sync")
    return GymnasiumEnv(vec, actions_per_chunk=K, seed=10_000 * rank)


def init_params(rng, hidden=64):
    k1, k2 = jax.random.split(rng)
    return {
        "w1": jax.random.normal(k1, (OBS, hidden)) / np.sqrt(OBS),
        "b1": jnp.zeros((hidden,)),
        "w2": 0.01 * jax.random.normal(k2, (hidden, K * ACT)),
        "b2": jnp.zeros((K * ACT,)),
        "log_std": jnp.full((K * ACT,), -0.5, jnp.float32),  # not weak-typed: no recompile
    }


def mean_action(params, obs):
    h = jnp.tanh(obs @ params["w1"] + params["b1"])
    return (h @ params["w2"] + params["b2"]).reshape(obs.shape[:-1] + (K, ACT))


def log_prob(params, obs, actions):
    std = jnp.exp(params["log_std"]).reshape(K, ACT)
    z = (actions - mean_action(params, obs)) / std
    return -0.5 * jnp.square(z) - jnp.log(std) - 0.5 * jnp.log(2 * jnp.pi)


@jax.jit
def sample(params, obs, rng):
    mean = mean_action(params, obs)
    std = jnp.exp(params["log_std"]).reshape(K, ACT)
    # rng [N, 2]: a PRNG key per row; each row's noise from its own key.
    actions = mean + std * jax.vmap(lambda k: jax.random.normal(k, (K, ACT)))(rng)
    return actions, log_prob(params, obs, actions)


def policy_fn(params, obs, rng):
    actions, logp = sample(params, jnp.asarray(obs["state"]), rng)
    return PolicyOutput(
        actions=np.asarray(actions),
        prev_logprobs=np.asarray(logp),
        versions=np.zeros((obs["state"].shape[0],), np.int32),  # stamped by the runner
    )


def make_update(plan, optimizer, clip=0.2):
    def loss_fn(params, traj, adv):
        obs, actions = traj.obs["state"], traj.actions  # [E, T, B, ...]
        logp = log_prob(params, obs, actions).sum(axis=(-2, -1))
        ratio = jnp.exp(logp - traj.prev_logprobs.sum(axis=(-2, -1)))
        clipped = jnp.clip(ratio, 1 - clip, 1 + clip)
        return -jnp.mean(jnp.minimum(ratio * adv, clipped * adv))

    @jax.jit
    def update(params, opt_state, traj):
        adv = trajectory_targets(plan, traj).advantages
        # Critic-free: the baseline of a chunk is the mean return of every environment at
        # the same chunk of the episode (GRPO-style groups), then one scale for all.
        adv = adv - adv.mean(axis=-1, keepdims=True)
        adv = adv / (adv.std() + 1e-8)
        for _ in range(4):
            grads = jax.grad(loss_fn)(params, traj, adv)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state

    return update


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--actors", type=int, default=2, help="env actors (env ranks)")
    parser.add_argument("--envs", type=int, default=16, help="environments per actor")
    parser.add_argument("--iterations", type=int, default=100, help="training steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--address", default=None,
                        help="a Ray cluster's address; none: RAY_ADDRESS, else a local Ray")
    parser.add_argument("--actor-cpus", type=float, default=0.5, help="CPUs each env actor asks")
    parser.add_argument(
        "--actor-resources",
        type=json.loads,
        default={},
        help="custom resources each env actor asks, e.g. '{\"sim\": 1}' (CPU nodes only)",
    )
    parser.add_argument(
        "--transport",
        choices=("auto", "ray", "direct"),
        default="auto",
        help="how chunks travel: a Ray call each, or each actor's own connection to the "
        "learner (faster; the actors' nodes must reach the learner's address); auto: "
        "direct, each actor that cannot reach the learner falling back to ray",
    )
    parser.add_argument(
        "--direct-port",
        type=int,
        default=0,
        help="the port the direct transport's learner listens on (one a cluster's "
        "firewall opens; with --transport auto, a nonzero port asks for direct); 0: one "
        "the system picks",
    )
    args = parser.parse_args()

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)  # a running cluster: env actors go to its CPU nodes
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    plan = TrajectoryPlan(
        num_chunks=T,
        num_epochs=1,
        batch_size=args.envs,
        num_env_ranks=args.actors,
        advantage="returns",
        gamma=0.99,
    )
    params = init_params(jax.random.PRNGKey(0))
    with make_env(0, args.envs) as env:  # its spec: the collector's example halves
        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), env.spec().obs)
        out = policy_fn(params, zeros, jax.random.split(jax.random.PRNGKey(0), args.envs))
        collector = jaxtraj.TrajectoryCollector(plan, *example_parts(env, plan, out))
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)
    update = make_update(plan, optimizer)
    envs = args.envs

    print(
        f"{args.actors} env actors x {envs} Reacher-v5, chunks of {K} actions, "
        f"{T} chunks per step ({T * K * envs * args.actors} env steps per iteration)"
    )
    runner = RayRunner(
        collector,
        functools.partial(make_env, envs=envs),
        policy_fn,
        params,
        num_steps=1,
        actor_options={"num_cpus": args.actor_cpus, "resources": args.actor_resources},
        transport=args.transport,
        # a port asks for the direct transport (with --transport ray: an error naming both)
        direct_address=(None, args.direct_port) if args.direct_port or args.transport == "direct" else None,
    )
    first = last = None
    with runner:
        t0 = time.perf_counter()
        for it in range(args.iterations):
            t1 = time.perf_counter()
            items = runner.run()  # one training step from every env rank
            collect_s = time.perf_counter() - t1
            trajs = [traj for _, traj in items]
            # Mean return of an episode (each epoch is exactly one 50-step episode).
            # (rewards [E, T, B, K]: per action, from the adapter)
            ret = float(np.mean([np.asarray(tr.rewards).sum(axis=(1, 3)).mean() for tr in trajs]))
            versions = sorted({int(v) for tr in trajs for v in np.unique(tr.versions)})
            for traj in trajs:
                params, opt_state = update(params, opt_state, traj)
            runner.update_policy(params)
            first = ret if first is None else first
            last = ret
            steps = T * K * envs * args.actors
            print(
                f"iter {it:3d}  episode return {ret:8.2f}  versions {versions}  "
                f"collect {collect_s:5.2f} s ({steps / collect_s:,.0f} env steps/s)"
            )
        total = time.perf_counter() - t0
    print(
        f"return {first:.2f} -> {last:.2f} in {args.iterations} iterations, {total:.1f} s "
        f"(transports by rank {runner.transports})"
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
