"""py_ipc_leases.py WORKDIR [tree|outside]

Holds a read lease (F_SETLEASE F_RDLCK) on WORKDIR/leased.dat, taken on a
read-only open, that another process breaks by opening the file for
writing and waiting (blocked in open(2)) for the lease to be given up. The
break sends this process SIGIO (counted by a handler).

  tree     the opener is a child of this process (in the checkpointed tree)
  outside  the opener is started by the test (outside the tree); prints
           `LEASED` once the lease is taken, and waits for the break

Prints `READY` once the lease is being broken (SIGIO came, F_GETLEASE gives
F_UNLCK), waits for WORKDIR/go, then checks from the inside: the lease is
still being broken (F_GETLEASE F_UNLCK), no second SIGIO came, and (tree)
the child is again blocked opening the file, waiting for this lease
(/proc/locks shows it as the lease's BREAKER); then gives the lease up,
and (tree) the child's open completes (it exits 0). Prints `OK` (or
`FAIL: ...`).
"""

import fcntl
import os
import signal
import sys

from py_ipc_common import child_status_problems, out, wait_for, wait_go

F_SETLEASE, F_GETLEASE = 1024, 1025


def waiting_openers(path):
    """The pids /proc/locks shows blocked on a lease of `path`."""
    st = os.stat(path)
    me = "%02x:%02x:%d" % (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    entries, pids = set(), []
    with open("/proc/locks") as f:
        for line in f:
            w = line.split()
            if len(w) > 5 and w[1] == "LEASE" and w[5] == me:
                entries.add(w[0])
            elif len(w) > 5 and w[1:4] == ["->", "LEASE", "BREAKER"] and w[0] in entries:
                pids.append(int(w[5]))
    return pids


def main():
    workdir = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "tree"
    path = os.path.join(workdir, "leased.dat")
    with open(path, "w") as f:
        f.write("content")
    got = []
    signal.signal(signal.SIGIO, lambda signo, frame: got.append(signo))
    fd = os.open(path, os.O_RDONLY)
    fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
    child = None
    if mode == "tree":
        child = os.fork()
        if child == 0:
            os.close(fd)
            os.close(os.open(path, os.O_WRONLY))  # blocks until the lease goes
            os._exit(0)
    else:
        out("LEASED")
    wait_for("the break's SIGIO", lambda: len(got) == 1)
    p = []
    if fcntl.fcntl(fd, F_GETLEASE) != fcntl.F_UNLCK:
        p.append("F_GETLEASE %d while broken, before" % fcntl.fcntl(fd, F_GETLEASE))
    me = os.getpid()
    out("READY")
    wait_go(workdir)

    if os.getpid() != me:
        p.append("pid is %d, was %d" % (os.getpid(), me))
    if fcntl.fcntl(fd, F_GETLEASE) != fcntl.F_UNLCK:
        p.append("F_GETLEASE %d, not F_UNLCK (being broken)" % fcntl.fcntl(fd, F_GETLEASE))
    if child is not None:
        # Its open restarted: it waits for this lease again.
        wait_for("the child blocked opening the file", lambda: child in waiting_openers(path))
        if os.waitpid(child, os.WNOHANG)[0] != 0:
            p.append("the child's open completed while the lease was held")
    # Given up: the opener gets the file.
    fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
    if child is not None:
        p += child_status_problems("the opener child", child)
    # A SIGIO of the restore would have been handled by now (at the first
    # bytecode after the process ran again).
    if len(got) != 1:
        p.append("SIGIO %d times, not once (at the break)" % len(got))
    os.close(fd)
    if p:
        out("FAIL: %s" % "; ".join(p))
        sys.exit(1)
    out("OK")


if __name__ == "__main__":
    main()
