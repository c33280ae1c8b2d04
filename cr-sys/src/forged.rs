//! Packets written by hand and sent through a raw socket as if a peer had
//! sent them:
//! - a TCP segment: how a connection rebuilt in repair mode is told again
//!   that the peer closed its side (a FIN), or acknowledged ours (an ACK).
//!   Repair mode has no way to queue a received FIN or to move `snd_una`;
//!   a segment from the peer does both, through the ordinary receive path
//!   (a socket in repair mode still processes what arrives);
//! - a UDP datagram: how a rebuilt UDP socket gets back the datagrams that
//!   waited in its receive queue, each from its own sender (no socket
//!   option queues a datagram, and the sender's port may be nobody's now).
//!
//! Kernel behaviour worth knowing:
//! - A raw `IPPROTO_RAW` socket sends the IP header we write (IPv4: the
//!   kernel fills the header checksum, total length and ID; IPv6: nothing).
//!   The TCP or UDP checksum is ours to compute, pseudo-header included
//!   (IPv4 UDP may leave it 0: none).
//! - A packet to a local address loops back with its route attached: no
//!   reverse-path filter looks at the forged source address, and its
//!   `SO_MARK` stays on it, so nft rules can tell it apart
//!   ([`REPAIR_MARK`], let through by the network lock).
//! - A segment without a timestamp option is accepted by a connection that
//!   negotiated timestamps (PAWS only checks segments that carry one): we
//!   do not know the peer's last TSval, so we send none.

use crate::error::{NixResult, Result};
use crate::inet::canonical_ip;
use nix::sys::socket::{self as sock, MsgFlags, SockaddrStorage};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;

/// The mark of forged segments (SO_MARK), which the network lock lets
/// through (`netlock::script`).
pub const REPAIR_MARK: u32 = 0x0c7_5e6;

/// TCP header flags.
pub const FIN: u8 = 0x01;
pub const ACK: u8 = 0x10;

/// One segment from `from` (the peer) to `to` (our socket), no payload.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    pub from: SocketAddr,
    pub to: SocketAddr,
    pub seq: u32,
    pub ack: u32,
    pub flags: u8,
    /// The window field as sent (already scaled down).
    pub window: u16,
}

/// One's-complement sum of `data` as big-endian 16-bit words, added to `sum`.
fn sum16(mut sum: u32, data: &[u8]) -> u32 {
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        sum += u32::from(w);
    }
    sum
}

fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The 20-byte TCP header of `s`, checksum left 0.
fn tcp_header(s: &Segment) -> Vec<u8> {
    let mut t = Vec::with_capacity(20);
    t.extend_from_slice(&s.from.port().to_be_bytes());
    t.extend_from_slice(&s.to.port().to_be_bytes());
    t.extend_from_slice(&s.seq.to_be_bytes());
    t.extend_from_slice(&s.ack.to_be_bytes());
    t.push(5 << 4); // data offset: 5 words, no options
    t.push(s.flags);
    t.extend_from_slice(&s.window.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    t
}

/// `l4` (a TCP or UDP header and payload, its checksum field at
/// `checksum_at` still 0) behind an IP header from `from` to `to`, its
/// checksum computed over the pseudo-header.
fn ip_packet(
    from: IpAddr,
    to: IpAddr,
    proto: u8,
    mut l4: Vec<u8>,
    checksum_at: usize,
) -> std::result::Result<Vec<u8>, &'static str> {
    let len = u16::try_from(l4.len()).map_err(|_| "payload too large for one packet")?;
    let (mut p, pseudo) = match (canonical_ip(from), canonical_ip(to)) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            if usize::from(len) + 20 > usize::from(u16::MAX) {
                return Err("payload too large for one IPv4 packet");
            }
            let mut pseudo = Vec::with_capacity(12);
            pseudo.extend_from_slice(&src.octets());
            pseudo.extend_from_slice(&dst.octets());
            pseudo.extend_from_slice(&[0, proto]);
            pseudo.extend_from_slice(&len.to_be_bytes());
            // Version/IHL, TOS, total length and ID (the kernel fills
            // them), don't fragment, TTL, protocol, header checksum (the
            // kernel's).
            let mut p = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, proto, 0, 0];
            p.extend_from_slice(&src.octets());
            p.extend_from_slice(&dst.octets());
            (p, pseudo)
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let mut pseudo = Vec::with_capacity(40);
            pseudo.extend_from_slice(&src.octets());
            pseudo.extend_from_slice(&dst.octets());
            pseudo.extend_from_slice(&u32::from(len).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, proto]);
            let mut p = vec![0x60, 0, 0, 0];
            p.extend_from_slice(&len.to_be_bytes());
            p.extend_from_slice(&[proto, 64]);
            p.extend_from_slice(&src.octets());
            p.extend_from_slice(&dst.octets());
            (p, pseudo)
        }
        _ => return Err("one end IPv4, the other IPv6"),
    };
    let mut c = fold(sum16(sum16(0, &pseudo), &l4));
    if [libc::IPPROTO_UDP as u8, libc::IPPROTO_UDPLITE as u8].contains(&proto) && c == 0 {
        c = 0xffff; // 0 means "no checksum" in UDP
    }
    l4[checksum_at..checksum_at + 2].copy_from_slice(&c.to_be_bytes());
    p.extend(l4);
    Ok(p)
}

/// The whole packet (IP header and TCP header) of `s`.
pub fn packet(s: &Segment) -> std::result::Result<Vec<u8>, &'static str> {
    ip_packet(
        s.from.ip(),
        s.to.ip(),
        libc::IPPROTO_TCP as u8,
        tcp_header(s),
        16,
    )
}

/// Send `s` through a raw socket marked [`REPAIR_MARK`].
pub fn send(s: &Segment) -> Result<()> {
    let what = format!("forging a TCP segment {} -> {}", s.from, s.to);
    send_raw(s.to, packet(s), what)
}

/// A UDP (or UDP-Lite) datagram from `from` to `to` (our socket) carrying
/// `payload`.
#[derive(Debug, Clone, Copy)]
pub struct Datagram<'a> {
    pub from: SocketAddr,
    pub to: SocketAddr,
    pub payload: &'a [u8],
    /// UDP-Lite (RFC 3828): the header's length field is the checksum
    /// coverage instead, 0 for all of it (what any receiver accepts).
    pub lite: bool,
}

/// The whole packet (IP header, UDP header, payload) of `d`.
pub fn datagram(d: &Datagram<'_>) -> std::result::Result<Vec<u8>, &'static str> {
    let len = u16::try_from(8 + d.payload.len()).map_err(|_| "datagram too large")?;
    let mut u = Vec::with_capacity(usize::from(len));
    u.extend_from_slice(&d.from.port().to_be_bytes());
    u.extend_from_slice(&d.to.port().to_be_bytes());
    let (proto, field) = if d.lite {
        (libc::IPPROTO_UDPLITE, 0)
    } else {
        (libc::IPPROTO_UDP, len)
    };
    u.extend_from_slice(&field.to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(d.payload);
    ip_packet(d.from.ip(), d.to.ip(), proto as u8, u, 6)
}

/// Send `d` through a raw socket marked [`REPAIR_MARK`].
pub fn send_datagram(d: &Datagram<'_>) -> Result<()> {
    let what = format!(
        "forging a UDP datagram of {} bytes {} -> {}",
        d.payload.len(),
        d.from,
        d.to
    );
    send_raw(d.to, datagram(d), what)
}

fn send_raw(
    to: SocketAddr,
    packet: std::result::Result<Vec<u8>, &'static str>,
    what: String,
) -> Result<()> {
    let p = packet.map_err(|e| crate::error::SysError::Syscall {
        what: format!("{what}: {e}"),
        source: crate::error::Errno(libc::EAFNOSUPPORT),
    })?;
    let to = canonical_ip(to.ip());
    let family = if to.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let raw = crate::inet::socket(family, libc::SOCK_RAW, libc::IPPROTO_RAW)?;
    crate::fdio::setsockopt_int(&raw, libc::SOL_SOCKET, libc::SO_MARK, REPAIR_MARK as i32)?;
    let dst = SockaddrStorage::from(SocketAddr::new(to, 0));
    sock::sendto(raw.as_raw_fd(), &p, &dst, MsgFlags::empty()).or_sys(|| what)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksum of a header holding its own checksum folds to zero.
    #[test]
    fn checksums_verify() {
        for (from, to) in [
            ("10.1.2.3:5000", "10.1.2.4:40000"),
            ("[fd00::1]:5000", "[fd00::2]:40000"),
            ("[::ffff:127.0.0.1]:5000", "[::ffff:127.0.0.1]:40001"),
        ] {
            let s = Segment {
                from: from.parse().unwrap(),
                to: to.parse().unwrap(),
                seq: 0xdead_beef,
                ack: 7,
                flags: FIN | ACK,
                window: 512,
            };
            let p = packet(&s).unwrap();
            let (ip_len, pseudo) = if p[0] >> 4 == 4 {
                let mut ps = p[12..20].to_vec();
                ps.extend_from_slice(&[0, 6, 0, 20]);
                (20, ps)
            } else {
                let mut ps = p[8..40].to_vec();
                ps.extend_from_slice(&[0, 0, 0, 20, 0, 0, 0, 6]);
                (40, ps)
            };
            assert_eq!(p.len(), ip_len + 20);
            assert_eq!(fold(sum16(sum16(0, &pseudo), &p[ip_len..])), 0, "{from}");
            assert_eq!(p[ip_len + 13], FIN | ACK);
        }
    }

    /// A UDP datagram's checksum, over its pseudo-header, verifies too, and
    /// the IPv6 payload length counts the UDP header.
    #[test]
    fn datagram_checksums_verify() {
        for (from, to) in [
            ("10.1.2.3:5000", "127.0.0.1:40000"),
            ("[fd00::1]:5000", "[::1]:40000"),
        ] {
            let payload = b"odd length!";
            let d = Datagram {
                from: from.parse().unwrap(),
                to: to.parse().unwrap(),
                payload,
                lite: false,
            };
            let p = datagram(&d).unwrap();
            let n = 8 + payload.len();
            let (ip_len, pseudo) = if p[0] >> 4 == 4 {
                let mut ps = p[12..20].to_vec();
                ps.extend_from_slice(&[0, 17, 0, n as u8]);
                (20, ps)
            } else {
                assert_eq!(u16::from_be_bytes([p[4], p[5]]) as usize, n);
                let mut ps = p[8..40].to_vec();
                ps.extend_from_slice(&[0, 0, 0, n as u8, 0, 0, 0, 17]);
                (40, ps)
            };
            assert_eq!(p.len(), ip_len + n);
            assert_eq!(fold(sum16(sum16(0, &pseudo), &p[ip_len..])), 0, "{from}");
            assert_eq!(&p[ip_len + 8..], payload);
        }
    }
}
