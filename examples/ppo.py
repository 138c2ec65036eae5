"""Chunked-action PPO via jaxtraj's pipeline mode: MuJoCo (EnvPool XLA) or Pendulum.

MuJoCo tasks (Hopper-v4 by default) run through EnvPool's XLA interface; ``--env
pendulum`` trains gymnax's Pendulum-v1.

The policy emits a chunk of ``K`` actions per observation (one diagonal Gaussian over
the ``K * A`` outputs; the chunk's log-probability is the sum over its actions). The
synchronous runner (:mod:`jaxtraj.runners.sync`) steps ``B`` environments, runs policy
and terminal inference and inserts both halves of every chunk into the collector, all
in one compiled call per iteration: for MuJoCo tasks EnvPool's C++ simulators are
stepped inside that call through EnvPool's XLA interface
(:class:`jaxtraj.envs.envpool_xla.EnvPoolXla`; this turns on ``jax_enable_x64``, which
EnvPool's float64 actions need, and keeps every array of the example float32).
``jaxtraj.pipeline.make_flush`` then returns advantage-ready micro-batches (GAE over
chunks, time-limit truncations bootstrapped from ``V(final obs)``, advantages
normalised) that the PPO update trains on.

Discounting is per chunk: the plan's gamma is ``gamma_action ** K`` and a chunk's
reward is the sum of the ``K`` action rewards its decision owns (up to and including an
episode's end). MuJoCo tasks run with ``chunk_end="continue"`` (EnvPool's XLA interface
steps every environment in lockstep): after an episode ends inside a chunk, the chunk's
remaining actions run in the new episode, and EnvPool's reset step (the step after the
end) is not executed. The loss scores a chunk's log-probability over the actions its
decision owns and that ran (``MicroBatches.action_mask``). Pendulum runs with
``chunk_end="cut"`` (the synchronous runner's default for gymnax), though its episodes
only end at the time limit, on a chunk's last action.

    python examples/ppo.py                         # Hopper-v4 (EnvPool): 1.5-2 min, 2 cores
    python examples/ppo.py --quick                 # 15 iterations: about 20 s
    python examples/ppo.py --env pendulum          # gymnax Pendulum-v1: under a minute
    python examples/ppo.py --env halfcheetah --iterations 200 --seed 1 --plot /tmp/hc.png

Per iteration it prints the mean return of the episodes that ended in it (the flush's
episode statistics, ``MicroBatches.episodes``: environment rewards, counted whole across
iterations), environment
steps per second, and the share of the iteration spent in the collector (inserts,
estimated against the same rollout without a collector, plus the flush).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxtraj
from jaxtraj import PolicyOutput, TrajectoryPlan
from jaxtraj.runners import sync

LOG_2PI = float(np.log(2 * np.pi))
f32 = jnp.float32

# --env name -> EnvPool task id (MuJoCo, stepped in-jit through EnvPool's XLA interface);
# "pendulum" is gymnax's Pendulum-v1.
ENVPOOL_TASKS = {
    "hopper": "Hopper-v4",
    "halfcheetah": "HalfCheetah-v4",
    "inverted-pendulum": "InvertedPendulum-v4",
    "reacher": "Reacher-v4",
    "walker": "Walker2d-v4",
}


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
    gae_lambda: float = 0.95  # per chunk
    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    value_scale: float = 100.0  # the critic's head outputs values in these units
    seed: int = 0
    env: str = "pendulum"  # or a key of ENVPOOL_TASKS


def preset(env: str, actions_per_chunk: int | None = None) -> Config:
    """The tuned configuration of a task (``--env``)."""
    if env == "pendulum":
        K = actions_per_chunk or 4
        return Config(actions_per_chunk=K, chunks=200 // K)
    if env not in ENVPOOL_TASKS:
        raise ValueError(f"unknown env {env!r}: pendulum or one of {sorted(ENVPOOL_TASKS)}")
    K = actions_per_chunk or 2
    return Config(
        env=env,
        iterations=300,  # 1.2M steps: Hopper ~15 -> ~2000 in 75-90 s on 2 cores
        envs=16,
        actions_per_chunk=K,
        chunks=256 // K,  # 256 actions per env and iteration
        micro_batch_size=256,
        update_epochs=10,
        lr=3e-4,
        value_scale=100.0,
    )


class MLP(nn.Module):
    out: int
    final_scale: float = 1.0
    in_scale: tuple | None = None  # per-feature input scale (Pendulum's |thdot| <= 8)

    @nn.compact
    def __call__(self, x):
        if self.in_scale is not None:
            x = x * jnp.array(self.in_scale, f32).reshape((1,) * (x.ndim - 1) + (-1,))
        for _ in range(2):
            x = nn.tanh(nn.Dense(64, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(self.out, kernel_init=nn.initializers.orthogonal(self.final_scale))(x)


def make_model(K: int, A: int, value_scale: float = 1.0, in_scale=(1.0, 1.0, 1.0 / 8.0)):
    """``(init, policy_fn, value_fn, log_prob)`` of a chunk Gaussian policy and a critic.

    Observations are normalised by ``params["obs_norm"]`` (running mean and variance,
    updated outside the gradient by :func:`update_obs_norm`) when ``in_scale`` is None,
    else scaled by ``in_scale``. Every array is float32 (also under ``jax_enable_x64``).
    """
    actor = MLP(K * A, 0.01, in_scale)
    critic = MLP(1, 1.0, in_scale)
    normalise = in_scale is None

    def prep(params, obs):
        if not normalise:
            return obs
        n = jax.lax.stop_gradient(params["obs_norm"])
        lead = (1,) * (obs.ndim - 1)
        mean, var = n["mean"].reshape(lead + (-1,)), n["var"].reshape(lead + (-1,))
        return jnp.clip((obs - mean) * jax.lax.rsqrt(var + 1e-8), -10.0, 10.0)

    def init(rng, obs_dim):
        k1, k2 = jax.random.split(rng)
        x = jnp.zeros((1, obs_dim), f32)
        params = {
            "actor": actor.init(k1, x),
            "log_std": jnp.zeros((K * A,), f32),
            "critic": critic.init(k2, x),
        }
        if normalise:
            params["obs_norm"] = {
                "mean": jnp.zeros((obs_dim,), f32),
                "var": jnp.ones((obs_dim,), f32),
                "count": jnp.asarray(1e-4, f32),
            }
        return params

    def value_fn(params, obs):
        return value_scale * critic.apply(params["critic"], prep(params, obs))[..., 0]

    def log_prob(params, obs, actions):  # per action element, [B, K, A]
        mean = actor.apply(params["actor"], prep(params, obs)).reshape(actions.shape)
        log_std = params["log_std"].reshape((1,) + actions.shape[1:])
        z = (actions - mean) * jnp.exp(-log_std)
        return -0.5 * z**2 - log_std - 0.5 * LOG_2PI

    def policy_fn(params, obs, rng):  # rng [B, 2]: a PRNG key per row
        B = obs.shape[0]
        mean = actor.apply(params["actor"], prep(params, obs)).reshape(B, K, A)
        std = jnp.exp(params["log_std"]).reshape(1, K, A)
        noise = jax.vmap(lambda k: jax.random.normal(k, (K, A), f32))(rng)
        actions = mean + std * noise
        return PolicyOutput(
            actions=actions,
            prev_logprobs=log_prob(params, obs, actions),
            prev_values=value_fn(params, obs),
        )

    return init, policy_fn, value_fn, log_prob


@jax.jit
def update_obs_norm(norm, obs, mask):
    """Merge the masked observations ``[..., obs_dim]`` into the running statistics."""
    w = mask.astype(f32)[..., None]
    n = jnp.maximum(w.sum(), 1.0)
    axes = tuple(range(obs.ndim - 1))
    mean = (obs * w).sum(axis=axes) / n
    var = (((obs - mean.reshape((1,) * len(axes) + (-1,))) ** 2) * w).sum(axis=axes) / n
    total = norm["count"] + n
    delta = mean - norm["mean"]
    new_mean = norm["mean"] + delta * n / total
    m2 = norm["var"] * norm["count"] + var * n + delta**2 * norm["count"] * n / total
    return {"mean": new_mean, "var": m2 / total, "count": total}


def make_train(cfg: Config, log_prob, value_fn, optimizer):
    """The jitted PPO update over one epoch's micro-batches ``[R, MB, M, ...]``."""

    def loss_fn(params, b):
        mask = b.loss_mask.astype(jnp.float32)
        n = jnp.maximum(mask.sum(), 1.0)
        # The chunk's log-prob over the actions its decision owns and that ran (an episode
        # that ends inside the chunk ends its decision; EnvPool's reset step did not run).
        owned = b.action_mask.astype(jnp.float32)  # [M, K]
        logp = (log_prob(params, b.obs, b.actions).sum(axis=-1) * owned).sum(axis=-1)
        ratio = jnp.exp(logp - (b.prev_logprobs.sum(axis=-1) * owned).sum(axis=-1))
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


def make_env(cfg: Config):
    """``(env, env_params, obs_dim, action_dim)``: a gymnax env or an EnvPool driver."""
    K, B = cfg.actions_per_chunk, cfg.envs
    if cfg.env == "pendulum":
        import gymnax

        env, env_params = gymnax.make("Pendulum-v1")
        return env, env_params, 3, 1
    # EnvPool's XLA step takes float64 actions: JAX needs x64 for them (set before any
    # tracing). Every array of this example is float32 regardless (explicit dtypes).
    jax.config.update("jax_enable_x64", True)
    import envpool

    from jaxtraj.envs.envpool_xla import EnvPoolXla

    pool = envpool.make(ENVPOOL_TASKS[cfg.env], env_type="gymnasium", num_envs=B, seed=cfg.seed)
    env = EnvPoolXla(pool, K, clip_actions=True)  # actions clipped to [-1, 1] when sent
    return env, None, pool.spec.observation_space.shape[0], pool.spec.action_space.shape[0]


def run(cfg: Config, *, progress: bool = True, log=print) -> dict[str, Any]:
    """Train; returns ``{"returns": [...], "iteration_s": [...], "collector_share": [...],
    "steps_per_s": [...]}``."""
    from tqdm import tqdm

    env, env_params, obs_dim, A = make_env(cfg)
    K, B = cfg.actions_per_chunk, cfg.envs
    plan = TrajectoryPlan(
        num_chunks=cfg.chunks,
        batch_size=B,
        mode="pipeline",
        micro_batch_size=cfg.micro_batch_size,
        gamma=cfg.gamma**K,
        gae_lambda=cfg.gae_lambda,
    )
    in_scale = (1.0, 1.0, 1.0 / 8.0) if cfg.env == "pendulum" else None
    init_params, policy_fn, value_fn, log_prob = make_model(K, A, cfg.value_scale, in_scale)
    rng = jax.random.PRNGKey(cfg.seed)
    rng, k_init, k_env = jax.random.split(rng, 3)
    params = init_params(k_init, obs_dim)
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
    # An EnvPool pool was stepped on by the baseline (its state is not in the carry):
    # start again from a reset. (A gymnax carry is a value: this gives the same carry.)
    carry = sync.reset(env, env_params, k_env, B, K)

    history = {"returns": [], "iteration_s": [], "collector_share": [], "steps_per_s": []}
    steps = cfg.chunks * K * B
    bar = tqdm(range(cfg.iterations), disable=not progress, desc="ppo", leave=False)
    for it in bar:
        t0 = time.perf_counter()
        state, carry = collect(state, carry, params)
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        rng, k_train = jax.random.split(rng)
        t2 = time.perf_counter()
        batches, state, pipe = flush(state, pipe, 0)
        jax.block_until_ready(batches)
        t3 = time.perf_counter()
        params, opt_state, pg, vl = train(params, opt_state, batches, k_train)
        if "obs_norm" in params:  # for the next collection, outside the gradient
            norm = update_obs_norm(params["obs_norm"], batches.obs, batches.loss_mask)
            params = {**params, "obs_norm": norm}
        jax.block_until_ready(params)
        t4 = time.perf_counter()
        jaxtraj.raise_if_error(state)

        # The episodes that ended in this flush (every rank's batches hold them all).
        episodes = jax.tree.map(lambda x: x[0], batches.episodes)
        count, ret = int(episodes.count()), float(episodes.mean_return())
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
        "--env",
        default="hopper",
        choices=["pendulum", *ENVPOOL_TASKS],
        help="hopper (default), halfcheetah, ... via EnvPool's XLA interface; pendulum: gymnax",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run: 15 iterations (under a minute on 2 CPU cores); pendulum: 30 iterations",
    )
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--envs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chunk", type=int, default=None, help="K actions per chunk (MuJoCo 2, pendulum 4)"
    )
    parser.add_argument("--plot", default=None, help="learning-curve PNG (ppo_<env>.png)")
    args = parser.parse_args()
    cfg = preset(args.env, args.chunk)
    cfg = dataclasses.replace(cfg, seed=args.seed)
    if args.quick:
        cfg = dataclasses.replace(cfg, iterations=30 if args.env == "pendulum" else 15)
    if args.iterations is not None:
        cfg = dataclasses.replace(cfg, iterations=args.iterations)
    if args.envs is not None:
        cfg = dataclasses.replace(cfg, envs=args.envs)
    plot = args.plot or f"ppo_{args.env}.png"
    task = "Pendulum-v1 (gymnax)" if cfg.env == "pendulum" else ENVPOOL_TASKS[cfg.env]

    print(f"jaxtraj {jaxtraj.__version__} on {jax.default_backend()}: {task}, {cfg}")
    start = time.perf_counter()
    history = run(cfg)
    wall = time.perf_counter() - start
    returns = np.asarray(history["returns"])
    seen = returns[np.isfinite(returns)]
    steps_total = len(returns) * cfg.envs * cfg.chunks * cfg.actions_per_chunk
    print(
        f"\n{task}: first return {seen[0]:.1f}, mean of the last 5 reported "
        f"{np.mean(seen[-5:]):.1f}, best {seen.max():.1f}; {steps_total:,} env steps in "
        f"{wall:.1f} s wall, {np.median(history['steps_per_s'][1:]):,.0f} env steps/s "
        f"(median iteration), collector share {100 * np.median(history['collector_share'][1:]):.1f}% "
        "of iteration time (median; estimated against a collector-free rollout timed once at "
        "the start, so load on the machine during the run counts as collector time)"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(returns) + 1) * cfg.envs * cfg.chunks * cfg.actions_per_chunk
    ok = np.isfinite(returns)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps[ok], returns[ok])
    ax.set_xlabel("environment steps")
    ax.set_ylabel("mean episode return")
    ax.set_title(f"PPO on {task} via jaxtraj (K={cfg.actions_per_chunk}, seed {cfg.seed})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plot, dpi=100)
    print(f"learning curve saved to {plot}")


if __name__ == "__main__":
    main()
