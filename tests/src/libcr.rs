//! Programs using libcr (`include/libcr.h`, `libcr.so` of the workspace):
//! compiled with `cc` at test time, and a TCP server outside their tree
//! that they close and reopen connections to around checkpoints.

use crate::bin_dir;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

/// The repository's top directory.
pub fn repo_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the repository")
        .to_path_buf()
}

/// Compile C program `src` with `cc -Iinclude ... -lcr` (against the
/// libcr.so built next to the test binaries) into `dir/name`; linked with
/// -rdynamic so that libcr's messages name its callbacks.
pub fn build_c(src: &Path, dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(name);
    let lib = bin_dir();
    assert!(
        lib.join("libcr.so").is_file(),
        "{} missing: build the workspace first (cargo build --workspace)",
        lib.join("libcr.so").display()
    );
    let st = Command::new("cc")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-I")
        .arg(repo_dir().join("include"))
        .arg("-o")
        .arg(&out)
        .arg(src)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lcr", "-rdynamic", "-pthread"])
        .status()
        .unwrap_or_else(|e| panic!("run cc (tests/run.sh installs gcc): {e}"));
    assert!(st.success(), "cc {} failed: {st}", src.display());
    out
}

/// A line server on 127.0.0.1: answers `hello X` with `ack X` and any
/// other line with itself; remembers every line and how many connections
/// it accepted. Runs until the test process ends.
pub struct LineServer {
    pub port: u16,
    lines: Arc<Mutex<Vec<String>>>,
    conns: Arc<Mutex<usize>>,
}

impl LineServer {
    pub fn start() -> LineServer {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = l.local_addr().expect("local addr").port();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let conns = Arc::new(Mutex::new(0));
        let (ls, cs) = (lines.clone(), conns.clone());
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                *cs.lock().unwrap() += 1;
                let ls = ls.clone();
                std::thread::spawn(move || serve(c, ls));
            }
        });
        LineServer { port, lines, conns }
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    pub fn connections(&self) -> usize {
        *self.conns.lock().unwrap()
    }
}

fn serve(c: TcpStream, lines: Arc<Mutex<Vec<String>>>) {
    let mut w = c.try_clone().expect("clone stream");
    for line in BufReader::new(c).lines() {
        let Ok(line) = line else { return };
        let answer = match line.strip_prefix("hello ") {
            Some(x) => format!("ack {x}\n"),
            None => format!("{line}\n"),
        };
        lines.lock().unwrap().push(line);
        if w.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}
