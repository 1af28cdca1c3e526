#!/usr/bin/env bash
# Creates .venv in the repository root and installs hvdlite (editable) with torch and
# what the examples need. torch is pinned to the 2.13.0 CPU wheel: an unpinned torch
# would pull gigabytes of CUDA packages.
#
#   bash scripts/setup_venv.sh [EXTRA...]
#
# With no EXTRA it is the README's quick start. EXTRAs are more of pyproject.toml's
# extras to install (scripts/test.sh passes "test tensorflow lightning spark ray slurm
# cluster"); "slurm" and "cluster" are no extras but Debian packages, installed below as
# root.
# Every install runs under scripts/constraints.txt, so no extra's dependency (lightning
# needs torch) can replace the pinned torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# The namespace-cluster tests (tests/cluster) need ip/tc (iproute2), unshare (util-linux)
# and nft (link loss). Installed when "cluster" is asked for (scripts/test.sh) and that is
# possible (root with apt); elsewhere those tests skip with the reason, unless
# HVDLITE_REQUIRE names "cluster" (or "all", as CI does through scripts/test.sh): then a
# machine without them stops here.
cluster_tools() { command -v ip && command -v tc && command -v nft && command -v unshare; }
if [[ " $* " == *" cluster "* ]] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
    && ! cluster_tools >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      iproute2 nftables util-linux >/dev/null; } \
    || echo "setup_venv.sh: could not install iproute2/nftables; cluster tests may skip" >&2
fi
if [[ ",${HVDLITE_REQUIRE:-}," =~ ,(cluster|all), ]]; then
  if [ "$(id -u)" != 0 ] || ! cluster_tools >/dev/null 2>&1; then
    echo "setup_venv.sh: HVDLITE_REQUIRE includes cluster, but this is not root with" \
         "ip, tc, nft and unshare installed" >&2
    exit 1
  fi
fi
# pyspark (the "spark" extra) needs a Java runtime (17 or 21 for Spark 4): installed the
# same way where it is missing; without one, tests/spark skip (or fail under
# HVDLITE_REQUIRE=spark/all, as in CI).
if [[ " $* " == *" spark "* ]] && ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        openjdk-17-jre-headless >/dev/null; } \
      || echo "setup_venv.sh: could not install openjdk-17-jre-headless; Spark tests may skip" >&2
  fi
  if [[ ",${HVDLITE_REQUIRE:-}," =~ ,(spark|all), ]] && ! command -v java >/dev/null 2>&1; then
    echo "setup_venv.sh: HVDLITE_REQUIRE includes spark, but there is no java" >&2
    exit 1
  fi
fi
# "slurm" (not a pip extra) asks for a real Slurm, Debian's slurm-wlm and munge, for
# tests/cluster/test_cluster_slurm.py (which starts its own munged and Slurm daemons on
# the namespace cluster; the packages' system services are not used). Installed the same
# way, root with apt only; without them those tests skip (or fail under
# HVDLITE_REQUIRE=slurm/all, as in CI).
slurm_tools() { command -v slurmctld && command -v slurmd && command -v srun && command -v munged; }
if [[ " $* " == *" slurm "* ]] && ! slurm_tools >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends slurm-wlm munge >/dev/null; } \
      || echo "setup_venv.sh: could not install slurm-wlm/munge; Slurm tests may skip" >&2
  fi
  if [[ ",${HVDLITE_REQUIRE:-}," =~ ,(slurm|all), ]] && ! slurm_tools >/dev/null 2>&1; then
    echo "setup_venv.sh: HVDLITE_REQUIRE includes slurm, but slurm-wlm/munge are not" \
         "installed (root with apt-get installs them)" >&2
    exit 1
  fi
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
extras=examples
for extra in "$@"; do
  case $extra in slurm|cluster) ;; *) extras="$extras,$extra";; esac
done
.venv/bin/python -m pip install -q -c scripts/constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[$extras]"
