//! `opservant-runtime`: the executor runtime, `execve`d as the payload of an executor sandbox.
//!
//! It runs with every restriction of the sandbox already in place. It starts CPython (linked
//! statically into this binary only) from an *isolated* configuration — no `PYTHON*`
//! environment, no user site, no current directory on `sys.path`, no `site` import, no
//! bytecode writes — so the interpreter sees its standard library, the opservant package
//! embedded here, the executor's package and its installed requirements, and nothing else.
//! It talks to the agent only over the application channel (fd 4): the first message is its
//! arguments (a warm pool's sandbox may be asked to warm up first, see `warm`); it reports
//! "ready" once the interpreter is up and before any executor code is importable, and waits
//! for the agent's "proceed", sent once the CPU quota is in force.

mod native;
mod warm;

use std::ffi::CString;
use std::process::ExitCode;
use std::sync::{Mutex, OnceLock};

use agent::app::{self, FromPayload, RuntimeArgs, ToPayload};
use pyo3::prelude::*;
use sandbox::channel::{Channel, APP_FD};

/// The application channel; `None` once closed (`_opservant.close_channel`).
static APP: OnceLock<Mutex<Option<Channel>>> = OnceLock::new();
static ARGS: OnceLock<RuntimeArgs> = OnceLock::new();

/// `bootstrap.py`, compiled and marshalled by build.rs with the embedded interpreter: a cold
/// start never compiles source (the parser's first use alone costs ~0.8 ms).
const BOOTSTRAP: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/bootstrap.marshal"));

/// The interpreter the binary embeds; its standard library is found from this path.
const PYTHON_PROGRAM: &str = match option_env!("PYO3_PYTHON") {
    Some(p) => p,
    None => "/usr/bin/python3",
};

/// Exit status when the runtime itself cannot start (an executor failure is reported
/// through the result instead).
const RUNTIME_FAILED: u8 = 70;

fn main() -> ExitCode {
    match run() {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            agent::stdout::eprint(&format!("opservant-runtime: {e}\n"));
            ExitCode::from(RUNTIME_FAILED)
        }
    }
}

/// Set in zygote mode (`opservant-runtime --zygote`, started by the agent with its control
/// socket on fd 3): the interpreter and the runtime are initialised once, and every sandbox
/// is a fork of this process (see `sandbox::zygote`).
static ZYGOTE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn run() -> Result<u8, String> {
    if std::env::args_os().nth(1).is_some_and(|a| a == "--version") {
        // The build an agent must be to use this runtime (`agent::app::BUILD`).
        return match agent::stdout::print(&format!("opservant-runtime {}\n", app::BUILD)) {
            Ok(()) => Ok(0),
            Err(e) => Err(format!("stdout: {e}")),
        };
    }
    if std::env::args_os().nth(1).is_some_and(|a| a == "--zygote") {
        ZYGOTE.store(true, std::sync::atomic::Ordering::Relaxed);
        start_interpreter()?;
        return run_bootstrap();
    }
    // SAFETY: the sandbox passes the application channel as fd 4 and nothing else in this
    // fresh process owns it.
    let chan =
        unsafe { Channel::from_raw(APP_FD) }.map_err(|e| format!("no application channel on fd 4: {}", e.desc()))?;
    let args = warm::read_args(&chan)?;
    if let RuntimeArgs::Script { language, path, proceed } = &args {
        if language == "bash" {
            // Bash needs no interpreter of ours: check, report, then become bash.
            return run_bash(chan, path, *proceed);
        }
    }
    let _ = APP.set(Mutex::new(Some(chan)));
    let _ = ARGS.set(args);
    start_interpreter()?;
    run_bootstrap()
}

fn run_bootstrap() -> Result<u8, String> {
    Python::attach(|py| {
        // As `py.run` of the source would: in `__main__`'s namespace.
        let run = || -> PyResult<()> {
            let code = py.import("marshal")?.call_method1("loads", (pyo3::types::PyBytes::new(py, BOOTSTRAP),))?;
            let globals = py.import("__main__")?.dict();
            py.import("builtins")?.getattr("exec")?.call1((code, globals))?;
            Ok(())
        };
        match run() {
            Ok(()) => Ok(0),
            Err(e) => {
                e.print(py);
                Ok(1)
            }
        }
    })
}

/// Report ready (the CPU quota is in force once it is answered), check a Bash script with
/// `bash -n`, and on success `execve` bash on it (the channel is closed first: the script
/// never holds it). A syntax error is reported as a validation error and nothing of the
/// script runs. The check parses up to 1 MiB of input: under the quota, like Python's
/// `compile` of a Python script.
pub(crate) fn run_bash(chan: Channel, path: &str, proceed: bool) -> Result<u8, String> {
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    ready_and_wait(&chan, proceed)?;
    let check = Command::new(BASH)
        .arg("-n")
        .arg(path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run {BASH} -n: {e}"))?;
    if !check.status.success() {
        let text = String::from_utf8_lossy(&check.stderr);
        let mut error: String = text.trim_end().chars().take(64 * 1024).collect();
        if error.is_empty() {
            error = format!("bash -n failed ({})", check.status);
        }
        chan.send_bytes(&app::encode(&FromPayload::ValidationError { error }))
            .map_err(|e| format!("agent channel: {}", e.desc()))?;
        return Ok(VALIDATION_FAILED);
    }
    drop(chan);
    let err = Command::new(BASH).arg(path).arg0("bash").exec();
    Err(format!("cannot execute {BASH}: {err}"))
}

/// The shell scripts run with.
const BASH: &str = "/bin/bash";

/// Exit status after a validation failure (EX_DATAERR); the agent reports the validation
/// error, not this status.
const VALIDATION_FAILED: u8 = 65;

/// Report the runtime's start-up over and — when the agent said it answers
/// ([`RuntimeArgs::waits_for_proceed`]) — wait until it answers that the CPU quota is in
/// force ([`ToPayload::Proceed`]); anything else, or the end of the channel, is an error and
/// the run goes no further.
pub(crate) fn ready_and_wait(chan: &Channel, proceed: bool) -> Result<(), String> {
    chan.send_bytes(&app::encode(&FromPayload::Ready)).map_err(|e| format!("agent channel: {}", e.desc()))?;
    if !proceed {
        return Ok(());
    }
    match chan.recv_bytes(app::MAX_MESSAGE).map_err(|e| format!("agent channel: {e}"))? {
        None => Err("the agent closed the channel before the CPU quota was in force".into()),
        Some(bytes) => match serde_json::from_slice::<ToPayload>(&bytes) {
            Ok(ToPayload::Proceed) => Ok(()),
            Ok(other) => Err(format!("agent channel: expected proceed, got {other:?}")),
            Err(e) => Err(format!("agent channel: malformed message: {e}")),
        },
    }
}

/// Start CPython from an isolated configuration.
fn start_interpreter() -> Result<(), String> {
    pyo3::append_to_inittab!(_opservant);
    let program = CString::new(PYTHON_PROGRAM).map_err(|e| e.to_string())?;
    // SAFETY: single-threaded process, interpreter not yet initialised; `pre` and `config`
    // are initialised by their Init*IsolatedConfig functions before any field is read,
    // `config` is cleared after use, and `program` outlives the call that copies it.
    unsafe {
        use pyo3::ffi;
        // UTF-8 mode (PEP 540): stdio and file names are UTF-8 whatever the (cleared)
        // environment's locale, as `python3 -X utf8` would have them.
        let mut pre = std::mem::MaybeUninit::<ffi::PyPreConfig>::zeroed();
        ffi::PyPreConfig_InitIsolatedConfig(pre.as_mut_ptr());
        let pre = pre.assume_init_mut();
        pre.utf8_mode = 1;
        let status = ffi::Py_PreInitialize(pre);
        if ffi::PyStatus_Exception(status) != 0 {
            return Err("cannot pre-initialise the embedded Python".into());
        }
        let mut config = std::mem::MaybeUninit::<ffi::PyConfig>::zeroed();
        ffi::PyConfig_InitIsolatedConfig(config.as_mut_ptr());
        let c = config.assume_init_mut();
        c.site_import = 0;
        c.write_bytecode = 0;
        c.safe_path = 1;
        c.user_site_directory = 0;
        c.use_environment = 0;
        let status = ffi::PyConfig_SetBytesString(c, &mut c.program_name, program.as_ptr());
        let status = if ffi::PyStatus_Exception(status) == 0 { ffi::Py_InitializeFromConfig(c) } else { status };
        ffi::PyConfig_Clear(c);
        if ffi::PyStatus_Exception(status) != 0 {
            let msg = if status.err_msg.is_null() {
                "unknown error".to_string()
            } else {
                std::ffi::CStr::from_ptr(status.err_msg).to_string_lossy().into_owned()
            };
            return Err(format!("cannot start the embedded Python: {msg}"));
        }
    }
    Ok(())
}

use native::_opservant;
