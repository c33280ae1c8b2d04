"""mpi_check.py: the mpi4py twin of mpi_check.c (tests/tests/mpi.rs).

    python3 mpi_check.py ring|allreduce|halo ITERATIONS PACE_US

Same checks, smaller messages: a ring token (bytes, checked whole), an
allreduce whose sum every rank recomputes from the simulated states of all
ranks, a periodic 1-D stencil (256 cells per rank) whose halos carry their
step and whose final field rank 0 compares with a serial run. Every rank
also checks at the end that its host name is still the one it started
with (a job restarted on other nodes keeps its own). Prints
"progress N T" (N iterations done at T, the wall clock in seconds), then "RESULT OK MODE checksum=X" or "FAIL ..." / "RESULT
FAIL ..." (and aborts the job on the first bad message).
"""
import hashlib
import os
import socket
import sys
import time

from mpi4py import MPI

MASK = (1 << 64) - 1
CELLS = 256
TOKEN_BYTES = 4096
PRIME = 2305843009213693951

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()


def mix(a, b):
    x = (a ^ ((b + 0x9E3779B97F4A7C15 + (a << 6) + (a >> 2)) & MASK)) & MASK
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    return x


def fail(what, it, got, want):
    print(f"FAIL rank {rank} iteration {it}: {what} (got {got!r}, want {want!r})", flush=True)
    comm.Abort(3)


def progress(i, iters):
    if rank == 0 and (i % 50 == 0 or i == iters):
        print(f"progress {i} {time.time():.3f}", flush=True)


def token(i, hops):
    seed = f"{i}:{hops}".encode()
    out = b""
    while len(out) < TOKEN_BYTES:
        seed = hashlib.sha256(seed).digest()
        out += seed
    return out[:TOKEN_BYTES]


def ring_fold(st, i, r):
    return mix(st, int.from_bytes(hashlib.sha256(f"{i}:{r}".encode()).digest()[:8], "little"))


def run_ring(iters, pace):
    st = rank
    left, right = (rank - 1) % size, (rank + 1) % size
    for i in range(1, iters + 1):
        if rank == 0:
            comm.send((i, 0, token(i, 0)), dest=right, tag=7)
        it, hops, data = comm.recv(source=left, tag=7)
        want_hops = (size if rank == 0 else rank) - 1
        if it != i:
            fail("ring token of another iteration", i, it, i)
        if hops != want_hops:
            fail("ring token with a wrong hop count", i, hops, want_hops)
        if data != token(i, hops):
            fail("ring token corrupted", i, data[:8], token(i, hops)[:8])
        st = ring_fold(st, i, rank)
        if rank != 0:
            comm.send((i, hops + 1, token(i, hops + 1)), dest=right, tag=7)
        progress(i, iters)
        if pace:
            time.sleep(pace / 1e6)
    return st


def contribution(st, i):
    return mix(st, i) >> 8


def run_allreduce(iters, pace):
    states = [r + 1 for r in range(size)]
    for i in range(1, iters + 1):
        total = comm.allreduce(contribution(states[rank], i), op=MPI.SUM)
        lo = comm.allreduce(i, op=MPI.MIN)
        want = sum(contribution(s, i) for s in states)
        if total != want:
            fail("allreduce sum", i, total, want)
        if lo != i:
            fail("ranks at different iterations", i, lo, i)
        states = [mix(s, total & MASK) for s in states]
        progress(i, iters)
        if pace:
            time.sleep(pace / 1e6)
    return states[rank], states


def cell_init(g):
    return mix(g, 12345)


def stencil(l, c, r, i):
    return (l * 3 + c * 5 + r * 7 + i) % PRIME


def step(u, left, right, i):
    ext = [left] + u + [right]
    return [stencil(ext[j - 1], ext[j], ext[j + 1], i) for j in range(1, len(u) + 1)]


def run_halo(iters, pace):
    u = [cell_init(rank * CELLS + j) for j in range(CELLS)]
    left, right = (rank - 1) % size, (rank + 1) % size
    for i in range(1, iters + 1):
        tag = i % 30000
        in_l = comm.sendrecv((i, u[-1]), dest=right, sendtag=tag, source=left, recvtag=tag)
        in_r = comm.sendrecv((i, u[0]), dest=left, sendtag=tag + 30000, source=right,
                             recvtag=tag + 30000)
        if in_l[0] != i:
            fail("halo from the left of another step", i, in_l[0], i)
        if in_r[0] != i:
            fail("halo from the right of another step", i, in_r[0], i)
        u = step(u, in_l[1], in_r[1], i)
        progress(i, iters)
        if pace:
            time.sleep(pace / 1e6)
    return u


def connect_all():
    """Every pair of ranks talks once at start: MPI libraries open
    connections lazily, and one opened for the first time after a restart
    on other nodes would use the addresses of the old nodes (docs/MPI.md)."""
    for d in range(1, size):
        to, frm = (rank + d) % size, (rank - d) % size
        got = comm.sendrecv(rank, dest=to, sendtag=61000, source=frm, recvtag=61000)
        if got != frm:
            fail("warm-up message from another rank", 0, got, frm)


def main():
    mode, iters, pace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    host = socket.gethostname()
    print(f"rank {rank} of {size} on {host} pid {os.getpid()}", flush=True)
    connect_all()
    ok = True
    checksum = 0
    if mode == "ring":
        st = run_ring(iters, pace)
        got = comm.gather(st, root=0)
        if rank == 0:
            for r in range(size):
                ref = r
                for i in range(1, iters + 1):
                    ref = ring_fold(ref, i, r)
                if got[r] != ref:
                    print(f"RESULT FAIL ring: rank {r} ends with {got[r]}, a serial run gives {ref}")
                    ok = False
                checksum = mix(checksum, got[r])
    elif mode == "allreduce":
        st, _ = run_allreduce(iters, pace)
        got = comm.gather(st, root=0)
        if rank == 0:
            ref = [r + 1 for r in range(size)]
            for i in range(1, iters + 1):
                s = sum(contribution(x, i) for x in ref) & MASK
                ref = [mix(x, s) for x in ref]
            for r in range(size):
                if got[r] != ref[r]:
                    print(f"RESULT FAIL allreduce: rank {r} ends with {got[r]}, a serial run gives {ref[r]}")
                    ok = False
                checksum = mix(checksum, got[r])
    elif mode == "halo":
        u = run_halo(iters, pace)
        parts = comm.gather(u, root=0)
        if rank == 0:
            field = [c for p in parts for c in p]
            n = len(field)
            ref = [cell_init(g) for g in range(n)]
            for i in range(1, iters + 1):
                ref = [stencil(ref[(g - 1) % n], ref[g], ref[(g + 1) % n], i) for g in range(n)]
            if field != ref:
                print("RESULT FAIL halo: the field differs from a serial run")
                ok = False
            for c in field:
                checksum = mix(checksum, c)
    else:
        if rank == 0:
            print(f"mpi_check.py: unknown mode {mode}", file=sys.stderr)
        sys.exit(2)
    now = socket.gethostname()
    if now != host:
        print(f"FAIL rank {rank}: host name {now}, started on {host}", flush=True)
    if comm.allreduce(int(now == host), op=MPI.MIN) == 0:
        if rank == 0:
            print("RESULT FAIL the host name of a rank changed")
        ok = False
    if rank == 0 and ok:
        print(f"RESULT OK {mode} ranks={size} iterations={iters} checksum={checksum:016x}", flush=True)
    sys.stdout.flush()
    sys.exit(0 if ok else 1)


main()
