//! The verification pipeline for signed commands (DESIGN.md §6, seed 001), in this order —
//! each rejection is audited with its reason and answered with `status: "rejected"`:
//!
//! 1. size ≤ [`signing::MAX_COMMAND_BYTES`]
//! 2. strict parse (UTF-8, one JSON object, no duplicate keys, bounded depth)
//! 3. Ed25519 signature (strict) with the platform's key
//! 4. `timestamp` within [`signing::MAX_SKEW_S`] of the agent's clock
//! 5. `command_id` never seen before (persisted across restarts: [`crate::replay`])
//! 6. the action: `execute`, `install_executor`, `remove_executor`, `ping`
//! 7. `execute`: the executor, by name (`executor`) or by action ID (`action_id` among the
//!    installed executors' `supported_actions`)
//! 8. the permission check: the action ID must be supported, `parameters` an object, and a
//!    command's `resource_limits` may only tighten the manifest's (never exceed it or the
//!    agent's ceilings)
//! 9. run
//!
//! Nothing is recorded as seen before the signature and the clock have been checked, so
//! unsigned or stale traffic cannot fill the replay store or burn a future command's id.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use ed25519_dalek::VerifyingKey;
use serde_json::{json, Map, Value};

use crate::audit;
use crate::config::Config;
use crate::executor_run::Executor;
use crate::policy::AgentPolicy;
use crate::replay::{Seen, SeenCommands};
use crate::signing;

/// What the pipeline needs, set up once by the daemon.
pub struct Pipeline {
    pub config: Config,
    pub policy: AgentPolicy,
    pub platform_key: VerifyingKey,
    pub seen: SeenCommands,
    pub executors: PathBuf,
    pub runtime: PathBuf,
    pub launcher: sandbox::Launcher,
    /// The warm pool (`agent.warm_pool` > 0).
    pub pool: Option<std::sync::Arc<crate::warm_pool::WarmPool>>,
    /// Commands allowed to run at once (see [`Pipeline::submit`]).
    pub max_concurrent: usize,
    /// Commands running now; maintained by [`Pipeline::submit`] (start it at zero).
    pub running: AtomicUsize,
}

/// Why a command was rejected: the stable reason codes the platform sees (`reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    TooLarge,
    Malformed,
    Unsigned,
    BadSignature,
    ClockSkew,
    Replay,
    UnknownAction,
    UnknownExecutor,
    PermissionDenied,
    Checksum,
    CannotRun,
    Internal,
    Overloaded,
}

impl Reason {
    /// Every reason code, for checks that a reply carries one of them.
    pub const ALL: [Reason; 13] = [
        Reason::TooLarge,
        Reason::Malformed,
        Reason::Unsigned,
        Reason::BadSignature,
        Reason::ClockSkew,
        Reason::Replay,
        Reason::UnknownAction,
        Reason::UnknownExecutor,
        Reason::PermissionDenied,
        Reason::Checksum,
        Reason::CannotRun,
        Reason::Internal,
        Reason::Overloaded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TooLarge => "too_large",
            Reason::Malformed => "malformed",
            Reason::Unsigned => "unsigned",
            Reason::BadSignature => "bad_signature",
            Reason::ClockSkew => "clock_skew",
            Reason::Replay => "replay",
            Reason::UnknownAction => "unknown_action",
            Reason::UnknownExecutor => "unknown_executor",
            Reason::PermissionDenied => "permission_denied",
            Reason::Checksum => "checksum",
            Reason::CannotRun => "cannot_run",
            Reason::Internal => "internal",
            Reason::Overloaded => "overloaded",
        }
    }
}

/// A rejection by [`verify_command`]: the reason, the command's id when it has one, a sentence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: Reason,
    pub command_id: Option<String>,
    pub message: String,
}

/// What [`verify_command`] found (steps 1–4 and the `command_id` rule).
#[derive(Debug, Clone, PartialEq)]
pub enum Verification {
    /// Steps 1–2 failed: the bytes are not a command at all (`too_large` or `malformed`).
    Unreadable(Rejection),
    /// A command was parsed and its signature and clock checked: `verdict` is what the
    /// `command_received` audit record reports; `outcome` is the `command_id` when the command
    /// may go on to the replay check, else why not.
    Checked { cmd: Map<String, Value>, verdict: signing::Verdict, outcome: Result<String, Rejection> },
}

/// Steps 1–4 and the `command_id` rule for one command as received, with `key` and the clock
/// `now`: pure (no audit record, no replay store, nothing run), so it can be fuzzed — and
/// [`Pipeline::handle`] uses exactly this function.
pub fn verify_command(bytes: &[u8], key: &VerifyingKey, now: i64) -> Verification {
    let unreadable = |reason: Reason, command_id: Option<String>, message: String| {
        Verification::Unreadable(Rejection { reason, command_id, message })
    };
    if bytes.len() > signing::MAX_COMMAND_BYTES {
        return unreadable(Reason::TooLarge, None, signing::SigningError::TooLarge(bytes.len()).to_string());
    }
    let cmd = match signing::parse_command(bytes) {
        Ok(c) => c,
        Err(e) => return unreadable(Reason::Malformed, None, e.to_string()),
    };
    let id = cmd.get("command_id").and_then(Value::as_str).map(str::to_string);
    let verdict = match signing::verify(&cmd, key, now) {
        Ok(v) => v,
        Err(e) => return unreadable(Reason::Malformed, id, e.to_string()),
    };
    let reject =
        |reason: Reason, message: &str| Err(Rejection { reason, command_id: id.clone(), message: message.into() });
    let outcome = if let Err(e) = &verdict.signature {
        reject(if e == "missing signature" { Reason::Unsigned } else { Reason::BadSignature }, e)
    } else if let Err(e) = &verdict.timestamp {
        reject(Reason::ClockSkew, e)
    } else {
        match id.as_deref().filter(|i| !i.is_empty() && i.len() <= crate::replay::MAX_ID_BYTES) {
            Some(i) => Ok(i.to_string()),
            None => reject(Reason::Malformed, "command_id must be a string of 1-256 bytes"),
        }
    };
    Verification::Checked { cmd, verdict, outcome }
}

/// A rejection: the reason code (stable, for the platform) and a sentence.
fn rejected(command_id: Option<&str>, reason: Reason, message: &str) -> Value {
    json!({"status": "rejected", "command_id": command_id, "reason": reason.as_str(), "error": message})
}

fn reject(command_id: Option<&str>, reason: Reason, message: &str, security: bool) -> Value {
    let id = command_id.unwrap_or("");
    audit::record(
        if security { "security_event" } else { "command_rejected" },
        &[("command_id", id), ("reason", reason.as_str()), ("detail", message)],
    );
    rejected(command_id, reason, message)
}

impl Pipeline {
    /// [`Pipeline::handle`] under the concurrency limit, for every source of commands (the
    /// socket, the platform): one more than `max_concurrent` is rejected as `overloaded` at
    /// once (audited), never queued.
    pub fn submit(&self, bytes: &[u8], source: &str) -> Value {
        let reply = if self.running.fetch_add(1, Ordering::SeqCst) >= self.max_concurrent {
            let id = signing::parse_command(bytes)
                .ok()
                .and_then(|c| c.get("command_id").and_then(Value::as_str).map(str::to_string));
            let max = self.max_concurrent.to_string();
            audit::record(
                "security_event",
                &[
                    ("reason", "overloaded"),
                    ("source", source),
                    ("max_concurrent", &max),
                    ("command_id", id.as_deref().unwrap_or("")),
                ],
            );
            rejected(id.as_deref(), Reason::Overloaded, &format!("{max} commands are running; try again later"))
        } else {
            self.handle(bytes, signing::now())
        };
        self.running.fetch_sub(1, Ordering::SeqCst);
        reply
    }

    /// Commands running now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Steps 1–9 for one command as received; the reply JSON.
    pub fn handle(&self, bytes: &[u8], now: i64) -> Value {
        let (cmd, verdict, outcome) = match verify_command(bytes, &self.platform_key, now) {
            Verification::Unreadable(r) => return reject(r.command_id.as_deref(), r.reason, &r.message, true),
            Verification::Checked { cmd, verdict, outcome } => (cmd, verdict, outcome),
        };
        let action = cmd.get("action").and_then(Value::as_str).unwrap_or("");
        audit::record(
            "command_received",
            &[
                ("command_id", cmd.get("command_id").and_then(Value::as_str).unwrap_or("")),
                ("action", action),
                ("executor", cmd.get("executor").and_then(Value::as_str).unwrap_or("")),
                (
                    "signature",
                    match &verdict.signature {
                        Ok(()) => "valid",
                        Err(e) => e.as_str(),
                    },
                ),
            ],
        );
        let id = match &outcome {
            Ok(id) => id.as_str(),
            Err(r) => return reject(r.command_id.as_deref(), r.reason, &r.message, true),
        };
        match self.seen.check_and_insert(id, now) {
            Ok(Seen::New) => {}
            Ok(Seen::Replayed) => return reject(Some(id), Reason::Replay, "command_id was already received", true),
            // Fail closed: without the replay store no command is accepted.
            Err(e) => return reject(Some(id), Reason::Internal, &format!("replay store: {e}"), false),
        }
        match action {
            "ping" => self.ping(id),
            "execute" => self.execute(id, &cmd),
            "install_executor" => self.install(id, &cmd),
            "remove_executor" => self.remove(id, &cmd),
            other => reject(Some(id), Reason::UnknownAction, &format!("unknown action {other:?}"), false),
        }
    }

    fn ping(&self, id: &str) -> Value {
        let executors: Vec<String> = crate::executor_install::list(&self.executors)
            .map(|l| l.into_iter().map(|e| format!("{}@{}", e.name, e.version)).collect())
            .unwrap_or_default();
        json!({"status": "completed", "command_id": id, "output": {
            "pong": true, "agent_id": self.config.agent_id(), "version": env!("CARGO_PKG_VERSION"), "executors": executors,
        }})
    }

    /// Step 7: by name, else by action ID (exactly one installed executor supports it).
    fn lookup(&self, cmd: &Map<String, Value>) -> Result<(Executor, Option<String>), String> {
        let action_id = cmd.get("action_id").and_then(Value::as_str).map(str::to_string);
        if let Some(name) = cmd.get("executor").and_then(Value::as_str) {
            if let Some(dir) = crate::executor_install::resolve(&self.executors, name) {
                return Executor::load(&dir).map(|e| (e, action_id)).map_err(|e| e.0);
            }
        }
        let wanted = action_id.clone().or_else(|| cmd.get("executor").and_then(Value::as_str).map(str::to_string));
        let Some(wanted) = wanted else {
            return Err("no executor or action_id given".into());
        };
        let list = crate::executor_install::list(&self.executors).map_err(|e| e.to_string())?;
        let hits: Vec<_> = list.iter().filter(|e| e.supported_actions.contains(&wanted)).collect();
        match hits.as_slice() {
            [one] => Executor::load(&one.path).map(|e| (e, Some(wanted))).map_err(|e| e.0),
            [] => Err(format!("no installed executor is named or supports {wanted:?}")),
            _ => Err(format!("{wanted:?} is supported by several executors; name one")),
        }
    }

    fn execute(&self, id: &str, cmd: &Map<String, Value>) -> Value {
        let (mut executor, action_id) = match self.lookup(cmd) {
            Ok(x) => x,
            Err(e) => return reject(Some(id), Reason::UnknownExecutor, &e, false),
        };
        let name = executor.manifest.name.clone();
        // Step 8: the permission check.
        let denied = |why: String| {
            audit::record("permission_denied", &[("command_id", id), ("executor", &name), ("reason", &why)]);
            rejected(Some(id), Reason::PermissionDenied, &why)
        };
        if let Some(a) = &action_id {
            if !executor.manifest.supported_actions.contains(a) {
                return denied(format!("action {a:?} is not among {name}'s supported_actions"));
            }
        }
        let params = cmd.get("parameters").cloned().unwrap_or_else(|| json!({}));
        if !params.is_object() {
            return denied("parameters must be a JSON object".into());
        }
        if let Some(req) = cmd.get("resource_limits") {
            if let Err(why) = tighten(&mut executor, req, &self.policy) {
                return denied(why);
            }
        }
        audit::record("permission_granted", &[("command_id", id), ("executor", &name)]);
        let req = crate::executor_run::RunRequest {
            executor: &executor,
            params,
            action: action_id,
            command_id: Some(id.to_string()),
            config: &self.config,
            policy: &self.policy,
            launcher: self.launcher.clone(),
            runtime: self.runtime.clone(),
            pool: self.pool.clone(),
        };
        match crate::executor_run::run(req) {
            Ok(result) => {
                serde_json::to_value(&result).unwrap_or_else(|e| json!({"status": "failed", "error": e.to_string()}))
            }
            Err(e) => reject(Some(id), Reason::CannotRun, &e.0, false),
        }
    }

    fn install(&self, id: &str, cmd: &Map<String, Value>) -> Value {
        let p = cmd.get("parameters").cloned().unwrap_or_default();
        let (Some(package), Some(sha)) =
            (p.get("package").and_then(Value::as_str), p.get("sha256").and_then(Value::as_str))
        else {
            return reject(
                Some(id),
                Reason::Malformed,
                "install_executor needs parameters.package and parameters.sha256",
                false,
            );
        };
        let path = Path::new(package);
        match sha256_file(path) {
            Ok(got) if got.eq_ignore_ascii_case(sha) => {}
            Ok(got) => {
                return reject(
                    Some(id),
                    Reason::Checksum,
                    &format!("{package}: sha256 is {got}, the command says {sha}"),
                    true,
                )
            }
            Err(e) => return reject(Some(id), Reason::CannotRun, &format!("{package}: {e}"), false),
        }
        match crate::executor_install::install(path, &self.executors, &self.policy, &Default::default()) {
            Ok(i) => {
                audit::record(
                    "executor_installed",
                    &[("command_id", id), ("executor", &i.name), ("version", &i.version)],
                );
                json!({"status": "completed", "command_id": id, "output": {"name": i.name, "version": i.version}})
            }
            Err(e) => reject(Some(id), Reason::CannotRun, &e.to_string(), false),
        }
    }

    fn remove(&self, id: &str, cmd: &Map<String, Value>) -> Value {
        let name = cmd
            .get("executor")
            .or_else(|| cmd.get("parameters").and_then(|p| p.get("name")))
            .and_then(Value::as_str)
            .unwrap_or("");
        match crate::executor_install::remove(&self.executors, name) {
            Ok(true) => {
                audit::record("executor_removed", &[("command_id", id), ("executor", name)]);
                json!({"status": "completed", "command_id": id, "output": {"removed": name}})
            }
            Ok(false) => reject(Some(id), Reason::UnknownExecutor, &format!("{name:?} is not installed"), false),
            Err(e) => reject(Some(id), Reason::CannotRun, &e.to_string(), false),
        }
    }
}

/// Lower the executor's limits to a command's `resource_limits`; anything above the
/// manifest's value (or the default it implies) is refused.
fn tighten(executor: &mut Executor, req: &Value, policy: &AgentPolicy) -> Result<(), String> {
    let Value::Object(req) = req else {
        return Err("resource_limits must be an object".into());
    };
    let current = policy.limits.resolve(&executor.manifest.resource_limits);
    let m = &mut executor.manifest.resource_limits;
    for (key, value) in req {
        let v =
            value.as_u64().filter(|v| *v > 0).ok_or_else(|| format!("resource_limits.{key}: a positive integer"))?;
        let (slot, allowed) = match key.as_str() {
            "max_memory_mb" => (&mut m.max_memory_mb, current.max_memory_mb),
            "max_cpu_percent" => (&mut m.max_cpu_percent, current.max_cpu_percent),
            "timeout_seconds" => (&mut m.timeout_seconds, current.timeout_seconds),
            "max_disk_mb" => (&mut m.max_disk_mb, current.max_disk_mb),
            "max_bandwidth_mbps" => (&mut m.max_bandwidth_mbps, current.max_bandwidth_mbps),
            "max_pids" => (&mut m.max_pids, current.max_pids),
            other => return Err(format!("resource_limits.{other}: unknown limit")),
        };
        if v > allowed {
            return Err(format!("resource_limits.{key}: {v} is beyond what the manifest allows ({allowed})"));
        }
        *slot = Some(v);
    }
    Ok(())
}

fn sha256_file(p: &Path) -> std::io::Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut h = sha2::Sha256::new();
    let mut f = std::fs::File::open(p)?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;

    #[test]
    fn verify_command_gives_a_reason_for_every_rejection() {
        let key = SigningKey::from_bytes(&[7u8; 32]);
        let now = signing::parse_rfc3339("2026-04-28T12:00:00Z").unwrap();
        let signed = |text: &str| {
            let mut cmd = signing::parse_command(text.as_bytes()).unwrap();
            signing::sign(&mut cmd, &key, now).unwrap();
            serde_json::to_vec(&Value::Object(cmd)).unwrap()
        };
        let vk = key.verifying_key();
        let reason = |bytes: &[u8]| match verify_command(bytes, &vk, now) {
            Verification::Unreadable(r) => Err(r.reason),
            Verification::Checked { outcome, .. } => outcome.map_err(|r| r.reason),
        };
        assert_eq!(reason(&signed(r#"{"command_id":"c1","action":"ping"}"#)), Ok("c1".to_string()));
        assert_eq!(reason(&vec![b' '; signing::MAX_COMMAND_BYTES + 1]), Err(Reason::TooLarge));
        assert_eq!(reason(b"{\"a\":1,\"a\":2}"), Err(Reason::Malformed));
        assert_eq!(reason(br#"{"command_id":"c1"}"#), Err(Reason::Unsigned));
        let mut tampered = signed(r#"{"command_id":"c1","action":"ping"}"#);
        let at = tampered.iter().position(|b| *b == b'p').unwrap();
        tampered[at] = b'q';
        assert_eq!(reason(&tampered), Err(Reason::BadSignature));
        assert_eq!(
            reason(&signed(r#"{"command_id":"c1","timestamp":"2026-04-28T11:00:00Z"}"#)),
            Err(Reason::ClockSkew)
        );
        assert_eq!(reason(&signed(r#"{"action":"ping"}"#)), Err(Reason::Malformed));
        assert_eq!(reason(&signed(&format!(r#"{{"command_id":"{}"}}"#, "x".repeat(257)))), Err(Reason::Malformed));
        let codes: std::collections::HashSet<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(codes.len(), Reason::ALL.len(), "reason codes are distinct");
    }
}
