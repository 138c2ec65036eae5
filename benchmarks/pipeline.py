"""Pipeline flush: one epoch of every source to advantage-ready micro-batches, against a
plain copy of the same bytes.

Two flushes, interleaved: into fresh buffers, and recycling the micro-batches of the
previous flush (``recycle``, donated), as a training loop does once the Actor has
consumed them.

The state holds S sources x T chunks x B environments of realistic embodied parts (as
in ``benchmarks/collect.py``: a 64x64x3 image, a 32-float state, 8x7 actions and
log-probabilities, a value, 256 tokens, 8 action-level rewards). The flush computes
GAE, normalises advantages over every source, shuffles, and packs micro-batches for
the Actor ranks. Compile time is reported apart from run time.

    python benchmarks/pipeline.py [--quick] [--S 2 --T 64 --B 64] [--actor-ranks 4]
                                  [--micro-batch-size 256]

Writes ``benchmarks/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np
from collect import examples, machine, make_parts, nbytes

import jaxtraj
from jaxtraj import TrajectoryPlan


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline.json")
    )
    parser.add_argument("--S", type=int, default=None, help="sources (env ranks); default 2")
    parser.add_argument("--T", type=int, default=None, help="chunks; default 64 (--quick: 16)")
    parser.add_argument("--B", type=int, default=None, help="environments; default 64 (--quick: 16)")
    parser.add_argument("--actor-ranks", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=256)
    args = parser.parse_args()
    S, T, B = (2, 16, 16) if args.quick else (2, 64, 64)
    S, T, B = args.S or S, args.T or T, args.B or B
    repeats = 2 if args.quick else args.repeats
    plan = TrajectoryPlan(
        num_chunks=T,
        batch_size=B,
        num_env_ranks=S,
        mode="pipeline",
        actor_ranks=args.actor_ranks,
        micro_batch_size=args.micro_batch_size,
    )
    parts = []
    for r in range(S):
        for p in make_parts(B, T, seed=r):
            key = p.source.key.replace(env_rank=r)
            parts.append(p.replace(source=p.source.replace(key=key)))
    c = jaxtraj.TrajectoryCollector(plan, *examples(parts), auto_flush=False)
    c.add_many(parts)
    assert c.ready() == [0]
    state = jax.block_until_ready(jax.device_put(c.states[0]))
    flush = jaxtraj.pipeline.make_flush(plan)
    mode_state = jaxtraj.pipeline.init(plan, jax.random.PRNGKey(0))

    t0 = time.perf_counter()
    compiled = (
        jax.jit(lambda st, m, e: jaxtraj.pipeline.flush(plan, st, m, e), donate_argnums=0)
        .lower(state, mode_state, 0)
        .compile()
    )
    compile_s = time.perf_counter() - t0
    del compiled

    # Interleaved, round by round, so that every contender meets the same machine load: a
    # flush into fresh buffers, one that recycles the micro-batches of the previous flush
    # (donated: the Actor has consumed them), a memory copy of the packed bytes and a
    # jitted JAX copy of them into a new buffer.
    state = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))
    batches, state, _ = flush(state, mode_state, 0)
    spare = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), batches))
    out_bytes = sum(x.nbytes for x in jax.tree.leaves(batches))
    del batches
    src = np.random.default_rng(0).integers(0, 255, out_bytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    src_dev, jcopy = jax.device_put(src), jax.jit(lambda x: x.copy())
    jax.block_until_ready(jcopy(src_dev))
    times = {"fresh": [], "recycled": [], "memcpy": [], "jax_copy": []}
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        batches, state, _ = flush(state, mode_state, 0)  # the same epoch again each time
        jax.block_until_ready(batches)
        times["fresh"].append(time.perf_counter() - t0)
        del batches
        t0 = time.perf_counter()
        spare, state, _ = flush(state, mode_state, 0, 0, spare)
        jax.block_until_ready(spare)
        times["recycled"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times["memcpy"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(jcopy(src_dev))
        times["jax_copy"].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
    flush_ms, recycled_ms, copy_ms, jax_copy_ms = (
        ms["fresh"], ms["recycled"], ms["memcpy"], ms["jax_copy"]
    )
    report = {
        "benchmark": "pipeline",
        "machine": machine(),
        "epoch": {
            "S": S,
            "T": T,
            "B": B,
            "samples": S * T * B,
            "actor_ranks": args.actor_ranks,
            "micro_batch_size": args.micro_batch_size,
            "in_bytes": nbytes(parts),
            "out_bytes": out_bytes,
        },
        "flush_ms": flush_ms,
        "recycled_flush_ms": recycled_ms,
        "memcpy_ms": copy_ms,
        "x_memcpy": flush_ms / copy_ms,
        "recycled_x_memcpy": recycled_ms / copy_ms,
        "jax_copy_ms": jax_copy_ms,
        "x_jax_copy": flush_ms / jax_copy_ms,
        "compile_s": compile_s,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"pipeline flush S={S} T={T} B={B} ({out_bytes / 2**20:.1f} MiB packed): into fresh "
        f"buffers {flush_ms:.2f} ms ({flush_ms / copy_ms:.2f}x memcpy, {flush_ms / jax_copy_ms:.2f}x "
        f"a fresh jax copy), recycling the previous batches {recycled_ms:.2f} ms "
        f"({recycled_ms / copy_ms:.2f}x memcpy); memcpy {copy_ms:.2f} ms, fresh jax copy "
        f"{jax_copy_ms:.2f} ms; compile {compile_s:.2f} s"
    )


if __name__ == "__main__":
    main()
