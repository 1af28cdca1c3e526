#!/usr/bin/env bash
# Installs into .venv (scripts/setup_venv.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every area of the suite must run here, none may pass by skipping (tests/needs.py):
# CI runs as root on at least 2 cores, with a kernel that permits SCHED_FIFO to root.
# The quick start's setup_venv.sh installs torch and scikit-learn; the test tools with
# mpi4py and matplotlib (the "test" extra), tensorflow-cpu (with keras), lightning
# (hvdlite.lightning's tests), pyspark with a Java runtime (hvdlite.spark's), ray[train]
# (hvdlite.ray's, tests/on_ray), the namespace cluster's tools (iproute2, nftables) and
# Debian's slurm-wlm and munge (a real Slurm on the namespace cluster) are installed here
# only. A developer's run may override it, e.g. HVDLITE_REQUIRE= scripts/test.sh to let
# what this machine lacks skip.
export HVDLITE_REQUIRE=${HVDLITE_REQUIRE-all}
bash scripts/setup_venv.sh test tensorflow lightning spark ray slurm cluster
# --durations: the slowest cases, printed at the end, to keep the suite near 15 minutes.
run_pytest() {
    HVDLITE_REQUIRE_NATIVE=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q \
        -p no:cacheprovider --durations=20 "$@"
}
if [ $# -gt 0 ]; then
    run_pytest "$@"
    exit
fi
# The whole suite runs in two lanes at once, two pytest processes: the tests that mostly
# wait (on links, daemons, heartbeats and timeouts: the namespace cluster's, the engines'
# (Spark, Ray), the elastic jobs', and the fault and launcher tests that wait out a
# stall, a killed rank or the launcher's grace: under half a core each, most under a
# tenth) beside all the others. No test of one lane shares a resource with the other (namespace clusters
# and the engines' daemons are the first lane's alone, and its tests run one at a time).
# The first lane's output follows the second's; the run fails when either lane fails.
WAITING_LANE=(tests/cluster tests/spark tests/on_ray tests/elastic
              tests/faults/test_straggler.py tests/faults/test_mpi_fault_guard.py
              tests/faults/test_rank_death.py tests/faults/test_mismatch.py
              tests/multirank/test_launcher.py)
lane_log=$(mktemp)
run_pytest "${WAITING_LANE[@]}" >"$lane_log" 2>&1 &
waiting=$!
trap 'kill "$waiting" 2>/dev/null || true; rm -f "$lane_log"' EXIT
others=0
run_pytest tests "${WAITING_LANE[@]/#/--ignore=}" || others=$?
waiting_status=0
wait "$waiting" || waiting_status=$?
echo "======== lane ${WAITING_LANE[*]}: exit status ${waiting_status} ========"
cat "$lane_log"
echo "======== both lanes: ${WAITING_LANE[*]} ${waiting_status}, the others ${others} ========"
[ "$others" -eq 0 ] && [ "$waiting_status" -eq 0 ]
