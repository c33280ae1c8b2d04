"""py_ipc_unix.py WORKDIR [PARTS]

Unix sockets with data queued at checkpoint time. After the restore each
part checks that every queued byte / datagram arrives exactly once, with
its boundaries, and that names, peers and connections work on. Parts:

  stream      socketpair SOCK_STREAM, 64 KiB + small writes queued both ways
  dgram       socketpair SOCK_DGRAM, datagrams both ways (one of them empty)
  seqpacket   socketpair SOCK_SEQPACKET, records both ways
  listener    a listener bound to a path, one connection accepted (data both
              ways); a new client can connect after the restore
  queued      a listener with a connection not accepted yet: after the restore
              accept() returns it, and data flows both ways
  queued_data the same, the client having sent data before the checkpoint
  fork        a listener in the parent, a child connected to it (accepted by
              the parent, data both ways) and a second connection of the child
              still queued (accepted after the restore, data both ways); the
              child checks its side and exits 0
  abstract    a listener with an abstract name, one accepted connection
  dgram_path  datagram sockets bound to paths sending to each other with
              sendto(): the data arrives, names work on after the restore
  dgram_sender  the same, and recvfrom() gives each datagram's sender address
  unlinked    a datagram socket bound to a path, then the path was unlinked:
              the name stays, the path stays absent
  unlinked_queued  the same with a datagram queued (sent before the unlink)
  unlinked_peer  the same with a sender connected before the unlink: the
              connection carries data on after the restore
  shutdown    socketpair SOCK_STREAM, one side did shutdown(SHUT_WR): the peer
              reads the queued data, then EOF; the other direction still works
  stream_peer_closed  socketpair SOCK_STREAM, one end wrote and was closed:
              the other reads the bytes, then EOF
  dgram_peer_closed  the same with SOCK_DGRAM: the datagrams arrive
  seqpacket_peer_closed  the same with SOCK_SEQPACKET
  passcred    SO_PASSCRED on a datagram socket with a datagram queued: after the
              restore it comes with its sender's credentials (pid, uid, gid)
  relpath     a listener bound with a relative path (cwd = WORKDIR): a new client
              connects through the absolute path after the restore

See py_ipc_common.py for the protocol.
"""

import errno
import os
import random
import socket
import stat
import struct
import sys

from py_ipc_common import (child_main, child_status_problems, close_all_but, eq,
                           expect_errno, run, wait_go)

EAGAIN = (errno.EAGAIN,)
AF_UNIX = socket.AF_UNIX


def drain_stream(s):
    """All bytes readable now on a stream socket (non-blocking); (data, eof)."""
    s.setblocking(False)
    data = bytearray()
    eof = False
    try:
        while True:
            try:
                b = s.recv(65536)
            except BlockingIOError:
                break
            if not b:
                eof = True
                break
            data += b
    finally:
        s.setblocking(True)
    return bytes(data), eof


def drain_msgs(s):
    """All messages readable now (non-blocking), each as its own bytes. On a
    SOCK_SEQPACKET socket an empty read is EOF (its peer is gone): it ends
    the list as None."""
    seqpacket = s.type == socket.SOCK_SEQPACKET
    s.setblocking(False)
    msgs = []
    try:
        while len(msgs) < 10000:
            try:
                m = s.recv(65536)
            except BlockingIOError:
                break
            if seqpacket and not m:
                msgs.append(None)
                break
            msgs.append(m)
    finally:
        s.setblocking(True)
    return msgs


def recv_exact(s, n, timeout=5.0):
    s.settimeout(timeout)
    data = b""
    try:
        while len(data) < n:
            b = s.recv(n - len(data))
            if not b:
                break
            data += b
    finally:
        s.settimeout(None)
    return data


def part_stream(ctx):
    a, b = socket.socketpair(AF_UNIX, socket.SOCK_STREAM)
    big = random.Random(ctx.pid).randbytes(64 << 10)
    a2b = [big, b"s-a2b-1", b"s-a2b-2\n"]
    b2a = [b"s-b2a-1", b"\x00s-b2a-2"]
    for m in a2b:
        a.sendall(m)
    for m in b2a:
        b.sendall(m)

    def verify():
        p = []
        got, eof = drain_stream(b)
        eq(p, "a->b bytes", got, b"".join(a2b))
        got, eof2 = drain_stream(a)
        eq(p, "b->a bytes", got, b"".join(b2a))
        if eof or eof2:
            p.append("EOF on a connected pair")
        a.sendall(b"ping")
        eq(p, "a->b after restore", recv_exact(b, 4), b"ping")
        b.sendall(b"pong")
        eq(p, "b->a after restore", recv_exact(a, 4), b"pong")
        return p

    return verify


def msgs_part(ctx, kind, a2b, b2a):
    a, b = socket.socketpair(AF_UNIX, kind)
    for m in a2b:
        a.send(m)
    for m in b2a:
        b.send(m)

    def verify():
        p = []
        eq(p, "a->b messages", drain_msgs(b), a2b)
        eq(p, "b->a messages", drain_msgs(a), b2a)
        a.send(b"after")
        eq(p, "a->b after restore", drain_msgs(b), [b"after"])
        eq(p, "socket type", a.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE), kind)
        return p

    return verify


def part_dgram(ctx):
    return msgs_part(ctx, socket.SOCK_DGRAM,
                     [b"d-one", b"", b"d-three" * 50, b"d-four"], [b"back", b""])


def part_seqpacket(ctx):
    return msgs_part(ctx, socket.SOCK_SEQPACKET,
                     [b"p1", b"packet-two" * 10, b"p3"], [b"q"])


def accept_within(ls, what, timeout=3.0):
    """accept() with a deadline; raises with `what` in the message."""
    ls.settimeout(timeout)
    try:
        return ls.accept()[0]
    except socket.timeout:
        raise RuntimeError("%s: accept() found no connection within %.0f s" % (what, timeout)) from None
    finally:
        ls.settimeout(None)


def recv_within(s, n, what, timeout=3.0):
    """Exactly n bytes (or what arrived before EOF / the deadline)."""
    s.settimeout(timeout)
    data = b""
    try:
        while len(data) < n:
            b = s.recv(n - len(data))
            if not b:
                break
            data += b
    except socket.timeout:
        if not data:
            raise RuntimeError("%s: nothing to read within %.0f s" % (what, timeout)) from None
    finally:
        s.settimeout(None)
    return data


def part_listener(ctx):
    path = ctx.path("srv.sock")
    ls = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    ls.bind(path)
    ls.listen(8)
    c1 = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    c1.connect(path)
    s1, _ = ls.accept()
    c1.sendall(b"hello-from-c1")
    s1.sendall(b"hello-from-s1")

    def verify():
        p = []
        eq(p, "listener name", ls.getsockname(), path)
        eq(p, "accepted socket name", s1.getsockname(), path)
        eq(p, "client's peer name", c1.getpeername(), path)
        eq(p, "c1->s1", drain_stream(s1)[0], b"hello-from-c1")
        eq(p, "s1->c1", drain_stream(c1)[0], b"hello-from-s1")
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            p.append("%s is not a socket any more" % path)
        c3 = socket.socket(AF_UNIX, socket.SOCK_STREAM)
        c3.settimeout(5)
        c3.connect(path)
        s3 = accept_within(ls, "new client after restore")
        c3.sendall(b"new")
        eq(p, "new client after restore", recv_within(s3, 3, "new client"), b"new")
        return p

    return verify


def queued_part(ctx, name, early):
    path = ctx.path(name)
    ls = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    ls.bind(path)
    ls.listen(8)
    c2 = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    c2.connect(path)
    if early:
        c2.sendall(b"queued-c2")

    def verify():
        p = []
        s2 = accept_within(ls, "connection queued at checkpoint time")
        eq(p, "accepted socket name", s2.getsockname(), path)
        s2.sendall(b"reply-to-c2")
        eq(p, "reply to the queued client", recv_within(c2, 11, "s2->c2"), b"reply-to-c2")
        if early:
            eq(p, "data the queued client sent before the checkpoint",
               recv_within(s2, 9, "data of the queued connection"), b"queued-c2")
        c2.sendall(b"c2-after")
        eq(p, "data the queued client sent after the restore",
           recv_within(s2, 8, "c2->s2"), b"c2-after")
        return p

    return verify


def part_queued(ctx):
    return queued_part(ctx, "queue.sock", False)


def part_queued_data(ctx):
    return queued_part(ctx, "queue-data.sock", True)


def part_fork(ctx):
    path = ctx.path("fork.sock")
    ls = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    ls.bind(path)
    ls.listen(8)
    rd, wr = os.pipe()

    def child_body():
        c = socket.socket(AF_UNIX, socket.SOCK_STREAM)
        c.connect(path)
        c.sendall(b"from-child")
        cq = socket.socket(AF_UNIX, socket.SOCK_STREAM)
        cq.connect(path)
        close_all_but({1, 2, c.fileno(), cq.fileno(), wr})
        os.write(wr, b"k")
        os.close(wr)
        wait_go(ctx.workdir)
        p = []
        eq(p, "parent->child", recv_exact(c, 11), b"from-parent")
        c.sendall(b"child-after")
        eq(p, "parent's message on the connection accepted after restore",
           recv_within(cq, 5, "child: cq"), b"hello")
        cq.sendall(b"queued-from-child")
        return p

    child = os.fork()
    if child == 0:
        child_main("fork child", child_body)
    os.close(wr)
    if os.read(rd, 1) != b"k":
        raise RuntimeError("child did not connect")
    os.close(rd)
    s, _ = ls.accept()
    s.sendall(b"from-parent")

    def verify():
        p = []
        eq(p, "child->parent", recv_exact(s, 10), b"from-child")
        sq = accept_within(ls, "the child's queued connection")
        sq.sendall(b"hello")
        eq(p, "child->parent after restore", recv_within(s, 11, "s"), b"child-after")
        eq(p, "child's data on the connection accepted after restore",
           recv_within(sq, 17, "sq"), b"queued-from-child")
        p += child_status_problems("fork child", child)
        return p

    return verify


def part_abstract(ctx):
    name = b"\0cr-tests-ipc-%d-%d" % (ctx.pid, random.getrandbits(32))
    ls = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    ls.bind(name)
    ls.listen(4)
    c = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    c.connect(name)
    s, _ = ls.accept()
    c.sendall(b"abstract-c2s")
    s.sendall(b"abstract-s2c")

    def verify():
        p = []
        eq(p, "listener name", ls.getsockname(), name)
        eq(p, "client's peer name", c.getpeername(), name)
        eq(p, "c->s", drain_stream(s)[0], b"abstract-c2s")
        eq(p, "s->c", drain_stream(c)[0], b"abstract-s2c")
        c2 = socket.socket(AF_UNIX, socket.SOCK_STREAM)
        c2.settimeout(5)
        c2.connect(name)
        ls.settimeout(5)
        s2, _ = ls.accept()
        c2.sendall(b"x")
        eq(p, "new client after restore", recv_exact(s2, 1), b"x")
        return p

    return verify


def dgram_path_part(ctx, sfx, check_sender):
    p1, p2 = ctx.path("d1%s.sock" % sfx), ctx.path("d2%s.sock" % sfx)
    d1 = socket.socket(AF_UNIX, socket.SOCK_DGRAM)
    d1.bind(p1)
    d2 = socket.socket(AF_UNIX, socket.SOCK_DGRAM)
    d2.bind(p2)
    d2.sendto(b"to-d1", p1)
    d2.sendto(b"to-d1-again", p1)
    d1.sendto(b"to-d2", p2)

    def verify():
        p = []
        d1.setblocking(False)
        d2.setblocking(False)
        got = [d1.recvfrom(100), d1.recvfrom(100), d2.recvfrom(100)]
        if check_sender:
            eq(p, "datagrams received (data, sender)", got,
               [(b"to-d1", p2), (b"to-d1-again", p2), (b"to-d2", p1)])
        else:
            eq(p, "datagrams received", [g[0] for g in got], [b"to-d1", b"to-d1-again", b"to-d2"])
        p += expect_errno("d1 after its two datagrams", EAGAIN, d1.recv, 100)
        eq(p, "d1 name", d1.getsockname(), p1)
        eq(p, "d2 name", d2.getsockname(), p2)
        d1.sendto(b"after", p2)
        eq(p, "datagram sent after restore", d2.recvfrom(100), (b"after", p1))
        return p

    return verify


def part_dgram_path(ctx):
    return dgram_path_part(ctx, "", False)


def part_dgram_sender(ctx):
    return dgram_path_part(ctx, "s", True)


def unlinked_part(ctx, name, queued):
    path = ctx.path(name)
    u = socket.socket(AF_UNIX, socket.SOCK_DGRAM)
    u.bind(path)
    if queued:
        x = socket.socket(AF_UNIX, socket.SOCK_DGRAM)
        x.sendto(b"sent-before-unlink", path)
        x.close()
    os.unlink(path)

    def verify():
        p = []
        u.setblocking(False)
        if queued:
            eq(p, "queued datagram", u.recv(100), b"sent-before-unlink")
        p += expect_errno("recv on the empty socket", EAGAIN, u.recv, 100)
        eq(p, "name", u.getsockname(), path)
        if os.path.lexists(path):
            p.append("%s exists after the restore (it was unlinked)" % path)
        return p

    return verify


def part_unlinked(ctx):
    return unlinked_part(ctx, "gone.sock", False)


def part_unlinked_queued(ctx):
    return unlinked_part(ctx, "gone-queued.sock", True)


def part_unlinked_peer(ctx):
    path = ctx.path("gone-peer.sock")
    u = socket.socket(AF_UNIX, socket.SOCK_DGRAM)
    u.bind(path)
    x = socket.socket(AF_UNIX, socket.SOCK_DGRAM)
    x.connect(path)
    os.unlink(path)
    x.send(b"to-unlinked")

    def verify():
        p = []
        u.setblocking(False)
        eq(p, "queued datagram", u.recv(100), b"to-unlinked")
        eq(p, "name", u.getsockname(), path)
        if os.path.lexists(path):
            p.append("%s exists after the restore (it was unlinked)" % path)
        x.send(b"more")
        eq(p, "datagram through the connection after restore", u.recv(100), b"more")
        return p

    return verify


def part_shutdown(ctx):
    a, b = socket.socketpair(AF_UNIX, socket.SOCK_STREAM)
    a.sendall(b"last words")
    a.shutdown(socket.SHUT_WR)
    b.sendall(b"reply-before")

    def verify():
        p = []
        got, eof = drain_stream(b)
        eq(p, "data before the shutdown", got, b"last words")
        if not eof:
            p.append("no EOF after the data of the shut-down side")
        eq(p, "b->a", drain_stream(a)[0], b"reply-before")
        b.sendall(b"after")
        eq(p, "b->a after restore", recv_exact(a, 5), b"after")
        p += expect_errno("send on the shut-down side", (errno.EPIPE,), a.send, b"x")
        return p

    return verify


def part_relpath(ctx):
    os.chdir(ctx.workdir)
    ls = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    ls.bind("rel.sock")
    ls.listen(4)

    def verify():
        p = []
        eq(p, "listener name", ls.getsockname(), "rel.sock")
        c = socket.socket(AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(5)
        c.connect(ctx.path("rel.sock"))
        ls.settimeout(5)
        s, _ = ls.accept()
        c.sendall(b"rel")
        eq(p, "new client after restore", recv_exact(s, 3), b"rel")
        return p

    return verify


def peer_closed_part(ctx, kind):
    a, b = socket.socketpair(AF_UNIX, kind)
    a.send(b"sent-then-closed-1")
    a.send(b"sent-then-closed-2")
    a.close()

    def verify():
        p = []
        if kind == socket.SOCK_STREAM:
            got, eof = drain_stream(b)
            eq(p, "bytes of the closed peer", got, b"sent-then-closed-1sent-then-closed-2")
            if not eof:
                p.append("no EOF after the data of the closed peer")
        elif kind == socket.SOCK_SEQPACKET:
            eq(p, "records of the closed peer, then EOF", drain_msgs(b),
               [b"sent-then-closed-1", b"sent-then-closed-2", None])
        else:
            eq(p, "datagrams of the closed peer", drain_msgs(b),
               [b"sent-then-closed-1", b"sent-then-closed-2"])
        return p

    return verify


def part_stream_peer_closed(ctx):
    return peer_closed_part(ctx, socket.SOCK_STREAM)


def part_dgram_peer_closed(ctx):
    return peer_closed_part(ctx, socket.SOCK_DGRAM)


def part_seqpacket_peer_closed(ctx):
    return peer_closed_part(ctx, socket.SOCK_SEQPACKET)


def part_passcred(ctx):
    a, b = socket.socketpair(AF_UNIX, socket.SOCK_DGRAM)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    a.send(b"with-creds")
    me = (os.getpid(), os.getuid(), os.getgid())

    def verify():
        p = []
        a.send(b"after")  # (also keeps `a` open until the end)
        eq(p, "SO_PASSCRED", b.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED), 1)
        b.setblocking(False)
        msg, anc, _, _ = b.recvmsg(100, socket.CMSG_SPACE(12))
        eq(p, "datagram", msg, b"with-creds")
        creds = [struct.unpack("iII", d[:12]) for lvl, typ, d in anc
                 if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS]
        eq(p, "sender credentials (pid, uid, gid) of the queued datagram", creds, [me])
        eq(p, "datagram sent after the restore", b.recv(100), b"after")
        return p

    return verify


PARTS = {
    "stream": part_stream,
    "dgram": part_dgram,
    "seqpacket": part_seqpacket,
    "listener": part_listener,
    "queued": part_queued,
    "queued_data": part_queued_data,
    "fork": part_fork,
    "abstract": part_abstract,
    "dgram_path": part_dgram_path,
    "dgram_sender": part_dgram_sender,
    "unlinked": part_unlinked,
    "unlinked_queued": part_unlinked_queued,
    "unlinked_peer": part_unlinked_peer,
    "shutdown": part_shutdown,
    "relpath": part_relpath,
    "passcred": part_passcred,
    "stream_peer_closed": part_stream_peer_closed,
    "dgram_peer_closed": part_dgram_peer_closed,
    "seqpacket_peer_closed": part_seqpacket_peer_closed,
}

if __name__ == "__main__":
    run(PARTS, sys.argv)
