//! Workload: identity across checkpoint/restore, checked from inside.
//!
//! At start it lowers RLIMIT_NOFILE to 123/456 and records its real,
//! effective and saved uids and gids, supplementary groups, all five
//! capability sets, no_new_privs, the keep-caps flag and its limits. After
//! `<workdir>/go` appears it reads them all again and prints OK or FAIL:
//! what changed. (Run it under `setpriv` to give it another user, groups or
//! capabilities.)
//!
//! Usage: wl_ident WORKDIR

fn say(s: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

fn snapshot() -> Vec<(String, String)> {
    let mut v = Vec::new();
    // SAFETY: plain getters writing into local variables.
    unsafe {
        let (mut r, mut e, mut s) = (0, 0, 0);
        libc::getresuid(&mut r, &mut e, &mut s);
        v.push(("uids".into(), format!("{r} {e} {s}")));
        libc::getresgid(&mut r, &mut e, &mut s);
        v.push(("gids".into(), format!("{r} {e} {s}")));
        let mut groups = [0 as libc::gid_t; 256];
        let n = libc::getgroups(256, groups.as_mut_ptr());
        v.push((
            "groups".into(),
            format!("{:?}", &groups[..n.max(0) as usize]),
        ));
        v.push((
            "no_new_privs".into(),
            libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0).to_string(),
        ));
        v.push((
            "keep_caps".into(),
            libc::prctl(libc::PR_GET_KEEPCAPS, 0, 0, 0, 0).to_string(),
        ));
        for res in [libc::RLIMIT_NOFILE, libc::RLIMIT_STACK, libc::RLIMIT_CORE] {
            let mut l = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::getrlimit(res, &mut l);
            v.push((
                format!("rlimit {res}"),
                format!("{} {}", l.rlim_cur, l.rlim_max),
            ));
        }
    }
    // The capability sets as the kernel reports them for this thread.
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap_or_default();
    for l in status.lines().filter(|l| l.starts_with("Cap")) {
        if let Some((k, val)) = l.split_once(':') {
            v.push((k.to_string(), val.trim().to_string()));
        }
    }
    v
}

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: wl_ident WORKDIR"));
    let l = libc::rlimit {
        rlim_cur: 123,
        rlim_max: 456,
    };
    // SAFETY: setrlimit with a valid pointer; lowering is always allowed.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) }, 0);
    let before = snapshot();
    say("READY");
    while !dir.join("go").exists() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let after = snapshot();
    let diffs: Vec<String> = before
        .iter()
        .zip(&after)
        .filter(|(b, a)| b != a)
        .map(|(b, a)| format!("{}: {} -> {}", b.0, b.1, a.1))
        .collect();
    if diffs.is_empty() {
        say("OK");
    } else {
        say(&format!("FAIL: {}", diffs.join("; ")));
        std::process::exit(1);
    }
}
