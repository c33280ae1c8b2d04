//! The recovery line against an oracle: random executions of members that
//! open TCP connections, write, send, deliver, acknowledge, close and
//! checkpoint, simulated with unbounded byte counters and explicit
//! connection states; the oracle judges every cut of the checkpoints from
//! that ground truth, and the line must be the one consistent cut that
//! every other consistent cut lies below.

use super::*;
use proptest::prelude::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Unopened,
    Open,
    Closed,
}

/// One direction of a connection, in bytes since it opened.
#[derive(Clone, Copy, Default, Debug)]
struct Flow {
    written: u64,
    sent: u64,
    received: u64,
    acked: u64,
    /// Initial sequence number (the bookmarks wrap around from it).
    isn: u32,
}

#[derive(Clone, Debug)]
struct Conn {
    ends: [usize; 2],
    state: State,
    /// flows[0]: ends[0] -> ends[1]; flows[1]: the way back.
    flows: [Flow; 2],
}

impl Conn {
    fn addr(&self, c: usize, side: usize) -> String {
        format!("10.0.0.{}:{}", self.ends[side] + 1, 1000 + 2 * c + side)
    }
}

#[derive(Clone, Debug)]
enum Op {
    Open(usize),
    Write(usize, usize, u64),
    Send(usize, usize, u64),
    Deliver(usize, usize, u64),
    Ack(usize, usize),
    Close(usize),
    Checkpoint(usize),
}

/// A simulated execution: the conns' state at every checkpoint.
struct Run {
    /// Per member, its checkpoints' bookmarks (what the line sees).
    history: Vec<Vec<Vec<Bookmark>>>,
    /// Per member, the state of every connection at each of its checkpoints.
    truth: Vec<Vec<Vec<Conn>>>,
    /// The global step of each checkpoint, per member.
    steps: Vec<Vec<usize>>,
    conns0: Vec<Conn>,
}

fn simulate(members: usize, mut conns: Vec<Conn>, ops: &[Op]) -> Run {
    let mut run = Run {
        history: vec![Vec::new(); members],
        truth: vec![Vec::new(); members],
        steps: vec![Vec::new(); members],
        conns0: conns.clone(),
    };
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Open(c) if conns[c].state == State::Unopened => conns[c].state = State::Open,
            Op::Write(c, d, n) if conns[c].state == State::Open => conns[c].flows[d].written += n,
            Op::Send(c, d, n) if conns[c].state == State::Open => {
                let f = &mut conns[c].flows[d];
                f.sent = (f.sent + n).min(f.written);
            }
            Op::Deliver(c, d, n) if conns[c].state == State::Open => {
                let f = &mut conns[c].flows[d];
                f.received = (f.received + n).min(f.sent);
            }
            Op::Ack(c, d) if conns[c].state == State::Open => {
                let f = &mut conns[c].flows[d];
                f.acked = f.received;
            }
            // A close is graceful: only once every byte both ways was
            // received and acknowledged.
            Op::Close(c)
                if conns[c].state == State::Open
                    && conns[c].flows.iter().all(|f| f.acked == f.written) =>
            {
                conns[c].state = State::Closed
            }
            Op::Checkpoint(m) => {
                let mut marks = Vec::new();
                for (i, c) in conns.iter().enumerate() {
                    if c.state != State::Open {
                        continue;
                    }
                    for side in 0..2 {
                        if c.ends[side] != m {
                            continue;
                        }
                        let (out, back) = (&c.flows[side], &c.flows[1 - side]);
                        let seq = |f: &Flow, n: u64| f.isn.wrapping_add(n as u32);
                        marks.push(Bookmark {
                            local: c.addr(i, side),
                            remote: c.addr(i, 1 - side),
                            snd_una: seq(out, out.acked),
                            snd_nxt: seq(out, out.sent),
                            write_seq: seq(out, out.written),
                            rcv_nxt: seq(back, back.received),
                        });
                    }
                }
                run.history[m].push(marks);
                run.truth[m].push(conns.clone());
                run.steps[m].push(step);
            }
            _ => {}
        }
    }
    run
}

impl Run {
    /// The connections of the run as member `m` saw them at checkpoint `k`
    /// (the start: as they were before the first step).
    fn at(&self, m: usize, k: Option<usize>) -> &[Conn] {
        k.map_or(&self.conns0, |k| &self.truth[m][k])
    }

    /// Whether a connection was listed by both its ends in some checkpoint:
    /// only those can be judged from bookmarks (see the module docs).
    fn observable(&self, c: usize) -> bool {
        (0..2).all(|side| {
            let m = self.conns0[c].ends[side];
            self.truth[m]
                .iter()
                .any(|conns| conns[c].state == State::Open)
        })
    }

    /// The oracle: `cut` is consistent when every observable connection is
    /// in the same state at both ends' checkpoints and, when open, no end
    /// received a byte its peer had not written and no end dropped as
    /// acknowledged a byte its peer had not received.
    fn consistent(&self, cut: &[Option<usize>]) -> bool {
        (0..self.conns0.len())
            .filter(|&c| self.observable(c))
            .all(|c| {
                let [a, b] = self.conns0[c].ends;
                let (ca, cb) = (&self.at(a, cut[a])[c], &self.at(b, cut[b])[c]);
                if ca.state != cb.state {
                    return false;
                }
                if ca.state != State::Open {
                    return true;
                }
                // Flow 0 is written by a, received by b; flow 1 the reverse.
                let (s0, r0) = (&ca.flows[0], &cb.flows[0]);
                let (s1, r1) = (&cb.flows[1], &ca.flows[1]);
                r0.received <= s0.written
                    && s0.acked <= r0.received
                    && r1.received <= s1.written
                    && s1.acked <= r1.received
            })
    }
}

/// Every cut of `counts` checkpoints per member (None: the start).
fn all_cuts(counts: &[usize]) -> Vec<Cut> {
    let mut cuts = vec![Vec::new()];
    for &n in counts {
        cuts = cuts
            .into_iter()
            .flat_map(|cut| {
                std::iter::once(None).chain((0..n).map(Some)).map(move |k| {
                    let mut c = cut.clone();
                    c.push(k);
                    c
                })
            })
            .collect();
    }
    cuts
}

fn le(a: &[Option<usize>], b: &[Option<usize>]) -> bool {
    a.iter().zip(b).all(|(x, y)| x <= y)
}

fn ops(members: usize, conns: usize) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        (0..conns).prop_map(Op::Open),
        (0..conns, 0..2usize, 1..400u64).prop_map(|(c, d, n)| Op::Write(c, d, n)),
        (0..conns, 0..2usize, 1..400u64).prop_map(|(c, d, n)| Op::Send(c, d, n)),
        (0..conns, 0..2usize, 1..400u64).prop_map(|(c, d, n)| Op::Deliver(c, d, n)),
        (0..conns, 0..2usize).prop_map(|(c, d)| Op::Ack(c, d)),
        (0..conns).prop_map(Op::Close),
        (0..members).prop_map(Op::Checkpoint),
        (0..members).prop_map(Op::Checkpoint),
    ];
    prop::collection::vec(op, 0..36)
}

fn scenario() -> impl Strategy<Value = (usize, Vec<Conn>, Vec<Op>)> {
    (2..=4usize, 1..=4usize).prop_flat_map(|(members, nconns)| {
        let conn = (
            0..members,
            1..members,
            any::<u32>(),
            any::<u32>(),
            any::<bool>(),
        )
            .prop_map(move |(a, off, i0, i1, wrap)| {
                // Half of the connections start just below the wrap point.
                let isn = |i: u32| if wrap { u32::MAX - (i % 512) } else { i };
                Conn {
                    ends: [a, (a + off) % members],
                    state: State::Unopened,
                    flows: [
                        Flow {
                            isn: isn(i0),
                            ..Flow::default()
                        },
                        Flow {
                            isn: isn(i1),
                            ..Flow::default()
                        },
                    ],
                }
            });
        (
            Just(members),
            prop::collection::vec(conn, nconns),
            ops(members, nconns),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// The line equals the brute-force maximum over all cuts, and the
    /// consistency test agrees with the oracle on every cut.
    #[test]
    fn line_is_the_maximum_consistent_cut((members, conns, ops) in scenario()) {
        let run = simulate(members, conns, &ops);
        let line = recovery_line(&run.history);
        let counts: Vec<usize> = run.history.iter().map(Vec::len).collect();
        prop_assert!(run.consistent(&line.cut), "line {:?} is not consistent", line.cut);
        for cut in all_cuts(&counts) {
            let truth = run.consistent(&cut);
            prop_assert_eq!(consistent(&run.history, &cut), truth, "cut {:?}", cut);
            if truth {
                prop_assert!(le(&cut, &line.cut), "consistent cut {:?} above the line {:?}", cut, line.cut);
            }
        }
        for (m, n) in counts.iter().enumerate() {
            prop_assert_eq!(line.rolled_back[m], n - line.cut[m].map_or(0, |k| k + 1));
        }
    }

    /// As checkpoints are added the line only moves forward once no end is
    /// unpaired, so a checkpoint collected as garbage then is never needed
    /// later.
    #[test]
    fn garbage_stays_garbage((members, conns, ops) in scenario()) {
        let run = simulate(members, conns, &ops);
        let mut before: Option<Line> = None;
        for end in 0..=ops.len() {
            // The history as it stood after `end` steps.
            let history: Vec<Vec<Vec<Bookmark>>> = (0..members)
                .map(|m| {
                    run.steps[m]
                        .iter()
                        .zip(&run.history[m])
                        .filter(|(s, _)| **s < end)
                        .map(|(_, marks)| marks.clone())
                        .collect()
                })
                .collect();
            let line = recovery_line(&history);
            if let Some(old) = before.as_ref().filter(|o| o.unpaired.is_empty()) {
                prop_assert!(le(&old.cut, &line.cut), "line went back: {:?} -> {:?}", old.cut, line.cut);
                for (m, cks) in history.iter().enumerate() {
                    for k in 0..cks.len() {
                        if old.cut[m].is_some() && k < old.cut[m].unwrap() {
                            prop_assert!(line.behind(m, k));
                        }
                        // Nothing on or after the line is behind it.
                        if line.cut[m].is_none_or(|on| k >= on) {
                            prop_assert!(!line.behind(m, k));
                        }
                    }
                }
            }
            before = Some(line);
        }
    }
}

fn conn(a: usize, b: usize) -> Conn {
    Conn {
        ends: [a, b],
        state: State::Unopened,
        flows: [Flow::default(), Flow::default()],
    }
}

/// One message from `from` to `to` over connection 0 (whose ends are
/// members 0 and 1), received and acknowledged.
fn message(from: usize) -> Vec<Op> {
    vec![
        Op::Write(0, from, 10),
        Op::Send(0, from, 10),
        Op::Deliver(0, from, 10),
        Op::Ack(0, from),
    ]
}

#[test]
fn domino_rolls_back_to_the_start() {
    // Each checkpoint of either member has received a message its peer sent
    // after its own previous checkpoint: every pair is inconsistent.
    let mut ops = vec![Op::Open(0)];
    for _ in 0..4 {
        ops.push(Op::Checkpoint(0));
        ops.extend(message(0));
        ops.push(Op::Checkpoint(1));
        ops.extend(message(1));
    }
    let run = simulate(2, vec![conn(0, 1)], &ops);
    let line = recovery_line(&run.history);
    assert!(line.at_start(), "{line:?}");
    assert_eq!(line.rolled_back, vec![4, 4]);
    assert!((0..4).all(|k| !line.behind(0, k) && !line.behind(1, k)));
}

#[test]
fn checkpoints_after_quiet_exchanges_form_the_latest_line() {
    // Both checkpoint after every exchange has been received: the latest
    // checkpoints are the line, and everything before is garbage.
    let mut ops = vec![Op::Open(0)];
    for _ in 0..3 {
        ops.extend(message(0));
        ops.extend(message(1));
        ops.push(Op::Checkpoint(0));
        ops.push(Op::Checkpoint(1));
    }
    let run = simulate(2, vec![conn(0, 1)], &ops);
    let line = recovery_line(&run.history);
    assert_eq!(line.cut, vec![Some(2), Some(2)]);
    assert_eq!(line.rolled_back, vec![0, 0]);
    assert!(line.behind(0, 1) && !line.behind(0, 2));
    assert!(line.unmatched.is_empty());
}

#[test]
fn bytes_in_the_senders_queue_are_not_lost() {
    // 0 writes and sends 10 bytes, checkpoints (they are unacknowledged in
    // its send queue), then 1 checkpoints before they arrive: consistent,
    // the restored sender retransmits them.
    let ops = vec![
        Op::Open(0),
        Op::Write(0, 0, 10),
        Op::Send(0, 0, 10),
        Op::Checkpoint(0),
        Op::Checkpoint(1),
        Op::Deliver(0, 0, 10),
        Op::Ack(0, 0),
        Op::Checkpoint(0),
    ];
    let run = simulate(2, vec![conn(0, 1)], &ops);
    let line = recovery_line(&run.history);
    // 0's second checkpoint dropped the bytes 1's checkpoint lacks: lost.
    assert_eq!(line.cut, vec![Some(0), Some(0)]);
    assert_eq!(line.rolled_back, vec![1, 0]);
}

#[test]
fn a_connection_only_one_side_lists_is_unmatched() {
    let ops = vec![Op::Open(0), Op::Checkpoint(0)];
    let run = simulate(2, vec![conn(0, 1)], &ops);
    let line = recovery_line(&run.history);
    assert_eq!(line.cut, vec![Some(0), None]);
    assert_eq!(
        line.unmatched,
        vec![(0, "10.0.0.1:1000".to_string(), "10.0.0.2:1001".to_string())]
    );
}

#[test]
fn an_unpaired_end_can_still_move_the_line_back() {
    // 0 checkpointed before a byte from 1 arrived; 1 has no checkpoint yet:
    // 0's end is unpaired and the line stands on 0's checkpoint. Once 1
    // checkpoints (the byte acknowledged, gone from its queue), the pair is
    // known, the byte is lost between them and the line moves back to the
    // start: nothing may be garbage while an end is unpaired.
    let ops = vec![
        Op::Open(0),
        Op::Write(0, 1, 1),
        Op::Send(0, 1, 1),
        Op::Checkpoint(0),
        Op::Deliver(0, 1, 1),
        Op::Ack(0, 1),
        Op::Checkpoint(1),
    ];
    let run = simulate(2, vec![conn(0, 1)], &ops);
    let early = recovery_line(&[run.history[0].clone(), vec![]]);
    assert_eq!(early.cut, vec![Some(0), None]);
    assert_eq!(early.unpaired.len(), 1);
    let line = recovery_line(&run.history);
    assert!(line.unpaired.is_empty());
    assert_eq!(line.cut, vec![None, None]);
    assert!(run.consistent(&line.cut));
}
