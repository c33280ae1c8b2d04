"""py_ipc_files.py WORKDIR [PARTS]

Files that exist nowhere else and open file descriptions that are shared.
After the restore each part checks content, offsets, seals, flags and
sharing. Parts:

  memfd_sealed  a memfd with 100 KiB of content, offset 12345, sealed
                (SHRINK|GROW|WRITE|SEAL): F_GET_SEALS equal, writes refused
  memfd_mmap    a memfd mapped MAP_SHARED: bytes written through the mapping
                before the checkpoint are read through the fd after; writes
                on either side after the restore show on the other
  deleted       a file deleted while open: content, offset, not re-created
  deleted_mmap  a file mapped MAP_SHARED and deleted: mapping and fd stay one
                file after the restore
  deleted_name  a file deleted while open: /proc/self/fd/N still names its old
                path, "(deleted)"
  tmpfile       an O_TMPFILE file: content, offset, mode
  dup_fork      a file fd, its dup, and both inherited by a child: after the
                restore an lseek/write through one moves the offset of the
                others, in both processes
  cloexec_high  close-on-exec kept per fd; fds 900 and 5000 (dups) with gaps
  fork_anon     an eventfd, a pipe's write end and a memfd shared by parent and
                child across fork: after the restore the child's writes (and
                lseek) show in the parent

See py_ipc_common.py for the protocol.
"""

import errno
import fcntl
import mmap
import os
import random
import stat
import sys

from py_ipc_common import (child_main, child_status_problems, close_all_but, eq, expect_errno,
                           read_all_nonblock, run, wait_go)

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def pos(fd):
    return os.lseek(fd, 0, os.SEEK_CUR)


def content(fd, size):
    return os.pread(fd, size + 1, 0)


def part_memfd_sealed(ctx):
    fd = os.memfd_create("cr-sealed", os.MFD_ALLOW_SEALING)
    data = random.Random(ctx.pid).randbytes(100 << 10) + b"tail"
    os.write(fd, data)
    os.lseek(fd, 12345, os.SEEK_SET)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)

    def verify():
        p = []
        eq(p, "F_GET_SEALS", fcntl.fcntl(fd, fcntl.F_GET_SEALS), SEALS)
        eq(p, "content", content(fd, len(data)), data)
        eq(p, "offset", pos(fd), 12345)
        eq(p, "link", os.readlink("/proc/self/fd/%d" % fd), "/memfd:cr-sealed (deleted)")
        p += expect_errno("write to the sealed memfd", (errno.EPERM,), os.write, fd, b"x")
        p += expect_errno("ftruncate of the sealed memfd", (errno.EPERM,), os.ftruncate, fd, 10)
        return p

    return verify


def part_memfd_mmap(ctx):
    size = 3 * mmap.PAGESIZE
    fd = os.memfd_create("cr-mapped")
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    before = random.Random(ctx.pid + 7).randbytes(size)
    m[:] = before
    os.lseek(fd, 100, os.SEEK_SET)

    def verify():
        p = []
        eq(p, "bytes written through the mapping, read through the fd", content(fd, size), before)
        eq(p, "offset", pos(fd), 100)
        m[10:20] = b"MAPPED-NOW"
        eq(p, "write through the mapping after restore, seen through the fd",
           os.pread(fd, 10, 10), b"MAPPED-NOW")
        os.pwrite(fd, b"FD-WRITE", 2 * mmap.PAGESIZE + 5)
        eq(p, "write through the fd after restore, seen through the mapping",
           m[2 * mmap.PAGESIZE + 5:2 * mmap.PAGESIZE + 13], b"FD-WRITE")
        maps = open("/proc/self/maps").read()
        if "/memfd:cr-mapped (deleted)" not in maps:
            p.append("no mapping of /memfd:cr-mapped in /proc/self/maps")
        return p

    return verify


def part_deleted(ctx):
    path = ctx.path("deleted.dat")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
    data = random.Random(ctx.pid + 3).randbytes(50000)
    os.write(fd, data)
    os.lseek(fd, 777, os.SEEK_SET)
    os.unlink(path)

    def verify():
        p = []
        st = os.fstat(fd)
        eq(p, "link count", st.st_nlink, 0)
        eq(p, "size", st.st_size, len(data))
        eq(p, "offset", pos(fd), 777)
        eq(p, "content", content(fd, len(data)), data)
        if os.path.lexists(path):
            p.append("%s exists again after the restore" % path)
        os.write(fd, b"WRITTEN")
        eq(p, "write at the offset", os.pread(fd, 7, 777), b"WRITTEN")
        return p

    return verify


def part_deleted_mmap(ctx):
    path = ctx.path("deleted-mapped.dat")
    size = 2 * mmap.PAGESIZE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    before = random.Random(ctx.pid + 11).randbytes(size)
    m[:] = before
    os.unlink(path)

    def verify():
        p = []
        eq(p, "bytes written through the mapping, read through the fd", content(fd, size), before)
        m[0:6] = b"MAPPED"
        eq(p, "write through the mapping after restore, seen through the fd",
           os.pread(fd, 6, 0), b"MAPPED")
        os.pwrite(fd, b"FD", mmap.PAGESIZE)
        eq(p, "write through the fd after restore, seen through the mapping",
           m[mmap.PAGESIZE:mmap.PAGESIZE + 2], b"FD")
        eq(p, "link count", os.fstat(fd).st_nlink, 0)
        return p

    return verify


def part_deleted_name(ctx):
    path = ctx.path("deleted-name.dat")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
    os.write(fd, b"named")
    os.unlink(path)

    def verify():
        p = []
        eq(p, "/proc/self/fd link", os.readlink("/proc/self/fd/%d" % fd), path + " (deleted)")
        if os.path.lexists(path):
            p.append("%s exists again after the restore" % path)
        return p

    return verify


def part_tmpfile(ctx):
    fd = os.open(ctx.workdir, os.O_TMPFILE | os.O_RDWR, 0o600)
    data = random.Random(ctx.pid + 4).randbytes(10000)
    os.write(fd, data)
    os.lseek(fd, 4242, os.SEEK_SET)
    os.fchmod(fd, 0o604)

    def verify():
        p = []
        st = os.fstat(fd)
        eq(p, "link count", st.st_nlink, 0)
        eq(p, "mode", stat.S_IMODE(st.st_mode), 0o604)
        eq(p, "offset", pos(fd), 4242)
        eq(p, "content", content(fd, len(data)), data)
        return p

    return verify


def part_dup_fork(ctx):
    path = ctx.path("shared.dat")
    a = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(a, b"." * 8192)
    os.lseek(a, 10, os.SEEK_SET)
    b = os.dup(a)
    p2c_r, p2c_w = os.pipe()
    c2p_r, c2p_w = os.pipe()
    def child_body():
        close_all_but({1, 2, a, b, p2c_r, c2p_w})
        p = []
        # Blocked in read() across the checkpoint and the restore.
        msg = os.read(p2c_r, 100)
        if msg != b"seeked":
            p.append("message from the parent is %r" % msg)
            return p
        eq(p, "child: offset of a after the parent's write", pos(a), 4322)
        eq(p, "child: offset of b", pos(b), 4322)
        os.write(a, b"C")
        os.write(c2p_w, b"written")
        return p

    pid = os.fork()
    if pid == 0:
        child_main("dup_fork child", child_body)
    os.close(p2c_r)
    os.close(c2p_w)

    def verify():
        p = []
        eq(p, "offset at restore", pos(b), 10)
        os.lseek(a, 4321, os.SEEK_SET)
        eq(p, "offset of the dup after lseek", pos(b), 4321)
        os.write(b, b"P")
        eq(p, "offset of a after a write through b", pos(a), 4322)
        os.write(p2c_w, b"seeked")
        eq(p, "child's answer", os.read(c2p_r, 100), b"written")
        eq(p, "offset after the child's write", pos(a), 4323)
        eq(p, "bytes written by parent and child", os.pread(a, 4, 4320), b".PC.")
        p += child_status_problems("dup_fork child", pid)
        return p

    return verify


def part_cloexec_high(ctx):
    path = ctx.path("cloexec.dat")
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    ce = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    keep = os.open(path, os.O_RDONLY)
    os.set_inheritable(keep, True)
    os.dup2(ce, 900, inheritable=False)
    os.dup2(keep, 5000, inheritable=True)
    os.lseek(ce, 33, os.SEEK_SET)
    os.lseek(keep, 44, os.SEEK_SET)
    ino = os.stat(path).st_ino

    def verify():
        p = []
        for fd, want in ((ce, 1), (keep, 0), (900, 1), (5000, 0)):
            try:
                eq(p, "FD_CLOEXEC of fd %d" % fd, fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, want)
                eq(p, "inode of fd %d" % fd, os.fstat(fd).st_ino, ino)
            except OSError as e:
                p.append("fd %d: %s" % (fd, e))
        if p:
            return p
        eq(p, "offset of fd 900", pos(900), 33)
        eq(p, "offset of fd 5000", pos(5000), 44)
        os.lseek(900, 99, os.SEEK_SET)
        eq(p, "offset of fd %d (dup of 900)" % ce, pos(ce), 99)
        os.lseek(keep, 55, os.SEEK_SET)
        eq(p, "offset of fd 5000 (dup of %d)" % keep, pos(5000), 55)
        return p

    return verify


def part_fork_anon(ctx):
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    r, w = os.pipe()
    m = os.memfd_create("cr-forked")
    os.write(m, b"." * 100)

    def child_body():
        close_all_but({1, 2, efd, w, m})
        wait_go(ctx.workdir)
        os.eventfd_write(efd, 5)
        os.write(w, b"child;")
        os.pwrite(m, b"CHILD", 0)
        os.lseek(m, 77, os.SEEK_SET)
        return []

    pid = os.fork()
    if pid == 0:
        child_main("fork_anon child", child_body)

    def verify():
        p = child_status_problems("fork_anon child", pid)
        os.write(w, b"parent;")
        got, _ = read_all_nonblock(r)
        eq(p, "pipe written by child and parent through the shared write end", got,
           b"child;parent;")
        try:
            eq(p, "eventfd written by the child", os.eventfd_read(efd), 5)
        except BlockingIOError:
            p.append("the child's eventfd write did not reach the parent's eventfd")
        eq(p, "memfd written by the child", os.pread(m, 5, 0), b"CHILD")
        eq(p, "memfd offset moved by the child (shared description)", pos(m), 77)
        return p

    return verify


PARTS = {
    "memfd_sealed": part_memfd_sealed,
    "memfd_mmap": part_memfd_mmap,
    "deleted": part_deleted,
    "deleted_mmap": part_deleted_mmap,
    "deleted_name": part_deleted_name,
    "tmpfile": part_tmpfile,
    "dup_fork": part_dup_fork,
    "cloexec_high": part_cloexec_high,
    "fork_anon": part_fork_anon,
}

if __name__ == "__main__":
    run(PARTS, sys.argv)
