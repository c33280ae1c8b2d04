//! Progress bars for long copies, shown only when stderr is a terminal.

use std::io::IsTerminal;

/// A byte progress bar on stderr, or `None` when not wanted or not a terminal.
pub fn bar(enabled: bool, total: u64, message: &'static str) -> Option<indicatif::ProgressBar> {
    if !enabled || !std::io::stderr().is_terminal() {
        return None;
    }
    let b = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr(),
    );
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} {bar:40} {bytes}/{total_bytes} ({bytes_per_sec})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b.set_message(message);
    Some(b)
}
