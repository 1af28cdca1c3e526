#!/usr/bin/env bash
# A/B on the GPU machine: part (a) of gpu_bench at a59f7fb (last GPU-measured) and HEAD, alternately.
set -u
GPU_CHECK_SKIP="info tests bench example-cuda example-cpu" bash scripts/gpu_check.sh $OUT/setup >/dev/null 2>&1
tail -5 $OUT/setup/summary.log
VPY=/tmp/gv/bin/python
mkdir -p /tmp/old && git archive a59f7fb | tar -x -C /tmp/old
(cd /tmp/old && $VPY setup.py build_native > $OUT/old_build.log 2>&1) || { echo old build failed; tail -20 $OUT/old_build.log; }
REPO=$(pwd)
for round in 1 2 3; do
  for t in /tmp/old $REPO; do
    cd $t
    PYTHONPATH=$t OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 timeout 90 $VPY benchmarks/gpu_bench.py --worker small --device cuda --reps 30 --warmup 5 --small-count 200 --small-bytes 16384 > $OUT/r${round}_$(basename $t).log 2>&1
    $VPY - $OUT/r${round}_$(basename $t).log $t <<'PY'
import json, statistics as s, sys
for line in open(sys.argv[1]):
    if "{" in line and '"allreduce"' in line:
        d = json.loads(line[line.index("{"):])
        m = lambda k: s.median(d[k]) * 1e6
        core = d.get("core")
        print(f"{sys.argv[2]:12s} allreduce {m('allreduce'):8.1f} us  enqueue {m('enqueue'):7.1f} us  copy {m('copy'):6.1f} us  core {str(core)[:60]}")
        break
else:
    print(sys.argv[2], "no result"); print(open(sys.argv[1]).read()[-2000:])
PY
  done
done
