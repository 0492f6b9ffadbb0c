//! The verification pipeline for signed commands (DESIGN.md §6, seed 001), in this order —
//! each rejection is audited with its reason and answered with `status: "rejected"`:
//!
//! 1. size ≤ [`signing::MAX_COMMAND_BYTES`]
//! 2. strict parse (UTF-8, one JSON object, no duplicate keys, bounded depth)
//! 3. Ed25519 signature (strict) with the platform's key
//! 4. `timestamp` within [`signing::MAX_SKEW_S`] of the agent's clock
//! 5. addressed to this agent: a command naming an agent (`agent_id`) runs only on that one;
//!    with `agent.require_agent_id` every command must name it
//! 6. `command_id` never seen before (persisted across restarts: [`crate::replay`])
//! 7. the action: `execute`, `install_executor` (see [`Pipeline::install`]: downloaded over
//!    the platform connection, size-capped, SHA-256 and package signature checked before
//!    anything is unpacked), `remove_executor`, `ping`
//! 8. `execute`: the executor, by name (`executor`) or by action ID (`action_id` among the
//!    installed executors' `supported_actions`)
//! 9. the permission check: the action ID must be supported, `parameters` an object, and a
//!    command's `resource_limits` may only tighten the manifest's (never exceed it or the
//!    agent's ceilings)
//! 10. run
//!
//! Nothing is recorded as seen before the signature and the clock have been checked, so
//! unsigned or stale traffic cannot fill the replay store or burn a future command's id.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use ed25519_dalek::VerifyingKey;
use serde_json::{json, Map, Value};

use crate::audit;
use crate::config::Config;
use crate::executor_run::Executor;
use crate::policy::AgentPolicy;
use crate::replay::{Seen, SeenCommands};
use crate::signing;

/// One of a [`Pipeline`]'s `max_concurrent` places, taken ahead of its command
/// ([`Pipeline::reserve`]); given back when dropped.
pub struct Place {
    pipeline: std::sync::Arc<Pipeline>,
}

impl Place {
    /// [`Pipeline::submit`] in the place already held (never `overloaded`), and whether the
    /// command passed the control plane's checks ([`Handled`]).
    pub fn submit(self, bytes: &[u8], source: &str) -> Handled {
        self.pipeline.handle_checked(bytes, signing::now(), source)
    }
}

/// A command's reply, and whether the command passed the control plane's checks — size,
/// form, signature, clock, address and replay (steps 1–6) — whatever became of it after
/// them. A command that did not pass is not one the platform's key issued for this agent
/// now: what a connection that answers as the platform without holding its key (a
/// compromised proxy or front end) can send, as many as it likes.
pub struct Handled {
    pub reply: Value,
    pub passed_checks: bool,
    /// An `execute` command's record in the runtime directory's `running` ([`crate::inflight`]):
    /// drop it once the reply is delivered (written to the client, posted to the platform).
    pub delivery: Option<crate::inflight::Running>,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.pipeline.running.fetch_sub(1, Ordering::SeqCst);
    }
}

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
    /// Commands running now, and places reserved for commands about to run; maintained by
    /// [`Pipeline::submit`] and [`Place`] (start it at zero).
    pub running: AtomicUsize,
    /// Where `install_executor` downloads packages (none: no platform configured).
    pub packages: Option<crate::platform::Packages>,
    /// The package signature rules (`executors.require_signature`, `trusted_keys`).
    pub trust: crate::package_signing::Trust,
    /// `executors.install` entries that failed at start (heartbeats and `ping` report them).
    pub install_failures: Vec<crate::executor_install::InstallFailure>,
    /// The commands running now, on disk, and those a dead predecessor left
    /// ([`crate::inflight`]); `None`: not kept (a pipeline without a socket of its own).
    pub inflight: Option<crate::inflight::InFlight>,
    /// Interrupted commands from the platform whose answer is still to be posted to it
    /// (taken by the platform connection as it starts).
    pub interrupted_for_platform: std::sync::Mutex<Vec<crate::inflight::Entry>>,
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
    /// `install_executor` without a platform connection to download from.
    NoPlatform,
    /// The package could not be downloaded (network, HTTP status).
    Download,
    /// No package signature where `executors.require_signature` asks for one.
    UnsignedPackage,
    /// A package signature that does not verify with a trusted key.
    BadPackageSignature,
    /// The package is not a valid archive or executor (traversal, manifest, lint, size).
    InvalidPackage,
    /// That version is installed already.
    AlreadyInstalled,
    /// That version is installed with other content.
    VersionConflict,
    /// The command names another agent, or none where `agent.require_agent_id` asks for it.
    WrongAgent,
    /// The command was running when the agent stopped (its id sent again): it did not finish
    /// and is not run again under that id ([`crate::inflight`]).
    Interrupted,
    /// The command finished, but the agent stopped before its reply was delivered (its id
    /// sent again): the result is lost, and it is not run again under that id.
    ResultLost,
}

impl Reason {
    /// Every reason code, for checks that a reply carries one of them.
    pub const ALL: [Reason; 23] = [
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
        Reason::NoPlatform,
        Reason::Download,
        Reason::UnsignedPackage,
        Reason::BadPackageSignature,
        Reason::InvalidPackage,
        Reason::AlreadyInstalled,
        Reason::VersionConflict,
        Reason::WrongAgent,
        Reason::Interrupted,
        Reason::ResultLost,
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
            Reason::NoPlatform => "no_platform",
            Reason::Download => "download",
            Reason::UnsignedPackage => "unsigned_package",
            Reason::BadPackageSignature => "bad_package_signature",
            Reason::InvalidPackage => "invalid_package",
            Reason::AlreadyInstalled => "already_installed",
            Reason::VersionConflict => "version_conflict",
            Reason::WrongAgent => "wrong_agent",
            Reason::Interrupted => "interrupted",
            Reason::ResultLost => "result_lost",
        }
    }

    /// The reason for a failed install.
    pub fn of_install(e: &crate::executor_install::InstallError) -> Reason {
        use crate::executor_install::InstallError as E;
        match e {
            E::Invalid(_) => Reason::InvalidPackage,
            E::Io { .. } => Reason::CannotRun,
            E::AlreadyInstalled { .. } => Reason::AlreadyInstalled,
            E::Unsigned(_) => Reason::UnsignedPackage,
            E::BadSignature(_) => Reason::BadPackageSignature,
            E::Checksum(_) => Reason::Checksum,
            E::Conflict(_) => Reason::VersionConflict,
            E::TooLarge(_) => Reason::TooLarge,
            E::Audit(_) | E::Interrupted(_) => Reason::CannotRun,
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
        reject(Reason::ClockSkew, &format!("{e}{}", crate::doctor::clock_skew_hint().unwrap_or("")))
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

/// What a command says of its own name and its executor's is recorded within this many bytes
/// (an executor's name has at most 64), and its `command_id` within
/// [`crate::replay::MAX_ID_BYTES`] (the longest a valid one has): before its signature is
/// known good these are anyone's words, and a platform connection that sends commands the
/// agent refuses must not fill the audit log (and rotate its history out) with ~4 KiB
/// fields of its choosing.
const CLAIMED_NAME_BYTES: usize = 64;
/// The `detail` of a refusal by the checks (which may quote what the command held: a
/// timestamp, a key) is recorded within this many bytes.
const REJECTION_DETAIL_BYTES: usize = 512;

/// A command that passed the checks of steps 1–6 and is rejected after them (audited as
/// `command_rejected`, with its detail whole).
fn reject(command_id: Option<&str>, reason: Reason, message: &str) -> Value {
    audit::record(
        "command_rejected",
        &[("command_id", command_id.unwrap_or("")), ("reason", reason.as_str()), ("detail", message)],
    );
    rejected(command_id, reason, message)
}

/// A command refused by the checks of steps 1–6 (a security event): its id, and the detail
/// (which may quote what it held), recorded short.
fn refuse(command_id: Option<&str>, reason: Reason, message: &str) -> Value {
    let id = audit::cut(command_id.unwrap_or(""), crate::replay::MAX_ID_BYTES);
    audit::record(
        "security_event",
        &[("command_id", &id), ("reason", reason.as_str()), ("detail", &audit::cut(message, REJECTION_DETAIL_BYTES))],
    );
    rejected(command_id, reason, message)
}

impl Pipeline {
    /// How sandboxes start now, for heartbeats: `launch` (`zygote` or `cold`), whether the
    /// zygote's process is alive (it is restarted on the next run after it dies), how many
    /// seconds runs still start cold after a zygote that did not serve, its network namespace
    /// stash (target, ready, made, taken, and why it stopped if it did), and the warm pool's
    /// size and ready sandboxes.
    pub fn launch_status(&self) -> Value {
        let (launch, zygote_running, zygote_paused, netns_stash) = match &self.launcher {
            sandbox::Launcher::Zygote { zygote, .. } => (
                "zygote",
                Some(zygote.alive()),
                zygote.paused_for().map(|d| d.as_secs() + 1),
                zygote.netns_stash().map(|s| s.status()),
            ),
            _ => ("cold", None, None, None),
        };
        json!({
            "launch": launch,
            "zygote_running": zygote_running,
            "zygote_paused_s": zygote_paused,
            "netns_stash": netns_stash,
            "warm_pool": self.pool.as_ref().map(|p| json!({"size": p.size(), "ready": p.ready()})),
        })
    }

    /// The warm pool, warm before the first command: a sandbox for a plain run (no tightened
    /// limits) of each installed executor without network egress, by name, up to the pool's
    /// size, started in the background. An executor that does not load is left out (its
    /// commands report why).
    pub fn prewarm_pool(&self) {
        let Some(pool) = &self.pool else { return };
        let installed = match crate::executor_install::loaded(&self.executors) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "warm pool: cannot list the installed executors");
                return;
            }
        };
        let executors = installed
            .into_iter()
            .map(|(_, executor)| executor)
            .filter(|ex| !ex.manifest.permissions.network.outbound)
            .take(pool.size());
        for executor in executors {
            let req = crate::executor_run::RunRequest {
                executor: &executor,
                params: json!({}),
                action: None,
                command_id: None,
                config: &self.config,
                policy: &self.policy,
                launcher: self.launcher.clone(),
                runtime: self.runtime.clone(),
                pool: self.pool.clone(),
                background_teardown: true,
                timeline: None,
            };
            if let Err(e) = crate::executor_run::prewarm(&req) {
                tracing::warn!(executor = %executor.manifest.name, error = %e.0, "warm pool: not pre-warmed");
            }
        }
    }

    /// [`Pipeline::handle`] under the concurrency limit, for every source of commands (the
    /// socket, the platform): one more than `max_concurrent` is rejected as `overloaded` at
    /// once (audited), never queued.
    pub fn submit(&self, bytes: &[u8], source: &str) -> Handled {
        let handled = if self.running.fetch_add(1, Ordering::SeqCst) >= self.max_concurrent {
            let id = signing::parse_command(bytes)
                .ok()
                .and_then(|c| c.get("command_id").and_then(Value::as_str).map(str::to_string));
            let reply =
                self.overloaded(id.as_deref(), source, &format!("{} commands are running", self.max_concurrent));
            Handled { reply, passed_checks: false, delivery: None }
        } else {
            self.handle_checked(bytes, signing::now(), source)
        };
        self.running.fetch_sub(1, Ordering::SeqCst);
        handled
    }

    /// Take one of the `max_concurrent` places ahead of a command (the platform's, before its
    /// thread starts): `None` when every place is taken. The place is held until the
    /// returned [`Place`] is dropped (or its command answered).
    pub fn reserve(self: &std::sync::Arc<Self>) -> Option<Place> {
        // A compare-and-swap loop rather than `fetch_update`, which newer toolchains deprecate
        // (renamed `try_update`) and older ones lack under its new name.
        let mut taken = self.running.load(Ordering::SeqCst);
        loop {
            if taken >= self.max_concurrent {
                return None;
            }
            match self.running.compare_exchange_weak(taken, taken + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Some(Place { pipeline: self.clone() }),
                Err(now) => taken = now,
            }
        }
    }

    /// The `overloaded` rejection (audited as a security event): `why` says which limit was
    /// reached.
    pub fn overloaded(&self, command_id: Option<&str>, source: &str, why: &str) -> Value {
        let max = self.max_concurrent.to_string();
        audit::record(
            "security_event",
            &[
                ("reason", "overloaded"),
                ("source", source),
                ("max_concurrent", &max),
                ("command_id", &audit::cut(command_id.unwrap_or(""), crate::replay::MAX_ID_BYTES)),
                ("detail", why),
            ],
        );
        rejected(command_id, Reason::Overloaded, &format!("{why}; try again later"))
    }

    /// `agent.max_concurrent`: commands run at once.
    pub fn max_concurrent(&self) -> usize {
        self.max_concurrent
    }

    /// Commands running now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Steps 1–10 for one command as received from `source` (`platform`, or the socket and
    /// its client's pid and uid: recorded with the receipt); the reply JSON, returned once
    /// every audit record of the command is durable.
    pub fn handle(&self, bytes: &[u8], now: i64, source: &str) -> Value {
        self.handle_checked(bytes, now, source).reply
    }

    /// [`Pipeline::handle`], and whether the command passed the checks of steps 1–6.
    pub fn handle_checked(&self, bytes: &[u8], now: i64, source: &str) -> Handled {
        let handled = match self.checked(bytes, now, source) {
            Ok((cmd, id)) => {
                let (reply, delivery) = self.dispatch(&id, &cmd, source);
                Handled { reply, passed_checks: true, delivery }
            }
            Err(reply) => {
                // What became of a command interrupted by the agent's stop, sent again: it
                // passed every check but the replay store's (it is no refused command, which
                // a platform connection sending many of is polled less for).
                let reason = reply["reason"].as_str();
                let passed_checks =
                    reason == Some(Reason::Interrupted.as_str()) || reason == Some(Reason::ResultLost.as_str());
                Handled { reply, passed_checks, delivery: None }
            }
        };
        // An `execute` command's receipt and permission are recorded before its gate without
        // a flush of their own (`audit::record_before_gate`); one that ended before the gate
        // is answered only once they are durable (normally settled already by the next
        // record's flush).
        if let Err(e) = audit::settle() {
            tracing::error!(target: "opservant::audit", error = %e, "audit log: a command's records are not durable");
        }
        handled
    }

    /// Steps 1–6, each refusal audited (before the gate of an `execute`, see `handle`): the
    /// command and its id when it passed them, else the reply. What a command that has not
    /// passed them says of itself is anyone's words, recorded short (see
    /// [`CLAIMED_NAME_BYTES`]).
    /// The receipt names where the command came from and the SHA-256 of its bytes as
    /// received (what was signed, whatever it says of itself).
    fn checked(&self, bytes: &[u8], now: i64, source: &str) -> Result<(Map<String, Value>, String), Value> {
        let (cmd, verdict, outcome) = match verify_command(bytes, &self.platform_key, now) {
            Verification::Unreadable(r) => return Err(refuse(r.command_id.as_deref(), r.reason, &r.message)),
            Verification::Checked { cmd, verdict, outcome } => (cmd, verdict, outcome),
        };
        let action = cmd.get("action").and_then(Value::as_str).unwrap_or("");
        // Before the gate of an `execute` (its `executor_start`), see `handle`; any other
        // command's receipt is durable before it goes on.
        let received = if action == "execute" { audit::record_before_gate } else { audit::record };
        let claimed = |key: &str, max: usize| audit::cut(cmd.get(key).and_then(Value::as_str).unwrap_or(""), max);
        received(
            "command_received",
            &[
                ("command_id", &claimed("command_id", crate::replay::MAX_ID_BYTES)),
                ("action", &claimed("action", CLAIMED_NAME_BYTES)),
                ("executor", &claimed("executor", CLAIMED_NAME_BYTES)),
                (
                    "signature",
                    match &verdict.signature {
                        Ok(()) => "valid",
                        Err(e) => e.as_str(),
                    },
                ),
                ("source", source),
                ("sha256", &audit::sha256_hex(bytes)),
            ],
        );
        let id = match outcome {
            Ok(id) => id,
            Err(r) => return Err(refuse(r.command_id.as_deref(), r.reason, &r.message)),
        };
        if let Err(why) = self.addressed_here(&cmd) {
            return Err(refuse(Some(&id), Reason::WrongAgent, &why));
        }
        match self.seen.check_and_insert(&id, now) {
            Ok(Seen::New) => Ok((cmd, id)),
            Ok(Seen::Replayed) => match self.inflight.as_ref().and_then(|f| f.interrupted(&id)) {
                // Sent again after the agent's stop interrupted it (a client that lost its
                // reply with the agent): what became of it, not a replay refusal.
                Some(entry) => {
                    let (reason, detail) = match entry.finished {
                        None => (Reason::Interrupted, "sent again after the agent's stop interrupted it"),
                        Some(_) => (Reason::ResultLost, "sent again after its result was lost with the agent's stop"),
                    };
                    audit::record(
                        "command_rejected",
                        &[("command_id", &id), ("reason", reason.as_str()), ("detail", detail)],
                    );
                    Err(crate::inflight::reply(&entry))
                }
                None => Err(refuse(Some(&id), Reason::Replay, "command_id was already received")),
            },
            Ok(Seen::Forgotten) => {
                let why = "the clock is back within the window of command ids the replay store has dropped: \
                           this command_id cannot be told from a replay (send it with a new one)";
                Err(refuse(Some(&id), Reason::Replay, why))
            }
            // Fail closed: without the replay store no command is accepted.
            Err(e) => Err(reject(Some(&id), Reason::Internal, &format!("replay store: {e}"))),
        }
    }

    /// Steps 7–10 for a command that passed the checks.
    fn dispatch(&self, id: &str, cmd: &Map<String, Value>, source: &str) -> (Value, Option<crate::inflight::Running>) {
        let action = cmd.get("action").and_then(Value::as_str).unwrap_or("");
        match action {
            "ping" => (self.ping(id), None),
            "execute" => self.execute(id, cmd, source),
            "install_executor" => (self.install(id, cmd), None),
            "remove_executor" => (self.remove(id, cmd), None),
            other => (reject(Some(id), Reason::UnknownAction, &format!("unknown action {other:?}")), None),
        }
    }

    /// Step 5: a signed command is valid on every agent that trusts the platform key, so one
    /// meant for another agent is refused by its `agent_id` (a copy replayed across the
    /// fleet within the clock window); with `agent.require_agent_id` it must name one.
    fn addressed_here(&self, cmd: &Map<String, Value>) -> Result<(), String> {
        let required = self.config.agent.require_agent_id.unwrap_or(false);
        match cmd.get("agent_id") {
            None | Some(Value::Null) if required => {
                Err("the command names no agent_id, and agent.require_agent_id is on".into())
            }
            None | Some(Value::Null) => Ok(()),
            Some(Value::String(to)) => {
                let me = self.config.agent_id();
                if *to == me {
                    Ok(())
                } else {
                    Err(format!("the command is for agent {to:?}; this is {me:?}"))
                }
            }
            Some(_) => Err("agent_id must be a string".into()),
        }
    }

    fn ping(&self, id: &str) -> Value {
        let executors: Vec<String> = crate::executor_install::list(&self.executors)
            .map(|l| l.into_iter().map(|e| format!("{}@{}", e.name, e.version)).collect())
            .unwrap_or_default();
        json!({"status": "completed", "command_id": id, "output": {
            "pong": true, "agent_id": self.config.agent_id(), "version": env!("CARGO_PKG_VERSION"), "build": crate::app::BUILD, "executors": executors,
            "install_failures": self.install_failures,
            "sandboxes": self.launch_status(),
            "audit": crate::audit::health(),
            "binaries": crate::integrity::report(),
        }})
    }

    /// Step 7: by name when the command names one (that executor or none: a command naming
    /// an executor that is not installed never runs another), else by action ID (exactly one
    /// installed executor supports it).
    fn lookup(&self, cmd: &Map<String, Value>) -> Result<(Executor, Option<String>), (Reason, String)> {
        let text = |key: &str| match cmd.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err((Reason::Malformed, format!("{key} must be a string, not {other}"))),
        };
        let action_id = text("action_id")?;
        let unknown = |e: String| (Reason::UnknownExecutor, e);
        if let Some(name) = text("executor")? {
            return match crate::executor_install::resolve(&self.executors, &name) {
                Ok(Some(dir)) => Executor::load(&dir).map(|e| (e, action_id)).map_err(|e| unknown(e.0)),
                Ok(None) => Err(unknown(format!("no installed executor is named {name:?}"))),
                Err(e) => Err(unknown(e.to_string())),
            };
        }
        let Some(wanted) = action_id else {
            return Err(unknown("no executor or action_id given".into()));
        };
        let list = crate::executor_install::list(&self.executors).map_err(|e| unknown(e.to_string()))?;
        let hits: Vec<_> = list.iter().filter(|e| e.supported_actions.contains(&wanted)).collect();
        match hits.as_slice() {
            [one] => Executor::load(&one.path).map(|e| (e, Some(wanted))).map_err(|e| unknown(e.0)),
            [] => Err(unknown(format!("no installed executor supports {wanted:?}"))),
            _ => Err(unknown(format!("{wanted:?} is supported by several executors; name one"))),
        }
    }

    /// Step 7 on for an `execute` command: its reply, and its record in `running/` — marked
    /// finished with the reply's status — to be dropped once the reply is delivered.
    fn execute(&self, id: &str, cmd: &Map<String, Value>, source: &str) -> (Value, Option<crate::inflight::Running>) {
        let mut running = None;
        let reply = self.execute_in(id, cmd, source, &mut running);
        if let Some(r) = running.as_mut() {
            r.finish(reply["status"].as_str().unwrap_or("failed"));
        }
        (reply, running)
    }

    fn execute_in(
        &self,
        id: &str,
        cmd: &Map<String, Value>,
        source: &str,
        running: &mut Option<crate::inflight::Running>,
    ) -> Value {
        let (mut executor, action_id) = match self.lookup(cmd) {
            Ok(x) => x,
            Err((reason, e)) => return reject(Some(id), reason, &e),
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
        // Made durable by the run's `executor_start` gate, before anything of the executor
        // runs, or by `handle` before the reply (see there).
        audit::record_before_gate("permission_granted", &[("command_id", id), ("executor", &name)]);
        let req = crate::executor_run::RunRequest {
            executor: &executor,
            params,
            action: action_id.clone(),
            command_id: Some(id.to_string()),
            config: &self.config,
            policy: &self.policy,
            launcher: self.launcher.clone(),
            runtime: self.runtime.clone(),
            pool: self.pool.clone(),
            background_teardown: true,
            timeline: None,
        };
        // On disk while it runs (and until its reply is delivered): an agent that dies
        // meanwhile says so at its next start.
        *running = self.inflight.as_ref().and_then(|f| {
            f.begin(&crate::inflight::Entry {
                command_id: id.to_string(),
                executor: name.clone(),
                source: source.to_string(),
                pid: std::process::id(),
                started: crate::rfc3339::format(crate::rfc3339::now()),
                finished: None,
                audited: false,
            })
        });
        match crate::executor_run::run(req) {
            Ok(result) => {
                serde_json::to_value(&result).unwrap_or_else(|e| json!({"status": "failed", "error": e.to_string()}))
            }
            // Failed after its start record (audited as `executor_fail`): not a refusal.
            Err(e) => match e.failed_reply(&executor, action_id.as_deref(), Some(id)) {
                Some(reply) => reply,
                None => reject(Some(id), Reason::CannotRun, e.message()),
            },
        }
    }

    /// `install_executor`: `parameters` = `{"name", "sha256", "size"?, "signature"?}`. The
    /// package is downloaded from the platform (`GET …/packages/{name}`, mutual TLS) into a
    /// root-only staging file, bounded by `executors.max_package_mb` (and exactly `size`
    /// when given); its SHA-256 must be `sha256` and, per `executors.require_signature`, its
    /// detached signature (`signature`, else `GET …/packages/{name}.sig`) must verify with a
    /// trusted key — all before anything is unpacked; then the normal install (lint, wheels,
    /// atomic switch). Every failure is audited (`executor_install_failed`) with its reason.
    fn install(&self, id: &str, cmd: &Map<String, Value>) -> Value {
        let p = cmd.get("parameters").cloned().unwrap_or_default();
        let params = match InstallParams::parse(&p) {
            Ok(x) => x,
            Err(e) => return install_failed(id, "", Reason::Malformed, &e),
        };
        let name = params.name.as_str();
        let Some(packages) = &self.packages else {
            return install_failed(
                id,
                name,
                Reason::NoPlatform,
                "install_executor downloads from the platform, and network.agent_to_platform is not configured",
            );
        };
        let signature = match params.signature {
            Some(s) => Some(s),
            None => match packages.signature(name) {
                Ok(s) => s,
                Err(e) => return install_failed(id, name, Reason::Download, &e),
            },
        };
        let max_bytes = self.config.executors.max_package_bytes();
        let mut body = match packages.open(name, params.size.map_or(max_bytes, |s| s.min(max_bytes))) {
            Ok(b) => b,
            Err(e @ crate::platform::PackageError::TooLarge(_)) => {
                return install_failed(id, name, Reason::TooLarge, &e.to_string())
            }
            Err(e) => return install_failed(id, name, Reason::Download, &e.to_string()),
        };
        let check = crate::executor_install::PackageCheck {
            trust: &self.trust,
            signature,
            sha256: Some(params.sha256.clone()),
            source: "command",
            command_id: Some(id),
            kind: None,
            max_bytes,
            label: None,
        };
        let installed = crate::executor_install::install_download(
            &mut body,
            name,
            params.size,
            &self.executors,
            &self.policy,
            &crate::executor_install::InstallOptions { force: params.force, ..Default::default() },
            check,
        );
        match installed {
            Ok(i) => {
                audit::record(
                    "executor_installed",
                    &[
                        ("command_id", id),
                        ("source", "command"),
                        ("package", name),
                        ("executor", &i.name),
                        ("version", &i.version),
                        ("sha256", &params.sha256),
                        ("signed_by", i.signed_by.as_deref().unwrap_or("")),
                    ],
                );
                json!({"status": "completed", "command_id": id, "output": {
                    "name": i.name, "version": i.version, "previous": i.previous, "package": name,
                    "sha256": params.sha256, "signed_by": i.signed_by, "warnings": i.warnings,
                }})
            }
            Err(e) => install_failed(id, name, Reason::of_install(&e), &e.to_string()),
        }
    }

    fn remove(&self, id: &str, cmd: &Map<String, Value>) -> Value {
        let name = cmd
            .get("executor")
            .or_else(|| cmd.get("parameters").and_then(|p| p.get("name")))
            .and_then(Value::as_str)
            .unwrap_or("");
        match crate::executor_install::remove(&self.executors, name, "command", Some(id)) {
            Ok(true) => {
                audit::record("executor_removed", &[("command_id", id), ("executor", name)]);
                json!({"status": "completed", "command_id": id, "output": {"removed": name}})
            }
            Ok(false) => reject(Some(id), Reason::UnknownExecutor, &format!("{name:?} is not installed")),
            Err(e) => reject(Some(id), Reason::CannotRun, &e.to_string()),
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

/// An `install_executor` failure: audited (`executor_install_failed`, with the reason) and
/// answered as a rejection.
fn install_failed(id: &str, package: &str, reason: Reason, message: &str) -> Value {
    audit::record(
        "executor_install_failed",
        &[
            ("command_id", id),
            ("source", "command"),
            ("package", package),
            ("reason", reason.as_str()),
            ("error", message),
        ],
    );
    rejected(Some(id), reason, message)
}

/// The `parameters` of `install_executor`, checked strictly (unknown keys refused).
#[derive(Debug)]
struct InstallParams {
    name: String,
    sha256: String,
    size: Option<u64>,
    signature: Option<String>,
    /// Install again a version that is already installed (as `executor install --force`).
    force: bool,
}

impl InstallParams {
    fn parse(p: &Value) -> Result<InstallParams, String> {
        let Value::Object(m) = p else {
            return Err("install_executor: parameters must be an object with name and sha256".into());
        };
        if let Some(k) = m.keys().find(|k| !matches!(k.as_str(), "name" | "sha256" | "size" | "signature" | "force")) {
            return Err(format!("install_executor: parameters.{k}: unknown (name, sha256, size, signature, force)"));
        }
        let name = m.get("name").and_then(Value::as_str).unwrap_or("");
        if !crate::platform::valid_package_name(name) {
            return Err(format!(
                "install_executor: parameters.name {name:?}: required, 1-128 of A-Z a-z 0-9 . _ - not starting with a dot"
            ));
        }
        let sha256 = m.get("sha256").and_then(Value::as_str).unwrap_or("");
        if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("install_executor: parameters.sha256: required, 64 hex digits".into());
        }
        let size = match m.get("size") {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .filter(|s| *s > 0)
                    .ok_or("install_executor: parameters.size: a positive integer (bytes)".to_string())?,
            ),
        };
        let signature = match m.get("signature") {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err("install_executor: parameters.signature: base64 text".into()),
        };
        let force = match m.get("force") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err("install_executor: parameters.force: true or false".into()),
        };
        Ok(InstallParams { name: name.to_string(), sha256: sha256.to_ascii_lowercase(), size, signature, force })
    }
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
