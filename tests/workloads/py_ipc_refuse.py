"""py_ipc_refuse.py WORKDIR MODE

Holds a socket that was once (or still is) refused by the checkpointer,
next to a pipe with bytes in it and a unix socketpair with queued data
(which a failed checkpoint must not consume). MODE:

- `netlink` (saved): socket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE), bound,
  in multicast groups 1 and 33, its receive buffer raised;
- `netlink_unread` (refused): the same with a RTM_GETLINK dump asked and
  not read yet;
- `packet` (saved): a packet socket (AF_PACKET, SOCK_DGRAM) bound to the
  loopback device for IPv4, all-multicast on it;
- `raw` (saved): a raw IPv4 ICMP socket with an ICMP filter;
- `tcp_close_wait` (saved): a TCP connection to itself whose other end was
  closed (state CLOSE-WAIT);
- `scm_rights` (saved): a unix stream socket with a pipe's fd in flight
  (sent with SCM_RIGHTS, not received yet; the socket of SOCKFD is the
  receiving one).

Prints `SOCKFD N` and `READY`, waits for WORKDIR/go, then checks that the
socket still works: netlink: same port id, groups and buffer, a RTM_GETLINK
dump is answered in full (netlink_unread: the dump asked before is read to
its end); packet: still bound to lo for IPv4, and a UDP datagram sent over
lo is seen on it; raw: an ICMP echo to 127.0.0.1 gets its reply, the filter
is kept; tcp_close_wait: reads the end of the stream and the bytes before
it; scm_rights: the fd arrives and reads the pipe's bytes. Then that the
pipe and the socketpair still hold their bytes, and prints OK or FAIL.
"""

import array
import os
import socket
import struct
import sys

from py_ipc_common import eq, out, read_all_nonblock, wait_go

NETLINK_ROUTE = 0
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NETLINK_LIST_MEMBERSHIPS = 9
ETH_P_IP = 0x0800
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_ALLMULTI = 2
SOL_RAW = 255
ICMP_FILTER = 1
RTM_GETLINK = 18
NLM_F_REQUEST = 1
NLM_F_DUMP = 0x300
NLMSG_DONE = 3


def ask_links(s):
    """Ask for a dump of every link (struct nlmsghdr, then struct rtgenmsg)."""
    s.send(struct.pack("=IHHII", 20, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) +
           struct.pack("Bxxx", socket.AF_UNSPEC))


def count_links(s):
    """Read a RTM_GETLINK dump (sequence 1) to its DONE; the links it listed."""
    s.settimeout(5)
    links = 0
    while True:
        data = s.recv(1 << 20)
        off = 0
        while off + 16 <= len(data):
            length, typ, _, seq, _ = struct.unpack_from("=IHHII", data, off)
            if typ == NLMSG_DONE:
                return links
            if seq == 1:
                links += 1
            if length == 0:
                break
            off += (length + 3) & ~3


def seen_on_lo(p, s):
    """A UDP datagram sent to 127.0.0.1 shows up on the packet socket."""
    mark = b"packet-socket-mark-%d" % os.getpid()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("127.0.0.1", 0))
    u.sendto(mark, u.getsockname())
    s.settimeout(5)
    try:
        while mark not in s.recv(65536):
            pass
    except socket.timeout:
        p.append("the datagram sent over lo never reached the packet socket")


def echo(p, s):
    """An ICMP echo request to 127.0.0.1; its reply comes back on `s`."""
    ident, seq = os.getpid() & 0xffff, 7
    body = b"raw-socket-echo"
    hdr = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    csum = checksum(hdr + body)
    s.sendto(struct.pack("!BBHHH", 8, 0, csum, ident, seq) + body, ("127.0.0.1", 0))
    s.settimeout(5)
    try:
        while True:
            pkt = s.recv(65536)
            ihl = (pkt[0] & 0x0f) * 4
            typ, _, _, rid, rseq = struct.unpack_from("!BBHHH", pkt, ihl)
            if typ == 0 and rid == ident and rseq == seq and pkt[ihl + 8:] == body:
                return
    except socket.timeout:
        p.append("no ICMP echo reply on the raw socket")


def checksum(b):
    if len(b) % 2:
        b += b"\0"
    total = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while total >> 16:
        total = (total & 0xffff) + (total >> 16)
    return ~total & 0xffff


def main():
    workdir, mode = sys.argv[1], sys.argv[2]
    r, w = os.pipe()
    os.write(w, b"pipe bytes survive a refused checkpoint")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.send(b"dgram-1")
    a.send(b"dgram-2")
    if mode in ("netlink", "netlink_unread"):
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        s.bind((0, 0))
        s.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, 1)
        s.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, 33)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        groups = s.getsockopt(SOL_NETLINK, NETLINK_LIST_MEMBERSHIPS, 8)
        rcvbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        name = s.getsockname()
        if mode == "netlink_unread":
            ask_links(s)
    elif mode == "packet":
        s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_IP))
        s.bind(("lo", ETH_P_IP))
        lo = socket.if_nametoindex("lo")
        s.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP,
                     struct.pack("iHH8s", lo, PACKET_MR_ALLMULTI, 0, b""))
        name = s.getsockname()
    elif mode == "raw":
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        # Let through echo replies (type 0) only: bit N set drops type N.
        icmp_filter = struct.pack("I", 0xffffffff & ~1)
        s.setsockopt(SOL_RAW, ICMP_FILTER, icmp_filter)
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
    elif mode in ("netlink", "netlink_unread"):
        eq(p, "netlink groups", s.getsockopt(SOL_NETLINK, NETLINK_LIST_MEMBERSHIPS, 8), groups)
        eq(p, "netlink receive buffer", s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF), rcvbuf)
        if mode == "netlink":
            ask_links(s)
        if count_links(s) == 0:
            p.append("the RTM_GETLINK dump listed no link")
    elif mode == "packet":
        eq(p, "packet socket interface and protocol", s.getsockname()[:2], name[:2])
        seen_on_lo(p, s)
    elif mode == "raw":
        eq(p, "ICMP filter", s.getsockopt(SOL_RAW, ICMP_FILTER, 4), icmp_filter)
        echo(p, s)
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
