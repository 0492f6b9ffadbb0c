//! The application protocol between the agent and its sandboxed runtime (the payload of an
//! entry sandbox), carried as JSON over the sandbox's application channel.
//!
//! Everything the agent receives here comes from the payload process, where executor code
//! runs: it is untrusted. Messages are size-bounded by the channel (`MAX_MESSAGE`), parsed
//! strictly, and never decide anything about isolation (the sandbox's own reports travel on
//! the separate control channel, which the payload no longer holds).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Largest message the agent accepts from a payload (the result carries output, capped at
/// 4 MiB, and artifacts, capped at 8 MiB before base64).
pub const MAX_MESSAGE: usize = 16 * 1024 * 1024;
/// `output` cap (bytes of its JSON encoding).
pub const MAX_OUTPUT: usize = 4 * 1024 * 1024;
/// Artifact caps: each file, and all of a run's files together.
pub const MAX_ARTIFACT: u64 = 4 * 1024 * 1024;
pub const MAX_ARTIFACTS_TOTAL: u64 = 8 * 1024 * 1024;
/// Log records kept per run.
pub const MAX_LOGS: usize = 1000;
/// `error` cap (bytes): an error message or traceback longer than this is cut.
pub const MAX_ERROR: usize = 64 * 1024;
/// Artifact entries kept per run (each file, or why it could not be read).
pub const MAX_ARTIFACT_ENTRIES: usize = 1000;
/// Most memory (bytes, estimated by [`parsed_cost_up_to`]) one message may take the agent
/// once parsed. Parsed, JSON costs the agent many times its text — tens of bytes a value,
/// ~0.7 KB a non-empty object (a B-tree node) — none of it charged to the sandbox: a 10 MB
/// message of nested one-key objects took 1.3 GB. A message over it is refused before it is
/// parsed. 4 MiB of output as small integers (`0,0,…`, ~134 MiB) fits; output of many small
/// objects may be refused below its own 4 MiB cap (~130 000 objects of three keys). Measured
/// at the limit (a debug `opservant run`, whose no-op run peaks at 23 MiB): 119–230 MiB at
/// its peak by the shape of the message — the estimate bounds the parse; the run's later
/// copies (the output's size check, its redaction) come on top.
pub const MAX_MESSAGE_PARSED: usize = 160 * 1024 * 1024;

/// Estimated heap of a parsed value, in bytes, by what allocates it (serde_json's `Value`
/// with `BTreeMap` objects, parsed straight into it by [`parse`]): an array's first element
/// (the vector's smallest allocation, 4 × 32 bytes and the allocator's header), each further
/// element (a 32-byte `Value`, twice for the vector's growth), an object entry (its key's
/// `String` and its `Value` in a node half full, and its share of the nodes above), a
/// non-empty object's first B-tree node (11 keys and values), a string's smallest
/// allocation; every byte of the text on top, for the strings' contents.
const COST_FIRST_ELEMENT: usize = 160;
const COST_ELEMENT: usize = 64;
const COST_ENTRY: usize = 160;
const COST_OBJECT: usize = 640;
const COST_STRING: usize = 32;
/// Containers deeper than this fail to parse anyway (serde_json's recursion limit).
const MAX_TRACKED_DEPTH: u32 = 128;

/// An upper bound on the memory `bytes` takes parsed into a `serde_json::Value` (see the
/// `COST_` constants), counted without allocating; past `limit` it stops.
fn parsed_cost_up_to(bytes: &[u8], limit: usize) -> usize {
    let mut cost = bytes.len().saturating_add(COST_ELEMENT);
    let (mut in_string, mut escaped) = (false, false);
    // Which open containers are objects (bit `depth - 1` set), and whether the last
    // container opened may still turn out empty (its first value not seen yet).
    let (mut objects, mut depth, mut opened) = (0u128, 0u32, false);
    for &b in bytes {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        if b.is_ascii_whitespace() {
            continue;
        }
        let in_object = depth > 0 && depth <= MAX_TRACKED_DEPTH && objects & (1u128 << (depth - 1)) != 0;
        if opened && b != b']' && b != b'}' {
            // The first value (or key) of the container just opened.
            cost = cost.saturating_add(if in_object { COST_OBJECT + COST_ENTRY } else { COST_FIRST_ELEMENT });
        }
        opened = false;
        match b {
            b'"' => {
                in_string = true;
                cost = cost.saturating_add(COST_STRING);
            }
            b'{' | b'[' => {
                depth += 1;
                if depth <= MAX_TRACKED_DEPTH {
                    let bit = 1u128 << (depth - 1);
                    objects = if b == b'{' { objects | bit } else { objects & !bit };
                }
                opened = true;
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            b',' => cost = cost.saturating_add(if in_object { COST_ENTRY } else { COST_ELEMENT }),
            _ => {}
        }
        if cost > limit {
            return cost;
        }
    }
    cost
}

/// This build's identity, `VERSION+HASH` (build.rs: a hash of every source file of the two
/// binaries), the same in `opservant` and the `opservant-runtime` built with it. The agent
/// sends it with every message of arguments ([`encode_args`]) and expects it in a zygote's
/// ready message (`sandbox::zygote::Zygote::expecting`); a runtime of another build answers
/// with [`wrong_build`] before it reads anything else. Either binary replaced (an upgrade)
/// while an agent runs is thus named as such — the agent keeps the copy it started from,
/// the runtime is started anew from its file — instead of failing later as a malformed
/// message, or passing while the two disagree on a message's meaning.
pub const BUILD: &str = env!("OPSERVANT_BUILD");

/// A build identity as an error names it: at most 64 characters, escaped (a runtime's
/// reply is the payload's to write).
pub(crate) fn shown_build(build: &str) -> String {
    build.chars().take(64).collect::<String>().escape_debug().to_string()
}

/// How [`wrong_build_error`] begins (no other protocol error does: they name a malformed,
/// refused or unexpected message).
const WRONG_BUILD: &str = "opservant-runtime is build ";

/// The error of a run whose runtime broke the protocol (`what`: "executor", "script"): `e`
/// prefixed with that — unless `e` says the runtime is another build, which is no
/// misbehaviour and is told as it is.
pub fn misbehaved(what: &str, e: &str) -> String {
    if e.starts_with(WRONG_BUILD) {
        e.to_string()
    } else {
        format!("the {what} runtime misbehaved: {e}")
    }
}

/// The error of a run whose runtime could not start (exit status 70 before `ready`; `what`:
/// "executor", "script"), from the last line it wrote on stderr — with a hint when that line
/// is how a runtime from before the build check refuses this build's arguments (this build's
/// runtime never finds them malformed).
pub fn could_not_start(what: &str, stderr_line: &str) -> String {
    let hint = if stderr_line.contains("malformed arguments") {
        " (an opservant-runtime of an older build than this opservant's? the two must be one build: restart the agent after an upgrade)"
    } else {
        ""
    };
    format!("the {what} runtime could not start: {stderr_line}{hint}")
}

/// Every message of arguments ([`RuntimeArgs`]) as the agent sends it: `{"build": BUILD,
/// "args": …}`.
#[derive(Serialize)]
struct ArgsOut<'a> {
    build: &'a str,
    args: &'a RuntimeArgs,
}

/// Encode `args` for the runtime, with this build's identity ([`BUILD`]).
pub fn encode_args(args: &RuntimeArgs) -> Vec<u8> {
    encode(&ArgsOut { build: BUILD, args })
}

/// A message of arguments as the runtime reads it: the sender's build first, the arguments
/// parsed only once that is this build's.
#[derive(Deserialize)]
pub struct ArgsIn<'a> {
    /// Absent from an agent older than the check (its arguments were the message itself).
    #[serde(default, borrow)]
    build: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    args: Option<&'a serde_json::value::RawValue>,
}

/// The runtime's side of [`encode_args`]: the arguments, or — from an agent of another build
/// — the reason, with the reply to send the agent before exiting ([`wrong_build`]).
pub fn decode_args(bytes: &[u8]) -> Result<RuntimeArgs, DecodeArgsError> {
    let envelope: ArgsIn = serde_json::from_slice(bytes).map_err(|e| DecodeArgsError::Malformed(e.to_string()))?;
    match envelope.build.as_deref() {
        Some(BUILD) => match envelope.args {
            Some(args) => serde_json::from_str(args.get()).map_err(|e| DecodeArgsError::Malformed(e.to_string())),
            None => Err(DecodeArgsError::Malformed("no `args`".into())),
        },
        other => Err(DecodeArgsError::WrongBuild(match other {
            Some(b) => format!(
                "opservant-runtime is build {BUILD}, started by an opservant of build {}: one of them was replaced (an upgrade?) while the other ran; restart the agent",
                shown_build(b)
            ),
            None => format!(
                "opservant-runtime is build {BUILD}, started by an older opservant (its arguments name no build): opservant-runtime was replaced (an upgrade?) while the agent ran; restart the agent"
            ),
        })),
    }
}

/// Why [`decode_args`] refused a message.
#[derive(Debug)]
pub enum DecodeArgsError {
    Malformed(String),
    /// From an agent of another build (the text names both).
    WrongBuild(String),
}

/// The runtime's answer to arguments from an agent of another build, naming its own
/// ([`FromPayload::WrongBuild`]): the run goes no further.
pub fn wrong_build() -> Vec<u8> {
    encode(&FromPayload::WrongBuild { build: BUILD.to_string() })
}

/// The error of a run whose runtime answered [`FromPayload::WrongBuild`] — as its first
/// message only: before `ready` no code of the run has had the channel, so the message is
/// the runtime's own (later it is executor code's, a protocol break like any other).
pub fn wrong_build_error(build: &str) -> String {
    format!(
        "{WRONG_BUILD}{}, not this opservant's build {BUILD}: one of them was replaced (an upgrade?) while the other ran; restart the agent",
        shown_build(build)
    )
}

/// Payload → agent.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum FromPayload {
    /// A structured log record from `context["logger"]`.
    Log {
        level: String,
        msg: String,
        #[serde(default)]
        fields: serde_json::Map<String, Value>,
    },
    /// `context["vault"].get_secret(name)`.
    SecretRequest { name: String },
    /// The executor's result, after the lifecycle. `logs_dropped`: log records the runtime
    /// did not send, past the caps the agent keeps (`MAX_LOGS`, `MAX_LOG_BYTES`); only when
    /// the agent asked for that (`log_caps`), and absent when none.
    Result {
        status: String,
        #[serde(default)]
        output: Option<Value>,
        #[serde(default)]
        error: Option<String>,
        #[serde(default)]
        artifacts: Vec<Value>,
        #[serde(default, skip_serializing_if = "is_zero")]
        logs_dropped: u64,
    },
    /// The runtime has begun keeping log records back (once, at the first; only when the
    /// agent asked, `log_caps`): a run that ends without its result still says that some
    /// were dropped.
    LogsHeld,
    /// A script did not pass validation (nothing was run).
    ValidationError { error: String },
    /// A session call finished: `call` is the number of the [`ToPayload::SessionExec`] it
    /// answers (0: the session's start). The agent takes a reply to any other call as a
    /// protocol break — session code that sent a reply of its own, whose real one then
    /// arrives during the next call, would otherwise shift every later reply by one.
    SessionReply {
        #[serde(default)]
        call: u64,
        success: bool,
        #[serde(default)]
        error: Option<String>,
        #[serde(default)]
        stdout: String,
        #[serde(default)]
        stderr: String,
        #[serde(default)]
        globals: serde_json::Map<String, Value>,
    },
    /// The runtime's trusted start-up is over; executor code comes next. The agent applies
    /// the CPU quota and answers [`ToPayload::Proceed`]; the runtime waits for that answer,
    /// so no code of the run starts before the quota is in force.
    Ready,
    /// Reply to [`RuntimeArgs::Warm`]: the warm-up is done and the runtime waits for the
    /// run's arguments. `prefaulted_kib`: memory it made its own (copy-on-write broken).
    Warmed { prefaulted_kib: u64 },
    /// One file of [`RuntimeArgs::Compile`], in order: its timestamp-checked `.pyc` (header
    /// and marshalled code), or why it does not compile.
    Compiled {
        path: String,
        #[serde(default)]
        pyc_base64: Option<String>,
        #[serde(default)]
        error: Option<String>,
    },
    /// The runtime's first and only answer to arguments from an agent of another build
    /// (see [`BUILD`]): its own build. Taken as that only before `ready`
    /// ([`wrong_build_error`]).
    WrongBuild { build: String },
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl FromPayload {
    /// The message's type, to name it: its content is the payload's (untrusted, up to
    /// [`MAX_MESSAGE`]) and is never logged or echoed.
    pub fn kind(&self) -> &'static str {
        match self {
            FromPayload::Log { .. } => "log",
            FromPayload::SecretRequest { .. } => "secret_request",
            FromPayload::Result { .. } => "result",
            FromPayload::LogsHeld => "logs_held",
            FromPayload::ValidationError { .. } => "validation_error",
            FromPayload::SessionReply { .. } => "session_reply",
            FromPayload::Ready => "ready",
            FromPayload::Warmed { .. } => "warmed",
            FromPayload::Compiled { .. } => "compiled",
            FromPayload::WrongBuild { .. } => "wrong_build",
        }
    }
}

/// Agent → payload.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToPayload {
    /// Reply to [`FromPayload::Ready`]: the CPU quota is in force, the runtime may go on.
    /// Never sent when the quota could not be written (the sandbox is stopped instead).
    Proceed,
    Secret {
        value: String,
    },
    SecretDenied {
        reason: String,
    },
    /// Run `code` in the session's persistent globals; `call` numbers the calls from 1, and
    /// the reply carries it back. `interrupts` counts the interrupts (SIGINT) sent to the
    /// session before this call: one of them that arrives late, during this call, is not
    /// this call's to raise.
    SessionExec {
        call: u64,
        #[serde(default)]
        interrupts: u64,
        code: String,
        #[serde(default)]
        globals: serde_json::Map<String, Value>,
        #[serde(default)]
        r#return: Vec<String>,
    },
}

/// What the agent hands the sandboxed runtime (the entry argument).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum RuntimeArgs {
    Executor {
        package_dir: String,
        entry_point: String,
        /// Extra `sys.path` entries (the executor's installed requirements).
        paths: Vec<String>,
        params: Value,
        agent_id: String,
        action: Option<String>,
        command_id: Option<String>,
        config: Value,
        /// See [`RuntimeArgs::waits_for_proceed`].
        #[serde(default)]
        proceed: bool,
        /// The agent takes the runtime's count of log records it kept back (past the
        /// agent's caps: [`FromPayload::LogsHeld`], `logs_dropped` in the result). Without it
        /// — an agent from before — the runtime sends every record, as it did then.
        #[serde(default)]
        log_caps: bool,
    },
    Script {
        language: String,
        path: String,
        /// See [`RuntimeArgs::waits_for_proceed`].
        #[serde(default)]
        proceed: bool,
    },
    Session {
        allow_imports: Vec<String>,
        default_imports: Vec<(String, String)>,
        /// Extra `sys.path` entries (directories of third-party packages).
        #[serde(default)]
        paths: Vec<String>,
        /// See [`RuntimeArgs::waits_for_proceed`].
        #[serde(default)]
        proceed: bool,
    },
    /// Not a run: a warm pool's sandbox is asked, while it waits for a run, to do now the
    /// runtime's own work that does not depend on the run — break copy-on-write sharing
    /// with the zygote (its first writes would otherwise fault page by page during the run)
    /// and read the network facts — then reply [`FromPayload::Warmed`] and wait for the
    /// run's arguments. Only the runtime's trusted code runs; allowed once, before the
    /// arguments.
    Warm,
    /// Not a run: compile each source file (absolute paths in the sandbox's view) to the
    /// bytecode its import would produce, without running any of it, and reply one
    /// [`FromPayload::Compiled`] per file, in order (executor installation, see
    /// `crate::bytecode`).
    Compile { files: Vec<String> },
}

impl RuntimeArgs {
    /// Whether the agent answers `ready` with [`ToPayload::Proceed`], which the runtime then
    /// waits for. Always set by this agent; absent (false) in the arguments of an agent from
    /// before the answer existed, whose runtime must not wait for it — and an older runtime
    /// refuses arguments that carry it (unknown field), instead of taking the answer for
    /// another message. Both ends of a version skew (an upgraded binary beside a running
    /// daemon) thus fail fast or keep the old behaviour, never hang.
    pub fn waits_for_proceed(&self) -> bool {
        match self {
            RuntimeArgs::Executor { proceed, .. }
            | RuntimeArgs::Script { proceed, .. }
            | RuntimeArgs::Session { proceed, .. } => *proceed,
            RuntimeArgs::Warm | RuntimeArgs::Compile { .. } => false,
        }
    }
}

/// The next message from the payload: `Ok(None)` at end of file (the payload is gone), `Err`
/// for a channel error or a message that is not valid protocol.
pub fn recv(chan: &sandbox::channel::Channel) -> Result<Option<FromPayload>, String> {
    recv_by(chan, None)
}

/// As [`recv`], the whole message by `deadline` (when given).
pub fn recv_by(
    chan: &sandbox::channel::Channel,
    deadline: Option<std::time::Instant>,
) -> Result<Option<FromPayload>, String> {
    recv_raw_by(chan, deadline)?.map(|bytes| parse(&bytes)).transpose()
}

/// As [`recv_by`], the message not parsed yet (its size and number of values checked).
pub fn recv_raw_by(
    chan: &sandbox::channel::Channel,
    deadline: Option<std::time::Instant>,
) -> Result<Option<Vec<u8>>, String> {
    match chan.recv_bytes_by(MAX_MESSAGE, deadline)? {
        Some(bytes) if parsed_cost_up_to(&bytes, MAX_MESSAGE_PARSED) > MAX_MESSAGE_PARSED => Err(format!(
            "message from the runtime refused: parsed, its {} bytes would take the agent more than {} MiB \
             (too many JSON values or objects; send fewer, larger values)",
            bytes.len(),
            MAX_MESSAGE_PARSED >> 20
        )),
        other => Ok(other),
    }
}

/// Parse a message [`recv_raw_by`] received: its `type` first (read through, nothing of the
/// rest built), then the variant's own fields straight into their types. Not through serde's
/// internally tagged enum, which buffers the whole message as generic content before it
/// looks at the tag — a second tree as large as the message's own, at the same time.
pub fn parse(bytes: &[u8]) -> Result<FromPayload, String> {
    let malformed = |e: serde_json::Error| format!("malformed message from the runtime: {e}");
    // An object only (serde would read a struct from an array too).
    if !bytes.trim_ascii_start().starts_with(b"{") {
        return Err("malformed message from the runtime: not a JSON object".into());
    }
    let kind = serde_json::from_slice::<wire::Kind>(bytes).map_err(malformed)?.kind;
    fn read<'de, T: Deserialize<'de>>(bytes: &'de [u8]) -> Result<T, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("malformed message from the runtime: {e}"))
    }
    Ok(match kind.as_ref() {
        "wrong_build" => {
            let wire::WrongBuild { build, .. } = read(bytes)?;
            FromPayload::WrongBuild { build }
        }
        "log" => {
            let wire::Log { level, msg, fields, .. } = read(bytes)?;
            FromPayload::Log { level, msg, fields }
        }
        "secret_request" => {
            let wire::SecretRequest { name, .. } = read(bytes)?;
            FromPayload::SecretRequest { name }
        }
        "result" => {
            let wire::Result { status, output, error, artifacts, logs_dropped, .. } = read(bytes)?;
            FromPayload::Result { status, output, error, artifacts, logs_dropped }
        }
        "logs_held" => {
            let wire::Ready { .. } = read(bytes)?;
            FromPayload::LogsHeld
        }
        "validation_error" => {
            let wire::ValidationError { error, .. } = read(bytes)?;
            FromPayload::ValidationError { error }
        }
        "session_reply" => {
            let wire::SessionReply { call, success, error, stdout, stderr, globals, .. } = read(bytes)?;
            FromPayload::SessionReply { call, success, error, stdout, stderr, globals }
        }
        "ready" => {
            let wire::Ready { .. } = read(bytes)?;
            FromPayload::Ready
        }
        "warmed" => {
            let wire::Warmed { prefaulted_kib, .. } = read(bytes)?;
            FromPayload::Warmed { prefaulted_kib }
        }
        "compiled" => {
            let wire::Compiled { path, pyc_base64, error, .. } = read(bytes)?;
            FromPayload::Compiled { path, pyc_base64, error }
        }
        other => {
            return Err(format!(
                "malformed message from the runtime: unknown type `{}`",
                other.chars().take(64).collect::<String>().escape_debug()
            ))
        }
    })
}

/// [`FromPayload`]'s variants as the agent reads them, one type each (see [`parse`]): the
/// same fields, and the `type` tag accepted and ignored.
mod wire {
    use serde::de::IgnoredAny;
    use serde::Deserialize;
    use serde_json::Value;

    #[derive(Deserialize)]
    pub struct Kind<'a> {
        #[serde(rename = "type", borrow)]
        pub kind: std::borrow::Cow<'a, str>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Log {
        #[serde(rename = "type")]
        _kind: IgnoredAny,
        pub level: String,
        pub msg: String,
        #[serde(default)]
        pub fields: serde_json::Map<String, Value>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct SecretRequest {
        #[serde(rename = "type")]
        _kind: IgnoredAny,
        pub name: String,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Result {
        #[serde(rename = "type")]
        _kind: IgnoredAny,
        pub status: String,
        #[serde(default)]
        pub output: Option<Value>,
        #[serde(default)]
        pub error: Option<String>,
        #[serde(default)]
        pub artifacts: Vec<Value>,
        #[serde(default)]
        pub logs_dropped: u64,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct ValidationError {
        #[serde(rename = "type")]
        _kind: IgnoredAny,
        pub error: String,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct SessionReply {
        #[serde(rename = "type")]
        _kind: IgnoredAny,
        #[serde(default)]
        pub call: u64,
        pub success: bool,
        #[serde(default)]
        pub error: Option<String>,
        #[serde(default)]
        pub stdout: String,
        #[serde(default)]
        pub stderr: String,
        #[serde(default)]
        pub globals: serde_json::Map<String, Value>,
    }

    /// A message of no fields but its `type` (`ready`, `logs_held`).
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Ready {
        #[serde(rename = "type")]
        _kind: IgnoredAny,
    }

    /// Lenient (unknown fields ignored): a runtime of any later build must be understood.
    #[derive(Deserialize)]
    pub struct WrongBuild {
        #[serde(rename = "type")]
        _kind: IgnoredAny,
        pub build: String,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Warmed {
        #[serde(rename = "type")]
        _kind: IgnoredAny,
        pub prefaulted_kib: u64,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Compiled {
        #[serde(rename = "type")]
        _kind: IgnoredAny,
        pub path: String,
        #[serde(default)]
        pub pyc_base64: Option<String>,
        #[serde(default)]
        pub error: Option<String>,
    }
}

/// Whether a received message is a log record, told from its `type` alone: the rest is read
/// through (valid JSON or not a log record) but nothing of it is built — for records past
/// the cap, which are only counted.
pub fn is_log(bytes: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Kind<'a> {
        #[serde(rename = "type", borrow)]
        kind: std::borrow::Cow<'a, str>,
    }
    // An object only (serde would read a struct from an array too).
    bytes.trim_ascii_start().starts_with(b"{") && serde_json::from_slice::<Kind>(bytes).is_ok_and(|k| k.kind == "log")
}

/// Answer a payload's [`FromPayload::Ready`]: apply the deferred CPU quota, then let the
/// runtime go on. When the quota cannot be written nothing is sent — the limiter has
/// already stopped the sandbox (fail closed) — and the error is returned.
pub fn proceed(chan: &sandbox::channel::Channel, cpu: &sandbox::CpuLimiter) -> Result<(), String> {
    cpu.apply()?;
    chan.send_bytes(&encode(&ToPayload::Proceed)).map_err(|e| format!("agent channel: {}", e.desc()))
}

/// Encode for the channel.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    // Serializing these plain data types cannot fail (no maps with non-string keys).
    serde_json::to_vec(msg).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_record_is_told_by_its_type_alone() {
        assert!(is_log(br#"{"type": "log", "level": "info", "msg": "m", "fields": {}}"#));
        assert!(is_log(br#"{"msg": [1, 2, {"a": "b"}], "type": "log"}"#));
        assert!(!is_log(br#"{"type": "result", "status": "completed"}"#));
        assert!(!is_log(br#"{"type": "log", "type": "result"}"#), "a duplicate key is no record");
        assert!(!is_log(br#"{"type": "log", "msg": "#), "not JSON");
        assert!(!is_log(br#"["log"]"#));
    }

    #[test]
    fn the_parsed_cost_counts_what_allocates_outside_strings_only() {
        let cost = |s: &str| parsed_cost_up_to(s.as_bytes(), usize::MAX) - s.len();
        assert_eq!(cost("0"), COST_ELEMENT);
        assert_eq!(cost("[0,0,0]"), COST_ELEMENT + COST_FIRST_ELEMENT + 2 * COST_ELEMENT);
        assert_eq!(cost("[ ]"), COST_ELEMENT, "an empty array allocates nothing");
        assert_eq!(cost("{}"), COST_ELEMENT, "nor an empty object");
        assert_eq!(cost(r#"{"a":0}"#), COST_ELEMENT + COST_OBJECT + COST_ENTRY + COST_STRING);
        assert_eq!(
            cost(r#"{"a":[1,{"b":2}],"c":"x"}"#),
            COST_ELEMENT + COST_OBJECT + 2 * COST_ENTRY + 3 * COST_STRING // the object, a, c, "x"
                + COST_FIRST_ELEMENT + COST_ELEMENT // [1, {…}]
                + COST_OBJECT + COST_ENTRY + COST_STRING // {"b":2}
        );
        // Brackets, commas and escaped quotes inside strings are text.
        assert_eq!(cost(r#"["[,{\",]", "a\\"]"#), COST_ELEMENT + COST_FIRST_ELEMENT + COST_ELEMENT + 2 * COST_STRING);
        assert_eq!(cost(r#"{"{":"}","[":"]"}"#), cost(r#"{"a":"b","c":"d"}"#));
        // Past the limit it stops.
        assert!(parsed_cost_up_to(b"[0,0,0,0,0]", 100) < parsed_cost_up_to(b"[0,0,0,0,0]", usize::MAX));
        // Deeper than serde_json parses: counted, never a panic.
        let deep = format!("{}{}", "{\"a\":[".repeat(300), "]}".repeat(300));
        assert!(parsed_cost_up_to(deep.as_bytes(), usize::MAX) > MAX_TRACKED_DEPTH as usize * COST_OBJECT);
    }

    /// The case found in review: 10 MB of nested one-key objects took the agent 1.3 GB parsed
    /// (2 Mi values, within the old count of values). Refused unparsed now; the largest output
    /// of small integers still fits.
    #[test]
    fn a_message_that_would_take_too_much_memory_parsed_is_refused_unparsed() {
        let (agent, payload) = sandbox::channel::Channel::pair().unwrap();
        let nested = format!("{}0{}", r#"{"":"#.repeat(120), "}".repeat(120));
        let bomb = format!(
            r#"{{"type":"result","status":"completed","output":[{}]}}"#,
            vec![nested.as_str(); 17_000].join(",")
        );
        assert!(bomb.len() < MAX_MESSAGE);
        let ints = vec!["0"; MAX_OUTPUT / 2].join(",");
        let fits = format!(r#"{{"type":"log","level":"info","msg":"x","fields":{{"a":[{ints}]}}}}"#);
        assert!(fits.len() < MAX_MESSAGE);
        // Sent from another thread: a message larger than the socket's buffer waits for the
        // reader.
        let sender = std::thread::spawn(move || {
            payload.send_bytes(bomb.as_bytes()).unwrap();
            payload.send_bytes(fits.as_bytes()).unwrap();
        });
        let e = recv(&agent).unwrap_err();
        assert!(e.contains("would take the agent more than 160 MiB"), "{e}");
        assert!(matches!(recv(&agent), Ok(Some(FromPayload::Log { .. }))));
        sender.join().unwrap();
    }
}
