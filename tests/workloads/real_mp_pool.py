"""real_mp_pool.py WORKDIR N

python3's multiprocessing.Pool (fork): 3 worker processes fed through
pipes, with locks that are POSIX named semaphores (sem_open, then unlinked:
a deleted /dev/shm file mapped shared by every process) and the pool's
handler threads. The main process maps a hash function over range(N) with
imap, printing `done K` every 200 results, then checks every result against
its own recomputation and prints `final N` and OK, or FAIL: reason.
"""

import hashlib
import multiprocessing as mp
import os
import sys


def work(i):
    h = hashlib.sha256(b"%d" % i).digest()
    for _ in range(40):
        h = hashlib.sha256(h).digest()
    return i, os.getpid(), h.hex()[:16]


def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    n = int(sys.argv[2])
    ctx = mp.get_context("fork")
    results = {}
    workers = set()
    with ctx.Pool(3) as pool:
        out("READY pid=%d workers=%s" % (os.getpid(), ",".join(str(p.pid) for p in pool._pool)))
        for k, (i, wpid, d) in enumerate(pool.imap(work, range(n), chunksize=8), 1):
            if i in results:
                out("FAIL: result %d twice" % i)
                sys.exit(1)
            results[i] = d
            workers.add(wpid)
            if k % 200 == 0:
                out("done %d" % k)
    problems = []
    if sorted(results) != list(range(n)):
        problems.append("%d results, not 0..%d" % (len(results), n - 1))
    bad = [i for i in range(n) if results.get(i) != work(i)[2]]
    if bad:
        problems.append("%d wrong results, first %d" % (len(bad), bad[0]))
    out("final %d workers %d" % (len(results), len(workers)))
    if problems:
        out("FAIL: " + "; ".join(problems))
        sys.exit(1)
    out("OK")


if __name__ == "__main__":
    main()
