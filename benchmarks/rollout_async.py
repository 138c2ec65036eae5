"""Throughput of the asynchronous host-thread runner, in halves per second.

Tiny parts (B = 2 environments, 1 action of 1 dimension, 2 floats of observation) so
the runner's own cost dominates: env workers and a policy worker in threads publish
100,000 halves (``--quick``: 10,000), each delayed by a random transport delay of up to
``--jitter-us`` (the runner's ``jitter_s``: a part reaches the consumer that long after
its publication, in due order; producers do not wait); one consumer feeds the
collector. Checks that no half is lost (every flushed trajectory is counted, and its
observations carry the expected chunk counter) and that memory stays bounded (peak RSS,
max queue sizes).

Until this delay model (sessions before 2026-12-01) each producer slept before it
published, which serialised the policy worker's publications: figures from then and
now are not comparable.

    python benchmarks/rollout_async.py [--quick] [--halves N] [--ranks 4] [--jitter-us 200]

Memory does not grow with the run's length (keys and PRNG keys are made one training step
at a time): compare ``--halves 100000`` with ``--halves 1000000`` (peak RSS).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
from collect import machine  # noqa: E402

import jaxtraj  # noqa: E402
from jaxtraj import EnvTransition, PolicyOutput, TrajectoryKey, TrajectoryPlan  # noqa: E402
from jaxtraj.runners.threads import AsyncRunner, EnvStep  # noqa: E402

B, K, A = 2, 1, 1
T, E = 25, 2


class CounterEnv:
    """Observation ``[rank, chunks executed]``; reward 1 per action; no episode ends."""

    def __init__(self, rank):
        self.rank, self.n = rank, 0

    def obs(self):
        return {"state": np.array([[self.rank, self.n]] * B, np.float32)}

    def reset(self):
        self.n = 0
        return self.obs()

    def step(self, key, actions):
        self.n += 1
        z = np.zeros((B,), bool)
        return EnvStep(
            transition=EnvTransition(
                rewards=np.ones((B,), np.float32), terminations=z, truncations=z
            ),
            obs=self.obs(),
            final_values=np.zeros((B,), np.float32),
        )


def policy_fn(params, obs, rng):
    s = obs["state"]
    return PolicyOutput(
        actions=np.zeros((s.shape[0], K, A), np.float32),
        prev_logprobs=np.zeros((s.shape[0], K, A), np.float32),
        prev_values=np.zeros((s.shape[0],), np.float32),
        versions=np.zeros((s.shape[0],), np.int32),
    )


def examples():
    key = TrajectoryKey(0, 0, 0, 0, 0)
    env = CounterEnv(0)
    obs = env.reset()
    out = policy_fn(None, obs, None)
    st = env.step(key, out.actions)
    src = jaxtraj.TrajectorySource(key, B, 0)
    return (
        jaxtraj.PolicyPart(src, obs, out),
        jaxtraj.EnvPart(
            src,
            st.transition,
            initial_transition=st.transition.boundary(),
            final_values=st.final_values,
        ),
    )


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run(halves, ranks, jitter_s, queue_size, seed=0):
    per_step = 2 * ranks * E * T
    steps = max(1, -(-halves // per_step))
    plan = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B, num_env_ranks=ranks)
    collector = jaxtraj.TrajectoryCollector(plan, *examples())
    counted = {"halves": 0, "trajectories": 0, "bad": 0}
    seen = set()
    expect_n = np.arange(1, E * T + 1, dtype=np.float32).reshape(E, T)  # per step, offset below

    def on_flush(queue_key, traj):
        s, r = int(traj.step_id), int(traj.env_rank)
        seen.add((s, r))
        counted["trajectories"] += 1
        counted["halves"] += 2 * E * T
        n = np.asarray(traj.obs["state"])[:, :, 0, 1]  # [E, T]: chunks executed before
        if not np.array_equal(n + 1, expect_n + s * E * T):
            counted["bad"] += 1

    runner = AsyncRunner(
        collector,
        [CounterEnv(r) for r in range(ranks)],
        policy_fn,
        None,
        num_steps=steps,
        seed=seed,
        on_flush=on_flush,
        queue_size=queue_size,
        jitter_s=jitter_s,
    )
    rss0 = peak_rss_mib()
    t0 = time.perf_counter()
    runner.run()
    dt = time.perf_counter() - t0
    total = steps * per_step
    assert counted["halves"] == total, (counted, total)  # none lost
    assert len(seen) == steps * ranks and counted["bad"] == 0, counted
    assert runner.max_qsize["parts"] <= queue_size  # the bounded one
    return {
        "halves": total,
        "steps": steps,
        "env_ranks": ranks,
        "parts_per_step_per_rank": 2 * E * T,
        "part_shapes": {"B": B, "K": K, "A": A, "obs": [2]},
        "jitter_s": jitter_s,
        "queue_size": queue_size,
        "seconds": dt,
        "halves_per_s": total / dt,
        "us_per_half": 1e6 * dt / total,
        "trajectories_flushed": counted["trajectories"],
        "halves_counted_in_flushed": counted["halves"],
        "lost": total - counted["halves"],
        "max_queue_sizes": dict(runner.max_qsize),
        "peak_rss_mib_before": rss0,
        "peak_rss_mib_after": peak_rss_mib(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10,000 halves")
    parser.add_argument("--halves", type=int, default=None)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--jitter-us", type=float, default=200.0)
    parser.add_argument("--queue-size", type=int, default=64)
    parser.add_argument("--out", default=str(HERE / "results" / "rollout_async.json"))
    args = parser.parse_args()
    halves = args.halves or (10_000 if args.quick else 100_000)
    # Warm-up: compile the collector's inserts and flush once (not timed).
    run(2 * args.ranks * E * T, args.ranks, 0.0, args.queue_size)
    res = run(halves, args.ranks, args.jitter_us * 1e-6, args.queue_size)
    res["machine"] = machine()
    res["jax_backend"] = jax.default_backend()
    out = pathlib.Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(
        f"{res['halves']} halves in {res['seconds']:.2f} s: {res['halves_per_s']:.0f} halves/s "
        f"({res['us_per_half']:.1f} us/half), lost {res['lost']}, "
        f"max queues {res['max_queue_sizes']}, peak RSS {res['peak_rss_mib_after']:.0f} MiB"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
