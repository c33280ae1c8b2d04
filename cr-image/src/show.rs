//! A readable dump of an image (like `crit show`): text for people, JSON
//! (the typed image serialized with serde, plus a one-line summary per
//! object) for tests and scripts.

use crate::model::objects::{InetSocket, ObjectKind};
use crate::model::{Checkpoint, Memory, Object, ParentRef, Process, VmaKind};
use serde::Serialize;

/// The image as `cr_image show --json` prints it.
#[derive(Serialize)]
pub struct ImageView<'a> {
    #[serde(flatten)]
    meta: &'a crate::model::Meta,
    root_pid: u32,
    pidns: bool,
    pre_dump: bool,
    netlock: &'a Option<String>,
    parent: &'a Option<ParentRef>,
    store: &'a Option<crate::model::PageStore>,
    processes: &'a [Process],
    objects: Vec<ObjectView<'a>>,
    sysv: &'a Option<crate::model::SysvIpc>,
    mounts: &'a Option<crate::model::MountNs>,
    job_dir: &'a Option<String>,
    uts: &'a Option<crate::model::UtsNs>,
}

#[derive(Serialize)]
struct ObjectView<'a> {
    #[serde(flatten)]
    object: &'a Object,
    summary: String,
}

/// The whole image, for JSON.
pub fn view(ck: &Checkpoint) -> ImageView<'_> {
    ImageView {
        meta: &ck.meta,
        root_pid: ck.root_pid,
        pidns: ck.pidns,
        pre_dump: ck.pre_dump,
        netlock: &ck.netlock,
        parent: &ck.parent,
        store: &ck.store,
        processes: &ck.processes,
        objects: ck
            .objects
            .iter()
            .map(|o| ObjectView {
                object: o,
                summary: object_summary(o),
            })
            .collect(),
        sysv: &ck.sysv,
        mounts: &ck.mounts,
        job_dir: &ck.job_dir,
        uts: &ck.uts,
    }
}

/// Page statistics of an image, as `cr_image stats --json` prints them.
#[derive(Serialize)]
pub struct StatsView<'a> {
    id: &'a str,
    /// The parent's directory.
    parent: Option<String>,
    pre_dump: bool,
    compression: &'static str,
    store_bytes: u64,
    store_raw_bytes: u64,
    processes: Vec<ProcStats<'a>>,
}

#[derive(Serialize)]
struct ProcStats<'a> {
    pid: u32,
    #[serde(flatten)]
    memory: &'a Memory,
}

pub fn stats(ck: &Checkpoint, parent: Option<String>) -> StatsView<'_> {
    let store = ck.store.as_ref();
    StatsView {
        id: &ck.meta.image_id,
        parent,
        pre_dump: ck.pre_dump,
        compression: store.map_or("none", |s| s.compression.name()),
        store_bytes: store.map_or(0, |s| s.size),
        store_raw_bytes: store.map_or(0, |s| s.blocks.iter().map(|b| b.pages as u64 * 4096).sum()),
        processes: ck
            .processes
            .iter()
            .filter(|p| !p.is_zombie())
            .map(|p| ProcStats {
                pid: p.pid,
                memory: &p.memory,
            })
            .collect(),
    }
}

fn prot_str(p: u32) -> String {
    let b = |bit: u32, c: char| if p & bit != 0 { c } else { '-' };
    format!("{}{}{}", b(1, 'r'), b(2, 'w'), b(4, 'x'))
}

fn vma_kind(k: VmaKind) -> String {
    serde_json::to_value(k)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// One line about an object: what it is and what it holds.
pub fn object_summary(o: &Object) -> String {
    match &o.kind {
        ObjectKind::Pipe(p) => format!(
            "pipe:[{}] {} bytes buffered, capacity {}",
            o.id,
            p.data.len(),
            p.capacity
        ),
        ObjectKind::Fifo(f) => format!("fifo {} {} bytes buffered", f.path, f.data.len()),
        ObjectKind::Mqueue(q) => format!(
            "message queue {}{} mode {:#o} owner {}:{}, {} of {} messages of up to {} bytes queued",
            q.name,
            if q.unlinked { " (unlinked)" } else { "" },
            q.mode,
            q.uid,
            q.gid,
            q.messages.len(),
            q.maxmsg,
            q.msgsize
        ),
        ObjectKind::BpfMap(m) => format!(
            "BPF map {:?} type {} key {} value {} bytes, {} of {} entries saved, flags {:#x}{}",
            m.name,
            m.map_type,
            m.key_size,
            m.value_size,
            m.entries.len(),
            m.max_entries,
            m.map_flags,
            if m.frozen { ", frozen" } else { "" }
        ),
        ObjectKind::Memfd(f) => {
            format!("memfd:{} {} bytes, seals {:#x}", f.name, f.size, f.seals)
        }
        ObjectKind::DeletedFile(f) => format!("deleted file {} {} bytes", f.name, f.size),
        ObjectKind::SavedFile(f) => format!("saved file {} {} bytes", f.name, f.size),
        ObjectKind::Pty(p) => format!(
            "pty /dev/pts/{}{}, {} lines and {} bytes of input, {} bytes of output queued{}",
            p.index,
            if p.locked { " (locked)" } else { "" },
            p.input_lines.len(),
            p.input.len(),
            p.output.len(),
            if p.packet { ", packet mode" } else { "" }
        ),
        ObjectKind::UnixSocket(u) => {
            let ty = match u.sock_type {
                1 => "stream",
                2 => "dgram",
                5 => "seqpacket",
                _ => "?",
            };
            let name = String::from_utf8_lossy(&u.name).replace('\0', "@");
            format!(
                "unix {ty} socket:[{}] state {} name {:?} peer {} {} queued messages ({} bytes)",
                o.id,
                u.state,
                name,
                u.peer,
                u.queue.len(),
                u.queue.iter().map(Vec::len).sum::<usize>()
            ) + &u
                .pending
                .iter()
                .map(|p| {
                    format!(
                        ", not yet accepted: client {} sent {} bytes",
                        p.client,
                        p.data.iter().map(Vec::len).sum::<usize>()
                    )
                })
                .collect::<String>()
        }
        ObjectKind::InetSocket(s) => inet_summary(o.id, s),
        ObjectKind::NetlinkSocket(n) => format!(
            "netlink socket:[{}] protocol {} port id {} groups {:?}{}",
            o.id,
            n.protocol,
            n.portid,
            n.groups,
            if n.dst_portid != 0 || n.dst_groups != 0 {
                format!(" connected to {}/{:#x}", n.dst_portid, n.dst_groups)
            } else {
                String::new()
            }
        ),
        ObjectKind::PacketSocket(p) => format!(
            "packet socket:[{}] protocol {:#06x} on {} {} memberships",
            o.id,
            u16::from_be(p.protocol as u16),
            if p.ifname.is_empty() {
                "every interface"
            } else {
                &p.ifname
            },
            p.memberships.len()
        ),
    }
}

/// "tcp socket:[7] (v4) 10.0.0.1:5000 -> 10.0.0.2:40000 ESTABLISHED
/// snd_una=... ...", "udp ...", "raw ipv4 (protocol 255) ...", "ping (icmp) ...".
fn inet_summary(id: u64, s: &InetSocket) -> String {
    let proto_name = s.proto_name().to_lowercase();
    let family = if s.family == 10 { "v6" } else { "v4" };
    let local = s
        .local
        .map_or_else(|| "(unbound)".to_string(), |a| a.to_string());
    let mut out = format!("{proto_name} socket:[{id}] ({family}) {local}");
    if let Some(r) = s.remote {
        out.push_str(&format!(" -> {r}"));
    }
    if s.protocol == 6 {
        let state = match s.state {
            1 => "ESTABLISHED",
            2 => "SYN-SENT",
            4 => "FIN-WAIT-1",
            5 => "FIN-WAIT-2",
            7 => "CLOSE",
            8 => "CLOSE-WAIT",
            9 => "LAST-ACK",
            10 => "LISTEN",
            11 => "CLOSING",
            _ => "?",
        };
        out.push_str(&format!(" {state}"));
        if s.state == 10 {
            out.push_str(&format!(" backlog {}", s.backlog));
        }
    }
    if let Some(t) = &s.tcp {
        out.push_str(&format!(
            " snd_una={} snd_nxt={} rcv_nxt={} send queue {} bytes ({} unsent), receive queue {} bytes",
            t.snd_una,
            t.snd_nxt,
            t.rcv_nxt,
            t.send_queue.len(),
            t.unsent,
            t.recv_queue.len()
        ));
    }
    out
}

/// The image as text.
pub fn to_text(ck: &Checkpoint) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let m = &ck.meta;
    let _ = writeln!(
        s,
        "checkpoint of pid {} taken on {} (kernel {}) by cr {}",
        ck.root_pid, m.hostname, m.kernel_release, m.tool_version
    );
    for p in &ck.processes {
        let _ = writeln!(
            s,
            "\nprocess {} (pid {} in its namespace) ({}) ppid {} exe {}{}",
            p.pid,
            p.ns_pid,
            p.task.comm,
            p.ppid,
            p.task.exe,
            if p.is_zombie() { " [zombie]" } else { "" }
        );
        let _ = writeln!(s, "  cwd {}  umask {:04o}", p.task.cwd, p.task.umask);
        let mem = &p.memory;
        let st = mem.stats;
        let _ = writeln!(
            s,
            "  pages: {} stored, {} duplicates, {} from the parent, {} zero ({} runs); unchanged pages found by {}, tracking left: {}",
            st.pages_stored,
            st.pages_dup,
            st.pages_parent,
            st.pages_zero,
            mem.runs.len(),
            mem.dirty.name(),
            mem.tracking.map_or("none", |t| t.name()),
        );
        let _ = writeln!(s, "  memory ({} vmas):", p.vmas.len());
        for v in &p.vmas {
            let _ = writeln!(
                s,
                "    {:012x}-{:012x} {}{} {:<12} {} {}",
                v.start,
                v.end,
                prot_str(v.prot),
                if v.shared { 's' } else { 'p' },
                vma_kind(v.kind),
                v.path,
                v.vm_flags.join(" ")
            );
        }
        for t in &p.threads {
            let r = &t.regs;
            let _ = writeln!(
                s,
                "  thread {}: rip {:#x} rsp {:#x} rax {:#x} orig_rax {} fs_base {:#x} xstate {} bytes",
                t.tid, r.rip, r.rsp, r.rax, r.orig_rax as i64, r.fs_base, t.xstate.len()
            );
        }
        let _ = writeln!(s, "  fds:");
        for f in &p.fds {
            let _ = writeln!(
                s,
                "    {:>4} {:<12} flags {:#o} pos {} {}",
                f.fd,
                f.kind.name(),
                f.flags,
                f.pos,
                f.path
            );
        }
    }
    if !ck.objects.is_empty() {
        let _ = writeln!(s, "\nobjects ({}):", ck.objects.len());
        for o in &ck.objects {
            let _ = writeln!(s, "  {}", object_summary(o));
        }
    }
    if let Some(v) = &ck.sysv {
        sysv_text(&mut s, v);
    }
    if let Some(m) = &ck.mounts {
        let _ = writeln!(
            s,
            "\nown mount namespace: /proc {}, /dev/shm {}, /dev/pts {}",
            if m.proc { "of its own" } else { "the host's" },
            m.dev_shm.as_ref().map_or_else(
                || "the host's".to_string(),
                |t| format!("private ({} entries)", t.entries.len())
            ),
            if m.devpts { "of its own" } else { "the host's" },
        );
    }
    if let Some(u) = &ck.uts {
        let _ = writeln!(
            s,
            "own UTS namespace: host name {:?}, domain name {:?}",
            u.hostname, u.domainname
        );
    }
    if let Some(d) = &ck.job_dir {
        let _ = writeln!(s, "job directory {d}");
    }
    s
}

/// The System V IPC objects, one line each.
fn sysv_text(s: &mut String, v: &crate::model::SysvIpc) {
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "\nSystem V IPC ({}):",
        if v.own_namespace {
            "its own namespace"
        } else {
            "the host's namespace"
        }
    );
    for g in &v.shm {
        let _ = writeln!(
            s,
            "  shm {} key {:#010x} size {} mode {:o} owner {}:{}{}{}{}",
            g.id,
            g.perm.key,
            g.size,
            g.perm.mode,
            g.perm.uid,
            g.perm.gid,
            if g.removed { " removed" } else { "" },
            if g.locked { " locked" } else { "" },
            if g.hugetlb { " hugetlb" } else { "" }
        );
    }
    for m in &v.sem {
        let _ = writeln!(
            s,
            "  sem {} key {:#010x} mode {:o} values {:?}",
            m.id, m.perm.key, m.perm.mode, m.values
        );
    }
    for q in &v.msg {
        let _ = writeln!(
            s,
            "  msg {} key {:#010x} mode {:o} {} messages ({} bytes)",
            q.id,
            q.perm.key,
            q.perm.mode,
            q.messages.len(),
            q.messages.iter().map(|m| m.text.len()).sum::<usize>()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::inet_summary;
    use crate::model::objects::InetSocket;

    /// Raw and ping sockets are named as such, not as UDP.
    #[test]
    fn inet_sockets_are_labelled_by_kind() {
        let sock = |family, sock_type, protocol| InetSocket {
            family,
            sock_type,
            protocol,
            ..Default::default()
        };
        let label = |s: &InetSocket| {
            let sum = inet_summary(1, s);
            sum[..sum.find(" socket:").expect("a socket summary")].to_string()
        };
        assert_eq!(label(&sock(2, 1, 6)), "tcp");
        assert_eq!(label(&sock(2, 2, 17)), "udp");
        assert_eq!(label(&sock(2, 3, 255)), "raw ipv4 (protocol 255)");
        assert_eq!(label(&sock(10, 3, 58)), "raw ipv6 (protocol 58)");
        assert_eq!(label(&sock(2, 2, 1)), "ping (icmp)");
        assert_eq!(label(&sock(10, 2, 58)), "ping (icmpv6)");
    }
}
