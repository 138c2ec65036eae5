"""The synchronous runner over EnvPool's XLA interface: collection overhead against the
same ``lax.scan`` without the collector.

Both run one jitted training step: EnvPool HalfCheetah-v4 (MuJoCo, C++) stepped through
its XLA custom call by :class:`jaxtraj.envs.envpool_xla.EnvPoolXla`, ``T`` chunks of ``K``
actions, an MLP policy (2 x 64, tanh) with a value head, terminal inference per chunk.
The runner (:func:`jaxtraj.runners.sync.collect`) inserts both halves of every chunk into
the collector inside its scan (state donated); the baseline
(:func:`jaxtraj.runners.sync.rollout_stacked`) only stacks the same parts. Timed: one
training step each, median of interleaved repeats after compile (both step the same
pool; only the time is compared).

    python benchmarks/host_env_xla.py [--quick] [--envs 8 16]

Writes ``benchmarks/results/host_env_xla.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)  # EnvPool's XLA step takes float64 actions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import envpool  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from collect import machine  # noqa: E402

import jaxtraj  # noqa: E402
from jaxtraj import PolicyOutput, TrajectoryPlan  # noqa: E402
from jaxtraj.envs.envpool_xla import EnvPoolXla  # noqa: E402
from jaxtraj.runners import sync  # noqa: E402

TASK, HIDDEN = "HalfCheetah-v4", 64
f32 = jnp.float32


def make_policy(K: int, obs_dim: int, A: int):
    def mlp(p, x):
        for w, b in p[:-1]:
            x = jnp.tanh(x @ w + b[None])
        w, b = p[-1]
        return x @ w + b[None]

    def init(rng):
        keys = jax.random.split(rng, 6)

        def layer(k, i, o):
            return jax.random.normal(k, (i, o), f32) / f32(np.sqrt(i)), jnp.zeros((o,), f32)

        body = [(obs_dim, HIDDEN), (HIDDEN, HIDDEN)]
        actor = [layer(keys[j], *s) for j, s in enumerate(body)] + [layer(keys[2], HIDDEN, K * A)]
        critic = [layer(keys[3 + j], *s) for j, s in enumerate(body)] + [layer(keys[5], HIDDEN, 1)]
        return {"actor": actor, "critic": critic}

    def value_fn(params, obs):
        return mlp(params["critic"], obs)[:, 0]

    def policy_fn(params, obs, key):
        mean = mlp(params["actor"], obs).reshape(obs.shape[0], K, A)
        noise = jax.random.normal(key, mean.shape, f32)
        return PolicyOutput(
            actions=mean + noise,
            prev_logprobs=-0.5 * noise**2 - f32(0.5 * np.log(2 * np.pi)),
            prev_values=value_fn(params, obs),
        )

    return init, policy_fn, value_fn


def timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def bench(B: int, T: int, K: int, repeats: int) -> dict:
    pool = envpool.make(TASK, env_type="gymnasium", num_envs=B, seed=0)
    env = EnvPoolXla(pool, K)
    obs_dim, A = pool.spec.observation_space.shape[0], pool.spec.action_space.shape[0]
    init, policy_fn, value_fn = make_policy(K, obs_dim, A)
    params = init(jax.random.PRNGKey(0))
    plan = TrajectoryPlan(num_chunks=T, batch_size=B)
    pe, ve = sync.example_parts(env, None, policy_fn, value_fn, params, B, K)
    state = jaxtraj.init(plan, pe, ve)
    carry = sync.reset(env, None, jax.random.PRNGKey(1), B, K)

    collect = sync.make_collect(plan, env, None, policy_fn, value_fn)
    stacked = jax.jit(lambda c, p: sync.rollout_stacked(plan, env, None, policy_fn, value_fn, c, p))
    flush = jax.jit(jaxtraj.rollout.flush, static_argnums=0, donate_argnums=1)
    t0 = time.perf_counter()
    collect_c = collect.lower(state, carry, params).compile()
    compile_collect = time.perf_counter() - t0
    t0 = time.perf_counter()
    stacked_c = stacked.lower(carry, params).compile()
    compile_stacked = time.perf_counter() - t0

    # Warm up, then interleave. Each call steps the pool on from its carry.
    state, c1 = collect_c(state, carry, params)
    traj, state = flush(plan, state)
    c2 = jax.block_until_ready(stacked_c(carry, params))[2]
    t_collect, t_stacked, t_flush = [], [], []
    for i in range(repeats):
        order = ("stacked", "collect") if i % 2 == 0 else ("collect", "stacked")
        for name in order:
            if name == "stacked":
                out, dt = timed(stacked_c, c2, params)
                c2 = out[2]
                t_stacked.append(dt)
                del out
            else:
                (state, c1), dt = timed(collect_c, state, c1, params)
                t_collect.append(dt)
                (traj, state), dt = timed(flush, plan, state)
                t_flush.append(dt)
                del traj
    jaxtraj.raise_if_error(state)
    med = lambda xs: statistics.median(xs) * 1e3
    return {
        "task": TASK,
        "B": B,
        "T": T,
        "K": K,
        "A": A,
        "obs_dim": obs_dim,
        "env_steps": B * T * K,
        "repeats": repeats,
        "stacked_ms": med(t_stacked),
        "collect_ms": med(t_collect),
        "ratio": med(t_collect) / med(t_stacked),
        "ratio_range": [min(t_collect) / max(t_stacked), max(t_collect) / min(t_stacked)],
        "rollout_flush_ms": med(t_flush),
        "compile_collect_s": compile_collect,
        "compile_stacked_s": compile_stacked,
        "steps_per_s_collect": B * T * K / statistics.median(t_collect),
        "steps_per_s_stacked": B * T * K / statistics.median(t_stacked),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=16, 6 repeats")
    parser.add_argument("--envs", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "host_env_xla.json")
    )
    args = parser.parse_args()
    T, K = (16, 4) if args.quick else (64, 4)
    repeats = 6 if args.quick else args.repeats
    results = [bench(B, T, K, repeats) for B in args.envs]
    report = {"benchmark": "host_env_xla", "machine": machine(), "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    m = report["machine"]
    print(f"sync runner over EnvPool XLA ({TASK}) vs the same scan without the collector")
    print(f"  machine: {m['processor']}, {m['cpu_count']} cores, jax {m['jax']} on {m['backend']}")
    for r in results:
        print(
            f"  B={r['B']:3d} T={r['T']} K={r['K']} ({r['env_steps']} steps): stacked "
            f"{r['stacked_ms']:8.2f} ms, collect {r['collect_ms']:8.2f} ms, ratio "
            f"{r['ratio']:.3f} (target <= 1.10; range {r['ratio_range'][0]:.2f}-"
            f"{r['ratio_range'][1]:.2f}), {r['steps_per_s_collect']:,.0f} steps/s, "
            f"flush {r['rollout_flush_ms']:.2f} ms"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
