"""GAE kernels: jaxtraj against its peers and a memory copy, side by side in one process.

For each ``[T, B]`` (time-major, ``B`` trajectories) the same float32 rewards ``[T, B]``,
values ``[T+1, B]`` and boolean dones ``[T+1, B]`` go to every implementation, which returns
advantages and returns ``[T, B]`` (RLinf's recurrence; see ``jaxtraj.advantages``):

- ``jaxtraj auto`` and each ``jaxtraj`` method (``inplace``, ``scan``, ``associative``);
- ``rlax``: ``rlax.truncated_generalized_advantage_estimation`` under ``jax.vmap`` over B,
  with ``discount_t = gamma * (1 - d_{t+1})``, returns added in the same jitted function;
- ``lax.scan (Brax)`` and ``lax.scan (PureJaxRL)``: the Brax/PureJaxRL idiom, a reverse
  ``lax.scan`` over ``(done, value, reward)`` carrying ``(gae, next_value)``; plain, and with
  ``unroll=16`` as PureJaxRL has it;
- ``numpy loop``: a reverse Python loop over T, vectorised over B;
- ``torch loop (RLinf)``: the same loop on torch CPU tensors, RLinf's style;
- ``torchrl``: ``torchrl.objectives.value.functional.generalized_advantage_estimate``, given
  its native batch-first ``[B, T, 1]`` layout (the transposes are not timed);
- ``copy (numpy)``: ``np.copyto`` of rewards, values and dones into preallocated arrays of
  the same size, the bytes GAE must read, written once; ``copy (jax)``: the same copy as a
  jitted function, which, like every JAX kernel here, allocates fresh output buffers.

A peer that is not installed is reported as ``missing``. Every output is checked against
the NumPy loop (``assert_allclose``, float32 tolerance) before it is timed. Compile time
(``jit(...).lower(...).compile()``) is reported apart from run time, which is the median of
several calls after a warm-up, each ended by ``block_until_ready``; the calls run in
blocks per implementation, and the blocks of all implementations alternate over several
passes, so that drift in the machine's speed hits all alike.

Each implementation is timed warm and cold. Warm: the same inputs, call after call, so
inputs, outputs and the dispatch path sit in cache. Cold, as a training loop sees GAE
between a rollout and an update: before every timed call a flush writes a buffer of
``--flush-mb`` MiB (default 64, twice this machine's 32 MiB L3) with NumPy on the host and,
on an accelerator, with a jitted kernel on the device, which evicts the inputs, the last
outputs and the runtime's own data from the caches; and the call takes the next of
``--cold-sets`` separate copies of the inputs (distinct buffers, same values), so it never
reads the buffers the previous call read. The flush is not timed. ``--modes warm`` or
``--modes cold`` measures one only.

Fresh memory is not free: a JAX function allocates its outputs anew on every call, and
the first touch of each fresh 4 KiB page is a page fault (the ``faults`` column: minor
faults during one call). At ``[512, 16384]`` the 64 MB of outputs are about 16k faults,
which on a virtual machine can cost as much as the copy itself and vary from run to run.
The NumPy and torch loops allocate their results and pay them too; ``copy (numpy)``
writes into preallocated arrays and does not, ``copy (jax)`` does.

JAX's CPU client normally runs a computation on a worker thread; on small machines waking
that thread adds tens of microseconds of noise to every call. The benchmark therefore
disables CPU async dispatch (``jax_cpu_enable_async_dispatch``) for all JAX rows alike;
``--async-dispatch`` keeps the default.

    python benchmarks/gae.py [--quick] [--sizes 64x256,2048x64] [--modes warm,cold]
                             [--peers jaxtraj,rlax] [--min-time 1.0]

Writes ``benchmarks/results/gae.json`` (``gae_quick.json`` with ``--quick``) and prints a
table: warm and cold time in ms and the ratios to both copies and to the fastest peer
(jaxtraj rows and copies excluded from "peer"), warm and cold apart.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtraj import advantages

SIZES = [(64, 4), (64, 256), (128, 256), (256, 4096), (512, 16384), (2048, 2), (2048, 64)]
QUICK_SIZES = [(16, 32), (64, 256), (128, 1024)]
GAMMA, LAM = 0.99, 0.95
JAXTRAJ = ["jaxtraj auto"] + [f"jaxtraj {m}" for m in advantages.METHODS]
COPIES = ["copy (numpy)", "copy (jax)"]


class Missing(Exception):
    """A peer that is not installed (or does not import)."""


# ----------------------------------------------------------------------------- data


def make_data(T: int, B: int, seed: int, done_prob: float):
    rng = np.random.default_rng(seed)
    rewards = rng.standard_normal((T, B), dtype=np.float32)
    values = rng.standard_normal((T + 1, B), dtype=np.float32)
    dones = rng.random((T + 1, B)) < done_prob
    return rewards, values, dones


def numpy_loop(rewards, values, dones, gamma=GAMMA, lam=LAM):
    """The reference: a reverse loop over time, vectorised over the batch."""
    T = rewards.shape[0]
    adv = np.empty_like(rewards)
    a = np.zeros_like(rewards[0])
    for t in range(T - 1, -1, -1):
        not_done = 1.0 - dones[t + 1].astype(np.float32)
        delta = rewards[t] + gamma * values[t + 1] * not_done - values[t]
        a = delta + gamma * lam * not_done * a
        adv[t] = a
    return adv, adv + values[:-1]


# ----------------------------------------------------------------------------- peers
#
# Each factory takes the NumPy inputs and returns (run, to_numpy): ``run()`` computes
# advantages and returns on inputs already in the peer's native form and blocks until they
# are ready; ``to_numpy(out)`` converts its result to NumPy ``(adv [T, B], ret [T, B])``.
# A factory for a JAX peer also returns its jitted function and device arguments, for the
# compile-time measurement.


def _jax_peer(fn, rewards, values, dones):
    args = tuple(jnp.asarray(x) for x in (rewards, values, dones))
    jitted = jax.jit(fn)

    def run():
        return jax.block_until_ready(jitted(*args))

    def to_numpy(out):
        return tuple(np.asarray(x) for x in out[:2])

    return run, to_numpy, (jitted, args)


def jaxtraj_peer(method):
    def factory(rewards, values, dones):
        fn = functools.partial(advantages.gae, gamma=GAMMA, lam=LAM, method=method)
        return _jax_peer(fn, rewards, values, dones)

    return factory


def rlax_peer(rewards, values, dones):
    try:
        import rlax
    except Exception as e:  # noqa: BLE001 - report any import failure as missing
        raise Missing(f"{type(e).__name__}: {e}") from e
    gae_b = jax.vmap(
        rlax.truncated_generalized_advantage_estimation, in_axes=(1, 1, None, 1), out_axes=1
    )

    def fn(r, v, d):
        discount = GAMMA * (1.0 - d[1:].astype(r.dtype))
        adv = gae_b(r, discount, LAM, v)
        return adv, adv + v[:-1]

    return _jax_peer(fn, rewards, values, dones)


def lax_scan_peer(unroll):
    """A reverse ``lax.scan``: Brax's ``compute_gae`` idiom, PureJaxRL's with ``unroll=16``."""

    def factory(rewards, values, dones):
        return _jax_peer(functools.partial(_lax_scan_gae, unroll=unroll), rewards, values, dones)

    return factory


def _lax_scan_gae(r, v, d, unroll):
    def step(carry, x):
        gae, next_value = carry
        done, value, reward = x
        not_done = 1.0 - done.astype(reward.dtype)
        delta = reward + GAMMA * next_value * not_done - value
        gae = delta + GAMMA * LAM * not_done * gae
        return (gae, value), gae

    init = (jnp.zeros_like(v[-1]), v[-1])
    _, adv = lax.scan(step, init, (d[1:], v[:-1], r), reverse=True, unroll=unroll)
    return adv, adv + v[:-1]


def numpy_peer(rewards, values, dones):
    return (lambda: numpy_loop(rewards, values, dones)), (lambda out: out), None


def _torch():
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        raise Missing(f"{type(e).__name__}: {e}") from e
    return torch


def torch_loop_peer(rewards, values, dones):
    torch = _torch()
    r, v = torch.from_numpy(rewards), torch.from_numpy(values)
    d = torch.from_numpy(dones)

    def run():
        T = r.shape[0]
        adv = torch.zeros_like(r)
        gae = torch.zeros_like(r[0])
        not_done = 1.0 - d.float()
        for t in reversed(range(T)):
            delta = r[t] + GAMMA * v[t + 1] * not_done[t + 1] - v[t]
            gae = delta + GAMMA * LAM * not_done[t + 1] * gae
            adv[t] = gae
        return adv, adv + v[:-1]

    return run, (lambda out: tuple(x.numpy() for x in out)), None


def torchrl_peer(rewards, values, dones):
    torch = _torch()
    try:
        from torchrl.objectives.value.functional import generalized_advantage_estimate
    except Exception as e:  # noqa: BLE001
        raise Missing(f"{type(e).__name__}: {e}") from e

    def batch_first(x):  # [T, B] -> [B, T, 1], contiguous
        return torch.from_numpy(np.ascontiguousarray(x.T)[..., None])

    value, next_value = batch_first(values[:-1]), batch_first(values[1:])
    reward, done = batch_first(rewards), batch_first(dones[1:])

    def run():
        return generalized_advantage_estimate(
            GAMMA, LAM, value, next_value, reward, done, done, time_dim=-2
        )

    def to_numpy(out):
        return tuple(x[..., 0].numpy().T for x in out)

    return run, to_numpy, None


def numpy_copy_peer(rewards, values, dones):
    outs = [np.empty_like(x) for x in (rewards, values, dones)]

    def run():
        for src, dst in zip((rewards, values, dones), outs, strict=True):
            np.copyto(dst, src)
        return outs

    return run, None, None


def jax_copy_peer(rewards, values, dones):
    fn = lambda r, v, d: (jnp.copy(r), jnp.copy(v), jnp.copy(d))
    run, _, compile_args = _jax_peer(fn, rewards, values, dones)
    return run, None, compile_args


PEERS: dict[str, Callable[..., Any]] = {
    **{name: jaxtraj_peer(name.split()[1]) for name in JAXTRAJ},
    "rlax (vmap)": rlax_peer,
    "lax.scan (Brax)": lax_scan_peer(1),
    "lax.scan (PureJaxRL)": lax_scan_peer(16),
    "numpy loop": numpy_peer,
    "torch loop (RLinf)": torch_loop_peer,
    "torchrl": torchrl_peer,
    "copy (numpy)": numpy_copy_peer,
    "copy (jax)": jax_copy_peer,
}


# ----------------------------------------------------------------------------- measuring


class Flush:
    """Evicts caches between cold calls: writes ``mb`` MiB on the host and on the device."""

    def __init__(self, mb: float):
        n = max(1, int(mb * 2**20) // 8)
        self.host = np.zeros(n, np.float64)
        self.device = None
        if jax.default_backend() != "cpu":
            self.bump = jax.jit(lambda b: b + 1.0, donate_argnums=0)
            self.device = jnp.zeros(2 * n, jnp.float32)

    def __call__(self) -> None:
        np.add(self.host, 1.0, out=self.host)
        if self.device is not None:
            self.device = jax.block_until_ready(self.bump(self.device))


def _stats(samples: list[float], prefix: str) -> dict:
    return {
        f"{prefix}_ms": 1e3 * statistics.median(samples),
        f"{prefix}_ms_min": 1e3 * min(samples),
        f"{prefix}_ms_p25": 1e3 * float(np.percentile(samples, 25)),
        f"{prefix}_ms_p75": 1e3 * float(np.percentile(samples, 75)),
    }


def measure_size(T: int, B: int, args, peers: dict[str, Callable[..., Any]]) -> list[dict]:
    rewards, values, dones = make_data(T, B, args.seed, args.done_prob)
    ref_adv, ref_ret = numpy_loop(rewards, values, dones)
    warm, cold = "warm" in args.modes, "cold" in args.modes
    flush = Flush(args.flush_mb) if cold else None
    rows, runs = [], {}
    for name, factory in peers.items():
        row = {"peer": name, "T": T, "B": B, "status": "ok"}
        rows.append(row)
        try:
            run, to_numpy, compile_args = factory(rewards, values, dones)
            # Cold calls rotate over separate copies of the inputs (the first is ``run``).
            cold_runs = [run] + [
                factory(*(np.array(x) for x in (rewards, values, dones)))[0]
                for _ in range(args.cold_sets - 1 if cold else 0)
            ]
        except Missing as e:
            row.update(status="missing", reason=str(e))
            continue
        if compile_args is not None:
            jitted, jargs = compile_args
            t0 = time.perf_counter()
            jitted.lower(*jargs).compile()
            row["compile_ms"] = 1e3 * (time.perf_counter() - t0)
        out = run()  # warm-up (and, under jit, the first compile of the call path)
        if to_numpy is not None:
            adv, ret = to_numpy(out)
            np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-4, err_msg=name)
            np.testing.assert_allclose(ret, ref_ret, rtol=1e-4, atol=1e-4, err_msg=name)
        del out
        for r in cold_runs[1:]:
            r()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        run()
        first = time.perf_counter() - t0
        row["page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        n = int(min(args.max_reps, max(args.min_reps, args.min_time / max(first, 1e-6))))
        n_cold = min(n, args.max_cold_reps)
        runs[name] = (run, cold_runs, n if warm else 0, n_cold if cold else 0, [first], [])
    # Interleaved passes: in each, every implementation runs a block of consecutive warm
    # calls (its first call after a switch is dropped: it pays for the caches the previous
    # implementation left behind), then a block of cold calls, each after a flush, so that
    # drift in the machine's speed hits all alike.
    k = 0
    for _ in range(args.passes):
        for run, cold_runs, n, n_cold, samples, cold_samples in runs.values():
            if n:
                run()
            for _ in range(-(-n // args.passes)):
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
            for _ in range(-(-n_cold // args.passes)):
                k += 1
                r = cold_runs[k % len(cold_runs)]
                flush()
                t0 = time.perf_counter()
                r()
                cold_samples.append(time.perf_counter() - t0)
    for row in rows:
        if row["peer"] in runs:
            *_, n, n_cold, samples, cold_samples = runs[row["peer"]]
            if n:
                row.update(_stats(samples, "run"), reps=len(samples))
            if n_cold:
                row.update(_stats(cold_samples, "cold"), cold_reps=len(cold_samples))
    for key, suffix in (("run_ms", ""), ("cold_ms", "_cold")):
        ok = {r["peer"]: r[key] for r in rows if key in r}
        others = {k: t for k, t in ok.items() if k not in JAXTRAJ and k not in COPIES}
        best = min(others, key=others.get) if others else None
        for row in rows:
            if key not in row:
                continue
            for ratio, ref in (("vs_copy_numpy", "copy (numpy)"), ("vs_copy_jax", "copy (jax)")):
                if ref in ok:
                    row[ratio + suffix] = row[key] / ok[ref]
            if best is not None:
                row["vs_best_peer" + suffix] = row[key] / others[best]
                row["best_peer" + suffix] = best
    return rows


def machine_info(args) -> dict:
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "jax_cpu_async_dispatch": bool(args.async_dispatch),
        "env": {
            k: os.environ.get(k)
            for k in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS", "XLA_FLAGS")
        },
        "versions": {d: version(d) for d in ("jax", "jaxlib", "numpy", "rlax", "torch", "torchrl")},
    }
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            info["transparent_hugepages"] = f.read().strip()
    except OSError:
        pass
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
    except Exception:  # noqa: BLE001
        pass
    return info


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'implementation':<22} {'compile ms':>10} {'warm ms':>9} {'/copy np':>8} "
        f"{'/copy jax':>9} {'/best':>6} {'cold ms':>9} {'/best':>6} {'faults':>7}"
    )
    T, B = rows[0]["T"], rows[0]["B"]
    best = next((r["best_peer"] for r in rows if "best_peer" in r), None)
    best_cold = next((r["best_peer_cold"] for r in rows if "best_peer_cold" in r), None)
    print(f"\n[T, B] = [{T}, {B}]   (best peer warm: {best}; cold: {best_cold})")
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['peer']:<22} missing: {r.get('reason', '')[:60]}")
            continue
        f = lambda key, fmt: (
            format(r[key], fmt) if key in r else format("-", ">" + fmt.split(".")[0])
        )
        print(
            f"{r['peer']:<22} {f('compile_ms', '10.1f')} {f('run_ms', '9.3f')} "
            f"{f('vs_copy_numpy', '8.2f')} {f('vs_copy_jax', '9.2f')} {f('vs_best_peer', '6.2f')} "
            f"{f('cold_ms', '9.3f')} {f('vs_best_peer_cold', '6.2f')} {f('page_faults', '7d')}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    p.add_argument("--sizes", help="override sizes as TxB, e.g. 64x256,2048x65536")
    p.add_argument("--modes", default="warm,cold", help="warm, cold or both (comma-separated)")
    p.add_argument(
        "--peers",
        help="only implementations whose name contains one of these (comma-separated), "
        "e.g. jaxtraj,rlax,lax.scan,copy; default all",
    )
    p.add_argument("--flush-mb", type=float, default=64.0, help="cache flush before cold calls")
    p.add_argument("--cold-sets", type=int, default=4, help="input copies cold calls rotate over")
    p.add_argument("--max-cold-reps", type=int, default=100)
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of runs per entry")
    p.add_argument("--min-reps", type=int, default=7)
    p.add_argument("--max-reps", type=int, default=400)
    p.add_argument("--passes", type=int, default=5, help="interleaved passes over all")
    p.add_argument("--done-prob", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-dispatch", action="store_true", help="keep JAX's CPU async dispatch")
    p.add_argument("--out", help="JSON path (default benchmarks/results/gae[_quick].json)")
    args = p.parse_args()
    jax.config.update("jax_cpu_enable_async_dispatch", bool(args.async_dispatch))
    if args.sizes:
        sizes = [tuple(int(n) for n in s.split("x")) for s in args.sizes.split(",")]
    else:
        sizes = QUICK_SIZES if args.quick else SIZES
    if args.quick:
        args.min_time = min(args.min_time, 0.1)
    args.modes = {m.strip() for m in args.modes.split(",")}
    if not args.modes or not args.modes <= {"warm", "cold"}:
        p.error(f"--modes must name warm and/or cold, got {sorted(args.modes)}")
    if args.cold_sets < 1:
        p.error(f"--cold-sets must be at least 1, got {args.cold_sets}")
    peers = PEERS
    if args.peers:
        keys = [k.strip() for k in args.peers.split(",") if k.strip()]
        peers = {n: f for n, f in PEERS.items() if any(k in n for k in keys)}
        if not peers:
            p.error(f"--peers {args.peers!r} matches none of {list(PEERS)}")
    info = machine_info(args)
    print(
        f"{info['cpu']} x{info['cpu_count']}, {info['platform']}, jax {info['versions']['jax']} "
        f"on {info['jax_backend']} (async dispatch {'on' if args.async_dispatch else 'off'})"
    )
    results = []
    for T, B in sizes:
        rows = measure_size(T, B, args, peers)
        print_table(rows)
        results.extend(rows)
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        "gae_quick.json" if args.quick else "gae.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    payload = {
        "benchmark": "gae",
        "machine": info,
        "settings": {
            "gamma": GAMMA,
            "lam": LAM,
            "done_prob": args.done_prob,
            "dtype": "float32",
            "min_time_s": args.min_time,
            "min_reps": args.min_reps,
            "max_reps": args.max_reps,
            "passes": args.passes,
            "modes": sorted(args.modes),
            "flush_mb": args.flush_mb,
            "cold_sets": args.cold_sets,
            "max_cold_reps": args.max_cold_reps,
            "peers": list(peers),
            "statistic": "median",
            "sizes": [list(s) for s in sizes],
        },
        "results": results,
    }
    with open(out, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
