"""Chunked-action PPO on gymnax's Pendulum-v1, collecting through jaxtraj's pipeline mode.

The policy emits a chunk of ``K`` torques per observation (one diagonal Gaussian over
the ``K * A`` outputs; the chunk's log-probability is the sum over its actions). The
synchronous runner (:mod:`jaxtraj.runners.sync`) steps ``B`` environments, runs policy
and terminal inference and inserts both halves of every chunk into the collector, all
in one compiled call per iteration. ``jaxtraj.pipeline.make_flush`` then returns
advantage-ready micro-batches (GAE over chunks, time-limit truncations bootstrapped
from ``V(final obs)``, advantages normalised) that the PPO update trains on.

    python examples/ppo.py --quick                 # a few minutes on 2 CPU cores
    python examples/ppo.py --iterations 200 --envs 128 --seed 1 --plot /tmp/ppo.png

Per iteration it prints the mean return of the episodes that ended in it, environment
steps per second, and the share of the iteration spent in the collector (inserts,
estimated against the same rollout without a collector, plus the flush).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxtraj
from jaxtraj import PolicyOutput, TrajectoryPlan
from jaxtraj.runners import sync

LOG_2PI = float(np.log(2 * np.pi))


@dataclasses.dataclass(frozen=True)
class Config:
    iterations: int = 80
    envs: int = 64
    chunks: int = 50  # T chunks per iteration: T * K = one 200-step episode per env
    actions_per_chunk: int = 4  # K
    micro_batch_size: int = 400
    update_epochs: int = 8
    lr: float = 1e-3
    gamma: float = 0.99  # per action; the plan's per-chunk discount is gamma ** K
    gae_lambda: float = 0.95
    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    value_scale: float = 100.0  # the critic's head outputs values in these units
    seed: int = 0


class MLP(nn.Module):
    out: int
    final_scale: float = 1.0

    @nn.compact
    def __call__(self, x):
        x = x * jnp.array([1.0, 1.0, 1.0 / 8.0]).reshape((1,) * (x.ndim - 1) + (3,))  # |thdot| <= 8
        for _ in range(2):
            x = nn.tanh(nn.Dense(64, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(self.out, kernel_init=nn.initializers.orthogonal(self.final_scale))(x)


def make_model(K: int, A: int, value_scale: float = 1.0):
    """``(init, policy_fn, value_fn, log_prob)`` of a chunk Gaussian policy and a critic."""
    actor, critic = MLP(K * A, 0.01), MLP(1, 1.0)

    def init(rng, obs_dim):
        k1, k2 = jax.random.split(rng)
        x = jnp.zeros((1, obs_dim))
        return {
            "actor": actor.init(k1, x),
            "log_std": jnp.zeros((K * A,)),
            "critic": critic.init(k2, x),
        }

    def value_fn(params, obs):
        return value_scale * critic.apply(params["critic"], obs)[..., 0]

    def log_prob(params, obs, actions):  # per action element, [B, K, A]
        mean = actor.apply(params["actor"], obs).reshape(actions.shape)
        log_std = params["log_std"].reshape((1,) + actions.shape[1:])
        z = (actions - mean) * jnp.exp(-log_std)
        return -0.5 * z**2 - log_std - 0.5 * LOG_2PI

    def policy_fn(params, obs, key):
        B = obs.shape[0]
        mean = actor.apply(params["actor"], obs).reshape(B, K, A)
        std = jnp.exp(params["log_std"]).reshape(1, K, A)
        actions = mean + std * jax.random.normal(key, mean.shape)
        return PolicyOutput(
            actions=actions,
            prev_logprobs=log_prob(params, obs, actions),
            prev_values=value_fn(params, obs),
        )

    return init, policy_fn, value_fn, log_prob


def make_train(cfg: Config, log_prob, value_fn, optimizer):
    """The jitted PPO update over one epoch's micro-batches ``[R, MB, M, ...]``."""

    def loss_fn(params, b):
        mask = b.loss_mask.astype(jnp.float32)
        n = jnp.maximum(mask.sum(), 1.0)
        logp = log_prob(params, b.obs, b.actions).sum(axis=(-2, -1))  # the chunk's log-prob
        ratio = jnp.exp(logp - b.prev_logprobs.sum(axis=(-2, -1)))
        adv = b.advantages
        pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - cfg.clip, 1 + cfg.clip) * adv)
        v = value_fn(params, b.obs)
        v_loss = 0.5 * ((v - b.returns) / cfg.value_scale) ** 2
        entropy = (params["log_std"] + 0.5 * (1 + LOG_2PI)).sum()
        loss = ((pg + cfg.value_coef * v_loss) * mask).sum() / n - cfg.entropy_coef * entropy
        return loss, ((pg * mask).sum() / n, (v_loss * mask).sum() / n)

    grad_fn = jax.grad(loss_fn, has_aux=True)

    @jax.jit
    def train(params, opt_state, batches, rng):
        flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[3:]), batches)
        n = flat.loss_mask.shape[0]
        M = batches.loss_mask.shape[2]

        def epoch(carry, key):
            perm = jax.random.permutation(key, n)
            mbs = jax.tree.map(lambda x: x[perm].reshape((n // M, M) + x.shape[1:]), flat)

            def step(carry, b):
                params, opt_state = carry
                grads, aux = grad_fn(params, b)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), aux

            return jax.lax.scan(step, carry, mbs)

        keys = jax.random.split(rng, cfg.update_epochs)
        (params, opt_state), (pg, vl) = jax.lax.scan(epoch, (params, opt_state), keys)
        return params, opt_state, pg.mean(), vl.mean()

    return train


@jax.jit
def episode_stats(state, running):
    """Returns of episodes that ended in this step, from the collector's raw env rewards.

    ``running [B]`` carries the unfinished episodes' returns across iterations.
    Returns ``(running, sum of finished returns, number finished)``.
    """
    tr = state.env.transition  # leaves [S, E, T, B, K] (stacked state)
    r = tr.rewards[0].reshape((-1,) + tr.rewards.shape[3:])  # [E*T, B, K]
    d = (tr.terminations | tr.truncations)[0].reshape(r.shape)
    r = jnp.moveaxis(r, 2, 1).reshape((-1, r.shape[1]))  # time-major [E*T*K, B]
    d = jnp.moveaxis(d, 2, 1).reshape(r.shape)

    def one(carry, x):
        acc, total, count = carry
        r_t, d_t = x
        acc = acc + r_t
        total = total + jnp.sum(jnp.where(d_t, acc, 0.0))
        count = count + jnp.sum(d_t)
        return (jnp.where(d_t, 0.0, acc), total, count), None

    (running, total, count), _ = jax.lax.scan(one, (running, 0.0, 0), (r, d))
    return running, total, count


def run(cfg: Config, *, progress: bool = True, log=print) -> dict[str, Any]:
    """Train; returns ``{"returns": [...], "iteration_s": [...], "collector_share": [...]}``."""
    from tqdm import tqdm

    env, env_params = gymnax.make("Pendulum-v1")
    K, A, B = cfg.actions_per_chunk, 1, cfg.envs
    plan = TrajectoryPlan(
        num_chunks=cfg.chunks,
        batch_size=B,
        mode="pipeline",
        micro_batch_size=cfg.micro_batch_size,
        gamma=cfg.gamma**K,
        gae_lambda=cfg.gae_lambda,
    )
    init_params, policy_fn, value_fn, log_prob = make_model(K, A, cfg.value_scale)
    rng = jax.random.PRNGKey(cfg.seed)
    rng, k_init, k_env = jax.random.split(rng, 3)
    params = init_params(k_init, 3)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(cfg.lr, eps=1e-5))
    opt_state = optimizer.init(params)

    policy_ex, env_ex = sync.example_parts(env, env_params, policy_fn, value_fn, params, B, K)
    # The stacked (single-source) state that the pipeline flush works on.
    state = jaxtraj.init(plan, policy_ex, env_ex, sources=[[0, 0]])
    carry = sync.reset(env, env_params, k_env, B, K)
    collect = sync.make_collect(plan, env, env_params, policy_fn, value_fn)
    flush = jaxtraj.pipeline.make_flush(plan)
    rng, k_shuffle = jax.random.split(rng)
    pipe = jaxtraj.pipeline.init(plan, k_shuffle)  # shuffle key, epochs flushed
    train = make_train(cfg, log_prob, value_fn, optimizer)
    # Baseline for the insert cost: the same rollout, parts only stacked (no collector).
    stacked = jax.jit(
        lambda c, p: sync.rollout_stacked(plan, env, env_params, policy_fn, value_fn, c, p)
    )
    jax.block_until_ready(stacked(carry, params))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(stacked(carry, params))
        times.append(time.perf_counter() - t0)
    baseline_s = float(np.median(times))

    running = jnp.zeros((B,))
    history = {"returns": [], "iteration_s": [], "collector_share": [], "steps_per_s": []}
    steps = cfg.chunks * K * B
    bar = tqdm(range(cfg.iterations), disable=not progress, desc="ppo", leave=False)
    for it in bar:
        t0 = time.perf_counter()
        state, carry = collect(state, carry, params)
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        running, total, count = episode_stats(state, running)
        rng, k_train = jax.random.split(rng)
        t2 = time.perf_counter()
        batches, state, pipe = flush(state, pipe, 0)
        jax.block_until_ready(batches)
        t3 = time.perf_counter()
        params, opt_state, pg, vl = train(params, opt_state, batches, k_train)
        jax.block_until_ready(params)
        t4 = time.perf_counter()
        jaxtraj.raise_if_error(state)

        count = int(count)
        ret = float(total) / count if count else float("nan")
        it_s = (t1 - t0) + (t3 - t2) + (t4 - t3)
        insert_s = max(0.0, (t1 - t0) - baseline_s)
        share = (insert_s + (t3 - t2)) / it_s
        history["returns"].append(ret)
        history["iteration_s"].append(it_s)
        history["collector_share"].append(share)
        history["steps_per_s"].append(steps / it_s)
        msg = (
            f"iter {it:4d}  return {ret:8.1f}  ({count} episodes)  "
            f"{steps / it_s:9.0f} steps/s  collector {100 * share:4.1f}%  "
            f"pg {float(pg):+.3f}  v {float(vl):.3f}"
        )
        bar.set_postfix_str(f"return {ret:.0f}")
        if log is not None:
            (tqdm.write if progress else log)(msg)
    return history


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the default short run (80 iterations, 64 envs)"
    )
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--envs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=4, help="K actions per chunk")
    parser.add_argument("--plot", default="ppo_pendulum.png", help="learning-curve PNG path")
    args = parser.parse_args()
    cfg = Config(seed=args.seed, actions_per_chunk=args.chunk, chunks=200 // args.chunk)
    if args.iterations is not None:
        cfg = dataclasses.replace(cfg, iterations=args.iterations)
    if args.envs is not None:
        cfg = dataclasses.replace(cfg, envs=args.envs)

    print(f"jaxtraj {jaxtraj.__version__} on {jax.default_backend()}: {cfg}")
    start = time.perf_counter()
    history = run(cfg)
    wall = time.perf_counter() - start
    returns = history["returns"]
    last = float(np.nanmean(returns[-5:]))
    print(
        f"\nfirst iteration return {returns[0]:.1f}, mean of the last 5 {last:.1f}, "
        f"best {np.nanmax(returns):.1f}; {wall:.1f} s wall, "
        f"collector share {100 * np.mean(history['collector_share'][1:]):.1f}% of iteration time"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(returns) + 1) * cfg.envs * cfg.chunks * cfg.actions_per_chunk
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, returns)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("mean episode return")
    ax.set_title(f"PPO on Pendulum-v1 via jaxtraj (K={cfg.actions_per_chunk}, seed {cfg.seed})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"learning curve saved to {args.plot}")


if __name__ == "__main__":
    main()
