//! libcr (application cooperation): programs that call cr_init take part
//! in their checkpoints. The C program tests/workloads/libcr_check.c checks
//! from the inside what its callbacks and critical sections saw and prints
//! OK or FAIL; the examples (libcr/examples/reconnect.{c,rs}) close and
//! reopen a connection to a server outside their tree.

use cr_tests::cluster::{jlist, jstr, ju64, node_ip, AgentOpts, Cluster, CRCTL_TIMEOUT};
use cr_tests::faults::Faults;
use cr_tests::libcr::{build_c, repo_dir, LineServer};
use cr_tests::*;
use std::ffi::{OsStr, OsString};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

fn check_program(h: &Harness) -> std::path::PathBuf {
    build_c(&script_path("libcr_check.c"), &h.dir, "libcr_check")
}

/// Thread- and signal-context callbacks around a checkpoint that continues
/// (cr_checkpoint returns 0) and one with --kill, then a restart
/// (cr_checkpoint returns > 0): the connection to the outside server is
/// closed before each and reopened after, the callbacks run in BLCR's
/// order, and the restarted copy finishes OK.
#[test]
fn callbacks_continue_then_restart() {
    let h = Harness::new("libcr-reconnect");
    let exe = check_program(&h);
    let server = LineServer::start();
    let port = server.port.to_string();
    let mut wl = h.spawn_program("libcr_check", &exe, &[], &["reconnect", &port]);
    wl.wait_ready();
    let pid = wl.pid();

    h.checkpoint(&h.image_dir("continued"), &[], pid)
        .assert_success("cr_checkpoint of a program using libcr");
    wl.wait_line("the callbacks' continue", |l| {
        l == "continued thread_rc=0 sig_rc=0 order=O<C<C>O>"
    });
    assert_running_untraced(pid, "after the checkpoint");

    let img = h.image_dir("img");
    h.checkpoint(&img, &["--kill"], pid)
        .assert_success("cr_checkpoint --kill");
    wl.reap_killed();
    let mut r = h.restore_bg(&img, pid);
    r.wait_line(&wl, "the callbacks' restart", |l| {
        l == "restarted thread_rc=1 sig_rc=1 order=O<C<C>O>O<C<C>O>"
    });
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restart of a program using libcr");
    assert_eq!(
        server.lines(),
        [
            "hello start",
            "hello continue",
            "hello restart",
            "hello final"
        ],
        "the server's view of the connections\n{}",
        wl.diag()
    );
    assert!(
        wl.output().lines().any(|l| l.starts_with(&format!(
            "restart info src={} node_changed=0 addresses_changed=0",
            img.display()
        ))),
        "restart info\n{}",
        wl.diag()
    );
}

/// A callback that never calls cr_checkpoint: the checkpoint fails after
/// --callback-timeout naming it, leaves no image, and the program runs on.
#[test]
fn hanging_callback_times_out_by_name() {
    let h = Harness::new("libcr-hang");
    let exe = check_program(&h);
    let mut wl = h.spawn_program("libcr_check", &exe, &[], &["hang"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    let t0 = Instant::now();
    let out = h.checkpoint(&img, &["--callback-timeout", "1s", "--cs-wait", "1s"], pid);
    out.assert_error(
        "checkpoint with a hanging callback",
        "cr_checkpoint:",
        &[
            "hang_cb",
            "thread context",
            "did not call cr_checkpoint",
            "1s",
        ],
    );
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "the timeout took {:?}",
        t0.elapsed()
    );
    assert!(!img.exists(), "a failed checkpoint left {}", img.display());
    assert_running_untraced(pid, "after a callback timed out");
    wl.go_and_expect_ok();
}

/// A callback that returns an error, then a signal-context callback that
/// cancels with its own code: each checkpoint fails naming the callback,
/// the program runs on, and the third checkpoint goes through.
#[test]
fn refusing_callbacks_fail_the_checkpoint_by_name() {
    let h = Harness::new("libcr-refuse");
    let exe = check_program(&h);
    let mut wl = h.spawn_program("libcr_check", &exe, &[], &["refuse"]);
    wl.wait_ready();
    let pid = wl.pid();
    h.checkpoint(&h.image_dir("one"), &[], pid).assert_error(
        "a callback returning -1",
        "cr_checkpoint:",
        &[&format!("process {pid}"), "refuse_cb", "returned -1"],
    );
    assert_running_untraced(pid, "after a refused checkpoint");
    h.checkpoint(&h.image_dir("two"), &[], pid).assert_error(
        "a signal-context callback cancelling",
        "cr_checkpoint:",
        &["sig_refuse_cb", "signal context", "TEMP_FAILURE"],
    );
    assert!(!h.image_dir("two").exists());
    h.checkpoint(&h.image_dir("three"), &[], pid)
        .assert_success("third checkpoint");
    wl.go_and_expect_ok();
}

/// Nested critical sections: a checkpoint fails after --cs-wait while
/// they are open; one that waits longer goes through once both are left
/// (cr_tryenter_cs is refused meanwhile); --cs-proceed goes through inside
/// one.
#[test]
fn critical_sections_delay_and_limit_checkpoints() {
    let h = Harness::new("libcr-cs");
    let exe = check_program(&h);
    let mut wl = h.spawn_program("libcr_check", &exe, &[], &["cs"]);
    wl.wait_ready();
    let pid = wl.pid();
    let pid_s = pid.to_string();

    h.checkpoint(&h.image_dir("one"), &["--cs-wait", "300ms"], pid)
        .assert_error(
            "checkpoint inside critical sections",
            "cr_checkpoint:",
            &["2 critical section(s) still open after 300 ms"],
        );
    wl.wait_line("tryenter refused", |l| l == "pending 1");
    wl.wait_line("the first checkpoint over", |l| l == "idle 1");

    let img = h.image_dir("two");
    let (mut ck, out, err, cmdline) = h.start_tool(
        &tool_path("cr_checkpoint"),
        &[
            OsStr::new("--dir"),
            img.as_os_str(),
            OsStr::new("--cs-wait"),
            OsStr::new("60s"),
            OsStr::new(&pid_s),
        ],
        &RunOpts::default(),
    );
    wl.wait_line("the second checkpoint pending", |l| l == "pending 2");
    touch(&wl.workdir.join("leave1"));
    // Still pending (status ACTIVE) with one section open, no callback yet.
    wl.wait_line("left1", |l| l.starts_with("left1"));
    assert!(
        wl.lines().iter().any(|l| l == "left1 status=2 callbacks=0"),
        "{}",
        wl.diag()
    );
    touch(&wl.workdir.join("leave2"));
    let st = ck
        .wait_exit(TOOL_TIMEOUT, || {
            format!("{cmdline}\n{}\n{}", read_text(&out), read_text(&err))
        })
        .expect("our child");
    assert!(
        st.success(),
        "{cmdline}: {}\n{}",
        status_str(Some(st)),
        read_text(&err)
    );

    touch(&wl.workdir.join("enter3"));
    wl.wait_line("entered again", |l| l == "entered again");
    h.checkpoint(
        &h.image_dir("three"),
        &["--cs-wait", "200ms", "--cs-proceed"],
        pid,
    )
    .assert_success("--cs-proceed inside a critical section");
    wl.go_and_expect_ok();
}

/// Runs an example (`reconnect ... 120`) against a line server through two
/// checkpoints; it must reconnect after each and get every answer.
fn run_example(h: &Harness, exe: &std::path::Path, args: &[&str], server: &LineServer) {
    let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    let (mut p, out, err, cmdline) = h.start_tool(exe, &args, &RunOpts::default());
    let diag = || format!("{cmdline}\n{}\n{}", read_text(&out), read_text(&err));
    wait_until(
        "the example to connect",
        Duration::from_secs(20),
        || read_text(&out).contains("connected"),
        diag,
    );
    for n in 1..=2 {
        let before = server.lines().len();
        h.checkpoint(&h.image_dir(&format!("ex{n}")), &[], p.pid)
            .assert_success("checkpoint of the example");
        wait_until(
            "the example to reconnect",
            Duration::from_secs(20),
            || {
                read_text(&out).matches("reconnected (continue)").count() == n
                    && server.lines().len() > before
            },
            diag,
        );
    }
    let st = p.wait_exit(EXIT_TIMEOUT, diag).expect("our child");
    assert!(st.success(), "{}", diag());
    assert_eq!(server.connections(), 3, "{}", diag());
    let want: Vec<String> = (1..=120).map(|i| i.to_string()).collect();
    assert_eq!(server.lines(), want, "{}", diag());
}

/// The C example builds with `cc -Iinclude prog.c -L... -lcr` and closes
/// and reopens its connection around checkpoints.
#[test]
fn c_example_reconnects_around_checkpoints() {
    let h = Harness::new("libcr-example-c");
    let exe = build_c(
        &repo_dir().join("libcr/examples/reconnect.c"),
        &h.dir,
        "reconnect",
    );
    let server = LineServer::start();
    let port = server.port.to_string();
    run_example(&h, &exe, &["127.0.0.1", &port, "120"], &server);
}

/// The Rust example (closures, a critical-section guard) does the same.
#[test]
fn rust_example_reconnects_around_checkpoints() {
    let h = Harness::new("libcr-example-rust");
    let exe = bin_dir().join("examples").join("reconnect");
    assert!(
        exe.is_file(),
        "{} missing: cargo build --workspace --all-targets",
        exe.display()
    );
    let server = LineServer::start();
    let addr = format!("127.0.0.1:{}", server.port);
    run_example(&h, &exe, &[&addr, "120"], &server);
}

/// A program asks the node's agent for a checkpoint of itself
/// (cr_request_checkpoint) and waits for it (cr_poll_checkpoint: > 0, its
/// callback sees 0); the copy restarted from that image gets
/// CR_ERESTARTED and its callback > 0. The program runs in the node's
/// namespaces, as the processes its agent serves.
#[test]
fn self_requested_checkpoint_through_the_agent() {
    let h = Harness::new("libcr-request");
    let exe = check_program(&h);
    let c = Cluster::new(&h, 1);
    c.start_agent_with(
        1,
        &AgentOpts {
            standalone: true,
            ..Default::default()
        },
    );
    let img = h.image_dir("requested");
    let work = h.dir.join("request-work");
    std::fs::create_dir_all(&work).expect("mkdir");
    let out = work.join("stdout.txt");
    let args: Vec<OsString> = vec![
        work.clone().into(),
        "request".into(),
        c.socket(1).into(),
        img.clone().into(),
    ];
    let mut sp = c.spawn_in(Some(c.ns(1)), "libcr_check", &exe, &args, &[], (&out, &out));
    let has = |what: &str| read_text(&out).lines().any(|l| l == what);
    wait_until("READY", LINE_TIMEOUT, || has("READY"), || sp.describe());
    touch(&work.join("ask"));
    wait_until(
        "the request's end",
        LINE_TIMEOUT,
        || read_text(&out).contains("request "),
        || sp.describe(),
    );
    assert!(has("request continued callback=0"), "{}", sp.describe());
    assert!(
        img.join("checkpoint.img").is_file(),
        "no image in {}",
        img.display()
    );
    touch(&work.join("go"));
    let st = sp.wait(EXIT_TIMEOUT, String::new);
    assert!(st.status.success() && has("OK"), "{}", st.show());
    std::fs::remove_file(work.join("go")).expect("rm go");

    let cr_restart = tool_path("cr_restart").display().to_string();
    c.run_on(1, &[&cr_restart, "--detach", &img.display().to_string()])
        .assert_success("cr_restart --detach of the requested image");
    wait_until(
        "the restarted copy's poll",
        LINE_TIMEOUT,
        || has("request restarted callback=1"),
        || read_text(&out),
    );
    touch(&work.join("go"));
    wait_until(
        "the restarted copy's verdict",
        EXIT_TIMEOUT,
        || read_text(&out).ends_with("request restarted callback=1\nOK\n"),
        || read_text(&out),
    );
}

/// No agent on the node: cr_request_checkpoint runs the standalone
/// cr_checkpoint (found next to libcr.so) on the program itself, as BLCR's
/// library did without a daemon; the program waits for it
/// (cr_poll_checkpoint > 0, its callback sees 0) and runs on; the copy
/// restarted from that image by cr_restart gets CR_ERESTARTED and its
/// callback > 0.
#[test]
fn self_requested_checkpoint_without_an_agent() {
    let h = Harness::new("libcr-request-standalone");
    let exe = check_program(&h);
    let img = h.image_dir("requested");
    // CR_AGENT_SOCKET names a socket nobody listens on.
    let no_agent = h.dir.join("no-agent.sock").display().to_string();
    let img_s = img.display().to_string();
    let mut wl = h.spawn_program("libcr_check", &exe, &[], &["request", &no_agent, &img_s]);
    wl.wait_ready();
    let pid = wl.pid();
    // The program's libcr socket, removed when it exits.
    let pidns = std::fs::metadata("/proc/self/ns/pid").expect("pidns").ino();
    let sock = cr_proto::coop::socket_path(Path::new(cr_proto::coop::DEFAULT_DIR), pidns, pid);
    assert!(sock.exists(), "no libcr socket {}", sock.display());
    touch(&wl.workdir.join("ask"));
    let line = wl.wait_line("the request's end", |l| {
        l.starts_with("request ") || l.starts_with("FAIL")
    });
    assert_eq!(line, "request continued callback=0", "{}", wl.diag());
    assert!(
        img.join("checkpoint.img").is_file(),
        "no image in {}\n{}",
        img.display(),
        wl.diag()
    );
    assert_running_untraced(pid, "after the checkpoint it asked for");
    wl.go_and_expect_ok();
    wl.remove_go();
    assert!(
        !sock.exists(),
        "{} left after the program's exit",
        sock.display()
    );

    let mut r = h.restore_bg(&img, pid);
    r.wait_line(&wl, "the restarted copy's poll", |l| {
        l == "request restarted callback=1"
    });
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restart from the image the program asked for");
}

/// A libcr program that forked a child without exec (the child holds the
/// parent's libcr socket, which only the parent serves; BLCR's "child" and
/// "mmaps" tests): a checkpoint that continues and one with --kill go
/// through (only the parent is asked; before the fix the checkpointer also
/// asked the child through the parent's socket and timed out: "libcr did
/// not answer"), and after the restart the parent's callback sees it and
/// its child runs on and exits 0.
#[test]
fn forked_child_without_exec_is_not_asked() {
    let h = Harness::new("libcr-forked");
    let exe = check_program(&h);
    let mut wl = h.spawn_program("libcr_check", &exe, &[], &["forked"]);
    wl.wait_ready();
    let pid = wl.pid();
    let limits = ["--callback-timeout", "3s", "--cs-wait", "1s"];
    h.checkpoint(&h.image_dir("continued"), &limits, pid)
        .assert_success("cr_checkpoint of a libcr program with a forked child");
    wl.wait_line("the continue callback", |l| l == "forked callback=0");
    assert_running_untraced(pid, "after the checkpoint");
    let img = h.image_dir("img");
    let mut args = limits.to_vec();
    args.push("--kill");
    h.checkpoint(&img, &args, pid)
        .assert_success("cr_checkpoint --kill");
    wl.reap_killed();
    let mut r = h.restore_bg(&img, pid);
    r.wait_line(&wl, "the restart callback", |l| l == "forked callback=1");
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restart of a libcr program with a forked child");
}

/// A signal queued to the process (sigqueue) while its main thread blocks
/// it stays pending for that thread, before and after a checkpoint and a
/// restart, and its handler runs there once unblocked, with its value
/// (BLCR's sigpending "sigqueue"). Before the fix libcr's own thread,
/// which blocked nothing, took it at once and ran the program's handler.
#[test]
fn process_signal_is_not_taken_by_the_libcr_thread() {
    let h = Harness::new("libcr-sigqueue");
    let exe = check_program(&h);
    let mut wl = h.spawn_program("libcr_check", &exe, &[], &["sigqueue"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    h.checkpoint(&img, &["--kill"], pid)
        .assert_success("cr_checkpoint --kill");
    wl.reap_killed();
    let mut r = h.restore_bg(&img, pid);
    // Back in its read of inotify (wait_file), as it was frozen.
    r.wait_blocked_in(&wl, &[0], Duration::from_secs(30));
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restart of a program with a queued signal");
}

/// A coordinated checkpoint runs every member's callbacks, on every node,
/// before it freezes any member: the callback of a member on n1 flushes
/// its connection to a member on n2 (sends "flush K" and needs the answer
/// before it lets the checkpoint go on, as a transport's "quiet and
/// flush" does), which only works while n2's member still runs. Three
/// checkpoints (one that continues, with --callback-timeout; one of the
/// whole job asked by the member on n1 itself, CR_SCOPE_JOB; one with
/// --kill) and a restart of the job; the members check every ping and
/// flush over their connection themselves and print OK.
///
/// The restart moves the member of n1 to n3 and holds n2's RELEASE (its
/// agent's fault point) after n3 let its member go: the restart callback
/// must not run before n2's member runs again (the job-wide barrier,
/// JOBBACK; the program FAILs if it runs while the test holds n2). It then
/// sees the new node and address (cr_get_restart_info: n1 → n3) and
/// reopens its connection to n2's member, which checks that it comes from
/// n3's address.
#[test]
fn coordinated_callbacks_all_run_before_any_member_is_frozen() {
    let h = Harness::new("libcr-coordinated");
    let exe = check_program(&h);
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    let faults = Faults::new(&h.dir);
    for k in 1..=3 {
        c.start_agent_with(
            k,
            &AgentOpts {
                env: if k == 2 {
                    faults.agent_env()
                } else {
                    Vec::new()
                },
                no_wait: true,
                ..Default::default()
            },
        );
    }
    c.wait_nodes_up(&[1, 2, 3]);
    let job = "flush";
    let work = |name: &str| {
        let d = h.dir.join(name);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    };
    let (w1, w2) = (work("flusher"), work("responder"));
    let port = "7411";
    let mut resp = c.run_member(
        job,
        2,
        "responder",
        &[
            exe.clone().into(),
            w2.into(),
            "responder".into(),
            port.into(),
        ],
    );
    let has = |sp: &cr_tests::cluster::Spawned, what: &str| {
        read_text(&sp.stdout).lines().any(|l| l == what)
    };
    wait_until(
        "the responder",
        LINE_TIMEOUT,
        || has(&resp, "READY"),
        || resp.describe(),
    );
    let mut flusher = c.run_member(
        job,
        1,
        "flusher",
        &[
            exe.into(),
            w1.clone().into(),
            "flusher".into(),
            node_ip(2).into(),
            port.into(),
        ],
    );
    let diag = |f: &cr_tests::cluster::Spawned, r: &cr_tests::cluster::Spawned| {
        format!("{}\n{}\n{}", f.describe(), r.describe(), c.diag())
    };
    wait_until(
        "the flusher",
        LINE_TIMEOUT,
        || has(&flusher, "READY"),
        || diag(&flusher, &resp),
    );
    // Both members known to the coordinator (an agent that has just
    // started registers its member a moment later).
    wait_until(
        "both members in the coordinator's job",
        LINE_TIMEOUT,
        || c.job_procs(job).iter().filter(|p| p.2).count() == 2,
        || diag(&flusher, &resp),
    );

    let info = c.crctl_json(&["checkpoint", job, "--callback-timeout", "20s"]);
    assert_eq!(jstr(&info, "state"), "committed", "{info:#}");
    eprintln!(
        "callbacks {} ms, then pause {} ms",
        ju64(&info, "callbacks_ms"),
        ju64(&info, "pause_ms")
    );
    wait_until(
        "the callback's continue",
        LINE_TIMEOUT,
        || has(&flusher, "callback 1 continued"),
        || diag(&flusher, &resp),
    );

    // A member asks for a checkpoint of its whole job (both nodes).
    touch(&w1.join("ask"));
    wait_until(
        "the job checkpoint asked by a member",
        LINE_TIMEOUT,
        || has(&flusher, "job request continued") && has(&flusher, "callback 2 continued"),
        || diag(&flusher, &resp),
    );
    let listed = c.crctl_json(&["checkpoints", job]);
    let first = jstr(&info, "id");
    assert!(
        jlist(&listed, "checkpoints")
            .iter()
            .any(|k| jstr(k, "id") != first
                && jstr(k, "state") == "committed"
                && jlist(k, "images").len() == 2),
        "a second checkpoint of both members: {listed:#}"
    );

    let id = jstr(&c.crctl_json(&["checkpoint", job, "--kill"]), "id");
    // Their cr_run end with them.
    for sp in [&mut flusher, &mut resp] {
        sp.wait(EXIT_TIMEOUT, String::new);
    }
    c.wait_members_gone(job);
    // n1's member goes to n3; n2's agent holds its RELEASE. While the
    // test holds it, WORKDIR/held tells the program that a member of its
    // job is still frozen.
    touch(&w1.join("held"));
    touch(&w1.join("moved"));
    std::fs::write(&faults.agent_ctl, "release").expect("arm the fault");
    let n3_log = c.agent_log(3);
    let released_before = read_text(&n3_log).matches("restored tree released").count();
    let held_before = read_text(&n3_log).matches("wait for JOBBACK").count();
    let mut restart = c.crctl_bg(&[
        "restart",
        job,
        "--checkpoint",
        &id,
        "--on",
        "n3",
        "--on",
        "n2",
    ]);
    wait_until(
        "n2 held at RELEASE, n3's member released and its restart callbacks held for JOBBACK",
        LINE_TIMEOUT,
        || {
            let log = read_text(&n3_log);
            faults.agent_reached.exists()
                && log.matches("restored tree released").count() > released_before
                && log.matches("wait for JOBBACK").count() > held_before
        },
        || format!("{}\n{}", restart.describe(), diag(&flusher, &resp)),
    );
    // Without the job-wide barrier n3's agent tells its member at its own
    // release (no JOBBACK wait is logged, and the wait above times out);
    // with it, the callback has not run while n2 is held.
    assert!(
        !has(&flusher, "callback 3 restarted"),
        "the restart callback ran while n2's member was frozen\n{}",
        diag(&flusher, &resp)
    );
    std::fs::remove_file(w1.join("held")).expect("rm held");
    std::fs::write(&faults.agent_ctl, "").expect("disarm the fault");
    std::fs::remove_file(&faults.agent_reached).expect("let n2 go on");
    restart
        .wait(CRCTL_TIMEOUT, || diag(&flusher, &resp))
        .assert_success("crctl restart of the job, n1's member on n3");
    // The restored members write on into the same files.
    wait_until(
        "the callback's restart",
        LINE_TIMEOUT,
        || has(&flusher, "callback 3 restarted"),
        || diag(&flusher, &resp),
    );
    let f = read_text(&flusher.stdout);
    assert!(
        f.lines().any(|l| l.starts_with("moved from n1 (10.99.0.1")
            && l.contains("to n3 (10.99.0.3")
            && l.ends_with("node_changed=1 addresses_changed=1")),
        "the restart callback did not see the new node and address\n{}",
        diag(&flusher, &resp)
    );
    assert!(
        has(&resp, "reopened from 10.99.0.3 (says 10.99.0.3)"),
        "{}",
        diag(&flusher, &resp)
    );
    touch(&w1.join("go"));
    wait_until(
        "both verdicts",
        EXIT_TIMEOUT,
        || {
            let (f, r) = (read_text(&flusher.stdout), read_text(&resp.stdout));
            (f.contains("\nOK\n") || f.contains("FAIL"))
                && (r.contains("\nOK\n") || r.contains("FAIL"))
        },
        || diag(&flusher, &resp),
    );
    assert!(
        has(&flusher, "OK") && has(&resp, "OK"),
        "{}",
        diag(&flusher, &resp)
    );
}
