"""py_ipc_stream.py WORKDIR [AFTER]

A writer child streams numbered 16-byte records into a pipe (128 KiB, set
with F_SETPIPE_SZ) as fast as the pipe takes them; the parent reads them
a little slower (so the pipe is mostly full) and checks every record: no
gap, no duplicate, no reordering. The parent prints `got N` every 8192
records, `READY` at 16384. Once WORKDIR/go exists it reads AFTER more
records (default 50000), checks the pipe's capacity, closes its end (the
writer gets EPIPE and exits 0), checks the writer's exit status and
prints `records N`, `stream OK` and `OK` (or `FAIL: ...`).
"""

import fcntl
import os
import sys
import time

from py_ipc_common import SELF_TIMEOUT, child_status_problems, out

REC = 16
BATCH = 16  # records per write: 256 bytes, atomic (<= PIPE_BUF)
PIPE_SIZE = 128 << 10


def rec(i):
    return b"%015d\n" % i


def writer(w):
    i = 0
    try:
        while True:
            os.write(w, b"".join(rec(j) for j in range(i, i + BATCH)))
            i += BATCH
    except BrokenPipeError:
        os._exit(0)
    except Exception as e:  # noqa: BLE001
        out("writer FAIL: %s" % e)
        os._exit(2)


def main():
    workdir = sys.argv[1]
    after = int(sys.argv[2]) if len(sys.argv) > 2 else 50000
    go = os.path.join(workdir, "go")
    r, w = os.pipe()
    got_size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    if got_size != PIPE_SIZE:
        out("FAIL: F_SETPIPE_SZ gave %d" % got_size)
        sys.exit(1)
    child = os.fork()
    if child == 0:
        os.close(r)
        writer(w)
    os.close(w)
    start = time.monotonic()
    n = 0
    buf = b""
    stop_at = None
    problem = None
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            problem = "EOF from the pipe at record %d (writer gone?)" % n
            break
        buf += chunk
        k = 0
        while len(buf) - k >= REC:
            if buf[k:k + REC] != rec(n):
                problem = "record %d is %r (previous records were fine)" % (n, buf[k:k + REC])
                break
            n += 1
            k += REC
            if n % 8192 == 0:
                out("got %d" % n)
                if n == 16384:
                    out("READY")
        if problem:
            break
        buf = buf[k:]
        if stop_at is None:
            if n >= 16384 and os.path.exists(go):
                stop_at = n + after
            elif time.monotonic() - start > SELF_TIMEOUT:
                problem = "timed out waiting for go"
                break
        elif n >= stop_at:
            break
        time.sleep(0.0005)
    problems = [problem] if problem else []
    size = fcntl.fcntl(r, fcntl.F_GETPIPE_SZ)
    if size != PIPE_SIZE:
        problems.append("pipe capacity is %d, was %d" % (size, PIPE_SIZE))
    os.close(r)
    problems += child_status_problems("writer", child)
    out("records %d" % n)
    if problems:
        out("stream FAIL: %s" % "; ".join(problems))
        out("FAIL: stream")
        sys.exit(1)
    out("stream OK")
    out("OK")


if __name__ == "__main__":
    main()
