//! TCP bookmarks: per established connection of an image, its two
//! addresses and the sequence numbers that tell how far each direction got
//! (snd_una, snd_nxt, rcv_nxt). A set of images is a consistent cut when no
//! side received a byte its peer had not sent (rcv_nxt <= peer's snd_nxt)
//! and no byte is lost (rcv_nxt >= peer's snd_una: everything the peer
//! forgets as acknowledged was received). The coordinator checks this
//! before committing a global checkpoint; `cr_image cut` checks it by hand.

use crate::proto;
use serde_json::{json, Value};

/// One established TCP connection of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bookmark {
    pub local: String,
    pub remote: String,
    pub snd_una: u32,
    pub snd_nxt: u32,
    pub rcv_nxt: u32,
}

impl Bookmark {
    pub fn to_json(&self) -> Value {
        json!({
            "local": self.local,
            "remote": self.remote,
            "state": "ESTABLISHED",
            "snd_una": self.snd_una,
            "snd_nxt": self.snd_nxt,
            "rcv_nxt": self.rcv_nxt,
        })
    }
}

/// The bookmarks of every established TCP connection of `ck`.
pub fn of(ck: &proto::Checkpoint) -> Vec<Bookmark> {
    ck.objects
        .iter()
        .filter_map(|o| {
            let s = o.inet.as_ref()?;
            let t = s.tcp.as_ref()?;
            Some(Bookmark {
                local: s.local.clone(),
                remote: s.remote.clone(),
                snd_una: t.snd_una,
                snd_nxt: t.snd_nxt,
                rcv_nxt: t.rcv_nxt,
            })
        })
        .collect()
}

/// `a` is at or after `b` in sequence space (RFC 793 arithmetic).
fn seq_ge(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

/// Where a set of images fails to be a consistent cut.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CutError {
    #[error("connection {local} -> {remote}: {local} received up to {rcv_nxt} but its peer sent only up to {peer_snd_nxt} (a byte received that was never sent)")]
    Orphan {
        local: String,
        remote: String,
        rcv_nxt: u32,
        peer_snd_nxt: u32,
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
    let mut matched = 0;
    for m in marks {
        let Some(peer) = marks
            .iter()
            .find(|p| p.local == m.remote && p.remote == m.local)
        else {
            continue;
        };
        matched += 1;
        if !seq_ge(peer.snd_nxt, m.rcv_nxt) {
            return Err(CutError::Orphan {
                local: m.local.clone(),
                remote: m.remote.clone(),
                rcv_nxt: m.rcv_nxt,
                peer_snd_nxt: peer.snd_nxt,
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
        }
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
