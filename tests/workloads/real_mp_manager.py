"""real_mp_manager.py WORKDIR N

python3's multiprocessing.Manager (fork): a server process listening on a
unix socket (a path under /tmp/pymp-*), serving a dict and a queue, one
thread per connection. Two worker processes each do N steps: set their
entry of the dict to the step number and put (worker, step) on the queue,
each a request/reply over their own unix socket connection. The main
process takes 2N items off the queue (printing `got K` every 500), checks
each worker's steps arrive in order, exactly once, and that the dict ends
at N for both; prints `final K` and OK, or FAIL: reason.
"""

import multiprocessing as mp
import os
import sys


def worker(wid, d, q, n):
    for k in range(n):
        d["w%d" % wid] = k + 1
        q.put((wid, k))


def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    n = int(sys.argv[2])
    ctx = mp.get_context("fork")
    with ctx.Manager() as m:
        d = m.dict()
        q = m.Queue()
        procs = [ctx.Process(target=worker, args=(w, d, q, n)) for w in range(2)]
        for p in procs:
            p.start()
        out("READY pid=%d" % os.getpid())
        nxt = [0, 0]
        problems = []
        for k in range(1, 2 * n + 1):
            wid, step = q.get(timeout=120)
            if step != nxt[wid]:
                problems.append("worker %d: step %d where %d was expected" % (wid, step, nxt[wid]))
                break
            nxt[wid] += 1
            if k % 500 == 0:
                out("got %d" % k)
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                problems.append("worker exit code %s" % p.exitcode)
        if dict(d) != {"w0": n, "w1": n}:
            problems.append("dict is %r" % dict(d))
        if not q.empty():
            problems.append("items left in the queue")
        out("final %d" % sum(nxt))
    if problems:
        out("FAIL: " + "; ".join(problems))
        sys.exit(1)
    out("OK")


if __name__ == "__main__":
    main()
