#!/usr/bin/env bash
# Every benchmark in benchmarks/, on one GPU, at accelerator-sized shapes, in under 8 minutes.
#
#   bash benchmarks/gpu.sh                  # on a machine with one NVIDIA GPU
#   FORCE_CPU=1 SMALL=1 bash benchmarks/gpu.sh   # smoke test on a CPU machine, tiny shapes
#
# Writes benchmarks/results/gpu/: one JSON per benchmark, <name>.log with its printed table,
# gpu.log with everything this script printed, and summary.json (exit status and seconds of
# each step). Results elsewhere in benchmarks/results/ are left as they were.
#
# Environment:
#   VENV=.venv            the virtual environment to use (created if missing)
#   JAX_CUDA_EXTRA=cuda12 the jax extra to install when JAX sees no GPU ("cuda13" for CUDA 13)
#   JAX_WHEELS=/dir       install jax[cuda] from wheels in /dir, with no index (offline machines)
#   FORCE_CPU=1           run on CPU instead of failing when JAX sees no GPU
#   SMALL=1               tiny shapes and few repeats, to check that every step starts
#   BUDGET_S=450          seconds for the whole script; each step's timeout is cut to fit
#
# Every step runs under `timeout`; a failing or timed-out step is reported and the script
# goes on. The exit status is 0 when all steps passed, 1 when any failed, 2 when there is no
# usable GPU (or no usable environment).

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="benchmarks/results/gpu"
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

START=$SECONDS
BUDGET_S="${BUDGET_S:-450}"
FORCE_CPU="${FORCE_CPU:-0}"
SMALL="${SMALL:-0}"
VENV="${VENV:-.venv}"
JAX_CUDA_EXTRA="${JAX_CUDA_EXTRA:-cuda12}"
PY="$VENV/bin/python"

say() { printf '[gpu.sh %4ds] %s\n' "$((SECONDS - START))" "$*"; }
die() { say "FATAL: $*"; exit 2; }

say "repository $ROOT, results in $OUT, budget ${BUDGET_S}s, FORCE_CPU=$FORCE_CPU SMALL=$SMALL"
command -v timeout >/dev/null || die "coreutils 'timeout' is required"

# ----------------------------------------------------------------------------- environment

if [[ ! -x "$PY" ]]; then
    say "no $PY: creating $VENV"
    python3 -m venv "$VENV" || die "python3 -m venv $VENV failed"
fi
# Installed, not imported: an import error inside jaxtraj is the benchmarks' to report.
if ! "$PY" -c "import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('jaxtraj', 'rlax', 'torchrl')))" 2>/dev/null; then
    say "installing jaxtraj with its benchmark extras into $VENV"
    timeout 300 "$PY" -m pip install -q -e ".[bench]" || say "WARNING: pip install -e .[bench] failed"
fi
"$PY" -c "import jax" 2>/dev/null || die "jax does not import in $VENV"

backend() { "$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null; }

# XLA would otherwise take 75% of GPU memory in the first process that touches it; the
# benchmarks that start subprocesses, and torch next to jax, need to share.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

if [[ "$FORCE_CPU" == 1 ]]; then
    export JAX_PLATFORMS=cpu
else
    if [[ "$(backend)" != "gpu" ]]; then
        # Keep the installed jax version: jaxlib and the CUDA plugin must match it exactly.
        JAX_VERSION="$("$PY" -c "import jax; print(jax.__version__)")"
        SPEC="jax[$JAX_CUDA_EXTRA]==$JAX_VERSION"
        if [[ -n "${JAX_WHEELS:-}" ]]; then
            say "JAX sees no GPU: installing $SPEC from $JAX_WHEELS (no index)"
            timeout 300 "$PY" -m pip install --no-index --find-links "$JAX_WHEELS" "$SPEC"
        else
            say "JAX sees no GPU: installing $SPEC from the package index"
            timeout 300 "$PY" -m pip install "$SPEC"
        fi || say "WARNING: installing $SPEC failed (offline? set JAX_WHEELS=/dir of wheels)"
    fi
    export JAX_PLATFORMS=cuda
fi

say "devices JAX sees:"
"$PY" - <<'EOF' || die "JAX did not start on the requested platform (see above)"
import jax
print(f"  jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
for d in jax.devices():
    print(f"  {d.platform}: {getattr(d, 'device_kind', '?')}")
EOF
if [[ "$FORCE_CPU" != 1 && "$(backend)" != "gpu" ]]; then
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    die "JAX's default backend is '$(backend)', not gpu. Install jax[$JAX_CUDA_EXTRA] in $VENV (or set FORCE_CPU=1 to smoke-test on CPU)."
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# ----------------------------------------------------------------------------- steps

declare -a NAMES=() RCS=() SECS=() FAILED=()

# run NAME TIMEOUT_S COMMAND...: one benchmark under `timeout`, cut to the budget left.
run() {
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET_S - (SECONDS - START) - 5))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        say "SKIP $name: the budget is spent"
        NAMES+=("$name"); RCS+=(-1); SECS+=(0); FAILED+=("$name (skipped: budget spent)")
        return
    fi
    say "RUN  $name (timeout ${limit}s): $*"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    NAMES+=("$name"); RCS+=("$rc"); SECS+=($((SECONDS - t0)))
    if ((rc == 0)); then
        say "OK   $name in $((SECONDS - t0))s"
    else
        local why="exit $rc"
        ((rc == 124 || rc == 137)) && why="timed out after ${limit}s"
        say "FAIL $name: $why"
        FAILED+=("$name ($why)")
    fi
}

# stash_result and keep_result NAME: for a benchmark that can only write benchmarks/results/NAME.json; move its
# output into $OUT and put the committed file back.
stash_result() { [[ -f "benchmarks/results/$1.json" ]] && cp "benchmarks/results/$1.json" "$OUT/.$1.json.orig"; }
keep_result() {
    [[ -f "benchmarks/results/$1.json" ]] && cp "benchmarks/results/$1.json" "$OUT/$1.json"
    [[ -f "$OUT/.$1.json.orig" ]] && mv "$OUT/.$1.json.orig" "benchmarks/results/$1.json"
}

if [[ "$SMALL" == 1 ]]; then
    GAE_SIZES="16x32,64x4"
    GAE_BIG="64x256"
    GAE_OPTS=(--min-time 0.02 --min-reps 2 --max-cold-reps 3 --passes 1 --cold-sets 2 --flush-mb 8)
    QUICK=(--quick)
    B=16 T=16
else
    # [2048, 65536] float32: 512 MiB per array, 5 GiB of inputs and outputs with copies.
    GAE_SIZES="64x256,256x4096,2048x64,512x16384"
    GAE_BIG="2048x65536"
    GAE_OPTS=(--min-time 0.3 --min-reps 5 --max-cold-reps 30 --passes 3 --flush-mb 128)
    QUICK=()
    B=1024 T=64
fi

# GAE: all peers at moderate sizes; the accelerator's size with the JAX implementations only
# (the NumPy, torch and torchrl loops run on the host and would take minutes there).
run gae 150 "$PY" benchmarks/gae.py --sizes "$GAE_SIZES" "${GAE_OPTS[@]}" \
    --out "$OUT/gae.json"
run gae_large 120 "$PY" benchmarks/gae.py --sizes "$GAE_BIG" "${GAE_OPTS[@]}" \
    --peers "jaxtraj,rlax,lax.scan (Brax),copy (jax)" --cold-sets 2 --out "$OUT/gae_large.json"

# collect.py: --B/--T size the "bench" case; the "camera" case (B = 32, T = 48) runs too.
run collect 45 "$PY" benchmarks/collect.py --B "$B" --T "$T" "${QUICK[@]}" \
    --out "$OUT/collect.json"

# pipeline.py has no shape options yet (fixed S=2, T=64, B=64); it would need --S/--T/--B.
run pipeline 30 "$PY" benchmarks/pipeline.py "${QUICK[@]}" --out "$OUT/pipeline.json"

# rollout.py has no shape options yet (fixed B=256, T=64, K=4); it would need --B/--T/--K.
# Its asynchronous part is rollout_async.py's benchmark, run as its own step below.
run rollout 60 "$PY" benchmarks/rollout.py "${QUICK[@]}" --async-halves 0 \
    --out "$OUT/rollout.json"

# rollout_async.py has no --out: it writes benchmarks/results/rollout_async.json.
stash_result rollout_async
run rollout_async 30 "$PY" benchmarks/rollout_async.py "${QUICK[@]}"
keep_result rollout_async

# checkpoint.py has no shape options yet (fixed B=64, T=64); it would need --B/--T.
run checkpoint 30 "$PY" benchmarks/checkpoint.py "${QUICK[@]}" --out "$OUT/checkpoint.json"

# lerobot.py has neither shape options (it would need --sizes) nor --out: it writes
# benchmarks/results/lerobot.json.
stash_result lerobot
run lerobot 45 "$PY" benchmarks/lerobot.py "${QUICK[@]}"
keep_result lerobot

# multihost.py runs two processes with CPU collectives (gloo) over forced host devices, so
# it runs on CPU here; a GPU variant would need a --platform option and NCCL collectives.
run multihost 45 env JAX_PLATFORMS=cpu "$PY" benchmarks/multihost.py "${QUICK[@]}" \
    --out "$OUT/multihost.json"

# ----------------------------------------------------------------------------- report

{
    printf '{\n "backend": "%s",\n "force_cpu": %s,\n "small": %s,\n "seconds": %d,\n "steps": [\n' \
        "$(backend)" "$FORCE_CPU" "$SMALL" "$((SECONDS - START))"
    for i in "${!NAMES[@]}"; do
        sep=","; ((i == ${#NAMES[@]} - 1)) && sep=""
        printf '  {"name": "%s", "rc": %s, "seconds": %s}%s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}" "$sep"
    done
    printf ' ]\n}\n'
} >"$OUT/summary.json"

say "done in $((SECONDS - START))s; results in $OUT"
if ((${#FAILED[@]})); then
    say "${#FAILED[@]} of ${#NAMES[@]} steps failed:"
    for f in "${FAILED[@]}"; do say "  - $f"; done
    exit 1
fi
say "all ${#NAMES[@]} steps passed"
