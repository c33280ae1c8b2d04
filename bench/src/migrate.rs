//! `cr-bench migrate`: downtime and total time of `crctl migrate --member`
//! against the member's memory and dirty rate, stop-and-copy, pre-copy,
//! lazy (`--lazy`: post-copy restore on the target) and both, next to the
//! link's own limit measured in the same run. With `--lazy` the total runs
//! until the target's agent logs that every page is in (its `ms` counts
//! from the start of the member's restore), and the bytes copied count
//! the page store's blocks the target got from the source after the
//! release (post-copy), their time that of the post-copy stream.
//!
//! The cluster is the one of the end-to-end tests (`cr_tests::cluster`).
//! For each (memory, dirty rate) a 2-member ring of `wl_ring` is started on
//! n1 and n2, member 0 holding a ballast of that size rewritten at that
//! rate (and checked by the member itself, as every byte of both
//! connections); member 0 is migrated to n3 in each mode, then back to n1
//! (not measured), `--reps` times. The link limit is one TCP stream from
//! n1 to n3 (a socket made in each namespace by this process), 1 GiB
//! sent (or 4 s of a shaped link), measured before the rows.
//!
//! `--link-mbit N` shapes every node's link to N Mbit/s (`tc` token
//! bucket): unshaped, the "link" between two namespaces is a memory copy
//! on the same 2 CPUs that also run both agents, so the copy's share of it
//! says how much CPU a byte costs; shaped, it says how much of a real
//! network's bandwidth a migration uses.

use crate::cluster::{median, on_cluster};
use crate::int_in;
use clap::{ArgAction, Args};
use cr_tests::cluster::{jstr, ju64, node_ip, Cluster, Ring};
use cr_tests::Harness;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Messages every member must carry between two migrations.
const ADVANCE: u64 = 2000;
/// Bytes sent to measure an unshaped link.
const LINK_BYTES: u64 = 1 << 30;
/// Seconds of a shaped link's rate sent to measure it.
const SHAPED_LINK_SECS: u64 = 4;

/// `cr-bench migrate`.
#[derive(Args)]
#[command(after_help = crate::cluster::CLUSTER_HELP)]
pub struct Opts {
    /// Memory of the migrated member, MiB.
    #[arg(
        long,
        value_name = "MIB,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "256,1024",
        value_parser = int_in::<usize>(1..=65536),
    )]
    mib: Vec<usize>,
    /// Dirty rates of that memory, MB/s.
    #[arg(
        long,
        value_name = "MBS,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "10,100",
        value_parser = int_in::<usize>(0..=10000),
    )]
    dirty: Vec<usize>,
    /// Migrations per row and mode; the table shows medians.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = int_in::<usize>(1..))]
    reps: usize,
    /// Modes measured, in this order.
    #[arg(
        long,
        value_name = "MODE,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "stop-and-copy,pre-copy,lazy,pre-copy+lazy",
        value_parser = ["stop-and-copy", "pre-copy", "lazy", "pre-copy+lazy"],
    )]
    modes: Vec<String>,
    /// Shape every node's link to this many Mbit/s (0: not shaped).
    #[arg(long, value_name = "MBIT", default_value_t = 0, value_parser = int_in::<u32>(0..=400_000))]
    link_mbit: u32,
    /// Where cr-agent, cr-coordinatord, crctl, cr_run and wl_ring live
    /// (default: the directory of this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
}

struct Row {
    mib: usize,
    dirty: usize,
    mode: String,
    /// (downtime, total, bytes copied, copy ms) per migration.
    samples: Vec<(u64, u64, u64, u64)>,
}

/// MiB/s of one TCP stream from n1 to n3, `total` bytes sent.
fn link_limit(c: &Cluster, total: u64) -> f64 {
    let addr: SocketAddr = format!("{}:7999", node_ip(3)).parse().expect("address");
    let l = c
        .ns(3)
        .run(move || std::net::TcpListener::bind(addr))
        .expect("listen in n3");
    let rx = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept in n3");
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        while got < total {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got += n as u64,
                Err(e) => panic!("link limit: read: {e}"),
            }
        }
        got
    });
    let mut s = c
        .ns(1)
        .connect_tcp(addr, Duration::from_secs(5))
        .expect("connect from n1");
    let buf = vec![0x5au8; 1 << 20];
    let t0 = Instant::now();
    for _ in 0..total >> 20 {
        s.write_all(&buf).expect("link limit: write");
    }
    drop(s);
    let got = rx.join().expect("receiver");
    got as f64 / (1 << 20) as f64 / t0.elapsed().as_secs_f64()
}

/// The `FIELD=` values of the `n`-th line of node `k`'s agent log holding
/// `marker` (the moved member is the only one restored there), once there.
fn log_fields<const N: usize>(
    c: &Cluster,
    k: usize,
    marker: &str,
    n: usize,
    fields: [&str; N],
) -> [u64; N] {
    let log = c.agent_log(k);
    let mut found = None;
    cr_tests::wait_until(
        &format!("n{k}'s agent to log {marker:?}"),
        Duration::from_secs(600),
        || {
            let text = cr_tests::read_text(&log);
            found = text.lines().filter(|l| l.contains(marker)).nth(n).map(|l| {
                fields.map(|f| {
                    l.split(&format!(" {f}="))
                        .nth(1)
                        .and_then(|v| v.split_whitespace().next())
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0)
                })
            });
            found.is_some()
        },
        String::new,
    );
    found.unwrap_or([0; N])
}

/// Lines of the target's log: every page in the process (its `ms` from
/// the start of the restore), every block of the page store in from the
/// source (its `bytes` and `ms`).
const PAGES_IN: &str = "post-copy done";
const BLOCKS_IN: &str = "every page block is in";

/// Migrate member 0 of `ring` to node `to` in `mode`: (downtime, total,
/// bytes copied, copy ms) and the checkpoint's id.
fn migrate(c: &Cluster, ring: &mut Ring, to: &str, mode: &str) -> ((u64, u64, u64, u64), String) {
    let pid = ring.host_pids()[0];
    let k = ring.nodes_now()[0].expect("member 0 on a node");
    let member = format!("n{k}:{pid}");
    let job = ring.job.clone();
    let mut args = vec![
        "migrate",
        job.as_str(),
        "--member",
        member.as_str(),
        "--to",
        to,
    ];
    if mode.contains("pre-copy") {
        args.push("--pre-copy");
    }
    let lazy = mode.contains("lazy");
    if lazy {
        args.push("--lazy");
    }
    let dst: usize = to.trim_start_matches('n').parse().expect("node name nK");
    let log = cr_tests::read_text(&c.agent_log(dst));
    let (seen, seen_blocks) = (
        log.matches(PAGES_IN).count(),
        log.matches(BLOCKS_IN).count(),
    );
    let r = c.crctl_json(&args);
    ring.adopt();
    // Post-copy: the pages come after the release, from the source.
    let ([after], [post_bytes, post_ms]) = if lazy {
        (
            log_fields(c, dst, PAGES_IN, seen, ["ms"]),
            log_fields(c, dst, BLOCKS_IN, seen_blocks, ["bytes", "ms"]),
        )
    } else {
        ([0], [0, 0])
    };
    ring.wait_advanced(ADVANCE, "after a migration");
    (
        (
            ju64(&r, "downtime_ms"),
            // The whole migration (pre-copy, callbacks, downtime), then
            // a post-copy's pages after the release.
            ju64(&r, "duration_ms") + after,
            ju64(&r, "bytes") + ju64(&r, "pre_copy_bytes") + post_bytes,
            ju64(&r, "copy_ms") + ju64(&r, "pre_copy_ms") + post_ms,
        ),
        jstr(&r, "checkpoint"),
    )
}

fn measure(o: &Opts) -> (f64, Vec<Row>) {
    let h = Harness::new("bench-migrate");
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    // Each node's images in its own tmpfs: every migration copies them.
    c.start_agents_local(&[1, 2, 3], &[]);
    let total = if o.link_mbit > 0 {
        c.shape_links(o.link_mbit);
        (u64::from(o.link_mbit) * 1_000_000 / 8 * SHAPED_LINK_SECS).clamp(64 << 20, LINK_BYTES)
    } else {
        LINK_BYTES
    };
    let link = link_limit(&c, total & !((1 << 20) - 1));
    let shaped = match o.link_mbit {
        0 => String::from("not shaped"),
        m => format!("shaped to {m} Mbit/s"),
    };
    eprintln!("cr-bench: link n1 -> n3: {link:.0} MiB/s (one TCP stream, {shaped})");
    let mut rows = Vec::new();
    for &mib in &o.mib {
        for &dirty in &o.dirty {
            let job = format!("mig-{mib}-{dirty}");
            eprintln!("cr-bench: {mib} MiB dirtied at {dirty} MB/s ...");
            let mut ring = c.start_ring_ballast(&job, &[1, 2], &format!("{mib}:{dirty}"));
            // Only the last checkpoint's images (and their copies) are
            // kept; a big member may stay frozen long on a loaded machine.
            let out = c.crctl(&["job", &job, "--keep", "1", "--freeze-timeout", "300"]);
            if !out.status.success() {
                panic!("crctl job {job} failed\n{}", out.show());
            }
            ring.wait_advanced(ADVANCE, "before the first migration");
            for mode in &o.modes {
                let mut samples = Vec::new();
                for _ in 0..o.reps {
                    let (s, id) = migrate(&c, &mut ring, "n3", mode);
                    eprintln!(
                        "cr-bench:   {mode}: down {} ms, total {} ms, {} MiB copied ({id})",
                        s.0,
                        s.1,
                        s.2 >> 20,
                    );
                    samples.push(s);
                    migrate(&c, &mut ring, "n1", "stop-and-copy");
                }
                rows.push(Row {
                    mib,
                    dirty,
                    mode: mode.clone(),
                    samples,
                });
            }
            ring.assert_no_fail();
            ring.kill_all();
        }
    }
    (link, rows)
}

fn table(link: f64, mbit: u32, rows: &[Row], reps: usize) -> String {
    let mut o = String::new();
    let shaped = match mbit {
        0 => String::from("not shaped"),
        m => format!("every link shaped to {m} Mbit/s"),
    };
    let _ = writeln!(
        o,
        "# crctl migrate --member (one of a 2-member ring) n1 -> n3: medians of {reps}\n\n\
         link n1 -> n3, one TCP stream in the same run ({shaped}): {link:.0} MiB/s\n"
    );
    let _ = writeln!(
        o,
        "| memory MiB | dirty MB/s | mode | downtime ms | total ms | copied MiB | copy MiB/s | % of link |"
    );
    let _ = writeln!(o, "|---:|---:|---|---:|---:|---:|---:|---:|");
    for r in rows {
        let m = |f: fn(&(u64, u64, u64, u64)) -> u64| {
            median(r.samples.iter().map(f).collect()).unwrap_or(0.0)
        };
        let (bytes, ms) = (m(|s| s.2), m(|s| s.3));
        let rate = bytes / (1 << 20) as f64 / (ms.max(1.0) / 1000.0);
        let _ = writeln!(
            o,
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {rate:.0} | {:.0} |",
            r.mib,
            r.dirty,
            r.mode,
            m(|s| s.0),
            m(|s| s.1),
            bytes / (1 << 20) as f64,
            rate / link * 100.0
        );
    }
    o
}

/// `cr-bench migrate ARGS...`.
pub fn run(o: Opts) -> Result<(), String> {
    let (link, rows) = on_cluster("migrate", o.bin_dir.as_deref(), || measure(&o))?;
    print!("{}", table(link, o.link_mbit, &rows, o.reps));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{assert_refused, parsed};

    #[test]
    fn command_lines() {
        let o = parsed::<Opts>("migrate");
        assert!(o.mib == [256, 1024] && o.dirty == [10, 100] && o.reps == 2);
        let o = parsed::<Opts>("migrate --mib 64 --dirty 0 --reps 1");
        assert!(o.mib == [64] && o.dirty == [0] && o.reps == 1 && o.link_mbit == 0);
        assert_eq!(parsed::<Opts>("migrate --link-mbit 1000").link_mbit, 1000);
        assert_eq!(
            o.modes,
            ["stop-and-copy", "pre-copy", "lazy", "pre-copy+lazy"]
        );
        let o = parsed::<Opts>("migrate --modes lazy,pre-copy+lazy");
        assert_eq!(o.modes, ["lazy", "pre-copy+lazy"]);
        assert_refused(&[
            "migrate --mib 0",
            "migrate --reps 0",
            "migrate --modes post",
        ]);
    }
}
