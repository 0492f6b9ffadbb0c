//! `_opservant`: the native module of the embedded runtime. It owns the application channel;
//! Python code in the sandbox reaches the agent only through these functions.

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::exceptions::{PyOSError, PyPermissionError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use serde_json::Value;

use super::{APP, ARGS};
use agent::app::{self, FromPayload, RuntimeArgs, ToPayload};
use sandbox::channel::Channel;

// The package embedded in the binary, precompiled by build.rs.
include!(concat!(env!("OUT_DIR"), "/embedded_python.rs"));

/// Where executors put artifacts (the sandbox's scratch directory).
const SCRATCH: &str = sandbox::spec::SCRATCH_DIR;

static ARTIFACT_BYTES: AtomicU64 = AtomicU64::new(0);

/// Whether `ready` was sent (it is sent once).
static READY_SENT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" {
    /// glibc's `srandom(3)` (not bound by the libc crate).
    fn srandom(seed: libc::c_uint);
}

/// Reseed the C library's `random()`/`rand()` state (a zygote's children would otherwise
/// share it). Fails rather than seed from anything but the kernel's generator.
fn reseed_libc_random() -> Result<(), String> {
    let mut seed = [0u8; 4];
    // SAFETY: getrandom writes at most `seed.len()` bytes into the buffer we own.
    let got = unsafe { libc::getrandom(seed.as_mut_ptr().cast(), seed.len(), 0) };
    if got != seed.len() as isize {
        return Err(format!("reseed the C library's generator: getrandom: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: srandom/srand only set the generators' state; glibc exports both.
    unsafe {
        srandom(u32::from_ne_bytes(seed));
        libc::srand(u32::from_ne_bytes(seed).rotate_left(16));
    }
    Ok(())
}

fn runtime_args() -> PyResult<&'static RuntimeArgs> {
    ARGS.get().ok_or_else(|| PyRuntimeError::new_err("runtime arguments missing"))
}

/// The tag a log record's message carries besides the record (`app::encode` writes it first).
const LOG_TAG: &str = r#""type":"log","#;
/// Log records sent to the agent, their bytes as it measures them, and those not sent.
static LOGS_KEPT: AtomicU64 = AtomicU64::new(0);
static LOG_BYTES_KEPT: AtomicU64 = AtomicU64::new(0);
static LOGS_DROPPED: AtomicU64 = AtomicU64::new(0);

fn send(msg: &FromPayload) -> PyResult<()> {
    send_bytes(&app::encode(msg))
}

fn send_bytes(bytes: &[u8]) -> PyResult<()> {
    with_channel(|chan| chan.send_bytes(bytes).map_err(|e| format!("agent channel: {}", e.desc())))
        .map_err(PyOSError::new_err)
}

/// Run `f` with the application channel; an error when there is none, or it was closed.
fn with_channel<T>(f: impl FnOnce(&Channel) -> Result<T, String>) -> Result<T, String> {
    let chan = APP.get().ok_or("no application channel")?;
    let chan = chan.lock().map_err(|_| "application channel poisoned")?;
    f(chan.as_ref().ok_or("the application channel is closed")?)
}

#[pymodule]
pub mod _opservant {
    use super::*;

    /// The runtime mode: "executor", "script" or "session".
    #[pyfunction]
    fn mode() -> PyResult<&'static str> {
        Ok(match runtime_args()? {
            RuntimeArgs::Executor { .. } => "executor",
            RuntimeArgs::Script { .. } => "script",
            RuntimeArgs::Session { .. } => "session",
            RuntimeArgs::Warm => "warm",
            RuntimeArgs::Compile { .. } => "compile",
        })
    }

    /// The arguments of this run, as Python objects.
    #[pyfunction]
    fn args<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let value = serde_json::to_value(super::runtime_args()?).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(pythonize::pythonize(py, &value)?)
    }

    /// `{module name: (marshalled code, is_package)}` of the embedded package.
    #[pyfunction]
    fn sources<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, code, pkg) in EMBEDDED {
            let code = pyo3::types::PyBytes::new(py, code).into_any();
            d.set_item(name, PyTuple::new(py, [code, pkg.into_pyobject(py)?.to_owned().into_any()])?)?;
        }
        Ok(d)
    }

    /// Whether this process was started as a zygote.
    #[pyfunction]
    fn zygote() -> bool {
        super::super::ZYGOTE.load(Ordering::Relaxed)
    }

    /// Zygote mode: serve sandbox requests (`sandbox::zygote::serve`). Returns None in the
    /// zygote when the agent closes its control socket; in each sandbox's payload process it
    /// returns the run's environment (already the process environment) once every
    /// restriction is in place, the interpreter's fork bookkeeping is done (which reseeds
    /// `random` if imported), the C library's generator is reseeded and the run's arguments
    /// are read from the application channel.
    #[pyfunction]
    fn zygote_serve<'py>(py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        use sandbox::zygote::Served;
        let handoff = match sandbox::zygote::serve(agent::app::BUILD.as_bytes()) {
            Err(e) => return Err(PyRuntimeError::new_err(e.to_string())),
            Ok(Served::Shutdown) => return Ok(None),
            Ok(Served::Payload(h)) => h,
        };
        // SAFETY: called with the GIL held, in the single-threaded child of a fork, as the
        // C API requires.
        unsafe { pyo3::ffi::PyOS_AfterFork_Child() };
        super::reseed_libc_random().map_err(PyRuntimeError::new_err)?;
        let chan = handoff.app.ok_or_else(|| PyRuntimeError::new_err("no application channel"))?;
        let args = super::super::warm::read_args(&chan).map_err(PyRuntimeError::new_err)?;
        if let RuntimeArgs::Script { language, path, proceed } = &args {
            if language == "bash" {
                let code = match super::super::run_bash(chan, &path.clone(), *proceed) {
                    Ok(code) => code as i32,
                    Err(e) => {
                        agent::stdout::eprint(&format!("opservant-runtime: {e}\n"));
                        70
                    }
                };
                std::process::exit(code)
            }
        }
        let _ = APP.set(std::sync::Mutex::new(Some(chan)));
        let _ = ARGS.set(args);
        let env = PyDict::new(py);
        for (k, v) in &handoff.env {
            env.set_item(k, v)?;
        }
        Ok(Some(env))
    }

    /// The interpreter is up and the runtime imported; executor code comes next. Tells the
    /// agent and waits for its answer, which comes once the CPU quota is in force (an
    /// error if the agent closes the channel instead: the run must not go on). Once per
    /// process; later calls return at once.
    #[pyfunction]
    fn ready(py: Python<'_>) -> PyResult<()> {
        let proceed = runtime_args()?.waits_for_proceed();
        if READY_SENT.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        py.detach(|| with_channel(|chan| super::super::ready_and_wait(chan, proceed))).map_err(PyOSError::new_err)
    }

    /// Wait for the next session call: `{"code", "globals", "return"}`, or None when the
    /// agent closed the channel (the session is over).
    #[pyfunction]
    fn session_next<'py>(py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let msg = py.detach(|| {
            with_channel(|chan| -> Result<Option<ToPayload>, String> {
                match chan.recv_bytes(app::MAX_MESSAGE)? {
                    None => Ok(None),
                    Some(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| e.to_string()),
                }
            })
        });
        match msg {
            Ok(None) => Ok(None),
            Ok(Some(ToPayload::SessionExec { call, interrupts, code, globals, r#return })) => {
                let value = serde_json::json!({"call": call, "interrupts": interrupts, "code": code,
                                               "globals": globals, "return": r#return});
                Ok(Some(pythonize::pythonize(py, &value)?))
            }
            Ok(Some(other)) => Err(PyRuntimeError::new_err(format!("unexpected message {other:?}"))),
            Err(e) => Err(PyRuntimeError::new_err(format!("agent channel: {e}"))),
        }
    }

    /// Send a session reply (a dict: success, error, stdout, stderr, globals). Globals over
    /// the output cap are replaced by an error reply.
    #[pyfunction]
    fn session_reply(reply: &Bound<'_, PyAny>) -> PyResult<()> {
        let FromPayload::SessionReply { call, success, error, stdout, stderr, globals } =
            super::message("session_reply", reply)?
        else {
            return Err(PyRuntimeError::new_err("session_reply: not a session reply"));
        };
        let globals_size = json_size(&Value::Object(globals.clone()));
        let msg = if globals_size > app::MAX_OUTPUT {
            let error =
                format!("the returned globals are {globals_size} bytes of JSON, over the {} byte cap", app::MAX_OUTPUT);
            FromPayload::SessionReply {
                call,
                success: false,
                error: Some(error),
                stdout,
                stderr,
                globals: Default::default(),
            }
        } else {
            FromPayload::SessionReply { call, success, error, stdout, stderr, globals }
        };
        // The runtime caps each part; a reply over the channel's cap all the same (session
        // code calling this itself) would end the session: an error reply instead.
        let bytes = app::encode(&msg);
        if bytes.len() > app::MAX_MESSAGE {
            let error = format!("the reply is {} bytes of JSON, over the {} byte cap", bytes.len(), app::MAX_MESSAGE);
            return send(&FromPayload::SessionReply {
                call,
                success: false,
                error: Some(error),
                stdout: String::new(),
                stderr: String::new(),
                globals: Default::default(),
            });
        }
        send_bytes(&bytes)
    }

    /// A script did not pass validation; nothing of it ran.
    #[pyfunction]
    fn validation_error(error: String) -> PyResult<()> {
        send(&FromPayload::ValidationError { error })
    }

    /// Close the application channel: nothing that runs after this (a script's own code)
    /// can speak for the runtime — claim a validation error, say. Functions that need the
    /// channel raise `OSError` from then on.
    #[pyfunction]
    fn close_channel() -> PyResult<()> {
        if let Some(chan) = APP.get() {
            let mut chan = chan.lock().map_err(|_| PyRuntimeError::new_err("application channel poisoned"))?;
            drop(chan.take());
        }
        Ok(())
    }

    /// End the process with `status` at once (streams are flushed by the caller; the
    /// interpreter is not finalised — nothing of it outlives the sandbox). `exit`, not
    /// `_exit`: C stdio buffers are flushed and the `atexit` handlers of C libraries an
    /// executor loaded run, as in any process that ends this way.
    #[pyfunction]
    fn exit(status: i32) -> PyResult<()> {
        std::process::exit(status)
    }

    /// Entries to put in front of `sys.path`.
    #[pyfunction]
    fn paths() -> PyResult<Vec<String>> {
        Ok(match super::runtime_args()? {
            RuntimeArgs::Executor { package_dir, paths, .. } => {
                let mut v = vec![package_dir.clone()];
                v.extend(paths.iter().cloned());
                v
            }
            RuntimeArgs::Session { paths, .. } => paths.clone(),
            RuntimeArgs::Script { .. } | RuntimeArgs::Warm | RuntimeArgs::Compile { .. } => Vec::new(),
        })
    }

    /// Forward a log record to the agent — as long as the agent keeps records: past its
    /// caps a record is only counted here, and the count goes with the result. (The agent
    /// stops a run that sends it records past the caps without end: each costs it CPU.)
    #[pyfunction]
    fn log(level: String, msg: String, fields: &Bound<'_, PyDict>) -> PyResult<()> {
        let fields: serde_json::Map<String, Value> = pythonize::depythonize(fields.as_any())?;
        let bytes = app::encode(&FromPayload::Log { level, msg, fields });
        // Only an agent that takes the count (an older one gets every record, as before).
        if !matches!(super::runtime_args()?, RuntimeArgs::Executor { log_caps: true, .. }) {
            return send_bytes(&bytes);
        }
        // The agent's measure of a record: its JSON without the message's tag (to within
        // how a float reads back; the agent counts what it drops itself besides).
        let size = bytes.len().saturating_sub(LOG_TAG.len()) as u64;
        // (Called with the interpreter's lock held: one record at a time.)
        let (kept, kept_bytes) = (LOGS_KEPT.load(Ordering::Relaxed), LOG_BYTES_KEPT.load(Ordering::Relaxed));
        if kept >= app::MAX_LOGS as u64 || kept_bytes + size > agent::executor_run::MAX_LOG_BYTES as u64 {
            if LOGS_DROPPED.fetch_add(1, Ordering::Relaxed) == 0 {
                send(&FromPayload::LogsHeld)?;
            }
            return Ok(());
        }
        LOGS_KEPT.fetch_add(1, Ordering::Relaxed);
        LOG_BYTES_KEPT.fetch_add(size, Ordering::Relaxed);
        send_bytes(&bytes)
    }

    /// Ask the agent for a secret; `PermissionError` when it is not granted.
    #[pyfunction]
    fn secret(py: Python<'_>, name: String) -> PyResult<String> {
        let reply = py.detach(|| {
            with_channel(|chan| -> Result<ToPayload, String> {
                chan.send_bytes(&app::encode(&FromPayload::SecretRequest { name: name.clone() }))
                    .map_err(|e| e.desc().to_string())?;
                let bytes = chan.recv_bytes(1 << 20)?.ok_or("the agent closed the channel")?;
                serde_json::from_slice(&bytes).map_err(|e| e.to_string())
            })
        });
        match reply {
            Ok(ToPayload::Secret { value }) => Ok(value),
            Ok(ToPayload::SecretDenied { reason }) => Err(PyPermissionError::new_err(reason)),
            Ok(other) => Err(PyRuntimeError::new_err(format!("unexpected reply {other:?}"))),
            Err(e) => Err(PyRuntimeError::new_err(format!("secret '{name}': {e}"))),
        }
    }

    /// The network as seen inside the sandbox: interfaces, their IPv4/IPv6 addresses, and
    /// the first non-loopback IPv4 address (or 127.0.0.1) with its subnet.
    #[pyfunction]
    fn network<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, network_facts())?)
    }

    /// `os.path.realpath` of a `str` (or path-like) path that exists, in one call: the
    /// runtime places the executor's package and module with it (Python's own resolves
    /// each component in Python: ~75 µs each in a sandbox, benches/README item 24).
    /// `OSError` when the path cannot be resolved (missing, a loop, not allowed): the
    /// caller falls back to `os.path.realpath`. (Out of memory is `MemoryError`: the run
    /// fails.)
    #[pyfunction]
    fn realpath(path: std::path::PathBuf) -> PyResult<std::ffi::OsString> {
        // A `str` back, as `os.path.realpath` gives for one (non-UTF-8 bytes as surrogate
        // escapes).
        Ok(std::fs::canonicalize(path)?.into_os_string())
    }

    /// Read an artifact from the scratch directory without following any symlink, with the
    /// per-file and per-run size caps; returns `{path, size, sha256, content_base64}`.
    #[pyfunction]
    fn artifact<'py>(py: Python<'py>, path: String) -> PyResult<Bound<'py, PyAny>> {
        let value = super::read_artifact(&path).map_err(PyOSError::new_err)?;
        Ok(pythonize::pythonize(py, &value)?)
    }

    /// An artifact the executor gave as binary data (seed 000: "file paths or binary data"),
    /// named `name` (a relative path), within the same caps as a file's; returns `{path,
    /// size, sha256, content_base64}`.
    /// The most bytes one artifact may hold.
    #[pyfunction]
    fn artifact_cap() -> u64 {
        app::MAX_ARTIFACT
    }

    #[pyfunction]
    fn data_artifact<'py>(
        py: Python<'py>,
        name: String,
        data: &Bound<'py, pyo3::types::PyBytes>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let value = super::data_artifact(&name, data.as_bytes()).map_err(PyOSError::new_err)?;
        Ok(pythonize::pythonize(py, &value)?)
    }

    /// The files to compile (`compile` mode).
    #[pyfunction]
    fn compile_files() -> PyResult<Vec<String>> {
        match super::runtime_args()? {
            RuntimeArgs::Compile { files } => Ok(files.clone()),
            _ => Err(PyRuntimeError::new_err("not in compile mode")),
        }
    }

    /// Report one compiled file: its `.pyc` bytes, or the error.
    #[pyfunction]
    #[pyo3(signature = (path, pyc=None, error=None))]
    fn compiled(path: String, pyc: Option<Vec<u8>>, error: Option<String>) -> PyResult<()> {
        use base64::Engine;
        let pyc_base64 = pyc.map(|b| base64::engine::general_purpose::STANDARD.encode(b));
        send(&FromPayload::Compiled { path, pyc_base64, error })
    }

    /// Send the lifecycle result (a dict: status, output, error, artifacts). An output over
    /// the cap is replaced by a failure saying so.
    #[pyfunction]
    fn send_result(result: &Bound<'_, PyAny>) -> PyResult<()> {
        let FromPayload::Result { status, output, error, artifacts, .. } = super::message("result", result)? else {
            return Err(PyRuntimeError::new_err("send_result: not a result"));
        };
        let logs_dropped = LOGS_DROPPED.load(Ordering::Relaxed);
        let output_size = output.as_ref().map_or(0, json_size);
        let msg = if output_size > app::MAX_OUTPUT {
            let error = format!("output is {output_size} bytes of JSON, over the {} byte cap", app::MAX_OUTPUT);
            FromPayload::Result { status: "failed".into(), output: None, error: Some(error), artifacts, logs_dropped }
        } else {
            FromPayload::Result { status, output, error, artifacts, logs_dropped }
        };
        send(&msg)
    }
}

/// A protocol message from a Python dict holding the fields of variant `kind` (the
/// variant's `type` tag is added here).
fn message(kind: &str, obj: &Bound<'_, PyAny>) -> PyResult<FromPayload> {
    let mut value: Value = pythonize::depythonize(obj).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let fields = value.as_object_mut().ok_or_else(|| PyValueError::new_err(format!("{kind}: expected a dict")))?;
    fields.insert("type".into(), Value::String(kind.into()));
    serde_json::from_value(value).map_err(|e| PyValueError::new_err(format!("{kind}: {e}")))
}

/// Bytes of `v`'s JSON encoding.
fn json_size(v: &Value) -> usize {
    serde_json::to_vec(v).map_or(0, |b| b.len())
}

/// Network information for `context["network"]`, read once: the sandbox's network is
/// complete before the payload starts (egress wires it from the namespace hook) and nothing
/// of the runtime changes it.
pub(crate) fn network_facts() -> &'static Value {
    static FACTS: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    FACTS.get_or_init(network_info)
}

fn network_info() -> Value {
    use std::collections::BTreeMap;
    let mut ifaces: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut local: Option<(std::net::Ipv4Addr, u32)> = None;
    let mut v4 = |ifaces: &mut BTreeMap<String, Vec<String>>, name: &str, ip: std::net::Ipv4Addr, prefix: u32| {
        ifaces.entry(name.to_string()).or_default().push(format!("{ip}/{prefix}"));
        if !ip.is_loopback() && local.is_none() {
            local = Some((ip, prefix));
        }
    };
    match nix::ifaddrs::getifaddrs() {
        Ok(addrs) => {
            for a in addrs {
                let entry = ifaces.entry(a.interface_name.clone()).or_default();
                let Some(addr) = a.address else { continue };
                if let Some(sin) = addr.as_sockaddr_in() {
                    let prefix = a
                        .netmask
                        .and_then(|m| m.as_sockaddr_in().map(|m| u32::from(m.ip()).count_ones()))
                        .unwrap_or(32);
                    v4(&mut ifaces, &a.interface_name, sin.ip(), prefix);
                } else if let Some(v6) = addr.as_sockaddr_in6() {
                    entry.push(v6.ip().to_string());
                }
            }
        }
        // No netlink (refused in a sandbox without network egress): the same facts from
        // /proc and the IPv4 ioctls.
        Err(_) => {
            for name in proc_interface_names() {
                ifaces.entry(name).or_default();
            }
            for (name, ip, prefix) in ipv4_addresses_by_ioctl() {
                v4(&mut ifaces, &name, ip, prefix);
            }
            for (name, ip) in proc_ipv6_addresses() {
                ifaces.entry(name).or_default().push(ip.to_string());
            }
        }
    }
    let (ip, prefix) = local.unwrap_or((std::net::Ipv4Addr::LOCALHOST, 8));
    let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
    let subnet = std::net::Ipv4Addr::from(u32::from(ip) & mask);
    serde_json::json!({
        "local_ip": ip.to_string(),
        "subnet": format!("{subnet}/{prefix}"),
        "interfaces": ifaces.iter().map(|(name, addrs)| serde_json::json!({"name": name, "addresses": addrs})).collect::<Vec<_>>(),
    })
}

/// The interface names `/proc/net/dev` lists (the namespace's).
fn proc_interface_names() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/net/dev").unwrap_or_default();
    text.lines().skip(2).filter_map(|l| l.split_once(':')).map(|(name, _)| name.trim().to_string()).collect()
}

/// The IPv6 addresses of `/proc/net/if_inet6` (address in hex, index, prefix, scope, flags,
/// name), by interface.
fn proc_ipv6_addresses() -> Vec<(String, std::net::Ipv6Addr)> {
    let text = std::fs::read_to_string("/proc/net/if_inet6").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (hex, name) = (f.first()?, f.get(5)?);
            Some((name.to_string(), std::net::Ipv6Addr::from(u128::from_str_radix(hex, 16).ok()?)))
        })
        .collect()
}

/// Each interface's IPv4 address and prefix length, as `SIOCGIFCONF` and `SIOCGIFNETMASK`
/// give them on a UDP socket (what `ifconfig` reads; no netlink).
fn ipv4_addresses_by_ioctl() -> Vec<(String, std::net::Ipv4Addr, u32)> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: socket(2) takes integers; a non-negative result is a descriptor we own.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Vec::new();
    }
    // SAFETY: `fd` is a fresh descriptor owned by nothing else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `ifreq` is plain data (names, a union of addresses and integers): all zeroes
    // is a valid value.
    let mut reqs: Vec<libc::ifreq> = vec![unsafe { std::mem::zeroed() }; 64];
    let mut conf = libc::ifconf {
        ifc_len: (reqs.len() * std::mem::size_of::<libc::ifreq>()) as libc::c_int,
        ifc_ifcu: libc::__c_anonymous_ifc_ifcu { ifcu_req: reqs.as_mut_ptr() },
    };
    // SAFETY: `conf` describes `reqs`, a writable buffer of `ifc_len` bytes that outlives the
    // call; the kernel writes at most that many and sets `ifc_len` to what it wrote.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFCONF, &mut conf) } < 0 {
        return Vec::new();
    }
    let n = (conf.ifc_len.max(0) as usize / std::mem::size_of::<libc::ifreq>()).min(reqs.len());
    let mut out = Vec::new();
    for req in &mut reqs[..n] {
        let name: String = req.ifr_name.iter().take_while(|c| **c != 0).map(|c| *c as u8 as char).collect();
        // SAFETY: for SIOCGIFCONF the kernel filled the union's address member with an
        // AF_INET `sockaddr_in` (only IPv4 addresses are listed), which fits in a `sockaddr`.
        let sin: libc::sockaddr_in =
            unsafe { std::ptr::read_unaligned(std::ptr::addr_of!(req.ifr_ifru.ifru_addr).cast()) };
        let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
        // SAFETY: `req` holds the interface's name; SIOCGIFNETMASK writes its netmask into
        // the same `ifreq`, which is ours and writable.
        let prefix = if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFNETMASK, req as *mut libc::ifreq) } == 0 {
            // SAFETY: as above: an AF_INET `sockaddr_in` in the union's netmask member.
            let mask: libc::sockaddr_in =
                unsafe { std::ptr::read_unaligned(std::ptr::addr_of!(req.ifr_ifru.ifru_netmask).cast()) };
            u32::from_be(mask.sin_addr.s_addr).count_ones()
        } else {
            32
        };
        out.push((name, ip, prefix));
    }
    out
}

/// Open `rel` beneath `dir` one component at a time, refusing symlinks anywhere.
fn open_beneath(dir: &OwnedFd, rel: &str) -> Result<OwnedFd, String> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::Mode;
    let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty() && *p != ".").collect();
    if parts.is_empty() || parts.contains(&"..") {
        return Err(format!("{rel}: not a path beneath the scratch directory"));
    }
    let mut current: Option<OwnedFd> = None;
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let flags = OFlag::O_NOFOLLOW
            | OFlag::O_CLOEXEC
            | if last { OFlag::O_RDONLY } else { OFlag::O_PATH | OFlag::O_DIRECTORY };
        let base = current.as_ref().unwrap_or(dir);
        let fd = openat(base.as_fd(), *part, flags, Mode::empty()).map_err(|e| match e {
            nix::errno::Errno::ELOOP | nix::errno::Errno::ENOTDIR => format!("{rel}: symbolic links are not followed"),
            e => format!("{rel}: {}", e.desc()),
        })?;
        current = Some(fd);
    }
    current.ok_or_else(|| format!("{rel}: empty path"))
}

fn read_artifact(path: &str) -> Result<Value, String> {
    use std::io::Read;
    let rel = match path.strip_prefix(SCRATCH) {
        Some(r) if r.is_empty() || r.starts_with('/') => r.trim_start_matches('/').to_string(),
        _ if path.starts_with('/') => return Err(format!("{path}: artifacts must be in {SCRATCH}")),
        _ => path.to_string(),
    };
    let dir = nix::fcntl::open(
        SCRATCH,
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_DIRECTORY,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| format!("{SCRATCH}: {}", e.desc()))?;
    let fd = open_beneath(&dir, &rel)?;
    let st = nix::sys::stat::fstat(&fd).map_err(|e| e.desc().to_string())?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(format!("{rel}: not a regular file"));
    }
    let size = st.st_size.max(0) as u64;
    charge_artifact(&rel, size)?;
    // SAFETY: `fd` is an open descriptor we own; File takes it over.
    let mut file = unsafe { std::fs::File::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
    let mut content = Vec::with_capacity(size as usize);
    (&mut file).take(app::MAX_ARTIFACT + 1).read_to_end(&mut content).map_err(|e| e.to_string())?;
    if content.len() as u64 > app::MAX_ARTIFACT {
        return Err(format!("{rel}: grew over the per-artifact cap while being read"));
    }
    Ok(artifact_entry(&rel, &content))
}

/// An artifact given as data: `name` must read as a path beneath the scratch directory
/// would (relative, no `..`), and the content is held to a file's caps.
fn data_artifact(name: &str, content: &[u8]) -> Result<Value, String> {
    if name.is_empty() || name.starts_with('/') || name.split('/').any(|c| c == "..") || name.contains('\0') {
        return Err(format!("{name:?}: an artifact's name must be a relative path without '..'"));
    }
    if name.len() > MAX_ARTIFACT_NAME {
        return Err(format!("an artifact's name of {} bytes, over {MAX_ARTIFACT_NAME}", name.len()));
    }
    charge_artifact(name, content.len() as u64)?;
    Ok(artifact_entry(name, content))
}

/// Hold an artifact of `size` bytes to the per-artifact cap and charge it to the run's total
/// (a file's or a piece of data's alike).
fn charge_artifact(name: &str, size: u64) -> Result<(), String> {
    if size > app::MAX_ARTIFACT {
        return Err(format!("{name}: {size} bytes, over the {} byte cap per artifact", app::MAX_ARTIFACT));
    }
    let total = ARTIFACT_BYTES.fetch_add(size, Ordering::Relaxed) + size;
    if total > app::MAX_ARTIFACTS_TOTAL {
        return Err(format!("{name}: the run's artifacts exceed {} bytes", app::MAX_ARTIFACTS_TOTAL));
    }
    Ok(())
}

/// The longest name of an artifact given as data (a path's length on Linux).
const MAX_ARTIFACT_NAME: usize = 4096;

/// `{path, size, sha256, content_base64}`.
fn artifact_entry(path: &str, content: &[u8]) -> Value {
    use base64::Engine;
    use sha2::Digest;
    let sha256: String = sha2::Sha256::digest(content).iter().map(|b| format!("{b:02x}")).collect();
    serde_json::json!({
        "path": path,
        "size": content.len(),
        "sha256": sha256,
        "content_base64": base64::engine::general_purpose::STANDARD.encode(content),
    })
}
