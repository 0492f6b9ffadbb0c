//! `execute` commands an agent is running, kept as one small file each in the runtime
//! directory's `running` (beside the agent's socket: `/run/opservant/running`) from just
//! before the run until its reply is delivered — so that an agent that died
//! mid-command (SIGKILL, the OOM killer, a crash) says so at its next start instead of
//! leaving the command's start without an end and its id a "replay" forever.
//!
//! Guarantees:
//! - at start ([`InFlight::recover`]) every file left is audited as `executor_fail` with
//!   `status: failed`, `reason: interrupted` and the pid of the agent it ran in — or, for a
//!   run that had ended and whose reply was not yet delivered, as `result_undelivered` —,
//!   then removed;
//! - such a command's id, sent again while this agent runs, is answered `failed` with reason
//!   `interrupted` (or its status with `result_lost`) ([`InFlight::interrupted`]), not
//!   refused as a replay (a security event): it ran, or began to, and is never run again
//!   under that id — for this agent's life (after one more restart the id is a `replay`);
//! - a command that came from the platform has that answer posted to it too
//!   ([`InFlight::recover`] returns them), so the platform learns the outcome;
//! - the files are written without `fdatasync`, on a tmpfs under systemd (~40 µs a command
//!   for its create, rename and unlink): an agent process that dies leaves them, a reboot
//!   does not — then the audit log alone shows a start without an end.
//!
//! A file's name is the SHA-256 of the command id (ids may hold any character); its text is
//! the [`Entry`] as JSON. At most `agent.max_concurrent` exist at once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// What is kept of a running command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub command_id: String,
    pub executor: String,
    /// Where the command came from: `platform`, or the socket and its client.
    pub source: String,
    /// The agent process it ran in.
    pub pid: u32,
    /// When its run began (RFC 3339, UTC).
    pub started: String,
    /// Its run ended with this status, its reply not yet delivered (the socket's client not
    /// yet written to, the platform not yet posted to): the agent died between the two.
    #[serde(default)]
    pub finished: Option<String>,
}

/// The directory of running commands, and the ones a dead predecessor left.
pub struct InFlight {
    dir: PathBuf,
    interrupted: Mutex<HashMap<String, Entry>>,
}

/// A running command's file, removed when this is dropped — once its reply is delivered
/// (written to the socket's client, posted to the platform), not when its run ends.
pub struct Running {
    path: PathBuf,
    entry: Entry,
}

impl Running {
    /// The run ended with `status`: only its reply is still to be delivered. Rewritten whole
    /// (a new file renamed over the old), so a crash leaves one or the other.
    pub fn finish(&mut self, status: &str) {
        self.entry.finished = Some(status.to_string());
        let tmp = self.path.with_extension("new");
        let written = write_entry(&tmp, &self.entry).and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(path = %self.path.display(), error = %e, "a finished command's record could not be updated");
        }
    }
}

fn write_entry(path: &Path, entry: &Entry) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let text = serde_json::to_vec(entry).unwrap_or_default();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        // A FIFO or a link planted at the name is never opened through (root-only directory).
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    std::io::Write::write_all(&mut f, &text)
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %self.path.display(), error = %e, "a running command's record could not be removed");
            }
        }
    }
}

/// Most bytes read of one file (an entry is a few hundred): anything larger is not ours.
const MAX_ENTRY_BYTES: u64 = 64 * 1024;

impl InFlight {
    /// `runtime_dir/running` (the agent socket's directory, `/run/opservant` — a tmpfs under
    /// systemd, kept across restarts by `RuntimeDirectoryPreserve=yes`), created (0700) when
    /// missing. Not the state directory: there, on this host's ext4, a command's create,
    /// rename and unlink cost 0.5–2 ms under load (a tmpfs: ~40 µs).
    pub fn open(runtime_dir: &Path) -> Result<InFlight, String> {
        use std::os::unix::fs::DirBuilderExt;
        // The socket's directory, when the agent has not made it yet: 0700, as it would.
        if !runtime_dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(runtime_dir)
                .map_err(|e| format!("{}: {e}", runtime_dir.display()))?;
        }
        let dir = runtime_dir.join("running");
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("{}: {e}", dir.display())),
        }
        let meta = std::fs::symlink_metadata(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        if !meta.is_dir() {
            return Err(format!("{}: not a directory", dir.display()));
        }
        crate::config::check_agents_own_dir(&dir, &meta)
            .map_err(|m| format!("{m}; the record of running commands must be the agent's alone"))?;
        Ok(InFlight { dir, interrupted: Mutex::new(HashMap::new()) })
    }

    fn path_of(&self, command_id: &str) -> PathBuf {
        self.dir.join(crate::audit::sha256_hex(command_id.as_bytes()))
    }

    /// Note `entry` as running; its file goes when the returned guard is dropped. A file
    /// that cannot be written is logged, and the command goes on (what it would have told
    /// is the audit log's start without an end).
    pub fn begin(&self, entry: &Entry) -> Option<Running> {
        let path = self.path_of(&entry.command_id);
        match write_entry(&path, entry) {
            Ok(()) => Some(Running { path, entry: entry.clone() }),
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "a running command could not be recorded");
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// At start, before any command: audit each command a dead predecessor left running as
    /// `executor_fail` (`interrupted`) — or, one whose run had ended and only its reply was
    /// undelivered, as `result_undelivered` (its end is in the log already) —, remember it
    /// for [`InFlight::interrupted`], remove its file (once its record is durable), and
    /// return them. A file that is not such an entry (its name not the SHA-256 of its id,
    /// an id longer than a command's may be, an unknown source) is logged and removed.
    pub fn recover(&self) -> Vec<Entry> {
        let Ok(list) = std::fs::read_dir(&self.dir) else { return vec![] };
        let mut found = Vec::new();
        for e in list.flatten() {
            let path = e.path();
            let entry = crate::bounded::open_regular_nofollow(&path, std::fs::OpenOptions::new().read(true))
                .ok()
                .and_then(|f| {
                    let mut text = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_ENTRY_BYTES), &mut text).ok()?;
                    serde_json::from_slice::<Entry>(&text).ok()
                })
                .filter(|entry| {
                    entry.command_id.len() <= crate::replay::MAX_ID_BYTES
                        && e.file_name().to_str() == Some(&crate::audit::sha256_hex(entry.command_id.as_bytes()))
                        && (entry.source == "platform" || entry.source.starts_with("socket"))
                });
            let Some(entry) = entry else {
                tracing::warn!(path = %path.display(), "not a running command's record; removed");
                if std::fs::remove_file(&path).is_err() {
                    let _ = std::fs::remove_dir(&path);
                }
                continue;
            };
            let pid = entry.pid.to_string();
            let recorded = match &entry.finished {
                None => crate::audit::try_record(
                    "executor_fail",
                    &[
                        ("command_id", &entry.command_id),
                        ("executor", &entry.executor),
                        ("status", "failed"),
                        ("reason", "interrupted"),
                        ("killed_by", ""),
                        ("agent_pid", &pid),
                        ("started", &entry.started),
                        ("source", &entry.source),
                    ],
                ),
                Some(status) => crate::audit::try_record(
                    "result_undelivered",
                    &[
                        ("command_id", &entry.command_id),
                        ("executor", &entry.executor),
                        ("status", status),
                        ("agent_pid", &pid),
                        ("source", &entry.source),
                    ],
                ),
            };
            match recorded {
                Ok(()) => {
                    let _ = std::fs::remove_file(&path);
                }
                // Kept for the next start to try again; answered meanwhile.
                Err(e) => tracing::error!(error = %e, "an interrupted command could not be audited"),
            }
            tracing::warn!(
                command_id = %crate::one_terminal_line(&entry.command_id),
                executor = %crate::one_terminal_line(&entry.executor),
                agent_pid = entry.pid,
                finished = entry.finished.as_deref().unwrap_or(""),
                "a command was running when the agent stopped: it did not finish, or its reply was not delivered"
            );
            found.push(entry);
        }
        let mut map = self.interrupted.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for e in &found {
            map.insert(e.command_id.clone(), e.clone());
        }
        found
    }

    /// A command interrupted by the agent's last stop, by id.
    pub fn interrupted(&self, command_id: &str) -> Option<Entry> {
        self.interrupted.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(command_id).cloned()
    }
}

/// The reply for an interrupted command (to the platform at start, or to its id sent again):
/// `failed`/`interrupted` for a run that did not finish; for one that finished and whose
/// reply was lost with the agent, its status and `result_lost` (the result itself is gone).
pub fn reply(entry: &Entry) -> serde_json::Value {
    match &entry.finished {
        None => serde_json::json!({
            "status": "failed",
            "command_id": entry.command_id,
            "reason": "interrupted",
            "error": format!(
                "the agent (pid {}) stopped while this command ran (started {}), or as it was about to begin: it did \
                 not finish and is not run again under this command_id",
                entry.pid, entry.started
            ),
        }),
        Some(status) => serde_json::json!({
            "status": status,
            "command_id": entry.command_id,
            "reason": "result_lost",
            "error": format!(
                "the command finished ({status}), but the agent (pid {}) stopped before its result was delivered: \
                 the result itself is lost (the audit log holds the run's end); it is not run again under this command_id",
                entry.pid
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("opservant-inflight-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        d
    }

    fn entry(id: &str) -> Entry {
        Entry {
            command_id: id.into(),
            executor: "x".into(),
            source: "platform".into(),
            pid: 42,
            started: "2026-12-07T10:00:00Z".into(),
            finished: None,
        }
    }

    #[test]
    fn a_running_command_is_recorded_until_its_guard_goes() {
        let d = scratch("guard");
        let f = InFlight::open(&d).unwrap();
        let g = f.begin(&entry("a/b\n")).unwrap();
        assert_eq!(std::fs::read_dir(d.join("running")).unwrap().count(), 1);
        drop(g);
        assert_eq!(std::fs::read_dir(d.join("running")).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn what_a_dead_agent_left_is_recovered_once_and_answered_interrupted() {
        let d = scratch("recover");
        let f = InFlight::open(&d).unwrap();
        std::mem::forget(f.begin(&entry("left-1")).unwrap());
        std::fs::write(d.join("running/junk"), b"not an entry").unwrap();
        let next = InFlight::open(&d).unwrap();
        assert!(next.interrupted("left-1").is_none(), "nothing known before recovery");
        let found = next.recover();
        assert_eq!(found, vec![entry("left-1")]);
        assert_eq!(next.interrupted("left-1"), Some(entry("left-1")));
        assert!(next.interrupted("other").is_none());
        // Recorded (no audit log is configured in this test: nothing to write to), removed.
        assert_eq!(std::fs::read_dir(d.join("running")).unwrap().count(), 0);
        assert!(next.recover().is_empty(), "recovered once");
        assert_eq!(next.interrupted("left-1"), Some(entry("left-1")), "still answered");
        let r = reply(&entry("left-1"));
        assert_eq!((r["status"].as_str(), r["reason"].as_str()), (Some("failed"), Some("interrupted")));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A run that ended, its reply undelivered when the agent died: answered with its status
    /// and `result_lost`, not as interrupted.
    #[test]
    fn a_finished_run_whose_reply_was_lost_is_told_apart() {
        let d = scratch("finished");
        let f = InFlight::open(&d).unwrap();
        let mut g = f.begin(&entry("done-1")).unwrap();
        g.finish("completed");
        std::mem::forget(g);
        let next = InFlight::open(&d).unwrap();
        let found = next.recover();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].finished.as_deref(), Some("completed"));
        let r = reply(&found[0]);
        assert_eq!((r["status"].as_str(), r["reason"].as_str()), (Some("completed"), Some("result_lost")));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Files that are not a running command's own record are removed, never taken: a name
    /// that is not the SHA-256 of its id, an id longer than a command's, an unknown source.
    #[test]
    fn records_that_are_not_ours_are_removed_not_taken() {
        let d = scratch("foreign");
        let f = InFlight::open(&d).unwrap();
        let put = |name: &str, e: &Entry| {
            std::fs::write(d.join("running").join(name), serde_json::to_vec(e).unwrap()).unwrap()
        };
        put("not-the-hash", &entry("x-1"));
        let long = entry(&"i".repeat(crate::replay::MAX_ID_BYTES + 1));
        put(&crate::audit::sha256_hex(long.command_id.as_bytes()), &long);
        let mut odd = entry("x-2");
        odd.source = "anywhere".into();
        put(&crate::audit::sha256_hex(b"x-2"), &odd);
        std::fs::create_dir(d.join("running/a-directory")).unwrap();
        assert!(f.recover().is_empty());
        assert_eq!(std::fs::read_dir(d.join("running")).unwrap().count(), 0, "all removed");
        let _ = std::fs::remove_dir_all(&d);
    }
}
