//! Agent configuration (`/etc/opservant/config.yaml`), the parts the executor runtime uses:
//! agent identity, limit defaults and ceilings, sandbox strictness, the secrets provider.
//! `network`: seed 001's executor defaults and proxy, plus the egress pool and DNS upstreams
//! (`network.egress`); `agent_to_platform` (the platform the agent daemon polls).
//!
//! Guarantees: unknown keys are errors naming the key path (a misspelt setting is never
//! silently ignored); `run`, `script` and `session` work without any file; nothing secret is
//! kept in [`Config::public_view`], which is what executors may see as `context["config"]`.
//! Hostile text is refused with an error saying why, never a panic: more than
//! [`MAX_CONFIG_BYTES`], not UTF-8, nested more than [`MAX_DEPTH`] deep, or beyond the YAML
//! budget of [`yaml_options`] (anchors and aliases — a "billion laughs" expands to nothing
//! like a billion —, nodes, scalar bytes, documents); duplicate keys are errors.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::limits::LimitPolicy;

pub const DEFAULT_PATH: &str = "/etc/opservant/config.yaml";
/// The environment variable naming the configuration a command reads when it is given no
/// `--config` (then it must exist); without either, [`DEFAULT_PATH`] when it exists.
pub const PATH_ENV: &str = "OPSERVANT_CONFIG";
/// The largest configuration file accepted, in bytes (real ones are a few KiB).
pub const MAX_CONFIG_BYTES: usize = 1 << 20;
/// The deepest nesting of mappings and sequences accepted (the configuration needs 4).
pub const MAX_DEPTH: usize = 32;

#[derive(Debug, Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default, deserialize_with = "null_as_default")]
    pub agent: AgentSection,
    #[serde(default, deserialize_with = "null_as_default")]
    pub resource_limits: LimitsSection,
    #[serde(default, deserialize_with = "null_as_default")]
    pub sandbox: SandboxSection,
    #[serde(default, deserialize_with = "null_as_default")]
    pub secrets: SecretsSection,
    #[serde(default, deserialize_with = "null_as_default")]
    pub network: NetworkSection,
    #[serde(default, deserialize_with = "null_as_default")]
    pub executors: ExecutorsSection,
    /// The hash-chained audit log (validated on parse; see [`crate::audit`]).
    #[serde(default, deserialize_with = "null_as_default")]
    pub audit: crate::audit::AuditSection,
    /// The file this configuration was read from (none: built-in defaults or parsed text).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// A section written with nothing under it (`agent:` whose keys are all commented out) is
/// the empty section, as an empty file is the empty configuration.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Installed executors (`opservant executor install`, `install_executor` commands, and
/// `install:` at agent start), and the package signature rules ([`crate::package_signing`]).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutorsSection {
    /// Where installed executors live (default /var/lib/opservant/executors).
    pub dir: Option<std::path::PathBuf>,
    /// Install only archives with a valid signature from a trusted key (directories are
    /// refused: they cannot be signed). Default false; a signature that is present is
    /// checked either way.
    #[serde(default)]
    pub require_signature: bool,
    /// Public keys (PEM or base64, absolute paths) package signatures are checked with;
    /// default: `agent.platform_public_key`, when set.
    pub trusted_keys: Option<Vec<PathBuf>>,
    /// Packages (directories or archives, absolute paths) `opservant agent` installs when it
    /// starts; one already installed with the same content is skipped.
    #[serde(default)]
    pub install: Vec<PathBuf>,
    /// The largest package archive accepted, in MiB (1-256, default 256): a local
    /// archive, and a download for an `install_executor` command, are refused beyond it.
    pub max_package_mb: Option<u64>,
}

impl ExecutorsSection {
    pub fn root(&self) -> std::path::PathBuf {
        self.dir.clone().unwrap_or_else(|| crate::executor_install::DEFAULT_ROOT.into())
    }

    /// `max_package_mb` in bytes.
    pub fn max_package_bytes(&self) -> u64 {
        self.max_package_mb.map_or(crate::package_signing::MAX_ARCHIVE_BYTES, |mb| mb << 20)
    }
}

/// Seed 001's `network` block plus `egress` (how sandboxes reach the network).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSection {
    /// The platform endpoint (used by the agent daemon).
    #[serde(default)]
    pub agent_to_platform: Option<crate::platform::PlatformSection>,
    #[serde(default)]
    pub executor_defaults: ExecutorNetworkDefaults,
    #[serde(default)]
    pub proxy: Option<ProxySection>,
    #[serde(default)]
    pub egress: EgressSection,
}

/// Defaults for manifest fields an executor leaves out.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutorNetworkDefaults {
    /// Accepted for seed 001's example; `outbound` must be declared by each manifest, and
    /// `true` here is refused (egress is never granted by default).
    pub outbound: Option<bool>,
    /// `dns_allowed` for manifests that do not say (default true).
    pub dns_allowed: Option<bool>,
}

/// Seed 001's HTTP proxy: executors with egress get `HTTP_PROXY`/`HTTPS_PROXY`/`NO_PROXY`
/// and may reach the proxy's address and port.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProxySection {
    pub http: Option<String>,
    pub https: Option<String>,
    #[serde(default)]
    pub no_proxy: Vec<String>,
}

/// Where sandbox links come from and where the agent's DNS forwarder asks.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EgressSection {
    /// IPv4 pool carved into /30 links (default 10.213.0.0/16).
    pub pool_v4: Option<String>,
    /// IPv6 pool carved into /126 links (default fd6f:7073:7276::/48; `none` disables IPv6).
    pub pool_v6: Option<String>,
    /// Switch IPv4 forwarding on when it is off, instead of refusing to run with egress (never
    /// IPv6 forwarding: IPv6 egress is used only where it is already on).
    #[serde(default)]
    pub manage_forwarding: bool,
    /// Upstream resolvers, `ADDR` or `ADDR:PORT` (`[V6]:PORT`); default: the nameservers of
    /// /etc/resolv.conf.
    #[serde(default)]
    pub dns_upstream: Vec<String>,
    /// Connections one sandbox may have tracked at once (1-65536, default 1024): each is
    /// also an entry in the host's conntrack table, which one sandbox must not fill.
    pub max_connections: Option<u32>,
    /// New connections one sandbox may open per second (1-10000, default 100, with as many
    /// at once): a closed connection stays in the host's conntrack table (TIME_WAIT, 120 s),
    /// so the rate bounds what one sandbox leaves there.
    pub max_new_connections_per_second: Option<u32>,
    /// The network's own NAT64 prefixes (IPv6 /96s), besides RFC 6052's well-known
    /// `64:ff9b::/96`: an address in one is the IPv4 address it embeds, as denied or as
    /// special as that.
    #[serde(default)]
    pub nat64_prefixes: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSection {
    /// The agent's identifier (`context["agent_id"]`); default `local-<hostname>`.
    pub id: Option<String>,
    /// The platform's Ed25519 public key (PEM or base64): commands must be signed with it.
    pub platform_public_key: Option<PathBuf>,
    /// Where the agent keeps its state (the replay store); default /var/lib/opservant.
    pub state_dir: Option<PathBuf>,
    /// The root-only socket `opservant submit` talks to; default /run/opservant/agent.sock.
    pub socket: Option<PathBuf>,
    /// Commands run at once (1-256, default 4); one more is rejected as overloaded.
    pub max_concurrent: Option<usize>,
    /// How the daemon starts sandboxes: `zygote` (default: fork a pre-initialised runtime,
    /// falling back to `cold` when it is unavailable) or `cold` (a fresh process each time).
    pub launch: Option<crate::launch::LaunchMode>,
    /// Executor sandboxes kept started ahead of their runs (0-64, default 0: off); see
    /// [`crate::warm_pool`].
    pub warm_pool: Option<usize>,
    /// Seconds a pooled sandbox may wait for its run before it is discarded (1-86400,
    /// default 600).
    pub warm_pool_idle_seconds: Option<u64>,
    /// Refuse a signed command that does not name this agent in `agent_id` (default false:
    /// a command naming no agent runs on any agent that trusts the key; one naming another
    /// agent is refused either way).
    pub require_agent_id: Option<bool>,
}

/// Seed 001: `default_timeout_seconds` sets a default, `max_*` set ceilings; `default_*`
/// for the other limits too. The shipped ceilings (`policies/limits.json`) may be lowered or
/// raised here; a default set here above its ceiling is an error, and a shipped default
/// above a ceiling lowered here follows the ceiling down.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSection {
    pub default_timeout_seconds: Option<u64>,
    pub default_memory_mb: Option<u64>,
    pub default_cpu_percent: Option<u64>,
    pub default_disk_mb: Option<u64>,
    pub default_pids: Option<u64>,
    pub default_bandwidth_mbps: Option<u64>,
    pub max_timeout_seconds: Option<u64>,
    pub max_memory_mb: Option<u64>,
    pub max_cpu_percent: Option<u64>,
    pub max_disk_mb: Option<u64>,
    pub max_pids: Option<u64>,
    pub max_bandwidth_mbps: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSection {
    /// Refuse to run below this Landlock ABI (default 1).
    pub landlock_min_abi: Option<u32>,
    /// Run with missing cgroup controllers, reporting what is not enforced.
    #[serde(default)]
    pub allow_degraded: bool,
    /// The host uids sandboxes run as, one per sandbox alive at a time: `auto` (the
    /// default: the `/etc/subuid` range of `opservant-executor`, else shared), `shared`
    /// (every sandbox runs as the identity's own uid), or `{first, count}`.
    #[serde(default)]
    pub host_uids: Option<HostUidsSetting>,
}

/// `sandbox.host_uids`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawHostUids", untagged)]
pub enum HostUidsSetting {
    /// `auto` or `shared`.
    Named(String),
    /// An explicit range.
    Range(HostUidRange),
}

/// `sandbox.host_uids` as written: a word, or a map whose missing keys are named in the
/// error (an untagged enum of the two would only say that neither matched).
#[derive(Deserialize)]
#[serde(untagged)]
enum RawHostUids {
    Named(String),
    Range(RawHostUidRange),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHostUidRange {
    first: Option<u32>,
    count: Option<u32>,
}

impl TryFrom<RawHostUids> for HostUidsSetting {
    type Error = String;
    fn try_from(raw: RawHostUids) -> Result<Self, String> {
        match raw {
            RawHostUids::Named(n) => Ok(HostUidsSetting::Named(n)),
            RawHostUids::Range(RawHostUidRange { first: Some(first), count: Some(count) }) => {
                Ok(HostUidsSetting::Range(HostUidRange { first, count }))
            }
            RawHostUids::Range(RawHostUidRange { first, .. }) => Err(format!(
                "a range needs `{}` (as {{first: UID, count: N}})",
                if first.is_none() { "first" } else { "count" }
            )),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HostUidRange {
    pub first: u32,
    pub count: u32,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SecretsSection {
    /// `builtin` (the AES-256-GCM store), `vault` (HashiCorp Vault, see
    /// [`crate::secrets_vault`]) or `file` (a local development secrets file).
    pub provider: Option<String>,
    /// For `provider: file`: a YAML map of name → value, root-owned, mode 0600.
    pub file: Option<PathBuf>,
    /// The built-in store (`provider: builtin` and `opservant secrets`); default
    /// /etc/opservant/secrets.enc.
    pub store: Option<PathBuf>,
    /// The built-in store's key, root-owned, mode 0600; default /etc/opservant/secrets.key.
    /// The systemd credential `opservant-secrets-key` in $CREDENTIALS_DIRECTORY wins over it.
    pub key_file: Option<PathBuf>,
    // `provider: vault` (seed 001's keys, plus `vault_ca` and `vault_namespace`); checked by
    // `crate::secrets_vault::VaultSettings::from_config`.
    /// `https://HOST[:PORT]` of the Vault server.
    pub vault_address: Option<String>,
    /// The CA (PEM) the Vault server's certificate must chain to (required).
    pub vault_ca: Option<PathBuf>,
    /// Certificate revocation lists (PEM) the Vault server's chain is checked against, read
    /// again when the file changes.
    pub vault_crl: Option<PathBuf>,
    /// KV v2 `MOUNT/data/PREFIX` (e.g. `secret/data/opservant`).
    pub vault_path: Option<String>,
    /// `approle` (the only method, and the default).
    pub auth_method: Option<String>,
    pub role_id: Option<String>,
    /// The AppRole secret_id, root-owned, mode 0600; the systemd credential
    /// `opservant-vault-secret-id` in $CREDENTIALS_DIRECTORY wins over it.
    pub secret_id_file: Option<PathBuf>,
    /// Vault Enterprise namespace (`X-Vault-Namespace`).
    pub vault_namespace: Option<String>,
}

/// A directory that holds files the agent's integrity depends on (`agent.state_dir`, the
/// audit log's directory) must be the agent's alone — owned by its effective user and
/// writable by no one else, like sshd's `StrictModes` — and so must the way to it: every
/// directory above it ([`check_ancestors`]). `Err` says which rule which directory breaks
/// (or that `dir` is not a directory).
pub fn check_agents_own_dir(dir: &Path, meta: &std::fs::Metadata) -> Result<(), String> {
    check_dir_itself(dir, meta)?;
    check_ancestors(dir)
}

/// A file the agent trusts for what it lets in — the key commands are verified with
/// (`agent.platform_public_key`), the keys packages are (`executors.trusted_keys`), the
/// platform's CA and the agent's own TLS certificate and key — must be changeable by root or
/// the agent only, like sshd's `StrictModes` for `authorized_keys`: whoever else could
/// replace the command key could sign commands of their own (`install_executor` included,
/// whose package the agent installs as root). So the file (as its links lead) must be owned
/// by root or the agent, writable by no one else (by root's group at most, without an ACL
/// naming others), and every directory and link on the way to it must pass
/// [`check_ancestors`]. `Err` names `field`, the path and the rule it breaks.
pub fn check_trust_file(field: &str, path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    // What it is first: a pipe (`<(…)`, whose /dev/fd link names no path) is not a regular
    // file, whatever the way to it.
    let meta = std::fs::metadata(path).map_err(|e| format!("{field}: {}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{field}: {}: not a regular file", path.display()));
    }
    check_ancestors(path).map_err(|m| format!("{field}: {m}"))?;
    let euid = nix::unistd::geteuid().as_raw();
    let mode = meta.mode() & 0o7777;
    if meta.uid() != 0 && meta.uid() != euid {
        return Err(format!(
            "{field}: {} is owned by uid {}, not by root or the agent: its owner could replace what the agent trusts",
            path.display(),
            meta.uid()
        ));
    }
    if mode & 0o002 != 0 {
        return Err(format!("{field}: {} is writable by others (mode {mode:04o}; chmod o-w)", path.display()));
    }
    if mode & 0o020 != 0 && meta.gid() != 0 {
        return Err(format!(
            "{field}: {} is writable by its group, gid {}, not root's (mode {mode:04o}; chmod g-w)",
            path.display(),
            meta.gid()
        ));
    }
    // With an access ACL the group bits are its mask: a named user or group may write.
    if mode & 0o020 != 0 && has_access_acl(path).map_err(|m| format!("{field}: {m}"))? {
        return Err(format!(
            "{field}: {} has an access ACL that lets more than root write it (mode {mode:04o}; getfacl)",
            path.display()
        ));
    }
    Ok(())
}

/// Whether `path` (as its links lead) has a POSIX access ACL (`system.posix_acl_access`):
/// then its group bits are the ACL's mask, what named users and groups may do at most.
fn has_access_acl(path: &Path) -> Result<bool, String> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| format!("{}: a NUL byte in the path", path.display()))?;
    // SAFETY: both names are NUL-terminated C strings that outlive the call; a null buffer
    // of size 0 asks only for the value's size, so nothing is written.
    let size = unsafe { libc::getxattr(c_path.as_ptr(), c"system.posix_acl_access".as_ptr(), std::ptr::null_mut(), 0) };
    if size >= 0 {
        return Ok(true);
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ENODATA) | Some(libc::EOPNOTSUPP) => Ok(false),
        _ => Err(format!("{}: its ACL cannot be read: {}", path.display(), std::io::Error::last_os_error())),
    }
}

/// Whether `gid` is a group of ordinary users: at or above [`FIRST_USER_GID`], or one that
/// distributions give users as such below it (`users`, every user's on openSUSE; Debian's
/// `staff`, for writing `/usr/local` without root).
fn group_of_users(gid: u32) -> bool {
    gid >= FIRST_USER_GID
        || nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid))
            .ok()
            .flatten()
            .is_some_and(|g| g.name == "users" || g.name == "staff")
}

/// The first group id of ordinary users on Debian and Ubuntu (`SYS_GID_MAX` is 999): a group
/// below it is a system group, which only an administrator gives members.
const FIRST_USER_GID: u32 = 1000;

/// Every directory on the way to `dir` — resolved one component at a time, through every
/// symbolic link and every directory a link's target passes — may be changed by root, the
/// agent or a system group only: whoever else can write one could rename the next one down
/// away and put a directory of their own in its place, which the agent, opening files by
/// path, would then use. So each must be owned by root or the agent (a link too: its owner
/// can point it elsewhere), not writable by others unless its sticky bit is set (`/tmp`:
/// there only an entry's owner may rename it), and writable by its group only when that is
/// root's or a system group — Ubuntu's `/var/log` is `root:syslog` 0775; not `users` or
/// `staff`, groups of users ([`group_of_users`]) — and no access ACL names others. `dir`
/// itself is held to the stricter rule of [`check_dir_itself`].
fn check_ancestors(dir: &Path) -> Result<(), String> {
    use std::ffi::OsString;
    use std::os::unix::fs::MetadataExt;
    use std::path::Component;
    /// More links than this on the way is a loop, as for the kernel's `ELOOP` (40).
    const MAX_LINKS: usize = 40;
    let euid = nix::unistd::geteuid().as_raw();
    let check = |at: &Path, meta: &std::fs::Metadata| {
        let what = if meta.file_type().is_symlink() { "a link on the way to" } else { "above" };
        if meta.uid() != 0 && meta.uid() != euid {
            return Err(format!(
                "{} ({what} {}) is owned by uid {}, not by root or the agent",
                at.display(),
                dir.display(),
                meta.uid()
            ));
        }
        if !meta.is_dir() {
            return Ok(());
        }
        let mode = meta.mode();
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            return Err(format!(
                "{} (above {}) is writable by others without the sticky bit (mode {:04o})",
                at.display(),
                dir.display(),
                mode & 0o7777
            ));
        }
        if mode & 0o020 != 0 && mode & 0o1000 == 0 && meta.gid() != 0 && group_of_users(meta.gid()) {
            return Err(format!(
                "{} (above {}) is writable by its group, gid {}, which is not a system group (mode {:04o})",
                at.display(),
                dir.display(),
                meta.gid(),
                mode & 0o7777
            ));
        }
        // With an access ACL the group bits are its mask: a named user or group may write.
        if mode & 0o020 != 0 && mode & 0o1000 == 0 && has_access_acl(at)? {
            return Err(format!(
                "{} (above {}) has an access ACL that lets more than its owner and group write (mode {:04o}; getfacl)",
                at.display(),
                dir.display(),
                mode & 0o7777
            ));
        }
        Ok(())
    };
    let lstat = |at: &Path| std::fs::symlink_metadata(at).map_err(|e| format!("{}: {e}", at.display()));
    let absolute = std::path::absolute(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // What is left to walk, the next component last.
    let mut todo: Vec<OsString> = Vec::new();
    let push = |todo: &mut Vec<OsString>, path: &Path| {
        for c in path.components().rev() {
            match c {
                Component::Normal(name) => todo.push(name.to_os_string()),
                Component::ParentDir => todo.push("..".into()),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
    };
    push(&mut todo, &absolute);
    let mut at = PathBuf::from("/");
    check(&at, &lstat(&at)?)?;
    let mut links = 0;
    while let Some(name) = todo.pop() {
        if name == ".." {
            // Back to a directory already checked on the way down.
            at.pop();
            continue;
        }
        let next = at.join(&name);
        let meta = lstat(&next)?;
        if meta.file_type().is_symlink() {
            check(&next, &meta)?;
            links += 1;
            if links > MAX_LINKS {
                return Err(format!("{}: more than {MAX_LINKS} symbolic links on the way", dir.display()));
            }
            let target = std::fs::read_link(&next).map_err(|e| format!("{}: {e}", next.display()))?;
            if target.is_absolute() {
                at = PathBuf::from("/");
            }
            push(&mut todo, &target);
            continue;
        }
        // The last component is `dir` itself, checked by the stricter rule.
        if !todo.is_empty() {
            check(&next, &meta)?;
        }
        at = next;
    }
    Ok(())
}

fn check_dir_itself(dir: &Path, meta: &std::fs::Metadata) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if !meta.is_dir() {
        return Err(format!("{} exists and is not a directory", dir.display()));
    }
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid {
        return Err(format!("{} is owned by uid {}, not by the agent (uid {euid})", dir.display(), meta.uid()));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "{} is writable by group or others (mode {:04o}; chmod go-w)",
            dir.display(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// What a file of the agent's own is to a sandbox ([`crate::policy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnKind {
    /// Public (CA bundles, certificates, public keys, install sources): never writable.
    Public,
    /// The agent's own business (state, socket, installed executors, the configuration, the
    /// audit log): never writable, masked in every view.
    Private,
    /// Key material: never writable, masked, never readable even when declared by name.
    Credential,
}

/// A file or directory of the agent's own that its configuration names (explicitly or by
/// default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnPath {
    /// The configuration key that names it (`audit.path`, `secrets.key_file`, …).
    pub key: String,
    /// Absolute and lexically normal (a relative path is taken from the current directory,
    /// as the agent reads it; `.` and `..` are folded).
    pub path: PathBuf,
    pub kind: OwnKind,
}

/// `path` made absolute (from the current directory) with `.` and `..` folded lexically.
fn normal_absolute(path: &Path) -> PathBuf {
    use std::path::Component;
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut out = PathBuf::from("/");
    for c in abs.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

impl Config {
    /// `path` if given (must exist), else the default path if it exists, else built-in
    /// defaults.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let from_env = std::env::var_os(PATH_ENV).filter(|p| !p.is_empty()).map(PathBuf::from);
        let (path, required) = match (path, from_env) {
            (Some(p), _) => (p.to_path_buf(), true),
            (None, Some(p)) => (p, true),
            (None, None) => (PathBuf::from(DEFAULT_PATH), false),
        };
        let file_err = |message: String| ConfigError { path: path.display().to_string(), message };
        // Root trusts the file for everything the agent trusts (the keys commands and
        // packages are checked with, the socket, the Vault address, the Landlock floor): it
        // is held to the same rule as those files — root's or the agent's, writable by no
        // one else, and so is the way to it ([`check_trust_file`]).
        // (A missing file is reported below, as unreadable or as the defaults.)
        if nix::unistd::geteuid().is_root() && path.exists() {
            check_trust_file("the configuration file", &path).map_err(file_err)?;
        }
        // A regular file only (a FIFO would block the open), no more than the cap + 1 bytes.
        match crate::bounded::read_regular(&path, MAX_CONFIG_BYTES as u64) {
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => Err(file_err(too_large().message)),
            Ok(bytes) => Self::parse_bytes(&bytes)
                .map(|mut c| {
                    c.source = Some(path.clone());
                    c
                })
                .map_err(|mut e| {
                    e.path = format!("{}: {}", path.display(), e.path);
                    e
                }),
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => Ok(Config::default()),
            Err(e) => Err(file_err(format!("cannot read: {e}"))),
        }
    }

    /// Every file and directory of the agent's own that this configuration names, defaults
    /// included: the configuration file itself, state, socket, installed executors and
    /// their install sources, trusted and platform keys, secrets (store, key, file, Vault CA
    /// and secret id), the platform TLS files, the audit log with its lock and rotated
    /// files, and the systemd credentials directory when the agent runs with one.
    pub fn own_paths(&self) -> Vec<OwnPath> {
        use OwnKind::{Credential, Private, Public};
        let mut out = Vec::new();
        let mut add = |key: &str, path: &Path, kind: OwnKind| {
            out.push(OwnPath { key: key.to_string(), path: normal_absolute(path), kind });
        };
        if let Some(p) = &self.source {
            add("the configuration file", p, Private);
        }
        let a = &self.agent;
        let state = a.state_dir.clone().unwrap_or_else(|| crate::daemon::DEFAULT_STATE_DIR.into());
        add("agent.state_dir", &state, Private);
        let socket = a.socket.clone().unwrap_or_else(|| crate::daemon::DEFAULT_SOCKET.into());
        add("agent.socket", &socket, Private);
        if let Some(p) = &a.platform_public_key {
            add("agent.platform_public_key", p, Public);
        }
        add("executors.dir", &self.executors.root(), Private);
        for (i, p) in self.executors.trusted_keys.iter().flatten().enumerate() {
            add(&format!("executors.trusted_keys[{i}]"), p, Public);
        }
        for (i, p) in self.executors.install.iter().enumerate() {
            add(&format!("executors.install[{i}]"), p, Public);
        }
        let s = &self.secrets;
        let store = s.store.clone().unwrap_or_else(|| crate::secrets_store::DEFAULT_STORE.into());
        add("secrets.store", &store, Credential);
        let key_file = s.key_file.clone().unwrap_or_else(|| crate::secrets_store::DEFAULT_KEY_FILE.into());
        add("secrets.key_file", &key_file, Credential);
        if let Some(p) = &s.file {
            add("secrets.file", p, Credential);
        }
        if let Some(p) = &s.secret_id_file {
            add("secrets.secret_id_file", p, Credential);
        }
        if let Some(p) = &s.vault_ca {
            add("secrets.vault_ca", p, Public);
        }
        if let Some(p) = &s.vault_crl {
            add("secrets.vault_crl", p, Public);
        }
        if let Some(p) = &self.network.agent_to_platform {
            for (key, path, kind) in
                [("ca", &p.ca, Public), ("cert", &p.cert, Public), ("key", &p.key, Credential), ("crl", &p.crl, Public)]
            {
                if let Some(path) = path {
                    add(&format!("network.agent_to_platform.{key}"), path, kind);
                }
            }
        }
        let audit = crate::audit::AuditSettings::from_config(self);
        add("audit.path", &audit.path, Private);
        add("audit.path (its lock)", &crate::audit::lock_path(&audit.path), Private);
        for n in 1..=audit.keep {
            add(&format!("audit.path (rotated .{n})"), &audit.rotated(n), Private);
        }
        // systemd's credentials for the agent (the secrets key, the Vault secret id).
        if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY").filter(|d| Path::new(d).is_absolute()) {
            add("$CREDENTIALS_DIRECTORY", Path::new(&dir), Credential);
        }
        out
    }

    /// [`Config::parse`] of raw bytes: more than [`MAX_CONFIG_BYTES`] or not UTF-8 is an error.
    pub fn parse_bytes(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.len() > MAX_CONFIG_BYTES {
            return Err(too_large());
        }
        let text = std::str::from_utf8(bytes).map_err(|e| ConfigError {
            path: "config".into(),
            message: format!("not UTF-8 (invalid bytes at offset {})", e.valid_up_to()),
        })?;
        Self::parse(text)
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        if text.len() > MAX_CONFIG_BYTES {
            return Err(too_large());
        }
        if text.trim().is_empty() {
            return Ok(Config::default());
        }
        // A document with nothing in it (`---` alone, or only comments) is empty too. A value
        // of the wrong type is named by its key (`agent.max_concurrent`), not only its line.
        let mut key = String::new();
        let c: Option<Config> = serde_saphyr::with_deserializer_from_str_with_options(text, yaml_options(), |de| {
            serde_path_to_error::deserialize(de).map_err(|e| {
                key = e.path().to_string();
                e.into_inner()
            })
        })
        .map_err(|e| {
            let key = key.trim_start_matches("?.").trim_start_matches('?');
            let path = if key.is_empty() || key == "." { "config" } else { key };
            ConfigError { path: path.into(), message: yaml_message(&e.to_string()) }
        })?;
        let c = c.unwrap_or_default();
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let err = |path: &str, message: &str| ConfigError { path: path.into(), message: message.into() };
        if let Some(id) = &self.agent.id {
            // A segment of the platform's URLs (`/v1/agents/{id}/…`): the characters RFC 3986
            // allows in one, nothing that could end the path (`/`, `?`, `#`, a space) and not
            // `.` or `..` alone.
            if id.is_empty()
                || id.len() > 128
                || id == "."
                || id == ".."
                || !id.bytes().all(crate::platform::is_path_segment_char)
            {
                return Err(err(
                    "agent.id",
                    "must be 1-128 characters of A-Z, a-z, 0-9 and -._~!$&'()*+,;=:@ (a segment of the platform's URLs)",
                ));
            }
        }
        if self.agent.launch == Some(crate::launch::LaunchMode::Pool) {
            return Err(err("agent.launch", "must be zygote or cold (agent.warm_pool sizes the warm pool)"));
        }
        if self.agent.warm_pool.is_some_and(|n| n > crate::warm_pool::MAX_SIZE) {
            return Err(err("agent.warm_pool", &format!("must be 0-{}", crate::warm_pool::MAX_SIZE)));
        }
        if self.agent.warm_pool_idle_seconds.is_some_and(|s| s == 0 || s > crate::warm_pool::MAX_IDLE_LIMIT.as_secs()) {
            return Err(err(
                "agent.warm_pool_idle_seconds",
                &format!("must be 1-{}", crate::warm_pool::MAX_IDLE_LIMIT.as_secs()),
            ));
        }
        if self.agent.max_concurrent.is_some_and(|n| n == 0 || n > 256) {
            return Err(err("agent.max_concurrent", "must be 1-256"));
        }
        for (key, p) in [
            ("agent.platform_public_key", &self.agent.platform_public_key),
            ("agent.state_dir", &self.agent.state_dir),
            ("agent.socket", &self.agent.socket),
        ] {
            if p.as_ref().is_some_and(|p| !p.is_absolute()) {
                return Err(err(key, "must be an absolute path"));
            }
        }
        for (i, p) in self.executors.trusted_keys.iter().flatten().enumerate() {
            if !p.is_absolute() {
                return Err(err(&format!("executors.trusted_keys[{i}]"), "must be an absolute path"));
            }
        }
        for (i, p) in self.executors.install.iter().enumerate() {
            if !p.is_absolute() {
                return Err(err(&format!("executors.install[{i}]"), "must be an absolute path"));
            }
        }
        if self.executors.dir.as_ref().is_some_and(|p| !p.is_absolute()) {
            return Err(err("executors.dir", "must be an absolute path"));
        }
        if self.executors.max_package_mb.is_some_and(|n| n == 0 || n > 256) {
            return Err(err("executors.max_package_mb", "must be 1-256"));
        }
        let no_keys = match &self.executors.trusted_keys {
            Some(list) => list.is_empty(),
            None => self.agent.platform_public_key.is_none(),
        };
        if self.executors.require_signature && no_keys {
            return Err(err(
                "executors.require_signature",
                "no trusted key to check signatures with (set executors.trusted_keys or agent.platform_public_key)",
            ));
        }
        match self.secrets.provider.as_deref() {
            None => {}
            Some("file") if self.secrets.file.is_some() => {}
            Some("file") => return Err(err("secrets.file", "is required with provider: file")),
            Some("builtin") => {}
            Some("vault") => {
                crate::secrets_vault::VaultSettings::from_config(&self.secrets)?;
            }
            Some(other) => {
                return Err(err(
                    "secrets.provider",
                    &format!("'{}' is not a provider (use 'builtin', 'vault' or 'file')", other.escape_debug()),
                ))
            }
        }
        let platform = self.network.agent_to_platform.as_ref();
        for (key, path) in [
            ("secrets.store", &self.secrets.store),
            ("secrets.key_file", &self.secrets.key_file),
            ("secrets.file", &self.secrets.file),
            ("secrets.secret_id_file", &self.secrets.secret_id_file),
            ("secrets.vault_ca", &self.secrets.vault_ca),
            ("secrets.vault_crl", &self.secrets.vault_crl),
            ("network.agent_to_platform.ca", platform.map_or(&None, |p| &p.ca)),
            ("network.agent_to_platform.cert", platform.map_or(&None, |p| &p.cert)),
            ("network.agent_to_platform.key", platform.map_or(&None, |p| &p.key)),
            ("network.agent_to_platform.crl", platform.map_or(&None, |p| &p.crl)),
        ] {
            // A relative path would name another file from another working directory — and
            // not the one the policy's never-readable list was built from.
            if path.as_ref().is_some_and(|p| !p.is_absolute()) {
                return Err(err(key, "must be an absolute path"));
            }
        }
        match &self.sandbox.host_uids {
            Some(HostUidsSetting::Named(n)) if n != "auto" && n != "shared" => {
                return Err(err(
                    "sandbox.host_uids",
                    &format!("{n:?} is neither `auto`, `shared` nor a range {{first: UID, count: N}}"),
                ))
            }
            Some(HostUidsSetting::Range(r)) => {
                if let Some(e) = sandbox::HostUids::bounds_error(r.first, r.count) {
                    return Err(err("sandbox.host_uids", &e));
                }
            }
            _ => {}
        }
        if self.sandbox.landlock_min_abi.is_some_and(|abi| abi > sandbox::landlock::MAX_PLAUSIBLE_ABI) {
            return Err(err(
                "sandbox.landlock_min_abi",
                &format!(
                    "must be 0-{} (0: no floor; Landlock is still applied where the kernel has it)",
                    sandbox::landlock::MAX_PLAUSIBLE_ABI
                ),
            ));
        }
        // The store written over its own key would lose every secret: the same path (after
        // the defaults, `.` and `//` aside), two names of one existing file, or — before
        // either exists — one name in two spellings of one directory (a link, `..`).
        let store = self.secrets.store.clone().unwrap_or_else(|| crate::secrets_store::DEFAULT_STORE.into());
        let key_file = self.secrets.key_file.clone().unwrap_or_else(|| crate::secrets_store::DEFAULT_KEY_FILE.into());
        use std::os::unix::fs::MetadataExt;
        let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        let same_inode = || id(&store).is_some() && id(&store) == id(&key_file);
        let same_place = || {
            let dir = |p: &Path| p.parent().and_then(id);
            store.file_name().is_some() && store.file_name() == key_file.file_name() && {
                let d = dir(&store);
                d.is_some() && d == dir(&key_file)
            }
        };
        if store.components().eq(key_file.components()) || same_inode() || same_place() {
            return Err(err(
                "secrets.store",
                &format!(
                    "names the same file as secrets.key_file ({}); the store would overwrite its key",
                    store.display()
                ),
            ));
        }
        self.limit_policy(LimitPolicy::builtin())?;
        if self.network.executor_defaults.outbound == Some(true) {
            return Err(err(
                "network.executor_defaults.outbound",
                "egress is granted per executor (permissions.network.outbound), never by default",
            ));
        }
        crate::egress::EgressSettings::from_config(self)?;
        Ok(())
    }

    /// The shipped limit policy with this configuration's defaults and ceilings applied: a
    /// default set here above its ceiling is an error naming both keys; a shipped default
    /// above a ceiling lowered here is lowered to it (the operator asked for no more).
    pub fn limit_policy(&self, mut p: LimitPolicy) -> Result<LimitPolicy, ConfigError> {
        let l = &self.resource_limits;
        let (d, c) = (&mut p.defaults, &mut p.ceilings);
        // (limit, field of the manifest, default here, ceiling here, the policy's default, ceiling)
        let limits = [
            (
                "timeout_seconds",
                "timeout_seconds",
                l.default_timeout_seconds,
                l.max_timeout_seconds,
                &mut d.timeout_seconds,
                &mut c.timeout_seconds,
            ),
            (
                "memory_mb",
                "max_memory_mb",
                l.default_memory_mb,
                l.max_memory_mb,
                &mut d.max_memory_mb,
                &mut c.max_memory_mb,
            ),
            (
                "cpu_percent",
                "max_cpu_percent",
                l.default_cpu_percent,
                l.max_cpu_percent,
                &mut d.max_cpu_percent,
                &mut c.max_cpu_percent,
            ),
            ("disk_mb", "max_disk_mb", l.default_disk_mb, l.max_disk_mb, &mut d.max_disk_mb, &mut c.max_disk_mb),
            ("pids", "max_pids", l.default_pids, l.max_pids, &mut d.max_pids, &mut c.max_pids),
            (
                "bandwidth_mbps",
                "max_bandwidth_mbps",
                l.default_bandwidth_mbps,
                l.max_bandwidth_mbps,
                &mut d.max_bandwidth_mbps,
                &mut c.max_bandwidth_mbps,
            ),
        ];
        for (name, field, default_here, ceiling_here, default, ceiling) in limits {
            let (default_key, ceiling_key) =
                (format!("resource_limits.default_{name}"), format!("resource_limits.max_{name}"));
            for (key, value, slot) in
                [(&ceiling_key, ceiling_here, &mut *ceiling), (&default_key, default_here, &mut *default)]
            {
                if let Some(v) = value {
                    if v == 0 {
                        return Err(ConfigError { path: key.clone(), message: "must be positive".into() });
                    }
                    if let Some(message) = crate::limits::above_maximum(field, v) {
                        return Err(ConfigError { path: key.clone(), message });
                    }
                    *slot = v;
                }
            }
            if *default > *ceiling {
                if default_here.is_some() {
                    let whose = if ceiling_here.is_some() { "set here" } else { "shipped" };
                    return Err(ConfigError {
                        path: default_key,
                        message: format!("{default} is above the ceiling {ceiling} ({ceiling_key}, {whose})"),
                    });
                }
                *default = *ceiling;
            }
        }
        if p.ceilings.max_cpu_percent > 100 {
            return Err(ConfigError { path: "resource_limits.max_cpu_percent".into(), message: "at most 100".into() });
        }
        // The scratch is RAM charged to the memory limit, so a run's disk is clamped to its
        // memory (reported): a shipped disk default above a memory default lowered here
        // follows it down too, or every run would report a clamp nobody asked for.
        if l.default_disk_mb.is_none() && p.defaults.max_disk_mb > p.defaults.max_memory_mb {
            p.defaults.max_disk_mb = p.defaults.max_memory_mb;
        }
        Ok(p)
    }

    /// `context["agent_id"]`: `agent.id`, else `local-HOSTNAME` with the hostname read once
    /// per process — the id the platform client polls as and the one commands are checked
    /// against must not part ways when the hostname changes under a running agent.
    pub fn agent_id(&self) -> String {
        static FROM_HOSTNAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        self.agent.id.clone().unwrap_or_else(|| {
            FROM_HOSTNAME
                .get_or_init(|| {
                    let host = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_default();
                    format!("local-{host}")
                })
                .clone()
        })
    }

    /// `context["config"]`: the non-secret part of the configuration.
    pub fn public_view(&self) -> serde_json::Value {
        serde_json::json!({
            "agent": {"id": self.agent_id()},
            "resource_limits": self.resource_limits,
            "sandbox": self.sandbox,
            "secrets": {"provider": self.secrets.provider},
        })
    }
}

fn too_large() -> ConfigError {
    ConfigError { path: "config".into(), message: format!("larger than the {MAX_CONFIG_BYTES} bytes accepted") }
}

/// The YAML parser's message without its source excerpt (printed on one line it is noise)
/// and without its advice to the programmer ("set DuplicateKeyPolicy in Options").
fn yaml_message(full: &str) -> String {
    let first = full.lines().next().unwrap_or(full);
    let first = first.split("  --> ").next().unwrap_or(first);
    first.replace(", set DuplicateKeyPolicy in Options if acceptable", "").trim_end().to_string()
}

/// The YAML parser's budget for a configuration: generous for any real file, small enough that
/// no text within [`MAX_CONFIG_BYTES`] costs much memory or time (alias expansion included).
pub fn yaml_options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_depth = MAX_DEPTH;
    budget.flow_nesting_limit = MAX_DEPTH;
    budget.max_documents = 1;
    budget.max_events = 100_000;
    budget.max_nodes = 50_000;
    budget.max_aliases = 1_000;
    budget.max_anchors = 1_000;
    budget.max_merge_keys = 1_000;
    budget.max_recorded_anchor_events = 100_000;
    budget.max_recorded_anchor_bytes = MAX_CONFIG_BYTES;
    budget.max_total_scalar_bytes = MAX_CONFIG_BYTES;
    budget.max_inclusion_depth = 0;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.duplicate_keys = serde_saphyr::DuplicateKeyPolicy::Error;
    options.alias_limits.max_total_replayed_events = 100_000;
    options.alias_limits.max_replay_stack_depth = MAX_DEPTH;
    options
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_uids_are_shown_as_written() {
        // An executor's `context["config"]` is this serialisation: the operator's form, not
        // the enum's (`{"Range": …}`).
        let c = Config::parse("sandbox:\n  host_uids: {first: 1900000000, count: 16}\n").unwrap();
        let v = serde_json::to_value(&c.sandbox.host_uids).unwrap();
        assert_eq!(v, serde_json::json!({"first": 1900000000u32, "count": 16}));
        let c = Config::parse("sandbox:\n  host_uids: auto\n").unwrap();
        assert_eq!(serde_json::to_value(&c.sandbox.host_uids).unwrap(), serde_json::json!("auto"));
    }

    #[test]
    fn empty_documents_and_sections_are_empty_and_yaml_errors_are_one_clean_line() {
        for text in ["---\n", "# nothing\n---\n# at all\n", "agent:\n#  id: x\n", "agent: ~\nnetwork:\n"] {
            let c = Config::parse(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(c.agent.id.is_none(), "{text:?}");
        }
        let e = Config::parse("agent:\n  id: a\n  id: b\n").unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("duplicate mapping key: id"), "{e}");
        assert!(!e.contains("DuplicateKeyPolicy") && !e.contains("-->") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn seed_001_example_parses() {
        let text = "resource_limits:\n  default_timeout_seconds: 120\n  max_memory_mb: 256\n  max_cpu_percent: 25\n\
                    network:\n  executor_defaults:\n    outbound: false\n    dns_allowed: true\n";
        let c = Config::parse(text).unwrap();
        let p = c.limit_policy(LimitPolicy::builtin()).unwrap();
        assert_eq!(p.defaults.timeout_seconds, 120);
        assert_eq!(p.ceilings.max_memory_mb, 256);
        assert_eq!(p.ceilings.max_cpu_percent, 25);
    }

    #[test]
    fn defaults_and_ceilings_of_every_limit_bandwidth_included() {
        let policy = |text: &str| Config::parse(text).and_then(|c| c.limit_policy(LimitPolicy::builtin()));
        // Bandwidth as DESIGN.md §3 lets a configuration set it.
        let p = policy("resource_limits:\n  default_bandwidth_mbps: 20\n  max_bandwidth_mbps: 50\n").unwrap();
        assert_eq!((p.defaults.max_bandwidth_mbps, p.ceilings.max_bandwidth_mbps), (20, 50));
        // A ceiling lowered below a shipped default takes the default down with it.
        let p = policy("resource_limits:\n  max_memory_mb: 64\n  max_timeout_seconds: 30\n").unwrap();
        assert_eq!((p.defaults.max_memory_mb, p.ceilings.max_memory_mb), (64, 64));
        assert_eq!((p.defaults.timeout_seconds, p.ceilings.timeout_seconds), (30, 30));
        // And the scratch with it (RAM, charged to the memory limit): no clamp on every run.
        assert_eq!(p.defaults.max_disk_mb, 64);
        let p = policy("resource_limits:\n  max_memory_mb: 64\n  default_disk_mb: 20\n").unwrap();
        assert_eq!(p.defaults.max_disk_mb, 20);
        let p = policy("resource_limits:\n  max_bandwidth_mbps: 5\n").unwrap();
        assert_eq!((p.defaults.max_bandwidth_mbps, p.ceilings.max_bandwidth_mbps), (5, 5));
        // A default set above its ceiling is an error naming both.
        let e = policy("resource_limits:\n  default_memory_mb: 100\n  max_memory_mb: 64\n").unwrap_err();
        assert_eq!(e.path, "resource_limits.default_memory_mb", "{e}");
        assert!(e.message.contains("above the ceiling 64 (resource_limits.max_memory_mb, set here)"), "{e}");
        let e = policy("resource_limits:\n  default_bandwidth_mbps: 200\n").unwrap_err();
        assert_eq!(e.path, "resource_limits.default_bandwidth_mbps", "{e}");
        assert!(e.message.contains("(resource_limits.max_bandwidth_mbps, shipped)"), "{e}");
        // Zero, and past the absolute maxima, name their key.
        assert_eq!(policy("resource_limits:\n  max_pids: 0\n").unwrap_err().path, "resource_limits.max_pids");
        let e = policy("resource_limits:\n  max_bandwidth_mbps: 100001\n").unwrap_err();
        assert_eq!(e.path, "resource_limits.max_bandwidth_mbps", "{e}");
    }

    #[test]
    fn host_uids_are_auto_shared_or_a_range_of_uids() {
        for ok in ["auto", "shared", "{first: 1900000000, count: 65536}", "{first: 1, count: 4294967294}"] {
            let c = Config::parse(&format!("sandbox:\n  host_uids: {ok}\n")).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert!(c.sandbox.host_uids.is_some(), "{ok}");
        }
        for (bad, says) in [
            ("own", "neither `auto`, `shared` nor a range"),
            ("{first: 0, count: 10}", "not root"),
            ("{first: 100000, count: 0}", "at least one uid"),
            ("{first: 4294967000, count: 1000}", "within 1-4294967294"),
        ] {
            let e = Config::parse(&format!("sandbox:\n  host_uids: {bad}\n")).unwrap_err();
            assert_eq!(e.path, "sandbox.host_uids", "{bad}: {e}");
            assert!(e.message.contains(says), "{bad}: {e}");
        }
        let e = Config::parse("sandbox:\n  host_uids: {first: 100000, count: 10, last: 3}\n").unwrap_err();
        assert!(e.to_string().contains("host_uids"), "{e}");
        let e = Config::parse("sandbox:\n  host_uids: {first: 100000}\n").unwrap_err();
        assert!(e.to_string().contains("a range needs `count`"), "{e}");
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let e = Config::parse("agent:\n  idd: x\n").unwrap_err();
        assert!(e.to_string().contains("idd"), "{e}");
        // A value of the wrong type, by its key as well as its line.
        for (text, key) in [
            ("agent:\n  max_concurrent: many\n", "agent.max_concurrent"),
            ("resource_limits:\n  max_memory_mb: -5\n", "resource_limits.max_memory_mb"),
            ("sandbox:\n  allow_degraded: maybe\n", "sandbox.allow_degraded"),
        ] {
            let e = Config::parse(text).unwrap_err();
            assert_eq!(e.path, key, "{e}");
            assert!(e.message.contains("line 2"), "{e}");
        }
        assert_eq!(Config::parse("[1, 2]\n").unwrap_err().path, "config");
        let e = Config::parse("resource_limits:\n  default_memory_mb: 600\n").unwrap_err();
        assert_eq!(e.path, "resource_limits.default_memory_mb", "{e}");
        let e = Config::parse("secrets:\n  provider: hsm\n").unwrap_err();
        assert_eq!(e.path, "secrets.provider");
        let e = Config::parse("secrets:\n  provider: vault\n").unwrap_err();
        assert_eq!(e.path, "secrets.vault_address");
        let e = Config::parse("secrets:\n  provider: file\n").unwrap_err();
        assert_eq!(e.path, "secrets.file");
        let e = Config::parse("executors:\n  require_signature: true\n").unwrap_err();
        assert_eq!(e.path, "executors.require_signature", "{e}");
        let e = Config::parse("executors:\n  install: [relative.tar.gz]\n").unwrap_err();
        assert_eq!(e.path, "executors.install[0]", "{e}");
        let e = Config::parse("executors:\n  max_package_mb: 0\n").unwrap_err();
        assert_eq!(e.path, "executors.max_package_mb", "{e}");
        let e = Config::parse("executors:\n  trusted_keys: [k.pub]\n").unwrap_err();
        assert_eq!(e.path, "executors.trusted_keys[0]", "{e}");
        let e = Config::parse("sandbox:\n  landlock_min_abi: 65\n").unwrap_err();
        assert_eq!(e.path, "sandbox.landlock_min_abi", "{e}");
        assert!(Config::parse("sandbox:\n  landlock_min_abi: 0\n").is_ok());
        let e = Config::parse("secrets:\n  provider: file\n  file: secrets.yaml\n").unwrap_err();
        assert_eq!(e.path, "secrets.file", "{e}");
        for key in ["ca", "cert", "key", "crl"] {
            let text = format!("network:\n  agent_to_platform:\n    {key}: tls/{key}.pem\n");
            let e = Config::parse(&text).unwrap_err();
            assert_eq!(e.path, format!("network.agent_to_platform.{key}"), "{e}");
        }
        let c =
            Config::parse("executors:\n  require_signature: true\n  trusted_keys: [/k.pub]\n  install: [/p.tar.gz]\n")
                .unwrap();
        assert!(c.executors.require_signature);
    }

    #[test]
    fn no_file_means_defaults() {
        let c = Config::load(None).unwrap_or_default();
        assert!(c.agent_id().starts_with("local-") || c.agent.id.is_some());
        assert!(Config::load(Some(Path::new("/nonexistent/config.yaml"))).is_err());
        assert!(c.public_view()["secrets"].get("file").is_none(), "no secret paths in the public view");
    }

    #[test]
    fn hostile_text_is_refused_with_a_reason() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            // Flow nesting 100 000 deep, and block nesting past the depth limit.
            (format!("agent: {}{}\n", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(), "line 1"),
            (format!("{}{}\n", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(), "line 1"),
            ((0..40).map(|i| format!("{}k{i}:\n", "  ".repeat(i))).collect::<String>().into_bytes(), "line 1"),
            // A billion laughs: 9 levels of 9 aliases (refused before anything expands).
            (
                {
                    let mut y = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
                    for i in 1..10 {
                        let p = format!("*a{}", i - 1);
                        y.push_str(&format!("a{i}: &a{i} [{}]\n", [p.as_str(); 9].join(", ")));
                    }
                    y.into_bytes()
                },
                "unknown field",
            ),
            // Aliases where a list of strings is welcome: the alias budget stops them.
            (format!("network:\n  proxy:\n    no_proxy: [&a x{}]\n", ", *a".repeat(5_000)).into_bytes(), "alias"),
            (vec![b'#'; MAX_CONFIG_BYTES + 1], "larger than"),
            (b"agent:\n  id: \xff\xfe\n".to_vec(), "not UTF-8"),
            (b"agent:\n  id: a\n  id: b\n".to_vec(), "duplicate"),
            (b"---\nagent: {}\n---\nagent: {}\n".to_vec(), ""),
        ];
        for (text, needle) in cases {
            let started = std::time::Instant::now();
            let e = Config::parse_bytes(&text).unwrap_err();
            assert!(started.elapsed() < std::time::Duration::from_secs(5), "{e}");
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
    }
}
