//! The network lock: while TCP connections are being saved for a dump that
//! ends with the processes killed or stopped, and until they are restored,
//! no packet of theirs may be answered. A peer's segment reaching a closed
//! port would draw a RST and end the connection; a segment acknowledged
//! after the dump read the sequence numbers would be lost.
//!
//! The lock is one nft table of the inet family in the processes' network
//! namespace, named after the image, whose input and output chains drop the
//! packets of the listed connections (both directions). `nft(8)` does the netlink
//! work; it is run inside the target's namespace through `nsenter(1)` when
//! that is not ours.

use crate::error::{Result, SysError};
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::Duration;

/// What one lock holds still: (local, remote) of established connections.
/// Listening sockets are held only while the dump runs
/// ([`hold_listeners`]): a client that connects while the server is away
/// is refused, as with any server restart, and a lock left behind on a
/// host the server moved away from must not block new servers on that
/// port.
#[derive(Debug, Default, Clone)]
pub struct LockSet {
    pub conns: Vec<(SocketAddr, SocketAddr)>,
    pub listeners: Vec<SocketAddr>,
}

impl LockSet {
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Whether the tables of a lock made from `self` (see [`lock_many`])
    /// are exactly the tables `other` would make, and hold everything it
    /// holds (and maybe more: connections closed since).
    pub fn covers(&self, other: &LockSet) -> bool {
        self.conns.is_empty() == other.conns.is_empty()
            && self.listeners.is_empty() == other.listeners.is_empty()
            && other.conns.iter().all(|c| self.conns.contains(c))
            && other.listeners.iter().all(|l| self.listeners.contains(l))
    }
}

fn nft_failed(what: String, detail: &str) -> SysError {
    SysError::Command {
        what,
        detail: detail.trim().to_string(),
    }
}

/// The network namespace of a process's leased locks, pinned: an open
/// handle on it when it is not ours, so that the locks can still be
/// renewed or made permanent once its processes are gone (a member killed
/// after its commit exits before its lock is made permanent, and
/// /proc/PID/ns/net goes with it: the lock would lapse and its peers see
/// a reset).
pub struct LockNs(Option<std::fs::File>);

impl LockNs {
    /// The namespace of `pid`, now.
    pub fn of(pid: i32) -> Result<LockNs> {
        if same_netns(pid) {
            return Ok(LockNs(None));
        }
        let path = format!("/proc/{pid}/ns/net");
        std::fs::File::open(&path)
            .map(|f| LockNs(Some(f)))
            .map_err(crate::error::io_err(path))
    }

    /// `nft` run in it.
    fn nft(&self) -> Command {
        use std::os::fd::AsRawFd;
        match &self.0 {
            None => Command::new("nft"),
            Some(f) => {
                // The child cannot inherit the handle (close-on-exec); it
                // opens the namespace through this process's fd instead.
                let mut c = Command::new("nsenter");
                c.arg(format!(
                    "--net=/proc/{}/fd/{}",
                    std::process::id(),
                    f.as_raw_fd()
                ))
                .arg("nft");
                c
            }
        }
    }
}

/// Run `nft -f -` with `script` in the network namespace of `pid` (None: ours).
fn run_nft(pid: Option<i32>, script: &str, what: &str) -> Result<()> {
    run_nft_with(nft_command(pid), script, what)
}

/// Run `cmd` (an nft) as `nft -f -` with `script`.
fn run_nft_with(mut cmd: Command, script: &str, what: &str) -> Result<()> {
    cmd.args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        nft_failed(
            what.to_string(),
            &format!(
                "cannot run nft ({e}); the network lock needs nft(8) (Debian package nftables)"
            ),
        )
    })?;
    if let Some(mut stdin) = child.stdin.take() {
        // A write error shows up as nft's own failure below.
        let _ = stdin.write_all(script.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| nft_failed(what.to_string(), &e.to_string()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let first = err
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("nft failed");
        return Err(nft_failed(what.to_string(), first));
    }
    Ok(())
}

/// `nft`, run in the network namespace of `pid` (None: ours).
fn nft_command(pid: Option<i32>) -> Command {
    match pid {
        Some(p) if !same_netns(p) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/proc/{p}/ns/net")).arg("nft");
            c
        }
        _ => Command::new("nft"),
    }
}

fn same_netns(pid: i32) -> bool {
    let a = std::fs::read_link(format!("/proc/{pid}/ns/net"));
    let b = std::fs::read_link("/proc/self/ns/net");
    matches!((a, b), (Ok(a), Ok(b)) if a == b)
}

fn ip_words(ip: IpAddr) -> (&'static str, String) {
    match crate::inet::canonical_ip(ip) {
        IpAddr::V4(v4) => ("ip", v4.to_string()),
        IpAddr::V6(v6) => ("ip6", v6.to_string()),
    }
}

/// The elements of the connections' sets of a lock for `set`: (c4, c6),
/// each connection in both directions.
fn conn_elements(set: &LockSet) -> (Vec<String>, Vec<String>) {
    let mut c4 = Vec::new();
    let mut c6 = Vec::new();
    for (l, r) in &set.conns {
        for (a, b) in [(l, r), (r, l)] {
            let (fa, ia) = ip_words(a.ip());
            let (_, ib) = ip_words(b.ip());
            let e = format!("{ia} . {} . {ib} . {}", a.port(), b.port());
            if fa == "ip" {
                c4.push(e);
            } else {
                c6.push(e);
            }
        }
    }
    (dedup(c4), dedup(c6))
}

/// Each element once: a connection whose both ends are held (two processes
/// of the job on one node) is listed from both sides, and an nft `delete
/// element` of a list naming one twice fails on the second.
fn dedup(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v.dedup();
    v
}

/// The elements of the listeners' sets: (l4, l6, lany); an unspecified
/// IP: any.
fn listener_elements(listeners: &[SocketAddr]) -> (Vec<String>, Vec<String>, Vec<String>) {
    let (mut l4, mut l6, mut lany) = (Vec::new(), Vec::new(), Vec::new());
    for l in listeners {
        if l.ip().is_unspecified() {
            lany.push(l.port().to_string());
        } else {
            let (f, i) = ip_words(l.ip());
            let e = format!("{i} . {}", l.port());
            if f == "ip" {
                l4.push(e)
            } else {
                l6.push(e)
            }
        }
    }
    (dedup(l4), dedup(l6), dedup(lany))
}

/// ` timeout Nms` of an element that lives for `lease` ("" for ever).
fn element_timeout(lease: Option<Duration>) -> String {
    lease.map_or_else(String::new, |d| {
        format!(" timeout {}ms", d.as_millis().max(1))
    })
}

/// ` elements = { ... }` of a set declaration ("" when empty).
fn elements_clause(v: &[String], lease: Option<Duration>) -> String {
    if v.is_empty() {
        return String::new();
    }
    let t = element_timeout(lease);
    let v: Vec<String> = v.iter().map(|e| format!("{e}{t}")).collect();
    format!(" elements = {{ {} }}", v.join(", "))
}

/// `; flags timeout` of a set whose elements carry a lease.
fn set_flags(lease: Option<Duration>) -> &'static str {
    if lease.is_some() {
        " flags timeout;"
    } else {
        ""
    }
}

/// The nft script that creates table `name` for `set`.
pub fn script(name: &str, set: &LockSet) -> String {
    leased_script(name, set, None)
}

/// [`script`] whose elements expire after `lease` unless renewed
/// ([`renew_many`]): the lock lifts by itself when its holder is gone.
fn leased_script(name: &str, set: &LockSet, lease: Option<Duration>) -> String {
    let (c4, c6) = conn_elements(set);
    let f = set_flags(lease);
    let mut s = format!("table inet {name} {{\n");
    s += &format!(
        "  set c4 {{ type ipv4_addr . inet_service . ipv4_addr . inet_service;{f}{} }}\n",
        elements_clause(&c4, lease)
    );
    s += &format!(
        "  set c6 {{ type ipv6_addr . inet_service . ipv6_addr . inet_service;{f}{} }}\n",
        elements_clause(&c6, lease)
    );
    // The segments a restore forges for half-closed connections pass
    // (see `forged`).
    let mark = crate::forged::REPAIR_MARK;
    for (chain, hook) in [("in", "input"), ("out", "output")] {
        s += &format!(
            "  chain {chain} {{ type filter hook {hook} priority -160; policy accept;\n    meta mark {mark:#x} accept\n    ip saddr . tcp sport . ip daddr . tcp dport @c4 drop\n    ip6 saddr . tcp sport . ip6 daddr . tcp dport @c6 drop\n"
        );
        s += "  }\n";
    }
    s += "}\n";
    s
}

/// The nft script of table `name` dropping new connection attempts (SYN)
/// to the listening addresses `listeners` (an unspecified IP: any).
pub fn syn_script(name: &str, listeners: &[SocketAddr]) -> String {
    leased_syn_script(name, listeners, None)
}

fn leased_syn_script(name: &str, listeners: &[SocketAddr], lease: Option<Duration>) -> String {
    let (l4, l6, lany) = listener_elements(listeners);
    let f = set_flags(lease);
    let syn = "tcp flags & (syn | ack) == syn";
    format!(
        "table inet {name} {{\n  set l4 {{ type ipv4_addr . inet_service;{f}{} }}\n  set l6 {{ type ipv6_addr . inet_service;{f}{} }}\n  set lany {{ type inet_service;{f}{} }}\n  chain in {{ type filter hook input priority -160; policy accept;\n    {syn} ip daddr . tcp dport @l4 drop\n    {syn} ip6 daddr . tcp dport @l6 drop\n    {syn} tcp dport @lany drop\n  }}\n}}\n",
        elements_clause(&l4, lease),
        elements_clause(&l6, lease),
        elements_clause(&lany, lease)
    )
}

/// While a dump runs, keep new clients out of the listeners of `pid`'s
/// tree (their SYNs are dropped and retried by the clients), so that no
/// connection lands in an accept queue after the queues were checked.
/// Removed with [`unlock`] when the dump ends: unlike the connections'
/// lock it must not outlive the dump (it would block the port on a host
/// the server moved away from).
pub fn hold_listeners(pid: i32, name: &str, listeners: &[SocketAddr]) -> Result<()> {
    run_nft(
        Some(pid),
        &syn_script(name, listeners),
        &format!("holding new connections off {name}"),
    )
}

/// Install several locks at once, in one nft transaction, in the network
/// namespace of process `pid`: `(name, set)` each, as [`lock`] and
/// [`hold_listeners`] (the listeners' table named `NAME_syn`) would. With
/// a `lease`, every element expires after it unless [`renew_many`] renews
/// it: if the holder dies, the lock lifts by itself within the lease (the
/// kernel's set timeouts; the emptied tables are swept by the holder's
/// next start).
pub fn lock_many(ns: &LockNs, locks: &[(String, LockSet)], lease: Option<Duration>) -> Result<()> {
    let mut all = String::new();
    for (name, set) in locks {
        if !set.listeners.is_empty() {
            all += &leased_syn_script(&format!("{name}_syn"), &set.listeners, lease);
        }
        if !set.conns.is_empty() {
            all += &leased_script(name, set, lease);
        }
    }
    if all.is_empty() {
        return Ok(());
    }
    run_nft_with(ns.nft(), &all, &format!("{} network locks", locks.len()))
}

/// Renew the lease of locks made by [`lock_many`] (in the network namespace
/// of `pid`) for `lease` more, in one nft transaction: every element is
/// deleted and added again with its new timeout (nft 1.0 cannot update a
/// timeout in place; one transaction, so no packet ever sees the set
/// without it). Fails, changing nothing, if an element expired meanwhile:
/// the lease lapsed and the lock lifted.
pub fn renew_many(ns: &LockNs, locks: &[(String, LockSet)], lease: Duration) -> Result<()> {
    refill(ns, locks, Some(lease), "delete element")
}

/// Make locks made by [`lock_many`] permanent (their elements no longer
/// expire; those that did are back), in one nft transaction.
pub fn keep_many(ns: &LockNs, locks: &[(String, LockSet)]) -> Result<()> {
    refill(ns, locks, None, "flush set")
}

/// `first` ("delete element": fails if one is gone; "flush set": empties
/// the set) then every element added again with `lease`.
fn refill(
    ns: &LockNs,
    locks: &[(String, LockSet)],
    lease: Option<Duration>,
    first: &str,
) -> Result<()> {
    let t = element_timeout(lease);
    let mut s = String::new();
    let mut put = |table: &str, set: &str, v: &[String]| {
        if v.is_empty() {
            return;
        }
        if first == "flush set" {
            s += &format!("flush set inet {table} {set}\n");
        } else {
            s += &format!("{first} inet {table} {set} {{ {} }}\n", v.join(", "));
        }
        let with: Vec<String> = v.iter().map(|e| format!("{e}{t}")).collect();
        s += &format!("add element inet {table} {set} {{ {} }}\n", with.join(", "));
    };
    for (name, set) in locks {
        let (c4, c6) = conn_elements(set);
        put(name, "c4", &c4);
        put(name, "c6", &c6);
        let syn = format!("{name}_syn");
        let (l4, l6, lany) = listener_elements(&set.listeners);
        put(&syn, "l4", &l4);
        put(&syn, "l6", &l6);
        put(&syn, "lany", &lany);
    }
    if s.is_empty() {
        return Ok(());
    }
    run_nft_with(
        ns.nft(),
        &s,
        &format!("renewing {} network locks", locks.len()),
    )
}

/// The tables named `prefix*` in the network namespace of `pid` (None: ours).
pub fn tables_named(pid: Option<i32>, prefix: &str) -> Result<Vec<String>> {
    let out = nft_command(pid)
        .args(["list", "tables", "inet"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map_err(|e| nft_failed("listing nft tables".into(), &e.to_string()))?;
    if !out.status.success() {
        return Err(nft_failed("listing nft tables".into(), "nft failed"));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table inet "))
        .map(|n| n.trim().to_string())
        .filter(|n| n.starts_with(prefix))
        .collect())
}

/// Install lock `name` for `set` in the network namespace of process `pid`.
pub fn lock(pid: i32, name: &str, set: &LockSet) -> Result<()> {
    run_nft(
        Some(pid),
        &script(name, set),
        &format!("network lock {name}"),
    )
}

/// Remove lock `name` from the network namespace of `pid` (None: ours).
/// Returns whether there was one.
pub fn unlock(pid: Option<i32>, name: &str) -> Result<bool> {
    // "add" then "delete" in one transaction: no error when it is absent.
    let existed = table_exists(pid, name);
    run_nft(
        pid,
        &format!("add table inet {name}\ndelete table inet {name}\n"),
        &format!("removing network lock {name}"),
    )?;
    Ok(existed)
}

/// Remove the locks `names` from the network namespace of `pid` (None:
/// ours) in one nft transaction. Each table deletion waits for an RCU grace
/// period (about 25 ms here); one transaction waits once, however many
/// tables go. Absent ones are no error.
///
/// In our own namespace the tables are deleted over netlink by this
/// process ([`delete_tables`]): no `nft` to fork, and the close of the
/// netlink socket, which waits for the kernel to free what the transaction
/// removed (an RCU grace period, 10-30 ms here), is left to a thread of its
/// own. The locks are lifted once the kernel acknowledged the transaction.
pub fn unlock_many(pid: Option<i32>, names: &[String]) -> Result<()> {
    if names.is_empty() {
        return Ok(());
    }
    if pid.is_none_or(same_netns) {
        match delete_tables(names) {
            Ok(()) => return Ok(()),
            // nft below says what is wrong, or does it its way.
            Err(e) => tracing::debug!(
                error = %e.into_sys_error(format!("removing {} network locks over netlink", names.len())),
                "network locks: netlink failed, trying nft"
            ),
        }
    }
    let script: String = names
        .iter()
        .map(|n| format!("add table inet {n}\ndelete table inet {n}\n"))
        .collect();
    run_nft(
        pid,
        &script,
        &format!("removing {} network locks", names.len()),
    )
}

/// The table of the reset guard (see [`guard_resets`]); one per namespace.
pub const GUARD_TABLE: &str = "cr_reset_guard";

/// Drop, for `secs` seconds, TCP resets that reach the connections
/// (local, remote) just restored in our network namespace. A peer restored
/// after us (on another host, one `cr_restart` after the other) answers our
/// packets with a RST until its socket exists; the guard lets our
/// retransmissions wait for it instead of dying. The set's elements expire
/// on their own; the table stays, empty.
pub fn guard_resets(conns: &[(SocketAddr, SocketAddr)], secs: u32) -> Result<()> {
    let (mut g4, mut g6) = (Vec::new(), Vec::new());
    for (l, r) in conns {
        let (f, ir) = ip_words(r.ip());
        let (_, il) = ip_words(l.ip());
        let e = format!("{ir} . {} . {il} . {} timeout {secs}s", r.port(), l.port());
        if f == "ip" {
            g4.push(e)
        } else {
            g6.push(e)
        }
    }
    let t = GUARD_TABLE;
    let mut s = format!(
        "add table inet {t}\n\
         add set inet {t} g4 {{ type ipv4_addr . inet_service . ipv4_addr . inet_service; flags timeout; }}\n\
         add set inet {t} g6 {{ type ipv6_addr . inet_service . ipv6_addr . inet_service; flags timeout; }}\n\
         add chain inet {t} in {{ type filter hook input priority -160; policy accept; }}\n\
         flush chain inet {t} in\n\
         add rule inet {t} in tcp flags rst ip saddr . tcp sport . ip daddr . tcp dport @g4 drop\n\
         add rule inet {t} in tcp flags rst ip6 saddr . tcp sport . ip6 daddr . tcp dport @g6 drop\n"
    );
    if !g4.is_empty() {
        s += &format!("add element inet {t} g4 {{ {} }}\n", g4.join(", "));
    }
    if !g6.is_empty() {
        s += &format!("add element inet {t} g6 {{ {} }}\n", g6.join(", "));
    }
    run_nft(None, &s, "installing the reset guard")
}

/// Remove the leased locks (tables `prefix*` whose sets expire: a
/// session's, never an image's, which are permanent) of our namespace:
/// what an agent that died left; their names.
pub fn remove_leased(prefix: &str) -> Result<Vec<String>> {
    let mut gone = Vec::new();
    for t in tables_named(None, prefix)? {
        let out = nft_command(None)
            .args(["list", "table", "inet", &t])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .map_err(|e| nft_failed(format!("listing nft table {t}"), &e.to_string()))?;
        if out.status.success() && String::from_utf8_lossy(&out.stdout).contains("flags timeout") {
            unlock(None, &t)?;
            gone.push(t);
        }
    }
    Ok(gone)
}

/// Remove the reset guard's table of our namespace once every element has
/// expired (nothing left to guard); whether it was removed.
pub fn remove_idle_guard() -> Result<bool> {
    let out = nft_command(None)
        .args(["list", "table", "inet", GUARD_TABLE])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map_err(|e| nft_failed("listing the reset guard".into(), &e.to_string()))?;
    if !out.status.success() || String::from_utf8_lossy(&out.stdout).contains("elements") {
        return Ok(false);
    }
    unlock(None, GUARD_TABLE)
}

fn table_exists(pid: Option<i32>, name: &str) -> bool {
    nft_command(pid)
        .args(["list", "table", "inet", name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

// linux/netfilter/nfnetlink.h, linux/netfilter/nf_tables.h
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
const NFTA_TABLE_NAME: u16 = 1;
const NFPROTO_INET: u8 = 1;
/// How long the kernel's acknowledgements are waited for.
const NETLINK_ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// `struct nfgenmsg` and a table's name attribute: the payload of a table
/// message (`family`, `res_id`, `name`: no attribute when empty).
fn nf_payload(family: u8, res_id: u16, name: &str) -> Vec<u8> {
    let mut p = vec![family, 0];
    p.extend_from_slice(&res_id.to_be_bytes());
    if !name.is_empty() {
        let len = 4 + name.len() + 1;
        p.extend_from_slice(&(len as u16).to_ne_bytes());
        p.extend_from_slice(&NFTA_TABLE_NAME.to_ne_bytes());
        p.extend_from_slice(name.as_bytes());
        p.push(0);
        p.resize(4 + crate::sock_diag::align4(len), 0);
    }
    p
}

/// The nfnetlink batch that deletes the inet tables `names`, each made
/// first if absent ("add table" then "delete table", as [`unlock_many`]'s
/// nft script): the batch, and how many of its messages ask for an
/// acknowledgement (sequence numbers 1..=that).
fn delete_batch(names: &[String]) -> (Vec<u8>, u32) {
    use crate::sock_diag::{message, NLM_F_ACK, NLM_F_REQUEST};
    let mut out = message(
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        0,
        &nf_payload(0, NFNL_SUBSYS_NFTABLES, ""),
    );
    let mut seq = 0;
    for n in names {
        for ty in [NFT_MSG_NEWTABLE, NFT_MSG_DELTABLE] {
            seq += 1;
            out.extend(message(
                (NFNL_SUBSYS_NFTABLES << 8) | ty,
                NLM_F_REQUEST | NLM_F_ACK,
                seq,
                &nf_payload(NFPROTO_INET, 0, n),
            ));
        }
    }
    out.extend(message(
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        seq + 1,
        &nf_payload(0, NFNL_SUBSYS_NFTABLES, ""),
    ));
    (out, seq)
}

/// Delete the inet tables `names` of our network namespace in one
/// nf_tables transaction over a netlink socket of our own; absent ones are
/// no error. Returns once the kernel acknowledged every message (the
/// transaction is committed: the tables' hooks no longer see a packet);
/// the socket is closed on a thread of its own, since its close waits for
/// the kernel's release of the deleted objects.
fn delete_tables(names: &[String]) -> crate::sock_diag::QResult<()> {
    use crate::error::Errno;
    use crate::sock_diag::{
        i32_at, recv_from_kernel, send, NlMsgHdr, QueryError, NLMSG_ERROR, NLMSG_HDRLEN, RECV_BUF,
    };
    use nix::sys::socket::{self as sock, sockopt, SockProtocol};
    if let Some(n) = names.iter().find(|n| n.is_empty() || n.len() > 255) {
        return Err(QueryError::Malformed(format!("table name {n:?}")));
    }
    let fd = crate::sock_diag::open(
        SockProtocol::NetlinkNetFilter,
        "socket(AF_NETLINK, NETLINK_NETFILTER)",
    )?;
    let timeout = nix::sys::time::TimeVal::new(NETLINK_ACK_TIMEOUT.as_secs() as i64, 0);
    sock::setsockopt(&fd, sockopt::ReceiveTimeout, &timeout)
        .map_err(|e| QueryError::Syscall("setsockopt(SO_RCVTIMEO)", e.into()))?;
    let (batch, acks) = delete_batch(names);
    let res = (|| {
        send(&fd, &batch)?;
        let mut buf = vec![0u8; RECV_BUF];
        let mut acked = 0;
        while acked < acks {
            let n = recv_from_kernel(&fd, &mut buf)?;
            let mut b = &buf[..n];
            while b.len() >= NLMSG_HDRLEN {
                let hdr = NlMsgHdr::parse(b)
                    .ok_or_else(|| QueryError::Malformed("short header".into()))?;
                let len = hdr.nlmsg_len as usize;
                if len < NLMSG_HDRLEN || len > b.len() {
                    return Err(QueryError::Malformed(format!(
                        "message length {len} with {} bytes left",
                        b.len()
                    )));
                }
                if hdr.nlmsg_type == NLMSG_ERROR {
                    let err = i32_at(&b[NLMSG_HDRLEN..len], 0)
                        .ok_or_else(|| QueryError::Malformed("short NLMSG_ERROR".into()))?;
                    if err < 0 {
                        return Err(QueryError::Kernel(Errno(-err)));
                    }
                    if (1..=acks).contains(&hdr.nlmsg_seq) {
                        acked += 1;
                    }
                }
                b = &b[crate::sock_diag::align4(len).min(b.len())..];
            }
        }
        Ok(())
    })();
    let closing = std::thread::Builder::new()
        .name("nft-close".into())
        .spawn(move || drop(fd));
    // Without a thread the close is waited for here.
    drop(closing);
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock made before the freeze is kept only if it makes the same
    /// tables and holds every connection found once frozen.
    #[test]
    fn covers_needs_the_same_tables_and_every_connection() {
        let a: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:6000".parse().unwrap();
        let c: SocketAddr = "10.0.0.3:7000".parse().unwrap();
        let before = LockSet {
            conns: vec![(a, b), (a, c)],
            listeners: vec![],
        };
        let closed_one = LockSet {
            conns: vec![(a, b)],
            listeners: vec![],
        };
        assert!(before.covers(&before));
        assert!(before.covers(&closed_one));
        assert!(!closed_one.covers(&before), "a new connection");
        assert!(!before.covers(&LockSet::default()), "a table fewer");
        let listening = LockSet {
            conns: vec![(a, b)],
            listeners: vec![a],
        };
        assert!(!before.covers(&listening), "a listeners' table more");
    }

    #[test]
    fn connections_held_at_both_ends_are_listed_once() {
        let (a, b): (SocketAddr, SocketAddr) = (
            "10.0.0.1:5000".parse().unwrap(),
            "10.0.0.1:40000".parse().unwrap(),
        );
        let set = LockSet {
            conns: vec![(a, b), (b, a)],
            listeners: vec![a, a],
        };
        let (c4, c6) = conn_elements(&set);
        assert_eq!(c4.len(), 2, "{c4:?}");
        assert!(c6.is_empty());
        assert_eq!(listener_elements(&set.listeners).0.len(), 1);
    }

    #[test]
    fn script_lists_both_directions() {
        let set = LockSet {
            conns: vec![
                (
                    "10.0.0.1:5000".parse().unwrap(),
                    "10.0.0.2:40000".parse().unwrap(),
                ),
                (
                    "[::1]:6000".parse().unwrap(),
                    "[::1]:50000".parse().unwrap(),
                ),
                (
                    "[::ffff:10.0.0.1]:7000".parse().unwrap(),
                    "[::ffff:10.0.0.3]:7001".parse().unwrap(),
                ),
            ],
            listeners: vec![],
        };
        let s = script("cr_lock_t", &set);
        assert!(s.contains("10.0.0.1 . 5000 . 10.0.0.2 . 40000"));
        assert!(s.contains("10.0.0.2 . 40000 . 10.0.0.1 . 5000"));
        assert!(s.contains("::1 . 6000 . ::1 . 50000"));
        // IPv4-mapped addresses are matched as the IPv4 packets they are.
        assert!(s.contains("10.0.0.3 . 7001 . 10.0.0.1 . 7000"));
    }

    #[test]
    fn leased_locks_expire_and_renew_in_one_transaction() {
        let set = LockSet {
            conns: vec![(
                "10.0.0.1:5000".parse().unwrap(),
                "10.0.0.2:40000".parse().unwrap(),
            )],
            listeners: vec!["0.0.0.0:5000".parse().unwrap()],
        };
        let s = leased_script("t", &set, Some(Duration::from_secs(4)));
        assert!(s.contains("flags timeout;"), "{s}");
        assert!(
            s.contains("10.0.0.1 . 5000 . 10.0.0.2 . 40000 timeout 4000ms"),
            "{s}"
        );
        let s = leased_syn_script("t_syn", &set.listeners, Some(Duration::from_secs(4)));
        assert!(s.contains("elements = { 5000 timeout 4000ms }"), "{s}");
        assert!(!script("t", &set).contains("timeout"));
    }

    #[test]
    fn syn_script_lists_listeners() {
        let s = syn_script(
            "t_syn",
            &[
                "0.0.0.0:5000".parse().unwrap(),
                "[::1]:6000".parse().unwrap(),
            ],
        );
        assert!(s.contains("set lany { type inet_service; elements = { 5000 } }"));
        assert!(s.contains("set l6 { type ipv6_addr . inet_service; elements = { ::1 . 6000 } }"));
    }

    /// The netlink removal (no nft): the batch's layout, and on a root
    /// host a real lock of ours removed with an absent one, no error.
    #[test]
    fn unlock_many_removes_tables_over_netlink() {
        let (b, acks) = delete_batch(&["t1".into(), "t22".into()]);
        assert_eq!(acks, 4);
        // begin, 4 table messages (header 16, nfgenmsg 4, name 8), end.
        assert_eq!(b.len(), 20 + 4 * 28 + 20);
        if !nix::unistd::geteuid().is_root() || Command::new("nft").arg("-v").output().is_err() {
            return;
        }
        let name = format!("cr_test_unlock_{}", std::process::id());
        let set = LockSet {
            conns: vec![(
                "10.0.0.1:5000".parse().unwrap(),
                "10.0.0.2:40000".parse().unwrap(),
            )],
            listeners: vec![],
        };
        lock(std::process::id() as i32, &name, &set).expect("lock");
        assert!(table_exists(None, &name));
        let absent = format!("{name}_absent");
        delete_tables(&[name.clone(), absent])
            .unwrap_or_else(|e| panic!("{}", e.into_sys_error("delete".into())));
        assert!(!table_exists(None, &name), "{name} still there");
    }

    /// A leased lock in another namespace is renewed and made permanent
    /// after every process of that namespace exited (a member killed after
    /// its commit): the namespace is pinned when the lock is made.
    #[test]
    fn leased_lock_outlives_the_processes_of_its_namespace() {
        if !nix::unistd::geteuid().is_root() || Command::new("nft").arg("-v").output().is_err() {
            return;
        }
        // The child says "ready" from inside its new namespace (unshare
        // made it before running the shell), then stays there.
        let mut child = Command::new("unshare")
            .args(["-n", "sh", "-c", "echo ready; exec sleep 60"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("unshare -n sh");
        let pid = child.id() as i32;
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("its stdout")),
            &mut line,
        )
        .expect("read the child's word");
        assert_eq!(line.trim(), "ready", "unshare -n did not start");
        assert!(!same_netns(pid), "the child is in a namespace of its own");
        let ns = LockNs::of(pid).expect("pin the namespace");
        assert!(ns.0.is_some(), "another namespace than ours");
        let name = format!("cr_test_lease_{}", std::process::id());
        let set = LockSet {
            conns: vec![(
                "10.0.0.1:5000".parse().unwrap(),
                "10.0.0.2:40000".parse().unwrap(),
            )],
            listeners: vec![],
        };
        let locks = vec![(name.clone(), set)];
        lock_many(&ns, &locks, Some(Duration::from_secs(30))).expect("lock");
        let _ = child.kill();
        let _ = child.wait();
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
        renew_many(&ns, &locks, Duration::from_secs(30)).expect("renew, the process gone");
        keep_many(&ns, &locks).expect("made permanent, the process gone");
        let listed = ns
            .nft()
            .args(["list", "table", "inet", &name])
            .output()
            .expect("nft list");
        assert!(listed.status.success(), "{name} is in the pinned namespace");
        assert!(!table_exists(None, &name), "{name} is not in ours");
    }
}
