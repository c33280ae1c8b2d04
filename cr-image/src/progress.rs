//! Progress of long copies: a bar on a terminal (bytes, rate, time left),
//! or JSON lines on stdout for programs (`--json`), or nothing.

use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How progress is shown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Progress {
    #[default]
    Off,
    /// A bar on stderr (only when it is a terminal).
    Bar,
    /// `{"progress": {...}}` lines on stdout, at most four a second.
    Json,
}

/// One phase being shown (see [`Progress::start`]).
pub struct Ticker {
    inner: Inner,
}

enum Inner {
    Off,
    Bar(indicatif::ProgressBar),
    Json(JsonTicker),
}

struct JsonTicker {
    phase: &'static str,
    total: u64,
    t0: Instant,
    last: Mutex<Instant>,
    done: AtomicU64,
}

/// Time between two JSON progress lines.
const JSON_EVERY: Duration = Duration::from_millis(250);

#[derive(Serialize)]
struct Line<'a> {
    progress: Fields<'a>,
}

#[derive(Serialize)]
struct Fields<'a> {
    phase: &'a str,
    bytes: u64,
    total: u64,
    bytes_per_sec: u64,
    /// Seconds left at the current rate (None until something moved).
    eta_secs: Option<f64>,
}

impl Progress {
    /// Start showing phase `phase` of `total` bytes.
    pub fn start(self, phase: &'static str, total: u64) -> Ticker {
        let inner = match self {
            Progress::Bar if std::io::stderr().is_terminal() => {
                let b = indicatif::ProgressBar::with_draw_target(
                    Some(total),
                    indicatif::ProgressDrawTarget::stderr(),
                );
                b.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{msg} {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, {eta} left)",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                b.set_message(phase);
                Inner::Bar(b)
            }
            Progress::Json => Inner::Json(JsonTicker {
                phase,
                total,
                t0: Instant::now(),
                last: Mutex::new(Instant::now()),
                done: AtomicU64::new(0),
            }),
            _ => Inner::Off,
        };
        Ticker { inner }
    }
}

impl Ticker {
    /// `done` bytes of the phase are done (callable from any thread).
    pub fn set(&self, done: u64) {
        match &self.inner {
            Inner::Off => {}
            Inner::Bar(b) => b.set_position(done),
            Inner::Json(j) => {
                j.done.fetch_max(done, Ordering::Relaxed);
                let mut last = j.last.lock().unwrap_or_else(|p| p.into_inner());
                if last.elapsed() >= JSON_EVERY {
                    *last = Instant::now();
                    j.emit();
                }
            }
        }
    }

    /// The phase is over.
    pub fn finish(self) {
        match self.inner {
            Inner::Off => {}
            Inner::Bar(b) => b.finish_and_clear(),
            Inner::Json(j) => {
                j.done.store(j.total, Ordering::Relaxed);
                j.emit();
            }
        }
    }
}

impl JsonTicker {
    fn emit(&self) {
        let done = self.done.load(Ordering::Relaxed);
        let secs = self.t0.elapsed().as_secs_f64();
        let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
        let line = Line {
            progress: Fields {
                phase: self.phase,
                bytes: done,
                total: self.total,
                bytes_per_sec: rate as u64,
                eta_secs: (rate > 0.0)
                    .then(|| (self.total.saturating_sub(done)) as f64 / rate)
                    .map(|s| (s * 1000.0).round() / 1000.0),
            },
        };
        if let Ok(text) = serde_json::to_string(&line) {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{text}");
            let _ = out.flush();
        }
    }
}
