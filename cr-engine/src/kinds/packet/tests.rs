//! Round trip of kind "packet": a raw packet socket on every interface and
//! a datagram one bound to lo, promiscuous there, with auxiliary data on.

use crate::kinds::testkit::{objects_of, round_trip};
use cr_image::model::{Checkpoint, ObjectKind};

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
