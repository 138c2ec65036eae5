"""The synchronous runner's collection overhead against a collector-free rollout.

Both run the same jitted rollout of one training step: gymnax's Pendulum-v1 (or, with
``--env jax-pendulum``, this file's own pure-JAX copy of its dynamics, for machines without
gymnax) vmapped over ``B`` environments, ``T`` chunks of ``K`` actions, an MLP policy (2 x 64, tanh) with a
value head, terminal inference per chunk. The runner (:func:`jaxtraj.runners.sync.collect`)
inserts both halves of every chunk into the collector inside its ``lax.scan`` (state
donated); the baseline (:func:`jaxtraj.runners.sync.rollout_stacked`) only stacks the
same parts as the scan's outputs. Timed: one training step each, median of interleaved
repeats after compile; compile times separately. The runner's rollout-mode flush is
reported alongside but is not part of the ratio.

    python benchmarks/rollout.py [--quick] [--B 256 --T 64 --K 4] [--env gymnax|jax-pendulum]
                                 (or: cd benchmarks && python rollout.py)

Writes ``benchmarks/results/rollout.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from collect import machine  # noqa: E402
from flax import struct  # noqa: E402

import jaxtraj  # noqa: E402
from jaxtraj import PolicyOutput, TrajectoryPlan  # noqa: E402
from jaxtraj.runners import sync  # noqa: E402

A, OBS, HIDDEN = 1, 3, 64


@struct.dataclass
class PendulumState:
    theta: jax.Array
    theta_dot: jax.Array
    time: jax.Array


class JaxPendulum:
    """gymnax's Pendulum-v1 (gymnax 1.0's dynamics, reward, reset and 200-step time limit)
    in gymnax's interface, auto-resetting, for machines without gymnax: ``step`` returns
    ``(obs, state, reward, terminated, truncated, info)`` with the pre-reset observation in
    ``info["final_observation"]``. Parameters are constants (``env_params`` is ``None``)."""

    max_speed, max_torque, dt, g, m, length, max_steps = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0, 200

    @staticmethod
    def _obs(st):
        return jnp.stack([jnp.cos(st.theta), jnp.sin(st.theta), st.theta_dot])

    def reset(self, key, params=None):
        high = jnp.array([jnp.pi, 1.0])
        x = jax.random.uniform(key, (2,), minval=-high, maxval=high)
        st = PendulumState(x[0], x[1], jnp.zeros((), jnp.int32))
        return self._obs(st), st

    def step(self, key, st, action, params=None):
        u = jnp.clip(action, -self.max_torque, self.max_torque).reshape(())
        norm = (st.theta + jnp.pi) % (2 * jnp.pi) - jnp.pi
        reward = -(norm**2 + 0.1 * st.theta_dot**2 + 0.001 * u**2)
        acc = (3 * self.g / (2 * self.length) * jnp.sin(st.theta)
               + 3.0 / (self.m * self.length**2) * u)
        thdot = jnp.clip(st.theta_dot + acc * self.dt, -self.max_speed, self.max_speed)
        nxt = PendulumState(st.theta + thdot * self.dt, thdot, st.time + 1)
        terminated = jnp.zeros((), bool)
        truncated = nxt.time >= self.max_steps
        obs_st = self._obs(nxt)
        obs_re, st_re = self.reset(jax.random.split(key)[1])
        done = terminated | truncated
        pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(done, x, y), a, b)
        info = {"final_observation": obs_st}
        return pick(obs_re, obs_st), pick(st_re, nxt), reward, terminated, truncated, info


def make_env(name: str):
    """``(env, env_params)`` for ``--env``."""
    if name == "gymnax":
        import gymnax

        return gymnax.make("Pendulum-v1")
    if name == "jax-pendulum":
        return JaxPendulum(), None
    raise SystemExit(f"--env must be gymnax or jax-pendulum, got {name!r}")


def make_policy(K: int, obs_dim: int = OBS, actions: int = A):
    """``(init, policy_fn, value_fn)``: an MLP actor (2 x 64, tanh) with a Gaussian noise of
    one, and an MLP critic, float32 throughout (also under ``jax_enable_x64``)."""
    f32 = jnp.float32

    def mlp(p, x):
        for w, b in p[:-1]:
            x = jnp.tanh(x @ w + b[None])
        w, b = p[-1]
        return x @ w + b[None]

    def init(rng):
        sizes = [(obs_dim, HIDDEN), (HIDDEN, HIDDEN)]
        keys = jax.random.split(rng, 6)

        def layer(k, i, o):
            return jax.random.normal(k, (i, o), f32) / f32(np.sqrt(i)), jnp.zeros((o,), f32)

        actor = [layer(keys[j], *s) for j, s in enumerate(sizes)]
        critic = [layer(keys[3 + j], *s) for j, s in enumerate(sizes)]
        return {
            "actor": actor + [layer(keys[2], HIDDEN, K * actions)],
            "critic": critic + [layer(keys[5], HIDDEN, 1)],
        }

    def value_fn(params, obs):
        return mlp(params["critic"], obs)[:, 0]

    def policy_fn(params, obs, rng):  # rng [B, 2]: a PRNG key per row
        mean = mlp(params["actor"], obs).reshape(obs.shape[0], K, actions)
        noise = jax.vmap(lambda k: jax.random.normal(k, (K, actions), f32))(rng)
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


def compare(env, env_params, K: int, repeats: int, obs_dim: int = OBS, actions: int = A,
            *, B: int, T: int) -> dict:
    """The synchronous runner (collector inserts in its scan) against the same scan that
    only stacks the parts, on ``env``: compile times, then interleaved repeats of one
    training step each. Each call steps on from its own last carry (an env with host
    state, as EnvPool's, advances between calls; a pure one may too)."""
    init, policy_fn, value_fn = make_policy(K, obs_dim, actions)
    params = init(jax.random.PRNGKey(0))
    plan = TrajectoryPlan(num_chunks=T, batch_size=B)
    pe, ve = sync.example_parts(env, env_params, policy_fn, value_fn, params, B, K)
    state = jaxtraj.init(plan, pe, ve)
    carry = sync.reset(env, env_params, jax.random.PRNGKey(1), B, K)

    collect = sync.make_collect(plan, env, env_params, policy_fn, value_fn)
    stacked = jax.jit(
        lambda c, p: sync.rollout_stacked(plan, env, env_params, policy_fn, value_fn, c, p)
    )
    flush = jax.jit(jaxtraj.rollout.flush, static_argnums=0, donate_argnums=1)

    t0 = time.perf_counter()
    collect_c = collect.lower(state, carry, params).compile()
    compile_collect = time.perf_counter() - t0
    t0 = time.perf_counter()
    stacked_c = stacked.lower(carry, params).compile()
    compile_stacked = time.perf_counter() - t0

    # Warm up (first touch of every buffer), then interleave the two.
    state, c1 = collect_c(state, carry, params)
    traj, state = flush(plan, state)
    c2 = jax.block_until_ready((stacked_c(carry, params), traj))[0][2]
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
        "B": B,
        "T": T,
        "K": K,
        "A": actions,
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


def bench(B: int, T: int, K: int, repeats: int, env_name: str = "gymnax") -> dict:
    env, env_params = make_env(env_name)
    result = compare(env, env_params, K, repeats, B=B, T=T)
    return {**({} if env_name == "gymnax" else {"env": env_name}), **result}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B=32, T=16, fewer repeats")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "rollout.json")
    )
    parser.add_argument(
        "--async-halves", type=int, default=None, help="asynchronous runner: halves (0: skip)"
    )
    parser.add_argument("--B", type=int, default=None, help="environments; default 256 (--quick: 32)")
    parser.add_argument("--T", type=int, default=None, help="chunks; default 64 (--quick: 16)")
    parser.add_argument("--K", type=int, default=None, help="actions per chunk; default 4")
    parser.add_argument(
        "--env", default="gymnax", choices=["gymnax", "jax-pendulum"],
        help="gymnax's Pendulum-v1, or this file's pure-JAX copy (no gymnax needed)",
    )
    args = parser.parse_args()
    B, T, K = (32, 16, 4) if args.quick else (256, 64, 4)
    B, T, K = args.B or B, args.T or T, args.K or K
    repeats = 10 if args.quick else args.repeats
    # gymnax's Pendulum broadcasts its [1] action against scalars: allow it explicitly.
    with jax.numpy_rank_promotion("allow"):
        result = bench(B, T, K, repeats, args.env)
    report = {"benchmark": "rollout", "machine": machine(), "result": result}
    halves = (
        args.async_halves if args.async_halves is not None else (10_000 if args.quick else 100_000)
    )
    if halves:  # the asynchronous runner's throughput, in the same run (rollout_async.py)
        import rollout_async

        rollout_async.run(2 * 4 * rollout_async.E * rollout_async.T, 4, 0.0, 64)  # warm-up
        report["async"] = rollout_async.run(halves, 4, 200e-6, 64)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    r = result
    print(
        f"sync runner vs collector-free rollout: B={B}, T={T}, K={K} ({r['env_steps']} steps), "
        f"env {'gymnax Pendulum-v1' if args.env == 'gymnax' else args.env}"
    )
    print(
        f"  machine: {report['machine']['processor']}, {report['machine']['cpu_count']} "
        f"cores, jax {report['machine']['jax']} on {report['machine']['backend']}"
    )
    print(f"  {'rollout, parts stacked (lax.scan)':<40} {r['stacked_ms']:9.2f} ms")
    print(f"  {'rollout + collector inserts (sync)':<40} {r['collect_ms']:9.2f} ms")
    print(
        f"  ratio {r['ratio']:.3f} (target <= 1.10; range over repeats "
        f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})"
    )
    print(f"  rollout-mode flush (not in the ratio)    {r['rollout_flush_ms']:9.2f} ms")
    print(f"  compile: sync {r['compile_collect_s']:.2f} s, stacked {r['compile_stacked_s']:.2f} s")
    if "async" in report:
        a = report["async"]
        print(
            f"async runner: {a['halves']} halves with random delays, {a['halves_per_s']:.0f} "
            f"halves/s, lost {a['lost']}, max queues {a['max_queue_sizes']}, peak RSS "
            f"{a['peak_rss_mib_after']:.0f} MiB"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
