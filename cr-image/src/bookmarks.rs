//! TCP bookmarks: per established connection of an image, its two
//! addresses and the sequence numbers that tell how far each direction got
//! (snd_una, snd_nxt, rcv_nxt, write_seq). A set of images is a consistent
//! cut when no side received a byte its peer had not written (rcv_nxt <=
//! peer's write_seq: bytes written but not yet sent are in the peer's
//! image and are sent again after a restore, where the receiver drops them
//! as duplicates) and no byte is lost (rcv_nxt >= peer's snd_una:
//! everything the peer forgets as acknowledged was received). The coordinator checks this
//! before committing a global checkpoint; `cr_image cut` checks it by hand.

use crate::model::{Checkpoint, ObjectKind};
use serde::Serialize;

/// One established TCP connection of an image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bookmark {
    pub local: String,
    pub remote: String,
    pub snd_una: u32,
    pub snd_nxt: u32,
    pub rcv_nxt: u32,
    /// The last byte the program wrote (snd_nxt plus what is not sent yet).
    pub write_seq: u32,
}

/// The bookmarks of every established TCP connection of `ck`.
pub fn of(ck: &Checkpoint) -> Vec<Bookmark> {
    ck.objects
        .iter()
        .filter_map(|o| {
            let ObjectKind::InetSocket(s) = &o.kind else {
                return None;
            };
            // A connection still being made has nothing to line up.
            let t = s.tcp.as_ref().filter(|_| s.state != 2)?;
            Some(Bookmark {
                local: s.local?.to_string(),
                remote: s.remote?.to_string(),
                snd_una: t.snd_una,
                snd_nxt: t.snd_nxt,
                rcv_nxt: t.rcv_nxt,
                write_seq: t.write_seq,
            })
        })
        .collect()
}

/// `a` is at or after `b` in sequence space (RFC 793 arithmetic).
pub(crate) fn seq_ge(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

/// Where a set of images fails to be a consistent cut.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CutError {
    #[error("connection {local} -> {remote}: {local} received up to {rcv_nxt} but its peer wrote only up to {peer_write_seq} (a byte received that was never sent)")]
    Orphan {
        local: String,
        remote: String,
        rcv_nxt: u32,
        peer_write_seq: u32,
    },
    #[error("connection {local} -> {remote}: {local} received up to {rcv_nxt} but its peer already dropped bytes up to {peer_snd_una} as acknowledged (bytes lost)")]
    Lost {
        local: String,
        remote: String,
        rcv_nxt: u32,
        peer_snd_una: u32,
    },
}

/// Check every connection whose both ends are in `marks` (the bookmarks of
/// all images of the set); returns how many connections were matched.
/// Connections whose peer is not in the set are not judged.
pub fn check_cut(marks: &[Bookmark]) -> Result<usize, CutError> {
    let ends: std::collections::HashMap<(&str, &str), &Bookmark> = marks
        .iter()
        .map(|m| ((m.local.as_str(), m.remote.as_str()), m))
        .collect();
    let mut matched = 0;
    for m in marks {
        let Some(peer) = ends.get(&(m.remote.as_str(), m.local.as_str())) else {
            continue;
        };
        matched += 1;
        if !seq_ge(peer.write_seq, m.rcv_nxt) {
            return Err(CutError::Orphan {
                local: m.local.clone(),
                remote: m.remote.clone(),
                rcv_nxt: m.rcv_nxt,
                peer_write_seq: peer.write_seq,
            });
        }
        if !seq_ge(m.rcv_nxt, peer.snd_una) {
            return Err(CutError::Lost {
                local: m.local.clone(),
                remote: m.remote.clone(),
                rcv_nxt: m.rcv_nxt,
                peer_snd_una: peer.snd_una,
            });
        }
    }
    Ok(matched / 2)
}

/// The connections of `marks` whose other end is not in `marks` (peers
/// outside the set of images).
pub fn unmatched(marks: &[Bookmark]) -> Vec<&Bookmark> {
    let ends: std::collections::HashSet<(&str, &str)> = marks
        .iter()
        .map(|m| (m.local.as_str(), m.remote.as_str()))
        .collect();
    marks
        .iter()
        .filter(|m| !ends.contains(&(m.remote.as_str(), m.local.as_str())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bm(local: &str, remote: &str, una: u32, nxt: u32, rcv: u32) -> Bookmark {
        Bookmark {
            local: local.into(),
            remote: remote.into(),
            snd_una: una,
            snd_nxt: nxt,
            rcv_nxt: rcv,
            write_seq: nxt,
        }
    }

    #[test]
    fn bytes_written_but_not_sent_may_be_received_later() {
        // a wrote up to 160 but had sent only up to 150 when it was read;
        // the kernel sent the rest before b was read.
        let mut a = bm("a:1", "b:2", 100, 150, 9);
        a.write_seq = 160;
        let marks = [a, bm("b:2", "a:1", 7, 9, 158)];
        assert_eq!(check_cut(&marks), Ok(1));
    }

    #[test]
    fn peers_outside_the_set_are_listed() {
        let marks = [
            bm("a:1", "b:2", 1, 1, 1),
            bm("b:2", "a:1", 1, 1, 1),
            bm("a:3", "x:9", 1, 1, 1),
        ];
        let out = unmatched(&marks);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].remote, "x:9");
    }

    #[test]
    fn consistent_pair_with_bytes_in_flight() {
        // a sent 100..150, b received up to 120; b sent 7..9, a received 9.
        let marks = [bm("a:1", "b:2", 100, 150, 9), bm("b:2", "a:1", 7, 9, 120)];
        assert_eq!(check_cut(&marks), Ok(1));
    }

    #[test]
    fn received_more_than_sent_is_refused() {
        let marks = [bm("a:1", "b:2", 100, 150, 9), bm("b:2", "a:1", 7, 9, 151)];
        assert!(matches!(check_cut(&marks), Err(CutError::Orphan { .. })));
    }

    #[test]
    fn acknowledged_but_not_received_is_refused() {
        let marks = [bm("a:1", "b:2", 130, 150, 9), bm("b:2", "a:1", 7, 9, 120)];
        assert!(matches!(check_cut(&marks), Err(CutError::Lost { .. })));
    }

    #[test]
    fn sequence_numbers_wrap() {
        let marks = [
            bm("a:1", "b:2", u32::MAX - 10, 5, 0),
            bm("b:2", "a:1", 0, 0, 2),
        ];
        assert_eq!(check_cut(&marks), Ok(1));
    }

    #[test]
    fn unmatched_connections_are_not_judged() {
        assert_eq!(check_cut(&[bm("a:1", "c:3", 1, 2, 3)]), Ok(0));
    }
}
