"""Shared helpers of the py_ipc_*.py workloads (imported, never run).

A workload is a table of *parts*: `setup(ctx)` creates the part's fds and
state and returns a `verify()` function; `verify()` runs after the restore
and returns a list of problems (empty: the part is fine) or raises.

Protocol (as for every workload of the suite): `SCRIPT WORKDIR [PARTS]`
(PARTS: comma-separated part names, default all), prints `READY` once every
part is set up, waits for WORKDIR/go (polled every 10 ms), then runs each
part's verify() and prints `PART OK` or `PART FAIL: why`, checks that the
fd table (numbers, type, close-on-exec and status flags) is the one it had
at READY, and prints `OK` (exit 0) or `FAIL: ...` (exit 1) as the last line.
"""

import errno
import fcntl
import os
import stat
import sys
import time

SELF_TIMEOUT = 240.0


def out(line):
    """One line on stdout with one write(2) (stdout is a regular file)."""
    os.write(1, (line + "\n").encode())


def note(line):
    os.write(2, (line + "\n").encode())


class Ctx:
    def __init__(self, workdir):
        self.workdir = workdir
        self.pid = os.getpid()

    def path(self, name):
        return os.path.join(self.workdir, name)


def wait_for(what, cond, started=None):
    """Polls cond() every 10 ms until it holds; FAIL (and exit) once
    SELF_TIMEOUT has passed since `started` (default: now)."""
    started = started if started is not None else time.monotonic()
    while not cond():
        if time.monotonic() - started > SELF_TIMEOUT:
            out("FAIL: timed out waiting for %s" % what)
            os._exit(1)
        time.sleep(0.01)


def wait_go(workdir, started=None):
    """Polls for WORKDIR/go every 10 ms."""
    go = os.path.join(workdir, "go")
    wait_for("go", lambda: os.path.exists(go), started)


def fd_table():
    """{fd: (file type, FD_CLOEXEC, status flags)} of this process."""
    table = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            mode = os.fstat(fd).st_mode
            fdfl = fcntl.fcntl(fd, fcntl.F_GETFD)
            fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            continue  # the fd of the listing itself
        table[fd] = (stat.S_IFMT(mode), fdfl, fl)
    return table


def close_all_but(keep):
    """In a forked child: close every fd >= 3 that is not in `keep`."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def expect_errno(what, errnos, fn, *args):
    """Calls fn(*args); returns [] if it fails with one of `errnos`, else a problem."""
    try:
        r = fn(*args)
    except OSError as e:
        if e.errno in errnos:
            return []
        return ["%s: expected %s, got %s" % (what, "/".join(errno.errorcode[x] for x in errnos), e)]
    return ["%s: expected %s, but it returned %r" % (
        what, "/".join(errno.errorcode[x] for x in errnos), r if not isinstance(r, bytes) or len(r) < 80 else r[:80])]


def eq(problems, what, got, want):
    if got != want:
        g = got if not isinstance(got, (bytes, bytearray)) or len(got) <= 80 else (
            "%d bytes %r..." % (len(got), bytes(got[:40])))
        w = want if not isinstance(want, (bytes, bytearray)) or len(want) <= 80 else (
            "%d bytes %r..." % (len(want), bytes(want[:40])))
        problems.append("%s: got %r, expected %r" % (what, g, w))


def read_all_nonblock(fd, limit=1 << 24):
    """Everything readable on fd now (sets O_NONBLOCK for the read, puts the
    flags back); stops at EOF. Returns (data, eof)."""
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
    data = bytearray()
    eof = False
    try:
        while len(data) < limit:
            try:
                b = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not b:
                eof = True
                break
            data += b
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, fl)
    return bytes(data), eof


def wait_child(pid, timeout=20.0):
    """waitpid with a deadline; returns the raw status or None on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        p, st = os.waitpid(pid, os.WNOHANG)
        if p == pid:
            return st
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)


def child_status_problems(what, pid, timeout=20.0):
    st = wait_child(pid, timeout)
    if st is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return ["%s (pid %d) did not exit in %.0f s" % (what, pid, timeout)]
    if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0:
        return []
    if os.WIFEXITED(st):
        return ["%s (pid %d) exited %d (see its FAIL line)" % (what, pid, os.WEXITSTATUS(st))]
    return ["%s (pid %d) died of signal %d" % (what, pid, os.WTERMSIG(st))]


def child_main(name, body):
    """In a forked child: runs body() (returns a list of problems), prints
    `NAME OK` or `NAME FAIL: why` and _exits 0 or 1; never returns."""
    try:
        problems = body() or []
    except BaseException as e:  # noqa: BLE001 - a child must never return
        problems = ["%s: %s" % (type(e).__name__, e)]
    child_finish(name, problems)


def child_finish(name, problems):
    """End of a forked child: print its verdict line, _exit 0 or 1."""
    if problems:
        out("%s FAIL: %s" % (name, "; ".join(problems)))
        os._exit(1)
    out("%s OK" % name)
    os._exit(0)


def run(parts, argv, before_ready=None):
    """Sets up the parts named in argv[2] (default: all, in table order),
    prints READY, waits for go, verifies, prints the verdict and exits."""
    started = time.monotonic()
    workdir = argv[1]
    names = argv[2].split(",") if len(argv) > 2 and argv[2] else list(parts)
    ctx = Ctx(workdir)
    verifiers = []
    for n in names:
        if n not in parts:
            out("FAIL: unknown part %r (have: %s)" % (n, ", ".join(parts)))
            sys.exit(1)
        try:
            verifiers.append((n, parts[n](ctx)))
        except Exception as e:  # noqa: BLE001 - report any setup error as FAIL
            out("FAIL: setup of %s: %s: %s" % (n, type(e).__name__, e))
            sys.exit(1)
    if before_ready:
        before_ready(ctx)
    table = fd_table()
    out("READY")
    wait_go(workdir, started)
    problems = []
    if os.getpid() != ctx.pid:
        problems.append("pid is %d, was %d" % (os.getpid(), ctx.pid))
    # The fd table first, before a verify() closes or opens anything.
    now = fd_table()
    if now != table:
        diff = []
        for fd in sorted(set(now) | set(table)):
            if now.get(fd) != table.get(fd):
                diff.append("fd %d: %s -> %s" % (fd, fmt_entry(table.get(fd)), fmt_entry(now.get(fd))))
        out("fdtable FAIL: %s" % "; ".join(diff))
        problems.append("fd table differs")
    else:
        out("fdtable OK")
    for n, verify in verifiers:
        try:
            errs = verify() or []
        except Exception as e:  # noqa: BLE001 - report any check error as FAIL
            errs = ["%s: %s" % (type(e).__name__, e)]
        if errs:
            out("%s FAIL: %s" % (n, "; ".join(errs)))
            problems.append(n)
        else:
            out("%s OK" % n)
    if problems:
        out("FAIL: %s" % ", ".join(problems))
        sys.exit(1)
    out("OK")
    sys.exit(0)


def fmt_entry(e):
    if e is None:
        return "closed"
    kinds = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFIFO: "fifo/pipe",
             stat.S_IFSOCK: "socket", stat.S_IFCHR: "chr", 0: "anon"}
    return "%s cloexec=%d flags=%#o" % (kinds.get(e[0], oct(e[0])), e[1], e[2])
