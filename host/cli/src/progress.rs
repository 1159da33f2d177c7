//! Progress bars for the command's long work (`check`, `replay-trace`, `report`).
//!
//! indicatif's stderr target draws nothing when stderr is not a terminal, so piped and
//! captured output (CI, `--json | jq`) stays exactly the report.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use allocbox_check as check;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a bar is redrawn from a counter another thread advances.
const TICK: Duration = Duration::from_millis(100);

fn bar(len: u64, template: &str, prefix: &str) -> ProgressBar {
    let style = ProgressStyle::with_template(template)
        .expect("the templates here are valid")
        .progress_chars("=> ");
    ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
        .with_style(style)
        .with_prefix(prefix.to_string())
}

/// Runs `work`, which advances `done` up to `len` events, under a bar showing events
/// per second and the time left.
pub fn counting_events<R>(prefix: &str, len: u64, done: &AtomicU64, work: impl FnOnce() -> R) -> R {
    let bar = bar(
        len,
        "{prefix} [{bar:30}] {human_pos}/{human_len} events, {msg}, {eta} left",
        prefix,
    );
    drawn_while(&bar, work, |bar| {
        let now = done.load(Ordering::Relaxed).min(len);
        bar.set_position(now);
        let rate = now as f64 / bar.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!("{:.1} M/s", rate / 1e6));
    })
}

/// Runs `work` while another thread calls `update` on `bar` every [`TICK`]; the bar is
/// cleared at the end. A hidden bar (standard error is no terminal) costs nothing.
fn drawn_while<R>(
    bar: &ProgressBar,
    work: impl FnOnce() -> R,
    update: impl Fn(&ProgressBar) + Sync,
) -> R {
    if bar.is_hidden() {
        return work();
    }
    let finished = AtomicBool::new(false);
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            while !finished.load(Ordering::Relaxed) {
                update(bar);
                std::thread::sleep(TICK);
            }
        });
        let result = work();
        finished.store(true, Ordering::Relaxed);
        result
    });
    bar.finish_and_clear();
    result
}

/// Runs `work`, which advances `done` through a count not known before (a trace's
/// events, read), under a spinner showing the count.
pub fn counting_unknown<R>(message: &str, done: &AtomicU64, work: impl FnOnce() -> R) -> R {
    let spinner = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
        .with_style(
            ProgressStyle::with_template("{spinner} {msg}: {human_pos} events ({elapsed})")
                .expect("the templates here are valid"),
        )
        .with_message(message.to_string());
    drawn_while(&spinner, work, |spinner| {
        spinner.set_position(done.load(Ordering::Relaxed));
        spinner.tick();
    })
}

/// Runs `work` under a spinner saying what it does (for work with no count to show).
pub fn spinning<R>(message: &str, work: impl FnOnce() -> R) -> R {
    let spinner = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
        .with_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .expect("the templates here are valid"),
        )
        .with_message(message.to_string());
    spinner.enable_steady_tick(TICK);
    let result = work();
    spinner.finish_and_clear();
    result
}

/// A bar for one policy's `check`: over its time budget (and the time it has left,
/// which is known), or its number of cases (and how many ran: an estimate of the time
/// left from the first cases, which include compiling, was off by twenty times), with
/// cases, operations and operations per second. `None` when stderr is not a terminal.
pub fn check_progress(prefix: &str, options: &check::CheckOptions) -> Option<CheckBar> {
    let (len, unit) = match options.time {
        Some(time) => (time.as_millis() as u64, Unit::Millis),
        None => (u64::from(options.cases), Unit::Cases),
    };
    let bar = bar(len.max(1), "{prefix} [{bar:30}] {msg}", prefix);
    (!bar.is_hidden()).then_some(CheckBar { bar, unit })
}

enum Unit {
    Millis,
    Cases,
}

pub struct CheckBar {
    bar: ProgressBar,
    unit: Unit,
}

impl CheckBar {
    /// The callback `check` calls as it goes.
    pub fn callback(&self) -> Arc<check::ProgressFn> {
        let bar = self.bar.clone();
        let by_time = matches!(self.unit, Unit::Millis);
        Arc::new(move |p: &check::Progress| {
            let rate = p.ops as f64 / p.elapsed.as_secs_f64().max(1e-9);
            let done = match by_time {
                true => {
                    bar.set_position(p.elapsed.as_millis() as u64);
                    let left = bar.length().unwrap_or(0).saturating_sub(bar.position());
                    format!("{} cases, {:.0} s left", p.cases, left as f64 / 1000.0)
                }
                false => {
                    bar.set_position(p.cases);
                    format!("{}/{} cases", p.cases, bar.length().unwrap_or(0))
                }
            };
            bar.set_message(format!("{done}, {} ops, {rate:.0} ops/s", p.ops));
        })
    }

    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}
