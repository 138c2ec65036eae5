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
import sys

import jax

jax.config.update("jax_enable_x64", True)  # EnvPool's XLA step takes float64 actions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import envpool  # noqa: E402
from collect import machine  # noqa: E402
from rollout import compare  # noqa: E402

from jaxtraj.envs.envpool_xla import EnvPoolXla  # noqa: E402

TASK = "HalfCheetah-v4"


def bench(B: int, T: int, K: int, repeats: int) -> dict:
    pool = envpool.make(TASK, env_type="gymnasium", num_envs=B, seed=0)
    obs_dim, A = pool.spec.observation_space.shape[0], pool.spec.action_space.shape[0]
    result = compare(EnvPoolXla(pool, K), None, K, repeats, obs_dim, A, B=B, T=T)
    return {"task": TASK, "obs_dim": obs_dim, **result}


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
