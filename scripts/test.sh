#!/usr/bin/env bash
# Everything the tests need, then the tests. Debian packages (chromium for the UI
# test, openssh-server for the SSH transport test, postgresql for the Postgres
# instance test) are installed when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v chromium >/dev/null || need+=(chromium)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v shuf >/dev/null || need+=(coreutils)
# PostgreSQL for the Postgres instance test; Debian keeps initdb/pg_ctl in /usr/lib/postgresql/<ver>/bin
command -v initdb >/dev/null || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi
# Bytecode is written where a module is first imported (into .venv and the gitignored __pycache__): set-up
# then compiles nothing ahead (scripts/setup.sh), and no process compiles a module another already did.
unset PYTHONDONTWRITEBYTECODE
# The release wheels the tests read (SGLang's and SpecForge's, tests/release_wheels.py) are fetched from PyPI
# while setup.sh runs, on the core its pip leaves idle (~30 s); each download holds the lock a test takes to
# read that wheel, and whatever this misses or fails to fetch, the test that needs it fetches itself.
mkdir -p .cache
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -m tests.release_wheels > .cache/release_wheels.log 2>&1 &
scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORKERS=${EAGLE3_TEST_WORKERS:-2}
# The cores shared out over the workers: each worker, and every torch process it starts (stage runs,
# drivers, torchrun ranks, SGLang's server), gets cores // workers threads. Two threads per process on two
# busy cores spin at every OpenMP barrier: 5x the CPU seconds per step (eagle3_dagster/threads.py,
# benchmarks/threads_under_load.py). The stages leave a user's OMP_NUM_THREADS as it is.
THREADS=$(( $(nproc) / (WORKERS > 0 ? WORKERS : 1) ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}
export MKL_NUM_THREADS=${MKL_NUM_THREADS:-$OMP_NUM_THREADS}
# -m "" lifts the fast-tier selection in pyproject.toml: every test runs, slow, e2e and the real-SGLang
# tier (tests/real_sglang) included. On EAGLE3_TEST_WORKERS worker processes (pytest-xdist, default 2:
# the tier waits on servers, daemons and subprocesses about as much as it computes), a module per worker
# at a time (`--dist loadgroup`, the groups in tests/conftest.py), in the order tests/conftest.py gives them:
# those holding full-tier tests first, then the fast tier's short ones (xdist would otherwise start with the
# modules of most tests and leave the long e2e ones for last).
exec .venv/bin/python -m pytest -ra -m "" -n "$WORKERS" --dist loadgroup --no-loadscope-reorder "$@"
