"""py_ipc_refuse.py WORKDIR MODE

Holds a socket the checkpointer refuses, next to a pipe with bytes in it
and a unix socketpair with queued data (which a failed checkpoint must not
consume). MODE `netlink`: socket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE),
bound; MODE `packet`: a packet socket (AF_PACKET) bound to the loopback
device; MODE `tcp_close_wait`: a TCP connection to itself whose other end
was closed (state CLOSE-WAIT; saved since); MODE `scm_rights`
(saved since): a unix stream socket with a
pipe's fd in flight (sent with SCM_RIGHTS, not received yet; the socket of
SOCKFD is the receiving one). Prints
`SOCKFD N` and `READY`, waits for WORKDIR/go, then checks that the socket
still works (netlink: same port id, a RTM_GETLINK dump is answered; packet:
still bound to lo; tcp_close_wait: reads the end of the stream and the
bytes before it; scm_rights: the fd
arrives and reads the pipe's bytes), that the pipe and the
socketpair still hold their bytes, and prints OK or FAIL.
"""

import array
import os
import socket
import struct
import sys

from py_ipc_common import eq, out, read_all_nonblock, wait_go

NETLINK_ROUTE = 0
RTM_GETLINK = 18
NLM_F_REQUEST = 1
NLM_F_DUMP = 0x300
NLMSG_DONE = 3


def main():
    workdir, mode = sys.argv[1], sys.argv[2]
    r, w = os.pipe()
    os.write(w, b"pipe bytes survive a refused checkpoint")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.send(b"dgram-1")
    a.send(b"dgram-2")
    if mode == "netlink":
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        s.bind((0, 0))
        name = s.getsockname()
    elif mode == "packet":
        s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, 0)
        s.bind(("lo", 0))
        name = s.getsockname()
    elif mode == "tcp_close_wait":
        l = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        l.bind(("127.0.0.1", 0))
        l.listen(1)
        s = socket.create_connection(l.getsockname(), timeout=5)
        conn, _ = l.accept()
        conn.sendall(b"last words")
        conn.close()
        l.close()
        name = s.getsockname()
    elif mode == "scm_rights":
        pr, pw = os.pipe()
        os.write(pw, b"through a passed fd")
        sender, s = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sender.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pr]))])
        os.close(pr)
        name = s.getsockname()
    else:
        out("FAIL: unknown mode %r" % mode)
        sys.exit(1)
    out("SOCKFD %d" % s.fileno())
    out("READY")
    wait_go(workdir)

    p = []
    eq(p, "socket name", s.getsockname(), name)
    if mode == "scm_rights":
        msg, fds, _, _ = socket.recv_fds(s, 10, 4)
        eq(p, "message carrying the fd", msg, b"F")
        if len(fds) != 1:
            p.append("%d fds received, want 1" % len(fds))
        else:
            eq(p, "bytes read through the passed fd", os.read(fds[0], 100), b"through a passed fd")
    elif mode == "netlink":
        # struct nlmsghdr (len, type, flags, seq, pid) + struct rtgenmsg (family, padded).
        req = struct.pack("=IHHII", 20, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + \
            struct.pack("Bxxx", socket.AF_UNSPEC)
        s.send(req)
        s.settimeout(5)
        links = 0
        done = False
        while not done:
            data = s.recv(65536)
            off = 0
            while off + 16 <= len(data):
                length, typ, _, seq, _ = struct.unpack_from("=IHHII", data, off)
                if typ == NLMSG_DONE:
                    done = True
                    break
                if seq == 1:
                    links += 1
                off += (length + 3) & ~3
                if length == 0:
                    break
        if links == 0:
            p.append("the RTM_GETLINK dump listed no link")
    elif mode == "packet":
        eq(p, "packet socket name", s.getsockname()[0], "lo")
    else:
        s.settimeout(5)
        eq(p, "data before the end", s.recv(100), b"last words")
        eq(p, "end of stream", s.recv(100), b"")
    got, _ = read_all_nonblock(r)
    eq(p, "pipe bytes", got, b"pipe bytes survive a refused checkpoint")
    b.setblocking(False)
    msgs = []
    try:
        while True:
            msgs.append(b.recv(100))
    except BlockingIOError:
        pass
    eq(p, "socketpair datagrams", msgs, [b"dgram-1", b"dgram-2"])
    if p:
        out("FAIL: %s" % "; ".join(p))
        sys.exit(1)
    out("OK")


if __name__ == "__main__":
    main()
