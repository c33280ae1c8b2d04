"""py_ipc_locks.py WORKDIR

Holds file locks across the checkpoint and the restore:

  WORKDIR/flock_ex.dat  flock(LOCK_EX)
  WORKDIR/flock_sh.dat  flock(LOCK_SH)
  WORKDIR/posix.dat     POSIX F_SETLK: F_WRLCK on bytes 10-19, F_RDLCK on 40-49
  WORKDIR/ofd.dat       OFD F_OFD_SETLK: F_WRLCK on the whole file

Prints `LOCKS PID` and `READY`, waits for WORKDIR/go (the test meanwhile
checks from outside that conflicting locks are refused), then checks from
the inside: a new open file description of each file cannot take a
conflicting flock / OFD lock, and a forked child cannot take a
conflicting POSIX lock and sees this process as the holder (F_GETLK).
Then it releases every lock, checks that each can now be taken, prints
`released` and `OK` (or `FAIL: ...`).
"""

import errno
import fcntl
import os
import struct
import sys

from py_ipc_common import child_main, child_status_problems, eq, expect_errno, out, wait_go

BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
FLOCK = "hhqqi4x"  # struct flock on x86_64: 32 bytes


def flock_struct(ltype, start, length):
    return struct.pack(FLOCK, ltype, os.SEEK_SET, start, length, 0)


def setlk(fd, cmd, ltype, start, length):
    return fcntl.fcntl(fd, cmd, flock_struct(ltype, start, length))


def getlk(fd, cmd, ltype, start, length):
    return struct.unpack(FLOCK, fcntl.fcntl(fd, cmd, flock_struct(ltype, start, length)))


def main():
    workdir = sys.argv[1]
    path = lambda n: os.path.join(workdir, n)  # noqa: E731
    fds = {}
    for n in ("flock_ex.dat", "flock_sh.dat", "posix.dat", "ofd.dat"):
        fd = os.open(path(n), os.O_RDWR | os.O_CREAT, 0o644)
        os.write(fd, b"-" * 200)
        fds[n] = fd
    fcntl.flock(fds["flock_ex.dat"], fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(fds["flock_sh.dat"], fcntl.LOCK_SH | fcntl.LOCK_NB)
    setlk(fds["posix.dat"], fcntl.F_SETLK, fcntl.F_WRLCK, 10, 10)
    setlk(fds["posix.dat"], fcntl.F_SETLK, fcntl.F_RDLCK, 40, 10)
    setlk(fds["ofd.dat"], fcntl.F_OFD_SETLK, fcntl.F_WRLCK, 0, 0)
    me = os.getpid()
    out("LOCKS %d" % me)
    out("READY")
    wait_go(workdir)

    p = []
    if os.getpid() != me:
        p.append("pid is %d, was %d" % (os.getpid(), me))
    # flock and OFD locks conflict between open file descriptions, even in
    # one process.
    other = {n: os.open(path(n), os.O_RDWR) for n in fds}
    p += expect_errno("flock(LOCK_EX) on flock_ex.dat", BUSY, fcntl.flock,
                      other["flock_ex.dat"], fcntl.LOCK_EX | fcntl.LOCK_NB)
    p += expect_errno("flock(LOCK_EX) on flock_sh.dat", BUSY, fcntl.flock,
                      other["flock_sh.dat"], fcntl.LOCK_EX | fcntl.LOCK_NB)
    p += expect_errno("F_OFD_SETLK write on ofd.dat", BUSY, setlk,
                      other["ofd.dat"], fcntl.F_OFD_SETLK, fcntl.F_WRLCK, 50, 1)
    # POSIX locks only conflict between processes.
    def child_body():
        q = []
        fd = os.open(path("posix.dat"), os.O_RDWR)
        q += expect_errno("child: F_SETLK write on posix.dat 10-19", BUSY, setlk,
                          fd, fcntl.F_SETLK, fcntl.F_WRLCK, 15, 1)
        q += expect_errno("child: F_SETLK write on posix.dat 40-49", BUSY, setlk,
                          fd, fcntl.F_SETLK, fcntl.F_WRLCK, 40, 10)
        lt, _, start, length, pid = getlk(fd, fcntl.F_GETLK, fcntl.F_WRLCK, 0, 0)
        eq(q, "child: F_GETLK (type, start, len, pid) on posix.dat",
           (lt, start, length, pid), (fcntl.F_WRLCK, 10, 10, me))
        try:
            setlk(fd, fcntl.F_SETLK, fcntl.F_WRLCK, 20, 20)
        except OSError as e:
            q.append("child: F_SETLK on the free range 20-39 of posix.dat: %s" % e)
        return q

    child = os.fork()
    if child == 0:
        child_main("locks child", child_body)
    p += child_status_problems("locks child", child)
    # Release, then every lock can be taken.
    for fd in fds.values():
        os.close(fd)
    try:
        fcntl.flock(other["flock_ex.dat"], fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other["flock_sh.dat"], fcntl.LOCK_EX | fcntl.LOCK_NB)
        setlk(other["ofd.dat"], fcntl.F_OFD_SETLK, fcntl.F_WRLCK, 0, 0)
    except OSError as e:
        p.append("a lock cannot be taken after the release: %s" % e)
    for fd in other.values():
        os.close(fd)
    out("released")
    if p:
        out("FAIL: %s" % "; ".join(p))
        sys.exit(1)
    out("OK")


if __name__ == "__main__":
    main()
