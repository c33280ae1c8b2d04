//! A readable dump of an image (like `crit show`): text for people, JSON
//! for tests and scripts.

use crate::proto;
use serde_json::{json, Value};

fn vma_kind(k: i32) -> &'static str {
    proto::VmaKind::try_from(k)
        .map(|k| k.as_str_name())
        .unwrap_or("UNKNOWN")
}

fn fd_kind(k: i32) -> &'static str {
    proto::FdKind::try_from(k)
        .map(|k| k.as_str_name())
        .unwrap_or("UNKNOWN")
}

fn prot_str(p: u32) -> String {
    let b = |bit: u32, c: char| if p & bit != 0 { c } else { '-' };
    format!("{}{}{}", b(1, 'r'), b(2, 'w'), b(4, 'x'))
}

/// Name of a dirty-tracking method as users type it.
pub fn dirty_name(m: i32) -> &'static str {
    match proto::DirtyMethod::try_from(m).unwrap_or(proto::DirtyMethod::DirtyFull) {
        proto::DirtyMethod::DirtyFull => "full",
        proto::DirtyMethod::DirtyUffdWp => "uffd-wp",
        proto::DirtyMethod::DirtySoftDirty => "soft-dirty",
        proto::DirtyMethod::DirtyHash => "hash",
    }
}

/// The method named by [`dirty_name`] (full if unknown).
pub fn dirty_from_name(s: &str) -> proto::DirtyMethod {
    [
        proto::DirtyMethod::DirtyUffdWp,
        proto::DirtyMethod::DirtySoftDirty,
        proto::DirtyMethod::DirtyHash,
    ]
    .into_iter()
    .find(|m| dirty_name(*m as i32) == s)
    .unwrap_or(proto::DirtyMethod::DirtyFull)
}

/// Name of the tracking left running in a process ("none" if none).
pub fn tracking_name(m: i32) -> &'static str {
    if m == 0 {
        "none"
    } else {
        dirty_name(m)
    }
}

/// Name of a compression as users type it.
pub fn compression_name(c: i32) -> &'static str {
    match proto::Compression::try_from(c).unwrap_or(proto::Compression::None) {
        proto::Compression::None => "none",
        proto::Compression::Lz4 => "lz4",
        proto::Compression::Zstd => "zstd",
    }
}

/// A compression as users type it (`none`, `lz4`, `zstd`).
pub fn parse_compression(s: &str) -> Result<proto::Compression, String> {
    match s {
        "none" => Ok(proto::Compression::None),
        "lz4" => Ok(proto::Compression::Lz4),
        "zstd" => Ok(proto::Compression::Zstd),
        _ => Err(format!("unknown compression {s:?} (none, lz4 or zstd)")),
    }
}

fn memory_json(m: &proto::Memory) -> Value {
    let st = m.stats.unwrap_or_default();
    json!({
        "dirty": dirty_name(m.dirty),
        "tracking": tracking_name(m.tracking),
        "runs": m.runs.len(),
        "pages_stored": st.pages_stored,
        "pages_parent": st.pages_parent,
        "pages_zero": st.pages_zero,
        "pages_dup": st.pages_dup,
        "pages_read": st.pages_read,
    })
}

/// Page statistics of an image (`cr_image stats --json`).
pub fn stats_json(ck: &proto::Checkpoint, parent: Option<String>) -> Value {
    let store = ck.store.clone().unwrap_or_default();
    let raw: u64 = store.blocks.iter().map(|b| b.nr_pages as u64 * 4096).sum();
    json!({
        "id": ck.image_id,
        "parent": parent,
        "pre_dump": ck.pre_dump,
        "compression": compression_name(store.compression),
        "store_bytes": store.size,
        "store_raw_bytes": raw,
        "processes": ck.processes.iter().filter(|p| !p.zombie).map(|p| {
            let mut v = p.memory.as_ref().map(memory_json).unwrap_or_else(|| json!({}));
            v["pid"] = json!(p.pid);
            v
        }).collect::<Vec<_>>(),
    })
}

/// The whole image as JSON.
pub fn to_json(ck: &proto::Checkpoint) -> Value {
    let procs: Vec<Value> = ck
        .processes
        .iter()
        .map(|p| {
            json!({
                "pid": p.pid,
                "ns_pid": p.ns_pid,
                "ppid": p.ppid,
                "pgid": p.pgid,
                "sid": p.sid,
                "zombie": p.zombie,
                "comm": p.comm,
                "exe": p.exe,
                "cwd": p.cwd,
                "umask": format!("{:04o}", p.umask),
                "personality": p.personality,
                "stopped": p.stopped,
                "shared_pending": p.shared_pending.iter().map(|i| i.get(0..4).map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect::<Vec<_>>(),
                "itimers": p.itimers.iter().map(|t| json!({"which": t.which, "interval_us": t.interval_us, "value_us": t.value_us})).collect::<Vec<_>>(),
                "cmdline": String::from_utf8_lossy(&p.cmdline).split('\0').filter(|s| !s.is_empty()).collect::<Vec<_>>(),
                "mm": p.mm.as_ref().map(|m| json!({
                    "start_code": m.start_code, "end_code": m.end_code,
                    "start_data": m.start_data, "end_data": m.end_data,
                    "start_brk": m.start_brk, "brk": m.brk, "start_stack": m.start_stack,
                    "arg_start": m.arg_start, "arg_end": m.arg_end,
                    "env_start": m.env_start, "env_end": m.env_end,
                })),
                "auxv_bytes": p.auxv.len(),
                "vmas": p.vmas.iter().map(|v| json!({
                    "start": format!("{:#x}", v.start),
                    "end": format!("{:#x}", v.end),
                    "prot": prot_str(v.prot),
                    "shared": v.shared,
                    "kind": vma_kind(v.kind),
                    "pgoff": v.pgoff,
                    "path": v.path,
                    "vm_flags": v.vm_flags,
                })).collect::<Vec<_>>(),
                "threads": p.threads.iter().map(|t| {
                    let r = t.regs.unwrap_or_default();
                    json!({
                        "tid": t.tid,
                        "rip": format!("{:#x}", r.rip),
                        "rsp": format!("{:#x}", r.rsp),
                        "rax": format!("{:#x}", r.rax),
                        "orig_rax": r.orig_rax as i64,
                        "fs_base": format!("{:#x}", r.fs_base),
                        "xstate_bytes": t.xstate.len(),
                        "sigmask": format!("{:#x}", t.sigmask),
                        "pending": t.pending.iter().map(|i| i.get(0..4).map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect::<Vec<_>>(),
                        "clear_child_tid": format!("{:#x}", t.clear_child_tid),
                        "rseq": t.rseq.as_ref().map(|s| json!({"addr": format!("{:#x}", s.addr), "len": s.len, "signature": format!("{:#x}", s.signature)})),
                    })
                }).collect::<Vec<_>>(),
                "fds": p.fds.iter().map(|f| json!({
                    "fd": f.fd,
                    "kind": fd_kind(f.kind),
                    "path": f.path,
                    "flags": format!("{:#o}", f.flags),
                    "pos": f.pos,
                    "size": f.size,
                })).collect::<Vec<_>>(),
                "sigactions": p.sigactions.iter().map(|s| json!({
                    "signo": s.signo,
                    "handler": format!("{:#x}", s.handler),
                    "flags": format!("{:#x}", s.flags),
                    "mask": format!("{:#x}", s.mask),
                })).collect::<Vec<_>>(),
                "memory": p.memory.as_ref().map(memory_json),
            })
        })
        .collect();
    json!({
        "tool_version": ck.tool_version,
        "created_unix_ms": ck.created_unix_ms,
        "hostname": ck.hostname,
        "kernel_release": ck.kernel_release,
        "root_pid": ck.root_pid,
        "pidns": ck.pidns,
        "cpu_xfeatures": format!("{:#x}", ck.cpu_xfeatures),
        "processes": procs,
        "objects": ck.objects.iter().map(object_json).collect::<Vec<_>>(),
        "netlock": ck.netlock,
    })
}

fn object_json(o: &proto::FileObject) -> Value {
    let kind = proto::ObjectKind::try_from(o.kind)
        .map(|k| k.as_str_name().trim_end_matches("_OBJECT").to_lowercase())
        .unwrap_or_else(|_| o.kind.to_string());
    let mut v = json!({ "id": o.id, "kind": kind, "summary": object_summary(o) });
    if let Some(u) = &o.unix {
        v["unix"] = json!({
            "type": u.sock_type,
            "state": u.state,
            "name": String::from_utf8_lossy(&u.name).replace('\0', "@"),
            "peer": u.peer,
            "listener": u.listener,
            "queued_messages": u.queue.len(),
            "queued_bytes": u.queue.iter().map(Vec::len).sum::<usize>(),
            "shutdown": u.shutdown,
        });
    }
    if let Some(i) = &o.inet {
        v["inet"] = json!({
            "family": i.family,
            "type": i.sock_type,
            "protocol": i.protocol,
            "state": i.state,
            "local": i.local,
            "remote": i.remote,
            "backlog": i.backlog,
            "options": i.opts.iter().map(|o| format!("{}/{}={}", o.level, o.name,
                o.value.iter().map(|b| format!("{b:02x}")).collect::<String>())).collect::<Vec<_>>(),
        });
        if let Some(t) = &i.tcp {
            v["inet"]["tcp"] = json!({
                "snd_una": t.snd_una,
                "snd_nxt": t.snd_nxt,
                "write_seq": t.write_seq,
                "rcv_nxt": t.rcv_nxt,
                "send_queue_bytes": t.send_queue.len(),
                "unsent_bytes": t.unsent,
                "recv_queue_bytes": t.recv_queue.len(),
                "mss": t.mss,
                "options": t.options,
            });
        }
    }
    v
}

/// One line about an object: what it is and what it holds.
fn object_summary(o: &proto::FileObject) -> String {
    use proto::ObjectKind as K;
    match proto::ObjectKind::try_from(o.kind).unwrap_or(K::Unspecified) {
        K::PipeObject => format!(
            "pipe:[{}] {} bytes buffered, capacity {}",
            o.id,
            o.pipe_data.len(),
            o.pipe_size
        ),
        K::FifoObject => format!("fifo {} {} bytes buffered", o.path, o.pipe_data.len()),
        K::MemfdObject => format!("memfd:{} {} bytes, seals {:#x}", o.path, o.size, o.seals),
        K::DeletedFileObject => format!("deleted file {} {} bytes", o.path, o.size),
        K::PtyObject => format!(
            "pty /dev/pts/{}{}",
            o.pty_index,
            if o.pty_locked { " (locked)" } else { "" }
        ),
        K::UnixSocketObject => {
            let u = o.unix.clone().unwrap_or_default();
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
            )
        }
        K::InetSocketObject => inet_summary(o.id, &o.inet.clone().unwrap_or_default()),
        K::Unspecified => format!("object {} of kind {}", o.id, o.kind),
    }
}

/// "tcp 10.0.0.1:5000 -> 10.0.0.2:40000 ESTABLISHED snd_una=... ..."
fn inet_summary(id: u64, s: &proto::InetSocket) -> String {
    let proto_name = if s.protocol == 6 { "tcp" } else { "udp" };
    let family = if s.family == 10 { "v6" } else { "v4" };
    let local = if s.local.is_empty() {
        "(unbound)"
    } else {
        &s.local
    };
    let mut out = format!("{proto_name} socket:[{id}] ({family}) {local}");
    if !s.remote.is_empty() {
        out.push_str(&format!(" -> {}", s.remote));
    }
    if s.protocol == 6 {
        let state = match s.state {
            1 => "ESTABLISHED",
            7 => "CLOSE",
            10 => "LISTEN",
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
pub fn to_text(ck: &proto::Checkpoint) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "checkpoint of pid {} taken on {} (kernel {}) by cr {}",
        ck.root_pid, ck.hostname, ck.kernel_release, ck.tool_version
    );
    for p in &ck.processes {
        let _ = writeln!(
            s,
            "\nprocess {} (pid {} in its namespace) ({}) ppid {} exe {}{}",
            p.pid,
            p.ns_pid,
            p.comm,
            p.ppid,
            p.exe,
            if p.zombie { " [zombie]" } else { "" }
        );
        let _ = writeln!(s, "  cwd {}  umask {:04o}", p.cwd, p.umask);
        if let Some(m) = &p.memory {
            let st = m.stats.unwrap_or_default();
            let _ = writeln!(
                s,
                "  pages: {} stored, {} duplicates, {} from the parent, {} zero ({} runs); unchanged pages found by {}, tracking left: {}",
                st.pages_stored,
                st.pages_dup,
                st.pages_parent,
                st.pages_zero,
                m.runs.len(),
                dirty_name(m.dirty),
                tracking_name(m.tracking),
            );
        }
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
            let r = t.regs.unwrap_or_default();
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
                fd_kind(f.kind),
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
    s
}
