//! PostgreSQL 15 (Debian's postgresql-15), started the way its users start
//! it (initdb, then pg_ctl as user postgres; under cr_run, postgres in the
//! foreground as user postgres), under a pgbench load over TCP from
//! outside the tree: a checkpoint that lets it run on, then a checkpoint
//! --kill and a restore, after which pgbench finishes without a failed
//! transaction and PostgreSQL's own checks pass: the TPC-B sums agree,
//! there is one history row per transaction pgbench counted, amcheck finds
//! every B-tree index sound, and pg_dump reads everything.
//!
//! PostgreSQL keeps a System V shared memory segment (attached by every
//! process), its main shared memory (anonymous, shared across fork) and
//! dynamic shared memory in /dev/shm (a private one under cr_run, saved in
//! the image). One cluster, made once per test run (initdb and pgbench -i)
//! and copied by each test, keeps the set-up short.

use cr_tests::*;
use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = "/usr/lib/postgresql/15/bin";
/// Seconds of pgbench load (the checkpoints and the restore fall inside).
const LOAD_SECS: &str = "20";

fn bin(name: &str) -> PathBuf {
    let p = Path::new(BIN).join(name);
    assert!(
        p.is_file(),
        "{} is missing: install postgresql-15 (tests/run.sh does)",
        p.display()
    );
    p
}

/// uid and gid of user postgres.
fn postgres_ids() -> (u32, u32) {
    let text = read_text(Path::new("/etc/passwd"));
    let f: Vec<&str> = text
        .lines()
        .find(|l| l.starts_with("postgres:"))
        .expect("user postgres (made by the postgresql-15 package)")
        .split(':')
        .collect();
    (f[2].parse().expect("uid"), f[3].parse().expect("gid"))
}

fn as_postgres() -> RunOpts {
    RunOpts {
        as_user: Some(postgres_ids()),
        ..RunOpts::default()
    }
}

fn chown_postgres(p: &Path) {
    let (u, g) = postgres_ids();
    std::os::unix::fs::chown(p, Some(u), Some(g))
        .unwrap_or_else(|e| panic!("chown {}: {e}", p.display()));
}

/// The cluster every test copies: initdb, then pgbench -i -s 1, made once
/// per test run (under a lock: tests run in parallel processes).
fn template(h: &Harness) -> PathBuf {
    let base = std::env::temp_dir().join("cr-tests").join("pg15-template");
    std::fs::create_dir_all(base.parent().expect("parent")).expect("mkdir");
    let lock = std::fs::File::create(base.with_extension("lock")).expect("lock file");
    // SAFETY: flock on an fd we own; released when it is closed.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let data = base.join("data");
    if base.join("ready").exists() {
        return data;
    }
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("mkdir template");
    chown_postgres(&base);
    h.run_tool(
        "initdb",
        &[
            "-D".as_ref(),
            data.as_os_str(),
            "-A".as_ref(),
            "trust".as_ref(),
            "-U".as_ref(),
            "postgres".as_ref(),
            "--no-sync".as_ref(),
        ],
        &RunOpts {
            exe: Some(bin("initdb")),
            ..as_postgres()
        },
    )
    .assert_success("initdb");
    let pg = Pg {
        data: data.clone(),
        sock: base.clone(),
        port: free_port(),
    };
    pg.ctl(h, "start");
    pg.tool(h, "pgbench", &["-i", "-s", "1", "postgres"])
        .assert_success("pgbench -i");
    pg.ctl(h, "stop");
    touch(&base.join("ready"));
    data
}

/// One PostgreSQL server of a test.
struct Pg {
    data: PathBuf,
    sock: PathBuf,
    port: u16,
}

impl Pg {
    /// A copy of the template cluster in the harness directory.
    fn new(h: &Harness) -> Pg {
        let tpl = template(h);
        let data = h.dir.join("data");
        let st = Command::new("cp")
            .arg("-a")
            .arg(&tpl)
            .arg(&data)
            .status()
            .expect("cp");
        assert!(st.success(), "cp -a {} {}", tpl.display(), data.display());
        let sock = h.dir.join("sock");
        std::fs::create_dir(&sock).expect("mkdir sock");
        chown_postgres(&sock);
        Pg {
            data,
            sock,
            port: free_port(),
        }
    }

    /// The server's command line options.
    fn opts(&self) -> String {
        format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1",
            self.port,
            self.sock.display()
        )
    }

    /// pg_ctl start (-w: until it accepts connections) or stop (-m fast).
    fn ctl(&self, h: &Harness, what: &str) -> ToolOutput {
        let log = self.sock.join("postgres.log");
        let opts = self.opts();
        let mut args: Vec<&OsStr> = vec!["-D".as_ref(), self.data.as_os_str(), "-w".as_ref()];
        if what == "start" {
            args.extend([
                OsStr::new("-l"),
                log.as_os_str(),
                OsStr::new("-o"),
                OsStr::new(&opts),
            ]);
        } else {
            args.extend([OsStr::new("-m"), OsStr::new("fast")]);
        }
        args.push(what.as_ref());
        let out = h.run_tool(
            "pg_ctl",
            &args,
            &RunOpts {
                exe: Some(bin("pg_ctl")),
                ..as_postgres()
            },
        );
        out.assert_success(&format!("pg_ctl {what}\n{}", read_text(&log)));
        out
    }

    /// A client program of PostgreSQL against this server, over TCP.
    fn tool(&self, h: &Harness, name: &str, args: &[&str]) -> ToolOutput {
        let port = self.port.to_string();
        let mut a: Vec<&OsStr> = ["-h", "127.0.0.1", "-p", &port, "-U", "postgres"]
            .into_iter()
            .map(OsStr::new)
            .collect();
        a.extend(args.iter().map(OsStr::new));
        h.run_tool(
            name,
            &a,
            &RunOpts {
                exe: Some(bin(name)),
                ..RunOpts::default()
            },
        )
    }

    /// One value of a query.
    fn query(&self, h: &Harness, sql: &str) -> String {
        let out = self.tool(
            h,
            "psql",
            &["-XAtq", "-v", "ON_ERROR_STOP=1", "-c", sql, "postgres"],
        );
        out.assert_success(&format!("psql -c {sql:?}"));
        out.stdout.trim().to_string()
    }

    fn ready(&self, h: &Harness) -> bool {
        self.tool(h, "pg_isready", &["-q"]).status.success()
    }

    /// The postmaster's pid as postmaster.pid says (the first line).
    fn postmaster(&self) -> i32 {
        read_text(&self.data.join("postmaster.pid"))
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .expect("postmaster.pid")
    }
}

/// pgbench of LOAD_SECS seconds with 4 clients, in the background.
struct Bench {
    proc: Proc,
    out: PathBuf,
    err: PathBuf,
}

impl Bench {
    fn start(h: &Harness, pg: &Pg) -> Bench {
        let port = pg.port.to_string();
        let args: Vec<&OsStr> = [
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "postgres",
            "-c",
            "4",
            "-j",
            "2",
            "-T",
            LOAD_SECS,
            "-P",
            "1",
            "postgres",
        ]
        .into_iter()
        .map(OsStr::new)
        .collect();
        let (proc, out, err, _) = h.start_tool(&bin("pgbench"), &args, &RunOpts::default());
        Bench { proc, out, err }
    }

    /// Progress lines that counted transactions.
    fn busy_seconds(&self) -> usize {
        read_text(&self.err)
            .lines()
            .filter(|l| l.starts_with("progress:") && !l.contains(" 0.0 tps"))
            .count()
    }

    fn diag(&self) -> String {
        format!(
            "--- pgbench stdout:\n{}\n--- pgbench stderr:\n{}",
            read_text(&self.out),
            tail(&read_text(&self.err), 15)
        )
    }

    /// Wait until pgbench counted transactions in `n` more seconds.
    fn wait_busy(&mut self, n: usize) {
        let from = self.busy_seconds();
        wait_until(
            "pgbench transactions",
            Duration::from_secs(60),
            || self.busy_seconds() >= from + n,
            || self.diag(),
        );
    }

    /// pgbench ended well: the number of transactions it made.
    fn finish(mut self) -> u64 {
        let (out, err) = (self.out.clone(), self.err.clone());
        let st = self
            .proc
            .wait_exit(Duration::from_secs(120), || files_diag(&out, &err))
            .expect("pgbench is our child");
        let out = read_text(&self.out);
        assert!(
            st.success() && out.contains("number of failed transactions: 0 "),
            "pgbench ({}) did not finish cleanly\n{}",
            status_str(Some(st)),
            self.diag()
        );
        out.lines()
            .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no transaction count\n{}", self.diag()))
    }
}

/// PostgreSQL's own checks after the restore, `done` being the
/// transactions pgbench counted.
fn check_database(h: &Harness, pg: &Pg, done: u64) {
    let sums = pg.query(
        h,
        "select (select sum(abalance) from pgbench_accounts) = (select sum(delta) from pgbench_history), \
                (select sum(tbalance) from pgbench_tellers) = (select sum(delta) from pgbench_history), \
                (select sum(bbalance) from pgbench_branches) = (select sum(delta) from pgbench_history), \
                (select count(*) from pgbench_history)",
    );
    assert_eq!(
        sums,
        format!("t|t|t|{done}"),
        "the TPC-B sums agree and there is one history row per transaction pgbench made"
    );
    pg.query(h, "create extension if not exists amcheck");
    let checked = pg.query(
        h,
        "select count(bt_index_check(c.oid, true)) from pg_index i \
         join pg_class c on c.oid = i.indexrelid join pg_am a on a.oid = c.relam \
         where a.amname = 'btree' and c.relpersistence != 't'",
    );
    assert!(
        checked.parse::<u64>().is_ok_and(|n| n > 100),
        "amcheck checked {checked} indexes"
    );
    let dump = pg.tool(h, "pg_dump", &["postgres"]);
    dump.assert_success("pg_dump");
    assert!(
        dump.stdout.contains("COPY public.pgbench_accounts"),
        "pg_dump dumped the tables"
    );
}

#[test]
fn postgres_under_pgbench_survives_checkpoints_and_a_restore() {
    let h = Harness::new("pg-plain");
    let pg = Pg::new(&h);
    pg.ctl(&h, "start");
    let pid = pg.postmaster();
    let mut bench = Bench::start(&h, &pg);
    bench.wait_busy(2);

    // The tree runs on, and keeps serving.
    h.checkpoint(&h.image_dir("img-continue"), &[], pid)
        .assert_success("cr_checkpoint (continue) of PostgreSQL");
    assert_running_untraced(pid, "PostgreSQL after the checkpoint");
    bench.wait_busy(2);

    let img = h.image_dir("img");
    h.checkpoint(&img, &["--kill"], pid)
        .assert_success("cr_checkpoint --kill of PostgreSQL");
    wait_until(
        "the killed postmaster to be gone",
        Duration::from_secs(20),
        || {
            reap_orphans();
            !Path::new(&format!("/proc/{pid}")).exists()
        },
        || describe(pid),
    );
    let mut r = h.restore_bg(&img, pid);
    let done = bench.finish();
    check_database(&h, &pg, done);
    pg.ctl(&h, "stop");
    let out = r.wait_plain(Duration::from_secs(60));
    out.assert_success("cr_restart (PostgreSQL stopped by pg_ctl)");
}

#[test]
fn postgres_under_cr_run_survives_checkpoints_and_a_restore() {
    let h = Harness::new("pg-cr-run");
    let pg = Pg::new(&h);
    let job_dir = h.image_dir("job");
    let opts = pg.opts();
    let mut args: Vec<&OsStr> = vec![
        "--dir".as_ref(),
        job_dir.as_os_str(),
        "--".as_ref(),
        "/usr/bin/setpriv".as_ref(),
        "--reuid=postgres".as_ref(),
        "--regid=postgres".as_ref(),
        "--init-groups".as_ref(),
        "--".as_ref(),
    ];
    let postgres = bin("postgres");
    args.push(postgres.as_os_str());
    args.extend([OsStr::new("-D"), pg.data.as_os_str()]);
    args.extend(opts.split(' ').map(OsStr::new));
    let (mut cr_run, _, job_err, _) =
        h.start_tool(&tool_path("cr_run"), &args, &RunOpts::default());
    let t0 = Instant::now();
    while !pg.ready(&h) {
        assert!(
            t0.elapsed() < Duration::from_secs(60) && !cr_run.has_exited(),
            "PostgreSQL under cr_run did not start\n{}",
            read_text(&job_err)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut bench = Bench::start(&h, &pg);
    bench.wait_busy(2);

    // Through cr_run's pid, into the job's directory.
    h.run_tool(
        "cr_checkpoint",
        &[OsStr::new(&cr_run.pid.to_string())],
        &RunOpts::default(),
    )
    .assert_success("cr_checkpoint (continue) of the job");
    assert!(
        job_dir.join("checkpoint.img").exists(),
        "image in the job's --dir"
    );
    bench.wait_busy(2);

    let img = h.image_dir("img");
    h.checkpoint(&img, &["--kill"], cr_run.pid)
        .assert_success("cr_checkpoint --kill of the job");
    let st = cr_run
        .wait_exit(Duration::from_secs(20), || read_text(&job_err))
        .expect("cr_run is our child");
    assert_eq!(
        st.code(),
        Some(128 + libc::SIGKILL),
        "cr_run reports the kill"
    );

    let mut r = h.restore_job(&img);
    let done = bench.finish();
    check_database(&h, &pg, done);
    // pg_ctl cannot signal PID 1 of another PID namespace: SIGINT (a fast
    // shutdown) to the job's root, cr_restart's child.
    let root = r.wait_running(&postgres, &String::new);
    kill_process(root, libc::SIGINT);
    let st = r.wait(Duration::from_secs(60), &String::new);
    assert_eq!(
        st.code(),
        Some(0),
        "the restored PostgreSQL stopped cleanly\n{}",
        r.diag()
    );
}

/// kill(2) of a process this test restored.
fn kill_process(pid: i32, sig: i32) {
    // SAFETY: kill(2) of the restored job's root, our cr_restart's child.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid}");
}

impl Drop for Pg {
    /// A server of a failed test goes (pg_ctl finds it by its data
    /// directory; a job's PID 1 dies with its cr_run or KillOnDrop).
    fn drop(&mut self) {
        let _ = Command::new(bin("pg_ctl"))
            .args([
                OsStr::new("-D"),
                self.data.as_os_str(),
                OsStr::new("-m"),
                OsStr::new("immediate"),
                OsStr::new("stop"),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .uid(postgres_ids().0)
            .gid(postgres_ids().1)
            .status();
    }
}
