"""Collect one training step of realistic embodied parts: jaxtraj against a host-side
dict-and-stack collector in the original system's style and a plain memory copy.

Parts (per source chunk, B = 64 environments): one 64x64x3 uint8 image and a
32-float state, an 8x7 float action chunk, log-probabilities of the same shape, a
value, 256 int32 forward-input tokens; env halves with 8 action-level rewards and
done flags. T = 64 chunks, one epoch. Halves arrive in a random order.

Measured, side by side in one process:

- ``memcpy``: one contiguous copy of every byte the step holds (the physical limit);
- ``jax_copy``: a jitted copy of those bytes into a new device buffer (what producing
  that many fresh bytes costs a JAX program, first-touch page faults included);
- ``host_dict_stack``: the original system's collector: dicts keyed by key, a
  step per joined pair, ``np.stack`` per field at flush;
- ``jaxtraj_add``: ``TrajectoryCollector.add`` per half, then the flush;
- ``jaxtraj_add_many``: ``TrajectoryCollector.add_many`` in batches of 16 halves;
- ``jaxtraj_jit``: the pure jitted functions on parts already on the device.

Two more figures: the overhead per half of batched inserts of tiny parts (B = 8,
no image), and insert time at a capacity of 4096 chunks against 64 chunks.

    python benchmarks/collect.py [--quick] [--repeats 5]

Writes ``benchmarks/results/collect.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtraj
from jaxtraj import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectoryPlan,
    TrajectorySource,
    stack_parts,
)

K, A = 8, 7


def make_parts(B, T, *, image=True, seed=0):
    """All halves of one training step (one source, one epoch), shuffled."""
    rng = np.random.default_rng(seed)
    parts = []
    for t in range(T):
        key = TrajectoryKey(0, 0, 0, 0, t)
        obs = {"state": rng.standard_normal((B, 32), np.float32)}
        if image:
            obs["image"] = rng.integers(0, 255, (B, 64, 64, 3), np.uint8)
        parts.append(
            PolicyPart(
                source=TrajectorySource(key, B, 0),
                obs=obs,
                output=PolicyOutput(
                    actions=rng.standard_normal((B, K, A), np.float32),
                    prev_logprobs=rng.standard_normal((B, K, A), np.float32),
                    prev_values=rng.standard_normal((B,), np.float32),
                    forward_inputs={"tokens": rng.integers(0, 32000, (B, 256), np.int32)},
                ),
            )
        )
        zeros = np.zeros((B, K), bool)
        parts.append(
            EnvPart(
                source=TrajectorySource(key, B, 0),
                transition=EnvTransition(
                    rewards=rng.standard_normal((B, K), np.float32),
                    terminations=rng.random((B, K)) < 0.01,
                    truncations=zeros,
                ),
                initial_transition=EnvTransition(terminations=zeros, truncations=zeros)
                if t == 0
                else None,
                final_values=rng.standard_normal((B,), np.float32) if t == T - 1 else None,
            )
        )
    random.Random(seed).shuffle(parts)
    return parts


def at_step(parts, step):
    """The same parts keyed to another training step (the arrays are shared)."""
    return [
        p.replace(source=p.source.replace(key=p.source.key.replace(step_id=step))) for p in parts
    ]


def steps_of(parts, n):
    """Parts for training steps ``0 .. n-1``; each timed call collects the next step."""
    return [at_step(parts, k) for k in range(n)]


def nbytes(parts):
    return sum(np.asarray(x).nbytes for p in parts for x in jax.tree.leaves(p.replace(source=None)))


def examples(parts):
    policy = next(p for p in parts if isinstance(p, PolicyPart))
    env = next(p for p in parts if isinstance(p, EnvPart))
    return policy, env


def timeit(fn, repeats):
    """Median wall time of ``fn()`` after one warm-up call (compiles).

    ``fn`` is called ``repeats + 1`` times; collectors persist between calls, as in a
    training loop, and each call collects the next training step.
    """
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def run_memcpy(parts):
    total = nbytes(parts)
    src = np.random.default_rng(1).integers(0, 255, total, np.uint8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def run_jax_copy(parts):
    """A jitted copy of the same bytes into a new device buffer: what any JAX program
    pays to produce that many fresh bytes (first-touch page faults included)."""
    src = jax.device_put(np.random.default_rng(1).integers(0, 255, nbytes(parts), np.uint8))
    copy = jax.jit(lambda x: x.copy())
    return lambda: jax.block_until_ready(copy(src))


def run_host_dict_stack(parts, T):
    """The original system's style: dicts keyed by key, lists, ``stack`` at flush."""

    def collect():
        pending_policy, pending_env, steps = {}, {}, {}
        initial = final = None
        for p in parts:
            k = p.source.key.as_tuple()
            if isinstance(p, PolicyPart):
                pending_policy[k] = p
            else:
                pending_env[k] = p
            if k in pending_policy and k in pending_env:
                pol, env = pending_policy.pop(k), pending_env.pop(k)
                steps[k[-1]] = {
                    "obs": pol.obs,
                    "actions": pol.output.actions,
                    "prev_logprobs": pol.output.prev_logprobs,
                    "prev_values": pol.output.prev_values,
                    "forward_inputs": pol.output.forward_inputs,
                    "rewards": env.transition.rewards,
                    "dones": env.transition.terminations | env.transition.truncations,
                }
                if env.initial_transition is not None:
                    initial = env.initial_transition
                if env.final_values is not None:
                    final = env.final_values
        ordered = [steps[t] for t in range(T)]
        out = jax.tree.map(lambda *xs: np.stack(xs), *ordered)
        out["dones"] = np.concatenate(
            [(initial.terminations | initial.truncations)[None], out["dones"]]
        )
        out["prev_values"] = np.concatenate([out["prev_values"], final[None]])
        return out

    return collect


def block(items):
    jax.block_until_ready([t for _, t in items])
    return items


def run_jaxtraj_add(parts, plan, repeats):
    pol, env = examples(parts)
    c = jaxtraj.TrajectoryCollector(plan, pol, env)
    steps = iter(steps_of(parts, repeats + 1))

    def collect():
        out = []
        for p in next(steps):
            out += c.add(p)
        assert len(out) == 1
        return block(out)

    return collect


def run_jaxtraj_add_many(parts, plan, repeats, batch=16):
    pol, env = examples(parts)
    c = jaxtraj.TrajectoryCollector(plan, pol, env)
    steps = iter(steps_of(parts, repeats + 1))

    def collect():
        step, out = next(steps), []
        for i in range(0, len(step), batch):
            out += c.add_many(step[i : i + batch])
        assert len(out) == 1
        return block(out)

    return collect


def run_jaxtraj_jit(parts, plan, repeats):
    """The pure functions on device-resident parts (one host sync: ``ready``)."""
    pol, env = examples(parts)
    add_p = jax.jit(jaxtraj.add_policy, static_argnums=0, donate_argnums=1)
    add_e = jax.jit(jaxtraj.add_env, static_argnums=0, donate_argnums=1)

    def flush_in_place(plan, state):  # trajectory first: it takes the donated buffers
        state, traj = jaxtraj.flush(plan, state, assume_complete=True)
        return traj, state

    flush = jax.jit(flush_in_place, static_argnums=0, donate_argnums=1)
    steps = iter([jax.device_put(step) for step in steps_of(parts, repeats + 1)])
    holder = {"state": jaxtraj.init(plan, pol, env)}

    def collect():
        state = holder["state"]
        for p in next(steps):
            state = (add_p if isinstance(p, PolicyPart) else add_e)(plan, state, p)
        assert bool(jaxtraj.ready(state))
        traj, state = flush(plan, state)
        jax.block_until_ready(traj)
        holder["state"] = state
        return traj

    return collect


def tiny_overhead(repeats, halves=4096, batch=256):
    """Microseconds per half of batched inserts of tiny parts (B = 8, no image).

    Two inputs: a list of parts (``add_many`` groups and stacks them on the host) and
    parts the service loop already stacked (one ``PolicyPart`` / ``EnvPart`` per batch
    with a leading axis).
    """
    B, T = 8, halves // 2
    parts = make_parts(B, T, image=False, seed=2)
    plan = TrajectoryPlan(num_chunks=T, batch_size=B)
    pol, env = examples(parts)
    out = {"halves": len(parts), "batch": batch, "bytes": nbytes(parts)}
    copy, _ = timeit(run_memcpy(parts), repeats)
    out["memcpy_ms"] = copy * 1e3

    def batches_of(step_parts, stacked):
        chunks = [step_parts[i : i + batch] for i in range(0, len(step_parts), batch)]
        if not stacked:
            return chunks
        return [group for chunk in chunks for group in stack_parts(chunk)]

    for name, stacked in (("list", False), ("stacked", True)):
        c = jaxtraj.TrajectoryCollector(plan, pol, env)
        steps = iter([batches_of(step, stacked) for step in steps_of(parts, repeats + 1)])

        def collect():
            res = []
            for b in next(steps):
                res += c.add_many(b)
            assert len(res) == 1
            return block(res)

        t, _ = timeit(collect, repeats)
        out[name] = {
            "total_ms": t * 1e3,
            "us_per_half": t / len(parts) * 1e6,
            "overhead_us_per_half": (t - copy) / len(parts) * 1e6,
        }
    return out


def capacity_scaling(repeats, small=64, large=4096, B=64, inserts=64):
    """Insert time of the same ``inserts`` parts into a state of ``small`` vs ``large`` chunks."""
    out = {}
    for T in (small, large):
        parts = [p for p in make_parts(B, inserts, image=False, seed=3)]
        plan = TrajectoryPlan(num_chunks=T, batch_size=B)
        pol, env = examples(parts)
        add_p = jax.jit(jaxtraj.add_policy, static_argnums=0, donate_argnums=1)
        policy_parts = jax.device_put([p for p in parts if isinstance(p, PolicyPart)])
        holder = {"state": jaxtraj.init(plan, pol, env)}

        def insert():
            state = holder["state"].replace(policy_rows=jnp.zeros_like(holder["state"].policy_rows))
            for p in policy_parts:
                state = add_p(plan, state, p)
            jax.block_until_ready(state)
            holder["state"] = state

        t, _ = timeit(insert, repeats)
        out[T] = t / len(policy_parts) * 1e6
    return {
        "us_per_insert": {str(k): v for k, v in out.items()},
        "ratio": out[large] / out[small],
        "capacities": [small, large],
    }


def memory(parts, plan):
    """Bytes of the collector state: transitions off (the default) against on.

    Off, the state holds the step's parts plus per-row masks and nothing more; on, it
    adds one next-observation buffer.
    """
    pol, env = examples(parts)
    size = lambda st: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(st))
    off = jax.eval_shape(lambda: jaxtraj.init(plan, pol, env))
    on = jax.eval_shape(
        lambda: jaxtraj.init(dataclasses.replace(plan, collect_transitions=True), pol, env)
    )
    return {"parts_bytes": nbytes(parts), "state_bytes_off": size(off), "state_bytes_on": size(on)}


def machine():
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "numpy": np.__version__,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller step, fewer repeats")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "collect.json")
    )
    args = parser.parse_args()
    B, T = (16, 16) if args.quick else (64, 64)
    repeats = 2 if args.quick else args.repeats
    parts = make_parts(B, T)
    plan = TrajectoryPlan(num_chunks=T, batch_size=B)
    runs = {
        "memcpy": run_memcpy(parts),
        "jax_copy": run_jax_copy(parts),
        "host_dict_stack": run_host_dict_stack(parts, T),
        "jaxtraj_add": run_jaxtraj_add(parts, plan, repeats),
        "jaxtraj_add_many": run_jaxtraj_add_many(parts, plan, repeats),
        "jaxtraj_jit": run_jaxtraj_jit(parts, plan, repeats),
    }
    results = {}
    for name, fn in runs.items():
        t, first = timeit(fn, repeats)
        results[name] = {"ms": t * 1e3, "first_call_ms": first * 1e3}
    copy = results["memcpy"]["ms"]
    for r in results.values():
        r["x_memcpy"] = r["ms"] / copy
    report = {
        "benchmark": "collect",
        "machine": machine(),
        "step": {"B": B, "T": T, "E": 1, "halves": len(parts), "bytes": nbytes(parts)},
        "results": results,
        "tiny_parts": tiny_overhead(repeats, halves=1024 if args.quick else 4096),
        "memory": memory(parts, plan),
        "capacity": capacity_scaling(repeats, large=512 if args.quick else 4096),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    m = report["machine"]
    print(f"collect: B={B} T={T}, {len(parts)} halves, {nbytes(parts) / 2**20:.1f} MiB")
    print(f"machine: {m['processor']}, {m['cpu_count']} cpus, jax {m['jax']} on {m['backend']}")
    print(f"{'collector':<18}{'ms':>10}{'x memcpy':>10}{'first call ms':>15}")
    for name, r in results.items():
        print(f"{name:<18}{r['ms']:>10.2f}{r['x_memcpy']:>10.2f}{r['first_call_ms']:>15.1f}")
    tiny = report["tiny_parts"]
    for name in ("list", "stacked"):
        r = tiny[name]
        print(
            f"tiny parts (B=8, no image), add_many of {name} batches of {tiny['batch']}: "
            f"{r['us_per_half']:.2f} us/half, overhead over memcpy {r['overhead_us_per_half']:.2f} us/half"
        )
    mem = report["memory"]
    print(
        f"state memory: parts {mem['parts_bytes'] / 2**20:.2f} MiB; state with transitions off "
        f"{mem['state_bytes_off'] / 2**20:.2f} MiB, on {mem['state_bytes_on'] / 2**20:.2f} MiB"
    )
    cap = report["capacity"]
    us = cap["us_per_insert"]
    print(
        f"insert at capacity {cap['capacities'][1]} vs {cap['capacities'][0]} chunks: "
        f"{us[str(cap['capacities'][1])]:.1f} vs {us[str(cap['capacities'][0])]:.1f} us, ratio {cap['ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
