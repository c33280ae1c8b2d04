"""py_ipc_pipes.py WORKDIR [PARTS]

Pipes and FIFOs held by one process, with bytes buffered in them at
checkpoint time. After the restore every part checks that the buffered
bytes arrive exactly once (then EAGAIN or EOF), and that the pipe's
capacity, flags and ends are as they were. Parts:

  buffered   both ends open, bytes in the pipe
  bigsize    F_SETPIPE_SZ 1 MiB, 300 KiB buffered (more than a default pipe holds)
  smallsize  F_SETPIPE_SZ 4096, full: a further write gets EAGAIN
  nonblock   O_NONBLOCK on both ends, empty
  nowriter   only the read end is open: the bytes, then EOF
  noreader   only the write end is open: a write gets EPIPE
  fifo_rw    a FIFO opened O_RDWR with bytes buffered
  fifo_ends  a FIFO opened read-only and write-only (two fds), bytes buffered
  fifo_reader_only  a FIFO opened O_RDONLY|O_NONBLOCK with no writer: EOF
  dup_ends   a pipe end dup'ed (fds share the description: O_NONBLOCK set on one shows on the other)
  exact_flags  F_GETFL of pipe ends (made by pipe2, blocking and not) is exactly
             what it was: the access mode and O_NONBLOCK, nothing added

See py_ipc_common.py for the protocol.
"""

import errno
import fcntl
import os
import random
import stat
import sys
import time

from py_ipc_common import eq, expect_errno, note, read_all_nonblock, run

EAGAIN = (errno.EAGAIN,)


def blob(seed, n):
    return random.Random(seed).randbytes(n)


def part_buffered(ctx):
    r, w = os.pipe()
    data = b"pipe A: hello \x00\xff\n" * 37
    os.write(w, data)

    def verify():
        p = []
        got, eof = read_all_nonblock(r)
        eq(p, "bytes read", got, data)
        if eof:
            p.append("EOF although the write end is open")
        # Both ends still work, and nothing else was buffered.
        os.write(w, b"after")
        eq(p, "bytes written after restore", os.read(r, 100), b"after")
        return p

    return verify


def part_bigsize(ctx):
    r, w = os.pipe()
    size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
    if size != 1 << 20:
        raise RuntimeError("F_SETPIPE_SZ gave %d" % size)
    data = blob(ctx.pid, 300 << 10)
    n = 0
    while n < len(data):
        n += os.write(w, data[n:])

    def verify():
        p = []
        eq(p, "F_GETPIPE_SZ", fcntl.fcntl(r, fcntl.F_GETPIPE_SZ), 1 << 20)
        got, _ = read_all_nonblock(r)
        eq(p, "300 KiB read back", got, data)
        return p

    return verify


def part_smallsize(ctx):
    r, w = os.pipe()
    size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    if size != 4096:
        raise RuntimeError("F_SETPIPE_SZ gave %d" % size)
    data = blob(ctx.pid + 1, 4096)
    os.write(w, data)
    os.set_blocking(w, False)

    def verify():
        p = []
        eq(p, "F_GETPIPE_SZ", fcntl.fcntl(w, fcntl.F_GETPIPE_SZ), 4096)
        p += expect_errno("write into the full 4 KiB pipe", EAGAIN, os.write, w, b"x")
        got, _ = read_all_nonblock(r)
        eq(p, "4 KiB read back", got, data)
        return p

    return verify


def part_nonblock(ctx):
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)

    def verify():
        p = []
        for fd, name in ((r, "read end"), (w, "write end")):
            if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK:
                p.append("%s lost O_NONBLOCK" % name)
        p += expect_errno("read of the empty non-blocking pipe", EAGAIN, os.read, r, 10)
        os.write(w, b"nb")
        eq(p, "read back", os.read(r, 10), b"nb")
        return p

    return verify


# cr_restart may still hold the other end of a restored pipe for a moment
# after it released the tree (seen under load): EOF / EPIPE are awaited for
# up to 2 s, and a late one is noted on stderr.


def part_nowriter(ctx):
    r, w = os.pipe()
    data = b"last bytes of a closed writer"
    os.write(w, data)
    os.close(w)

    def verify():
        p = []
        got, eof = read_all_nonblock(r)
        eq(p, "bytes read", got, data)
        if not eof:
            note("nowriter: no EOF at the first read (a write end is still open somewhere)")
        deadline = time.monotonic() + 2.0
        while not eof and time.monotonic() < deadline:
            time.sleep(0.01)
            more, eof = read_all_nonblock(r)
            if more:
                p.append("bytes after the data: %r" % more[:80])
        if not eof:
            p.append("no EOF after the data (a write end is open somewhere)")
        return p

    return verify


def part_noreader(ctx):
    r, w = os.pipe()
    os.close(r)

    def verify():
        p = expect_errno("write with no reader", (errno.EPIPE,), os.write, w, b"x")
        if not p:
            return p
        note("noreader: " + p[0])
        deadline = time.monotonic() + 2.0
        while p and time.monotonic() < deadline:
            time.sleep(0.01)
            p = expect_errno("write with no reader", (errno.EPIPE,), os.write, w, b"x")
        return p

    return verify


def part_fifo_rw(ctx):
    path = ctx.path("fifo_rw")
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR)
    data = b"fifo rw data\n" * 10
    os.write(fd, data)
    ino = os.stat(path).st_ino

    def verify():
        p = []
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode) or st.st_ino != ino:
            p.append("fd is no longer the FIFO %s (mode %o ino %d, want ino %d)" % (
                path, st.st_mode, st.st_ino, ino))
        eq(p, "fd flags", fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE, os.O_RDWR)
        got, _ = read_all_nonblock(fd)
        eq(p, "bytes read", got, data)
        return p

    return verify


def part_fifo_ends(ctx):
    path = ctx.path("fifo_ends")
    os.mkfifo(path, 0o600)
    r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    w = os.open(path, os.O_WRONLY)
    data = b"through a named pipe"
    os.write(w, data)

    def verify():
        p = []
        eq(p, "read end flags", fcntl.fcntl(r, fcntl.F_GETFL) & (os.O_ACCMODE | os.O_NONBLOCK),
           os.O_RDONLY | os.O_NONBLOCK)
        eq(p, "write end flags", fcntl.fcntl(w, fcntl.F_GETFL) & os.O_ACCMODE, os.O_WRONLY)
        got, _ = read_all_nonblock(r)
        eq(p, "bytes read", got, data)
        os.write(w, b"more")
        eq(p, "bytes written after restore", os.read(r, 10), b"more")
        # Another opener of the path reaches the same FIFO.
        w2 = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(w2, b"other opener")
        os.close(w2)
        eq(p, "bytes of another opener", os.read(r, 100), b"other opener")
        return p

    return verify


def part_fifo_reader_only(ctx):
    path = ctx.path("fifo_reader_only")
    os.mkfifo(path, 0o600)
    r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def verify():
        p = []
        eq(p, "flags", fcntl.fcntl(r, fcntl.F_GETFL) & (os.O_ACCMODE | os.O_NONBLOCK),
           os.O_RDONLY | os.O_NONBLOCK)
        # No writer has ever opened it: EOF, not EAGAIN (allowing cr_restart
        # a moment to let go of its own opening).
        deadline = time.monotonic() + 2.0
        while True:
            try:
                got = os.read(r, 10)
                eq(p, "read with no writer", got, b"")
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    p.append("read with no writer gives EAGAIN (a writer is open somewhere)")
                    break
                time.sleep(0.01)
        # A writer that comes now is seen by the reader.
        w = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(w, b"late writer")
        eq(p, "bytes of a writer opened after the restore", os.read(r, 100), b"late writer")
        os.close(w)
        return p

    return verify


def part_dup_ends(ctx):
    r, w = os.pipe()
    r2 = os.dup(r)
    os.write(w, b"dup")

    def verify():
        p = []
        os.set_blocking(r2, False)
        if not fcntl.fcntl(r, fcntl.F_GETFL) & os.O_NONBLOCK:
            p.append("O_NONBLOCK set through the dup does not show on the original fd "
                     "(they no longer share one open file description)")
        eq(p, "read through the dup", os.read(r2, 10), b"dup")
        p += expect_errno("read through the original", EAGAIN, os.read, r, 10)
        return p

    return verify


def part_exact_flags(ctx):
    r, w = os.pipe2(0)
    r2, w2 = os.pipe2(os.O_NONBLOCK)

    def verify():
        p = []
        for fd, want, name in ((r, os.O_RDONLY, "read end"), (w, os.O_WRONLY, "write end"),
                               (r2, os.O_RDONLY | os.O_NONBLOCK, "non-blocking read end"),
                               (w2, os.O_WRONLY | os.O_NONBLOCK, "non-blocking write end")):
            got = fcntl.fcntl(fd, fcntl.F_GETFL)
            if got != want:
                p.append("F_GETFL of the %s is %#o, was %#o" % (name, got, want))
        return p

    return verify


PARTS = {
    "buffered": part_buffered,
    "bigsize": part_bigsize,
    "smallsize": part_smallsize,
    "nonblock": part_nonblock,
    "nowriter": part_nowriter,
    "noreader": part_noreader,
    "fifo_rw": part_fifo_rw,
    "fifo_ends": part_fifo_ends,
    "fifo_reader_only": part_fifo_reader_only,
    "dup_ends": part_dup_ends,
    "exact_flags": part_exact_flags,
}

if __name__ == "__main__":
    run(PARTS, sys.argv)
