"""mpi_selfckpt.py: an mpi4py program that checkpoints itself, through
libcr (libcr/python/libcr.py), every EVERY iterations.

    mpirun ... python3 mpi_selfckpt.py ITERATIONS EVERY [PACE_US]

Run as a member of a cluster job (cr_run --job, its remote ranks started
through cr_rsh: docs/MPI.md) on nodes whose cr-agent runs. Every rank
evolves a state with an allreduce per iteration; every EVERY iterations
rank 0 asks for a checkpoint of the whole job (libcr.SCOPE_JOB: every rank
on every node, through its agent and the coordinator) and waits for it,
while the other ranks wait at a barrier. Rank 0's callback notes what each
checkpoint became (continued, or restarted).

A copy restarted from one of these checkpoints (crctl restart JOB
--checkpoint ID) comes back inside that request: rank 0 prints
"restarted from the self checkpoint at iteration I" and the job goes on
from there. At the end rank 0 compares every rank's state with a serial
recomputation and prints "RESULT OK ..." or "RESULT FAIL ...".
Lines: "self checkpoint K at iteration I continued", "progress N T".
"""
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import libcr  # noqa: E402

from mpi4py import MPI  # noqa: E402

MASK = (1 << 64) - 1

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()


def mix(a, b):
    x = (a ^ ((b + 0x9E3779B97F4A7C15 + (a << 6) + (a >> 2)) & MASK)) & MASK
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    return x


def contribution(st, i):
    return mix(st, i) >> 8


# What rank 0's callback saw, per checkpoint: 0 (continued) or > 0.
seen = []


def callback():
    seen.append(libcr.checkpoint())


def connect_all():
    """Every pair of ranks talks once at start: MPI libraries open
    connections lazily, and one opened while rank 0 waits in its request
    would sit unaccepted in rank 0's listen queue at the freeze (a
    connection that leads nowhere: the checkpoint aborts)."""
    for d in range(1, size):
        to, frm = (rank + d) % size, (rank - d) % size
        got = comm.sendrecv(rank, dest=to, sendtag=61000, source=frm, recvtag=61000)
        if got != frm:
            print(f"FAIL rank {rank}: warm-up message from {got}, not {frm}", flush=True)
            comm.Abort(3)


def main():
    iters, every = int(sys.argv[1]), int(sys.argv[2])
    pace = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if rank == 0:
        libcr.init()
        libcr.register_callback(callback)
    print(f"rank {rank} of {size} on {socket.gethostname()} pid {os.getpid()}", flush=True)
    connect_all()
    st = rank + 1
    taken = restarts = 0
    for i in range(1, iters + 1):
        total = comm.allreduce(contribution(st, i), op=MPI.SUM)
        st = mix(st, total & MASK)
        if i % every == 0:
            if rank == 0:
                how = libcr.request_checkpoint(libcr.SCOPE_JOB)
                if how == "continued":
                    taken += 1
                    if seen[-1:] != [0]:
                        print(f"FAIL the callback saw {seen} at iteration {i}", flush=True)
                        comm.Abort(3)
                    print(f"self checkpoint {taken} at iteration {i} continued", flush=True)
                else:
                    restarts += 1
                    info = libcr.restart_info()
                    if not seen or seen[-1] <= 0 or info is None:
                        print(f"FAIL the callback saw {seen} after a restart, info {info}", flush=True)
                        comm.Abort(3)
                    print(f"restarted from the self checkpoint at iteration {i} "
                          f"(image {info['src']})", flush=True)
            comm.Barrier()
        if rank == 0 and i % 10 == 0:
            print(f"progress {i} {time.time():.3f}", flush=True)
        if pace:
            time.sleep(pace / 1e6)
    got = comm.gather(st, root=0)
    if rank == 0:
        ref = [r + 1 for r in range(size)]
        for i in range(1, iters + 1):
            s = sum(contribution(x, i) for x in ref) & MASK
            ref = [mix(x, s) for x in ref]
        bad = [r for r in range(size) if got[r] != ref[r]]
        if bad:
            print(f"RESULT FAIL ranks {bad} differ from a serial run", flush=True)
            sys.exit(1)
        print(f"RESULT OK ranks={size} iterations={iters} self_checkpoints={taken} "
              f"restarts={restarts}", flush=True)


main()
