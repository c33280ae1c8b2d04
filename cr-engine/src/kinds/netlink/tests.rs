//! Round trip of kind "netlink": a route socket bound, in two groups (one
//! past the first 32), with a raised buffer, and a uevent listener.

use crate::kinds::testkit::{objects_of, round_trip};
use cr_image::model::{Checkpoint, ObjectKind};

#[test]
fn netlink_sockets_round_trip() {
    let rt = round_trip(
        "netlink",
        r#"
r = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
r.bind((0, 0))
r.setsockopt(270, 1, 1); r.setsockopt(270, 1, 33)
r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 300000)
r.setsockopt(270, 5, 1)  # NETLINK_NO_ENOBUFS
u = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)  # NETLINK_KOBJECT_UEVENT
u.bind((os.getpid() + 12345, 1))
name_r, name_u = r.getsockname(), u.getsockname()
groups = r.getsockopt(270, 9, 8)
"#,
        r#"
expect(r.getsockname() == name_r, "route socket port %r" % (r.getsockname(),))
expect(u.getsockname() == name_u, "uevent socket port and group %r" % (u.getsockname(),))
expect(r.getsockopt(270, 9, 8) == groups, "route groups")
expect(r.getsockopt(270, 5) == 1, "NETLINK_NO_ENOBUFS")
r.send(struct.pack("=IHHII", 20, 18, 0x301, 9, 0) + struct.pack("Bxxx", 0))
data = r.recv(1 << 20)
expect(struct.unpack_from("=IHHII", data)[3] == 9, "the kernel answers the dump")
"#,
    );
    let socks = |c: &Checkpoint| {
        let mut v = objects_of(c, |k| match k {
            ObjectKind::NetlinkSocket(n) => Some(n),
            _ => None,
        });
        v.sort_by_key(|n| n.protocol);
        v
    };
    let before = socks(&rt.before);
    assert_eq!(before.len(), 2, "two netlink sockets saved");
    assert_eq!(before[0].groups, vec![1, 33]);
    assert_eq!(before, socks(&rt.after));
}
