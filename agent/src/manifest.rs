//! Executor manifests (`manifest.json`): seed 000/001 fields plus the DESIGN.md §3 extensions.
//!
//! Guarantees: a manifest either loads into a [`Manifest`] whose every field passed its rule,
//! or yields a [`ManifestError`] naming the field path (`permissions.network.allowed_ports[2]`)
//! and the rule broken. Unknown keys under `permissions` (and in every nested permission or
//! limit object) are errors — a misspelt restriction must never be silently ignored; unknown
//! top-level keys are warnings. Input that cannot be a manifest at all — more than
//! [`MAX_MANIFEST_BYTES`], not UTF-8, nested more than [`MAX_DEPTH`] deep — is refused before
//! it is parsed, with an error that says which (never a panic or a deep recursion).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

/// The largest manifest accepted, in bytes (real ones are a few hundred).
pub const MAX_MANIFEST_BYTES: usize = 1 << 20;
/// The deepest nesting of arrays and objects accepted (a manifest needs 4).
pub const MAX_DEPTH: usize = 32;

/// A field that breaks a rule.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{path}: {message}")]
pub struct ManifestError {
    pub path: String,
    pub message: String,
}

impl ManifestError {
    /// A finding at `path`. A line break in it (from a value it quotes) is written `\n`:
    /// terminals get one line either way, and `1.0.0\n../x` must not read as `1.0.0 ../x`.
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        let escape = |s: String| if s.contains(['\n', '\r']) { s.replace('\n', "\\n").replace('\r', "\\r") } else { s };
        Self { path: escape(path.into()), message: escape(message.into()) }
    }
}

/// A finding that does not make the manifest invalid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub path: String,
    pub message: String,
}

/// A key of the manifest as a warning's path: as it is when it is a plain word (letters,
/// digits, `_`, `-`), else JSON-quoted — so an empty key still names something (`""`) and a
/// key holding dots, spaces or control characters cannot pass for a path or garble a terminal.
fn key_path(key: &str) -> String {
    if !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        key.to_string()
    } else {
        serde_json::Value::String(key.to_string()).to_string()
    }
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Manifest {
    pub name: String,
    pub version: String,
    pub description: String,
    #[serde(default)]
    pub author: Option<String>,
    pub supported_actions: Vec<String>,
    pub entry_point: String,
    #[serde(default)]
    pub requirements: Requirements,
    pub permissions: Permissions,
    #[serde(default)]
    pub resource_limits: ResourceLimits,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Requirements {
    #[serde(default)]
    pub python: Option<String>,
    #[serde(default)]
    pub packages: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Permissions {
    #[serde(default)]
    pub network: NetworkPermissions,
    #[serde(default)]
    pub filesystem: FilesystemPermissions,
    #[serde(default)]
    pub secrets: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NetworkPermissions {
    #[serde(default)]
    pub outbound: bool,
    #[serde(default)]
    pub allowed_hosts: Option<Vec<String>>,
    #[serde(default)]
    pub allowed_ports: Vec<PortEntry>,
    #[serde(default)]
    pub denied_hosts: Vec<String>,
    #[serde(default)]
    pub dns_allowed: Option<bool>,
}

/// An executor name: `[a-z0-9][a-z0-9-]*`, at most 64 characters (also what may name an
/// installed executor's directory).
pub fn valid_name(name: &str) -> bool {
    name.len() <= 64
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// One entry of `allowed_ports`: a port, a `"low-high"` string, or a `[low, high]` pair.
/// A bare list of two numbers (`[1, 65535]`, as in seed 000) is two single ports.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum PortEntry {
    Port(i64),
    Text(String),
    Pair(Vec<i64>),
    /// Anything else (a fraction, an object, a huge number): refused by [`PortEntry::range`]
    /// with a message saying what an entry may be, not serde's "no variant matched".
    Other(serde_json::Value),
}

impl PortEntry {
    /// The inclusive range this entry allows.
    pub fn range(&self) -> Result<(u16, u16), String> {
        let port =
            |v: i64| u16::try_from(v).ok().filter(|p| *p >= 1).ok_or_else(|| format!("{v} is not a port (1-65535)"));
        match self {
            PortEntry::Port(p) => port(*p).map(|p| (p, p)),
            PortEntry::Text(s) => {
                let (lo, hi) = match s.split_once('-') {
                    Some((a, b)) => (a.trim(), b.trim()),
                    None => (s.trim(), s.trim()),
                };
                let parse = |x: &str| {
                    x.parse::<i64>().map_err(|_| format!("'{s}' is not a port or \"low-high\" range")).and_then(port)
                };
                let (lo, hi) = (parse(lo)?, parse(hi)?);
                if lo > hi {
                    return Err(format!("'{s}': low end above high end"));
                }
                Ok((lo, hi))
            }
            PortEntry::Pair(v) => match v.as_slice() {
                [a, b] => {
                    let (lo, hi) = (port(*a)?, port(*b)?);
                    if lo > hi {
                        return Err(format!("[{a}, {b}]: low end above high end"));
                    }
                    Ok((lo, hi))
                }
                _ => Err("a range must be [low, high]".into()),
            },
            PortEntry::Other(v) => {
                Err(format!("{v} is not a port (1-65535), a \"low-high\" string or a [low, high] pair"))
            }
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FilesystemPermissions {
    #[serde(default)]
    pub read: Vec<PathBuf>,
    #[serde(default)]
    pub write: Vec<PathBuf>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ResourceLimits {
    pub max_memory_mb: Option<u64>,
    pub max_cpu_percent: Option<u64>,
    pub timeout_seconds: Option<u64>,
    pub max_disk_mb: Option<u64>,
    pub max_bandwidth_mbps: Option<u64>,
    pub max_pids: Option<u64>,
}

const TOP_LEVEL: &[&str] = &[
    "name",
    "version",
    "description",
    "author",
    "supported_actions",
    "entry_point",
    "requirements",
    "permissions",
    "resource_limits",
];

/// Whether arrays and objects in `bytes` (JSON) nest more than `max` deep, found without
/// recursion (brackets inside strings do not count).
fn nested_deeper_than(bytes: &[u8], max: usize) -> bool {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &b in bytes {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// The size and nesting bounds every manifest text must keep.
fn check_bounds(text: &[u8]) -> Result<(), ManifestError> {
    if text.len() > MAX_MANIFEST_BYTES {
        return Err(ManifestError::new(
            "manifest",
            format!("{} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have", text.len()),
        ));
    }
    if nested_deeper_than(text, MAX_DEPTH) {
        return Err(ManifestError::new("manifest", format!("nested more than {MAX_DEPTH} deep")));
    }
    Ok(())
}

/// Manifest bytes as text: at most [`MAX_MANIFEST_BYTES`], UTF-8, nested at most [`MAX_DEPTH`]
/// deep; else an error saying which.
pub fn text_of(bytes: &[u8]) -> Result<&str, ManifestError> {
    check_bounds(bytes)?;
    std::str::from_utf8(bytes)
        .map_err(|e| ManifestError::new("manifest", format!("not UTF-8 (invalid bytes at offset {})", e.valid_up_to())))
}

/// Read a manifest file's text ([`text_of`]'s rules): a regular file only, never more than
/// [`MAX_MANIFEST_BYTES`] + 1 bytes of it ([`crate::bounded`]). The error's path is the file.
pub fn read(path: &Path) -> Result<String, ManifestError> {
    let file = crate::bounded::open_regular(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidInput => file_error(path, "not a regular file".into()),
        _ => file_error(path, format!("cannot read: {e}")),
    })?;
    text_in(file, path)
}

/// An error about the manifest file at `path` as a whole.
fn file_error(path: &Path, message: String) -> ManifestError {
    ManifestError::new(path.display().to_string(), message)
}

/// The text of the opened manifest `file` (named `path` in errors): no more than
/// [`MAX_MANIFEST_BYTES`] of it, by [`text_of`]'s rules, UTF-8.
fn text_in(file: std::fs::File, path: &Path) -> Result<String, ManifestError> {
    let bytes = crate::bounded::read_capped(file, MAX_MANIFEST_BYTES as u64).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => {
            file_error(path, format!("larger than the {MAX_MANIFEST_BYTES} bytes a manifest may have"))
        }
        _ => file_error(path, format!("cannot read: {e}")),
    })?;
    text_of(&bytes).map_err(|e| file_error(path, e.message))?;
    String::from_utf8(bytes).map_err(|e| file_error(path, format!("not UTF-8: {e}")))
}

/// The text of a package's `manifest.json` in `dir`: a file of the package's own, never a
/// link (one out of the package had `lint` — run by root — read a root-only file and quote
/// its values), otherwise as [`read`].
pub fn read_in_package(dir: &Path) -> Result<String, ManifestError> {
    let path = dir.join("manifest.json");
    let file_err = |message: String| ManifestError::new(path.display().to_string(), message);
    if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_symlink()) {
        return Err(file_err(SYMLINKED.into()));
    }
    // Opened without following a link (one swapped in since the check fails with ELOOP).
    let file =
        crate::bounded::open_regular_nofollow(&path, std::fs::OpenOptions::new().read(true)).map_err(|e| {
            match e.kind() {
                std::io::ErrorKind::InvalidInput => file_err("not a regular file".into()),
                _ if e.raw_os_error() == Some(libc::ELOOP) => file_err(SYMLINKED.into()),
                _ => file_err(format!("cannot read: {e}")),
            }
        })?;
    text_in(file, &path)
}

/// Why a package's `manifest.json` that is a link is refused.
const SYMLINKED: &str = "a symbolic link: a package's manifest must be a file of its own (not followed)";

impl Manifest {
    /// Read, parse and validate `path`.
    pub fn load(path: &Path) -> Result<(Manifest, Vec<Warning>), ManifestError> {
        Self::parse(&read(path)?)
    }

    /// Read, parse and validate `manifest.json` in the opened directory `dir` (named `shown`
    /// in errors): the file of that directory, whatever its path names by now.
    pub fn load_in(dir: &std::fs::File, shown: &Path) -> Result<(Manifest, Vec<Warning>), ManifestError> {
        let path = shown.join("manifest.json");
        let file_err = |message: String| ManifestError::new(path.display().to_string(), message);
        // Checked before it is opened (opening a device can act), and again on what was.
        let st = nix::sys::stat::fstatat(dir, "manifest.json", nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| file_err(format!("cannot read: {}", std::io::Error::from(e))))?;
        if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(file_err(SYMLINKED.into()));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(file_err("not a regular file".into()));
        }
        let fd = nix::fcntl::openat(
            dir,
            "manifest.json",
            nix::fcntl::OFlag::O_RDONLY
                | nix::fcntl::OFlag::O_NOFOLLOW
                | nix::fcntl::OFlag::O_NONBLOCK
                | nix::fcntl::OFlag::O_NOCTTY
                | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| file_err(format!("cannot read: {}", std::io::Error::from(e))))?;
        let file = std::fs::File::from(fd);
        if !file.metadata().map_err(|e| file_err(format!("cannot read: {e}")))?.is_file() {
            return Err(file_err("not a regular file".into()));
        }
        let text = text_in(file, &path)?;
        // What concerns the whole file (not JSON, not an object) names it, as a read error does.
        Self::parse(&text).map_err(|e| if e.path == "manifest" { file_err(e.message) } else { e })
    }

    /// Every finding in manifest text: the manifest (when it parses), all rule violations
    /// (not only the first) and the warnings. For `executor lint`.
    pub fn check(text: &str) -> (Option<Manifest>, Vec<ManifestError>, Vec<Warning>) {
        match Self::parse_unchecked(text) {
            Err(e) => (None, vec![e], Vec::new()),
            Ok((manifest, mut warnings)) => {
                let mut errors = Vec::new();
                manifest.validate(&mut warnings, &mut errors);
                (Some(manifest), errors, warnings)
            }
        }
    }

    /// Parse and validate manifest text.
    pub fn parse(text: &str) -> Result<(Manifest, Vec<Warning>), ManifestError> {
        let (manifest, mut warnings) = Self::parse_unchecked(text)?;
        let mut errors = Vec::new();
        manifest.validate(&mut warnings, &mut errors);
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok((manifest, warnings)),
        }
    }

    /// JSON and types only (serde); the rules come in `validate`.
    fn parse_unchecked(text: &str) -> Result<(Manifest, Vec<Warning>), ManifestError> {
        check_bounds(text.as_bytes())?;
        // Strict, as commands are: a key given twice is an error, never resolved (which of the
        // two would the platform, a linter or a reviewer take for the manifest's?).
        let value = crate::signing::parse_strict(text.as_bytes()).map_err(|e| {
            let why = match e {
                crate::signing::SigningError::Parse(why) => why,
                other => other.to_string(),
            };
            // The two a hand-edited file most often holds, said plainly.
            let hint = if text.starts_with('\u{feff}') {
                " (the file starts with a UTF-8 byte-order mark: save it without one)"
            } else if ["NaN", "Infinity"].iter().any(|w| text.contains(w)) {
                " (NaN and Infinity are not JSON numbers)"
            } else {
                ""
            };
            ManifestError::new("manifest", format!("not valid JSON: {why}{hint}"))
        })?;
        let obj = value.as_object().ok_or_else(|| ManifestError::new("manifest", "must be a JSON object"))?;
        let warnings: Vec<Warning> = obj
            .keys()
            .filter(|k| !TOP_LEVEL.contains(&k.as_str()))
            .map(|k| Warning { path: key_path(k), message: "unknown top-level key (ignored)".into() })
            .collect();
        let manifest: Manifest = serde_path_to_error::deserialize(&value).map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." { "manifest".to_string() } else { path };
            let mut message = e.into_inner().to_string();
            // A whole number from 2^53 up is held as a double (RFC 8785 signs numbers so).
            if message.starts_with("invalid type: floating point") && message.contains("expected u") {
                message.push_str(" (a whole number below 2^53 is wanted: larger ones are read as floating point, and are past every limit anyway)");
            }
            ManifestError::new(path, message)
        })?;
        Ok((manifest, warnings))
    }

    fn validate(&self, warnings: &mut Vec<Warning>, errors: &mut Vec<ManifestError>) {
        if !valid_name(&self.name) {
            errors.push(ManifestError::new("name", "must match [a-z0-9][a-z0-9-]* (at most 64 characters)"));
        }
        if let Err(e) = semver::Version::parse(&self.version) {
            errors.push(ManifestError::new("version", format!("'{}' is not a semantic version: {e}", self.version)));
        }
        if self.description.trim().is_empty() {
            errors.push(ManifestError::new("description", "must not be empty"));
        }
        if self.supported_actions.is_empty() {
            errors.push(ManifestError::new("supported_actions", "must list at least one action"));
        }
        for (i, a) in self.supported_actions.iter().enumerate() {
            if a.trim().is_empty() || a.chars().any(char::is_whitespace) {
                errors.push(ManifestError::new(
                    format!("supported_actions[{i}]"),
                    "must be a non-empty id without spaces",
                ));
            } else if let Some(first) = self.supported_actions[..i].iter().position(|b| b == a) {
                errors.push(ManifestError::new(
                    format!("supported_actions[{i}]"),
                    format!("'{a}' is listed twice (also supported_actions[{first}])"),
                ));
            }
        }
        let ident = |s: &str| {
            !s.is_empty()
                && s.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        let parts: Vec<&str> = self.entry_point.split('.').collect();
        if parts.len() < 2 || !parts.iter().all(|p| ident(p)) {
            errors.push(ManifestError::new(
                "entry_point",
                format!("'{}' is not of the form module.Class", self.entry_point),
            ));
        } else if ["opservant", "s4e_agent", "_opservant"].contains(&parts[0]) {
            // The runtime's own packages, which the sandbox's interpreter has loaded already:
            // an executor module of that name would never be imported (the run failed late,
            // at its load, after lint had said ok).
            errors.push(ManifestError::new(
                "entry_point",
                format!(
                    "'{}': the top-level module '{}' is the runtime's own; name the executor's package otherwise",
                    self.entry_point, parts[0]
                ),
            ));
        }
        if let Some(req) = &self.requirements.python {
            if req.trim().is_empty() {
                errors.push(ManifestError::new("requirements.python", "must not be empty"));
            }
        }
        for (i, r) in self.requirements.packages.iter().enumerate() {
            if !is_requirement(r) {
                errors.push(ManifestError::new(
                    format!("requirements.packages[{i}]"),
                    format!("{r:?} is not a package name with optional extras and version specifiers (e.g. \"requests>=2.31,<3\"); URLs, paths and markers are not accepted"),
                ));
            }
        }
        let net = &self.permissions.network;
        for (i, p) in net.allowed_ports.iter().enumerate() {
            if let Err(m) = p.range() {
                errors.push(ManifestError::new(format!("permissions.network.allowed_ports[{i}]"), m));
            }
        }
        if net.allowed_ports.len() == 2 && net.allowed_ports.iter().all(|p| matches!(p, PortEntry::Port(_))) {
            warnings.push(Warning {
                path: "permissions.network.allowed_ports".into(),
                message: "two bare numbers are two single ports, not a range; write [[low, high]] or \"low-high\" for a range".into(),
            });
        }
        for (field, list) in
            [("read", &self.permissions.filesystem.read), ("write", &self.permissions.filesystem.write)]
        {
            for (i, p) in list.iter().enumerate() {
                let path = format!("permissions.filesystem.{field}[{i}]");
                if !p.is_absolute() {
                    errors.push(ManifestError::new(path, format!("{} is not an absolute path", p.display())));
                } else if p
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir | std::path::Component::CurDir))
                {
                    errors.push(ManifestError::new(path, format!("{} contains '.' or '..'", p.display())));
                } else if p.as_os_str().as_encoded_bytes().iter().any(|b| b.is_ascii_control()) {
                    // NUL cannot reach the kernel; others would be written raw to terminals.
                    errors.push(ManifestError::new(path, format!("{:?} contains a control character", p)));
                }
            }
        }
        for (i, s) in self.permissions.secrets.iter().enumerate() {
            if s.is_empty() || !s.chars().all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c)) {
                errors
                    .push(ManifestError::new(format!("permissions.secrets[{i}]"), "must be a name of [A-Za-z0-9_./-]"));
            }
        }
        let l = &self.resource_limits;
        for (field, v) in [
            ("max_memory_mb", l.max_memory_mb),
            ("max_cpu_percent", l.max_cpu_percent),
            ("timeout_seconds", l.timeout_seconds),
            ("max_disk_mb", l.max_disk_mb),
            ("max_bandwidth_mbps", l.max_bandwidth_mbps),
            ("max_pids", l.max_pids),
        ] {
            if v == Some(0) {
                errors.push(ManifestError::new(format!("resource_limits.{field}"), "must be positive"));
            }
            if let Some(message) = v.and_then(|v| crate::limits::above_maximum(field, v)) {
                errors.push(ManifestError::new(format!("resource_limits.{field}"), message));
            }
        }
        if l.max_cpu_percent.is_some_and(|p| p > 100) {
            errors.push(ManifestError::new("resource_limits.max_cpu_percent", "is a percentage of one CPU (1-100)"));
        }
    }
}

/// A requirement pip may install from wheels: a project name (letters, digits, `.`, `_`,
/// `-`, starting with a letter or digit, not ending like an archive), optional extras and
/// version specifiers — no URL, path, file, option or environment marker (`@`, `/`, `:`, `;`,
/// quotes and the like).
fn is_requirement(r: &str) -> bool {
    let r = r.trim();
    let name_len = r.find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))).unwrap_or(r.len());
    // pip takes a name that looks like an archive for a file (relative to its directory).
    let name = r[..name_len].to_ascii_lowercase();
    let archive = [".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz", ".egg"]
        .iter()
        .any(|ext| name.ends_with(ext));
    r.len() <= 200
        && !archive
        && r.as_bytes().first().is_some_and(u8::is_ascii_alphanumeric)
        && r[name_len..].chars().all(|c| c.is_ascii_alphanumeric() || " .*+!_-=<>~,[]()".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requirements_are_names_and_version_specifiers_only() {
        for ok in
            ["requests", "requests>=2.31,<3", "zope.interface==6.*", "pkg[extra1] ~= 1.4", "a_b-c!=1.0", "n (>=1.0)"]
        {
            assert!(is_requirement(ok), "{ok}");
        }
        for bad in [
            "",
            "tinydep @ file:///etc",
            "tinydep @ https://example.test/x.whl",
            "./local",
            "/abs/path",
            "-r requirements.txt",
            "--index-url=http://x",
            "x; python_version < \"3.12\"",
            "C:\\x",
            ".",
            "tinydep-1.0-py3-none-any.whl",
            "pkg.tar.gz",
        ] {
            assert!(!is_requirement(bad), "{bad}");
        }
    }

    const SEED: &str = r#"{
        "name": "port-scanner", "version": "1.0.0", "description": "Scans TCP ports on target hosts.",
        "author": "security-team", "supported_actions": ["act-port-scan", "act-service-discovery"],
        "entry_point": "port_scanner.PortScanExecutor",
        "requirements": {"python": ">=3.9", "packages": []},
        "permissions": {"network": {"outbound": true, "allowed_ports": [1, 65535]},
                        "filesystem": {"read": ["/etc/opservant/config.yaml"], "write": ["/tmp/opservant/"]}},
        "resource_limits": {"max_memory_mb": 256, "max_cpu_percent": 25, "timeout_seconds": 300}
    }"#;

    #[test]
    fn a_line_break_in_a_quoted_value_is_shown_as_one() {
        let e = Manifest::parse(&SEED.replace(r#""version": "1.0.0""#, r#""version": "1.0.0\n../x""#)).unwrap_err();
        assert!(e.message.contains(r"'1.0.0\n../x'"), "{e}");
        assert!(!e.message.contains('\n'), "{e}");
    }

    #[test]
    fn a_whole_number_past_2_pow_53_is_named_as_such() {
        let text = SEED.replace(r#""timeout_seconds": 300"#, r#""timeout_seconds": 9007199254740992"#);
        let e = Manifest::parse(&text).unwrap_err();
        assert_eq!(e.path, "resource_limits.timeout_seconds", "{e}");
        assert!(e.message.contains("a whole number below 2^53 is wanted"), "{e}");
        // A fraction is told the same: a whole number is wanted.
        let e = Manifest::parse(&SEED.replace(r#""timeout_seconds": 300"#, r#""timeout_seconds": 1.5"#)).unwrap_err();
        assert!(e.message.contains("floating point") && e.message.contains("2^53"), "{e}");
    }

    #[test]
    fn seed_manifest_loads_with_port_warning() {
        let (m, w) = Manifest::parse(SEED).unwrap();
        assert_eq!(m.name, "port-scanner");
        assert_eq!(m.permissions.network.allowed_ports[0].range().unwrap(), (1, 1));
        assert_eq!(w.len(), 1);
        assert!(w[0].message.contains("two single ports"));
    }

    #[test]
    fn misspelt_permission_is_an_error_naming_the_path() {
        let bad = SEED.replace("\"outbound\"", "\"outbond\"");
        let e = Manifest::parse(&bad).unwrap_err();
        assert!(e.path.starts_with("permissions.network"), "{e}");
        assert!(e.message.contains("outbond"), "{e}");
    }

    #[test]
    fn unknown_top_level_is_a_warning() {
        let extra = SEED.replacen('{', "{\"homepage\": \"x\",", 1);
        let (_, w) = Manifest::parse(&extra).unwrap();
        assert!(w.iter().any(|w| w.path == "homepage"));
    }

    /// Found by the `manifest` fuzz target: an empty key gave a warning with an empty path.
    #[test]
    fn an_unknown_key_that_is_not_a_plain_word_is_quoted_in_its_warning() {
        let cases = [
            (r#""""#, r#""""#),
            (r#""a.b""#, r#""a.b""#),
            (r#""x\u001b[2J""#, r#""x\u001b[2J""#),
            (r#""home_page-2""#, "home_page-2"),
        ];
        for (key_json, path) in cases {
            let extra = SEED.replacen('{', &format!("{{{key_json}: 1,"), 1);
            let (_, w) = Manifest::parse(&extra).unwrap();
            let warning = w.iter().find(|w| w.message.starts_with("unknown top-level key")).unwrap();
            assert_eq!(warning.path, path, "key {key_json}");
            assert_eq!(warning.to_string(), format!("{path}: unknown top-level key (ignored)"));
        }
    }

    #[test]
    fn field_rules() {
        for (from, to, path) in [
            ("\"port-scanner\"", "\"Port_Scanner\"", "name"),
            ("\"1.0.0\"", "\"1.0\"", "version"),
            ("\"port_scanner.PortScanExecutor\"", "\"port_scanner\"", "entry_point"),
            ("\"max_memory_mb\": 256", "\"max_memory_mb\": 0", "resource_limits.max_memory_mb"),
            ("[1, 65535]", "[\"80-20\"]", "permissions.network.allowed_ports[0]"),
            ("[1, 65535]", "[70000]", "permissions.network.allowed_ports[0]"),
            ("\"/tmp/opservant/\"", "\"tmp\"", "permissions.filesystem.write[0]"),
            ("\"/tmp/opservant/\"", "\"/tmp/a\\u0000b\"", "permissions.filesystem.write[0]"),
            ("\"/tmp/opservant/\"", "\"/tmp/a\\u001b[31m\"", "permissions.filesystem.write[0]"),
            ("\"max_memory_mb\": 256", "\"max_memory_mb\": \"lots\"", "resource_limits.max_memory_mb"),
            // The same action twice; an entry point in the runtime's own packages (it would
            // never load: found by a review, lint said ok and the run failed).
            ("\"act-service-discovery\"", "\"act-port-scan\"", "supported_actions[1]"),
            ("\"port_scanner.PortScanExecutor\"", "\"opservant.PortScanExecutor\"", "entry_point"),
            ("\"port_scanner.PortScanExecutor\"", "\"s4e_agent.x.E\"", "entry_point"),
            ("\"port_scanner.PortScanExecutor\"", "\"_opservant.main.E\"", "entry_point"),
        ] {
            let e = Manifest::parse(&SEED.replace(from, to)).unwrap_err();
            assert_eq!(e.path, path, "{from} -> {to}: {e}");
        }
    }

    /// A byte-order mark and NaN are named, not left as "expected value at column 1".
    #[test]
    fn a_byte_order_mark_and_nan_are_named() {
        let e = Manifest::parse(&format!("\u{feff}{SEED}")).unwrap_err();
        assert!(e.message.contains("byte-order mark"), "{e}");
        let e = Manifest::parse(&SEED.replace("\"max_memory_mb\": 256", "\"max_memory_mb\": NaN")).unwrap_err();
        assert!(e.message.contains("NaN and Infinity are not JSON numbers"), "{e}");
    }

    #[test]
    fn check_reports_every_violation() {
        let bad = SEED.replace("\"1.0.0\"", "\"1.0\"").replace("\"max_memory_mb\": 256", "\"max_memory_mb\": 0");
        let (m, errors, warnings) = Manifest::check(&bad);
        assert!(m.is_some());
        let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["version", "resource_limits.max_memory_mb"]);
        assert_eq!(warnings.len(), 1);
        assert_eq!(Manifest::parse(&bad).unwrap_err().path, "version", "parse stops at the first");
        let (m, errors, _) = Manifest::check("{");
        assert!(m.is_none() && errors.len() == 1);
    }

    #[test]
    fn port_forms() {
        assert_eq!(PortEntry::Text("8000-8100".into()).range().unwrap(), (8000, 8100));
        assert_eq!(PortEntry::Text("443".into()).range().unwrap(), (443, 443));
        assert_eq!(PortEntry::Pair(vec![1, 1024]).range().unwrap(), (1, 1024));
        assert!(PortEntry::Pair(vec![1, 2, 3]).range().is_err());
        assert!(PortEntry::Port(0).range().is_err());
        // What is not a port says what an entry may be, naming the value (before: serde's
        // "data did not match any variant of untagged enum PortEntry").
        for (entry, says) in [("-1", "-1 is not a port"), ("1.5", "1.5 is not a port"), ("{}", "[low, high] pair")] {
            let e = Manifest::parse(&SEED.replace("[1, 65535]", &format!("[{entry}]"))).unwrap_err();
            assert_eq!(e.path, "permissions.network.allowed_ports[0]", "{entry}: {e}");
            assert!(e.message.contains(says), "{entry}: {e}");
        }
    }

    #[test]
    fn a_key_given_twice_is_an_error_not_resolved() {
        let twice = SEED.replacen("{", "{\"name\": \"other\", ", 1);
        let e = Manifest::parse(&twice).unwrap_err();
        assert_eq!(e.path, "manifest");
        assert!(e.message.contains("duplicate key \"name\""), "{}", e.message);
        // At any depth: here the network permission's `outbound`, given false and then true.
        let nested = SEED.replacen("{\"outbound\": true", "{\"outbound\": false, \"outbound\": true", 1);
        assert_ne!(nested, SEED);
        let e = Manifest::parse(&nested).unwrap_err();
        assert!(e.message.contains("duplicate key \"outbound\""), "{}", e.message);
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(Manifest::parse("[]").is_err());
        assert!(Manifest::parse("{").is_err());
        assert_eq!(Manifest::parse("{}").unwrap_err().path, "manifest");
    }

    #[test]
    fn hostile_input_is_refused_before_parsing_with_a_reason() {
        let deep = format!("{{\"name\": {}{}}}", "[".repeat(100_000), "]".repeat(100_000));
        let big = format!("{}{}", SEED, " ".repeat(5 << 20));
        for (bytes, needle) in [
            (deep.as_bytes(), "nested more than 32 deep"),
            (big.as_bytes(), "more than the 1048576 a manifest may have"),
            (&b"{\"name\": \"\xc3\x28\"}"[..], "not UTF-8 (invalid bytes at offset 10)"),
        ] {
            let e = text_of(bytes).unwrap_err();
            assert_eq!(e.path, "manifest");
            assert!(e.message.contains(needle), "{needle}: {e}");
        }
        // parse and check apply the same bounds to text.
        assert!(Manifest::parse(&deep).unwrap_err().message.contains("deep"));
        assert!(Manifest::check(&big).1[0].message.contains("more than"));
        // Brackets inside strings do not count; the nesting the rules need does.
        let brackets = SEED.replace("security-team", &format!("{}\\\"{}", "[".repeat(100), "{".repeat(100)));
        assert!(Manifest::parse(&brackets).is_ok());
        assert!(!nested_deeper_than(br#"[[["]]]]]]]]"]]]"#, 3));
        assert!(nested_deeper_than(b"[[[[", 3));
    }
}
