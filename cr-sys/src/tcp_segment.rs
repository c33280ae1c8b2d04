//! A TCP segment written by hand and sent through a raw socket as if a
//! connection's peer had sent it: how a connection rebuilt in repair mode
//! is told again that the peer closed its side (a FIN), or acknowledged
//! ours (an ACK). Repair mode has no way to queue a received FIN or to move
//! `snd_una`; a segment from the peer does both, through the ordinary
//! receive path (a socket in repair mode still processes what arrives).
//!
//! Kernel behaviour worth knowing:
//! - A raw `IPPROTO_RAW` socket sends the IP header we write (IPv4: the
//!   kernel fills the header checksum, total length and ID; IPv6: nothing).
//!   The TCP checksum is ours to compute, pseudo-header included.
//! - A segment to a local address loops back with its route attached: no
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

/// The 20-byte TCP header of `s`, its checksum computed over `pseudo`.
fn tcp_header(s: &Segment, pseudo: &[u8]) -> Vec<u8> {
    let mut t = Vec::with_capacity(20);
    t.extend_from_slice(&s.from.port().to_be_bytes());
    t.extend_from_slice(&s.to.port().to_be_bytes());
    t.extend_from_slice(&s.seq.to_be_bytes());
    t.extend_from_slice(&s.ack.to_be_bytes());
    t.push(5 << 4); // data offset: 5 words, no options
    t.push(s.flags);
    t.extend_from_slice(&s.window.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    let c = fold(sum16(sum16(0, pseudo), &t));
    t[16..18].copy_from_slice(&c.to_be_bytes());
    t
}

/// The whole packet (IP header and TCP header) of `s`.
pub fn packet(s: &Segment) -> std::result::Result<Vec<u8>, &'static str> {
    match (canonical_ip(s.from.ip()), canonical_ip(s.to.ip())) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            let mut pseudo = Vec::with_capacity(12);
            pseudo.extend_from_slice(&src.octets());
            pseudo.extend_from_slice(&dst.octets());
            pseudo.extend_from_slice(&[0, libc::IPPROTO_TCP as u8, 0, 20]);
            let mut p = vec![
                0x45,
                0,
                0,
                40,
                0,
                0,
                0x40,
                0,
                64,
                libc::IPPROTO_TCP as u8,
                0,
                0,
            ];
            p.extend_from_slice(&src.octets());
            p.extend_from_slice(&dst.octets());
            p.extend(tcp_header(s, &pseudo));
            Ok(p)
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let mut pseudo = Vec::with_capacity(40);
            pseudo.extend_from_slice(&src.octets());
            pseudo.extend_from_slice(&dst.octets());
            pseudo.extend_from_slice(&[0, 0, 0, 20, 0, 0, 0, libc::IPPROTO_TCP as u8]);
            let mut p = vec![0x60, 0, 0, 0, 0, 20, libc::IPPROTO_TCP as u8, 64];
            p.extend_from_slice(&src.octets());
            p.extend_from_slice(&dst.octets());
            p.extend(tcp_header(s, &pseudo));
            Ok(p)
        }
        _ => Err("one end IPv4, the other IPv6"),
    }
}

/// Send `s` through a raw socket marked [`REPAIR_MARK`].
pub fn send(s: &Segment) -> Result<()> {
    let what = || format!("forging a TCP segment {} -> {}", s.from, s.to);
    let p = packet(s).map_err(|e| crate::error::SysError::Syscall {
        what: format!("{}: {e}", what()),
        source: crate::error::Errno(libc::EAFNOSUPPORT),
    })?;
    let to = canonical_ip(s.to.ip());
    let family = if to.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let raw = crate::inet::socket(family, libc::SOCK_RAW, libc::IPPROTO_RAW)?;
    crate::fdio::setsockopt_int(&raw, libc::SOL_SOCKET, libc::SO_MARK, REPAIR_MARK as i32)?;
    let dst = SockaddrStorage::from(SocketAddr::new(to, 0));
    sock::sendto(raw.as_raw_fd(), &p, &dst, MsgFlags::empty()).or_sys(what)?;
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
}
