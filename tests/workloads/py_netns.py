"""A sandbox: a process alone in a network namespace of its own (it
unshares one first, as `unshare -n` would), its loopback device brought up, holding a listener on
127.0.0.1, an established connection to it (both ends) with bytes unread
on the accepted end, and a connected UDP pair.

Protocol: `py_netns.py WORKDIR`, prints `READY`, waits for WORKDIR/go, then
checks that it is still alone with its loopback device (up), reads the
bytes left unread, exchanges more both ways, makes a new connection to the
listener and a datagram round trip, and prints `OK` (exit 0) or `FAIL: ...`
(exit 1).
"""

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from py_ipc_common import out, wait_go  # noqa: E402

IFF_UP = 0x1


def lo_up():
    import fcntl
    import struct
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    req = struct.pack("16sH14x", b"lo", 0)
    flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, req))[1]  # SIOCGIFFLAGS
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | IFF_UP))  # SIOCSIFFLAGS
    s.close()


def lo_is_up():
    import fcntl
    import struct
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    req = struct.pack("16sH14x", b"lo", 0)
    flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, req))[1]
    s.close()
    return flags & IFF_UP != 0


def main():
    workdir = sys.argv[1]
    host = os.readlink("/proc/self/ns/net")
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        out("FAIL: unshare(CLONE_NEWNET): errno %d" % ctypes.get_errno())
        sys.exit(1)
    devices = socket.if_nameindex()
    if [n for _, n in devices] != ["lo"]:
        out("FAIL: not alone in a network namespace: %r" % devices)
        sys.exit(1)
    lo_up()
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    port = lst.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    srv, _ = lst.accept()
    cli.sendall(b"before-checkpoint")
    u1 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u1.bind(("127.0.0.1", 0))
    u2 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u2.bind(("127.0.0.1", 0))
    u1.connect(u2.getsockname())
    u2.connect(u1.getsockname())
    out("READY")
    wait_go(workdir)
    problems = []
    now = [n for _, n in socket.if_nameindex()]
    if now != ["lo"]:
        problems.append("devices now %r" % now)
    if not lo_is_up():
        problems.append("lo is down")
    if os.readlink("/proc/self/ns/net") == host:
        problems.append("in the host's network namespace")
    srv.settimeout(10)
    cli.settimeout(10)
    got = b""
    while len(got) < len(b"before-checkpoint"):
        chunk = srv.recv(64)
        if not chunk:
            break
        got += chunk
    if got != b"before-checkpoint":
        problems.append("unread bytes %r" % got)
    srv.sendall(b"pong")
    if cli.recv(4) != b"pong":
        problems.append("no reply on the restored connection")
    again = socket.create_connection(("127.0.0.1", port), timeout=10)
    peer, _ = lst.accept()
    again.sendall(b"new")
    if peer.recv(3) != b"new":
        problems.append("a new connection to the restored listener failed")
    u1.settimeout(10)
    u2.settimeout(10)
    u1.send(b"dgram")
    if u2.recv(16) != b"dgram":
        problems.append("the UDP pair lost its datagram")
    if problems:
        out("FAIL: " + "; ".join(problems))
        sys.exit(1)
    out("OK")


main()
