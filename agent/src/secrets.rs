//! Secrets for executors: the provider lookup and the redaction of delivered values.
//!
//! Executors reach secrets only through `context["vault"].get_secret(name)`, an RPC over the
//! sandbox's application channel answered here: granted only for names the manifest declares
//! under `permissions.secrets`, every grant and refusal audited, never placed in the
//! environment or a file. This build has the development `file` provider (a root-owned,
//! mode-0600 YAML map); the encrypted store and Vault come with the agent daemon.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::config::Config;

/// Where secrets come from.
pub enum Provider {
    None,
    File(BTreeMap<String, String>),
}

impl Provider {
    /// The provider the configuration names. A development file that others could read is
    /// refused (fail closed), as is one that is not a flat map of strings.
    pub fn from_config(config: &Config) -> Result<Provider, String> {
        match (config.secrets.provider.as_deref(), &config.secrets.file) {
            (Some("file"), Some(path)) => Self::load_file(path).map(Provider::File),
            _ => Ok(Provider::None),
        }
    }

    /// Check the configured provider without reading any secret value.
    pub fn check_config(config: &Config) -> Result<(), String> {
        match (config.secrets.provider.as_deref(), &config.secrets.file) {
            (Some("file"), Some(path)) => Self::check_file(path),
            _ => Ok(()),
        }
    }

    fn check_file(path: &Path) -> Result<(), String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("secrets.file {}: {e}", path.display()))?;
        if meta.uid() != 0 || meta.mode() & 0o077 != 0 {
            return Err(format!(
                "secrets.file {}: must be owned by root with mode 0600 (is uid {}, mode {:o})",
                path.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ));
        }
        Ok(())
    }

    fn load_file(path: &Path) -> Result<BTreeMap<String, String>, String> {
        Self::check_file(path)?;
        let text = std::fs::read_to_string(path).map_err(|e| format!("secrets.file {}: {e}", path.display()))?;
        serde_saphyr::from_str(&text)
            .map_err(|e| format!("secrets.file {}: not a map of names to strings: {e}", path.display()))
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        match self {
            Provider::None => None,
            Provider::File(map) => map.get(name).map(String::as_str),
        }
    }
}

/// The secret values delivered during one run, replaced by `[REDACTED]` in everything the
/// result carries.
#[derive(Default, Debug, Clone)]
pub struct Redactor {
    values: Vec<String>,
}

pub const REDACTED: &str = "[REDACTED]";

impl Redactor {
    pub fn add(&mut self, value: &str) {
        if !value.is_empty() && !self.values.iter().any(|v| v == value) {
            self.values.push(value.to_string());
            // Longest first, so a secret containing another is replaced whole.
            self.values.sort_by_key(|v| std::cmp::Reverse(v.len()));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    pub fn text(&self, s: &str) -> String {
        let mut out = s.to_string();
        for v in &self.values {
            if out.contains(v.as_str()) {
                out = out.replace(v.as_str(), REDACTED);
            }
        }
        out
    }

    pub fn contains_secret(&self, bytes: &[u8]) -> bool {
        self.values.iter().any(|v| bytes.windows(v.len()).any(|w| w == v.as_bytes()))
    }

    /// Redact every string (keys included) in a JSON value.
    pub fn json(&self, v: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match v {
            Value::String(s) => Value::String(self.text(s)),
            Value::Array(a) => Value::Array(a.iter().map(|x| self.json(x)).collect()),
            Value::Object(o) => Value::Object(o.iter().map(|(k, x)| (self.text(k), self.json(x))).collect()),
            other => other.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_reaches_every_string() {
        let mut r = Redactor::default();
        r.add("s3cr3t");
        r.add("s3cr3t-longer");
        r.add("");
        assert_eq!(r.text("a s3cr3t-longer and s3cr3t"), "a [REDACTED] and [REDACTED]");
        let v = serde_json::json!({"k": ["x s3cr3t", {"s3cr3t": 1}], "n": 2});
        assert_eq!(r.json(&v), serde_json::json!({"k": ["x [REDACTED]", {"[REDACTED]": 1}], "n": 2}));
        assert!(r.contains_secret(b"..s3cr3t.."));
        assert!(!r.contains_secret(b"secret"));
    }

    #[test]
    fn an_exposed_secrets_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("opservant-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("secrets.yaml");
        std::fs::write(&f, "api_key: abc\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(Provider::load_file(&f).unwrap_err().contains("mode 0600"));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert_eq!(Provider::load_file(&f).unwrap().get("api_key").map(String::as_str), Some("abc"));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
