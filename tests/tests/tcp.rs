//! TCP and UDP sockets: established connections (with data queued both
//! ways), listeners and connected UDP pairs survive checkpoints that leave
//! the processes running, checkpoint --kill and restore (in the same network
//! namespace, or in fresh namespaces with other addresses), with a peer
//! inside or outside the checkpoint. The `wl_tcp` workloads check every
//! message from the inside (numbering, connection tag, bytes, end-of-stream
//! counts, socket options) and print OK or FAIL; a real program (redis)
//! keeps its data and its client connection. Sockets the engine cannot save
//! (packet, raw, netlink) are refused by name and the process is left alone.
//!
//! Every test runs in network namespaces of its own (`cr_tests::netns`),
//! removed when the test ends, so nothing touches the host's network.

use cr_tests::netns::{self, Netns};
mod common;

use common::object_summaries;
use cr_tests::resp::{Reply, Resp};
use cr_tests::*;
use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PORT: &str = "5000";
/// Messages (totals over a side's connections) that must flow after a
/// checkpoint or restore to call it "the exchange goes on".
const MARGIN: u64 = 20_000;
/// Same for UDP, which is paced slower.
const UDP_MARGIN: u64 = 2_000;

// ---------------------------------------------------------------------------
// Workload sides
// ---------------------------------------------------------------------------

/// One `wl_tcp` process: as spawned, or as restored by a cr_restart of ours.
struct Side {
    wl: Workload,
    restore: Option<Restore>,
}

/// Counters of a `progress` or `final` line.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    sent: u64,
    recv: u64,
    lost: u64,
    refused: u64,
    min_sent: u64,
    min_recv: u64,
}

fn kv(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

fn counts(line: &str) -> Counts {
    Counts {
        sent: kv(line, "sent").unwrap_or(0),
        recv: kv(line, "recv").unwrap_or(0),
        lost: kv(line, "lost").unwrap_or(0),
        refused: kv(line, "refused").unwrap_or(0),
        min_sent: kv(line, "min_sent").unwrap_or(0),
        min_recv: kv(line, "min_recv").unwrap_or(0),
    }
}

impl Side {
    fn pid(&self) -> i32 {
        self.wl.pid()
    }

    fn diag(&self) -> String {
        let mut s = self.wl.diag();
        if let Some(r) = &self.restore {
            s.push('\n');
            s.push_str(&r.diag());
        }
        s
    }

    /// The last `progress` line's counters.
    fn progress(&self) -> Counts {
        self.wl
            .output()
            .lines()
            .rfind(|l| l.starts_with("progress "))
            .map(counts)
            .unwrap_or_default()
    }

    /// Waits for a stdout line matching `pred` (or a FAIL line, which panics)
    /// while the process (or its cr_restart) runs.
    fn wait_for(&mut self, what: &str, pred: impl Fn(&str) -> bool, other: &dyn Fn() -> String) {
        // Alive: the original process, or the cr_restart that runs it.
        let pid = match &self.restore {
            Some(r) => r.cr.pid,
            None => self.wl.pid(),
        };
        let rd = || self.restore.as_ref().map(Restore::diag).unwrap_or_default();
        let line = self.wl.wait_line_while(
            what,
            LINE_TIMEOUT,
            |l| l.starts_with("FAIL") || pred(l),
            || is_alive(pid),
            || format!("{}\n--- the other side:\n{}", rd(), other()),
        );
        if line.starts_with("FAIL") {
            panic!(
                "{} failed while waiting for {what}: {line}\n{}\n--- the other side:\n{}",
                self.wl.label,
                self.diag(),
                other()
            );
        }
    }

    /// Waits until both counters went `margin` messages past `at`, and those
    /// of the slowest connection a tenth of that.
    fn wait_past(
        &mut self,
        at: Counts,
        margin: u64,
        ctx: &str,
        other: &dyn Fn() -> String,
    ) -> Counts {
        let what = format!("{ctx}: {} progress past {at:?} (+{margin})", self.wl.label);
        self.wait_for(
            &what,
            |l| {
                l.starts_with("progress ") && {
                    let c = counts(l);
                    c.sent > at.sent + margin
                        && c.recv > at.recv + margin
                        && c.min_sent > at.min_sent + margin / 10
                        && c.min_recv > at.min_recv + margin / 10
                }
            },
            other,
        );
        self.progress()
    }

    fn wait_ready(&mut self, other: &dyn Fn() -> String) {
        self.wait_for("READY", |l| l == "READY", other);
    }

    /// After `go`: waits for exit 0 and OK, returns the `final` counters.
    fn expect_ok(&mut self, ctx: &str) -> Counts {
        match &mut self.restore {
            Some(r) => {
                let out = r.wait(EXIT_TIMEOUT, &self.wl);
                assert_restored_ok(&out, &self.wl, &format!("{ctx}: {}", self.wl.label));
            }
            None => {
                let (o, e) = (self.wl.stdout.clone(), self.wl.stderr.clone());
                let st = self.wl.proc.wait_exit(EXIT_TIMEOUT, || files_diag(&o, &e));
                assert!(
                    st.is_some_and(|s| s.success()) && self.wl.lines().iter().any(|l| l == "OK"),
                    "{ctx}: {} should print OK and exit 0, got {}\n{}",
                    self.wl.label,
                    status_str(st),
                    self.diag()
                );
            }
        }
        check_progress_lines(&self.wl);
        let fin = self
            .wl
            .lines()
            .into_iter()
            .rfind(|l| l.starts_with("final "))
            .unwrap_or_else(|| panic!("{ctx}: no final line\n{}", self.diag()));
        counts(&fin)
    }

    /// The `conn I local=A peer=B ...` lines printed at go.
    fn conn_lines(&self) -> Vec<(String, String)> {
        self.wl
            .lines()
            .iter()
            .filter(|l| l.starts_with("conn "))
            .map(|l| {
                let get = |k: &str| {
                    l.split_whitespace()
                        .find_map(|w| w.strip_prefix(k))
                        .unwrap_or("")
                        .to_string()
                };
                (get("local="), get("peer="))
            })
            .collect()
    }
}

/// Progress counters never go back (a restore from the wrong state, or a
/// restart from scratch, would show), and no FAIL line was printed.
fn check_progress_lines(wl: &Workload) {
    let mut prev = Counts::default();
    for (i, l) in wl.lines().iter().enumerate() {
        assert!(
            !l.starts_with("FAIL"),
            "{}: line {}: {l}\n{}",
            wl.label,
            i + 1,
            wl.diag()
        );
        if l.starts_with("progress ") {
            let c = counts(l);
            assert!(
                c.sent >= prev.sent && c.recv >= prev.recv,
                "{}: line {}: counters went back from {prev:?} to {c:?}\n{}",
                wl.label,
                i + 1,
                wl.diag()
            );
            prev = c;
        }
    }
}

/// `wl_tcp WORKDIR ROLE --netns NS ADDR PORT EXTRA...`; a server is waited
/// for until it listens.
fn spawn(h: &Harness, role: &str, ns: &Netns, addr: &str, extra: &[&str]) -> Side {
    let mut args = vec![role, "--netns", ns.name.as_str(), addr, PORT];
    args.extend_from_slice(extra);
    let mut wl = h.spawn_wl("wl_tcp", &args);
    wl.label = format!("{role} (pid {})", wl.pid());
    if role.ends_with("server") {
        wl.wait_line("LISTENING", |l| l.starts_with("LISTENING"));
    }
    Side { wl, restore: None }
}

/// A server and a client in `ns`, both READY.
fn spawn_pair(h: &Harness, ns: &Netns, udp: bool, addr: &str, extra: &[&str]) -> (Side, Side) {
    let (sr, cr) = if udp {
        ("udp-server", "udp-client")
    } else {
        ("server", "client")
    };
    let mut s = spawn(h, sr, ns, addr, extra);
    let mut c = spawn(h, cr, ns, addr, extra);
    s.wait_ready(&|| format!("{}\n{}", c.diag(), ns.diag()));
    c.wait_ready(&|| format!("{}\n{}", s.diag(), ns.diag()));
    (s, c)
}

/// Creates both go files, then waits for both to finish OK; checks that each
/// side received exactly what the other sent.
fn finish_pair(s: &mut Side, c: &mut Side, ctx: &str) -> (Counts, Counts) {
    s.wl.go();
    c.wl.go();
    let fs = s.expect_ok(ctx);
    let fc = c.expect_ok(ctx);
    assert!(
        fs.sent == fc.recv && fs.recv == fc.sent,
        "{ctx}: server final {fs:?} and client final {fc:?} do not match\n{}\n{}",
        s.diag(),
        c.diag()
    );
    (fs, fc)
}

/// Same for a UDP pair: what each side received or counted lost adds up
/// to what the other sent.
fn finish_udp_pair(s: &mut Side, c: &mut Side, ctx: &str) -> (Counts, Counts) {
    s.wl.go();
    c.wl.go();
    let fs = s.expect_ok(ctx);
    let fc = c.expect_ok(ctx);
    assert!(
        fs.recv + fs.lost == fc.sent && fc.recv + fc.lost == fs.sent,
        "{ctx}: server final {fs:?} and client final {fc:?} do not add up\n{}\n{}",
        s.diag(),
        c.diag()
    );
    (fs, fc)
}

fn ckpt_continue(h: &Harness, side: &Side, img: &Path) {
    h.checkpoint(img, &[], side.pid())
        .assert_success(&format!("cr_checkpoint (continue) of {}", side.wl.label));
    assert_running_untraced(side.pid(), "after a checkpoint that leaves it running");
}

fn ckpt_kill(h: &Harness, side: &mut Side, img: &Path) {
    checkpoint_kill(h, &mut side.wl, img);
}

/// `cr_restart --netns NS EXTRA... IMG` in the background; the side now
/// runs there. (Without --netns, cr_restart restores into its own network
/// namespace.)
fn restore(h: &Harness, side: &mut Side, img: &Path, ns: &Netns, extra: &[&str]) {
    let mut args: Vec<&OsStr> = vec![OsStr::new("--netns"), OsStr::new(&ns.name)];
    args.extend(extra.iter().map(OsStr::new));
    side.restore = Some(h.restore_bg_args(img, side.pid(), &args));
}

fn img(h: &Harness, name: &str) -> PathBuf {
    h.image_dir(name)
}

// ---------------------------------------------------------------------------
// cr_image
// ---------------------------------------------------------------------------

/// The image lists an established TCP socket `local -> remote`.
fn assert_tcp_object(h: &Harness, img: &Path, local: &str, remote: &str) {
    let sums = object_summaries(h, img);
    let want = format!(" {local} -> {remote} ");
    assert!(
        sums.iter().any(|s| s.starts_with("tcp ")
            && s.contains(&want)
            && s.to_lowercase().contains("established")),
        "image {} should list {want:?} established; TCP/UDP objects: {:#?}",
        img.display(),
        sums.iter()
            .filter(|s| s.starts_with("tcp ") || s.starts_with("udp "))
            .collect::<Vec<_>>()
    );
}

/// Every JSON object (anywhere) that has a `rcv_nxt` key.
fn collect_bookmarks(v: &serde_json::Value, out: &mut Vec<serde_json::Value>) {
    match v {
        serde_json::Value::Object(m) => {
            if m.contains_key("rcv_nxt") {
                out.push(v.clone());
            }
            m.values().for_each(|x| collect_bookmarks(x, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_bookmarks(x, out)),
        _ => {}
    }
}

fn cr_image(h: &Harness, args: &[&OsStr]) -> ToolOutput {
    h.cr_image(args)
}

/// `cr_image cut IMGS...`.
fn cut(h: &Harness, imgs: &[&Path]) -> ToolOutput {
    let mut args = vec![OsStr::new("cut")];
    args.extend(imgs.iter().map(|p| p.as_os_str()));
    cr_image(h, &args)
}

// ---------------------------------------------------------------------------
// Without the engine: the workload itself
// ---------------------------------------------------------------------------

/// TCP on 127.0.0.1 and ::1 and UDP, no checkpoint: exchange, then OK with
/// matching counts (and no datagram lost).
#[test]
fn wl_tcp_exchanges_and_verifies_without_checkpoint() {
    let ns = Netns::new("plain");
    let h = Harness::new("tcp-plain");
    for (udp, addr) in [(false, "127.0.0.1"), (false, "::1"), (true, "127.0.0.1")] {
        let ctx = format!("udp {udp} on {addr}");
        let (mut s, mut c) = spawn_pair(&h, &ns, udp, addr, &["--conns", "2"]);
        let (sa, ca) = (s.progress(), c.progress());
        let m = if udp { UDP_MARGIN } else { MARGIN };
        s.wait_past(sa, m, &ctx, &|| c.diag());
        c.wait_past(ca, m, &ctx, &|| s.diag());
        if udp {
            let (fs, fc) = finish_udp_pair(&mut s, &mut c, &ctx);
            assert!(
                fs.lost + fs.refused + fc.lost + fc.refused == 0,
                "{ctx}: datagrams lost without any checkpoint: {fs:?} {fc:?}"
            );
        } else {
            finish_pair(&mut s, &mut c, &ctx);
        }
    }
}

/// The workload can fail: a peer that dies makes the other side print FAIL
/// (a reset or an EOF without the end marker) and exit 1.
#[test]
fn wl_tcp_detects_a_dead_peer() {
    let ns = Netns::new("dead");
    let h = Harness::new("tcp-dead-peer");
    let (mut s, mut c) = spawn_pair(&h, &ns, false, "127.0.0.1", &[]);
    c.wl.proc.kill_and_reap();
    let (o, e) = (s.wl.stdout.clone(), s.wl.stderr.clone());
    let st =
        s.wl.proc
            .wait_exit(Duration::from_secs(20), || files_diag(&o, &e));
    let out = s.wl.output();
    let fail = out.lines().find(|l| l.starts_with("FAIL: "));
    assert!(
        st.is_some_and(|s| s.code() == Some(1)) && fail.is_some(),
        "the server should FAIL once its client is killed, got {}\n{}",
        status_str(st),
        s.diag()
    );
    assert_mentions_any(
        fail.unwrap_or_default(),
        &["reset", "EOF"],
        "the server's FAIL line",
    );
}

// ---------------------------------------------------------------------------
// 1. Checkpoints that leave the pair running
// ---------------------------------------------------------------------------

/// Server and client (two process trees, one namespace, 127.0.0.1, two
/// connections) are checkpointed three times each while they exchange; the
/// exchange goes on after every checkpoint and ends with nothing lost. The
/// images list the connections; `cr_image bookmarks` shows their sequence
/// numbers; two images taken far apart are not a consistent cut.
#[test]
fn tcp_pair_continue() {
    let ns = Netns::new("cont");
    let h = Harness::new("tcp-continue");
    let (mut s, mut c) = spawn_pair(&h, &ns, false, "127.0.0.1", &["--conns", "2"]);
    for round in 1..=3 {
        let ctx = format!("round {round}");
        ckpt_continue(&h, &s, &img(&h, &format!("s{round}")));
        ckpt_continue(&h, &c, &img(&h, &format!("c{round}")));
        let (sa, ca) = (s.progress(), c.progress());
        s.wait_past(sa, MARGIN, &ctx, &|| format!("{}\n{}", c.diag(), ns.diag()));
        c.wait_past(ca, MARGIN, &ctx, &|| format!("{}\n{}", s.diag(), ns.diag()));
    }
    finish_pair(&mut s, &mut c, "after 3 checkpoints");

    let conns = c.conn_lines();
    assert_eq!(conns.len(), 2, "client conn lines\n{}", c.diag());
    let (s3, c3, s1) = (img(&h, "s3"), img(&h, "c3"), img(&h, "s1"));
    for (local, peer) in &conns {
        assert_tcp_object(&h, &c3, local, peer);
        assert_tcp_object(&h, &s3, peer, local);
    }
    let sums = object_summaries(&h, &s3);
    assert!(
        sums.iter().any(|x| x.starts_with("tcp ")
            && x.contains(" 127.0.0.1:5000 ")
            && x.to_lowercase().contains("listen")),
        "the server image should list its listener: {sums:#?}"
    );

    // Bookmarks: text names the connections, JSON has the numbers.
    let out = cr_image(
        &h,
        &[OsStr::new("bookmarks"), s3.as_os_str(), c3.as_os_str()],
    );
    out.assert_success("cr_image bookmarks");
    for (local, _) in &conns {
        assert!(
            out.stdout.contains(local.as_str()),
            "cr_image bookmarks should name the connection of {local}\n{}",
            out.show()
        );
    }
    let out = cr_image(
        &h,
        &[
            OsStr::new("bookmarks"),
            OsStr::new("--json"),
            s3.as_os_str(),
            c3.as_os_str(),
        ],
    );
    out.assert_success("cr_image bookmarks --json");
    let v: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("bookmarks --json: bad JSON ({e})\n{}", out.show()));
    let mut marks = Vec::new();
    collect_bookmarks(&v, &mut marks);
    assert_eq!(
        marks.len(),
        4,
        "two connections seen from both ends\n{}",
        out.show()
    );
    for m in &marks {
        for k in ["local", "remote", "state", "snd_una", "snd_nxt", "rcv_nxt"] {
            assert!(m.get(k).is_some(), "bookmark without {k}: {m}");
        }
    }

    // The server's first image and the client's last are far apart in time:
    // the client had received more than the server had sent then.
    let out = cut(&h, &[&s1, &c3]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "cut of images taken far apart should not be consistent\n{}",
        out.show()
    );
    let lines: Vec<&str> = out
        .stdout
        .lines()
        .chain(out.stderr.lines())
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert!(
        lines.len() == 1 && lines[0].contains(":5000"),
        "cut should name the first inconsistent connection in one line\n{}",
        out.show()
    );
}

// ---------------------------------------------------------------------------
// 2. Kill and restore in the same namespace
// ---------------------------------------------------------------------------

/// "snd_una=A snd_nxt=B" of a summary: true if data was in flight (sent,
/// not acknowledged).
fn in_flight(summary: &str) -> bool {
    let get = |k: &str| {
        summary
            .split_whitespace()
            .find_map(|w| w.strip_prefix(k)?.strip_prefix('=')?.parse::<u64>().ok())
    };
    matches!((get("snd_una"), get("snd_nxt")), (Some(a), Some(b)) if a != b)
}

/// Kill both ends of a pair one after the other, restore both, check both
/// go on. The client's image must hold data in flight; under a heavy load
/// the server may not have drained its receive window when it was killed,
/// so nothing was in flight: the scenario (which checked the restore all
/// the same) is then run again, up to three times.
fn pair_kill_restore(addr: &str) {
    let mut last = Vec::new();
    for attempt in 1..=3 {
        last = pair_kill_restore_once(addr);
        if last.iter().any(|x| x.starts_with("tcp ") && in_flight(x)) {
            return;
        }
        eprintln!("attempt {attempt}: no data in flight in the client image; again");
    }
    panic!(
        "the client image should hold data in flight (snd_una != snd_nxt), which \
         the restore must send again; three attempts did not exercise that: {last:#?}"
    );
}

/// One run of [`pair_kill_restore`]; the client image's object summaries.
fn pair_kill_restore_once(addr: &str) -> Vec<String> {
    let ns = Netns::new("kill");
    let h = Harness::new("tcp-kill");
    let (mut s, mut c) = spawn_pair(&h, &ns, false, addr, &["--conns", "2"]);
    let (si, ci) = (img(&h, "server"), img(&h, "client"));
    ckpt_kill(&h, &mut s, &si);
    // The client goes on sending for a moment: what goes out on its fast
    // connection is dropped by the lock, so it is in flight when it is killed.
    // Under a heavy load the server may have fallen behind before its kill:
    // the client's buffers are then full and it sends nothing more; it is
    // killed all the same (the caller runs the scenario again if its image
    // holds nothing in flight).
    let ca = c.progress();
    let client = c.wl.pid();
    let more = c.wl.line_within(
        Duration::from_secs(15),
        |l| l.starts_with("FAIL") || (l.starts_with("progress ") && counts(l).sent > ca.sent + 100),
        || is_alive(client),
    );
    match more {
        Ok(l) if l.starts_with("FAIL") => panic!(
            "the client failed while its server was down: {l}\n{}",
            c.diag()
        ),
        Ok(_) => {}
        Err(LineMissing::TimedOut) => {
            eprintln!(
                "the client sent nothing more in 15 s while its server was down (buffers full)"
            )
        }
        Err(LineMissing::Stopped) => panic!(
            "the client stopped while its server was down\n{}\n{}",
            c.diag(),
            ns.diag()
        ),
    }
    ckpt_kill(&h, &mut c, &ci);
    let (sa, ca) = (s.progress(), c.progress());
    restore(&h, &mut s, &si, &ns, &[]);
    restore(&h, &mut c, &ci, &ns, &[]);
    s.wait_past(sa, MARGIN, "after restore", &|| {
        format!("{}\n{}", c.diag(), ns.diag())
    });
    c.wait_past(ca, MARGIN, "after restore", &|| {
        format!("{}\n{}", s.diag(), ns.diag())
    });
    finish_pair(&mut s, &mut c, &format!("kill+restore on {addr}"));

    let out = cut(&h, &[&si, &ci]);
    out.assert_success("cr_image cut of the two --kill images (a consistent cut)");
    for (local, peer) in c.conn_lines() {
        assert_tcp_object(&h, &ci, &local, &peer);
    }
    object_summaries(&h, &ci)
}

/// Checkpoint the server with --kill, then the client, restore both: the
/// exchange goes on from where it was, nothing lost (IPv4).
#[test]
fn tcp_pair_kill_restore_ipv4() {
    pair_kill_restore("127.0.0.1");
}

/// Same over IPv6 (::1).
#[test]
fn tcp_pair_kill_restore_ipv6() {
    pair_kill_restore("::1");
}

// ---------------------------------------------------------------------------
// 3. Migration to other namespaces and addresses
// ---------------------------------------------------------------------------

/// Server in namespace A (10.77.1.1), client in B (10.77.1.2), joined by a
/// veth pair; both killed; A and B deleted (a dead node); restored into fresh
/// C (10.77.2.1) and D (10.77.2.2) with the addresses mapped: the exchange
/// goes on with nothing lost, over the new addresses.
#[test]
fn tcp_pair_migrate_netns() {
    let mut a = Netns::new("a");
    let mut b = Netns::new("b");
    netns::link(&a, &["10.77.1.1/24"], &b, &["10.77.1.2/24"]);
    let h = Harness::new("tcp-migrate");
    let mut s = spawn(&h, "server", &a, "10.77.1.1", &["--conns", "2"]);
    let mut c = spawn(&h, "client", &b, "10.77.1.1", &["--conns", "2"]);
    s.wait_ready(&|| c.diag());
    c.wait_ready(&|| s.diag());
    let (si, ci) = (img(&h, "server"), img(&h, "client"));
    ckpt_kill(&h, &mut s, &si);
    ckpt_kill(&h, &mut c, &ci);
    let (sa, ca) = (s.progress(), c.progress());
    a.delete();
    b.delete();

    let cc = Netns::new("c");
    let dd = Netns::new("d");
    netns::link(&cc, &["10.77.2.1/24"], &dd, &["10.77.2.2/24"]);
    let maps = [
        "--map-addr",
        "10.77.1.1=10.77.2.1",
        "--map-addr",
        "10.77.1.2=10.77.2.2",
    ];
    restore(&h, &mut s, &si, &cc, &maps);
    restore(&h, &mut c, &ci, &dd, &maps);
    let net = || format!("{}\n{}", cc.diag(), dd.diag());
    s.wait_past(sa, MARGIN, "after restore in C", &|| {
        format!("{}\n{}", c.diag(), net())
    });
    c.wait_past(ca, MARGIN, "after restore in D", &|| {
        format!("{}\n{}", s.diag(), net())
    });
    finish_pair(&mut s, &mut c, "migrated");

    for (local, peer) in s.conn_lines() {
        assert!(
            local == "10.77.2.1:5000" && peer.starts_with("10.77.2.2:"),
            "the restored server's connection should be 10.77.2.1:5000 -> 10.77.2.2:*, \
             is {local} -> {peer}\n{}",
            s.diag()
        );
    }
    for (local, peer) in c.conn_lines() {
        assert!(
            local.starts_with("10.77.2.2:") && peer == "10.77.2.1:5000",
            "the restored client's connection should be 10.77.2.2:* -> 10.77.2.1:5000, \
             is {local} -> {peer}\n{}",
            c.diag()
        );
    }
}

// ---------------------------------------------------------------------------
// 4, 5. A peer outside the checkpoint, new clients of a restored listener
// ---------------------------------------------------------------------------

/// One `ping` on a new connection to `addr` made in `ns`: must get `pong`.
fn ping(ns: &Netns, addr: SocketAddr, ctx: &str, diag: &dyn Fn() -> String) {
    let mut st = ns
        .connect_tcp(addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{ctx}: connect {addr}: {e}\n{}", diag()));
    pong(&mut st, ctx, diag);
}

fn pong(st: &mut TcpStream, ctx: &str, diag: &dyn Fn() -> String) {
    st.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("set_read_timeout");
    st.write_all(b"ping\n")
        .unwrap_or_else(|e| panic!("{ctx}: send ping: {e}\n{}", diag()));
    let mut got = Vec::new();
    st.read_to_end(&mut got)
        .unwrap_or_else(|e| panic!("{ctx}: read pong: {e} (got {got:?})\n{}", diag()));
    assert_eq!(
        got,
        b"pong\n",
        "{ctx}: answer to ping, then EOF\n{}",
        diag()
    );
}

/// The server is checkpointed, its client is not: a checkpoint that leaves
/// the server running, then one with --kill and a restore within seconds;
/// the client, which checks every byte all along, never notices. A new
/// client then connects to the restored listener.
#[test]
fn tcp_external_client() {
    let ns = Netns::new("ext");
    let h = Harness::new("tcp-external");
    let (mut s, mut c) = spawn_pair(
        &h,
        &ns,
        false,
        "127.0.0.1",
        &["--conns", "2", "--extra-accept"],
    );
    let si = img(&h, "server-continue");
    ckpt_continue(&h, &s, &si);
    let (sa, ca) = (s.progress(), c.progress());
    s.wait_past(sa, MARGIN, "after a checkpoint (continue)", &|| {
        format!("{}\n{}", c.diag(), ns.diag())
    });
    c.wait_past(
        ca,
        MARGIN,
        "after the server's checkpoint (continue)",
        &|| format!("{}\n{}", s.diag(), ns.diag()),
    );

    let sk = img(&h, "server-kill");
    let t0 = Instant::now();
    ckpt_kill(&h, &mut s, &sk);
    let sa = s.progress();
    restore(&h, &mut s, &sk, &ns, &[]);
    let ca = c.progress();
    s.wait_past(sa, MARGIN, "after restore", &|| {
        format!("{}\n{}", c.diag(), ns.diag())
    });
    c.wait_past(ca, MARGIN, "with its server restored", &|| {
        format!("{}\n{}", s.diag(), ns.diag())
    });
    eprintln!("kill to progress after restore: {:?}", t0.elapsed());

    let addr: SocketAddr = "127.0.0.1:5000".parse().expect("addr");
    ping(&ns, addr, "new client of the restored server", &|| s.diag());
    s.wait_for("pong 1", |l| l.starts_with("pong 1 "), &|| ns.diag());
    finish_pair(&mut s, &mut c, "external client");
}

/// A listener alone (`--conns 0 --extra-accept` on 0.0.0.0), killed and
/// restored: new clients connect to the restored listener and are served.
/// (While the server is down a connect is refused: the dump holds SYNs to
/// its listeners only while it runs, and the image's lock only holds
/// established connections.)
#[test]
fn tcp_listener_new_clients() {
    let ns = Netns::new("listen");
    let h = Harness::new("tcp-listener");
    let mut s = spawn(
        &h,
        "server",
        &ns,
        "0.0.0.0",
        &["--conns", "0", "--extra-accept"],
    );
    s.wait_ready(&|| ns.diag());
    let addr: SocketAddr = "127.0.0.1:5000".parse().expect("addr");
    ping(&ns, addr, "before the checkpoint", &|| s.diag());
    s.wait_for("pong 1", |l| l.starts_with("pong 1 "), &|| ns.diag());

    let si = img(&h, "server");
    ckpt_kill(&h, &mut s, &si);
    restore(&h, &mut s, &si, &ns, &[]);
    for i in 0..3 {
        ping(&ns, addr, &format!("new client {i} after restore"), &|| {
            format!("{}\n{}", s.diag(), ns.diag())
        });
    }
    s.wait_for("pong 4", |l| l.starts_with("pong 4 "), &|| ns.diag());
    s.wl.go();
    s.expect_ok("listener");
    let sums = object_summaries(&h, &si);
    assert!(
        sums.iter()
            .any(|x| x.starts_with("tcp ") && x.contains(" 0.0.0.0:5000 ")),
        "the image should list the listener on 0.0.0.0:5000: {sums:#?}"
    );
}

// ---------------------------------------------------------------------------
// 6. UDP
// ---------------------------------------------------------------------------

/// A connected UDP pair (two pairs of sockets) killed and restored: the
/// exchange goes on; datagrams may be lost while a side is down, never
/// duplicated, reordered or corrupted, and all the rest arrive.
#[test]
fn udp_pair_kill_restore() {
    let ns = Netns::new("udp");
    let h = Harness::new("udp-kill");
    let (mut s, mut c) = spawn_pair(&h, &ns, true, "127.0.0.1", &["--conns", "2"]);
    let (si, ci) = (img(&h, "server"), img(&h, "client"));
    ckpt_kill(&h, &mut s, &si);
    ckpt_kill(&h, &mut c, &ci);
    let sums = object_summaries(&h, &si);
    assert!(
        sums.iter().filter(|x| x.starts_with("udp ")).count() == 2,
        "the server image should list its two UDP sockets: {sums:#?}"
    );
    let (sa, ca) = (s.progress(), c.progress());
    restore(&h, &mut s, &si, &ns, &[]);
    restore(&h, &mut c, &ci, &ns, &[]);
    // UDP is paced at 2 x 2000 datagrams/s per side.
    s.wait_past(sa, UDP_MARGIN, "after restore", &|| {
        format!("{}\n{}", c.diag(), ns.diag())
    });
    c.wait_past(ca, UDP_MARGIN, "after restore", &|| {
        format!("{}\n{}", s.diag(), ns.diag())
    });
    let (fs, fc) = finish_udp_pair(&mut s, &mut c, "udp kill+restore");
    eprintln!("udp finals: server {fs:?}, client {fc:?}");
}

// ---------------------------------------------------------------------------
// 7. A real program: redis
// ---------------------------------------------------------------------------

/// redis-server in a namespace (it is the checkpointed pid): 10000 keys set
/// over a connection of the test; checkpoint --kill; a GET sent while it is
/// down is answered after restore on the same connection, the keys are all
/// there, INCR works, and a new connection works too.
#[test]
fn redis_keeps_its_data_and_client_connection() {
    let redis = ["/usr/bin/redis-server", "/usr/local/bin/redis-server"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .expect("redis-server is not installed (tests/run.sh installs it)");
    let ns = Netns::new("redis");
    let h = Harness::new("tcp-redis");
    let dir = h.dir.join("redis-data");
    std::fs::create_dir_all(&dir).expect("mkdir redis-data");
    let dir_s = dir.to_string_lossy().into_owned();
    let mut wl = h.spawn_program(
        "redis",
        &workload_path("wl_tcp"),
        &[],
        &[
            "exec",
            &ns.name,
            redis,
            "--port",
            "6379",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            &dir_s,
        ],
    );
    wl.label = format!("redis-server (pid {})", wl.pid());
    wl.wait_line("redis Ready to accept connections", |l| {
        l.contains("Ready to accept connections")
    });
    let addr: SocketAddr = "127.0.0.1:6379".parse().expect("addr");
    let st = ns
        .connect_tcp(addr, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("connect to redis: {e}\n{}", wl.diag()));
    let mut cl = Resp::new(st);
    let n = 10_000;
    let key = |i: usize| {
        if i == 0 {
            b"counter".to_vec()
        } else {
            format!("key:{i}").into_bytes()
        }
    };
    let val = |i: usize| {
        if i == 0 {
            b"100".to_vec()
        } else {
            sample_value(i)
        }
    };
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let cmds: Vec<Vec<u8>> = chunk
            .iter()
            .map(|&i| Resp::encode(&[b"SET", &key(i), &val(i)]))
            .collect();
        cl.send(&cmds).expect("send SETs");
        for &i in chunk {
            let r = cl.reply().expect("SET reply");
            assert_eq!(r, Reply::Simple("OK".into()), "SET key {i}");
        }
    }
    for i in [1, 777, 9999] {
        let r = cl.call(&[b"GET", &key(i)]).expect("GET");
        assert_eq!(
            r,
            Reply::Bulk(Some(val(i))),
            "GET key {i} before checkpoint"
        );
    }

    let img = h.image_dir("redis");
    let pid = wl.pid();
    checkpoint_kill(&h, &mut wl, &img);
    // A request sent while redis is down: held by the network lock, answered
    // after the restore.
    cl.send(&[Resp::encode(&[b"GET", &key(4242)])])
        .expect("send GET while redis is down");
    let mut r = h.restore_bg_args(&img, pid, &[OsStr::new("--netns"), OsStr::new(&ns.name)]);
    let got = cl.reply().unwrap_or_else(|e| {
        panic!(
            "reply to the GET sent while redis was down: {e}\n{}\n{}",
            r.diag(),
            wl.diag()
        )
    });
    assert_eq!(got, Reply::Bulk(Some(val(4242))), "GET during the outage");
    for i in (1..n).step_by(97).chain([n - 1]) {
        let r = cl.call(&[b"GET", &key(i)]).expect("GET after restore");
        assert_eq!(r, Reply::Bulk(Some(val(i))), "GET key {i} after restore");
    }
    assert_eq!(
        cl.call(&[b"INCR", b"counter"]).expect("INCR"),
        Reply::Int(101)
    );
    assert_eq!(cl.call(&[b"DBSIZE"]).expect("DBSIZE"), Reply::Int(n as i64));
    let st2 = ns
        .connect_tcp(addr, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("new connection to restored redis: {e}\n{}", r.diag()));
    let mut cl2 = Resp::new(st2);
    assert_eq!(
        cl2.call(&[b"PING"]).expect("PING"),
        Reply::Simple("PONG".into())
    );
    assert_eq!(
        cl2.call(&[b"GET", b"counter"]).expect("GET counter"),
        Reply::Bulk(Some(b"101".to_vec()))
    );
    assert_eq!(
        cl2.call(&[b"DBSIZE"]).expect("DBSIZE"),
        Reply::Int(n as i64)
    );
    // A clean shutdown: redis exits 0, so cr_restart does too.
    let _ = cl2.call(&[b"SHUTDOWN", b"NOSAVE"]);
    let out = r.wait(EXIT_TIMEOUT, &wl);
    out.assert_success("cr_restart of redis after SHUTDOWN NOSAVE");
}

/// The TCP sockets of `ns` as /proc/net/tcp{,6} lists them, split in fields.
fn tcp_table(ns: &Netns) -> Vec<Vec<String>> {
    let text = ns.run(|| {
        ["tcp", "tcp6"]
            .iter()
            .map(|f| {
                std::fs::read_to_string(format!("/proc/thread-self/net/{f}")).unwrap_or_default()
            })
            .collect::<String>()
    });
    text.lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .filter(|f| f.len() > 9 && f[0] != "sl")
        .collect()
}

/// Orphaned sockets (no process holds them: inode 0) still in FIN-WAIT-1,
/// the state that keeps a connection's addresses taken.
fn lingering_fin_wait1(ns: &Netns) -> usize {
    tcp_table(ns)
        .iter()
        .filter(|f| f[3] == "04" && f[9] == "0")
        .count()
}

/// Whether some socket probes a zero window (timer 4) with nothing left
/// to read, while its peer has nothing left to send: killed now, that
/// socket's owner sends a FIN (not a reset) that waits behind its unsent
/// data.
fn drained_zero_window(table: &[Vec<String>]) -> bool {
    let queues = |f: &Vec<String>| -> (u64, u64) {
        let (tx, rx) = f[4].split_once(':').unwrap_or(("?", "?"));
        (
            u64::from_str_radix(tx, 16).unwrap_or(u64::MAX),
            u64::from_str_radix(rx, 16).unwrap_or(u64::MAX),
        )
    };
    table.iter().any(|f| {
        f[5].starts_with("04:")
            && queues(f).1 == 0
            && table
                .iter()
                .any(|p| p[1] == f[2] && p[2] == f[1] && queues(p).0 == 0)
    })
}

/// Both ends checkpointed with --kill and restored. Then the restored pair
/// crashes the hard way: the client stops reading (SIGSTOP) until the
/// server's connection to it has a closed window, the server is killed
/// (its FIN waits behind the unsent data: FIN-WAIT-1), then the client is
/// killed (its reset is dropped by the restore's reset guard), so the
/// server's socket lingers on the connection's addresses. The same images
/// restored again take the addresses back (the orphan is destroyed) and
/// the exchange goes on from the checkpoint with nothing lost.
#[test]
fn tcp_pair_restored_again_over_lingering_sockets() {
    let ns = Netns::new("linger");
    let h = Harness::new("tcp-linger");
    let (mut s, mut c) = spawn_pair(&h, &ns, false, "127.0.0.1", &["--conns", "2"]);
    let (si, ci) = (img(&h, "server"), img(&h, "client"));
    ckpt_kill(&h, &mut s, &si);
    ckpt_kill(&h, &mut c, &ci);
    let (sa, ca) = (s.progress(), c.progress());
    restore(&h, &mut s, &si, &ns, &[]);
    restore(&h, &mut c, &ci, &ns, &[]);
    s.wait_past(sa, MARGIN, "after the first restore", &|| ns.diag());
    c.wait_past(ca, MARGIN, "after the first restore", &|| ns.diag());
    c.restore
        .as_ref()
        .expect("restored client")
        .restored
        .signal(libc::SIGSTOP);
    // A sender probing a zero window (timer 4) is a full connection. The
    // server must also have read all the client sent: killed with unread
    // bytes, its close() would send a reset instead of a FIN, and nothing
    // would linger.
    wait_until(
        "a connection to the stopped client with a closed window, all the client's bytes read",
        Duration::from_secs(20),
        || drained_zero_window(&tcp_table(&ns)),
        || ns.diag(),
    );
    drop(s.restore.take());
    drop(c.restore.take());
    wait_until(
        "the killed server's socket lingering in FIN-WAIT-1",
        Duration::from_secs(10),
        || lingering_fin_wait1(&ns) > 0,
        || ns.diag(),
    );
    let (sa, ca) = (s.progress(), c.progress());
    restore(&h, &mut s, &si, &ns, &[]);
    restore(&h, &mut c, &ci, &ns, &[]);
    s.wait_past(sa, MARGIN, "after the second restore", &|| ns.diag());
    c.wait_past(ca, MARGIN, "after the second restore", &|| ns.diag());
    finish_pair(&mut s, &mut c, "second restore over lingering sockets");
}
