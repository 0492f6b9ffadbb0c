//! `opservant doctor`: what this host supports, what is missing, and — in plain words — what
//! will be degraded. Read-only: it changes nothing on the host.

use sandbox::probe::HostProbe;
use serde::Serialize;

/// One finding.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub feature: &'static str,
    pub ok: bool,
    /// A missing required feature stops sandboxes from running.
    pub required: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct DoctorReport {
    pub kernel: String,
    pub findings: Vec<Finding>,
    /// Plain-language consequences of what is missing.
    pub degraded: Vec<String>,
    pub probe: HostProbe,
}

impl DoctorReport {
    /// A required feature is missing.
    pub fn failed(&self) -> bool {
        self.findings.iter().any(|f| f.required && !f.ok)
    }
}

/// Examine the host. `landlock_min_abi` and `allow_degraded` come from the agent policy.
pub fn examine(landlock_min_abi: u32, allow_degraded: bool, host_uids: Option<&sandbox::HostUids>) -> DoctorReport {
    let p = sandbox::probe::probe();
    let mut findings = Vec::new();
    let mut degraded = Vec::new();

    let missing_ns: Vec<&str> = p.namespaces.iter().filter(|(n, ok)| !ok && *n != "time").map(|(n, _)| *n).collect();
    findings.push(Finding {
        feature: "namespaces",
        ok: missing_ns.is_empty(),
        required: true,
        detail: if missing_ns.is_empty() {
            format!(
                "{} available",
                p.namespaces.iter().filter(|(_, ok)| *ok).map(|(n, _)| *n).collect::<Vec<_>>().join(" ")
            )
        } else {
            format!("missing: {}", missing_ns.join(" "))
        },
    });

    let u = &p.user_namespaces;
    let mut notes = Vec::new();
    if let Some(m) = u.max_user_namespaces {
        notes.push(format!("user.max_user_namespaces={m}"));
    }
    if let Some(v) = u.unprivileged_userns_clone {
        notes.push(format!("kernel.unprivileged_userns_clone={}", u8::from(v)));
    }
    match u.apparmor_restrict_unprivileged_userns {
        Some(true) => notes.push("AppArmor restricts unprivileged user namespaces (root is not affected)".into()),
        Some(false) => notes.push("AppArmor does not restrict user namespaces".into()),
        None => notes.push("no AppArmor user-namespace restriction on this kernel".into()),
    }
    findings.push(Finding {
        feature: "user namespaces",
        ok: u.can_create.is_ok(),
        required: true,
        detail: match &u.can_create {
            Ok(()) => format!("can create all seven namespace types; {}", notes.join("; ")),
            Err(e) => format!("cannot create: {e}; {}", notes.join("; ")),
        },
    });

    let ll = &p.landlock;
    let ll_ok = ll.abi >= landlock_min_abi && ll.abi > 0;
    findings.push(Finding {
        feature: "landlock",
        ok: ll_ok,
        required: landlock_min_abi > 0,
        detail: if ll.abi == 0 {
            "not available (not built or not enabled: add landlock to the lsm= boot parameter)".into()
        } else {
            format!(
                "ABI {} ({}); enforced rights: {}; scopes: {}",
                ll.abi,
                serde_json::to_value(ll.status).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default(),
                ll.fs_enforced.join(","),
                if ll.scopes_enforced.is_empty() { "none".into() } else { ll.scopes_enforced.join(",") }
            )
        },
    });
    if !ll.fs_unsupported.is_empty() {
        degraded.push(format!(
            "Landlock ABI {} cannot enforce: {}{}",
            ll.abi,
            ll.fs_unsupported.join(", "),
            if ll.fs_unsupported.iter().any(|r| r == "resolve_unix") {
                " (connecting to path-named Unix sockets is not mediated by Landlock; the sandbox's allowlisted mount view is what hides host sockets)"
            } else {
                ""
            }
        ));
    }
    if !ll.scopes_unsupported.is_empty() {
        degraded.push(format!(
            "Landlock ABI {} has no {} scoping (the sandbox's own network and PID namespaces still separate abstract sockets and signals)",
            ll.abi,
            ll.scopes_unsupported.join(" / ")
        ));
    }

    findings.push(Finding {
        feature: "seccomp",
        ok: p.seccomp,
        required: true,
        detail: if p.seccomp { "filter mode available".into() } else { "seccomp filters unavailable".into() },
    });

    findings.push(Finding {
        feature: "cgroups",
        ok: p.cgroup_mode != "none",
        required: !allow_degraded,
        detail: match p.cgroup_mode.as_str() {
            "unified" => "cgroup v2 (unified hierarchy)".into(),
            "hybrid" => {
                "cgroup v1 hybrid: v1 controller hierarchies plus a cgroup2 mount; limits use the v1 hierarchies below"
                    .into()
            }
            "legacy" => "cgroup v1 (legacy hierarchies only)".into(),
            _ => "no cgroup filesystem mounted".into(),
        },
    });
    for (name, c) in
        [("cgroup memory", &p.cgroup.memory), ("cgroup cpu", &p.cgroup.cpu), ("cgroup pids", &p.cgroup.pids)]
    {
        let ok = c.version.is_some();
        findings.push(Finding {
            feature: name,
            ok,
            required: !allow_degraded,
            detail: match c.version {
                Some(v) => format!("{v}, sandbox cgroups under {}", c.detail),
                None => c.detail.clone(),
            },
        });
        if !ok {
            degraded.push(format!("{name} limits cannot be enforced: {}", c.detail));
        }
    }
    let versions: Vec<&str> =
        [&p.cgroup.memory, &p.cgroup.cpu, &p.cgroup.pids].iter().filter_map(|c| c.version).collect();
    if versions.contains(&"v1") {
        degraded.push(
            "cgroup v1 hierarchy in use: no cgroup.kill (teardown sweeps processes with SIGKILL) and no memory.oom.group (the kernel's OOM kill takes one process; the agent kills the rest of the sandbox when its memory cgroup reports the OOM through cgroup.event_control — an OOM of the whole host reports none)".into(),
        );
    }

    findings.push(Finding {
        feature: "mount_setattr",
        ok: p.mount_setattr,
        required: false,
        detail: if p.mount_setattr {
            "available".into()
        } else {
            "missing: read-only binds fall back to per-mount remounts".into()
        },
    });
    findings.push(Finding {
        feature: "openat2",
        ok: p.openat2,
        required: false,
        detail: if p.openat2 {
            "available (host paths resolved with RESOLVE_IN_ROOT)".into()
        } else {
            "missing: host paths resolved without RESOLVE_IN_ROOT".into()
        },
    });
    let (identity, mut identity_detail) = identity_finding();
    if identity == Some(false) {
        if host_uids.is_some() {
            // Each sandbox runs as a uid of its own on the host: nobody's processes are not
            // its user, only the files of its declared paths are nobody's to it.
            identity_detail.push_str(" inside, each on a host uid of its own (sandbox.host_uids)");
        } else {
            degraded.push(format!("{identity_detail}: {SHARED_NOBODY}"));
        }
    }
    findings.push(Finding {
        feature: "identity",
        ok: identity == Some(true),
        required: identity.is_none(),
        detail: identity_detail,
    });

    let (uids_ok, uids_detail) = host_uids_finding(host_uids);
    if !uids_ok {
        degraded.push(uids_detail.clone());
    }
    findings.push(Finding { feature: "host uids", ok: uids_ok, required: false, detail: uids_detail });

    let (inotify_ok, inotify_detail) = root_inotify_finding(host_uids);
    if !inotify_ok {
        degraded.push(inotify_detail.clone());
    }
    findings.push(Finding {
        feature: "root's inotify headroom",
        ok: inotify_ok,
        required: false,
        detail: inotify_detail,
    });

    let (dumpable_ok, dumpable_detail) = suid_dumpable_finding(
        std::fs::read_to_string("/proc/sys/fs/suid_dumpable").ok().and_then(|s| s.trim().parse().ok()),
    );
    if !dumpable_ok {
        degraded.push(dumpable_detail.clone());
    }
    findings.push(Finding { feature: "fs.suid_dumpable", ok: dumpable_ok, required: false, detail: dumpable_detail });

    let (core_ok, core_detail) = core_pattern_finding(std::fs::read_to_string("/proc/sys/kernel/core_pattern").ok());
    if !core_ok {
        degraded.push(core_detail.clone());
    }
    findings.push(Finding { feature: "kernel.core_pattern", ok: core_ok, required: false, detail: core_detail });

    let (egress_ok, egress_detail) = egress_readiness();
    if !egress_ok {
        degraded.push(format!("executors with outbound: true cannot run: {egress_detail}"));
    }
    findings.push(Finding { feature: "network egress", ok: egress_ok, required: false, detail: egress_detail });

    let (clock_ok, clock_degraded, clock_detail) = clock_finding(kernel_clock());
    if clock_degraded {
        degraded.push(clock_detail.clone());
    }
    findings.push(Finding { feature: "clock", ok: clock_ok, required: false, detail: clock_detail });

    let (runtime_ok, runtime_detail) = runtime_finding();
    if !runtime_ok {
        degraded.push(format!("executors, scripts and sessions cannot run: {runtime_detail}"));
    }
    findings.push(Finding { feature: "executor runtime", ok: runtime_ok, required: true, detail: runtime_detail });

    DoctorReport { kernel: p.kernel.clone(), findings, degraded, probe: p }
}

/// What running sandboxes as the host's `nobody` means.
const SHARED_NOBODY: &str = "the host's nobody, whose other processes can signal the sandboxes' payloads and, unless ptrace is restricted, trace them; \
     install systemd/sysusers.d/opservant.conf (systemd-sysusers) to give them a uid of their own";

/// The uid sandboxes run as: `Some(true)` their own (`opservant-executor`), `Some(false)` the
/// shared `nobody`, `None` neither exists (sandboxes cannot start).
fn identity_finding() -> (Option<bool>, String) {
    if let Ok(id) = sandbox::Identity::local("opservant-executor") {
        return (Some(true), format!("sandboxes run as opservant-executor (uid {}, gid {})", id.host_uid, id.host_gid));
    }
    match sandbox::Identity::default_executor() {
        Ok(id) => (
            Some(false),
            format!("no user opservant-executor: sandboxes run as nobody (uid {}, gid {})", id.host_uid, id.host_gid),
        ),
        Err(e) => (None, e.to_string()),
    }
}

/// Whether each sandbox runs as a host uid of its own (`sandbox.host_uids`).
fn host_uids_finding(host_uids: Option<&sandbox::HostUids>) -> (bool, String) {
    let Some(r) = host_uids else { return (false, SHARED_HOST_UID.into()) };
    // What a lease refuses, checked before any run fails on it.
    if let Some(problem) = sandbox::host_uid::lock_problem(r) {
        return (false, format!("{problem}: every run would fail"));
    }
    let accounts = accounts_in_range(r);
    if let Some(problem) = accounts.problem {
        return (false, format!("{}-{} holds {problem}: that account's processes would share a sandbox's kernel allowances and could signal it; choose another range", r.first, r.last()));
    }
    let allocators: Vec<&str> =
        SYSTEMD_UID_ALLOCATORS.iter().copied().filter(|p| std::path::Path::new(p).exists()).collect();
    if let Some(problem) = container_range_overlap(r, &allocators) {
        return (false, problem);
    }
    let mut detail = format!("a host uid of its own per sandbox, from {}-{} ({} at once)", r.first, r.last(), r.count);
    if !accounts.unlisted_sources.is_empty() {
        detail.push_str(&format!(
            "; accounts from {} are checked only as far as they are listed (getpwent): keep the directory's uids out of this range",
            accounts.unlisted_sources.join(", ")
        ));
    }
    (true, detail)
}

/// systemd's programs that hand containers and user namespaces uids from
/// [`crate::policy::SYSTEMD_CONTAINER_UIDS`].
const SYSTEMD_UID_ALLOCATORS: [&str; 2] = ["/usr/bin/systemd-nspawn", "/usr/lib/systemd/systemd-nsresourced"];

/// What `range` overlapping systemd's container uids means where `installed` (of
/// [`SYSTEMD_UID_ALLOCATORS`]) can allocate them: they check only that no account names the
/// first uid of what they pick, and nothing names the sandboxes' uids.
fn container_range_overlap(range: &sandbox::HostUids, installed: &[&str]) -> Option<String> {
    let (low, high) = crate::policy::SYSTEMD_CONTAINER_UIDS;
    if installed.is_empty() || range.last() < low || range.first > high {
        return None;
    }
    Some(format!(
        "{}-{} overlaps systemd's container uids ({low}-{high}), which {} can give a container or user namespace: \
         its root would own the sandboxes' processes; choose a range outside it (e.g. 1879048192-2147352575)",
        range.first,
        range.last(),
        installed.join(" and ")
    ))
}

/// What [`accounts_in_range`] found.
#[derive(Debug, Default, PartialEq)]
struct AccountsInRange {
    /// An account inside the range, named.
    problem: Option<String>,
    /// `passwd` sources of `/etc/nsswitch.conf` that may not list all their accounts
    /// (directory services: `sss`, `ldap`, `winbind`, …; enumeration is often off).
    unlisted_sources: Vec<String>,
}

/// NSS `passwd` sources whose accounts are all listed by `getpwent`: the local file
/// (`compat` too: its NIS entries as far as NIS lists them) and systemd's user records
/// (the uid ranges it hands out are refused by the configuration check).
const LISTED_SOURCES: [&str; 3] = ["files", "systemd", "compat"];

/// The accounts of every NSS source (`getpwent`, so directory services too, as far as they
/// list their accounts), checked against `range` — the
/// configuration check ([`crate::policy::host_uids`]) reads `/etc/passwd` only: an NSS
/// lookup per uid of a range would stall every start.
fn accounts_in_range(range: &sandbox::HostUids) -> AccountsInRange {
    let sources = std::fs::read_to_string("/etc/nsswitch.conf").map(|t| passwd_sources(&t)).unwrap_or_default();
    check_accounts(range, &sources, recent_accounts)
}

/// How long a listing of every account ([`every_account`]) is reused: the heartbeat
/// examines the host every minute, and a directory service that lists its accounts would
/// be walked whole each time.
const ACCOUNTS_REUSED_FOR: std::time::Duration = std::time::Duration::from_secs(600);

/// [`every_account`], listed again at most every [`ACCOUNTS_REUSED_FOR`].
fn recent_accounts() -> Vec<(String, u32)> {
    type Listed = (std::time::Instant, Vec<(String, u32)>);
    static RECENT: std::sync::Mutex<Option<Listed>> = std::sync::Mutex::new(None);
    let mut recent = RECENT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    match &*recent {
        Some((at, accounts)) if at.elapsed() < ACCOUNTS_REUSED_FOR => accounts.clone(),
        _ => {
            let accounts = every_account();
            *recent = Some((std::time::Instant::now(), accounts.clone()));
            accounts
        }
    }
}

/// [`accounts_in_range`] with the `passwd` sources given, and `accounts` listing them.
fn check_accounts(
    range: &sandbox::HostUids,
    sources: &[String],
    accounts: impl FnOnce() -> Vec<(String, u32)>,
) -> AccountsInRange {
    let mut found = AccountsInRange {
        unlisted_sources: sources.iter().filter(|s| !LISTED_SOURCES.contains(&s.as_str())).cloned().collect(),
        ..Default::default()
    };
    let contains = |uid: u32| (range.first..=range.last()).contains(&uid);
    found.problem =
        accounts().into_iter().find(|(_, uid)| contains(*uid)).map(|(name, uid)| format!("the uid of {name} ({uid})"));
    found
}

/// The sources of the `passwd:` line of an `nsswitch.conf` text, without `[…]` actions.
fn passwd_sources(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.split('#').next()?.trim().strip_prefix("passwd:"))
        .next_back()
        .map(|rest| {
            rest.split_whitespace().filter(|w| !w.starts_with('[') && !w.ends_with(']')).map(str::to_string).collect()
        })
        .unwrap_or_default()
}

/// Every account NSS lists (`setpwent`/`getpwent`/`endpwent`), as (name, uid).
fn every_account() -> Vec<(String, u32)> {
    // getpwent's position is the C library's process-wide state: one walk at a time.
    static WALK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _walk = WALK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut accounts = Vec::new();
    // SAFETY: setpwent/getpwent/endpwent are called only under WALK; each entry getpwent
    // returns is valid until the next call, and is copied out before it.
    unsafe {
        libc::setpwent();
        loop {
            let entry = libc::getpwent();
            if entry.is_null() {
                break;
            }
            if (*entry).pw_name.is_null() {
                continue;
            }
            let name = std::ffi::CStr::from_ptr((*entry).pw_name).to_string_lossy().into_owned();
            accounts.push((name, (*entry).pw_uid));
        }
        libc::endpwent();
    }
    accounts
}

/// Sandboxes (each at most at its cap) below which root's host-wide inotify allowance counts
/// as enough: 8192 instances at the default cap of 16, a common setting where many
/// containers run.
const ROOT_INOTIFY_SANDBOXES: u64 = 512;

/// Whether root's host-wide inotify allowance outlasts the sandboxes': the kernel charges the
/// instances made in a user namespace to its owner too. With a host uid leased per sandbox,
/// that uid owns the sandbox's namespace and root's allowance is not touched. Sharing the
/// identity's uid, every sandbox's namespace is root's, and the instances count against
/// root's own `fs.inotify.max_user_instances`, so sandboxes at their cap can leave none for
/// root's processes (systemd, udev): reported, with the number of sandboxes that takes,
/// below [`ROOT_INOTIFY_SANDBOXES`] of them.
fn root_inotify_finding(host_uids: Option<&sandbox::HostUids>) -> (bool, String) {
    if host_uids.is_some() {
        return (
            true,
            "each sandbox's user namespace is owned by its leased host uid: its inotify instances count against that uid's allowance, not root's".into(),
        );
    }
    let cap = u64::from(sandbox::Limits::default().inotify_instances).max(1);
    let Some(host) = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
    else {
        return (true, "no inotify on this host".into());
    };
    let sandboxes = host.div_ceil(cap);
    let detail = format!(
        "sandboxes' inotify instances also count against root's host-wide fs.inotify.max_user_instances ({host} here): \
         {sandboxes} sandboxes at their cap of {cap} leave none for root's own processes (systemd, udev)"
    );
    if sandboxes >= ROOT_INOTIFY_SANDBOXES {
        (true, detail)
    } else {
        (
            false,
            format!(
                "{detail}; raise it (sysctl fs.inotify.max_user_instances={}) where many sandboxes run at once",
                cap * ROOT_INOTIFY_SANDBOXES
            ),
        )
    }
}

/// What a crashing sandboxed process leaves, by the host's `kernel.core_pattern` (its text):
/// a file pattern is held off by the sandbox's `RLIMIT_CORE` 0, but the kernel ignores core
/// limits for a pipe (`|…`): its helper runs as root outside the sandbox and takes the
/// process's memory — a delivered secret included — unless it honours the limit itself, as
/// systemd-coredump does when the pattern passes it (`%c`: "Resource limits disable core
/// dumping").
fn core_pattern_finding(pattern: Option<String>) -> (bool, String) {
    match pattern.as_deref().map(str::trim) {
        Some(p) if p.starts_with('|') => {
            let mut words = p.trim_start_matches('|').split_whitespace();
            let helper = words.next().unwrap_or("");
            let honours_limit = helper.ends_with("/systemd-coredump") && words.any(|w| w == "%c");
            if honours_limit {
                return (
                    true,
                    format!("core dumps go to {helper}, which is given the core limit (%c) and stores nothing for the sandboxes' RLIMIT_CORE 0"),
                );
            }
            (
                false,
                format!(
                    "kernel.core_pattern pipes core dumps to {helper}: a crashing sandboxed process is dumped by it, outside the sandbox \
                     and its limits, with its memory (a delivered secret included) — the kernel ignores RLIMIT_CORE for a pipe; \
                     for sandboxes to leave no dump, have the helper honour the core limit (systemd-coredump with %c) or set a file pattern"
                ),
            )
        }
        Some(p) => (true, format!("core dumps go to files ({p:?}), which the sandboxes' RLIMIT_CORE 0 prevents")),
        None => (false, "cannot read /proc/sys/kernel/core_pattern".into()),
    }
}

/// Whether a process that changes its credentials stays out of reach of the uid it changes
/// to (`fs.suid_dumpable`, `value`): with 1 (a debugging setting) the kernel leaves it
/// dumpable, so at each sandbox's start init (as it switches to the sandbox's uid) and a
/// leased sandbox's monitor (as it joins the namespace that uid owns) are, until their next
/// call makes them non-dumpable, open to `ptrace` and `pidfd_getfd` from a host process
/// running as that uid.
fn suid_dumpable_finding(value: Option<u32>) -> (bool, String) {
    match value {
        Some(0) => (true, "0: a process that changes its credentials is not dumpable".into()),
        Some(2) => (true, "2: a process that changes its credentials is dumpable by root only".into()),
        Some(1) => (
            false,
            "1: sandbox init and a leased sandbox's monitor stay dumpable for a moment at each start, as they change \
             credentials: a host process running as the sandbox's uid could trace them then; set fs.suid_dumpable to 0 or 2"
                .into(),
        ),
        Some(n) => (false, format!("{n}: not a value the kernel documents")),
        None => (false, "cannot read /proc/sys/fs/suid_dumpable".into()),
    }
}

/// What sandboxes sharing the identity's host uid means.
const SHARED_HOST_UID: &str = "every sandbox runs as the identity's host uid: kernel allowances counted per uid \
     (pipe buffer pages, descriptors in flight over Unix sockets, epoll watches) are shared, so one sandbox can use them up \
     for the others while it lives; give opservant-executor a range in /etc/subuid (usermod --add-subuids) or set sandbox.host_uids";

/// Whether the executor runtime this process would start is there and of this build
/// (`opservant-runtime --version`, which starts no interpreter): one replaced by an upgrade
/// while an agent runs fails every executor run of that agent until it is restarted — the
/// heartbeat's `doctor` says so to the platform. The file is run again only when it changed
/// (device, inode, size, change times); one that does not answer within
/// [`RUNTIME_VERSION_LIMIT`] is killed and reported.
fn runtime_finding() -> (bool, String) {
    use std::os::unix::fs::MetadataExt;
    type Key = (std::path::PathBuf, u64, u64, u64, i64, i64, i64, i64);
    static LAST: std::sync::Mutex<Option<(Key, (bool, String))>> = std::sync::Mutex::new(None);
    let path = match crate::executor_run::runtime_binary() {
        Ok(p) => p,
        Err(e) => return (false, e.0),
    };
    let key = match std::fs::metadata(&path) {
        Ok(m) => (path.clone(), m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec()),
        Err(e) => return (false, format!("{}: {e}", path.display())),
    };
    let mut last = LAST.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((k, finding)) = &*last {
        if *k == key {
            return finding.clone();
        }
    }
    let (finding, settled) = run_runtime_version(&path);
    *last = settled.then(|| (key, finding.clone()));
    finding
}

/// How long `opservant-runtime --version` may take (it prints a constant and exits).
const RUNTIME_VERSION_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// [`runtime_finding`]'s check of the file at `path`; false with it when the answer is not
/// one to keep (the program could not be run, or did not answer in time). The program runs
/// in a process group of its own, killed whole at the deadline: its output is read on a
/// thread, so a process it left holding the pipe delays nothing.
fn run_runtime_version(path: &std::path::Path) -> ((bool, String), bool) {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let mut child = match std::process::Command::new(path)
        .arg("--version")
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => return ((false, format!("{}: cannot run it: {e}", path.display())), false),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    if let Some(out) = child.stdout.take() {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = out.take(4096).read_to_string(&mut text);
            let _ = tx.send(text);
        });
    }
    let deadline = std::time::Instant::now() + RUNTIME_VERSION_LIMIT;
    let answer = loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                break rx
                    .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
                    .ok()
                    .map(|t| (status, t))
            }
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(std::time::Duration::from_millis(5)),
            Ok(None) | Err(_) => break None,
        }
    };
    let Some((status, text)) = answer else {
        // The whole group: the program and anything it left holding the pipe.
        // SAFETY: kill has no memory preconditions; the group is the child's own (pid = pgid).
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let _ = child.wait();
        return (
            (
                false,
                format!(
                    "{} --version did not answer within {} s: not opservant's runtime, or stuck",
                    path.display(),
                    RUNTIME_VERSION_LIMIT.as_secs()
                ),
            ),
            false,
        );
    };
    let build = text.trim_end().strip_prefix("opservant-runtime ").unwrap_or("");
    let finding = if status.success() && build == crate::app::BUILD {
        (true, format!("{}, build {build} (this opservant's)", path.display()))
    } else if status.success() && !build.is_empty() {
        (
            false,
            format!(
                "{} is build {}, this opservant is build {}: they come from different installs (an upgrade replaced one, perhaps while this agent ran); install both from one build and restart the agent",
                path.display(),
                crate::app::shown_build(build),
                crate::app::BUILD
            ),
        )
    } else {
        (
            false,
            format!(
                "{} did not name its build ({status}): an older build than this opservant's {}, or not opservant's; install both from one build and restart the agent",
                path.display(),
                crate::app::BUILD
            ),
        )
    };
    (finding, true)
}

/// What the kernel says of the system clock: `ntp_adjtime`'s state and its maximum error in
/// µs (16 s, [`UNSYNCHRONISED_MAXERROR_US`], once no time service disciplines it); `Err` the
/// call's error (`EPERM` under a system call filter such as systemd's `ProtectClock=`, which
/// refuses the call even to read).
pub fn kernel_clock() -> Result<(i32, i64), std::io::Error> {
    // SAFETY: `timex` is plain data, valid all zeros; with `modes` 0 the call only reads the
    // kernel's clock state into the structure, which lives across the call.
    let mut t: libc::timex = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `t` is a valid, exclusive pointer for the call's duration.
    let state = unsafe { libc::ntp_adjtime(&mut t) };
    if state < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((state, t.maxerror))
}

/// The maximum error the kernel reports for a clock no time service disciplines (its
/// `NTP_PHASE_LIMIT`): systemd's `ntp_synced()` criterion. `STA_UNSYNC` is not one — chrony
/// without `rtcsync` leaves it set on a synchronised clock (to keep the kernel off the RTC).
pub const UNSYNCHRONISED_MAXERROR_US: i64 = 16_000_000;

/// Whether the system clock is kept synchronised (seed 001's checklist: "NTP synchronized",
/// required), and whether a failure is a degradation: signed commands more than
/// [`crate::signing::MAX_SKEW_S`] from this clock are refused as `clock_skew`, so an
/// unsynchronised clock is one — reported, not a refusal of sandboxes (it keeps nothing from
/// running that a command did not bring). A state that cannot be read (a system call filter)
/// is said so, not counted as a degradation: nothing is known.
fn clock_finding(kernel: Result<(i32, i64), std::io::Error>) -> (bool, bool, String) {
    match kernel {
        Ok((_, maxerror)) if maxerror >= UNSYNCHRONISED_MAXERROR_US => (
            false,
            true,
            format!(
                "the system clock is not synchronised (the kernel's maximum error has reached {} s: no time \
                 service such as chrony or systemd-timesyncd keeps it): signed commands whose timestamp is more \
                 than {} s from it are rejected as clock_skew",
                UNSYNCHRONISED_MAXERROR_US / 1_000_000,
                crate::signing::MAX_SKEW_S
            ),
        ),
        Ok((_, maxerror)) => (true, false, format!("synchronised (maximum error {} ms)", maxerror / 1000)),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => (
            false,
            false,
            "unknown here: a system call filter refuses adjtimex even to read the clock's state (systemd's \
             ProtectClock=, which the opservant unit sets); run opservant doctor from a shell"
                .into(),
        ),
        Err(e) => (false, false, format!("the clock's synchronisation cannot be read (ntp_adjtime: {e})")),
    }
}

/// A note for a command refused as `clock_skew` when this host's clock is known not to be
/// synchronised.
pub fn clock_skew_hint() -> Option<&'static str> {
    matches!(kernel_clock(), Ok((_, maxerror)) if maxerror >= UNSYNCHRONISED_MAXERROR_US)
        .then_some("; this host's clock is not synchronised (no time service keeps it: see opservant doctor)")
}

/// Whether `outbound: true` can be honoured here (read-only: nothing is created).
fn egress_readiness() -> (bool, String) {
    let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    let mut missing = Vec::new();
    if let Err(e) = sandbox::net::nftables_available() {
        missing.push(format!("nftables ({e})"));
    }
    let v4 = read("/proc/sys/net/ipv4/ip_forward");
    let v6 = read("/proc/sys/net/ipv6/conf/all/forwarding");
    let mut notes = Vec::new();
    match v4.as_deref() {
        Some("1") => notes.push("IPv4 forwarding on".to_string()),
        _ => missing.push("IPv4 forwarding (net.ipv4.ip_forward=1: systemd/sysctl.d/60-opservant.conf, or network.egress.manage_forwarding)".into()),
    }
    notes.push(match v6.as_deref() {
        Some("1") => "IPv6 egress available".into(),
        Some(_) => "IPv6 egress off (net.ipv6.conf.all.forwarding=0): IPv4 only".into(),
        None => "IPv6 disabled: IPv4 only".into(),
    });
    if missing.is_empty() {
        (true, notes.join("; "))
    } else {
        (false, format!("missing: {}", missing.join(", ")))
    }
}

/// Human-readable rendering.
pub fn render(r: &DoctorReport) -> String {
    let mut s = format!("opservant doctor — {}\n\n", r.kernel);
    for f in &r.findings {
        let mark = match (f.ok, f.required) {
            (true, _) => "ok     ",
            (false, true) => "MISSING",
            (false, false) => "absent ",
        };
        s.push_str(&format!("{mark}  {:<16} {}\n", f.feature, f.detail));
    }
    if !r.degraded.is_empty() {
        s.push_str("\nWhat will be degraded on this host:\n");
        for d in &r.degraded {
            s.push_str(&format!("  - {d}\n"));
        }
    }
    s.push_str(if r.failed() {
        "\nA required feature is missing: sandboxes (or, without their runtime, executor runs) will not start on this host.\n"
    } else {
        "\nEvery required feature is present.\n"
    });
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsynchronised_clock_is_a_degradation_named_with_its_consequence() {
        let (ok, degraded, detail) = clock_finding(Ok((libc::TIME_ERROR, 16_000_000)));
        assert!(!ok && degraded);
        assert!(detail.contains("not synchronised") && detail.contains("clock_skew"), "{detail}");
        assert_eq!(
            clock_finding(Ok((libc::TIME_OK, 12_500))),
            (true, false, "synchronised (maximum error 12 ms)".into())
        );
        assert!(clock_finding(Ok((libc::TIME_INS, 0))).0, "a leap second pending is still synchronised");
        // chrony without rtcsync leaves STA_UNSYNC (TIME_ERROR) on a disciplined clock.
        assert!(clock_finding(Ok((libc::TIME_ERROR, 250_000))).0, "judged by the maximum error, not the state");
        // Under systemd's ProtectClock=: unknown, not a degradation.
        let (ok, degraded, detail) = clock_finding(Err(std::io::Error::from_raw_os_error(libc::EPERM)));
        assert!(!ok && !degraded && detail.contains("ProtectClock"), "{detail}");
        let (ok, degraded, detail) = clock_finding(Err(std::io::Error::from_raw_os_error(libc::EINVAL)));
        assert!(!ok && !degraded && detail.contains("ntp_adjtime"), "{detail}");
    }

    fn range(first: u32, count: u32) -> sandbox::HostUids {
        sandbox::HostUids { first, count, lock: "/nonexistent/lock".into() }
    }

    #[test]
    fn the_passwd_sources_are_read_without_actions_or_comments() {
        let text =
            "# passwd: ignored\ngroup: files\npasswd:  files [NOTFOUND=return] sss  # directory\nshadow: files\n";
        assert_eq!(passwd_sources(text), ["files", "sss"]);
        assert!(passwd_sources("group: files\n").is_empty());
    }

    #[test]
    fn an_account_in_the_range_is_named_and_directories_are_noted() {
        let local: Vec<String> = vec!["files".into(), "systemd".into()];
        let ldap: Vec<String> = vec!["files".into(), "ldap".into()];
        let accounts = || vec![("root".to_string(), 0), ("alice".to_string(), 1_900_000_100)];
        let found = check_accounts(&range(1_900_000_000, 65536), &ldap, accounts);
        assert_eq!(found.problem.as_deref(), Some("the uid of alice (1900000100)"));
        assert_eq!(found.unlisted_sources, ["ldap"]);
        assert_eq!(check_accounts(&range(1_900_000_101, 10), &local, accounts), AccountsInRange::default());
        assert_eq!(check_accounts(&range(1_900_000_101, 10), &ldap, accounts).problem, None);
    }

    #[test]
    fn a_range_systemd_can_give_containers_is_reported_where_its_allocators_are_installed() {
        let r = |first, count| sandbox::HostUids { first, count, lock: "/run/lock".into() };
        let nspawn = ["/usr/bin/systemd-nspawn"];
        let e = container_range_overlap(&r(524_288 - 10, 11), &nspawn).unwrap();
        assert!(
            e.contains("overlaps systemd's container uids (524288-1879048191)") && e.contains("systemd-nspawn"),
            "{e}"
        );
        assert!(container_range_overlap(&r(1_879_048_191, 1), &nspawn).is_some());
        assert_eq!(container_range_overlap(&r(524_288 - 10, 10), &nspawn), None);
        assert_eq!(container_range_overlap(&r(1_879_048_192, 65536), &nspawn), None);
        assert_eq!(container_range_overlap(&r(600_000, 65536), &[]), None);
    }

    #[test]
    fn a_core_pattern_that_pipes_is_a_degradation() {
        assert!(core_pattern_finding(Some("core\n".into())).0);
        assert!(core_pattern_finding(Some("/var/crash/core.%p".into())).0);
        // systemd's own pattern passes the limit (%c), which systemd-coredump honours.
        assert!(core_pattern_finding(Some("|/usr/lib/systemd/systemd-coredump %P %u %g %s %t %c %h\n".into())).0);
        let (ok, detail) = core_pattern_finding(Some("|/usr/lib/systemd/systemd-coredump %P %u %g %s %t %h".into()));
        assert!(!ok && detail.contains("systemd-coredump") && detail.contains("RLIMIT_CORE"), "{detail}");
        assert!(!detail.contains("  "), "{detail}");
        let (ok, detail) = core_pattern_finding(Some("|/usr/share/apport/apport -p%p -s%s -c%c -d%d".into()));
        assert!(!ok && detail.contains("/usr/share/apport/apport"), "{detail}");
        assert!(!core_pattern_finding(None).0);
    }

    #[test]
    fn only_a_suid_dumpable_of_1_leaves_credential_changes_dumpable() {
        assert!(suid_dumpable_finding(Some(0)).0);
        assert!(suid_dumpable_finding(Some(2)).0);
        let (ok, detail) = suid_dumpable_finding(Some(1));
        assert!(!ok && detail.contains("set fs.suid_dumpable to 0 or 2"), "{detail}");
        assert!(!suid_dumpable_finding(None).0);
    }

    #[test]
    fn every_account_lists_this_hosts_accounts_through_nss() {
        let accounts = every_account();
        assert!(accounts.contains(&("root".to_string(), 0)), "{accounts:?}");
        // Twice in a row: the walk starts from the beginning each time.
        assert_eq!(every_account(), accounts);
    }
}
