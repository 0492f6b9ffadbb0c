//! `execute` commands an agent is running, kept as one small file each in `<socket>.running`
//! beside the agent's socket (`/run/opservant/agent.sock.running`) from just before the run
//! until its reply is delivered — so that an agent that died
//! mid-command (SIGKILL, the OOM killer, a crash) says so at its next start instead of
//! leaving the command's start without an end and its id a "replay" forever.
//!
//! Guarantees:
//! - at start ([`InFlight::recover`]) every file left is audited as `executor_fail` with
//!   `status: failed`, `reason: interrupted` and the pid of the agent it ran in — or, for a
//!   run that had ended and whose reply was not yet delivered, as `result_undelivered` —,
//!   then removed (a platform's command once its outcome is posted to it: a start that
//!   cannot post it leaves the record, marked audited, for the next);
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
//! the [`Entry`] as JSON. `install_executor` and `remove_executor` commands are not kept: a
//! re-sent id of one an agent died running is a `replay` (heartbeats show what is installed).

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
    /// A start recovered it and audited its end; a platform's command keeps its record until
    /// its outcome is posted ([`InFlight::posted`]), across later starts too.
    #[serde(default)]
    pub audited: bool,
}

/// The directory of running commands, and the ones a dead predecessor left.
pub struct InFlight {
    dir: PathBuf,
    interrupted: Mutex<HashMap<String, Entry>>,
    /// Held for the agent's life ([`InFlight::open`]).
    _lock: nix::fcntl::Flock<std::fs::File>,
}

/// The lock file in the directory (not a record).
const LOCK: &str = "lock";
/// At most this many records are taken at a start (each costs a durable audit record before
/// the agent serves; the agent itself leaves at most one per concurrent command); the rest
/// are removed, counted in one record.
const MAX_RECOVERED: usize = 1024;

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
    /// `<socket>.running` beside the agent's socket (`/run/opservant/agent.sock.running`: the
    /// runtime directory, a tmpfs under systemd kept across restarts by
    /// `RuntimeDirectoryPreserve=yes`), created (0700) when missing, and held — an exclusive
    /// `flock` on its `lock`, kept for the agent's life — before anything in it is read: two
    /// agents never take each other's records (one on the same socket is refused here, naming
    /// the holder). Its directory must be the agent's alone, as the socket's. Not the state
    /// directory: there, on this host's ext4, a command's create, rename and unlink cost
    /// 0.5–2 ms under load (a tmpfs: ~40 µs).
    pub fn open(socket: &Path) -> Result<InFlight, String> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let parent = socket
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .ok_or_else(|| format!("{}: the agent's socket must be named by an absolute path", socket.display()))?;
        // The socket's directory, when the agent has not made it yet: 0700, as `bind` would;
        // then checked as the socket's is (the agent's alone), before anything is made in it.
        if !parent.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        let meta = std::fs::metadata(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        crate::config::check_agents_own_dir(parent, &meta)
            .map_err(|m| format!("{m}; the agent socket's directory must be the agent's alone"))?;
        let mut name = socket.file_name().unwrap_or_default().to_os_string();
        name.push(".running");
        let dir = parent.join(name);
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
        let lock_path = dir.join(LOCK);
        let file = crate::bounded::open_regular_nofollow(
            &lock_path,
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600),
        )
        .map_err(|e| format!("{}: {e}", lock_path.display()))?;
        let lock = match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(held) => held,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                let by = crate::audit::lock::holders(&lock_path).unwrap_or_else(|| "another process".into());
                return Err(format!("{}: another agent runs on this socket ({by} holds it)", socket.display()));
            }
            Err((_, e)) => return Err(format!("{}: flock: {e}", lock_path.display())),
        };
        Ok(InFlight { dir, interrupted: Mutex::new(HashMap::new()), _lock: lock })
    }

    /// The platform has the outcome of a command recovered at start ([`InFlight::recover`]):
    /// its record goes.
    pub fn posted(&self, command_id: &str) {
        let _ = std::fs::remove_file(self.path_of(command_id));
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
        let list = match std::fs::read_dir(&self.dir) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(dir = %self.dir.display(), error = %e, "the records of running commands cannot be read");
                return vec![];
            }
        };
        let mut found = Vec::new();
        let mut dropped = 0u64;
        for e in list.flatten() {
            let path = e.path();
            if e.file_name() == LOCK {
                continue;
            }
            if found.len() >= MAX_RECOVERED {
                let _ = std::fs::remove_file(&path);
                dropped += 1;
                continue;
            }
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
                // Audited by an earlier start; its outcome still to be posted to the platform.
                _ if entry.audited => Ok(()),
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
                // The platform's keeps its record, marked audited, until its outcome is
                // posted (the platform may be unreachable now, or the agent stop again).
                Ok(()) if entry.source == "platform" => {
                    if !entry.audited {
                        let marked = Entry { audited: true, ..entry.clone() };
                        let tmp = path.with_extension("new");
                        if write_entry(&tmp, &marked).and_then(|()| std::fs::rename(&tmp, &path)).is_err() {
                            let _ = std::fs::remove_file(&tmp);
                        }
                    }
                }
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
        if dropped > 0 {
            crate::audit::record(
                "running_records_dropped",
                &[("count", &dropped.to_string()), ("kept", &MAX_RECOVERED.to_string())],
            );
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

    /// The records in the directory (its lock aside).
    fn records(d: &Path) -> usize {
        std::fs::read_dir(d.join("agent.sock.running")).unwrap().flatten().filter(|e| e.file_name() != LOCK).count()
    }

    fn entry(id: &str) -> Entry {
        Entry {
            command_id: id.into(),
            executor: "x".into(),
            source: "socket (pid 7, uid 0)".into(),
            pid: 42,
            started: "2026-12-07T10:00:00Z".into(),
            finished: None,
            audited: false,
        }
    }

    #[test]
    fn a_running_command_is_recorded_until_its_guard_goes() {
        let d = scratch("guard");
        let f = InFlight::open(&d.join("agent.sock")).unwrap();
        let g = f.begin(&entry("a/b\n")).unwrap();
        assert_eq!(records(&d), 1);
        drop(g);
        assert_eq!(records(&d), 0);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn what_a_dead_agent_left_is_recovered_once_and_answered_interrupted() {
        let d = scratch("recover");
        let f = InFlight::open(&d.join("agent.sock")).unwrap();
        std::mem::forget(f.begin(&entry("left-1")).unwrap());
        std::fs::write(d.join("agent.sock.running/junk"), b"not an entry").unwrap();
        // Held by its agent: a second on the same socket is refused, and reads nothing.
        let err = InFlight::open(&d.join("agent.sock")).err().expect("refused while held");
        assert!(err.contains("another agent runs on this socket"), "{err}");
        drop(f);
        let next = InFlight::open(&d.join("agent.sock")).unwrap();
        assert!(next.interrupted("left-1").is_none(), "nothing known before recovery");
        let found = next.recover();
        assert_eq!(found, vec![entry("left-1")]);
        assert_eq!(next.interrupted("left-1"), Some(entry("left-1")));
        assert!(next.interrupted("other").is_none());
        // Recorded (no audit log is configured in this test: nothing to write to), removed.
        assert_eq!(records(&d), 0);
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
        let f = InFlight::open(&d.join("agent.sock")).unwrap();
        let mut g = f.begin(&entry("done-1")).unwrap();
        g.finish("completed");
        std::mem::forget(g);
        drop(f);
        let next = InFlight::open(&d.join("agent.sock")).unwrap();
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
        let f = InFlight::open(&d.join("agent.sock")).unwrap();
        let put = |name: &str, e: &Entry| {
            std::fs::write(d.join("agent.sock.running").join(name), serde_json::to_vec(e).unwrap()).unwrap()
        };
        put("not-the-hash", &entry("x-1"));
        let long = entry(&"i".repeat(crate::replay::MAX_ID_BYTES + 1));
        put(&crate::audit::sha256_hex(long.command_id.as_bytes()), &long);
        let mut odd = entry("x-2");
        odd.source = "anywhere".into();
        put(&crate::audit::sha256_hex(b"x-2"), &odd);
        std::fs::create_dir(d.join("agent.sock.running/a-directory")).unwrap();
        assert!(f.recover().is_empty());
        assert_eq!(records(&d), 0, "all removed");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A platform's command keeps its record, marked audited, until its outcome is posted:
    /// a start that cannot post it (the platform unreachable, the agent stopped again) leaves
    /// it to the next, which posts it without auditing it twice.
    #[test]
    fn a_platforms_record_stays_until_its_outcome_is_posted() {
        let d = scratch("platform");
        let mut e = entry("plat-1");
        e.source = "platform".into();
        let f = InFlight::open(&d.join("agent.sock")).unwrap();
        std::mem::forget(f.begin(&e).unwrap());
        drop(f);
        let next = InFlight::open(&d.join("agent.sock")).unwrap();
        assert_eq!(next.recover(), vec![e.clone()]);
        assert_eq!(records(&d), 1, "kept until posted");
        drop(next);
        let again = InFlight::open(&d.join("agent.sock")).unwrap();
        let found = again.recover();
        assert_eq!(found.len(), 1);
        assert!(found[0].audited, "audited once, by the first start");
        again.posted("plat-1");
        assert_eq!(records(&d), 0);
        let _ = std::fs::remove_dir_all(&d);
    }
}
