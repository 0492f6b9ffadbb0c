//! A log's runs of failures, as the process appending to it sees them, and the
//! `audit_resumed` record that puts each one in the log itself.
//!
//! A run begins with an append (or a flush) that fails and ends with the first one durable
//! after it. What this module guarantees:
//!
//! - [`failing`] says whether the log's latest append failed: the run's latest error and the
//!   time of its first failure (`health()`'s `ok`, `error`, `since`).
//! - Every run that ends gets an `audit_resumed` record (`failing_since`, `last_error`) of
//!   its own, appended on a thread of its own once the log takes records again: the log
//!   says when it was failing and why, whichever record ended the run (a command's receipt,
//!   or the record itself). One such thread at a time, so a hung disk holds one thread, not
//!   one per call.
//! - Runs that end while that thread is busy wait their turn in order (before the
//!   twenty-fourth session a second run ending then was dropped: the log never said it had
//!   failed). A run is never in line twice, nor in line while its record is being appended.
//!   A record that could not be appended keeps its place at the head of the line and is
//!   tried again first. Its line may be in the file all the same (a failed flush leaves
//!   it): at least once, then, not exactly once.
//! - At most [`MAX_WAITING`] runs wait; past that the newest is merged into the last one in
//!   line (its start kept, the later error taken), so the records still cover the whole span.
//! - [`at_heartbeat`] retries what no append is left to start: the run under way once
//!   [`RETRY_AFTER`] has passed since its latest failure (an idle process says `ok` again
//!   without waiting for a command's record), and runs left waiting with no thread
//!   (one could not be started).
//! - [`drain`] lets a short-lived command wait, bounded, for the records in line before it
//!   exits (the thread is not joined otherwise).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use super::{timestamp, try_record_to, AuditError, AuditLog};

/// How long the log's latest failure must be past before [`at_heartbeat`] tries it again:
/// while commands come, their own records try it.
pub(super) const RETRY_AFTER: Duration = Duration::from_secs(10);

/// The most runs waiting for their record while one is being appended.
pub(super) const MAX_WAITING: usize = 64;

/// One log's runs of failures (a field of [`AuditLog`]). Lock order: `resuming` before
/// `failing` (never the other way: [`note`] lets `failing` go before it takes `resuming`).
#[derive(Debug, Default)]
pub(super) struct Outages {
    /// The run under way, if the latest append failed.
    failing: Mutex<Option<Failing>>,
    /// The ended runs whose `audit_resumed` is not in the log yet.
    resuming: Mutex<Resuming>,
}

/// The run of failures under way.
#[derive(Debug, Clone)]
pub(super) struct Failing {
    /// The latest failure's error.
    pub error: String,
    /// When the first failure of the run was ([`timestamp`]).
    pub since: String,
    /// When the latest failure was.
    pub latest: Instant,
}

/// A run to put in the log: `failing_since` and `last_error` of its `audit_resumed`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    since: String,
    error: String,
}

#[derive(Debug, Default)]
struct Resuming {
    /// A thread is appending the records of `waiting` (set and cleared under this lock,
    /// with the line's last change: a run put in line while it is set is the thread's).
    busy: bool,
    /// The run whose record the thread is appending now (its `since`).
    in_flight: Option<String>,
    /// Oldest first; one entry for each `since`.
    waiting: VecDeque<Run>,
}

/// The run under way on `log`, if its latest append failed.
pub(super) fn failing(log: &AuditLog) -> Option<Failing> {
    log.outages.failing.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

/// An append's outcome on `log`. A failure begins a run or is its latest. A durable append
/// that `began` after the run's latest failure ends it, and the run's record is put in
/// line; one that began before it (a slow success, its flush waited for) ends nothing — it
/// must not hide a later append's failure.
pub(super) fn note(log: &Arc<AuditLog>, outcome: Result<(), &AuditError>, began: Instant) {
    let mut failing = log.outages.failing.lock().unwrap_or_else(PoisonError::into_inner);
    let ended = match outcome {
        Ok(()) if failing.as_ref().is_some_and(|f| f.latest > began) => return,
        Ok(()) => failing.take(),
        Err(e) => {
            let since = failing.take().map_or_else(|| timestamp(SystemTime::now()), |f| f.since);
            *failing = Some(Failing { error: e.to_string(), since, latest: Instant::now() });
            None
        }
    };
    drop(failing);
    let Some(ended) = ended else { return };
    let mut resuming = log.outages.resuming.lock().unwrap_or_else(PoisonError::into_inner);
    wait_in_line(&mut resuming, Run { since: ended.since, error: ended.error });
    if !resuming.busy && !resuming.waiting.is_empty() {
        start(log, resuming);
    }
}

/// At a heartbeat (`health()`), with no thread busy: put the run under way in line when
/// [`RETRY_AFTER`] has passed since its latest failure — its record, durable, ends it — and
/// start the thread for whatever waits, unless the log failed within [`RETRY_AFTER`].
pub(super) fn at_heartbeat(log: &Arc<AuditLog>) {
    let mut resuming = log.outages.resuming.lock().unwrap_or_else(PoisonError::into_inner);
    if resuming.busy {
        return;
    }
    // Read under `resuming`: a run that ended since the caller looked is not put back.
    let under_way = failing(log);
    if under_way.as_ref().is_some_and(|run| run.latest.elapsed() < RETRY_AFTER) {
        return;
    }
    if let Some(run) = under_way {
        wait_in_line(&mut resuming, Run { since: run.since, error: run.error });
    }
    if !resuming.waiting.is_empty() {
        start(log, resuming);
    }
}

/// Wait, at most `max`, until no record is in line or being appended: a command's process
/// exits without joining the thread.
pub(super) fn drain(log: &AuditLog, max: Duration) {
    let deadline = Instant::now() + max;
    loop {
        // Not busy: nothing is in line, or what is waits for the log (or a thread).
        let idle = !log.outages.resuming.lock().unwrap_or_else(PoisonError::into_inner).busy;
        if idle || Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `run` joins the line: nothing when its record is being appended now, in place of an
/// entry of the same run (its latest error now), else last — merged into the last when
/// [`MAX_WAITING`] wait already.
fn wait_in_line(resuming: &mut Resuming, run: Run) {
    if resuming.in_flight.as_deref() == Some(run.since.as_str()) {
        return;
    }
    let waiting = &mut resuming.waiting;
    if let Some(same) = waiting.iter_mut().find(|w| w.since == run.since) {
        same.error = run.error;
    } else if waiting.len() >= MAX_WAITING {
        if let Some(last) = waiting.back_mut() {
            last.error = run.error;
        }
    } else {
        waiting.push_back(run);
    }
}

/// Start the thread that appends the waiting records (`resuming` is locked, not busy).
fn start(log: &Arc<AuditLog>, mut resuming: MutexGuard<'_, Resuming>) {
    resuming.busy = true;
    drop(resuming);
    let for_thread = log.clone();
    let spawned = std::thread::Builder::new().name("audit-retry".into()).spawn(move || append_waiting(&for_thread));
    if let Err(e) = spawned {
        // The runs stay in line: the next run that ends, or the next heartbeat, starts the
        // thread again.
        log.outages.resuming.lock().unwrap_or_else(PoisonError::into_inner).busy = false;
        tracing::error!(target: "opservant::audit", error = %e, "cannot start the thread that records the audit log's failures");
    }
}

/// The thread: append the waiting runs' records, oldest first, until none waits or one
/// cannot be appended (it keeps its place; the failure is the log's run under way now).
/// It stops being busy under the same lock as it finds the line empty or puts a run back,
/// so a run put in line meanwhile is always either taken by it or starts another thread.
fn append_waiting(log: &Arc<AuditLog>) {
    /// Not busy however the thread ends (a panic unwinds in test builds).
    struct Unwinding<'a>(&'a Arc<AuditLog>);
    impl Drop for Unwinding<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                let mut r = self.0.outages.resuming.lock().unwrap_or_else(PoisonError::into_inner);
                (r.busy, r.in_flight) = (false, None);
            }
        }
    }
    let _unwinding = Unwinding(log);
    loop {
        let run = {
            let mut r = log.outages.resuming.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(run) = r.waiting.pop_front() else {
                (r.busy, r.in_flight) = (false, None);
                return;
            };
            r.in_flight = Some(run.since.clone());
            run
        };
        let recorded = try_record_to(
            Some(log.clone()),
            "audit_resumed",
            &[("failing_since", &run.since), ("last_error", &run.error)],
        );
        let mut r = log.outages.resuming.lock().unwrap_or_else(PoisonError::into_inner);
        r.in_flight = None;
        match recorded {
            Ok(()) => {
                drop(r);
                tracing::info!(target: "opservant::audit", failing_since = %run.since, "the audit log takes records again");
            }
            Err(_) => {
                // Its own failure is noted (a run under way again); this run is tried again
                // first, once the log takes records.
                r.waiting.push_front(run);
                r.busy = false;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::Scratch;
    use super::super::{verify, AuditSettings};
    use super::*;
    use std::fs::File;

    fn error(text: &str) -> AuditError {
        AuditError { path: "test".into(), message: text.into() }
    }

    /// The log, and its lock held the way another process holds it (flock on another open
    /// file description).
    fn log_and_lock(s: &Scratch, wait: Duration) -> (Arc<AuditLog>, impl Fn() -> nix::fcntl::Flock<File>) {
        let mut settings = AuditSettings::at(&s.log());
        settings.lock_wait = wait;
        let log = Arc::new(AuditLog::open(settings.clone()).unwrap());
        let hold = move || {
            let f = File::options().read(true).write(true).open(settings.lock_path()).unwrap();
            nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).unwrap()
        };
        (log, hold)
    }

    /// A run of failures: one failed append noted, its `since`.
    fn fail(log: &Arc<AuditLog>, text: &str) -> String {
        note(log, Err(&error(text)), Instant::now());
        let since = failing(log).unwrap().since;
        // The next run's `since` is another microsecond.
        std::thread::sleep(Duration::from_millis(2));
        since
    }

    fn idle(log: &AuditLog) -> bool {
        let r = log.outages.resuming.lock().unwrap();
        !r.busy && r.waiting.is_empty()
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `(failing_since, last_error)` of the log's `audit_resumed` records, in order.
    fn resumed(s: &Scratch) -> Vec<(String, String)> {
        std::fs::read_to_string(s.log())
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|r| r["event"] == "audit_resumed")
            .map(|r| {
                let field = |k: &str| r["fields"][k].as_str().unwrap().to_string();
                (field("failing_since"), field("last_error"))
            })
            .collect()
    }

    /// A second run that begins and ends while the first one's record waits for the log (a
    /// slow disk, the lock held) gets a record of its own after it. Before, the busy retry
    /// dropped it: the log never said it had failed.
    #[test]
    fn a_run_that_ends_while_another_is_recorded_gets_its_own_record() {
        let s = Scratch::new("outage-two-runs");
        let (log, hold) = log_and_lock(&s, Duration::from_secs(30));
        let first = fail(&log, "disk full");
        let held = hold();
        note(&log, Ok(()), Instant::now());
        assert!(log.outages.resuming.lock().unwrap().busy, "the first run's record is being appended");
        let second = fail(&log, "lock held by pid 7");
        note(&log, Ok(()), Instant::now());
        assert!(failing(&log).is_none());
        drop(held);
        wait_until("the waiting records were appended", || idle(&log));
        let got = resumed(&s);
        assert_eq!(
            got,
            vec![(first, "audit log test: disk full".into()), (second, "audit log test: lock held by pid 7".into())]
        );
        assert!(failing(&log).is_none(), "{:?}", failing(&log));
        assert!(verify::verify(&[s.log()]).unwrap().intact);
    }

    /// A run whose record cannot be appended (the log fails again) keeps its place: once
    /// the failure under way ends, both are in the log, the earlier first, each with its own
    /// start and error — nothing folded, nothing lost.
    #[test]
    fn a_record_that_could_not_be_appended_is_tried_again_first() {
        let s = Scratch::new("outage-retried");
        let (log, hold) = log_and_lock(&s, Duration::from_millis(100));
        let first = fail(&log, "disk full");
        let held = hold();
        note(&log, Ok(()), Instant::now());
        wait_until("the first record's try failed", || !log.outages.resuming.lock().unwrap().busy);
        let under_way = failing(&log).expect("the failed record began a run");
        assert!(under_way.error.contains("held by pid"), "{under_way:?}");
        assert_ne!(under_way.since, first);
        assert_eq!(log.outages.resuming.lock().unwrap().waiting.len(), 1, "the first run still waits");
        drop(held);
        // A command's record ends the run under way.
        try_record_to(Some(log.clone()), "command_received", &[]).unwrap();
        wait_until("the waiting records were appended", || idle(&log));
        let got = resumed(&s);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0], (first, "audit log test: disk full".into()));
        assert_eq!(got[1].0, under_way.since);
        assert!(got[1].1.contains("held by pid"), "{got:?}");
    }

    /// An idle log is retried only [`RETRY_AFTER`] past its latest failure, once at a time,
    /// and its record ends the run without queueing it again.
    #[test]
    fn an_idle_run_is_retried_after_a_pause_and_recorded_once() {
        let s = Scratch::new("outage-idle");
        let (log, _) = log_and_lock(&s, Duration::from_secs(30));
        let since = fail(&log, "disk full");
        at_heartbeat(&log);
        assert!(idle(&log), "too soon: nothing is tried");
        let mut past = failing(&log).unwrap();
        past.latest = Instant::now() - RETRY_AFTER;
        *log.outages.failing.lock().unwrap() = Some(past);
        at_heartbeat(&log);
        wait_until("the record was appended", || idle(&log));
        assert!(failing(&log).is_none());
        assert_eq!(resumed(&s), vec![(since, "audit log test: disk full".into())]);
    }

    /// The idle run's record is being appended (held up by the lock) when a command's
    /// record ends the run: the run is not put in line again — one record, not two.
    #[test]
    fn a_run_whose_record_is_under_way_is_not_put_in_line_again() {
        let s = Scratch::new("outage-in-flight");
        let (log, hold) = log_and_lock(&s, Duration::from_secs(30));
        let since = fail(&log, "disk full");
        let mut past = failing(&log).unwrap();
        past.latest = Instant::now() - RETRY_AFTER;
        *log.outages.failing.lock().unwrap() = Some(past);
        let held = hold();
        at_heartbeat(&log);
        wait_until("the record is under way", || log.outages.resuming.lock().unwrap().in_flight.is_some());
        // Another thread's durable record ends the run meanwhile.
        note(&log, Ok(()), Instant::now());
        assert!(log.outages.resuming.lock().unwrap().waiting.is_empty(), "not in line again");
        drop(held);
        wait_until("the record was appended", || idle(&log));
        assert_eq!(resumed(&s), vec![(since, "audit log test: disk full".into())]);
    }

    /// Runs left in line with no thread to append them (one could not be started) are
    /// started by the next heartbeat, even with no run under way.
    #[test]
    fn a_heartbeat_starts_what_waits_with_no_thread() {
        let s = Scratch::new("outage-stranded");
        let (log, _) = log_and_lock(&s, Duration::from_secs(30));
        let run = Run { since: "2026-12-07T00:00:00.000000Z".into(), error: "disk full".into() };
        log.outages.resuming.lock().unwrap().waiting.push_back(run);
        at_heartbeat(&log);
        wait_until("the record was appended", || idle(&log));
        assert_eq!(resumed(&s), vec![("2026-12-07T00:00:00.000000Z".into(), "disk full".into())]);
    }

    #[test]
    fn the_line_keeps_one_entry_a_run_and_a_bound() {
        let run = |since: &str, error: &str| Run { since: since.into(), error: error.into() };
        let mut line = Resuming::default();
        wait_in_line(&mut line, run("a", "1"));
        wait_in_line(&mut line, run("b", "2"));
        wait_in_line(&mut line, run("a", "3"));
        assert_eq!(line.waiting, [run("a", "3"), run("b", "2")]);
        line.in_flight = Some("z".into());
        wait_in_line(&mut line, run("z", "4"));
        assert_eq!(line.waiting.len(), 2, "the run under way is not put in line");
        for i in 0..2 * MAX_WAITING {
            wait_in_line(&mut line, run(&format!("c{i:03}"), &i.to_string()));
        }
        assert_eq!(line.waiting.len(), MAX_WAITING);
        let last = line.waiting.back().unwrap();
        assert_eq!((last.since.as_str(), last.error.as_str()), ("c061", "127"), "the newest merged into the last");
    }
}
