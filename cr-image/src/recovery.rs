//! The recovery line of uncoordinated checkpoints: given every member's
//! checkpoints in the order they were taken (each with the bookmarks of its
//! TCP connections), the latest checkpoint of each member such that the
//! chosen set is a consistent cut (the rule of [`crate::bookmarks`]).
//!
//! A member may also be at the *start* (no checkpoint: the job starts that
//! member over), where it holds no connection.
//!
//! # The rule, extended to connections that open and close
//! A connection end (local, remote) of member A, at A's checkpoint k, is
//! *before* (A had not opened it yet: no checkpoint up to k lists it),
//! *during* (k lists it: its sequence numbers), or *after* (closed: an
//! earlier checkpoint lists it, k and the later ones do not). For the
//! bytes flowing A -> B, with B's end the reverse pair:
//! - **no orphan**: B received no byte A had not written:
//!   `rcv_nxt(B) <= write_seq(A)`, else B rolls back;
//! - **nothing lost**: every byte A dropped as acknowledged was received by
//!   B: `snd_una(A) <= rcv_nxt(B)`, else A rolls back.
//!
//! *before* counts as minus infinity and *after* as plus infinity on both
//! sides, so a connection one side has and the other has not yet (or no
//! longer) is inconsistent and rolls back the side that is further on.
//!
//! # Why a fixpoint gives the maximum
//! Every bound above reads "a value non-decreasing in B's checkpoint <= a
//! value non-decreasing in A's checkpoint". The component-wise maximum of
//! two consistent cuts is then consistent, so there is one maximum
//! consistent cut; rolling back only the side a violated bound names never
//! passes below it (the other side is already at its maximum or above),
//! and the loop stops at a consistent cut: that maximum.
//!
//! Connections whose other end no member's checkpoint lists (a peer
//! outside the job, a peer that has not been checkpointed since the
//! connection opened, or a connection that lived and died between two
//! checkpoints of its peer) are not judged; [`Line::unmatched`] lists those
//! still open on the line, for the job's external-connection policy.
//!
//! # Garbage
//! Once every connection end listed anywhere in the history has its other
//! end listed too ([`Line::unpaired`] empty, or only peers known to be
//! outside the job), the checkpoints before the line are garbage and stay
//! garbage as checkpoints are added: an end first listed later was not
//! open at any checkpoint of the old line (on either side), so the old
//! line stays consistent and the maximum only moves forward. With an
//! unpaired end that is not so: its peer's first checkpoint listing it can
//! show the line was too far on (property-tested both ways).

use crate::bookmarks::{seq_ge, Bookmark};
use serde::Serialize;
use std::collections::HashMap;

/// Where each member's checkpoint lies on the recovery line: the index of
/// the checkpoint in its history, or `None` for the start.
pub type Cut = Vec<Option<usize>>;

/// The recovery line of a job's checkpoint history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Line {
    /// Per member, its checkpoint on the line (`None`: the start).
    pub cut: Cut,
    /// Per member, how many of its checkpoints lie after the line (what a
    /// restart from the line rolls back).
    pub rolled_back: Vec<usize>,
    /// Connections open on the line whose other end no member lists, as
    /// (member, local, remote).
    pub unmatched: Vec<(usize, String, String)>,
    /// Every connection end listed anywhere in the history whose other end
    /// no checkpoint lists, as (member, local, remote): while one of them
    /// may lead to a member, the line may still move back (see the module
    /// docs, Garbage).
    pub unpaired: Vec<(usize, String, String)>,
}

impl Line {
    /// Every member is at the start: nothing of the history is usable.
    pub fn at_start(&self) -> bool {
        self.cut.iter().all(Option::is_none)
    }

    /// Whether checkpoint `k` of `member` lies behind the line (garbage
    /// when no end is unpaired: see the module docs).
    pub fn behind(&self, member: usize, k: usize) -> bool {
        self.cut[member].is_some_and(|on| k < on)
    }
}

/// A position of one connection end at a checkpoint.
#[derive(Clone, Copy)]
enum Pos<'a> {
    Before,
    During(&'a Bookmark),
    After,
}

/// One connection end as the line sees it: its owner and where it appears
/// in the owner's history.
struct End<'a> {
    member: usize,
    /// The first checkpoint listing it.
    first: usize,
    /// Its bookmark per checkpoint of the owner that lists it.
    at: HashMap<usize, &'a Bookmark>,
}

impl<'a> End<'a> {
    fn pos(&self, k: Option<usize>) -> Pos<'a> {
        match k {
            None => Pos::Before,
            Some(k) if k < self.first => Pos::Before,
            // Not listed at or after its first appearance: closed (a gap
            // between two appearances, the 4-tuple reused, counts as closed).
            Some(k) => self.at.get(&k).map_or(Pos::After, |b| Pos::During(b)),
        }
    }
}

/// Whether the bound "low <= high" between two sides holds, in extended
/// sequence space.
fn holds(low: Ext, high: Ext) -> bool {
    match (low, high) {
        (Ext::MinusInf, _) | (_, Ext::PlusInf) => true,
        (Ext::PlusInf, _) | (_, Ext::MinusInf) => false,
        (Ext::Seq(l), Ext::Seq(h)) => seq_ge(h, l),
    }
}

#[derive(Clone, Copy)]
enum Ext {
    MinusInf,
    Seq(u32),
    PlusInf,
}

fn ext(p: Pos, f: impl Fn(&Bookmark) -> u32) -> Ext {
    match p {
        Pos::Before => Ext::MinusInf,
        Pos::During(b) => Ext::Seq(f(b)),
        Pos::After => Ext::PlusInf,
    }
}

/// Which side a violated bound rolls back.
enum Violation {
    Sender,
    Receiver,
}

/// The bounds of the bytes flowing from end `s` (sender, at checkpoint
/// `ks` of its owner) to end `r` (receiver, at `kr`).
fn check(s: &End, ks: Option<usize>, r: &End, kr: Option<usize>) -> Option<Violation> {
    let (ps, pr) = (s.pos(ks), r.pos(kr));
    let rcv = ext(pr, |b| b.rcv_nxt);
    if !holds(rcv, ext(ps, |b| b.write_seq)) {
        return Some(Violation::Receiver);
    }
    if !holds(ext(ps, |b| b.snd_una), rcv) {
        return Some(Violation::Sender);
    }
    None
}

/// The connection ends of `history` (per member, its checkpoints' bookmarks
/// in the order taken), and the pairs (sender end, receiver end) whose both
/// ends are listed somewhere.
fn ends(history: &[Vec<Vec<Bookmark>>]) -> (Vec<End<'_>>, Vec<(usize, usize)>) {
    let mut index: HashMap<(&str, &str), usize> = HashMap::new();
    let mut ends: Vec<End> = Vec::new();
    for (m, cks) in history.iter().enumerate() {
        for (k, marks) in cks.iter().enumerate() {
            for b in marks {
                let key = (b.local.as_str(), b.remote.as_str());
                let i = *index.entry(key).or_insert_with(|| {
                    ends.push(End {
                        member: m,
                        first: k,
                        at: HashMap::new(),
                    });
                    ends.len() - 1
                });
                let e = &mut ends[i];
                // The same 4-tuple in two members cannot be one end; the
                // first owner keeps it and the other's copy is not judged.
                if e.member == m {
                    e.at.insert(k, b);
                }
            }
        }
    }
    let pairs = index
        .iter()
        .filter_map(|(&(l, r), &s)| index.get(&(r, l)).map(|&rv| (s, rv)))
        .collect();
    (ends, pairs)
}

/// Whether `cut` is consistent for `history`.
pub fn consistent(history: &[Vec<Vec<Bookmark>>], cut: &[Option<usize>]) -> bool {
    let (ends, pairs) = ends(history);
    pairs.iter().all(|&(s, r)| {
        let (s, r) = (&ends[s], &ends[r]);
        check(s, cut[s.member], r, cut[r.member]).is_none()
    })
}

/// The maximum consistent recovery line of `history`: per member, its
/// checkpoints' bookmarks in the order taken.
pub fn recovery_line(history: &[Vec<Vec<Bookmark>>]) -> Line {
    let (ends, pairs) = ends(history);
    let mut cut: Cut = history.iter().map(|cks| cks.len().checked_sub(1)).collect();
    loop {
        let mut moved = false;
        for &(s, r) in &pairs {
            let (s, r) = (&ends[s], &ends[r]);
            let back = match check(s, cut[s.member], r, cut[r.member]) {
                None => continue,
                Some(Violation::Sender) => s.member,
                Some(Violation::Receiver) => r.member,
            };
            cut[back] = cut[back].and_then(|k| k.checked_sub(1));
            moved = true;
        }
        if !moved {
            break;
        }
    }
    let rolled_back = history
        .iter()
        .zip(&cut)
        .map(|(cks, k)| cks.len() - k.map_or(0, |k| k + 1))
        .collect();
    let paired: std::collections::HashSet<usize> = pairs.iter().map(|&(s, _)| s).collect();
    let mut unmatched: Vec<(usize, String, String)> = ends
        .iter()
        .enumerate()
        .filter(|(i, _)| !paired.contains(i))
        .filter_map(|(_, e)| match e.pos(cut[e.member]) {
            Pos::During(b) => Some((e.member, b.local.clone(), b.remote.clone())),
            _ => None,
        })
        .collect();
    unmatched.sort();
    let mut unpaired: Vec<(usize, String, String)> = ends
        .iter()
        .enumerate()
        .filter(|(i, _)| !paired.contains(i))
        .filter_map(|(_, e)| {
            e.at.values()
                .next()
                .map(|b| (e.member, b.local.clone(), b.remote.clone()))
        })
        .collect();
    unpaired.sort();
    Line {
        cut,
        rolled_back,
        unmatched,
        unpaired,
    }
}

#[cfg(test)]
mod tests;
