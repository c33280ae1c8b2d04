#!/usr/bin/env bash
# Runs the whole test suite: unit tests of every crate and the end-to-end
# tests that checkpoint and restore real processes (needs root: ptrace,
# clone3 set_tid, PR_SET_MM_MAP). Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "tests/run.sh: the end-to-end tests need root (ptrace, CAP_CHECKPOINT_RESTORE)" >&2
    exit 1
fi
if ! command -v python3 >/dev/null; then
    apt-get update -qq && apt-get install -y -qq python3
fi
# A C compiler for the programs using libcr (tests/tests/libcr.rs).
# Real programs the end-to-end tests run (tests/tests/real_programs.rs,
# tests/tests/tcp.rs, tests/tests/postgres.rs, tests/tests/daemons.rs: the
# daemons, go and javac to build their servers at test time; tests/tests/mpi.rs:
# Open MPI, MPICH, mpi4py; tests/tests/slurm.rs: Slurm and munge), ip(8) for the tests' network
# namespaces and nft(8), which cr_checkpoint uses to hold TCP connections
# still while they are saved.
need=()
for pair in cc:gcc lmp:lammps tmux:tmux sqlite3:sqlite3 bc:bc less:less ip:iproute2 nft:nftables nsenter:util-linux \
            setpriv:util-linux redis-server:redis-server redis-cli:redis-tools \
            memcached:memcached nginx:nginx go:golang-go node:nodejs \
            javac:default-jdk-headless jcmd:default-jdk-headless; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
# PostgreSQL 15 (server, pgbench, amcheck; its client tools come with it).
[ -x /usr/lib/postgresql/15/bin/postgres ] || need+=(postgresql-15)
# Open MPI, MPICH and mpi4py for the MPI jobs (tests/tests/mpi.rs).
for pair in mpirun.openmpi:openmpi-bin mpicc.openmpi:libopenmpi-dev mpiexec.mpich:mpich \
            mpicc.mpich:libmpich-dev; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
[ -e /usr/lib/python3/dist-packages/mpi4py/__init__.py ] || need+=(python3-mpi4py)
# Slurm 22.05 and munge for the Slurm integration (tests/tests/slurm.rs):
# the tests start munged, slurmctld and the slurmds themselves.
for pair in /usr/sbin/munged:munge /usr/sbin/slurmctld:slurmctld /usr/sbin/slurmd:slurmd \
            sbatch:slurm-client; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
if ! cargo nextest --version >/dev/null 2>&1; then
    cargo install --locked cargo-nextest
fi
cargo build -j2 --workspace --all-targets
# One process per test (nextest), so fork/ptrace/signals of one test cannot
# disturb another.
exec cargo nextest run -j2 --workspace --no-fail-fast "$@"
