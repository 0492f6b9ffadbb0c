//! Binary integrity (seed 001's security checklist: "Agent binary integrity verification"):
//! the SHA-256 of the running agent's own executable and of the runtime binary it starts
//! sandboxes with, so that a platform holding the digests of the builds it shipped can tell
//! a binary that is not one of them.
//!
//! Guarantees:
//! - The agent's digest is of the file it was started from, read through `/proc/self/exe`
//!   (the running inode, even once an upgrade replaced or removed the path).
//! - The runtime's digest is of the file at [`crate::executor_run::runtime_binary`] when it
//!   was hashed; a report says `replaced_since: true` once the file there is no longer that
//!   one (another inode, size, or change time — which no one can set back), as after an upgrade under a running
//!   agent (which [`crate::app::BUILD`]'s check then refuses to use, until a restart).
//! - Both are computed once, off the agent's start path (a thread: ~20 MB of release
//!   binaries, ~45 ms of one CPU here; at normal priority — the unit's system-call filter
//!   refuses `sched_setscheduler` and `setpriority`, and a thread at idle priority that
//!   then appends the audit record would hold the log's lock and flush for others), recorded in the audit log as `agent_binaries` and carried by every ping and
//!   heartbeat (`binaries`); until then a report says `pending`. A file that cannot be read
//!   is reported with its error, never as a digest.
//!
//! What it does not do: compare the digests with anything here. The agent's configuration
//! and binaries are writable by the same root; the comparison belongs to whoever holds the
//! shipped digests off the host (the platform), as the audit log's heads do.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{json, Value};
use sha2::Digest as _;

/// One binary: its digest, or why there is none.
#[derive(Debug, Clone)]
pub struct Hashed {
    pub path: PathBuf,
    pub sha256: Result<String, String>,
    /// `(st_dev, st_ino, size, ctime ns)` of what was hashed, to tell a replacement by.
    identity: Option<(u64, u64, u64, i128)>,
}

/// The agent's binaries as hashed at its start.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub opservant: Hashed,
    pub runtime: Option<Hashed>,
}

static BINARIES: OnceLock<Binaries> = OnceLock::new();

fn identity(m: &std::fs::Metadata) -> (u64, u64, u64, i128) {
    (m.dev(), m.ino(), m.size(), i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()))
}

/// SHA-256 (lowercase hex) of the file at `path`, streamed; with the identity of what was
/// read (taken from the open file, before reading).
pub fn hash_file(path: &Path) -> Hashed {
    let hashed = (|| -> std::io::Result<(String, (u64, u64, u64, i128))> {
        let mut f = std::fs::File::open(path)?;
        let id = identity(&f.metadata()?);
        let mut hasher = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match f.read(&mut buf)? {
                0 => break,
                n => hasher.update(&buf[..n]),
            }
        }
        Ok((crate::audit::hex(&hasher.finalize()), id))
    })();
    match hashed {
        Ok((sha256, id)) => Hashed { path: path.to_path_buf(), sha256: Ok(sha256), identity: Some(id) },
        Err(e) => Hashed { path: path.to_path_buf(), sha256: Err(e.to_string()), identity: None },
    }
}

/// Hash the agent's binaries, once (a later call waits for the first, then does nothing):
/// only [`start`]'s thread calls it, so a ping never waits for it.
fn hash_binaries() -> &'static Binaries {
    BINARIES.get_or_init(|| {
        // The path first: once an upgrade replaced the file, `current_exe` names it
        // `… (deleted)` (and the report then says `replaced_since`).
        let exe = std::env::current_exe();
        let mut opservant = hash_file(Path::new("/proc/self/exe"));
        if let Ok(exe) = exe {
            opservant.path = exe;
        }
        let runtime = crate::executor_run::runtime_binary().ok().map(|p| hash_file(&p));
        Binaries { opservant, runtime }
    })
}

/// Start hashing on a thread of its own and record the result in the audit log
/// (`agent_binaries`): the daemon calls it as it starts.
pub fn start() {
    let spawned = std::thread::Builder::new().name("integrity".into()).spawn(|| {
        let b = hash_binaries();
        let digest = |h: &Hashed| match &h.sha256 {
            Ok(d) => d.clone(),
            Err(e) => format!("unreadable: {e}"),
        };
        let opservant = digest(&b.opservant);
        let opservant_path = b.opservant.path.to_string_lossy().into_owned();
        let (runtime, runtime_path) = match &b.runtime {
            Some(h) => (digest(h), h.path.to_string_lossy().into_owned()),
            None => ("not found".to_string(), String::new()),
        };
        crate::audit::record(
            "agent_binaries",
            &[
                ("opservant", &opservant_path),
                ("opservant_sha256", &opservant),
                ("runtime", &runtime_path),
                ("runtime_sha256", &runtime),
                ("build", crate::app::BUILD),
            ],
        );
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the thread that hashes the agent's binaries; pings and heartbeats report them pending");
    }
}

/// What pings and heartbeats carry (`binaries`).
pub fn report() -> Value {
    let Some(b) = BINARIES.get() else { return json!({"pending": true}) };
    let one = |h: &Hashed| {
        let mut v = match &h.sha256 {
            Ok(d) => json!({"path": h.path, "sha256": d}),
            Err(e) => json!({"path": h.path, "error": e}),
        };
        if let Some(id) = h.identity {
            let now = std::fs::metadata(&h.path).ok().map(|m| identity(&m));
            v["replaced_since"] = json!(now != Some(id));
        }
        v
    };
    json!({
        "opservant": one(&b.opservant),
        "opservant_runtime": b.runtime.as_ref().map(one),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_files_digest_and_its_replacement_are_told() {
        let dir = std::env::temp_dir().join(format!("opservant-integrity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bin");
        std::fs::write(&p, b"abc").unwrap();
        let h = hash_file(&p);
        // SHA-256("abc"), FIPS 180-2's example.
        assert_eq!(h.sha256.as_deref(), Ok("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
        assert_eq!(h.identity, Some(identity(&std::fs::metadata(&p).unwrap())));
        // Rewritten in place, same size, its modification time put back: the change time
        // (which no one can set back) tells it.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().write_all_at(b"abd", 0).unwrap();
        std::fs::File::options().write(true).open(&p).unwrap().set_modified(mtime).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().modified().unwrap(), mtime);
        assert_ne!(h.identity, Some(identity(&std::fs::metadata(&p).unwrap())), "rewritten in place");
        std::fs::write(&p, b"abc").unwrap();
        // Replaced by a rename (an upgrade): another inode.
        std::fs::write(dir.join("new"), b"abc").unwrap();
        std::fs::rename(dir.join("new"), &p).unwrap();
        assert_ne!(h.identity, Some(identity(&std::fs::metadata(&p).unwrap())));
        let missing = hash_file(&dir.join("missing"));
        assert!(missing.sha256.as_ref().is_err_and(|e| e.contains("No such file")), "{missing:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
