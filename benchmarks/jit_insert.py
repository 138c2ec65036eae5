"""Inserts under ``jit``: jaxtraj's ``add_policy`` + ``add_env`` against flashbax's ``add`` of
the same joined chunk, inside one ``lax.scan`` over the chunks of a step and call by call.

A camera-sized step (``B = 32`` environments, ``T = 48`` chunks, a 96x96x3 ``uint8`` image and a
small state per observation, ``K = 4`` actions of 6): the chunks are on the device, stacked
``[T, B, ...]``; each configuration writes all of them into its buffers:

- ``memcpy``: a device copy of the same bytes into a donated buffer (the floor; and a NumPy
  ``copyto`` into a preallocated host array);
- ``dus``: a plain ``dynamic_update_slice`` of the joined chunk into ``[T, B, ...]`` buffers;
- ``flashbax``: ``flashbax.make_trajectory_buffer``'s ``add`` of the joined chunk (``[B, 1, ...]``);
- ``jaxtraj``: ``jaxtraj.add_policy`` then ``jaxtraj.add_env`` of the two halves.

In the scan, everything is one jitted call with the buffers donated; call by call, each
insert is its own jitted call with the state donated (a training loop that inserts as parts
arrive). Rounds alternate the configurations; medians. Writes ``benchmarks/results/
jit_insert.json``.

    pip install flashbax      # the peer (the bench extra has it)
    python benchmarks/jit_insert.py [--quick] [--B 32] [--T 48]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from collect import machine  # noqa: E402
from jax import lax  # noqa: E402

import jaxtraj  # noqa: E402
from jaxtraj import EnvTransition, PolicyOutput, PolicyPart, TrajectoryKey, TrajectorySource  # noqa: E402

K, A, H = 4, 6, 96


def halves(B, T, seed=0):
    """Every chunk's two halves, stacked ``[T, ...]``, on the device; chunk 0's env half
    with ``initial_transition`` (every chunk's, for one scan: ``add_env_uniform``)."""
    rng = np.random.default_rng(seed)
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    t = jnp.arange(T, dtype=jnp.int32)
    key = TrajectoryKey(i32(np.zeros(T)), i32(np.zeros(T)), i32(np.zeros(T)), i32(np.zeros(T)), t)
    src = TrajectorySource(key, i32(np.full(T, B)), i32(np.zeros(T)))
    obs = {
        "image": jnp.asarray(rng.integers(0, 255, (T, B, H, H, 3), dtype=np.uint8)),
        "state": jnp.asarray(rng.normal(size=(T, B, 16)).astype(np.float32)),
    }
    out = PolicyOutput(
        actions=jnp.asarray(rng.normal(size=(T, B, K, A)).astype(np.float32)),
        prev_logprobs=jnp.asarray(rng.normal(size=(T, B, K, A)).astype(np.float32)),
        prev_values=jnp.asarray(rng.normal(size=(T, B)).astype(np.float32)),
        versions=jnp.zeros((T, B), jnp.int32),
    )
    flags = jnp.zeros((T, B, K), bool)
    tr = EnvTransition(
        rewards=jnp.asarray(rng.normal(size=(T, B, K)).astype(np.float32)),
        terminations=flags,
        truncations=flags,
    )
    env = jaxtraj.EnvPart(
        src,
        tr,
        initial_transition=EnvTransition(terminations=flags, truncations=flags),
        final_values=jnp.zeros((T, B), jnp.float32),
    )
    return PolicyPart(src, obs, out), env


def one(tree, t):
    return jax.tree.map(lambda x: x[t], tree)


def joined(policy, env):
    """The joined chunk as flashbax and the plain write take it (leaves ``[T, B, ...]``)."""
    return {
        "obs": policy.obs,
        "actions": policy.output.actions,
        "prev_logprobs": policy.output.prev_logprobs,
        "prev_values": policy.output.prev_values,
        "versions": policy.output.versions,
        "rewards": env.transition.rewards,
        "terminations": env.transition.terminations,
        "truncations": env.transition.truncations,
        "final_values": env.final_values,
    }


def nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="B=8, T=12, 3 rounds")
    p.add_argument("--B", type=int, default=32)
    p.add_argument("--T", type=int, default=48)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default=str(HERE / "results" / "jit_insert.json"))
    args = p.parse_args()
    if args.quick:
        args.B, args.T, args.rounds = 8, 12, 3
    B, T = args.B, args.T
    try:
        import flashbax as fbx
    except ImportError:
        fbx = None
        print("flashbax is not installed: its rows are skipped (pip install flashbax)")

    policy, env = halves(B, T)
    plan = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B)
    example = (one(policy, 0), one(env, 0))
    chunk = joined(policy, env)
    size = nbytes(chunk)

    # -- inside one lax.scan over the chunks --------------------------------------------------
    def scan_jaxtraj(state, policy, env):
        def body(st, x):
            p, e = x
            st = jaxtraj.add_policy(plan, st, p)
            return jaxtraj.add_env_uniform(plan, st, e), None

        return lax.scan(body, state, (policy, env))[0]

    def scan_dus(buf, chunk):
        def body(b, x):
            t, c = x
            return jax.tree.map(lambda bb, cc: lax.dynamic_update_index_in_dim(bb, cc, t, 0), b, c), None

        return lax.scan(body, buf, (jnp.arange(T), chunk))[0]

    def copy(dst, chunk):  # into a donated buffer, as the inserts write into theirs
        return jax.tree.map(lambda d, x: d.at[:].set(x), dst, chunk)

    fresh_state = lambda: jaxtraj.init(plan, *example)  # noqa: E731
    fresh_dus = lambda: jax.tree.map(jnp.zeros_like, chunk)  # noqa: E731
    configs = {
        "memcpy": (jax.jit(copy, donate_argnums=0), lambda: (fresh_dus(), chunk)),
        "dus": (jax.jit(scan_dus, donate_argnums=0), lambda: (fresh_dus(), chunk)),
        "jaxtraj": (jax.jit(scan_jaxtraj, donate_argnums=0), lambda: (fresh_state(), policy, env)),
    }
    if fbx is not None:
        buffer = fbx.make_trajectory_buffer(
            add_batch_size=B,
            sample_batch_size=1,
            sample_sequence_length=1,
            period=1,
            min_length_time_axis=1,
            max_length_time_axis=T,
        )
        one_step = jax.tree.map(lambda x: x[0, 0], chunk)  # one transition, no batch axis

        def scan_flashbax(bstate, chunk):
            def body(s, c):
                return buffer.add(s, jax.tree.map(lambda x: x[:, None], c)), None

            return lax.scan(body, bstate, chunk)[0]

        configs["flashbax"] = (
            jax.jit(scan_flashbax, donate_argnums=0),
            lambda: (buffer.init(one_step), chunk),
        )

    def timed(fn, make):
        args_ = make()
        jax.block_until_ready(args_)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args_))
        return time.perf_counter() - t0

    scan_s = {n: [] for n in configs}
    for fn, make in configs.values():
        timed(fn, make)  # compile
    st = configs["jaxtraj"][0](fresh_state(), policy, env)
    jaxtraj.raise_if_error(st)
    assert bool(jaxtraj.rollout.ready(st)), "the scan left the step incomplete"
    for r in range(args.rounds):
        names = list(configs)
        names = names[r % len(names) :] + names[: r % len(names)]
        for n in names:
            scan_s[n].append(timed(*configs[n]))
    scan = {n: float(np.median(v)) for n, v in scan_s.items()}
    host = [np.asarray(x) for x in jax.tree.leaves(chunk)]
    dst = [np.empty_like(x) for x in host]
    for d, x in zip(dst, host):
        np.copyto(d, x)  # touch the destination
    numpy_s = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for d, x in zip(dst, host):
            np.copyto(d, x)
        numpy_s.append(time.perf_counter() - t0)
    scan["numpy copyto (host)"] = float(np.median(numpy_s))

    # -- call by call ----------------------------------------------------------------------
    add_policy = jax.jit(jaxtraj.add_policy, static_argnums=0, donate_argnums=1)
    add_env = jax.jit(jaxtraj.add_env, static_argnums=0, donate_argnums=1)
    ready = jax.jit(jaxtraj.rollout.ready)
    policies = [one(policy, t) for t in range(T)]
    envs = [one(env, t) for t in range(T)]
    envs = [e if t == 0 else e.replace(initial_transition=None) for t, e in enumerate(envs)]
    chunks = [one(chunk, t) for t in range(T)]

    def calls_jaxtraj():
        st = fresh_state()
        jax.block_until_ready(st)
        t0 = time.perf_counter()
        for p, e in zip(policies, envs):
            st = add_policy(plan, st, p)
            st = add_env(plan, st, e)
        done = ready(st)
        jax.block_until_ready((st, done))
        return time.perf_counter() - t0, st

    call_fns = {"jaxtraj": calls_jaxtraj}
    if fbx is not None:
        add = jax.jit(buffer.add, donate_argnums=0)
        steps = [jax.tree.map(lambda x: x[:, None], c) for c in chunks]

        def calls_flashbax():
            s = buffer.init(one_step)
            jax.block_until_ready(s)
            t0 = time.perf_counter()
            for c in steps:
                s = add(s, c)
            jax.block_until_ready(s)
            return time.perf_counter() - t0, s

        call_fns["flashbax"] = calls_flashbax
    for f in call_fns.values():
        f()
    _, st = calls_jaxtraj()
    jaxtraj.raise_if_error(st)
    call_s = {n: [] for n in call_fns}
    for r in range(args.rounds):
        names = list(call_fns)[r % len(call_fns) :] + list(call_fns)[: r % len(call_fns)]
        for n in names:
            call_s[n].append(call_fns[n]()[0])
    calls = {n: float(np.median(v)) for n, v in call_s.items()}

    res = {
        "benchmark": "jit_insert",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "jax_backend": jax.default_backend(),
        "jax": jax.__version__,
        "shapes": {"B": B, "T": T, "K": K, "A": A, "image": [H, H, 3], "step_bytes": size},
        "rounds": args.rounds,
        "scan_s": scan,
        "calls_s": calls,
        "ratios": {
            "scan_jaxtraj_over_memcpy": scan["jaxtraj"] / scan["memcpy"],
            "scan_jaxtraj_over_dus": scan["jaxtraj"] / scan["dus"],
        },
    }
    if fbx is not None:
        res["ratios"].update(
            scan_jaxtraj_over_flashbax=scan["jaxtraj"] / scan["flashbax"],
            scan_flashbax_over_memcpy=scan["flashbax"] / scan["memcpy"],
            calls_jaxtraj_over_flashbax=calls["jaxtraj"] / calls["flashbax"],
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    mb = size / 1e6
    print(f"step: B={B} T={T}, {mb:.1f} MB; {machine()['cpu_model']}, {jax.default_backend()}")
    print("| in one lax.scan | ms | x memcpy |\n|---|---|---|")
    for n, v in scan.items():
        print(f"| {n} | {1e3 * v:.2f} | {v / scan['memcpy']:.2f} |")
    print("| call by call (T chunks) | ms | per chunk us |\n|---|---|---|")
    for n, v in calls.items():
        print(f"| {n} | {1e3 * v:.2f} | {1e6 * v / T:.0f} |")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
