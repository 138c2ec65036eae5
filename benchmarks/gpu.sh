#!/usr/bin/env bash
# Every benchmark in benchmarks/ on the lent GPU machine's own image (the device tool's
# KINDS.md: python3 3.12 with jax/jaxlib 0.11.2 and the CUDA 13 plugin, flax, optax, chex,
# orbax-checkpoint, pyarrow, numpy, torch, pytest; no rlax, gymnax, torchrl, PyAV, Ray,
# gymnasium or EnvPool; no network), at accelerator-sized shapes, in one call of under
# 8 minutes. No virtual environment, no package index: the image's python with the
# checkout on PYTHONPATH.
#
# THE DEVICE COMMAND, for a session whose task is lent an nvidia-h200 (the device tool's
# `run`, timeout_s 540, nothing carried; what comes back is $OUT's three files):
#
#     OUT_DIR=$OUT PY=python3 bash benchmarks/gpu.sh
#
# The rehearsal, on a CPU machine (here), from any checkout or fresh clone:
#
#     bash benchmarks/gpu.sh --rehearse
#
# builds a throwaway virtual environment holding only the image's packages that jaxtraj
# uses (jax, jaxlib, flax, optax, chex, orbax-checkpoint, pyarrow, numpy, pytest and their
# dependency closure, linked from an existing environment by benchmarks/rehearse_env.py:
# REHEARSE_FROM=/path/to/python, else this checkout's .venv, else the .venv of the
# repository it was cloned from, else python3), forbids the index (PIP_NO_INDEX=1), forces
# the CPU and tiny shapes, and runs every step to its end or its skip line.
#
# Writes three files into OUT_DIR (default benchmarks/results/gpu; for --rehearse a fresh
# temporary folder, printed): gpu.log (everything printed), results.json (every step's
# JSON, {"steps": {name: ...}}) and summary.json (each step's status and seconds, the
# ratios of issue 21's item 2 against their targets, what could not be measured and why).
#
# Environment:
#   PY=python3     the Python to run (ignored with --rehearse)
#   OUT_DIR=dir    where the three files go
#   BUDGET_S=450   seconds for the whole script; each step's timeout is cut to fit
#   FORCE_CPU=1    run on the CPU instead of stopping when JAX sees no GPU
#   SMALL=1        tiny shapes and few repeats (--rehearse sets both)
#   REHEARSE_FROM  the Python whose installed packages the rehearsal links
#   KEEP_REHEARSE_ENV=1  keep the rehearsal's environment (its path is printed)
#
# Exit status: 0 when every step ran or was skipped (a missing peer or file), 1 when a step
# failed or timed out, 2 when there is no usable GPU (or no usable environment).

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

REHEARSE=0
for arg in "$@"; do
    case "$arg" in
        --rehearse) REHEARSE=1 ;;
        -h|--help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu.sh: unknown argument $arg (only --rehearse)" >&2; exit 2 ;;
    esac
done

START=$SECONDS
BUDGET_S="${BUDGET_S:-450}"
FORCE_CPU="${FORCE_CPU:-0}"
SMALL="${SMALL:-0}"
REH_DIR=""
if ((REHEARSE)); then
    FORCE_CPU=1 SMALL=1
    OUT_DIR="${OUT_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/jaxtraj-gpu-rehearse.XXXXXX")}"
else
    OUT_DIR="${OUT_DIR:-benchmarks/results/gpu}"
fi
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/jaxtraj-gpu-work.XXXXXX")" || exit 2
LOG="$OUT_DIR/gpu.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

say() { printf '[gpu.sh %4ds] %s\n' "$((SECONDS - START))" "$*"; }

# Remove the temporary folders, let tee finish.
cleanup() {
    rm -rf "$WORK"
    if [[ -n "$REH_DIR" ]]; then
        if [[ "${KEEP_REHEARSE_ENV:-0}" == 1 ]]; then say "kept the rehearsal environment $REH_DIR"
        else rm -rf "$REH_DIR"; fi
    fi
}
finish() {  # finish STATUS: report, clean up, wait for the log, exit
    cleanup
    exec >&- 2>&-
    wait "$TEE_PID" 2>/dev/null
    exit "$1"
}
die() { say "FATAL: $*"; finish 2; }
trap 'say "interrupted"; finish 130' INT TERM

command -v timeout >/dev/null || die "coreutils 'timeout' is required"

# ----------------------------------------------------------------------------- environment

if ((REHEARSE)); then
    SRC="${REHEARSE_FROM:-}"
    if [[ -z "$SRC" ]]; then
        origin="$(git -C "$ROOT" config --get remote.origin.url 2>/dev/null || true)"
        for cand in "$ROOT/.venv/bin/python" "${origin:+$origin/.venv/bin/python}" "$(command -v python3)"; do
            [[ -n "$cand" && -x "$cand" ]] && { SRC="$cand"; break; }
        done
    fi
    [[ -x "$SRC" ]] || die "no Python to take the packages from (set REHEARSE_FROM=/path/to/python)"
    REH_DIR="$(mktemp -d "${TMPDIR:-/tmp}/jaxtraj-rehearse-env.XXXXXX")" || die "mktemp failed"
    say "rehearsal: a throwaway environment in $REH_DIR, packages linked from $SRC"
    "$SRC" benchmarks/rehearse_env.py "$REH_DIR" >"$WORK/rehearse_env.out" \
        || { cat "$WORK/rehearse_env.out"; die "could not build the rehearsal environment"; }
    sed '$d' "$WORK/rehearse_env.out"
    PY="$(tail -n 1 "$WORK/rehearse_env.out")"
    export PIP_NO_INDEX=1 PIP_FIND_LINKS=""
    unset PYTHONHOME
    export PYTHONPATH="$ROOT"
else
    PY="${PY:-python3}"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
# XLA would otherwise take 75% of GPU memory in the first process that touches it; the
# benchmarks that start subprocesses, and torch next to jax, need to share.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
((FORCE_CPU)) && export JAX_PLATFORMS=cpu
command -v "$PY" >/dev/null || die "no python at '$PY' (set PY=...)"

say "repository $ROOT, results in $OUT_DIR, budget ${BUDGET_S}s, rehearse=$REHEARSE FORCE_CPU=$FORCE_CPU SMALL=$SMALL"
say "python: $(command -v "$PY") ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1))"

# Which peers this Python has: one line each, "name yes|no".
PEERS="rlax torch torchrl gymnax av ray gymnasium envpool mujoco flashbax orbax.checkpoint pyarrow"
declare -A HAVE=()
while read -r name ok; do HAVE[$name]=$ok; done < <("$PY" - $PEERS <<'EOF'
import importlib.util, sys
for name in sys.argv[1:]:
    try:
        ok = importlib.util.find_spec(name) is not None
    except Exception:  # a parent package that is missing
        ok = False
    print(name, "yes" if ok else "no")
EOF
)
have() { [[ "${HAVE[$1]:-no}" == yes ]]; }
missing_of() { local m out=(); for m in "$@"; do have "$m" || out+=("$m"); done; echo "${out[*]}"; }
say "peers present: $(for p in $PEERS; do have "$p" && printf '%s ' "$p"; done)"
say "peers missing: $(missing_of $PEERS)"

say "devices JAX sees:"
"$PY" - <<'EOF' || die "JAX does not start (see above)"
import jax
print(f"  jax {jax.__version__}, jaxlib {__import__('jaxlib').__version__}, backend {jax.default_backend()}")
for d in jax.devices():
    print(f"  {d}: {getattr(d, 'device_kind', '?')}, memories {[m.kind for m in d.addressable_memories()]}")
EOF
BACKEND="$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null)"
if [[ "$FORCE_CPU" != 1 && "$BACKEND" != gpu ]]; then
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    die "JAX's default backend is '$BACKEND', not gpu: this script installs nothing; run it with the image's python3 (PY=...) or FORCE_CPU=1 to smoke-test on the CPU"
fi
command -v nvidia-smi >/dev/null && [[ "$BACKEND" == gpu ]] \
    && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# ----------------------------------------------------------------------------- steps

declare -a FAILED=() NOTES=()
NSTEPS=0

record() {  # record NAME STATUS RC SECONDS NOTE
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >>"$WORK/steps.tsv"
    NSTEPS=$((NSTEPS + 1))
}

skip() {  # skip NAME WHY: one line naming what is missing
    say "SKIP $1: $2"
    record "$1" skipped 0 0 "$2"
}

note() { say "NOTE $*"; NOTES+=("$*"); }

# run NAME TIMEOUT_S NOTE COMMAND...: one step under `timeout`, cut to the budget left.
run() {
    local name="$1" limit="$2" why="$3"
    shift 3
    local left=$((BUDGET_S - (SECONDS - START) - 10))
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        say "SKIP $name: the budget is spent"
        record "$name" budget -1 0 "budget spent"
        FAILED+=("$name (skipped: budget spent)")
        return
    fi
    [[ -n "$why" ]] && say "     $name: $why"
    say "RUN  $name (timeout ${limit}s): $*"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    local secs=$((SECONDS - t0))
    if ((rc == 0)); then
        say "OK   $name in ${secs}s"
        record "$name" ok 0 "$secs" "$why"
    else
        local status=failed
        ((rc == 124 || rc == 137)) && status="timed out after ${limit}s"
        say "FAIL $name: $status (exit $rc)"
        record "$name" "$status" "$rc" "$secs" "$why"
        FAILED+=("$name ($status)")
    fi
}

# For a benchmark that can only write benchmarks/results/NAME.json (lerobot.py,
# rollout_ray.py): run a copy of benchmarks/*.py from $WORK/bench, whose results/ is its
# own, so that the checkout's results (which others may be writing) are never touched.
BENCH="$WORK/bench"
bench_copy() {
    [[ -d "$BENCH" ]] && return
    mkdir -p "$BENCH/results" && cp benchmarks/*.py "$BENCH/" && ln -s "$ROOT/examples" "$WORK/examples"
}
take() {  # take NAME: the copy's results/NAME.json becomes the step's result
    [[ -f "$BENCH/results/$1.json" ]] && mv -f "$BENCH/results/$1.json" "$WORK/$1.json"
}

if ((SMALL)); then
    COLLECT=(--quick)                                      # bench 16x16, camera 8x12
    PIPELINE=(--quick --S 4 --T 8 --B 8 --micro-batch-size 32)
    GAE_BIG="64x256" GAE_SIZES="16x32,64x4"
    GAE_OPTS=(--min-time 0.02 --min-reps 2 --max-cold-reps 3 --passes 1 --cold-sets 2 --flush-mb 8)
    ROLLOUT=(--quick --B 16 --T 8)
    JIT_INSERT=(--quick)
    CHECKPOINT=(--quick --B 8 --T 8 --repeats 2)
    ASYNC=(--halves 2000)
    LEROBOT=(--quick --repeats 2)
    MULTIHOST=(--quick)
    QUICK=(--quick)
else
    # bench case: B = 1024 environments, T = 64 chunks (64x64x3 image: 0.9 GB a step);
    # camera case: B = 32, T = 48 (96x96x3), the issue's camera-sized step.
    COLLECT=(--B 1024 --T 64 --repeats 5)
    # 16 sources x 64 chunks x 64 environments (0.9 GB in), 4 Actor ranks.
    PIPELINE=(--S 16 --T 64 --B 64 --repeats 7)
    # [2048, 65536] float32: 512 MiB per array, about 5 GiB of inputs and outputs.
    GAE_BIG="2048x65536" GAE_SIZES="64x256,256x4096,2048x64,512x16384"
    GAE_OPTS=(--min-time 0.3 --min-reps 5 --max-cold-reps 30 --passes 3 --flush-mb 128)
    ROLLOUT=(--B 1024 --T 64 --K 4 --repeats 15)
    JIT_INSERT=(--B 1024 --T 64)                           # 96x96x3 images: 1.8 GB a step
    CHECKPOINT=(--B 256 --T 64 --repeats 3)               # half a step: 115 MB
    ASYNC=(--halves 100000)
    LEROBOT=(--repeats 5)
    MULTIHOST=()
    QUICK=(--quick)
fi

# The measurements of issue 21's item 2 first, so that a short budget cuts the others.

# collect.py: host parts through the facade against one pageable and one pinned
# host-to-device copy of the same bytes (--h2d); device parts through the jitted inserts
# against a plain donated insert (x_floor); every storage choice (--storages).
why=""
if grep -q flashbax benchmarks/collect.py && ! have flashbax; then
    why="flashbax is missing here: collect.py's flashbax comparison cannot run"
fi
run collect 110 "$why" "$PY" benchmarks/collect.py "${COLLECT[@]}" --h2d --storages \
    --out "$WORK/collect.json"

# pipeline.py: the flush (fresh and recycling) against a device copy of the packed bytes.
run pipeline 70 "" "$PY" benchmarks/pipeline.py "${PIPELINE[@]}" --out "$WORK/pipeline.json"

# GAE at the accelerator's size with the JAX implementations only (the NumPy, torch and
# torchrl loops run on the host and would take minutes there): jaxtraj against lax.scan
# (Brax's and PureJaxRL's idiom) and its own associative scan.
why=""; have rlax || why="runs without rlax (missing: its row reads 'missing')"
run gae_large 90 "$why" "$PY" benchmarks/gae.py --sizes "$GAE_BIG" "${GAE_OPTS[@]}" \
    --peers "jaxtraj,rlax,lax.scan,copy (jax)" --cold-sets 2 --out "$WORK/gae_large.json"

# rollout.py: the synchronous runner against its plain lax.scan (rollout_stacked).
if have gymnax; then
    run rollout 60 "" "$PY" benchmarks/rollout.py "${ROLLOUT[@]}" --async-halves 0 \
        --out "$WORK/rollout.json"
else
    run rollout 60 "runs without gymnax (missing): on rollout.py's pure-JAX copy of Pendulum-v1 (--env jax-pendulum)" \
        "$PY" benchmarks/rollout.py "${ROLLOUT[@]}" --env jax-pendulum --async-halves 0 \
        --out "$WORK/rollout.json"
fi

# jit_insert.py (where the checkout has it): jaxtraj's add_policy + add_env against a plain
# dynamic_update_slice and flashbax's add of the same joined chunk, in one lax.scan and
# call by call; without flashbax its rows are left out.
if [[ ! -f benchmarks/jit_insert.py ]]; then
    skip jit_insert "benchmarks/jit_insert.py is not in this checkout"
else
    why=""; have flashbax || why="runs without flashbax (missing: its rows and ratios are left out)"
    run jit_insert 60 "$why" "$PY" benchmarks/jit_insert.py "${JIT_INSERT[@]}" \
        --out "$WORK/jit_insert.json"
fi

# GAE, every peer at moderate sizes.
why="$(missing_of rlax torch torchrl)"
[[ -n "$why" ]] && why="runs without $why (missing: their rows read 'missing')"
run gae 80 "$why" "$PY" benchmarks/gae.py --sizes "$GAE_SIZES" "${GAE_OPTS[@]}" \
    --out "$WORK/gae.json"

# checkpoint.py: save and restore mid-step against np.savez / np.load (and orbax).
why=""; have orbax.checkpoint || why="runs without orbax-checkpoint (missing)"
run checkpoint 45 "$why" "$PY" benchmarks/checkpoint.py "${CHECKPOINT[@]}" \
    --out "$WORK/checkpoint.json"

# rollout_async.py: the asynchronous host-thread runner's halves per second.
run rollout_async 40 "" "$PY" benchmarks/rollout_async.py "${ASYNC[@]}" \
    --out "$WORK/rollout_async.json"

# lerobot.py (no --out: it writes results/lerobot.json beside itself, here in the copy);
# its video part needs PyAV. gpu_lerobot.py runs lerobot.py's main() unchanged, standing
# in for av.__version__ in its machine record (which reads it even for --part parquet).
if ! have pyarrow; then
    skip lerobot "needs pyarrow (missing)"
else
    bench_copy
    if have av; then
        run lerobot 40 "" "$PY" "$BENCH/lerobot.py" "${LEROBOT[@]}"
    else
        run lerobot 40 "runs --part parquet only: the video part needs av (PyAV, missing)" \
            "$PY" "$BENCH/gpu_lerobot.py" "${LEROBOT[@]}" --part parquet
    fi
    take lerobot
fi

# multihost.py: two processes with CPU collectives (gloo) over forced host devices; it
# runs on the CPU on every machine (a GPU variant would need NCCL collectives).
run multihost 45 "runs on the CPU by design (2 processes, gloo collectives)" \
    env JAX_PLATFORMS=cpu "$PY" benchmarks/multihost.py "${MULTIHOST[@]}" \
    --out "$WORK/multihost.json"

# Host-simulator benchmarks: only where their simulators are installed.
m="$(missing_of gymnasium envpool mujoco)"
if [[ -n "$m" ]]; then skip host_env "needs gymnasium, envpool and mujoco (missing: $m)"
else run host_env 60 "" "$PY" benchmarks/host_env.py "${QUICK[@]}" --out "$WORK/host_env.json"; fi
m="$(missing_of envpool)"
if [[ -n "$m" ]]; then skip host_env_xla "needs envpool (missing)"
else run host_env_xla 45 "" "$PY" benchmarks/host_env_xla.py "${QUICK[@]}" --out "$WORK/host_env_xla.json"; fi
m="$(missing_of ray gymnasium mujoco)"
if [[ -n "$m" ]]; then skip rollout_ray "needs ray, gymnasium and mujoco (missing: $m)"
else
    bench_copy
    run rollout_ray 60 "" "$PY" "$BENCH/rollout_ray.py" "${QUICK[@]}"
    take rollout_ray
fi

# ----------------------------------------------------------------------------- report

have torch || note "torch is missing: gae.py's torch rows read 'missing' (on the image torch is present)"
note "GAE's 'associative scan' is jaxtraj's own associative method (auto's choice off the CPU); gae.py has no independent associative-scan peer"
note "collect.py times no fresh-buffer flush next to the recycling one (jaxtraj_jit recycles): the recycle path is compared in pipeline.py only"
((REHEARSE)) && note "rehearsal: CPU and tiny shapes; the figures say nothing about a GPU"

"$PY" benchmarks/gpu_report.py "$WORK" "$OUT_DIR" \
    "backend $BACKEND, rehearse=$REHEARSE, small=$SMALL, budget ${BUDGET_S}s, ${NSTEPS} steps in $((SECONDS - START))s" \
    "${NOTES[@]}" || FAILED+=("report (gpu_report.py failed)")

ran=$(grep -c $'\tok\t' "$WORK/steps.tsv" 2>/dev/null || true)
skipped=$(grep -c $'\tskipped\t' "$WORK/steps.tsv" 2>/dev/null || true)
say "done in $((SECONDS - START))s: $ran steps ran, $skipped skipped (a missing peer or file), ${#FAILED[@]} failed; files in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
if ((${#FAILED[@]})); then
    for f in "${FAILED[@]}"; do say "  FAILED: $f"; done
    finish 1
fi
finish 0
