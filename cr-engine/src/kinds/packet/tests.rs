//! Round trip of kind "packet": a raw packet socket on every interface and
//! a datagram one bound to lo, promiscuous there, with auxiliary data on.

use crate::kinds::testkit::{objects_of, round_trip};
use cr_image::model::{Checkpoint, ObjectKind, VmaKind};

#[test]
fn packet_sockets_round_trip() {
    let rt = round_trip(
        "packet",
        r#"
a = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
d = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
d.bind(("lo", 0x0800))
lo = socket.if_nametoindex("lo")
d.setsockopt(263, 1, struct.pack("iHH8s", lo, 1, 0, b""))  # PACKET_MR_PROMISC
d.setsockopt(263, 8, 1)  # PACKET_AUXDATA
name_d = d.getsockname()
"#,
        r#"
expect(d.getsockname()[:2] == name_d[:2], "bound to lo for IPv4: %r" % (d.getsockname(),))
expect(d.getsockopt(263, 8) == 1, "PACKET_AUXDATA")
expect(a.getsockname()[0] == "", "the raw one on every interface: %r" % (a.getsockname(),))
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.sendto(b"seen-by-packet", ("127.0.0.1", 9))
d.settimeout(5)
while b"seen-by-packet" not in d.recv(65536):
    pass
"#,
    );
    let socks = |c: &Checkpoint| {
        let mut v = objects_of(c, |k| match k {
            ObjectKind::PacketSocket(p) => Some(p),
            _ => None,
        });
        v.sort_by_key(|p| p.sock_type);
        v
    };
    let before = socks(&rt.before);
    assert_eq!(before.len(), 2, "two packet sockets saved");
    assert_eq!(before[0].memberships.len(), 1, "the promiscuous membership");
    assert_eq!(before, socks(&rt.after));
}

/// SOCK_PACKET sockets (the obsolete type, bound by interface name): one
/// bound to lo, one on every interface. After the restore both are bound
/// as before (the image holds the same sockets, protocol included).
#[test]
fn sock_packet_sockets_round_trip() {
    let rt = round_trip(
        "packet-spkt",
        r#"
libc = ctypes.CDLL(None, use_errno=True)
def spkt_name(s):
    sa = ctypes.create_string_buffer(16); n = ctypes.c_uint32(16)
    expect(libc.getsockname(s.fileno(), sa, ctypes.byref(n)) == 0, "getsockname")
    return sa.raw[2:16].split(b"\0")[0]
SOCK_PACKET = 10
b = socket.socket(socket.AF_PACKET, SOCK_PACKET, socket.htons(0x0003))
sa = struct.pack("H14s", socket.AF_PACKET, b"lo")
expect(libc.bind(b.fileno(), sa, 16) == 0, "bind to lo: %d" % ctypes.get_errno())
n = socket.socket(socket.AF_PACKET, SOCK_PACKET, socket.htons(0x0003))
"#,
        r#"
expect(spkt_name(b) == b"lo", "b bound to %r" % spkt_name(b))
expect(spkt_name(n) == b"", "n bound to %r" % spkt_name(n))
"#,
    );
    let socks = |c: &Checkpoint| {
        objects_of(c, |k| match k {
            ObjectKind::PacketSocket(p) => Some(p),
            _ => None,
        })
    };
    let before = socks(&rt.before);
    assert_eq!(before.len(), 2, "two SOCK_PACKET sockets saved");
    assert!(before.iter().any(|p| p.ifname == "lo"), "one bound to lo");
    assert_eq!(before, socks(&rt.after));
}

/// Mapped rings: a TPACKET_V2 socket on lo with a receive and a transmit
/// ring (PACKET_RESERVE and PACKET_LOSS set before them) mapped shared,
/// and a TPACKET_V3 one with a receive ring, in a fanout group. After the
/// restore the options and the group are as they were, each mapping is at
/// its address with its protections, mapped from the socket (readable),
/// and the rings work: a frame queued in the transmit ring is sent, and it
/// and a UDP datagram on lo appear in the receive rings.
#[test]
fn packet_rings_round_trip() {
    let rt = round_trip(
        "packet-rings",
        r#"
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = os.sysconf("SC_PAGE_SIZE")
SOL_PACKET = 263
def mapping(s, size):
    m = libc.mmap(None, size, 3, 1, s.fileno(), 0)  # PROT_READ|WRITE, MAP_SHARED
    expect(m not in (None, ctypes.c_void_p(-1).value), "mmap: %d" % ctypes.get_errno())
    return m
def maps_at(addr):
    for l in open("/proc/self/maps"):
        f = l.split()
        if int(f[0].split("-")[0], 16) == addr:
            return f
    return None
# V2: 4 blocks of a page, frames of 2048 bytes, for each ring.
r = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
r.bind(("lo", 0x0003))
r.setsockopt(SOL_PACKET, 10, 1)   # PACKET_VERSION: TPACKET_V2
r.setsockopt(SOL_PACKET, 12, 64)  # PACKET_RESERVE
r.setsockopt(SOL_PACKET, 14, 1)   # PACKET_LOSS
req = struct.pack("IIII", PAGE, 4, 2048, 4 * PAGE // 2048)
r.setsockopt(SOL_PACKET, 5, req)   # PACKET_RX_RING
r.setsockopt(SOL_PACKET, 13, req)  # PACKET_TX_RING
RING = 4 * PAGE
rm = mapping(r, 2 * RING)
# V3: a receive ring of 2 blocks of 2 pages retired after 10 ms.
v = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
v.bind(("lo", 0x0800))
v.setsockopt(SOL_PACKET, 10, 2)   # TPACKET_V3
req3 = struct.pack("IIIIIII", 2 * PAGE, 2, 2048, 2 * (2 * PAGE // 2048), 10, 0, 0)
v.setsockopt(SOL_PACKET, 5, req3)
v.setsockopt(SOL_PACKET, 18, 4242)  # PACKET_FANOUT: group 4242, hash
vm = mapping(v, 4 * PAGE)
before = {rm: maps_at(rm), vm: maps_at(vm)}
"#,
        r#"
expect(r.getsockopt(SOL_PACKET, 10) == 1, "r: TPACKET_V2")
expect(r.getsockopt(SOL_PACKET, 12) == 64, "r: PACKET_RESERVE 64")
expect(r.getsockopt(SOL_PACKET, 14) == 1, "r: PACKET_LOSS")
expect(v.getsockopt(SOL_PACKET, 10) == 2, "v: TPACKET_V3")
expect(v.getsockopt(SOL_PACKET, 18) == 4242, "v: fanout %#x" % v.getsockopt(SOL_PACKET, 18))
for addr, sock in ((rm, r), (vm, v)):
    now = maps_at(addr)
    expect(now is not None, "no mapping at %#x" % addr)
    if now is None:
        continue
    expect(now[:3] == before[addr][:3], "mapping %r, was %r" % (now, before[addr]))
    expect(int(now[4]) == os.fstat(sock.fileno()).st_ino, "%#x maps %r, not the socket" % (addr, now))
ctypes.string_at(rm, 2 * RING)  # readable, all of it
ctypes.string_at(vm, 4 * PAGE)
# A frame queued in the transmit ring (the kernel's index is 0 again):
# tpacket2_hdr, the frame at offset 32; ethertype 0x88b5 (local use).
frame = b"\xff" * 6 + b"\x00" * 6 + b"\x88\xb5" + b"tx-ring-frame" + b"\x00" * 32
tx = rm + RING
ctypes.memmove(tx + 32, frame, len(frame))
ctypes.memmove(tx + 4, struct.pack("I", len(frame)), 4)  # tp_len
ctypes.memmove(tx, struct.pack("I", 1), 4)  # TP_STATUS_SEND_REQUEST
expect(libc.send(r.fileno(), None, 0, 0) >= 0, "send of the transmit ring: %d" % ctypes.get_errno())
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.sendto(b"rx-ring-datagram", ("127.0.0.1", 9))
def status(addr):
    return struct.unpack("I", ctypes.string_at(addr, 4))[0]
# r's receive ring, frame by frame from 0, each handed back once read.
want = {b"tx-ring-frame", b"rx-ring-datagram"}
i, deadline = 0, time.time() + 20
while want and time.time() < deadline:
    f = rm + (i // (PAGE // 2048)) * PAGE + (i % (PAGE // 2048)) * 2048
    if status(f) & 1:  # TP_STATUS_USER
        data = ctypes.string_at(f, 2048)
        want = {w for w in want if w not in data}
        ctypes.memmove(f, struct.pack("I", 0), 4)
        i = (i + 1) % (4 * PAGE // 2048)
    else:
        time.sleep(0.01)
expect(not want, "not in the V2 receive ring: %r" % want)
expect(status(tx) == 0, "transmit frame status %#x, not sent" % status(tx))
# v's V3 ring: the datagram in a retired block (block_status at 8).
found, b, deadline = False, 0, time.time() + 20
while not found and time.time() < deadline:
    blk = vm + b * 2 * PAGE
    if status(blk + 8) & 1:
        found = b"rx-ring-datagram" in ctypes.string_at(blk, 2 * PAGE)
        ctypes.memmove(blk + 8, struct.pack("I", 0), 4)
        b = (b + 1) % 2
    else:
        time.sleep(0.01)
expect(found, "the datagram not in the V3 receive ring")
"#,
    );
    let socks = |c: &Checkpoint| {
        let mut v = objects_of(c, |k| match k {
            ObjectKind::PacketSocket(p) => Some(p),
            _ => None,
        });
        v.sort_by_key(|p| p.sock_type);
        v
    };
    let before = socks(&rt.before);
    assert_eq!(before.len(), 2, "two packet sockets saved");
    let (dgram, raw) = (&before[0], &before[1]);
    assert!(raw.rx_ring.is_some() && raw.tx_ring.is_some(), "{raw:?}");
    assert!(
        dgram.rx_ring.is_some() && dgram.tx_ring.is_none(),
        "{dgram:?}"
    );
    assert_eq!(dgram.fanout, 4242);
    assert_eq!(before, socks(&rt.after));
    let rings = |c: &Checkpoint| {
        c.processes[0]
            .vmas
            .iter()
            .filter(|v| v.kind == VmaKind::PacketRing)
            .map(|v| (v.start, v.end, v.prot, v.shared))
            .collect::<Vec<_>>()
    };
    assert_eq!(rings(&rt.before).len(), 2, "both rings mapped");
    assert_eq!(rings(&rt.before), rings(&rt.after));
}
