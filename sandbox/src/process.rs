//! Process hygiene for the payload: descriptors, rlimits, signals, program lookup, `execve`.
//! Everything here is called in a single-threaded child just before `execve`.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::resource::{setrlimit, Resource};
use nix::sys::signal::{sigprocmask, SigSet, SigmaskHow};

use crate::error::{Stage, StepError};

/// What a forked monitor's command line reads once blanked ([`blank_command_line`]).
const BLANK_COMMAND_LINE: &[u8] = b"opservant: sandbox";

/// Replace this process's command line (`/proc/PID/cmdline`) with "opservant: sandbox". A
/// monitor forked from its caller (`Launcher::Fork`) carries the caller's arguments — e.g.
/// `opservant run DIR --params … --config …` — into its init, PID 1 of the sandbox, whose
/// command line every process there may read. The argument strings are overwritten in
/// place, setproctitle's method (moving the range the kernel records needs
/// `CAP_SYS_RESOURCE`).
///
/// # Safety
/// The caller is single-threaded (a forked child before anything else runs: no other
/// thread may read the argument strings, e.g. through `std::env::args`, while they are
/// written), and the process has not moved its recorded argument range (`PR_SET_MM`), so
/// that [arg_start, arg_end) is still the argument strings the kernel placed on its stack.
pub(crate) unsafe fn blank_command_line() -> Result<(), StepError> {
    let err = |m: String| StepError::new(Stage::Exec, format!("blank the command line: {m}"));
    let stat = std::fs::read_to_string("/proc/self/stat").map_err(|e| err(format!("/proc/self/stat: {e}")))?;
    // proc(5): arg_start and arg_end are fields 48 and 49; the text after the command name's
    // closing parenthesis starts with field 3.
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<usize>().ok());
    let (Some(start), Some(end)) = (field(48), field(49)) else {
        return Err(err("no argument range in /proc/self/stat".into()));
    };
    if end <= start {
        return Ok(());
    }
    let len = end - start;
    let shown = BLANK_COMMAND_LINE.len().min(len - 1);
    // SAFETY: by the caller's contract, [arg_start, arg_end) is where the kernel placed this
    // process's argument strings, at the top of its initial stack: mapped, writable and this
    // process's own, and no other thread reads it meanwhile. No Rust value lives there; the C
    // `argv` pointers into it (which `std::env::args` reads) afterwards see NUL-terminated
    // strings — the new text or empty ones. The last byte stays NUL, so every string stays
    // terminated.
    unsafe {
        let area = start as *mut u8;
        std::ptr::copy_nonoverlapping(BLANK_COMMAND_LINE.as_ptr(), area, shown);
        std::ptr::write_bytes(area.add(shown), 0, len - shown);
    }
    Ok(())
}

/// Close every descriptor `>= from` (`close_range(2)`, or a `/proc/self/fd` sweep).
pub fn close_fds_from(from: i32) -> Result<(), StepError> {
    // SAFETY: close_range only closes descriptors; callers own every fd in the range.
    let rc =
        unsafe { libc::syscall(libc::SYS_close_range, from as libc::c_uint, libc::c_uint::MAX, 0 as libc::c_uint) };
    if rc == 0 {
        return Ok(());
    }
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map_err(|e| StepError::io(Stage::Exec, "list /proc/self/fd", e))?
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .filter(|fd| *fd >= from)
        .collect();
    for fd in fds {
        // SAFETY: see above; EBADF for the directory fd itself is harmless.
        unsafe { libc::close(fd) };
    }
    Ok(())
}

/// `RLIMIT_CORE` 0 (no core dumps of sandboxed memory), `RLIMIT_NOFILE` `nofile`,
/// `RLIMIT_SIGPENDING` `sigpending` (the sandbox's queued signals also count against its
/// user namespace's owner, host root: without it one sandbox could queue root's whole
/// host-wide allowance and root's own `sigqueue` would fail), and for the same reason
/// `RLIMIT_MSGQUEUE` 0 and `RLIMIT_MEMLOCK` 0: POSIX message-queue bytes and `SHM_LOCK`ed
/// pages are charged to host root as well (since Linux 5.14), whose allowance (819 200
/// bytes of queues) nine default queues of one sandbox would use up — every other
/// sandbox's and root's own `mq_open` then failing. No payload gets either.
pub fn set_rlimits(nofile: u64, sigpending: u64) -> Result<(), StepError> {
    let err = |what: &str, e| StepError::errno(Stage::Rlimits, what, e);
    setrlimit(Resource::RLIMIT_CORE, 0, 0).map_err(|e| err("RLIMIT_CORE", e))?;
    setrlimit(Resource::RLIMIT_NOFILE, nofile, nofile).map_err(|e| err("RLIMIT_NOFILE", e))?;
    setrlimit(Resource::RLIMIT_SIGPENDING, sigpending, sigpending).map_err(|e| err("RLIMIT_SIGPENDING", e))?;
    setrlimit(Resource::RLIMIT_MSGQUEUE, 0, 0).map_err(|e| err("RLIMIT_MSGQUEUE", e))?;
    setrlimit(Resource::RLIMIT_MEMLOCK, 0, 0).map_err(|e| err("RLIMIT_MEMLOCK", e))?;
    Ok(())
}

/// Default dispositions and an empty signal mask, as a freshly started program expects.
pub fn reset_signals() {
    default_dispositions();
    let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
}

/// Every signal's disposition at its default (the mask is left as it is).
pub(crate) fn default_dispositions() {
    for sig in 1..=libc::SIGRTMAX() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: installing SIG_DFL is always sound.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
    // glibc's `signal` refuses its two internal signals (32 and 33, below `SIGRTMIN()`), and
    // its `posix_spawn` — how the daemon starts a zygote or a cold monitor — leaves them
    // *ignored* in the child, which an `execve` keeps: a payload would start with them
    // ignored where a fork and exec give the default. Set through the kernel, only when
    // ignored (a handler glibc installed for itself is left alone).
    for sig in [32, 33] {
        if raw_disposition(sig) == Some(libc::SIG_IGN) {
            set_raw_default(sig);
        }
    }
}

/// The kernel's `struct sigaction` (x86_64 and aarch64 alike), for the two signals glibc
/// keeps from its callers.
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// `sig`'s handler as the kernel has it.
fn raw_disposition(sig: libc::c_int) -> Option<libc::sighandler_t> {
    let mut old = KernelSigaction { handler: 0, flags: 0, restorer: 0, mask: 0 };
    // SAFETY: rt_sigaction with no new action only writes the old one into `old`, a valid
    // struct of the kernel's layout; the size is that of its 64-bit mask.
    let r =
        unsafe { libc::syscall(libc::SYS_rt_sigaction, sig, std::ptr::null::<KernelSigaction>(), &mut old, 8usize) };
    (r == 0).then_some(old.handler)
}

/// Set `sig` to its default disposition through the kernel.
fn set_raw_default(sig: libc::c_int) {
    let dfl = KernelSigaction { handler: libc::SIG_DFL, flags: 0, restorer: 0, mask: 0 };
    // SAFETY: installs SIG_DFL (no handler runs, so no restorer is needed); the kernel only
    // reads `dfl`, a valid struct of its layout.
    unsafe { libc::syscall(libc::SYS_rt_sigaction, sig, &dfl, std::ptr::null_mut::<KernelSigaction>(), 8usize) };
}

/// Resolve `program` like `execvp`: a name with a slash is used as is, otherwise the first
/// executable match in `path_var`.
pub fn find_program(program: &str, path_var: Option<&str>) -> Result<PathBuf, StepError> {
    if program.contains('/') {
        return Ok(PathBuf::from(program));
    }
    let search = path_var.unwrap_or("/usr/local/bin:/usr/bin:/bin");
    for dir in search.split(':').filter(|d| !d.is_empty()) {
        let candidate = Path::new(dir).join(program);
        if nix::unistd::access(&candidate, nix::unistd::AccessFlags::X_OK).is_ok() && candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(StepError::new(Stage::Exec, format!("{program}: command not found in PATH {search}")))
}

/// `execve`; only returns on failure.
pub fn exec(path: &Path, argv0: &str, args: &[String], env: &[(String, String)]) -> StepError {
    let to_c = |s: &[u8]| CString::new(s).map_err(|_| Errno::EINVAL);
    let build = || -> Result<(CString, Vec<CString>, Vec<CString>), Errno> {
        let p = to_c(path.as_os_str().as_bytes())?;
        let mut a = vec![to_c(argv0.as_bytes())?];
        for x in args {
            a.push(to_c(x.as_bytes())?);
        }
        let e = env.iter().map(|(k, v)| to_c(format!("{k}={v}").as_bytes())).collect::<Result<_, _>>()?;
        Ok((p, a, e))
    };
    match build() {
        Err(e) => StepError::errno(Stage::Exec, "argument encoding", e),
        Ok((p, a, e)) => match nix::unistd::execve(&p, &a, &e) {
            Err(err) => StepError::errno(Stage::Exec, format!("execve {}", path.display()), err),
            Ok(never) => match never {},
        },
    }
}

/// Make `env` the whole process environment (what `execve` with `env` would give a program),
/// for a payload that continues in-process instead of `execve`.
pub fn replace_environment(env: &[(String, String)]) -> Result<(), StepError> {
    let to_c = |s: &str| CString::new(s).map_err(|_| StepError::new(Stage::Exec, "environment entry with NUL"));
    let entries: Vec<(CString, CString)> =
        env.iter().map(|(k, v)| Ok((to_c(k)?, to_c(v)?))).collect::<Result<_, StepError>>()?;
    // SAFETY: the caller is single-threaded (a forked sandbox process), so nothing reads the
    // environment concurrently; the strings are NUL-terminated and copied by setenv.
    unsafe {
        if libc::clearenv() != 0 {
            return Err(StepError::new(Stage::Exec, "clearenv failed"));
        }
        for (k, v) in &entries {
            if libc::setenv(k.as_ptr(), v.as_ptr(), 1) != 0 {
                return Err(StepError::errno(Stage::Exec, "setenv", Errno::last()));
            }
        }
    }
    Ok(())
}

/// `PR_SET_DUMPABLE` 0: the process's `/proc` files belong to root and no process without
/// `CAP_SYS_PTRACE` over its memory's namespace can trace it or take its descriptors —
/// whatever `fs.suid_dumpable` set the flag to at the last credential change. A failure is
/// reported as a failure of `stage`.
pub(crate) fn not_dumpable(stage: Stage) -> Result<(), StepError> {
    // SAFETY: PR_SET_DUMPABLE takes an integer.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(StepError::errno(stage, "prctl(PR_SET_DUMPABLE, 0)", Errno::last()));
    }
    Ok(())
}
