#!/usr/bin/env bash
# The GPU machine's check (issue 36): builds hvdlite there without a network, then runs
# the GPU tests, the GPU benchmark and the digits example on CUDA and on the CPU, each
# step under its own timeout, each step's output in a log under OUTDIR.
#
#   bash scripts/gpu_check.sh OUTDIR
#
# Run from a checkout whose .whl/ holds the wheels the machine lacks (the lent machines
# have torch, numpy, scikit-learn, pytest, mpi4py and NCCL, but not cffi, pycparser or
# mpich; setuptools is carried for a known version): cffi 2.1.1 (cp312), pycparser 3.12,
# mpich 5.0.2 and setuptools 84.2.1. The device tool's run, with `carry: [".whl"]`:
#   PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh $OUT       (timeout_s 600)
#
# A venv (GPU_CHECK_VENV, default /tmp/gv) is made from GPU_CHECK_PYTHON (default
# python3) with its packages visible (torch and the rest come from there, also when that
# python is itself a venv), the wheels are installed into it offline, and hvdlite is
# installed editable with --no-build-isolation (setup.py builds the core; nothing is
# fetched). A failing step is recorded and the next one runs; the exit status is 1 if any
# step failed. The whole script ends within GPU_CHECK_DEADLINE seconds (default 570; a
# normal run on the GPU machine takes about 5 minutes). Logs (at most 8 files): setup.log,
# info.log, tests.log, bench.log, bench.json, example.log, summary.log.
#
# Without a GPU (a rehearsal on a developer's machine) the GPU tests skip, the benchmark
# runs its CPU rehearsal (--device cpu) and the example's --cuda run is left out, e.g.:
#   GPU_CHECK_PYTHON=.venv/bin/python GPU_CHECK_WHEELS=/tmp/whl311 \
#     bash scripts/gpu_check.sh /tmp/gpu_out
# (wheels for that python's version: see the report of issue 36). It installs the
# checkout editable, so hvdlite/libhvdlite.so is rebuilt in place: rehearse in a copy of
# the checkout when another build there must stay as it is.
set -u -o pipefail
export PYTHONUNBUFFERED=1

OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${GPU_CHECK_PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.whl}
VENV=${GPU_CHECK_VENV:-/tmp/gv}
VPY=$VENV/bin/python
export OMP_NUM_THREADS=1

FAILED=()
SUMMARY=$OUTDIR/summary.log
for log in setup.log info.log tests.log bench.log bench.json example.log summary.log; do
  rm -f "${OUTDIR:?}/$log"
done

# The whole script ends within DEADLINE seconds (the device tool stops a command at 600):
# each step's timeout is its own limit, cut so that the steps after it keep their share.
DEADLINE=${GPU_CHECK_DEADLINE:-570}

# step NAME LOG SECONDS RESERVE COMMAND: runs COMMAND (a bash string) under a timeout of
# SECONDS, or less so that RESERVE seconds of the deadline stay for the later steps
# (timeout signals its whole process group: the launcher, mpiexec and the ranks), with
# its output appended to LOG and shown; records the outcome in summary.log.
step() {
  local name=$1 log=$2 limit=$3 reserve=$4 cmd=$5 start=$SECONDS rc
  # GPU_CHECK_SKIP="bench example-cuda ...": steps left out (a short rerun); the others
  # then keep no reserve for them.
  if [ -n "${GPU_CHECK_SKIP:-}" ]; then
    case " $GPU_CHECK_SKIP " in *" $name "*) echo "$name: skipped (GPU_CHECK_SKIP)" | tee -a "$SUMMARY"; return 0;; esac
    reserve=0
  fi
  local left=$((DEADLINE - SECONDS - reserve))
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -lt 10 ] && limit=10
  echo "=== $name (timeout ${limit}s): $cmd" | tee -a "$OUTDIR/$log"
  timeout -k 15 "$limit" bash -c "set -o pipefail; $cmd" 2>&1 | tee -a "$OUTDIR/$log"
  rc=${PIPESTATUS[0]}
  local what="ok"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then what="TIMED OUT"; elif [ "$rc" != 0 ]; then what="FAILED (exit $rc)"; fi
  [ "$what" = ok ] || FAILED+=("$name")
  printf '%-22s %-18s %4ds  (%s)\n' "$name" "$what" $((SECONDS - start)) "$log" | tee -a "$SUMMARY"
  echo "=== $name: $what" >>"$OUTDIR/$log"
  return 0
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU=1
else
  GPU=0
fi
export VENV VPY PY WHEELS REPO OUTDIR GPU
echo "gpu_check: repo $REPO, python $PY, wheels $WHEELS, venv $VENV, GPU present: $GPU" \
  | tee -a "$SUMMARY"

# -- setup: venv, wheels, hvdlite -----------------------------------------------------------
step venv setup.log 60 420 '
  set -e
  rm -rf "$VENV"
  "$PY" -m venv --system-site-packages "$VENV" \
    || { echo "venv with pip failed; again without pip (the parent'"'"'s pip is used)";
         rm -rf "$VENV"; "$PY" -m venv --without-pip --system-site-packages "$VENV"; }
  # --system-site-packages shows the base interpreter'"'"'s packages only: when PY is
  # itself a venv (the GPU image'"'"'s python3 is /opt/torch/.venv), its site-packages
  # (torch...) are added after the new venv'"'"'s own by a .pth file.
  parent=$("$PY" -c "import site, sys; print(\"\n\".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else \"\")")
  site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")
  if [ -n "$parent" ]; then echo "$parent" >"$site/gpu-check-parent.pth"; echo "parent site-packages: $parent"; fi
  "$VPY" -c "import sys; print(sys.version); print(sys.path)"
  "$VPY" -m pip --version'
step wheels setup.log 90 400 '
  set -e
  ls -la "$WHEELS"
  # --ignore-installed: into this venv even where the parent has the same version (and
  # without uninstalling the parent'"'"'s copy).
  "$VPY" -m pip install --no-index --no-deps --no-cache-dir --disable-pip-version-check \
    --ignore-installed "$WHEELS"/*.whl
  ls -la "$VENV/bin/mpiexec" "$VENV/include/mpi.h" "$VENV"/lib/libmpi.so*'
step build setup.log 240 330 '
  set -e
  "$VPY" -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir \
    --disable-pip-version-check -v -e . \
    || { echo "editable install failed: building the core with setup.py build_native and" \
              "putting the checkout on the venv'"'"'s path (this step still fails)";
         "$VPY" setup.py build_native
         echo "$REPO" >"$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")/hvdlite-checkout.pth"
         exit 1; }
  # One allreduce in a process that loaded torch (and so its own libstdc++): a core built
  # by a compiler whose libstdc++ clashes with it crashed here once. If it does, the
  # build is redone with the system compiler, and this step fails to say so.
  probe="import torch, hvdlite.torch as hvd; hvd.init(); print(\"probe allreduce\", hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist())"
  if ! timeout 60 "$VPY" -c "$probe"; then
    echo "the core built by $(command -v g++) crashed; rebuilding with /usr/bin/g++"
    CXX=/usr/bin/g++ "$VPY" setup.py build_native
    timeout 60 "$VPY" -c "$probe"
    exit 1
  fi'

# hvdliterun as installed, or through python -m when only the fallback above worked.
if [ -x "$VENV/bin/hvdliterun" ]; then RUN="$VENV/bin/hvdliterun"; else RUN="$VPY -m hvdlite.runner"; fi
export RUN

# -- what the machine and the build are -----------------------------------------------------
step info info.log 200 240 '
  nvidia-smi -L || echo "(no nvidia-smi)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  nproc
  which -a g++ c++ || true
  "$VPY" -c "
import torch, sys
print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda,
      \"available\", torch.cuda.is_available(), \"devices\", torch.cuda.device_count())
if torch.cuda.is_available():
    print(\"device 0:\", torch.cuda.get_device_name(0), \"nccl\", torch.cuda.nccl.version())
"
  "$VPY" -m pip list 2>/dev/null | grep -iE "^(cffi|pycparser|mpich|setuptools|torch|numpy|mpi4py|ml.dtypes|pytest|pytest-timeout|nvidia-nccl|hvdlite) " || true
  $RUN --check-build
  if [ -n "${GPU_CHECK_PROBE:-}" ]; then bash -c "$GPU_CHECK_PROBE"; fi'

# -- the GPU tests ---------------------------------------------------------------------------
# Where there is a GPU, a module that cannot run fails instead of skipping.
export HVDLITE_REQUIRE_GPU=${HVDLITE_REQUIRE_GPU:-$GPU}
step tests tests.log 240 160 '
  HVDLITE_REQUIRE_NATIVE=1 "$VPY" -m pytest tests/gpu -v -p no:cacheprovider -rs \
    --durations=10
  rc=$?
  if [ "$rc" = 5 ] && [ "$GPU" = 0 ]; then echo "(no test ran: no GPU here)"; exit 0; fi
  exit $rc'

# -- the benchmark ---------------------------------------------------------------------------
if [ "$GPU" = 1 ]; then BENCH_ARGS="--timeout 60"; else BENCH_ARGS="--device cpu --reps 10 --steps 20"; fi
export BENCH_ARGS
step bench bench.log 150 60 '"$VPY" benchmarks/gpu_bench.py --json "$OUTDIR/bench.json" $BENCH_ARGS'

# -- the example, on CUDA and on the CPU -----------------------------------------------------
if [ "$GPU" = 1 ]; then
  step example-cuda example.log 60 30 '$RUN -np 2 "$VPY" examples/pytorch_digits.py --cuda --epochs 3'
else
  echo "example-cuda           left out          (no GPU)" | tee -a "$SUMMARY"
fi
step example-cpu example.log 60 0 '$RUN -np 2 "$VPY" examples/pytorch_digits.py --epochs 3'
echo "--- accuracies (rank 0, last epoch of each run) ---" | tee -a "$OUTDIR/example.log" "$SUMMARY"
grep -E "training on|epoch +3 " "$OUTDIR/example.log" | tee -a "$SUMMARY"

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_check: FAILED steps: ${FAILED[*]} (logs in $OUTDIR)" | tee -a "$SUMMARY"
  exit 1
fi
echo "gpu_check: every step passed (logs in $OUTDIR)" | tee -a "$SUMMARY"
