//! The audit log's lock: an exclusive `flock` on `<log>.lock`, waited for at most a limit
//! (`audit.lock_wait_seconds`).
//!
//! Guarantee: [`exclusive`] and [`shared`] return with the lock held, or with an error — never blocks for
//! ever. Every gated action appends under this lock, so an unbounded wait would let one
//! stopped holder (an `opservant` command suspended with Ctrl-Z mid-append, a process frozen
//! by a cgroup freezer or stuck in the kernel on a dead disk) stall every run of the agent
//! without a word. With the limit, those actions fail closed with an error naming the
//! holder, and go on as soon as it lets go.
//!
//! An uncontended lock costs one non-blocking `flock`. Only a contended one arms a POSIX
//! timer that signals the waiting thread (`SIGEV_THREAD_ID`) with [`wake_signal`], whose
//! handler does nothing and is installed without `SA_RESTART`, so the blocked `flock`
//! returns `EINTR`; the timer repeats every [`REPEAT`] after the limit, so a signal that
//! lands between the deadline check and the next `flock` cannot leave the thread blocked.

use std::fs::File;
use std::mem::MaybeUninit;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// How often the timer fires again once the limit has passed.
const REPEAT: Duration = Duration::from_millis(20);

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another open file description held it for the whole limit.
    #[error("{} held by {holders} for more than {} s", path.display(), limit.as_secs_f64())]
    TimedOut { path: PathBuf, holders: String, limit: Duration },
    /// `flock` or the timer failed.
    #[error("{call} on {}: {errno}", path.display())]
    Os { path: PathBuf, call: &'static str, errno: Errno },
}

/// The real-time signal that ends a `flock` wait: one nothing else in the process uses
/// (glibc keeps the first two for itself; Rust's standard library and tokio use none).
pub fn wake_signal() -> libc::c_int {
    libc::SIGRTMAX() - 3
}

/// Take an exclusive `flock` on `file` (opened from `path`), waiting at most `limit`.
pub fn exclusive(file: File, path: &Path, limit: Duration) -> Result<Flock<File>, LockError> {
    take(file, path, FlockArg::LockExclusiveNonblock, FlockArg::LockExclusive, limit)
}

/// Take a shared `flock` on `file` (opened from `path`) — for readers that must not see an
/// append half done —, waiting at most `limit`.
pub fn shared(file: File, path: &Path, limit: Duration) -> Result<Flock<File>, LockError> {
    take(file, path, FlockArg::LockSharedNonblock, FlockArg::LockShared, limit)
}

fn take(
    file: File,
    path: &Path,
    at_once: FlockArg,
    waiting: FlockArg,
    limit: Duration,
) -> Result<Flock<File>, LockError> {
    let os = |call, errno| LockError::Os { path: path.to_path_buf(), call, errno };
    let mut file = match Flock::lock(file, at_once) {
        Ok(held) => return Ok(held),
        Err((back, Errno::EWOULDBLOCK | Errno::EINTR)) => back,
        Err((_, e)) => return Err(os("flock", e)),
    };
    let deadline = Instant::now() + limit;
    let _alarm = Alarm::arm(limit).map_err(|(call, e)| os(call, e))?;
    loop {
        match Flock::lock(file, waiting) {
            Ok(held) => return Ok(held),
            Err((back, Errno::EINTR)) => {
                if Instant::now() >= deadline {
                    let holders = holders(path).unwrap_or_else(|| "another writer".to_string());
                    return Err(LockError::TimedOut { path: path.to_path_buf(), holders, limit });
                }
                file = back;
            }
            Err((_, e)) => return Err(os("flock", e)),
        }
    }
}

/// Who holds an `flock` on the file at `path`, from `/proc/locks`: "pid N (comm)" for each
/// holder (waiters, shown with `->`, are left out); `None` when the table names none.
pub fn holders(path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let wanted = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    let table = std::fs::read_to_string("/proc/locks").ok()?;
    let named: Vec<String> = table
        .lines()
        .filter_map(|line| {
            // "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2162846 0 EOF"
            let mut words = line.split_whitespace().skip(1);
            if words.next()? != "FLOCK" {
                return None;
            }
            let pid = words.nth(2)?;
            (words.next()? == wanted).then(|| pid.to_string())
        })
        .map(|pid| describe(&pid))
        .collect();
    (!named.is_empty()).then(|| named.join(", "))
}

/// "pid N (comm)", "pid N (comm, stopped)", or — the table keeps the pid that took the lock
/// — "pid N (exited: a process that inherited its descriptor holds the lock)".
fn describe(pid: &str) -> String {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return format!("pid {pid} (exited: a process that inherited its descriptor holds the lock)");
    };
    // "PID (COMM) STATE …": the command may itself hold ") ", so split at the last one.
    let (head, tail) = stat.rsplit_once(") ").unwrap_or((&stat, ""));
    let comm = head.split_once(" (").map_or("", |(_, c)| c);
    match tail.chars().next() {
        Some('T' | 't') => format!("pid {pid} ({comm}, stopped)"),
        _ => format!("pid {pid} ({comm})"),
    }
}

/// A POSIX timer that signals the calling thread, with the signal unblocked in the thread
/// meanwhile (a caller may block signals); deleted, and the mask restored, on drop.
struct Alarm {
    timer: libc::timer_t,
    mask: libc::sigset_t,
}

impl Alarm {
    fn arm(after: Duration) -> Result<Alarm, (&'static str, Errno)> {
        install_handler()?;
        // SAFETY: sigset_t is plain data, initialised by sigemptyset/pthread_sigmask before
        // it is read; every pointer is valid for its call.
        let mask = unsafe {
            let mut wake: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut wake);
            libc::sigaddset(&mut wake, wake_signal());
            let mut mask: libc::sigset_t = std::mem::zeroed();
            // pthread_sigmask returns the error number itself.
            match libc::pthread_sigmask(libc::SIG_UNBLOCK, &wake, &mut mask) {
                0 => mask,
                rc => return Err(("pthread_sigmask", Errno::from_raw(rc))),
            }
        };
        // SAFETY: sigevent is plain data; all-zero is a valid value that the fields set
        // below complete.
        let mut event: libc::sigevent = unsafe { std::mem::zeroed() };
        event.sigev_notify = libc::SIGEV_THREAD_ID;
        event.sigev_signo = wake_signal();
        // SAFETY: gettid has no preconditions.
        event.sigev_notify_thread_id = unsafe { libc::gettid() };
        let mut id = MaybeUninit::<libc::timer_t>::uninit();
        // SAFETY: both pointers are valid for the call; timer_create initialises `id` when
        // it returns 0.
        if let Err(e) = Errno::result(unsafe { libc::timer_create(libc::CLOCK_MONOTONIC, &mut event, id.as_mut_ptr()) })
        {
            restore(&mask);
            return Err(("timer_create", e));
        }
        // SAFETY: initialised by the successful timer_create above.
        let alarm = Alarm { timer: unsafe { id.assume_init() }, mask };
        let spec = libc::itimerspec { it_value: timespec(after), it_interval: timespec(REPEAT) };
        // SAFETY: `alarm.timer` is a live timer of this process; `spec` is valid for the call.
        Errno::result(unsafe { libc::timer_settime(alarm.timer, 0, &spec, std::ptr::null_mut()) })
            .map_err(|e| ("timer_settime", e))?;
        Ok(alarm)
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        // SAFETY: `self.timer` is a timer this value created and deletes once. A signal it
        // queued before the deletion is delivered to the no-op handler (or stays pending if
        // the restored mask blocks it), so it interrupts nothing else.
        unsafe { libc::timer_delete(self.timer) };
        restore(&self.mask);
    }
}

/// Put back the thread's signal mask saved by [`Alarm::arm`].
fn restore(mask: &libc::sigset_t) {
    // SAFETY: `mask` is a signal set pthread_sigmask filled in.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, mask, std::ptr::null_mut()) };
}

fn timespec(d: Duration) -> libc::timespec {
    // A zero it_value would disarm the timer: the limit is at least a nanosecond.
    let d = d.max(Duration::from_nanos(1));
    libc::timespec {
        tv_sec: libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX),
        // subsec_nanos() < 10^9 fits any c_long.
        tv_nsec: d.subsec_nanos() as libc::c_long,
    }
}

extern "C" fn wake(_: libc::c_int) {}

/// Install the no-op handler for [`wake_signal`], once per process.
pub(crate) fn install_handler() -> Result<(), (&'static str, Errno)> {
    static INSTALLED: OnceLock<Result<(), Errno>> = OnceLock::new();
    let result = INSTALLED.get_or_init(|| {
        // SAFETY: sigaction is plain data; the handler is an async-signal-safe function that
        // does nothing; no SA_RESTART, so the interrupted flock returns EINTR.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = wake as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            Errno::result(libc::sigaction(wake_signal(), &action, std::ptr::null_mut())).map(drop)
        }
    });
    result.map_err(|e| ("sigaction", e))
}
