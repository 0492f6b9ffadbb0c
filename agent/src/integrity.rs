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
//!   one (another inode, size or modification time), as after an upgrade under a running
//!   agent (which [`crate::app::BUILD`]'s check then refuses to use, until a restart).
//! - Both are computed once, off the agent's start path (a thread of `SCHED_IDLE` priority:
//!   ~20 MB of release binaries, ~45 ms here), recorded in the audit log as `agent_binaries` and carried by every ping and
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
    /// `(st_dev, st_ino, size, mtime ns)` of what was hashed, to tell a replacement by.
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
    (m.dev(), m.ino(), m.size(), i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()))
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

/// Hash the agent's binaries, once (a later call does nothing).
pub fn hash_binaries() -> &'static Binaries {
    BINARIES.get_or_init(|| {
        let mut opservant = hash_file(Path::new("/proc/self/exe"));
        if let Ok(exe) = std::env::current_exe() {
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
        idle_priority();
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

/// Run the calling thread only when a CPU would otherwise idle (`SCHED_IDLE`): hashing must
/// not take CPU from sandboxes or commands (a debug build's ~300 MB take ~0.35 s here, far
/// longer in an emulated VM). Lowering one's own policy needs no privilege; if it fails, the
/// thread runs at its normal priority, which is logged.
fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler on pid 0 changes the calling thread's policy only; `param`
    // is a valid sched_param that outlives the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "integrity: SCHED_IDLE refused; hashing at normal priority");
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
        // Replaced by a rename (an upgrade): another inode.
        std::fs::write(dir.join("new"), b"abc").unwrap();
        std::fs::rename(dir.join("new"), &p).unwrap();
        assert_ne!(h.identity, Some(identity(&std::fs::metadata(&p).unwrap())));
        let missing = hash_file(&dir.join("missing"));
        assert!(missing.sha256.as_ref().is_err_and(|e| e.contains("No such file")), "{missing:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
