//! opservant's sandbox policy: how a manifest's permissions and limits become a
//! [`SandboxSpec`]. This is where the agent's own rules live (the `sandbox` crate has none):
//! what is always masked, which declarations are refused, which limits apply.
//!
//! Guarantees: write access to system directories, the agent binary, its configuration and
//! its state — and every file of its own that its configuration names elsewhere (state
//! directory, socket, executors, keys, secrets, TLS files, audit log) — is refused even when
//! declared (naming the manifest field); those files are masked in every view, and key
//! material is never readable, even when declared by name; declared paths must exist; host
//! credentials stay masked; nothing in the host's `/proc` is bound for reading, and nothing
//! every host user may write to is bound for writing. Masks, the write protection of the
//! agent's files and system directories, and key material hold for the files, not only for
//! their names: a declared path is also checked for what its bind would show through other
//! mounts of the same filesystem (a bind mount on the host, a filesystem mounted twice), by
//! each path's place in its filesystem (`sandbox::mountinfo`) — of a system directory, its
//! own tree (a directory mounted beneath one from a disk also mounted elsewhere keeps the
//! path the operator gave it there). World-writable directories are judged at the declared
//! path and at the mounts beneath it, not at plain subdirectories.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sandbox::mountinfo::{MountTable, Shown};
use sandbox::{Access, Identity, Limits, PathRule, SandboxSpec, SeccompPolicy, SyntheticFile};
use thiserror::Error;

use crate::limits::{EffectiveLimits, LimitPolicy};
use crate::manifest::Manifest;

/// The agent's configuration directory.
pub const CONFIG_DIR: &str = "/etc/opservant";
/// The agent's state directories.
pub const STATE_DIRS: &[&str] = &["/var/lib/opservant", "/var/log/opservant", "/run/opservant"];

/// Directories no executor may write to, at or beneath.
const SYSTEM_DIRS: &[&str] = &[
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/sys",
    "/usr",
    "/var/lib",
    "/var/log",
    "/var/cache",
    "/var/spool",
    "/var/mail",
    "/var/backups",
];

/// Files no executor may read even when declared.
const NEVER_READABLE: &[&str] = &["/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-"];

/// The embedded interpreter's standard library (recorded at build time).
pub const PYTHON_STDLIB: &str = env!("OPSERVANT_PYTHON_STDLIB");

/// Loader and merged-/usr paths of an interpreter view (symlinks on merged-/usr hosts,
/// recreated as such; library directories elsewhere).
const LOADER_PATHS: &[&str] = &["/lib", "/lib64", "/lib32", "/libx32", "/usr/lib64"];

/// Host files an interpreter view shows besides the interpreter and its libraries: the
/// loader's cache, name resolution, time zones, MIME types and the TLS trust store. Missing
/// ones are skipped; `/etc/hosts`, `/etc/passwd` and `/etc/group` are synthetic.
const INTERPRETER_HOST_FILES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/nsswitch.conf",
    "/etc/resolv.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
    "/etc/services",
    "/etc/protocols",
    "/etc/localtime",
    "/etc/mime.types",
    "/etc/ssl/certs",
    "/usr/share/zoneinfo",
    "/usr/lib/ssl",
    "/usr/share/ca-certificates",
];

/// Directories holding the shared libraries this process has loaded (the runtime binary
/// is built by the same toolchain against the same libraries); from `/proc/self/maps`,
/// read once per process: the runtime's libraries sit beside those the agent loaded at
/// start (a library loaded later could only add a directory), and the map of a busy
/// multi-threaded agent is long (reading it per sandbox cost ~60 µs of CPU, measured under
/// `opservant bench`'s throughput test). A failed read is not cached (the next sandbox
/// tries again); meanwhile the list is empty and the runtime cannot start — a failed
/// start, not a wider view.
fn loaded_library_dirs() -> Vec<PathBuf> {
    static DIRS: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();
    if let Some(dirs) = DIRS.get() {
        return dirs.clone();
    }
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) => DIRS.get_or_init(|| library_dirs_in(&maps)).clone(),
        Err(_) => Vec::new(),
    }
}

/// The directories of the shared objects named in a `/proc/PID/maps` text.
fn library_dirs_in(maps: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else { continue };
        let p = Path::new(path);
        let is_lib = p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.contains(".so"));
        if let (true, Some(dir)) = (is_lib && p.is_absolute(), p.parent()) {
            if !dirs.iter().any(|d| d == dir) {
                dirs.push(dir.to_path_buf());
            }
        }
    }
    dirs
}

/// Replace the system part of `spec`'s view with an *interpreter view*: the embedded
/// interpreter's standard library, the shared libraries, and the few host files listed in
/// [`INTERPRETER_HOST_FILES`] — not `/usr` and `/etc` as a whole. Everything else an
/// executor reads must be declared in its manifest. The Landlock rules follow the view.
pub fn interpreter_view(spec: &mut SandboxSpec) {
    let mut system: Vec<PathRule> = Vec::new();
    let mut add = |path: PathBuf, optional: bool| {
        if !system.iter().any(|r| r.path == path) {
            system.push(PathRule { source: None, path, access: Access::Read, optional, identity: None });
        }
    };
    for p in LOADER_PATHS {
        add(PathBuf::from(p), true);
    }
    for d in loaded_library_dirs() {
        add(d, true);
    }
    // The standard library is not optional: without it the runtime cannot start.
    add(PathBuf::from(PYTHON_STDLIB), false);
    for p in INTERPRETER_HOST_FILES {
        add(PathBuf::from(p), true);
    }
    spec.filesystem.system = system;
    let inside = spec.identity.inside_uid;
    let inside_gid = spec.identity.inside_gid;
    let mut passwd = String::from("root:x:0:0:root:/root:/usr/sbin/nologin\n");
    let mut group = String::from("root:x:0:\n");
    if inside != 0 && inside != 65534 {
        passwd.push_str(&format!(
            "executor:x:{inside}:{inside_gid}:opservant executor:/tmp/opservant/scratch:/usr/sbin/nologin\n"
        ));
        group.push_str(&format!("executor:x:{inside_gid}:\n"));
    }
    passwd.push_str("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n");
    group.push_str("nogroup:x:65534:\n");
    spec.filesystem.synthetic.push(SyntheticFile { path: "/etc/passwd".into(), content: passwd });
    spec.filesystem.synthetic.push(SyntheticFile { path: "/etc/group".into(), content: group });
}

/// The window over which a runtime payload's CPU percentage is enforced (see
/// `sandbox::Limits::cpu_period_us`): at the default 10 %, 50 ms of CPU per 500 ms, so an
/// executor's import-and-return or a session call is not stalled for crossing a 100 ms
/// window's 10 ms; the average rate is the same.
pub const RUNTIME_CPU_PERIOD_US: u64 = 500_000;

/// Make `spec` run the executor runtime (`runtime`, an `execve`d payload): the application
/// channel, the runtime binary readable, and the CPU quota applied when the runtime reports
/// that its own (trusted) start-up is over — at the latest a second after it started — over
/// a [`RUNTIME_CPU_PERIOD_US`] window.
pub fn runtime_payload(spec: &mut SandboxSpec, runtime: &Path) {
    spec.command.app_channel = true;
    spec.limits.cpu_deferred = true;
    spec.limits.cpu_period_us = Some(RUNTIME_CPU_PERIOD_US);
    spec.filesystem.paths.push(PathRule {
        source: None,
        path: runtime.to_path_buf(),
        access: Access::Read,
        optional: false,
        identity: None,
    });
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error("{field}: {message}")]
pub struct PolicyError {
    pub field: String,
    pub message: String,
}

impl PolicyError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }
}

/// For commands that run without egress: a manifest asking for it is refused, never run
/// with less network than it declares.
pub fn refuse_egress(manifest: Option<&Manifest>, command: &str) -> Result<(), PolicyError> {
    match manifest {
        Some(m) if m.permissions.network.outbound => Err(PolicyError::new(
            "permissions.network.outbound",
            format!("{command} runs without network egress; refusing to run rather than run without the declared network (executors get egress through `opservant run`)"),
        )),
        _ => Ok(()),
    }
}

/// What a manifest declares that only `opservant run` (and the agent's `execute`) provides:
/// network egress, secrets (the runtime's channel to the agent is closed before a script
/// starts, and a session or a bare program has no vault), installed packages (`.deps`); and
/// for a Python payload (`python`) the interpreter version it requires. A manifest that
/// declares any of them is refused, naming the field: run without what it declared, the
/// payload would fail later, or worse, half-way (before the twenty-first session `script
/// --manifest` accepted `permissions.secrets`, `requirements.packages` and an unmet
/// `requirements.python` without a word).
pub fn refuse_unmet(manifest: Option<&Manifest>, command: &str, python: bool) -> Result<(), PolicyError> {
    refuse_egress(manifest, command)?;
    let Some(m) = manifest else { return Ok(()) };
    if !m.permissions.secrets.is_empty() {
        return Err(PolicyError::new(
            "permissions.secrets",
            format!("{command} gets no secrets; refusing to run rather than run without the declared secrets (executors get them through `opservant run`)"),
        ));
    }
    if !m.requirements.packages.is_empty() {
        return Err(PolicyError::new(
            "requirements.packages",
            format!("{command} gets no installed packages; refusing to run rather than run without them (an executor package gets them from `executor install`)"),
        ));
    }
    if let (true, Some(req)) = (python, &m.requirements.python) {
        let v = crate::executor_run::embedded_python();
        match crate::executor_run::python_requirement_ok(req, v) {
            Ok(true) => {}
            Ok(false) => {
                return Err(PolicyError::new(
                    "requirements.python",
                    format!("'{req}' is not satisfied by the embedded Python {}.{}.{}", v.0, v.1, v.2),
                ))
            }
            Err(e) => return Err(PolicyError::new("requirements.python", e)),
        }
    }
    Ok(())
}

/// The lock file through which every opservant process on the host — the service and
/// command-line runs alike — shares out the host uids of sandboxes ([`sandbox::host_uid`]).
/// Not in `/run/opservant`, which systemd removed when the service stopped before the unit
/// kept it (`RuntimeDirectoryPreserve=yes`), and which an operator's unit may still remove
/// (a command-line run's lease would then be on a file no later lease sees); the unit makes this directory
/// writable (`ReadWritePaths=`) and `systemd/tmpfiles.d` creates it at boot.
pub const HOST_UIDS_LOCK: &str = "/run/opservant-host-uids/lock";

/// The account sandboxes run as when it exists, whose `/etc/subuid` range `auto` takes.
const EXECUTOR_ACCOUNT: &str = "opservant-executor";

/// `sandbox.host_uids` resolved: an explicit range, or with `auto` (the default) the first
/// `/etc/subuid` range of [`EXECUTOR_ACCOUNT`] when sandboxes run as it; `None` when they
/// share the identity's uid. A range holding a local account's uid (or the identity's), or
/// another user's subordinate uids, or uids systemd hands out ([`SYSTEMD_UID_RANGES`]), is
/// an error naming it: processes running as them would share the sandbox's kernel
/// allowances, and could signal it. (Accounts of a directory service are not looked up
/// here: a range of tens of thousands of NSS lookups would stall every start; `opservant
/// doctor` lists every NSS account against the range, and `/etc/subuid` ranges are where
/// such ranges are registered.)
pub fn host_uids(
    setting: Option<&crate::config::HostUidsSetting>,
    identity: &Identity,
) -> Result<Option<sandbox::HostUids>, String> {
    use crate::config::HostUidsSetting;
    let (first, count, origin) = match setting {
        Some(HostUidsSetting::Named(n)) if n == "shared" => return Ok(None),
        Some(HostUidsSetting::Range(r)) => (r.first, r.count, "sandbox.host_uids".to_string()),
        _ => {
            let executor = Identity::local(EXECUTOR_ACCOUNT).ok();
            if executor.map(|e| e.host_uid) != Some(identity.host_uid) {
                return Ok(None);
            }
            let subuid = match std::fs::read_to_string("/etc/subuid") {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(format!("sandbox.host_uids: auto: cannot read /etc/subuid: {e}")),
            };
            match subuid_range(&subuid, EXECUTOR_ACCOUNT, identity.host_uid) {
                Some((first, count)) => (first, count, format!("/etc/subuid's range of {EXECUTOR_ACCOUNT}")),
                None => return Ok(None),
            }
        }
    };
    if let Some(e) = sandbox::HostUids::bounds_error(first, count) {
        return Err(format!("{origin}: {e}"));
    }
    let range = sandbox::HostUids { first, count, lock: HOST_UIDS_LOCK.into() };
    let passwd =
        std::fs::read_to_string("/etc/passwd").map_err(|e| format!("{origin}: cannot read /etc/passwd: {e}"))?;
    let taken = passwd.lines().find_map(|line| {
        let mut f = line.split(':');
        let name = f.next()?;
        let uid: u32 = f.nth(1)?.parse().ok()?;
        (first..=range.last()).contains(&uid).then(|| format!("the uid of {name} ({uid})"))
    });
    // Another user's subordinate uids: that user may map them into a namespace of its own
    // (newuidmap) and run processes as them.
    // The executor account's own range is what `auto` takes — when sandboxes run as it.
    let executor_uid =
        Identity::local(EXECUTOR_ACCOUNT).ok().map(|e| e.host_uid).filter(|uid| *uid == identity.host_uid);
    // No file is no delegation; one that cannot be read is not known to hold none.
    let subuid = match std::fs::read_to_string("/etc/subuid") {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("{origin}: cannot read /etc/subuid to check the range against it: {e}")),
    };
    let delegated = subuid_overlap(&subuid, &range, executor_uid);
    let systemd = SYSTEMD_UID_RANGES
        .iter()
        .find(|(_, low, high)| *low <= range.last() && first <= *high)
        .map(|(what, low, high)| format!("{what} uids ({low}-{high})"));
    if let Some(account) = taken.or(delegated).or(systemd).or_else(|| {
        (first..=range.last())
            .contains(&identity.host_uid)
            .then(|| format!("the sandbox identity ({})", identity.host_uid))
    }) {
        return Err(format!(
            "{origin}: {first}-{} holds {account}: sandboxes must run as uids no account and no other user's namespaces use",
            range.last()
        ));
    }
    Ok(Some(range))
}

/// The uid ranges systemd hands out on its own (its `docs/UIDS-GIDS.md`), to processes and
/// files no `/etc/passwd` line names: a `systemd-homed` user's, a unit's with `DynamicUser=`,
/// and the "foreign" range (files of images `systemd-mountfsd` maps into other user
/// namespaces). Its containers' range ([`SYSTEMD_CONTAINER_UIDS`]) is left out:
/// `/etc/subuid` ranges commonly lie there; `doctor` reports an overlap where a systemd tool
/// that allocates from it is installed.
const SYSTEMD_UID_RANGES: [(&str, u32, u32); 3] = [
    ("systemd-homed's", 60001, 60513),
    ("systemd's DynamicUser=", 61184, 65519),
    ("systemd's foreign", 2_147_352_576, 2_147_418_111),
];

/// The uids `systemd-nspawn --private-users=pick` and `systemd-nsresourced` allocate
/// 65 536 at a time to containers and user namespaces (`docs/UIDS-GIDS.md`), checking only
/// that no account names the first of them.
pub const SYSTEMD_CONTAINER_UIDS: (u32, u32) = (524_288, 1_879_048_191);

/// Another user's subordinate uids (in the text of `/etc/subuid`) that `range` overlaps —
/// not [`EXECUTOR_ACCOUNT`]'s (by name or by its uid, `executor_uid`) when sandboxes run as
/// it, which `auto` takes: that user may map them into a namespace of its own
/// (`newuidmap`) and run processes as them.
fn subuid_overlap(text: &str, range: &sandbox::HostUids, executor_uid: Option<u32>) -> Option<String> {
    text.lines().find_map(|line| {
        let mut f = line.trim().split(':');
        let who = f.next()?;
        let (start, n): (u32, u32) = (f.next()?.parse().ok()?, f.next()?.parse().ok()?);
        let mine = executor_uid.is_some() && (who == EXECUTOR_ACCOUNT || who.parse::<u32>().ok() == executor_uid);
        let overlaps = n > 0
            && u64::from(start) <= u64::from(range.last())
            && u64::from(start) + u64::from(n) > u64::from(range.first);
        (overlaps && !mine).then(|| format!("{who}'s subordinate uids in /etc/subuid ({start}+{n})"))
    })
}

/// The first range of `name` (or of its uid, `uid`) in the text of `/etc/subuid`
/// (`NAME:FIRST:COUNT` lines).
fn subuid_range(text: &str, name: &str, uid: u32) -> Option<(u32, u32)> {
    text.lines().find_map(|line| {
        let mut f = line.trim().split(':');
        let who = f.next()?;
        if who != name && who.parse::<u32>().ok() != Some(uid) {
            return None;
        }
        Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
    })
}

/// Agent-wide settings that shape every sandbox.
#[derive(Debug, Clone)]
pub struct AgentPolicy {
    pub limits: LimitPolicy,
    pub landlock_min_abi: u32,
    pub allow_degraded: bool,
    pub seccomp: SeccompPolicy,
    pub identity: Identity,
    /// The host uids sandboxes run as, one each (`sandbox.host_uids`); `None`: the
    /// identity's own, shared.
    pub host_uids: Option<sandbox::HostUids>,
    /// Paths protected from writes besides the system directories (binary, config, state,
    /// and every file of the agent's own its configuration names).
    pub protected: Vec<PathBuf>,
    /// Masked in every view besides the sandbox's defaults: the configuration and state
    /// directories and the agent's own files outside them (as named and as their real
    /// paths). A path declared by its own name is shown (a credential never is).
    pub masked: Vec<PathBuf>,
    /// Key material, with the configuration key naming it: never readable, even when
    /// declared by its own name or reached through a symlink.
    pub credentials: Vec<(String, PathBuf)>,
    /// `SYSTEM_DIRS` and `NEVER_READABLE` as named and as their real paths (`/root` is
    /// `/var/roothome` on ostree hosts).
    pub system_dirs: Vec<PathBuf>,
    pub never_readable: Vec<PathBuf>,
}

impl AgentPolicy {
    /// Built-in defaults: the shipped limit policy, Landlock required (ABI ≥ 1), no degraded
    /// mode, the default seccomp profile, the `opservant-executor` (or `nobody`) identity.
    pub fn builtin() -> Result<Self, String> {
        Self::with_own_paths(&crate::config::Config::default())
    }

    /// The built-in policy with the agent's own files as `config` names them.
    fn with_own_paths(config: &crate::config::Config) -> Result<Self, String> {
        let identity = Identity::default_executor().map_err(|e| e.to_string())?;
        let mut p = Self {
            limits: LimitPolicy::builtin(),
            landlock_min_abi: 1,
            allow_degraded: false,
            seccomp: sandbox::seccomp::default_policy()?,
            identity,
            host_uids: None,
            protected: Vec::new(),
            masked: Vec::new(),
            credentials: Vec::new(),
            system_dirs: Vec::new(),
            never_readable: Vec::new(),
        };
        let mut parents = Vec::new();
        for dir in SYSTEM_DIRS {
            p.system_dirs.extend(as_named_and_real(Path::new(dir), &mut parents));
        }
        for file in NEVER_READABLE {
            p.never_readable.extend(as_named_and_real(Path::new(file), &mut parents));
        }
        // The sandbox's own masks as their real paths too (each view masks them by name).
        for path in sandbox::spec::DEFAULT_MASKED_PATHS {
            p.masked.extend(as_named_and_real(Path::new(path), &mut parents).into_iter().skip(1));
        }
        for dir in std::iter::once(CONFIG_DIR).chain(STATE_DIRS.iter().copied()) {
            for path in as_named_and_real(Path::new(dir), &mut parents) {
                p.protected.push(path.clone());
                p.masked.push(path);
            }
        }
        if let Ok(exe) = std::env::current_exe() {
            p.protected.push(exe);
        }
        // The executor runtime binary is the payload of every executor sandbox.
        if let Ok(runtime) = crate::executor_run::runtime_binary() {
            p.protected.push(runtime);
        }
        p.add_own_paths(&config.own_paths(), &mut parents);
        Ok(p)
    }

    /// Protect the agent's own files, mask the private ones and make its credentials
    /// unreadable, as named and as their real paths. Each private file is masked on its
    /// own, also beneath a masked directory: a path declared beneath a mask is shown on top
    /// of it, and a directory declared by its own name is not masked. The root directory is
    /// protected but never masked.
    fn add_own_paths(&mut self, own: &[crate::config::OwnPath], parents: &mut Vec<(PathBuf, Option<PathBuf>)>) {
        use crate::config::OwnKind;
        let mut masked: std::collections::HashSet<PathBuf> = self.masked.iter().cloned().collect();
        for o in own {
            for path in as_named_and_real(&o.path, parents) {
                if o.kind == OwnKind::Credential {
                    self.credentials.push((o.key.clone(), path.clone()));
                }
                if o.kind != OwnKind::Public && path != Path::new("/") && masked.insert(path.clone()) {
                    self.masked.push(path.clone());
                }
                self.protected.push(path);
            }
        }
    }

    /// The built-in policy adjusted by the agent configuration (limits, Landlock minimum,
    /// degraded mode, the agent's own files).
    pub fn from_config(config: &crate::config::Config) -> Result<Self, String> {
        let mut p = Self::with_own_paths(config)?;
        p.limits = config.limit_policy(p.limits).map_err(|e| e.to_string())?;
        if let Some(abi) = config.sandbox.landlock_min_abi {
            p.landlock_min_abi = abi;
        }
        p.allow_degraded = config.sandbox.allow_degraded;
        p.host_uids = host_uids(config.sandbox.host_uids.as_ref(), &p.identity)?;
        Ok(p)
    }

    /// Build the spec for `program args…` under `manifest`'s permissions and limits (or the
    /// defaults). Network egress is not part of the spec: callers that support it wire it
    /// (`crate::egress`), the others call [`refuse_egress`].
    pub fn spec_for(
        &self,
        manifest: Option<&Manifest>,
        program: &str,
        args: Vec<String>,
    ) -> Result<(SandboxSpec, EffectiveLimits), PolicyError> {
        let default_manifest_limits = Default::default();
        let requested = manifest.map(|m| &m.resource_limits).unwrap_or(&default_manifest_limits);
        let limits = self.limits.resolve(requested);
        let mut spec = SandboxSpec::new(program, args, self.identity);
        spec.host_uids = self.host_uids.clone();
        // No netlink in any sandbox, egress or not: what a netlink socket queues is charged to
        // no memory cgroup (up to `net.core.rmem_max` ×2 on each descriptor). Interfaces are
        // in /proc/net; glibc's getaddrinfo assumes both address families when it cannot ask.
        spec.seccomp = sandbox::seccomp::refusing_netlink(&self.seccomp).map_err(|e| PolicyError::new("seccomp", e))?;
        spec.landlock.min_abi = self.landlock_min_abi;
        // Resolved limits are at most the ceilings, which the configuration bounds by
        // limits::MAXIMA (1 TiB): checked anyway, so no value ever wraps into a tiny limit.
        let mb = |field: &str, v: u64| {
            v.checked_mul(1 << 20).ok_or_else(|| PolicyError::new(field, format!("{v} MB does not fit in bytes")))
        };
        spec.filesystem.scratch_bytes = mb("resource_limits.max_disk_mb", limits.max_disk_mb)?;
        spec.filesystem.masked.extend(self.masked.iter().cloned());
        spec.filesystem.synthetic.push(SyntheticFile {
            path: "/etc/hosts".into(),
            content: format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{}\n",
                spec.hostname
            ),
        });
        spec.limits = Limits {
            memory_bytes: Some(mb("resource_limits.max_memory_mb", limits.max_memory_mb)?),
            cpu_percent: Some(u32::try_from(limits.max_cpu_percent).unwrap_or(u32::MAX)),
            pids: Some(u32::try_from(limits.max_pids).unwrap_or(u32::MAX)),
            timeout_ms: Some(limits.timeout_seconds.saturating_mul(1000)),
            allow_degraded: self.allow_degraded,
            ..Limits::default()
        };
        if let Some(m) = manifest {
            // The network entries are checked here (so lint reports them); egress itself is
            // wired by the caller that supports it (see `refuse_egress`).
            crate::egress::NetworkPolicy::from_manifest(&m.permissions.network, &crate::config::Config::default(), 0)?;
            let masked = spec.filesystem.masked.clone();
            let fs = &m.permissions.filesystem;
            let mounts = if fs.read.is_empty() && fs.write.is_empty() {
                MountTable::default()
            } else {
                host_mounts("permissions.filesystem")?
            };
            for (i, p) in m.permissions.filesystem.read.iter().enumerate() {
                let field = format!("permissions.filesystem.read[{i}]");
                let real = self.check_read_in(&field, p, &masked, &mounts)?;
                // The file checked is the file bound: its identity now, taken with its type
                // checked once more (a socket or FIFO put in its place after the checks above
                // is refused here, or fails the bind as another file).
                let meta = std::fs::metadata(&real)
                    .map_err(|e| PolicyError::new(&field, format!("{}: {e}", real.display())))?;
                refuse_ipc_endpoint_kind(&field, p, &real, &meta.file_type())?;
                spec.filesystem.paths.push(PathRule {
                    source: Some(real),
                    path: p.clone(),
                    access: Access::Read,
                    optional: false,
                    identity: Some(sandbox::FileId::of(&meta)),
                });
            }
            for (i, p) in m.permissions.filesystem.write.iter().enumerate() {
                let field = format!("permissions.filesystem.write[{i}]");
                let source = self.check_write(&field, p, &masked, &mounts)?;
                spec.filesystem.paths.push(PathRule {
                    source,
                    path: p.clone(),
                    access: Access::ReadWrite,
                    optional: false,
                    identity: None,
                });
            }
        }
        spec.validate().map_err(|e| PolicyError::new(e.field, e.message))?;
        Ok((spec, limits))
    }

    /// A declared read path: allowed, and the real host path to bind at it. `masked` is the
    /// view's masks (a declaration through a symlink must not show one).
    pub fn check_read(&self, field: &str, p: &Path, masked: &[PathBuf]) -> Result<PathBuf, PolicyError> {
        self.check_read_in(field, p, masked, &host_mounts(field)?)
    }

    /// [`Self::check_read`] against the host's mount table `mounts`.
    fn check_read_in(
        &self,
        field: &str,
        p: &Path,
        masked: &[PathBuf],
        mounts: &MountTable,
    ) -> Result<PathBuf, PolicyError> {
        // Read paths, /tmp included, are bound from the host (only writes under /tmp land in
        // the scratch).
        // The declared text first (a refusal does not depend on what exists), then its real
        // path.
        refuse_sandbox_owned(field, p)?;
        self.refuse_read(field, p, p)?;
        let real = real_path(field, p)?;
        self.refuse_read(field, p, &real)?;
        check_alias(field, p, &real, masked)?;
        refuse_procfs(field, p, &real, mounts)?;
        refuse_ipc_endpoints(field, p, &real)?;
        refuse_over_scratch(field, p, &real)?;
        let bind = Bind::new(p, &real, mounts);
        self.refuse_read_elsewhere(field, &bind)?;
        self.refuse_masked_elsewhere(field, &bind, masked)?;
        Ok(real)
    }

    /// A declared write path: allowed, and the real host path to bind at it (`None` under
    /// `/tmp`: the sandbox's private scratch, nothing of the host).
    fn check_write(
        &self,
        field: &str,
        p: &Path,
        masked: &[PathBuf],
        mounts: &MountTable,
    ) -> Result<Option<PathBuf>, PolicyError> {
        // Writes under /tmp land in the sandbox's private scratch tmpfs.
        if p.starts_with("/tmp") {
            return Ok(None);
        }
        // The declared text first (a refusal does not depend on what exists), then its real
        // path.
        refuse_sandbox_owned(field, p)?;
        self.refuse_write(field, p, p)?;
        let real = real_path(field, p)?;
        self.refuse_write(field, p, &real)?;
        check_alias(field, p, &real, masked)?;
        refuse_shared_with_everyone(field, p, &real)?;
        refuse_procfs(field, p, &real, mounts)?;
        refuse_shared_mounts_beneath(field, p, &real, mounts)?;
        let bind = Bind::new(p, &real, mounts);
        self.refuse_write_elsewhere(field, &bind)?;
        self.refuse_read_elsewhere(field, &bind)?;
        self.refuse_masked_elsewhere(field, &bind, masked)?;
        Ok(Some(real))
    }

    /// Refuse writing to `q`, declared as `p`, when it is or overlaps what is never granted.
    fn refuse_write(&self, field: &str, p: &Path, q: &Path) -> Result<(), PolicyError> {
        if q == Path::new("/") || q == Path::new("/var") || self.system_dirs.iter().any(|d| q.starts_with(d)) {
            return Err(PolicyError::new(
                field,
                format!("{}{}: writing to system directories is never granted", p.display(), via(p, q)),
            ));
        }
        if let Some(hit) = self.protected.iter().find(|x| x.starts_with(q) || q.starts_with(x)) {
            return Err(PolicyError::new(
                field,
                format!(
                    "{}{}: overlaps the agent's own files ({}); never granted",
                    p.display(),
                    via(p, q),
                    hit.display()
                ),
            ));
        }
        Ok(())
    }

    /// Refuse reading `q`, declared as `p`, when it holds host credentials or the agent's
    /// key material (or lies beneath such a directory).
    fn refuse_read(&self, field: &str, p: &Path, q: &Path) -> Result<(), PolicyError> {
        // `/etc/mtab` is `../proc/self/mounts`: bound, it would show the agent's own mount
        // table (and `/proc/PID/…` another host process's files) beside the sandbox's procfs.
        if q.starts_with("/proc") {
            return Err(PolicyError::new(
                field,
                format!(
                    "{}{} is in the host's /proc: the sandbox has a /proc of its own, and host /proc entries are never bound",
                    p.display(),
                    via(p, q)
                ),
            ));
        }
        if self.never_readable.iter().any(|n| q == n) {
            return Err(PolicyError::new(
                field,
                format!("{}{} holds host credentials and is never readable", p.display(), via(p, q)),
            ));
        }
        if let Some((key, _)) = self.credentials.iter().find(|(_, c)| q.starts_with(c)) {
            return Err(PolicyError::new(
                field,
                format!("{}{} is the agent's key material ({key}) and is never readable", p.display(), via(p, q)),
            ));
        }
        Ok(())
    }

    /// [`Self::refuse_write`] for what a write bind would reach through other mounts of the
    /// same files: `/`, `/var`, a system directory (its own tree: a directory mounted beneath
    /// one from elsewhere keeps the path the operator gave it) or the agent's own files (with
    /// whatever is mounted beneath them).
    fn refuse_write_elsewhere(&self, field: &str, bind: &Bind) -> Result<(), PolicyError> {
        for whole in ["/", "/var"] {
            if let Some((s, t)) = bind.find(Path::new(whole), Trees::Own, |s, t| t.is_within(s)) {
                return Err(bind.refused(field, s, &t, format!("the whole of the host's {whole}; never granted")));
            }
        }
        for dir in &self.system_dirs {
            if let Some((s, t)) = bind.find(dir, Trees::Own, Shown::overlaps) {
                let why = format!("the host's {} is a system directory, never granted for writing", dir.display());
                return Err(bind.refused(field, s, &t, why));
            }
        }
        for x in &self.protected {
            if let Some((s, t)) = bind.find(x, Trees::All, Shown::overlaps) {
                let why = format!("those are the agent's own files ({}), never granted", x.display());
                return Err(bind.refused(field, s, &t, why));
            }
        }
        Ok(())
    }

    /// [`Self::refuse_read`] for what a bind would show through other mounts of the same
    /// files: the agent's key material or host credentials. (What holds them is masked:
    /// [`Self::refuse_masked_elsewhere`].)
    fn refuse_read_elsewhere(&self, field: &str, bind: &Bind) -> Result<(), PolicyError> {
        for n in &self.never_readable {
            if let Some((s, t)) = bind.find(n, Trees::All, Shown::is_within) {
                let why = format!("{} holds host credentials and is never readable", n.display());
                return Err(bind.refused(field, s, &t, why));
            }
        }
        for (key, c) in &self.credentials {
            if let Some((s, t)) = bind.find(c, Trees::All, Shown::is_within) {
                let why = format!("that is the agent's key material ({key}), never readable");
                return Err(bind.refused(field, s, &t, why));
            }
        }
        Ok(())
    }

    /// A mask covers a path of the view: a bind that would show what a mask hides (the masked
    /// path and whatever is mounted beneath it) at any other place of the view — through
    /// another mount of the same files — is refused, as one reaching it through a symlink is
    /// ([`check_alias`]). A masked path that does not exist has nothing to show.
    fn refuse_masked_elsewhere(&self, field: &str, bind: &Bind, masked: &[PathBuf]) -> Result<(), PolicyError> {
        for m in masked {
            let elsewhere = |s: &Shown, t: &Shown| bind.place(s, t).is_some_and(|v| !v.starts_with(m));
            let Some((s, t)) = bind.find(m, Trees::All, elsewhere) else { continue };
            if std::fs::symlink_metadata(m).is_err() {
                continue;
            }
            let view = bind.place(s, &t).unwrap_or_else(|| s.at.clone());
            let never = self.never_readable.contains(m) || self.credentials.iter().any(|(_, c)| c == m);
            let advice = if never { "it is never shown" } else { "declare the masked path itself to show it" };
            let why = format!("the masked {} would be shown at {}; {advice}", m.display(), view.display());
            return Err(bind.refused(field, s, &t, why));
        }
        Ok(())
    }
}

/// Which of a listed path's trees [`Bind::find`] compares: its own (the files at the path),
/// or all it shows (with the mounts beneath it).
#[derive(Clone, Copy)]
enum Trees {
    Own,
    All,
}

/// What a declared path's (recursive) bind shows — its own tree and every mount beneath it
/// (`sandbox::mountinfo`) — to find the same files as a listed path's reached through
/// another mount of them. A listed path is compared as it is named; the lists hold real
/// paths beside the names (`as_named_and_real`).
struct Bind<'a> {
    /// As declared (its place in the view) and its real host path.
    p: &'a Path,
    real: &'a Path,
    /// What it shows, by filesystem.
    shown: HashMap<String, Vec<Shown>>,
    mounts: &'a MountTable,
}

impl<'a> Bind<'a> {
    fn new(p: &'a Path, real: &'a Path, mounts: &'a MountTable) -> Bind<'a> {
        let mut shown: HashMap<String, Vec<Shown>> = HashMap::new();
        for s in mounts.shown_by(real) {
            shown.entry(s.device.clone()).or_default().push(s);
        }
        Bind { p, real, shown, mounts }
    }

    /// The first pair of what this shows and what listed path `x` shows (its `trees`) of
    /// one filesystem for which `test` holds. Costs the depth of `x`, a scan of the table
    /// only when mounts lie beneath `x`, and what this shows of the same filesystems.
    fn find(&self, x: &Path, trees: Trees, test: impl Fn(&Shown, &Shown) -> bool) -> Option<(&Shown, Shown)> {
        let mut listed: Vec<Shown> = self.mounts.own_tree(x).into_iter().collect();
        if let Trees::All = trees {
            listed.extend(self.mounts.mounts_beneath(x));
        }
        for t in listed {
            if let Some(s) = self.shown.get(&t.device).and_then(|same| same.iter().find(|s| test(s, &t))) {
                return Some((s, t));
            }
        }
        None
    }

    /// Where in the view `s` shows what `t` shows: its root's place when it lies in `s`,
    /// `s`'s own place when `s` lies in it.
    fn place(&self, s: &Shown, t: &Shown) -> Option<PathBuf> {
        let at = s.place_of(t).or_else(|| s.is_within(t).then(|| s.at.clone()))?;
        Some(match at.strip_prefix(self.real) {
            Ok(rel) if rel.as_os_str().is_empty() => self.p.to_path_buf(),
            Ok(rel) => self.p.join(rel),
            Err(_) => at,
        })
    }

    /// The refusal of this bind for showing `t`'s files through `s`: names the mount, the
    /// filesystem and the other place of the files.
    fn refused(&self, field: &str, s: &Shown, t: &Shown, why: String) -> PolicyError {
        let whose = if s.at == self.real { String::new() } else { format!(" (its mount {})", s.at.display()) };
        PolicyError::new(
            field,
            format!(
                "{}{}{whose} reaches files of {} through another mount of the same filesystem ({}, {} in it); {why}",
                self.p.display(),
                via(self.p, self.real),
                t.at.display(),
                s.device,
                s.root.display()
            ),
        )
    }
}

/// The host's mounts now (a declared path's checks read them once).
fn host_mounts(field: &str) -> Result<MountTable, PolicyError> {
    let table = MountTable::read().map_err(|e| PolicyError::new(field, format!("/proc/self/mountinfo: {e}")))?;
    if !table.places_root() {
        // A chroot into a directory that is not a mount point: no path's filesystem is
        // known, so nothing declared could be checked for other mounts of its files.
        return Err(PolicyError::new(
            field,
            "/proc/self/mountinfo does not list the mount of / (a chroot?): declared paths cannot be checked against other mounts of their files",
        ));
    }
    Ok(table)
}

/// Refuses a write path that every user of the host may write to (`/var/tmp`, a mode-777
/// directory): shared with host processes, it would let the payload plant files or links
/// for them, and read or replace theirs. A directory of the executor's own is declared
/// instead. So is one in a directory every user may write to without the sticky bit: any
/// user could rename it away and put a directory of theirs in its place between this check
/// and the bind, and read what the payload writes there.
fn refuse_shared_with_everyone(field: &str, p: &Path, real: &Path) -> Result<(), PolicyError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::symlink_metadata(real).map_err(|e| PolicyError::new(field, format!("{}: {e}", p.display())))?;
    if meta.permissions().mode() & 0o002 != 0 {
        return Err(PolicyError::new(
            field,
            format!(
                "{}{}: every user of the host may write there; never granted (declare a directory of the executor's own)",
                p.display(),
                via(p, real)
            ),
        ));
    }
    for parent in real.ancestors().skip(1) {
        let mode = std::fs::symlink_metadata(parent)
            .map_err(|e| PolicyError::new(field, format!("{}: {e}", parent.display())))?
            .permissions()
            .mode();
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            return Err(PolicyError::new(
                field,
                format!(
                    "{}{}: every user of the host may rename it away and put another in its place ({} is writable by all, without the sticky bit); never granted",
                    p.display(),
                    via(p, real),
                    parent.display()
                ),
            ));
        }
    }
    Ok(())
}

/// [`refuse_shared_with_everyone`] for what a write bind takes along: a mount beneath the
/// declared directory whose own directory every user of the host may write to (a bind of
/// `/var/tmp`, a mode-1777 tmpfs) is as shared as the declared path would be.
fn refuse_shared_mounts_beneath(field: &str, p: &Path, real: &Path, mounts: &MountTable) -> Result<(), PolicyError> {
    use std::os::unix::fs::PermissionsExt;
    for m in mounts.mounts_beneath(real) {
        // One that cannot be looked at (covered, or beyond the agent's reach) is judged as
        // shared: it is bound writable all the same.
        let mode = std::fs::symlink_metadata(&m.at).map(|meta| meta.permissions().mode()).unwrap_or(0o777);
        if mode & 0o002 != 0 {
            return Err(PolicyError::new(
                field,
                format!(
                    "{}{}: {} is mounted beneath it, and every user of the host may write there; never granted (declare a directory of the executor's own)",
                    p.display(),
                    via(p, real),
                    m.at.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Refuse reading `real` (declared as `p`) when it is a Unix socket or a FIFO, or a
/// directory in the host's runtime directory (`/run`, `/var/run`), where its daemons keep
/// theirs: a read-only bind stops writes to files, not a `connect()` to a socket nor opening
/// a FIFO for writing, and Landlock's `resolve_unix`, which would, is not in every kernel.
/// A regular file there (`/run/utmp`, a pidfile) is readable. Talking to a socket is a
/// write grant (`permissions.filesystem.write`), which `/run` never gets. (A socket made
/// later inside another declared directory is not seen here: see README, Not done yet.)
fn refuse_ipc_endpoints(field: &str, p: &Path, real: &Path) -> Result<(), PolicyError> {
    match std::fs::metadata(real) {
        Ok(meta) => refuse_ipc_endpoint_kind(field, p, real, &meta.file_type()),
        Err(_) => Ok(()),
    }
}

/// [`refuse_ipc_endpoints`] for a file type already read.
fn refuse_ipc_endpoint_kind(field: &str, p: &Path, real: &Path, kind: &std::fs::FileType) -> Result<(), PolicyError> {
    use std::os::unix::fs::FileTypeExt;
    let kind = Some(kind);
    let why = match kind {
        Some(t) if t.is_socket() => "is a Unix socket",
        Some(t) if t.is_fifo() => "is a FIFO",
        Some(t) if t.is_dir() && real.starts_with("/run") => {
            "is a directory of the host's runtime directory, where its daemons' sockets are"
        }
        _ => return Ok(()),
    };
    let advice = if real.starts_with("/run") {
        "declare the files you need in it (the host's runtime directory is never writable, so none of its sockets can be granted)"
    } else {
        "declare it under permissions.filesystem.write to talk to it"
    };
    Err(PolicyError::new(
        field,
        format!(
            "{}{} {why}: a read-only bind does not stop connecting to a socket or writing to a FIFO; {advice}",
            p.display(),
            via(p, real)
        ),
    ))
}

/// A read grant of the sandbox's own `/tmp` — host `/tmp`, or where in it the private
/// scratch is (`/tmp/opservant`) — would bind the host's directory over the scratch: its
/// working directory, `HOME` and `TMPDIR` gone, and the host's `/tmp`, with every user's
/// sockets there (X11's are every user's to connect to), in their place.
/// `/dev` and `/sys` in the sandbox are its own (a few devices; an empty sysfs), as `/proc`
/// is: nothing of the host's can be declared there (the sandbox's spec would refuse it too,
/// naming its own field rather than the manifest's).
fn refuse_sandbox_owned(field: &str, p: &Path) -> Result<(), PolicyError> {
    for (own, what) in [("/dev", "null, zero, full, random, urandom and a private shm"), ("/sys", "an empty directory")]
    {
        if p.starts_with(own) {
            return Err(PolicyError::new(
                field,
                format!(
                    "{}: {own} in the sandbox is its own ({what}); nothing of the host's is shown there",
                    p.display()
                ),
            ));
        }
    }
    Ok(())
}

fn refuse_over_scratch(field: &str, p: &Path, real: &Path) -> Result<(), PolicyError> {
    let scratch = Path::new(sandbox::spec::SCRATCH_DIR);
    let own = scratch.parent().unwrap_or(scratch);
    if scratch.starts_with(real) || real.starts_with(own) {
        return Err(PolicyError::new(
            field,
            format!(
                "{}{} is the sandbox's own /tmp, its private scratch: a read grant would put the host's there; \
                 declare the files you need in it, or a write path under /tmp for scratch space",
                p.display(),
                via(p, real)
            ),
        ));
    }
    Ok(())
}

/// Refuses a declared path in a procfs or with one mounted at or beneath it (`mount -t
/// proc proc /srv/p`, a container's root below a declared directory): that is the host's
/// /proc by another name, and a bind takes what is mounted beneath it along.
fn refuse_procfs(field: &str, p: &Path, real: &Path, mounts: &MountTable) -> Result<(), PolicyError> {
    let refused = |what: String| {
        PolicyError::new(
            field,
            format!(
                "{}{}: {what}: the sandbox has a /proc of its own, and host /proc entries are never bound",
                p.display(),
                via(p, real)
            ),
        )
    };
    if nix::sys::statfs::statfs(real).is_ok_and(|f| f.filesystem_type() == nix::sys::statfs::PROC_SUPER_MAGIC) {
        return Err(refused("a procfs of the host".into()));
    }
    if let Some(m) = mounts.mounts().iter().find(|m| m.fstype == "proc" && m.mount_point.starts_with(real)) {
        return Err(refused(format!("a procfs of the host is mounted beneath it, on {}", m.mount_point.display())));
    }
    // The kernel's own interfaces (tracing, debugging, security modules, BPF objects,
    // firmware variables, crash records, binfmt handlers): never a sandbox's business, as
    // declared or beneath what is declared.
    let magic = nix::sys::statfs::statfs(real).ok().map(|f| f.filesystem_type());
    if let Some((name, _)) = KERNEL_INTERFACE_FS.iter().find(|(_, m)| Some(*m) == magic) {
        return Err(PolicyError::new(
            field,
            format!("{}{}: is in the host's {name}, a kernel interface; never bound", p.display(), via(p, real)),
        ));
    }
    let kernel_interface = |fstype: &str| KERNEL_INTERFACE_FS.iter().any(|(name, _)| *name == fstype);
    if let Some(m) = mounts.mounts().iter().find(|m| kernel_interface(&m.fstype) && m.mount_point.starts_with(real)) {
        return Err(PolicyError::new(
            field,
            format!(
                "{}{}: the host's {} (a kernel interface) is mounted beneath it, on {}; never bound",
                p.display(),
                via(p, real),
                m.fstype,
                m.mount_point.display()
            ),
        ));
    }
    Ok(())
}

/// Kernel-interface filesystems no declared path may be in or hold (mountinfo type, statfs
/// magic).
const KERNEL_INTERFACE_FS: &[(&str, nix::sys::statfs::FsType)] = &[
    ("tracefs", nix::sys::statfs::FsType(0x7472_6163)),
    ("debugfs", nix::sys::statfs::FsType(0x6462_6720)),
    ("securityfs", nix::sys::statfs::FsType(0x7363_6673)),
    ("bpf", nix::sys::statfs::FsType(0xcafe_4a11)),
    ("configfs", nix::sys::statfs::FsType(0x6265_6570)),
    ("efivarfs", nix::sys::statfs::FsType(0xde5e_81e4)),
    ("pstore", nix::sys::statfs::FsType(0x6165_676c)),
    ("binfmt_misc", nix::sys::statfs::FsType(0x4249_4e4d)),
    ("fusectl", nix::sys::statfs::FsType(0x6573_5543)),
    ("selinuxfs", nix::sys::statfs::FsType(0xf97c_ff8c)),
    ("smackfs", nix::sys::statfs::FsType(0x4341_5d53)),
];

/// `path`, and its real path when that differs (symlinks resolved; for a path that does
/// not exist yet, its parent's real path and its name): a view binds real paths, so what
/// is protected or masked by one name must be by the other. Parents' real paths are
/// remembered in `parents` (the audit log's rotated files share one), so each costs one
/// `realpath` and each path one `lstat`.
fn as_named_and_real(path: &Path, parents: &mut Vec<(PathBuf, Option<PathBuf>)>) -> Vec<PathBuf> {
    let real = match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => {
            let real_parent = match parents.iter().find(|(p, _)| p == parent) {
                Some((_, r)) => r.clone(),
                None => {
                    let r = std::fs::canonicalize(parent).ok();
                    parents.push((parent.to_path_buf(), r.clone()));
                    r
                }
            };
            match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path).ok(),
                // `name` is not a link: a `..` or `.` is not a file name, so it is real
                // beneath the real parent.
                _ => real_parent.map(|d| d.join(name)),
            }
        }
        _ => None,
    };
    match real {
        Some(r) if r != path => vec![path.to_path_buf(), r],
        _ => vec![path.to_path_buf()],
    }
}

/// ` (through a symlink, X)` when the checked `q` is the real path of `p`, not `p` itself.
fn via(p: &Path, q: &Path) -> String {
    if p == q {
        String::new()
    } else {
        format!(" (through a symlink, {})", q.display())
    }
}

/// The real path of `p` on the host (symlinks resolved): what the sandbox binds at `p`,
/// exactly — it binds it without following symlinks, so one swapped in after this check
/// fails the run instead of widening the view. `p` must exist.
fn real_path(field: &str, p: &Path) -> Result<PathBuf, PolicyError> {
    std::fs::canonicalize(p).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => PolicyError::new(field, format!("{} does not exist on this host", p.display())),
        _ => PolicyError::new(field, format!("{}: {e}", p.display())),
    })
}

/// A path that reaches a masked one through a symlink is refused: masks cover paths of the
/// view, and what is bound at `p` would show the masked content (or a directory holding
/// it) at another place. Declaring a masked path by its own name stays the way to show it.
fn check_alias(field: &str, p: &Path, real: &Path, masked: &[PathBuf]) -> Result<(), PolicyError> {
    if p == real {
        return Ok(());
    }
    match masked.iter().find(|m| real.starts_with(m) || m.starts_with(real)) {
        Some(m) => Err(PolicyError::new(
            field,
            format!(
                "{} is {} through a symlink, which would show the masked {}; declare the path itself",
                p.display(),
                real.display(),
                m.display()
            ),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn host_uids_come_from_the_configuration_or_subuid_and_never_hold_an_account() {
        use crate::config::{HostUidRange, HostUidsSetting};
        let nobody = Identity::same_inside(65534, 65534);
        let range = |first, count| HostUidsSetting::Range(HostUidRange { first, count });
        assert_eq!(host_uids(Some(&HostUidsSetting::Named("shared".into())), &nobody), Ok(None));
        let r = host_uids(Some(&range(1_900_000_000, 16)), &nobody).unwrap().unwrap();
        assert_eq!((r.first, r.last(), r.lock.as_path()), (1_900_000_000, 1_900_000_015, Path::new(HOST_UIDS_LOCK)));
        // A local account's uid (root's, here) in the range is refused, by name.
        let e = host_uids(Some(&range(1, 10)), &nobody).unwrap_err();
        assert!(e.contains("sandbox.host_uids") && e.contains("holds the uid of ") && e.contains("(1)"), "{e}");
        let e = host_uids(Some(&range(65530, 10)), &Identity::same_inside(65534, 65534)).unwrap_err();
        assert!(e.contains("(65534)"), "{e}");
        // So are the uids systemd hands out to units with DynamicUser= and to homed users.
        let e = host_uids(Some(&range(61200, 10)), &nobody).unwrap_err();
        assert!(e.contains("holds systemd's DynamicUser= uids (61184-65519)"), "{e}");
        let e = host_uids(Some(&range(60000, 2)), &nobody).unwrap_err();
        assert!(e.contains("holds systemd-homed's uids (60001-60513)"), "{e}");
        let e = host_uids(Some(&range(2_147_418_111, 1)), &nobody).unwrap_err();
        assert!(e.contains("holds systemd's foreign uids (2147352576-2147418111)"), "{e}");
        assert!(host_uids(Some(&range(2_147_418_112, 65536)), &nobody).is_ok());
        // `auto` (or nothing) without an opservant-executor account: shared.
        if Identity::local(EXECUTOR_ACCOUNT).is_err() {
            assert_eq!(host_uids(None, &nobody), Ok(None));
            assert_eq!(host_uids(Some(&HostUidsSetting::Named("auto".into())), &nobody), Ok(None));
        }
        let subuid = "alice:100000:65536\n998:300000:1000\nopservant-executor:200000:65536\n";
        assert_eq!(subuid_range(subuid, "opservant-executor", 998), Some((300000, 1000)));
        assert_eq!(subuid_range(subuid, "opservant-executor", 997), Some((200000, 65536)));
        assert_eq!(subuid_range(subuid, "bob", 1001), None);
        let r = |first, count| sandbox::HostUids { first, count, lock: HOST_UIDS_LOCK.into() };
        let alice = Some("alice's subordinate uids in /etc/subuid (100000+65536)".to_string());
        assert_eq!(subuid_overlap(subuid, &r(165536, 10), Some(998)), None);
        assert_eq!(subuid_overlap(subuid, &r(99990, 11), Some(998)), alice);
        assert_eq!(subuid_overlap(subuid, &r(165535, 1), Some(998)), alice);
        // The executor's own range (what `auto` takes) is not another user's — when sandboxes
        // run as the executor account; otherwise it is, by name or by number alike.
        assert_eq!(subuid_overlap(subuid, &r(200000, 65536), Some(998)), None);
        assert_eq!(subuid_overlap(subuid, &r(300000, 1000), Some(998)), None);
        assert!(subuid_overlap(subuid, &r(200000, 1), None).is_some_and(|w| w.starts_with("opservant-executor's")));
        assert!(subuid_overlap(subuid, &r(300000, 1), None).is_some_and(|w| w.starts_with("998's")));
    }

    use super::*;

    fn policy() -> AgentPolicy {
        AgentPolicy {
            limits: LimitPolicy::builtin(),
            landlock_min_abi: 1,
            allow_degraded: false,
            seccomp: SeccompPolicy::Disabled,
            identity: Identity::same_inside(65534, 65534),
            host_uids: None,
            protected: vec![PathBuf::from(CONFIG_DIR), PathBuf::from("/opt/opservant/bin/opservant")],
            masked: std::iter::once(CONFIG_DIR).chain(STATE_DIRS.iter().copied()).map(PathBuf::from).collect(),
            credentials: Vec::new(),
            system_dirs: SYSTEM_DIRS.iter().map(PathBuf::from).collect(),
            never_readable: NEVER_READABLE.iter().map(PathBuf::from).collect(),
        }
    }

    fn manifest(fs: &str) -> Manifest {
        let text = format!(
            r#"{{"name":"x","version":"1.0.0","description":"d","supported_actions":["a"],"entry_point":"m.C",
                "permissions":{{"filesystem":{fs}}}}}"#
        );
        Manifest::parse(&text).unwrap().0
    }

    #[test]
    fn system_and_agent_writes_are_refused() {
        let p = policy();
        for path in ["/etc", "/etc/opservant", "/usr/local/bin", "/", "/var", "/var/lib/x", "/opt/opservant", "/opt"] {
            let m = manifest(&format!(r#"{{"write":["{path}"]}}"#));
            let e = p.spec_for(Some(&m), "/bin/true", vec![]).unwrap_err();
            assert_eq!(e.field, "permissions.filesystem.write[0]", "{path}: {e}");
        }
    }

    #[test]
    fn the_hosts_tmp_is_not_read_over_the_scratch() {
        let p = policy();
        // By a link to it too (a host path that resolves there).
        let link = std::path::PathBuf::from(format!("/var/tmp/opservant-policy-tmp-{}", std::process::id()));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/tmp", &link).unwrap();
        for path in ["/tmp", "/tmp/", link.to_str().unwrap()] {
            let m = manifest(&format!(r#"{{"read":["{path}"]}}"#));
            let e = p.spec_for(Some(&m), "/bin/true", vec![]).unwrap_err();
            assert_eq!(e.field, "permissions.filesystem.read[0]", "{path}: {e}");
            assert!(e.message.contains("the sandbox's own /tmp"), "{path}: {e}");
        }
        std::fs::remove_file(&link).unwrap();
        // A file of the host's /tmp is a file like any other.
        let file = std::env::temp_dir().join(format!("opservant-policy-{}", std::process::id()));
        std::fs::write(&file, "x").unwrap();
        let m = manifest(&format!(r#"{{"read":["{}"]}}"#, file.display()));
        let granted = p.spec_for(Some(&m), "/bin/true", vec![]);
        std::fs::remove_file(&file).unwrap();
        granted.unwrap();
    }

    #[test]
    fn the_sandboxs_own_dev_and_sys_are_refused_naming_the_manifests_field() {
        let p = policy();
        for (kind, path) in [("read", "/sys/class"), ("read", "/sys"), ("read", "/dev/shm"), ("write", "/dev/shm/x")] {
            let m = manifest(&format!(r#"{{"{kind}":["{path}"]}}"#));
            let e = p.spec_for(Some(&m), "/bin/true", vec![]).unwrap_err();
            assert_eq!(e.field, format!("permissions.filesystem.{kind}[0]"), "{path}: {e}");
            assert!(
                e.message.starts_with(&format!("{path}: /")) && e.message.contains("in the sandbox is its own"),
                "{e}"
            );
        }
        // A name that merely begins so is another directory.
        let m = manifest(r#"{"read":["/system-not-there-x"]}"#);
        let e = p.spec_for(Some(&m), "/bin/true", vec![]).unwrap_err();
        assert!(!e.message.contains("in the sandbox is its own"), "{e}");
    }

    #[test]
    fn scratch_writes_are_fine_and_credentials_unreadable() {
        let p = policy();
        let m = manifest(r#"{"write":["/tmp/opservant/"]}"#);
        p.spec_for(Some(&m), "/bin/true", vec![]).unwrap();
        let m = manifest(r#"{"read":["/etc/shadow"]}"#);
        assert!(p.spec_for(Some(&m), "/bin/true", vec![]).unwrap_err().message.contains("credentials"));
    }

    #[test]
    fn declared_paths_are_checked_and_bound_as_their_real_paths() {
        // Outside /tmp: writes under /tmp land in the scratch and are not bound from the host.
        let dir = PathBuf::from(format!("/var/tmp/opservant-policy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("real")).unwrap();
        std::fs::write(dir.join("real/x"), "").unwrap();
        for (link, target) in [("shadow", "/etc/shadow"), ("ssh", "/etc/ssh"), ("etc", "/etc"), ("run", "/run")] {
            std::os::unix::fs::symlink(target, dir.join(link)).unwrap();
        }
        std::os::unix::fs::symlink(dir.join("real"), dir.join("alias")).unwrap();
        let p = policy();
        let d = |s: &str| dir.join(s).display().to_string();
        for (fs, field, says) in [
            (
                format!(r#"{{"read":["{}"]}}"#, d("shadow")),
                "read[0]",
                "through a symlink, /etc/shadow) holds host credentials",
            ),
            (format!(r#"{{"read":["{}"]}}"#, d("ssh")), "read[0]", "which would show the masked /etc/ssh"),
            (format!(r#"{{"read":["{}"]}}"#, d("etc")), "read[0]", "which would show the masked /etc/"),
            (
                format!(r#"{{"write":["{}"]}}"#, d("run")),
                "write[0]",
                "through a symlink, /run): writing to system directories",
            ),
        ] {
            let e = p.spec_for(Some(&manifest(&fs)), "/bin/true", vec![]).unwrap_err();
            assert_eq!(e.field, format!("permissions.filesystem.{field}"), "{fs}: {e}");
            assert!(e.message.contains(says), "{fs}: {e}");
        }
        // An alias to an ordinary path is bound at the alias, from the real path, exactly.
        let fs = format!(r#"{{"read":["{}"],"write":["{}"]}}"#, d("alias/x"), d("alias"));
        let (spec, _) = p.spec_for(Some(&manifest(&fs)), "/bin/true", vec![]).unwrap();
        let rules: Vec<(String, Option<String>)> = spec
            .filesystem
            .paths
            .iter()
            .map(|r| (r.path.display().to_string(), r.source.as_ref().map(|s| s.display().to_string())))
            .collect();
        assert_eq!(rules, [(d("alias/x"), Some(d("real/x"))), (d("alias"), Some(d("real")))]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The agent's own files that a configuration places outside `/etc/opservant` and the
    /// state directories are masked and write-protected like those (as named and as their
    /// real paths), and its key material is never readable; a default configuration adds
    /// nothing to the built-in masks.
    #[test]
    fn configured_own_files_are_masked_protected_and_key_material_unreadable() {
        let dir = PathBuf::from(format!("/var/tmp/opservant-policy-own-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["real-state", "audit", "tls", "public"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        std::os::unix::fs::symlink(dir.join("real-state"), dir.join("state")).unwrap();
        std::fs::write(dir.join("tls/agent.key"), "k").unwrap();
        std::os::unix::fs::symlink(dir.join("tls/agent.key"), dir.join("public/key-link")).unwrap();
        let d = |s: &str| dir.join(s).display().to_string();
        let yaml = format!(
            "agent:\n  state_dir: {}\naudit:\n  path: {}\n  keep: 2\nnetwork:\n  agent_to_platform:\n    key: {}\n",
            d("state"),
            d("audit/audit.jsonl"),
            d("tls/agent.key")
        );
        let p = AgentPolicy::from_config(&crate::config::Config::parse(&yaml).unwrap()).unwrap();
        let (spec, _) = p.spec_for(None, "/bin/true", vec![]).unwrap();
        for want in [
            "state",
            "real-state",
            "audit/audit.jsonl",
            "audit/audit.jsonl.lock",
            "audit/audit.jsonl.1",
            "audit/audit.jsonl.2",
            "tls/agent.key",
        ] {
            assert!(
                spec.filesystem.masked.contains(&dir.join(want)),
                "{want} not masked: {:?}",
                spec.filesystem.masked
            );
        }
        assert!(!spec.filesystem.masked.contains(&dir.join("audit/audit.jsonl.3")));
        // Writes at, above or beneath them are refused.
        for w in ["state", "real-state/x", "audit", "tls"] {
            let m = manifest(&format!(r#"{{"write":["{}"]}}"#, d(w)));
            let e = p.spec_for(Some(&m), "/bin/true", vec![]).unwrap_err();
            assert!(e.message.contains("agent's own files"), "{w}: {e}");
        }
        // Key material is never readable: by its name, through a link, or as a file
        // beneath it; the directory holding it may be declared (the key stays masked).
        for r in ["tls/agent.key", "public/key-link"] {
            let m = manifest(&format!(r#"{{"read":["{}"]}}"#, d(r)));
            let e = p.spec_for(Some(&m), "/bin/true", vec![]).unwrap_err();
            assert!(e.message.contains("key material (network.agent_to_platform.key)"), "{r}: {e}");
        }
        let m = manifest(&format!(r#"{{"read":["{}"]}}"#, d("tls")));
        p.spec_for(Some(&m), "/bin/true", vec![]).unwrap();
        // A link to the (masked) state directory is refused, as for /etc/opservant.
        std::os::unix::fs::symlink(dir.join("state"), dir.join("public/state-link")).unwrap();
        let m = manifest(&format!(r#"{{"read":["{}"]}}"#, d("public/state-link")));
        assert!(p.spec_for(Some(&m), "/bin/true", vec![]).unwrap_err().message.contains("masked"));
        // The default configuration's files are masked each on its own too (declaring
        // `/etc/opservant/` by name does not show the secrets key), after the directories.
        let default = AgentPolicy::from_config(&crate::config::Config::default()).unwrap();
        let base: Vec<PathBuf> = std::iter::once(CONFIG_DIR)
            .chain(STATE_DIRS.iter().copied())
            .flat_map(|d| as_named_and_real(Path::new(d), &mut Vec::new()))
            .collect();
        assert_eq!(default.masked[..base.len()], base[..]);
        assert!(default.masked.contains(&PathBuf::from("/etc/opservant/secrets.key")));
        assert!(default.credentials.iter().any(|(k, _)| k == "secrets.key_file"));
        // `..` in a configured path is folded (a mask must be a normal path), and a public
        // file (a CA) is protected, not masked.
        let yaml = format!(
            "agent:\n  state_dir: {}/x/../state\nnetwork:\n  agent_to_platform:\n    ca: {}\n",
            dir.display(),
            d("public/ca.pem")
        );
        let p = AgentPolicy::from_config(&crate::config::Config::parse(&yaml).unwrap()).unwrap();
        let (spec, _) = p.spec_for(None, "/bin/true", vec![]).unwrap();
        assert!(spec.filesystem.masked.contains(&dir.join("state")));
        assert!(!spec.filesystem.masked.contains(&dir.join("public/ca.pem")));
        assert!(p.protected.contains(&dir.join("public/ca.pem")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_read_path_is_an_error() {
        let p = policy();
        for path in ["/definitely/not/here", "/tmp/definitely-not-here"] {
            let m = manifest(&format!(r#"{{"read":["{path}"]}}"#));
            assert!(
                p.spec_for(Some(&m), "/bin/true", vec![]).unwrap_err().message.contains("does not exist"),
                "{path}"
            );
        }
    }

    #[test]
    fn limits_flow_into_the_spec() {
        let p = policy();
        let (spec, lim) = p.spec_for(None, "/bin/true", vec![]).unwrap();
        assert_eq!(spec.limits.memory_bytes, Some(128 << 20));
        assert_eq!(spec.limits.cpu_percent, Some(10));
        assert_eq!(spec.limits.timeout_ms, Some(60_000));
        assert_eq!(spec.filesystem.scratch_bytes, 100 << 20);
        assert_eq!(lim.max_pids, 64);
    }

    /// What a declared path reaches through another mount of the same files is judged as
    /// those files (a synthetic host: the root filesystem, its `/etc` bound at `/srv/alias`
    /// and its `/opt` at `/mnt/opt`, and a data disk at `/data` whose `/docker` is also bound
    /// at `/var/lib/docker`).
    #[test]
    fn other_mounts_of_the_same_files_are_judged_as_those_files() {
        let table = MountTable::new(sandbox::mountinfo::parse(
            b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
              30 22 8:1 /etc /srv/alias rw - ext4 /dev/sda1 rw\n\
              31 22 8:2 / /data rw - ext4 /dev/sdb1 rw\n\
              32 22 8:2 /docker /var/lib/docker rw - ext4 /dev/sdb1 rw\n\
              33 22 8:1 /opt /mnt/opt rw - ext4 /dev/sda1 rw\n\
              34 22 8:1 / /mnt/root rw - ext4 /dev/sda1 rw\n",
        ));
        let pol = policy();
        let bind = |p: &'static str| Bind::new(Path::new(p), Path::new(p), &table);
        let refusal = |r: Result<(), PolicyError>| r.err().map(|e| e.message).unwrap_or_default();
        // Writes: into `/etc` through its other mount, or holding that mount, are refused;
        // so is the whole root filesystem and the agent's binary (`/opt/opservant/…`).
        let says = refusal(pol.refuse_write_elsewhere("f", &bind("/srv/alias/apt")));
        assert!(
            says.contains("reaches files of /etc through another mount") && says.contains("system directory"),
            "{says}"
        );
        let says = refusal(pol.refuse_write_elsewhere("f", &bind("/srv")));
        assert!(says.contains("(its mount /srv/alias)"), "{says}");
        let says = refusal(pol.refuse_write_elsewhere("f", &bind("/mnt/root")));
        assert!(says.contains("the whole of the host's /"), "{says}");
        let says = refusal(pol.refuse_write_elsewhere("f", &bind("/mnt/opt")));
        assert!(says.contains("the agent's own files (/opt/opservant/bin/opservant)"), "{says}");
        // Not: other files of the root filesystem, and a data disk's directory mounted
        // beneath `/var/lib` keeps its own path.
        for ok in ["/srv/data", "/data", "/data/docker", "/mnt/optx"] {
            assert_eq!(refusal(pol.refuse_write_elsewhere("f", &bind(ok))), "", "{ok}");
        }
        // Reads: host credentials through the other mount.
        let says = refusal(pol.refuse_read_elsewhere("f", &bind("/srv/alias/shadow")));
        assert!(says.contains("/etc/shadow holds host credentials"), "{says}");
        assert_eq!(refusal(pol.refuse_read_elsewhere("f", &bind("/srv/alias/passwd"))), "");
        // Masks (`/etc/passwd` exists on every host): shown at another place, refused; shown
        // where the mask is, or declared by its own name, not.
        let masked = [PathBuf::from("/etc/passwd")];
        let says = refusal(pol.refuse_masked_elsewhere("f", &bind("/srv"), &masked));
        assert!(says.contains("the masked /etc/passwd would be shown at /srv/alias/passwd"), "{says}");
        for ok in ["/etc", "/etc/passwd", "/srv/data"] {
            assert_eq!(refusal(pol.refuse_masked_elsewhere("f", &bind(ok), &masked)), "", "{ok}");
        }
        // `/` shows the masked file where the mask is, and again at its other mounts.
        assert!(refusal(pol.refuse_masked_elsewhere("f", &bind("/"), &masked)).contains("would be shown at"));
        let says = refusal(pol.refuse_masked_elsewhere("f", &bind("/mnt/root"), &masked));
        assert!(says.contains("would be shown at /mnt/root/etc/passwd"), "{says}");
    }
}
