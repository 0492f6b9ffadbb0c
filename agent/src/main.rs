//! The `opservant` binary. Exit status (DESIGN.md §5): 0 completed, 1 ran but did not
//! complete (the JSON says why), 2 could not run — with a one-line reason on stderr.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use agent::one_terminal_line;
use agent::policy::AgentPolicy;
use agent::result::{RunResult, Status};

/// Hidden sub-command that turns this process into a sandbox init.
use agent::launch::{LaunchMode, SANDBOX_INIT};

#[derive(Parser)]
#[command(name = "opservant", version = agent::app::BUILD, about = "Runs executor plugins inside a native Linux sandbox")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The longest a command waits at its exit for the `audit_resumed` records in line.
const AUDIT_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Subcommand)]
enum Command {
    /// Run any program inside the sandbox built from a manifest's permissions and limits
    /// (defaults without one). Prints the program's output, then the result JSON as the last
    /// line of stdout.
    Sandbox {
        /// Manifest whose permissions and resource_limits shape the sandbox.
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// Print only the result JSON (the program's output is inside it).
        #[arg(long)]
        json: bool,
        /// How to start the sandbox: a fresh process (cold) or a fork of a zygote.
        #[arg(long, value_enum, default_value_t)]
        launch: LaunchMode,
        /// Agent configuration, whose limits, ceilings and minimum Landlock ABI apply as to
        /// `run` (default $OPSERVANT_CONFIG, else /etc/opservant/config.yaml when it exists).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Program and arguments.
        #[arg(required = true, last = true, value_name = "PROGRAM")]
        argv: Vec<String>,
    },
    /// Run an executor (a directory with manifest.json and a Python package) in a fresh
    /// sandbox; prints the result JSON.
    Run {
        /// The executor directory, or the name of an installed executor (a bare name is the
        /// installed one, even when a directory of that name is in the working directory).
        dir: PathBuf,
        /// Parameters: a JSON object, or @FILE.
        #[arg(long, default_value = "{}")]
        params: String,
        /// The action (one of the manifest's supported_actions).
        #[arg(long)]
        action: Option<String>,
        /// Agent configuration (default $OPSERVANT_CONFIG, else /etc/opservant/config.yaml when it
        /// exists).
        #[arg(long)]
        config: Option<PathBuf>,
        /// How to start the sandbox: a fresh process (cold) or a fork of a zygote with the
        /// runtime already initialised (the agent daemon's way).
        #[arg(long, value_enum, default_value_t)]
        launch: LaunchMode,
    },
    /// Run a Python or Bash script in a fresh sandbox (validated first, inside the sandbox);
    /// prints the script result JSON.
    Script {
        language: agent::script_run::Language,
        file: PathBuf,
        /// Wall-clock limit in seconds (default: the manifest's timeout_seconds, else the
        /// configuration's default_timeout_seconds, 60 shipped; at most 300).
        #[arg(long)]
        timeout: Option<u64>,
        /// Manifest whose permissions and resource_limits shape the sandbox (default: no
        /// network, scratch only, default limits).
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// Agent configuration (default $OPSERVANT_CONFIG, else /etc/opservant/config.yaml when it
        /// exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Stateful Python sessions: one long-lived sandboxed interpreter per session whose
    /// globals persist between calls.
    Session {
        #[command(subcommand)]
        command: SessionCommand,
    },
    /// The session daemon (started by `session start`; settings on stdin).
    #[command(name = "__session-serve", hide = true)]
    SessionServe,
    /// Remove the egress host table after DELAY_MS if no sandbox uses it (started by the
    /// last run with egress to end).
    #[command(name = "__net-gc", hide = true)]
    NetGc { delay_ms: u64 },
    /// Manage executors.
    Executor {
        #[command(subcommand)]
        command: ExecutorCommand,
    },
    /// The agent daemon: verifies and runs signed commands from the root-only socket
    /// (`agent.socket`) until SIGTERM.
    Agent {
        #[arg(long)]
        config: Option<PathBuf>,
        /// Check the configuration (and the keys and directories it names), then exit:
        /// 0 when it is usable, 2 with the reason when not.
        #[arg(long = "check-config")]
        check_config: bool,
    },
    /// Send a signed command to the running agent and print its reply. Exit 0 when the
    /// command completed, 1 when it did not (rejected included), 2 when it could not be sent.
    Submit {
        /// The signed command (`-` for stdin).
        signed: PathBuf,
        #[arg(long)]
        socket: Option<PathBuf>,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Create an Ed25519 key pair for signing commands: DIR/signing.key (PKCS#8 PEM, mode
    /// 0600) and DIR/signing.pub (PEM). Never overwrites.
    Keygen {
        #[arg(long)]
        out: PathBuf,
    },
    /// Sign a command: add `timestamp` when absent and `signature` (Ed25519 over the RFC 8785
    /// canonical JSON without `signature`); print the signed command. With `--package`: sign
    /// an executor archive — write PKG.sig, the base64 Ed25519 signature of the archive's
    /// bytes (replaced atomically when it exists).
    Sign {
        #[arg(long)]
        key: PathBuf,
        /// The command JSON (`-` for stdin).
        #[arg(required_unless_present = "package", conflicts_with = "package")]
        command: Option<PathBuf>,
        /// An executor archive (.tar.gz, .tgz, .tar) to sign instead of a command.
        #[arg(long)]
        package: Option<PathBuf>,
        /// With --package: where to write the signature (default PKG.sig).
        #[arg(long, requires = "package")]
        out: Option<PathBuf>,
    },
    /// Verify a signed command: signature and clock skew. Exit 0 when both pass, 1 when not.
    /// With `--package`: verify an archive's detached signature (PKG.sig, or --signature):
    /// exit 0 when it verifies with the key, 1 when it is bad or missing.
    Verify {
        #[arg(long = "pub")]
        public_key: PathBuf,
        #[arg(required_unless_present = "package", conflicts_with = "package")]
        signed: Option<PathBuf>,
        /// An executor archive to verify instead of a command.
        #[arg(long)]
        package: Option<PathBuf>,
        /// With --package: the signature file (default PKG.sig).
        #[arg(long, requires = "package")]
        signature: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// The hash-chained audit log: verify the chain, show the last records.
    Audit {
        #[command(subcommand)]
        command: agent::audit::cli::AuditCommand,
    },
    /// Describe what this host supports and what will be degraded. Exit 1 when a required
    /// feature is missing.
    Doctor {
        #[arg(long)]
        json: bool,
        /// The agent configuration whose requirements to check (`sandbox.landlock_min_abi`,
        /// `sandbox.allow_degraded`); default $OPSERVANT_CONFIG, else /etc/opservant/config.yaml
        /// when it exists.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Sandbox overhead report: bare programs (`true`, `python3`), `unshare`, bubblewrap,
    /// opservant's cold, zygote and pool rows, interleaved in one process; median/p90/p99 and ratios against bubblewrap, throughput,
    /// memory, the issue-6 targets. Needs root.
    Bench {
        /// Measured rounds (each runs every row once).
        #[arg(long, default_value_t = 100)]
        rounds: usize,
        /// Warm-up rounds, discarded.
        #[arg(long, default_value_t = 5)]
        warmup: usize,
        /// Only these rows (comma-separated): true, python3, unshare, bwrap-true, bwrap-python3,
        /// sandbox-cold, sandbox-zygote, run-cold, run-zygote, run-pool, run-agent,
        /// run-agent-pool, run-cold-egress, run-zygote-egress, run-pool-egress.
        #[arg(long, value_delimiter = ',', value_name = "ROW,...")]
        only: Option<Vec<String>>,
        /// Threads of the throughput test (default: the agent's default `agent.max_concurrent`,
        /// the commands it runs at once).
        #[arg(long)]
        threads: Option<usize>,
        /// Seconds the throughput test runs.
        #[arg(long, default_value_t = 5.0)]
        duration: f64,
        /// Only the timing rows: no throughput and memory sections.
        #[arg(long = "timings-only")]
        timings_only: bool,
        /// Write every figure as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Render the chart (SVG) to FILE.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
    },
    /// The built-in encrypted secrets store (secrets.store, default /etc/opservant/secrets.enc).
    /// Exit 1 when the named secret does not exist (get, rm), 2 when the store or key cannot
    /// be used.
    Secrets {
        #[command(subcommand)]
        command: agent::secrets_cli::SecretsCommand,
    },
}

#[derive(Subcommand)]
enum ExecutorCommand {
    /// Check an executor directory without running it: the errors `opservant run` would stop
    /// on and its warnings. Exit 0 when there are no errors, 1 when there are.
    Lint {
        dir: PathBuf,
        #[arg(long)]
        json: bool,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Install an executor from a directory or a .tar.gz/.tgz/.tar package into the executors
    /// directory (`executors.dir`); it must lint clean. Requirements are installed from wheels.
    /// An archive's signature (PKG.sig beside it, or --signature) is checked when present and
    /// required with `executors.require_signature` (which refuses directories).
    Install {
        package: PathBuf,
        /// The archive's detached signature (default: PKG.sig beside it, when it exists).
        #[arg(long, value_name = "FILE")]
        signature: Option<PathBuf>,
        /// Install again a version that is already installed.
        #[arg(long)]
        force: bool,
        /// More wheels for `requirements.packages` (repeatable).
        #[arg(long = "find-links", value_name = "DIR")]
        find_links: Vec<PathBuf>,
        /// A package index for `requirements.packages`.
        #[arg(long = "index-url", value_name = "URL")]
        index_url: Option<String>,
        #[arg(long)]
        json: bool,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// List the installed executors.
    List {
        #[arg(long)]
        json: bool,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Remove an installed executor. Exit 1 when it is not installed.
    Remove {
        name: String,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Run an executor package's own tests (tests/, pytest with ExecutorTestHarness) inside
    /// the sandbox: no network, the package read-only, a scratch /tmp, the executor user.
    /// pytest's output goes to stderr; stdout gets one result JSON line with the counts.
    /// Harness runs with sandboxed=True are skipped (no sandbox can be built inside one).
    /// Exit 0 when every test passed (or was skipped), 1 when some failed or the session did
    /// not complete, 2 when the tests could not run (bad manifest, no tests/, no pytest).
    Test {
        /// The executor directory, or the name of an installed executor.
        executor: PathBuf,
        /// The Python interpreter whose pytest runs the tests (default: the first python3 on
        /// PATH that can import pytest). Its standard library and site-packages are shown
        /// read-only in the sandbox; it must be readable by the executor user.
        #[arg(long, value_name = "PATH")]
        python: Option<PathBuf>,
        /// Wall-clock limit of the whole session in seconds (default 600, at most the
        /// agent's ceiling).
        #[arg(long)]
        timeout: Option<u64>,
        #[arg(long)]
        config: Option<PathBuf>,
        /// More pytest arguments, e.g. -- -k scan -x
        #[arg(last = true, value_name = "PYTEST_ARGS")]
        pytest_args: Vec<String>,
    },
}

#[derive(Subcommand)]
enum SessionCommand {
    /// Start a session; prints its settings as JSON once it is ready.
    Start {
        name: String,
        /// Modules code may import (comma-separated, repeatable; submodules included). None
        /// given: every import is refused.
        #[arg(long = "allow-import", value_name = "MODULES")]
        allow_import: Vec<String>,
        /// Pre-import ALIAS=MODULE into the session's globals (repeatable), e.g. np=numpy.
        #[arg(long = "default-import", value_name = "ALIAS=MODULE")]
        default_import: Vec<String>,
        /// Per-call timeout in seconds (default 60, at most 300); a call that exceeds it
        /// ends the session.
        #[arg(long)]
        timeout: Option<u64>,
        /// End the session after this many seconds without a call (default 600).
        #[arg(long)]
        idle_timeout: Option<u64>,
        /// End the session after this many seconds in any case (default 86400).
        #[arg(long)]
        max_lifetime: Option<u64>,
        /// A directory of third-party packages to put on sys.path (repeatable; shown
        /// read-only in the sandbox). Importing from it still needs --allow-import.
        #[arg(long = "python-path", value_name = "DIR")]
        python_path: Vec<PathBuf>,
        /// Manifest whose permissions and resource_limits shape the sandbox.
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// Agent configuration (default $OPSERVANT_CONFIG, else /etc/opservant/config.yaml when it
        /// exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Run code in a session; prints {success, error, stdout, stderr, globals}.
    Exec {
        name: String,
        /// The code: inline, or @FILE.
        #[arg(long)]
        code: String,
        /// Variables to set before the code runs: a JSON object, or @FILE.
        #[arg(long)]
        globals: Option<String>,
        /// Names of globals to return after the code ran (comma-separated).
        #[arg(long = "return", value_name = "NAMES")]
        return_names: Option<String>,
        /// Timeout for this call in seconds (at most the session's).
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Stop a session.
    Stop { name: String },
    /// List running sessions.
    List,
}

/// `println!` to stdout, returning (with `?`) a write error as [`CannotRun`]: exit 2 with a
/// reason naming stdout (see [`agent::stdout`]).
macro_rules! outln {
    ($($arg:tt)*) => {
        agent::stdout::print(&format!("{}\n", format_args!($($arg)*)))?
    };
}

/// `print!` to stdout, as [`outln!`].
macro_rules! out {
    ($($arg:tt)*) => {
        agent::stdout::print(&format!($($arg)*))?
    };
}

/// `eprintln!` that cannot panic: a stderr that cannot be written drops the message (see
/// [`agent::stdout::eprint`]).
macro_rules! errln {
    ($($arg:tt)*) => {
        agent::stdout::eprint(&format!("{}\n", format_args!($($arg)*)))
    };
}

/// A failure to run: exit status 2 with a one-line reason.
struct CannotRun(String);

impl<E: std::fmt::Display> From<E> for CannotRun {
    fn from(e: E) -> Self {
        CannotRun(e.to_string())
    }
}

/// `filter` with the HTTP client's own logging off whatever `OPSERVANT_LOG` asks: at debug
/// and trace it writes requests and responses — the Vault token, a login's `client_token`,
/// secret values — into the log (`log` records, which `tracing-subscriber` takes in). A
/// directive for the same target in `OPSERVANT_LOG` is replaced by these.
fn quiet_http_clients(filter: tracing_subscriber::EnvFilter) -> tracing_subscriber::EnvFilter {
    ["ureq=off", "ureq_proto=off"].iter().fold(filter, |f, d| match d.parse() {
        Ok(directive) => f.add_directive(directive),
        // A constant that parses: `off` for a crate's target.
        Err(_) => f,
    })
}

/// A command-line error of clap's in one line: its message and the lines that complete it
/// (the arguments it names), without the usage block and tips that follow.
fn usage_error_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let words: Vec<&str> = text
        .lines()
        .take_while(|l| !l.starts_with("Usage:"))
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
        .collect();
    one_terminal_line(words.join(" ").trim_start_matches("error: "))
}

fn main() -> ExitCode {
    // The sandbox init must run before anything else (no threads, no logging setup).
    if std::env::args_os().nth(1).is_some_and(|a| a == SANDBOX_INIT) {
        sandbox::init::main();
    }
    // A file-size limit (`LimitFSIZE=`, an inherited `ulimit -f`) must fail a write with
    // EFBIG, which the audit log cuts back and reports, not kill the agent with a record
    // half-written. Every sandbox resets its dispositions before its payload runs.
    // SAFETY: installing SIG_IGN is always sound; no handler runs.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            // DESIGN.md §5: a one-line reason (clap's message, without its usage block).
            errln!("opservant: {} (see --help)", usage_error_line(&e));
            return ExitCode::from(2);
        }
    };
    let log = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match tracing_subscriber::EnvFilter::try_from_env("OPSERVANT_LOG") {
        Ok(filter) => log.with_env_filter(quiet_http_clients(filter)).init(),
        // `bench` runs thousands of executions whose audit events go to its own scratch log;
        // `sandbox`'s stderr is its program's (its records are in the log all the same).
        Err(_) if matches!(cli.command, Command::Bench { .. } | Command::Sandbox { .. }) => {
            log.with_env_filter(tracing_subscriber::EnvFilter::new("warn")).init()
        }
        // Without OPSERVANT_LOG: warnings, and the audit events (always).
        Err(_) => log.with_env_filter(tracing_subscriber::EnvFilter::new("warn,opservant::audit=info")).init(),
    }
    if matches!(
        cli.command,
        Command::Sandbox { .. }
            | Command::Run { .. }
            | Command::Script { .. }
            | Command::Executor { command: ExecutorCommand::Test { .. } }
    ) {
        if let Err(CannotRun(reason)) = stop_sandboxes_on_signals() {
            errln!("opservant: {}", one_terminal_line(&reason));
            return ExitCode::from(2);
        }
    }
    // As the daemon's: these hold what must not reach a core file — a run the store's key,
    // a cached Vault token and the values it delivers; `secrets` the key and a value.
    if matches!(
        cli.command,
        Command::Run { .. } | Command::Executor { command: ExecutorCommand::Test { .. } } | Command::Secrets { .. }
    ) {
        if let Err(agent::executor_run::CannotRun(reason)) = agent::daemon::no_core_dumps() {
            errln!("opservant: {}", one_terminal_line(&reason));
            return ExitCode::from(2);
        }
    }
    // An install a stop reached after its record completes (a rename and a link): its exit
    // status is the install's, not the signal's — a script that read 143 would try again and
    // be told the version is installed.
    let install = matches!(cli.command, Command::Executor { command: ExecutorCommand::Install { .. } });
    let result = match cli.command {
        Command::Sandbox { manifest, json, launch, config, argv } => run_sandbox(manifest, json, launch, config, argv),
        Command::Run { dir, params, action, config, launch } => run_executor(dir, params, action, config, launch),
        Command::Script { language, file, timeout, manifest, config } => {
            run_script(language, file, timeout, manifest, config)
        }
        Command::Session { command } => session(command),
        Command::NetGc { delay_ms } => {
            return match agent::egress::collect_host_table(delay_ms.min(60_000)) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    errln!("opservant: {e}");
                    ExitCode::from(1)
                }
            };
        }
        Command::SessionServe => {
            let runtime = match agent::executor_run::runtime_binary() {
                Ok(r) => r,
                Err(e) => {
                    // The session's starter reads this line; nothing more can be reported.
                    let _ =
                        agent::stdout::print(&format!("{}\n", serde_json::json!({"status": "failed", "error": e.0})));
                    return ExitCode::from(2);
                }
            };
            let code = agent::session::serve(sandbox::Launcher::fork_or_reexec(SANDBOX_INIT), runtime);
            return ExitCode::from(code as u8);
        }
        Command::Executor { command: ExecutorCommand::Lint { dir, json, config } } => lint(dir, json, config),
        Command::Executor {
            command: ExecutorCommand::Install { package, signature, force, find_links, index_url, json, config },
        } => executor_install(
            &package,
            signature.as_deref(),
            agent::executor_install::InstallOptions {
                force,
                find_links,
                index_url,
                skip_identical: false,
                owned_tree: false,
            },
            json,
            config,
        ),
        Command::Executor { command: ExecutorCommand::List { json, config } } => executor_list(json, config),
        Command::Executor { command: ExecutorCommand::Remove { name, config } } => executor_remove(&name, config),
        Command::Executor { command: ExecutorCommand::Test { executor, python, timeout, config, pytest_args } } => {
            executor_test(executor, python, timeout, config, pytest_args)
        }
        Command::Audit { command } => agent::audit::cli::main(command).map_err(|e| CannotRun(e.to_string())),
        Command::Doctor { json, config } => doctor(json, config),
        Command::Secrets { command } => {
            agent::secrets_cli::run(command).map(ExitCode::from).map_err(|e| CannotRun(e.to_string()))
        }
        Command::Keygen { out } => keygen(&out),
        Command::Bench { rounds, warmup, only, threads, duration, timings_only, json, svg } => {
            bench(rounds, warmup, only, threads, duration, timings_only, json, svg)
        }
        Command::Agent { config, check_config } => agent_daemon(config, check_config),
        Command::Submit { signed, socket, config } => submit(&signed, socket, config),
        Command::Sign { key, package: Some(package), out, .. } => sign_package(&key, &package, out),
        // clap's `requires` does not fire beside the positional command (it conflicts with
        // --package), so the flag is checked here: a signed command goes to stdout only.
        Command::Sign { out: Some(out), .. } => Err(CannotRun(format!(
            "--out {}: only with --package (a signed command is printed on stdout)",
            out.display()
        ))),
        Command::Sign { key, command: Some(command), .. } => sign_command(&key, &command),
        Command::Verify { public_key, package: Some(package), signature, json, .. } => {
            verify_package(&public_key, &package, signature.as_deref(), json)
        }
        Command::Verify { public_key, signed: Some(signed), json, .. } => verify_command(&public_key, &signed, json),
        Command::Sign { .. } | Command::Verify { .. } => Err(CannotRun("give a command file or --package".into())),
    };
    let code = match result {
        Ok(code) => code,
        Err(CannotRun(reason)) => {
            errln!("opservant: {}", one_terminal_line(&reason));
            ExitCode::from(2)
        }
    };
    // A run of audit failures this command ended has its record appended on a thread of its
    // own: waited for (bounded), not lost with the process.
    agent::audit::drain(AUDIT_DRAIN);
    // Stopped by a signal: the shell's convention, once everything is reported and cleaned up.
    match CAUGHT_SIGNAL.load(std::sync::atomic::Ordering::SeqCst) {
        0 => code,
        sig if install && code == ExitCode::SUCCESS => {
            let name = nix::sys::signal::Signal::try_from(sig).map_or("a signal", |s| s.as_str());
            errln!("opservant: {name} came after the install was recorded: it completed");
            code
        }
        // A run completes despite a stop only when the stop came after its payload ended
        // (the sandbox was then being reaped): its result says `completed`, and so does the
        // exit status.
        sig if code == ExitCode::SUCCESS => {
            let name = nix::sys::signal::Signal::try_from(sig).map_or("a signal", |s| s.as_str());
            errln!("opservant: {name} came after the run ended: it completed");
            code
        }
        sig => {
            let name = nix::sys::signal::Signal::try_from(sig).map_or("a signal", |s| s.as_str());
            errln!("opservant: stopped by {name}");
            ExitCode::from(128u8.saturating_add(u8::try_from(sig).unwrap_or(0)))
        }
    }
}

/// The terminal signal a sandbox-running command received (0: none).
static CAUGHT_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// The command's own pid (its signal handler does nothing in a forked child).
static CLI_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// SIGINT, SIGTERM, SIGHUP and SIGQUIT stop the command's sandboxes instead of killing the
/// command outright (which left their cgroups behind): each sandbox is torn down, the result
/// says it was stopped, its cgroups are removed, and the command exits 128 + the signal.
/// The sandboxes' monitors have sessions of their own, so a terminal's Ctrl-C reaches only
/// this process. A handler, not a thread: the command stays single-threaded, so its cold
/// sandboxes are still forked, not re-executed.
fn stop_sandboxes_on_signals() -> Result<(), CannotRun> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    extern "C" fn on_signal(sig: libc::c_int) {
        // Async-signal-safe: getpid(2), atomics and stop_all's write(2); errno is kept.
        // A child forked to be a sandbox's monitor runs this until it resets its handlers:
        // the stop pipe's descriptor numbers are not the pipe there, so it does nothing.
        // SAFETY: getpid has no preconditions.
        if unsafe { libc::getpid() } as u32 != CLI_PID.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        // A second signal: out at once (the stop hangs, or the command is busy elsewhere,
        // e.g. reading --params from a terminal). `_exit`, not the default action: SIGQUIT's
        // would dump the core of a process that may hold secrets.
        if CAUGHT_SIGNAL.swap(sig, std::sync::atomic::Ordering::SeqCst) != 0 {
            // SAFETY: _exit is async-signal-safe and ends the process.
            unsafe { libc::_exit(128 + sig) };
        }
        let errno = nix::errno::Errno::last_raw();
        sandbox::parent::stop_all();
        agent::executor_install::stop_signalled(sig);
        nix::errno::Errno::set_raw(errno);
    }
    CLI_PID.store(std::process::id(), std::sync::atomic::Ordering::SeqCst);
    sandbox::parent::enable_stop_all().map_err(|e| CannotRun(e.to_string()))?;
    let action = SigAction::new(SigHandler::Handler(on_signal), SaFlags::SA_RESTART, SigSet::empty());
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP, Signal::SIGQUIT] {
        // SAFETY: the handler only does async-signal-safe work (see above).
        unsafe { sigaction(s, &action) }.map_err(|e| CannotRun(format!("sigaction {s}: {e}")))?;
    }
    Ok(())
}

fn run_sandbox(
    manifest: Option<PathBuf>,
    json_only: bool,
    launch: LaunchMode,
    config: Option<PathBuf>,
    argv: Vec<String>,
) -> Result<ExitCode, CannotRun> {
    let manifest_path = manifest.as_deref().map(|p| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()));
    let manifest = manifest.as_deref().map(load_manifest).transpose()?;
    let config = agent::config::Config::load(config.as_deref())?;
    let policy = AgentPolicy::from_config(&config)?;
    let (program, args) = argv.split_first().ok_or_else(|| CannotRun("no program given".into()))?;
    agent::audit::init(&config)?;
    // What the manifest asks that is refused is a check that said no: audited, as a run's
    // refusal is.
    let refused = |e: CannotRun| {
        agent::audit::record_quietly("sandbox_refused", &[("program", program), ("reason", &e.0)]);
        e
    };
    agent::policy::refuse_unmet(manifest.as_ref(), "opservant sandbox", false).map_err(|e| refused(e.into()))?;
    let (spec, limits) = policy.spec_for(manifest.as_ref(), program, args.to_vec()).map_err(|e| refused(e.into()))?;
    // Fail closed: a program whose start cannot be audited does not start. The arguments as
    // given (a JSON array, and its SHA-256: a long one is cut in the record), the manifest by
    // its absolute path.
    let manifest_shown = manifest_path.as_deref().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    let args_json = serde_json::to_string(args)?;
    agent::audit::try_record(
        "sandbox_start",
        &[
            ("program", program),
            ("args", &args_json),
            ("args_sha256", &agent::audit::sha256_hex(args_json.as_bytes())),
            ("manifest", &manifest_shown),
            ("launch", launch.as_str()),
        ],
    )?;
    limits.audit_clamps(("program", program));
    // From here on, a program that cannot finish is audited as ended: every start has an end.
    let ended = |status: &str, exit_code: Option<i32>, killed_by: &str, error: &str| {
        let exit_code = exit_code.map(|c| c.to_string()).unwrap_or_default();
        agent::audit::record(
            "sandbox_end",
            &[
                ("program", program.as_str()),
                ("status", status),
                ("exit_code", &exit_code),
                ("killed_by", killed_by),
                ("error", error),
            ],
        );
    };
    let result = sandboxed(&spec, &limits, json_only, launch);
    let (result, newline_first) = match result {
        Ok(r) => r,
        Err(e) => {
            ended("error", None, "", &e.0);
            return Err(e);
        }
    };
    if let Some(why) = &result.sandbox.abandoned {
        agent::audit::record("sandbox_abandoned", &[("program", program), ("reason", why)]);
    }
    let killed_by = result.killed_by.as_deref().unwrap_or("");
    if matches!(killed_by, "oom" | "timeout" | "pids") {
        agent::audit::record("limit_enforced", &[("program", program), ("limit", killed_by)]);
    }
    ended(result.status.as_str(), result.exit_code, killed_by, result.error.as_deref().unwrap_or(""));
    // Printed once its end is on record: a caller that reads the result and stops this
    // process finds the record there (and a result that cannot be written, exit 2, ended
    // all the same).
    let text = serde_json::to_string(&result)?;
    out!("{}{text}\n", if newline_first { "\n" } else { "" });
    Ok(if result.status == Status::Completed { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Start the sandbox of `opservant sandbox` and pass its program's output on (unless
/// `json_only`): its result, and whether the program's output left stdout without its last
/// newline (the result line then begins with one).
fn sandboxed(
    spec: &sandbox::SandboxSpec,
    limits: &agent::limits::EffectiveLimits,
    json_only: bool,
    launch: LaunchMode,
) -> Result<(RunResult, bool), CannotRun> {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    // The program is the sandbox's: to a terminal its output goes with control characters
    // other than newline and tab shown escaped (it could hide or overwrite the result line
    // that follows, or drive the terminal); to a pipe or file byte for byte.
    let (out_terminal, err_terminal) =
        (std::io::IsTerminal::is_terminal(&stdout), std::io::IsTerminal::is_terminal(&stderr));
    let (mut out_escaper, mut err_escaper) =
        (agent::stdout::TerminalEscaper::default(), agent::stdout::TerminalEscaper::default());
    let mut last_stdout_byte = b'\n';
    let mut tee = |stream: sandbox::Stream, data: &[u8]| {
        // A closed terminal or pipe must not stop the sandbox; the JSON still captures it.
        let _ = match stream {
            sandbox::Stream::Stdout => {
                if let Some(b) = data.last() {
                    last_stdout_byte = *b;
                }
                if out_terminal {
                    stdout.lock().write_all(&out_escaper.escape(data))
                } else {
                    stdout.lock().write_all(data)
                }
            }
            sandbox::Stream::Stderr if err_terminal => stderr.lock().write_all(&err_escaper.escape(data)),
            sandbox::Stream::Stderr => stderr.lock().write_all(data),
        };
    };
    let out = sandbox::OutputOptions { tee: if json_only { None } else { Some(&mut tee) }, ..Default::default() };
    let zygote = || -> Result<sandbox::Launcher, CannotRun> {
        let runtime = agent::executor_run::runtime_binary().map_err(|e| CannotRun(e.0))?;
        Ok(agent::launch::for_program(&agent::launch::one_shot_zygote(&runtime)))
    };
    let sb = match launch {
        LaunchMode::Cold => {
            agent::launch::spawn_with_fallback(spec, &sandbox::Launcher::fork_or_reexec(SANDBOX_INIT), None)?
        }
        LaunchMode::Zygote => agent::launch::spawn_with_fallback(spec, &zygote()?, None)?,
        // As a warm pool does it: the sandbox is started through the zygote, held (its payload
        // waits, every restriction in place, for the go) and then taken, which releases it.
        LaunchMode::Pool => {
            let mut spec = spec.clone();
            spec.command.held = true;
            let pool = agent::warm_pool::WarmPool::single_use(zygote()?)
                .map_err(|e| CannotRun(format!("--launch pool: warm pool: {e}")))?;
            pool.fill(spec.clone())?;
            pool.take(&spec).ok_or_else(|| CannotRun("--launch pool: the pooled sandbox could not be taken".into()))?
        }
    };
    // The program ended, but processes it left cannot die (stuck in the kernel): its result
    // stands, the abandon said beside it (`sandbox.abandoned`).
    let (outcome, abandoned) = match sb.wait(out) {
        Err(sandbox::SandboxError::Abandoned { reason, outcome }) if outcome.exit.is_some() => (*outcome, Some(reason)),
        other => (other?, None),
    };
    let _ = stdout.lock().write_all(&out_escaper.finish());
    let _ = stderr.lock().write_all(&err_escaper.finish());
    let mut result = RunResult::for_plain_program(&outcome, limits);
    result.sandbox.abandoned = abandoned;
    Ok((result, !json_only && last_stdout_byte != b'\n'))
}

/// `--params`: inline JSON or `@FILE` (at most what a run accepts, read no further),
/// parsed as strictly as a signed command's: no duplicate keys, bounded depth, integers a
/// double holds exactly — so a run from the CLI sees what the same parameters in a command
/// would give.
fn read_params(arg: &str) -> Result<serde_json::Value, CannotRun> {
    let bytes = match arg.strip_prefix('@') {
        Some(path) => read_bounded("--params", path, agent::app::MAX_MESSAGE, "a run accepts")?,
        None => arg.as_bytes().to_vec(),
    };
    parse_json_arg("--params", &bytes)
}

/// `FLAG @PATH`: the file's bytes, at most `limit` (read no further: a FIFO or /dev/zero
/// cannot make it read for ever).
fn read_bounded(flag: &str, path: &str, limit: usize, what: &str) -> Result<Vec<u8>, CannotRun> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(limit as u64 + 1).read_to_end(&mut bytes))
        .map_err(|e| CannotRun(format!("{flag} @{path}: {e}")))?;
    if bytes.len() > limit {
        return Err(CannotRun(format!("{flag} @{path}: larger than the {limit} bytes {what}")));
    }
    Ok(bytes)
}

/// A JSON argument parsed as strictly as a signed command ([`agent::signing::parse_strict`]).
fn parse_json_arg(flag: &str, bytes: &[u8]) -> Result<serde_json::Value, CannotRun> {
    agent::signing::parse_strict(bytes).map_err(|e| match e {
        agent::signing::SigningError::Parse(m) => CannotRun(format!("{flag}: not valid JSON: {m}")),
        other => CannotRun(format!("{flag}: {other}")),
    })
}

fn run_executor(
    dir: PathBuf,
    params: String,
    action: Option<String>,
    config: Option<PathBuf>,
    launch: LaunchMode,
) -> Result<ExitCode, CannotRun> {
    let config = agent::config::Config::load(config.as_deref())?;
    let policy = AgentPolicy::from_config(&config)?;
    let params = read_params(&params)?;
    let dir = executor_dir(dir, &config)?;
    let executor = agent::executor_run::Executor::load(&dir).map_err(|e| CannotRun(e.0))?;
    for w in &executor.warnings {
        tracing::warn!(executor = %executor.manifest.name, "{w}");
    }
    agent::audit::init(&config)?;
    let runtime = agent::executor_run::runtime_binary().map_err(|e| CannotRun(e.0))?;
    // Cold: the payload is a fresh execve of opservant-runtime, and a forked monitor carries
    // nothing of this process into the executor's reach. Zygote: the payload is a fork of a
    // runtime that holds only the interpreter and the embedded runtime. Pool: the same, started
    // before the run (the sandbox waits for its arguments) and taken by it.
    let launcher = match launch {
        LaunchMode::Cold => sandbox::Launcher::fork_or_reexec(SANDBOX_INIT),
        LaunchMode::Zygote | LaunchMode::Pool => agent::launch::for_runtime(&agent::launch::one_shot_zygote(&runtime)),
    };
    let pool = (launch == LaunchMode::Pool)
        .then(|| agent::warm_pool::WarmPool::single_use(launcher.clone()))
        .transpose()
        .map_err(|e| CannotRun(format!("--launch pool: warm pool: {e}")))?;
    let req = agent::executor_run::RunRequest {
        executor: &executor,
        params,
        action,
        command_id: None,
        config: &config,
        policy: &policy,
        launcher,
        runtime,
        pool,
        background_teardown: false,
        timeline: None,
    };
    agent::executor_run::warm(&req).map_err(|e| CannotRun(format!("--launch pool: {}", e.0)))?;
    let (executor_ref, action_ref) = (req.executor, req.action.clone());
    let result = match agent::executor_run::run(req) {
        Ok(result) => result,
        // It ran, or may have: a result that says it failed (exit 1), not "cannot run".
        Err(e) => match e.failed_reply(executor_ref, action_ref.as_deref(), None) {
            Some(reply) => {
                outln!("{reply}");
                return Ok(ExitCode::from(1));
            }
            None => {
                // Refused before it started (its permissions, its sandbox's set-up): audited
                // as the agent audits a command's refusal — a check that said no is an event.
                let m = &executor_ref.manifest;
                agent::audit::record_quietly(
                    "executor_refused",
                    &[
                        ("executor", &m.name),
                        ("version", &m.version),
                        (
                            "package",
                            &std::path::absolute(&executor_ref.dir)
                                .unwrap_or_else(|_| executor_ref.dir.clone())
                                .to_string_lossy(),
                        ),
                        ("reason", e.message()),
                    ],
                );
                return Err(CannotRun(e.message().to_string()));
            }
        },
    };
    outln!("{}", serde_json::to_string(&result)?);
    Ok(if result.status == Status::Completed { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// A directory, or the name of an installed executor.
/// `dir` names an executor directory, or — a bare name — an installed executor, which wins
/// over a directory of that name in the current directory (one planted where root happens to
/// be must not shadow it; `./NAME` names the directory) — with a warning saying so.
fn executor_dir(dir: PathBuf, config: &agent::config::Config) -> Result<PathBuf, CannotRun> {
    let name = dir.to_string_lossy();
    let bare = !name.contains('/');
    if bare {
        match installed(config, &name) {
            Ok(Some(installed)) => {
                if dir.is_dir() {
                    // Said, not silent: whoever meant the directory learns how to name it.
                    errln!(
                        "opservant: warning: running the installed executor {name}, not the directory {name} here (`./{name}` runs the directory)"
                    );
                }
                return Ok(installed);
            }
            Ok(None) => {}
            // The installed lookup comes first (a directory planted here must not shadow an
            // executor), so a root it cannot trust is an error — saying how to run the
            // directory instead.
            Err(CannotRun(e)) if dir.is_dir() => {
                return Err(CannotRun(format!("{e} (`./{name}` runs the directory {name} here instead)")))
            }
            Err(e) => return Err(e),
        }
    }
    if dir.exists() {
        return Ok(dir);
    }
    installed(config, &name)?.ok_or_else(|| {
        CannotRun(format!(
            "{name}: not a directory, nor an executor installed in {}",
            config.executors.root().display()
        ))
    })
}

/// [`agent::executor_install::resolve`] in the configuration's executors root.
fn installed(config: &agent::config::Config, name: &str) -> Result<Option<PathBuf>, CannotRun> {
    agent::executor_install::resolve(&config.executors.root(), name).map_err(|e| CannotRun(e.to_string()))
}

fn executor_test(
    dir: PathBuf,
    python: Option<PathBuf>,
    timeout: Option<u64>,
    config: Option<PathBuf>,
    pytest_args: Vec<String>,
) -> Result<ExitCode, CannotRun> {
    let config = agent::config::Config::load(config.as_deref())?;
    let policy = AgentPolicy::from_config(&config)?;
    let dir = executor_dir(dir, &config)?;
    let executor = agent::executor_run::Executor::load(&dir).map_err(|e| CannotRun(e.0))?;
    for w in &executor.warnings {
        tracing::warn!(executor = %executor.manifest.name, "{w}");
    }
    // Before looking for pytest: a package without tests, or a zero timeout, is bad input
    // whatever the host has.
    agent::executor_test::tests_dir(&executor).map_err(|e| CannotRun(e.0))?;
    agent::executor_test::check_timeout(timeout).map_err(|e| CannotRun(e.0))?;
    let python = agent::executor_test::find_python(python.as_deref(), policy.identity).map_err(|e| CannotRun(e.0))?;
    let (major, minor, _) = agent::executor_run::embedded_python();
    if !python.version.starts_with(&format!("{major}.{minor}.")) {
        tracing::warn!(
            "the tests run under Python {} ({}), executors under the embedded Python {major}.{minor}",
            python.version,
            python.executable.display()
        );
    }
    agent::audit::init(&config)?;
    let stderr = std::io::stderr();
    // pytest's stdout and stderr both go to stderr: stdout carries only the result line. It
    // is the package's tests' output: on a terminal, control characters but newline and
    // tab are shown escaped (`\x1b`), never sent (no escape sequences).
    let terminal = std::io::IsTerminal::is_terminal(&stderr);
    let mut escaper = agent::stdout::TerminalEscaper::default();
    // Shown up to a bound (a suite can print without end, and a CI log fills a disk): the
    // rest is counted, and the result's own copy is capped at 1 MiB regardless.
    let (mut shown, mut dropped) = (0usize, 0usize);
    let mut tee = |_: sandbox::Stream, data: &[u8]| {
        let take = data.len().min(TEST_OUTPUT_SHOWN.saturating_sub(shown));
        shown += take;
        dropped += data.len() - take;
        let data = &data[..take];
        let _ = if terminal { stderr.lock().write_all(&escaper.escape(data)) } else { stderr.lock().write_all(data) };
    };
    let result = agent::executor_test::run(
        agent::executor_test::TestRequest {
            executor: &executor,
            python: &python,
            timeout_s: timeout,
            pytest_args,
            policy: &policy,
            launcher: sandbox::Launcher::fork_or_reexec(SANDBOX_INIT),
        },
        Some(&mut tee),
    )
    .map_err(|e| CannotRun(e.0));
    let _ = stderr.lock().write_all(&escaper.finish());
    if dropped > 0 {
        errln!(
            "\n[opservant: the test session's output past {} MiB is not shown: {dropped} more bytes]",
            TEST_OUTPUT_SHOWN >> 20
        );
    }
    let result = result?;
    outln!("{}", serde_json::to_string(&result)?);
    Ok(if result.status == Status::Completed { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn read_input(path: &std::path::Path) -> Result<Vec<u8>, CannotRun> {
    use std::io::Read;
    let mut buf = Vec::new();
    let limit = agent::signing::MAX_COMMAND_BYTES as u64 + 1;
    let read = if path == std::path::Path::new("-") {
        std::io::stdin().take(limit).read_to_end(&mut buf)
    } else {
        std::fs::File::open(path).and_then(|f| f.take(limit).read_to_end(&mut buf))
    };
    read.map_err(|e| CannotRun(format!("{}: {e}", path.display())))?;
    Ok(buf)
}

/// Revocation lists of the configuration that are past their `nextUpdate` or near it: the
/// connections they guard fail once they are stale. (An unreadable file is the connection's
/// error, and `--check-config`'s before this.)
fn revocation_list_warnings(cfg: &agent::config::Config) -> Vec<String> {
    let platform = cfg.network.agent_to_platform.as_ref().and_then(|p| p.crl.as_deref());
    let lists = [("network.agent_to_platform.crl", platform), ("secrets.vault_crl", cfg.secrets.vault_crl.as_deref())];
    let now = agent::rfc3339::now();
    lists
        .into_iter()
        .filter_map(|(key, path)| Some((key, path?)))
        .flat_map(|(key, path)| agent::tls::crl_warnings(key, path, now).unwrap_or_else(|e| vec![e]))
        .collect()
}

/// Most of a test session's output `executor test` copies to stderr.
const TEST_OUTPUT_SHOWN: usize = 16 << 20;

fn agent_daemon(config: Option<PathBuf>, check_only: bool) -> Result<ExitCode, CannotRun> {
    // `--check-config` too: it loads the secrets store's key.
    agent::daemon::no_core_dumps().map_err(|e| CannotRun(e.0))?;
    let cfg = agent::config::Config::load(config.as_deref())?;
    // What the configuration's keys hold, refused, names the file too.
    let source = cfg.source.as_ref().map_or_else(|| "the built-in configuration".into(), |p| p.display().to_string());
    let in_config = |m: String| CannotRun(format!("{source}: {m}"));
    let policy = AgentPolicy::from_config(&cfg)?;
    let settings = agent::daemon::DaemonSettings::from_config(&cfg).map_err(|e| in_config(e.0))?;
    let platform_key =
        agent::signing::load_verifying_key(&settings.platform_key).map_err(|e| in_config(e.to_string()))?;
    agent::secrets::Provider::check_config(&cfg).map_err(in_config)?;
    agent::egress::EgressSettings::from_config(&cfg).map_err(|e| in_config(e.to_string()))?;
    let runtime = agent::executor_run::runtime_binary().map_err(|e| CannotRun(e.0))?;
    let platform = agent::platform::Platform::from_config(&cfg).map_err(in_config)?;
    let trust = agent::package_signing::Trust::from_config(&cfg).map_err(in_config)?;
    if check_only {
        agent::audit::AuditLog::check_dir(&agent::audit::AuditSettings::from_config(&cfg))?;
        agent::executor_install::check_configured_root(&cfg.executors.root()).map_err(|e| in_config(e.to_string()))?;
        // Entries of executors.install that would not install: the agent still starts
        // without them, so they are warnings, not errors.
        for w in agent::executor_install::check_configured(&cfg, &trust, &policy.identity) {
            errln!("opservant: warning: {}", one_terminal_line(&w));
        }
        // Both signatures are plain Ed25519 over bytes: one key for both lets a signature
        // made for a package's bytes pass as a command's, should the platform's package
        // signing ever sign bytes that are a command's canonical JSON.
        if let Some(k) = trust.keys.iter().find(|k| k.key == platform_key) {
            errln!(
                "opservant: warning: packages are checked with the key commands are verified with ({}): a platform that signed uploaded bytes with it, unchecked, could be made to sign a command; give packages a key of their own (executors.trusted_keys)",
                k.label
            );
        }
        for w in revocation_list_warnings(&cfg) {
            errln!("opservant: warning: {}", one_terminal_line(&w));
        }
        if let Some(w) = agent::audit::journald_warning(&agent::audit::AuditSettings::from_config(&cfg)) {
            errln!("opservant: warning: {}", one_terminal_line(&w));
        }
        // The configuration is valid; whether this host can meet it is `doctor`'s, but what
        // it requires and the host lacks means every run would be refused: said here too.
        let host = agent::doctor::examine(policy.landlock_min_abi, policy.allow_degraded, policy.host_uids.as_ref());
        for f in host.findings.iter().filter(|f| f.required && !f.ok) {
            errln!(
                "opservant: warning: this host lacks what the configuration requires, so every run would be refused: {}: {}",
                f.feature,
                one_terminal_line(&f.detail)
            );
        }
        outln!("configuration ok");
        return Ok(ExitCode::SUCCESS);
    }
    // Created now (0700) and checked again, not at the first command: a directory someone
    // else made meanwhile in a parent they can write would otherwise be taken as ours.
    // Held until the agent exits: one agent per state directory.
    let _state_lock = agent::daemon::prepare_state_dir(&settings.state_dir).map_err(|e| CannotRun(e.0))?;
    agent::audit::init(&cfg)?;
    for w in revocation_list_warnings(&cfg) {
        tracing::warn!(warning = %w, "a certificate revocation list is stale, nearly so, or unreadable");
    }
    if let Some(w) = agent::audit::journald_warning(&agent::audit::AuditSettings::from_config(&cfg)) {
        tracing::warn!(warning = %w, "the audit log has no journald copy");
    }
    // Before any thread starts (see the function).
    agent::daemon::block_stop_signals().map_err(|e| CannotRun(e.0))?;
    // The cgroup layout now, before the zygote or any sandbox exists: sandbox cgroups a
    // crashed predecessor left are swept at start rather than at the first sandbox (they
    // hold memory and pids till then), and on a delegated v2 host the agent moves into its
    // leaf while it is still alone in its cgroup.
    sandbox::cgroup::prepare();
    // One connection thread per command, up to `agent.max_concurrent`: glibc would give each
    // its own malloc arena (up to 8 per core), each holding its high-water mark for good.
    // Two arenas are plenty for threads that mostly wait on their sandbox.
    // SAFETY: mallopt only sets an allocator tunable; called before the daemon's threads start.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 2) };
    // An install this agent was making when it stopped, cut short between its copy and its
    // switch, is completed first (runs resolve `current`).
    if let Err(e) = agent::executor_install::settle(&cfg.executors.root()) {
        tracing::error!(error = %e, "the executors root could not be settled");
    }
    // executors.install, before any command is taken: failures are logged and audited, and
    // the agent starts without those packages (it can still be told to install them).
    let install_failures = agent::executor_install::install_configured(&cfg, &policy, &trust);
    // Executors installed by an older agent get their bytecode once (a sandbox each).
    agent::bytecode::precompile_installed(&cfg.executors.root(), &policy);
    // The daemon is multi-threaded: sandboxes start from its zygote (a process of their own,
    // started now so the first command does not wait for it) or from a fresh exec.
    let launcher = match settings.launch {
        LaunchMode::Cold => sandbox::Launcher::reexec(SANDBOX_INIT),
        // Refused by the configuration check (`agent.warm_pool` sizes the daemon's pool).
        LaunchMode::Pool => {
            return Err(CannotRun("agent.launch: pool is not a launch mode; set agent.warm_pool".into()))
        }
        LaunchMode::Zygote => {
            // One prepared network namespace per command that may run at once.
            let zygote = agent::launch::zygote(&runtime, settings.max_concurrent);
            if let Err(e) = zygote.start() {
                tracing::warn!(error = %e, "zygote did not start; sandboxes start cold until it does");
                agent::audit::record("zygote_fallback", &[("error", &e.to_string())]);
            }
            agent::launch::for_runtime(&zygote)
        }
    };
    let pool = (settings.warm_pool > 0)
        .then(|| agent::warm_pool::WarmPool::new(settings.warm_pool, settings.warm_pool_idle, launcher.clone()))
        .transpose()
        .map_err(|e| CannotRun(format!("warm pool: {e}")))?;
    // Commands a dead predecessor left running: audited as interrupted before any command
    // is taken (their ids are answered so when sent again; the platform's are posted to it).
    let inflight =
        agent::inflight::InFlight::open(&settings.socket).map_err(|e| CannotRun(format!("agent.socket: {e}")))?;
    let interrupted = inflight.recover();
    let pipeline = agent::command::Pipeline {
        inflight: Some(inflight),
        interrupted_for_platform: std::sync::Mutex::new(
            interrupted.into_iter().filter(|e| e.source == "platform").collect(),
        ),
        seen: agent::replay::SeenCommands::new(&settings.state_dir.join("commands-seen")),
        executors: cfg.executors.root(),
        config: cfg,
        policy,
        platform_key,
        runtime,
        pool: pool.clone(),
        launcher,
        max_concurrent: settings.max_concurrent,
        running: Default::default(),
        packages: platform.as_ref().map(|p| p.packages()),
        trust,
        install_failures,
    };
    pipeline.prewarm_pool();
    let served = agent::daemon::serve(pipeline, &settings.socket, platform).map_err(|e| CannotRun(e.0));
    // Pooled sandboxes die with the agent, their cgroups removed.
    if let Some(p) = pool {
        p.shutdown();
    }
    // After the drain no run of this agent holds the host table.
    agent::egress::release_host_table_at_shutdown();
    served?;
    Ok(ExitCode::SUCCESS)
}

fn submit(signed: &std::path::Path, socket: Option<PathBuf>, config: Option<PathBuf>) -> Result<ExitCode, CannotRun> {
    let socket = match socket {
        Some(s) => s,
        None => agent::config::Config::load(config.as_deref())?
            .agent
            .socket
            .unwrap_or_else(|| agent::daemon::DEFAULT_SOCKET.into()),
    };
    let command = read_input(signed)?;
    if command.iter().all(u8::is_ascii_whitespace) {
        // The agent takes a connection that sends nothing for a liveness probe and answers
        // nothing; say what is wrong instead of "closed without a reply".
        return Err(CannotRun(format!("{}: the command is empty", signed.display())));
    }
    let reply = agent::daemon::submit(&socket, &command).map_err(|e| CannotRun(e.0))?;
    outln!("{reply}");
    // A command whose result was lost with the agent answers its run's status, `completed`
    // perhaps, without the result: not a success for whoever wanted the result (exit 1).
    let result_lost = reply["reason"] == "result_lost";
    Ok(if reply["status"] == "completed" && !result_lost { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

#[allow(clippy::too_many_arguments)]
fn bench(
    rounds: usize,
    warmup: usize,
    only: Option<Vec<String>>,
    threads: Option<usize>,
    duration: f64,
    timings_only: bool,
    json: Option<PathBuf>,
    svg: Option<PathBuf>,
) -> Result<ExitCode, CannotRun> {
    use agent::bench::{self, BenchError};
    if !(duration.is_finite() && duration > 0.0 && duration <= 3600.0) {
        return Err(CannotRun("--duration: must be more than 0 and at most 3600 seconds".into()));
    }
    // Where the report goes is checked before anything is measured.
    for (flag, path) in [("--json", &json), ("--svg", &svg)] {
        if let Some(path) = path {
            report_destination(flag, path)?;
        }
    }
    let opts = bench::Options {
        rounds,
        warmup,
        only,
        threads: threads.unwrap_or(agent::daemon::DEFAULT_MAX_CONCURRENT),
        duration: std::time::Duration::from_secs_f64(duration),
        timings_only,
    };
    let report = bench::run(&opts, &mut |line| {
        // Progress only: a failing stdout is reported by the table printed next.
        let _ = agent::stdout::print(&format!("{line}\n"));
    });
    // Also when it failed or was stopped part-way: no sandbox cgroup outlives the bench.
    sandbox::parent::await_background_teardown(std::time::Duration::from_secs(30));
    let report = match report {
        Ok(r) => r,
        Err(BenchError::Usage(m)) => return Err(CannotRun(m)),
        Err(BenchError::Failed(m)) => {
            errln!("opservant: bench: {m}");
            return Ok(ExitCode::from(1));
        }
        // Ran but did not complete: 1, as the command line's contract has it (DESIGN.md §5).
        Err(e @ BenchError::Interrupted(_)) => {
            errln!("opservant: bench: {e}");
            return Ok(ExitCode::from(1));
        }
    };
    out!("{}", bench::render_table(&report));
    if let Some(path) = &json {
        let text = serde_json::to_string_pretty(&report)? + "\n";
        agent::whole_file::replace(path, text.as_bytes(), 0o644)
            .map_err(|e| CannotRun(format!("--json {}: {e}", path.display())))?;
        outln!("wrote {}", path.display());
    }
    if let Some(path) = &svg {
        bench::render_svg(&report, path).map_err(|e| CannotRun(e.to_string()))?;
        outln!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// A file a report can be written to: a regular file or none yet, in a directory that is
/// there (a FIFO would block the write, a device swallow it).
fn report_destination(flag: &str, path: &std::path::Path) -> Result<(), CannotRun> {
    let fail = |why: String| Err(CannotRun(format!("{flag} {}: {why}", path.display())));
    // Checked before the measuring, to save a wasted run; the write itself replaces
    // whatever is there then, never following or opening it (`whole_file::replace`).
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() => return Ok(()),
        Ok(m) if m.is_symlink() => return fail("a symbolic link (not followed)".into()),
        Ok(_) => return fail("not a regular file".into()),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return fail(e.to_string()),
        Err(_) => {}
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => fail(format!("{} is not a directory", dir.display())),
        Err(e) => fail(format!("{}: {e}", dir.display())),
    }
}

fn keygen(out: &std::path::Path) -> Result<ExitCode, CannotRun> {
    let (key, public) = agent::signing::keygen(out).map_err(|e| CannotRun(e.to_string()))?;
    outln!("{}\n{}", key.display(), public.display());
    Ok(ExitCode::SUCCESS)
}

fn sign_command(key: &std::path::Path, command: &std::path::Path) -> Result<ExitCode, CannotRun> {
    use agent::signing;
    let key = signing::load_signing_key(key).map_err(|e| CannotRun(e.to_string()))?;
    let mut cmd =
        signing::parse_command(&read_input(command)?).map_err(|e| CannotRun(format!("{}: {e}", command.display())))?;
    signing::sign(&mut cmd, &key, signing::now()).map_err(|e| CannotRun(e.to_string()))?;
    let text =
        serde_json_canonicalizer::to_string(&serde_json::Value::Object(cmd)).map_err(|e| CannotRun(e.to_string()))?;
    outln!("{text}");
    Ok(ExitCode::SUCCESS)
}

fn sign_package(
    key_path: &std::path::Path,
    package: &std::path::Path,
    out: Option<PathBuf>,
) -> Result<ExitCode, CannotRun> {
    use agent::package_signing;
    let key = agent::signing::load_signing_key(key_path).map_err(|e| CannotRun(e.to_string()))?;
    let meta = std::fs::metadata(package).map_err(|e| CannotRun(format!("{}: {e}", package.display())))?;
    if meta.is_dir() {
        return Err(CannotRun(format!(
            "{}: a directory cannot be signed; pack it first (tar czf PKG.tar.gz -C PARENT DIR) and sign the archive",
            package.display()
        )));
    }
    agent::executor_install::ArchiveKind::from_name(package).map_err(|e| CannotRun(e.to_string()))?;
    let sig = package_signing::sign_file(package, &key).map_err(CannotRun)?;
    let explicit = out.is_some();
    let out = out.unwrap_or_else(|| package_signing::sig_path(package));
    check_signature_out(&out, explicit, &[("the package", package), ("the signing key", key_path)])?;
    // Written beside, then renamed over: never a half-written signature file, and the
    // rename on the disk before success is reported.
    agent::whole_file::replace(&out, format!("{}\n", package_signing::encode(&sig)).as_bytes(), 0o644)
        .map_err(|e| CannotRun(format!("{}: {e}", out.display())))?;
    outln!("{}", out.display());
    Ok(ExitCode::SUCCESS)
}

/// Where `sign --package` may write: a new file, or one that holds a previous signature (a
/// regular file of short base64 text; for the default `PKG.sig`, `explicit` false, any
/// short text that is not a PEM key — the signature there may be a bad one). Never the
/// package or the key themselves (by inode, so a hard link or symlink to them is refused
/// too), nor anything else that exists.
fn check_signature_out(
    out: &std::path::Path,
    explicit: bool,
    protected: &[(&str, &std::path::Path)],
) -> Result<(), CannotRun> {
    use std::os::unix::fs::MetadataExt;
    let refuse = |why: String| CannotRun(format!("--out {}: {why}; refusing to overwrite it", out.display()));
    let target = match std::fs::metadata(out) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(refuse(e.to_string())),
    };
    if let Some(target) = &target {
        for (what, path) in protected {
            if std::fs::metadata(path).is_ok_and(|m| m.dev() == target.dev() && m.ino() == target.ino()) {
                return Err(refuse(format!("it is {what} ({})", path.display())));
            }
        }
    }
    let meta = match std::fs::symlink_metadata(out) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(refuse(e.to_string())),
    };
    if !meta.file_type().is_file() {
        return Err(refuse("exists and is not a regular file".into()));
    }
    let text = agent::package_signing::read_signature_file(out).ok();
    let previous = if explicit {
        text.is_some_and(|t| agent::package_signing::decode(&t).is_ok())
    } else {
        // `PKG.sig` beside the package may hold a bad signature (re-signing is how it is
        // fixed): replaced when it is small text that is not a PEM key.
        text.is_some_and(|t| !t.contains("-----BEGIN"))
    };
    if !previous {
        return Err(refuse("exists and does not hold a signature".into()));
    }
    Ok(())
}

fn verify_package(
    public: &std::path::Path,
    package: &std::path::Path,
    signature: Option<&std::path::Path>,
    json: bool,
) -> Result<ExitCode, CannotRun> {
    use agent::package_signing::{self, Trust, TrustedKey, Verdict};
    let key = agent::signing::load_verifying_key(public).map_err(|e| CannotRun(e.to_string()))?;
    if key.is_weak() {
        return Err(CannotRun(format!("{}: a small-order (weak) key is refused", public.display())));
    }
    let trust = Trust { required: true, keys: vec![TrustedKey { label: public.display().to_string(), key }] };
    let sig_file = signature.map_or_else(|| package_signing::sig_path(package), std::path::Path::to_path_buf);
    if !std::fs::metadata(package).map_err(|e| CannotRun(format!("{}: {e}", package.display())))?.is_file() {
        return Err(CannotRun(format!("{}: not a file (only archives are signed)", package.display())));
    }
    let text = match std::fs::symlink_metadata(&sig_file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        _ => Some(package_signing::read_signature_file(&sig_file).map_err(CannotRun)?),
    };
    let (sha, verdict) =
        package_signing::check_file(package, text.as_deref(), &trust, package_signing::MAX_ARCHIVE_BYTES)
            .map_err(CannotRun)?;
    let detail = match &verdict {
        Verdict::Valid(_) => String::new(),
        Verdict::Missing => format!("no signature file {}", sig_file.display()),
        Verdict::Bad(why) => why.clone(),
    };
    if json {
        outln!(
            "{}",
            serde_json::json!({
                "valid": matches!(verdict, Verdict::Valid(_)),
                "signature": verdict.as_str(),
                "detail": detail,
                "sha256": sha,
                "signature_file": sig_file,
            })
        );
    } else {
        match &verdict {
            Verdict::Valid(_) => outln!("signature: valid ({})", sig_file.display()),
            Verdict::Missing => outln!("signature: MISSING ({detail})"),
            Verdict::Bad(_) => outln!("signature: INVALID ({detail})"),
        }
        outln!("sha256: {sha}");
    }
    Ok(if matches!(verdict, Verdict::Valid(_)) { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn verify_command(public: &std::path::Path, signed: &std::path::Path, json: bool) -> Result<ExitCode, CannotRun> {
    use agent::signing;
    let key = signing::load_verifying_key(public).map_err(|e| CannotRun(e.to_string()))?;
    let cmd =
        signing::parse_command(&read_input(signed)?).map_err(|e| CannotRun(format!("{}: {e}", signed.display())))?;
    let v = signing::verify(&cmd, &key, signing::now()).map_err(|e| CannotRun(e.to_string()))?;
    if json {
        outln!(
            "{}",
            serde_json::json!({
                "valid": v.valid(),
                "signature": match &v.signature { Ok(()) => "valid".to_string(), Err(e) => e.clone() },
                "timestamp": match &v.timestamp { Ok(_) => "within window".to_string(), Err(e) => e.clone() },
                "skew_seconds": v.timestamp.as_ref().ok(),
            })
        );
    } else {
        match &v.signature {
            Ok(()) => outln!("signature: valid"),
            Err(e) => outln!("signature: INVALID ({e})"),
        }
        match &v.timestamp {
            Ok(skew) => outln!("timestamp: within {}s of this clock (skew {skew:+}s)", signing::MAX_SKEW_S),
            Err(e) => outln!("timestamp: REJECTED ({e})"),
        }
    }
    Ok(if v.valid() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn load_manifest(path: &std::path::Path) -> Result<agent::manifest::Manifest, CannotRun> {
    let (m, warnings) = agent::manifest::Manifest::load(path)?;
    for w in warnings {
        tracing::warn!(manifest = %path.display(), "{w}");
    }
    Ok(m)
}

fn run_script(
    language: agent::script_run::Language,
    file: PathBuf,
    timeout: Option<u64>,
    manifest: Option<PathBuf>,
    config: Option<PathBuf>,
) -> Result<ExitCode, CannotRun> {
    let config = agent::config::Config::load(config.as_deref())?;
    let policy = AgentPolicy::from_config(&config)?;
    let manifest = manifest.as_deref().map(load_manifest).transpose()?;
    agent::audit::init(&config)?;
    let result = agent::script_run::run(agent::script_run::ScriptRequest {
        language,
        file: &file,
        timeout_s: timeout,
        manifest: manifest.as_ref(),
        policy: &policy,
        launcher: sandbox::Launcher::fork_or_reexec(SANDBOX_INIT),
        runtime: agent::executor_run::runtime_binary().map_err(|e| CannotRun(e.0))?,
    })
    .map_err(|e| CannotRun(e.0))?;
    outln!("{}", serde_json::to_string(&result)?);
    Ok(if result.success { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// `ARG` or, for `@FILE`, the file's text — read no further than a session accepts.
fn inline_or_file(flag: &str, arg: &str) -> Result<String, CannotRun> {
    let Some(path) = arg.strip_prefix('@') else { return Ok(arg.to_string()) };
    let bytes = read_bounded(flag, path, agent::session::MAX_REQUEST, "a session request may take")?;
    String::from_utf8(bytes).map_err(|e| CannotRun(format!("{flag} @{path}: not UTF-8 ({e})")))
}

fn session(command: SessionCommand) -> Result<ExitCode, CannotRun> {
    use agent::session;
    match command {
        SessionCommand::Start {
            name,
            allow_import,
            default_import,
            timeout,
            idle_timeout,
            max_lifetime,
            python_path,
            manifest,
            config,
        } => {
            // Check the configuration and manifest here, so bad input fails fast with exit 2.
            let cfg = agent::config::Config::load(config.as_deref())?;
            let policy = AgentPolicy::from_config(&cfg)?;
            // The daemon appends to the log; an unwritable one fails here, with exit 2.
            agent::audit::init(&cfg)?;
            if let Some(m) = &manifest {
                let m = load_manifest(m)?;
                agent::policy::refuse_unmet(Some(&m), "a session", true)?;
                policy.spec_for(Some(&m), "/bin/true", vec![])?;
            }
            agent::executor_run::runtime_binary().map_err(|e| CannotRun(e.0))?;
            let settings = session::Settings::new(
                &name,
                &allow_import,
                &default_import,
                timeout,
                idle_timeout,
                max_lifetime,
                &python_path,
                manifest,
                config,
            )
            .map_err(|e| CannotRun(e.0))?;
            let exe = std::env::current_exe()?;
            let reply = session::start(&settings, &exe, "__session-serve").map_err(|e| CannotRun(e.0))?;
            outln!("{reply}");
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::Exec { name, code, globals, return_names, timeout } => {
            let code = inline_or_file("--code", &code)?;
            let globals: serde_json::Value = match globals {
                Some(g) => parse_json_arg("--globals", inline_or_file("--globals", &g)?.as_bytes())?,
                None => serde_json::json!({}),
            };
            if !globals.is_object() {
                return Err(CannotRun("--globals: must be a JSON object".into()));
            }
            let names: Vec<String> = return_names
                .iter()
                .flat_map(|r| r.split(','))
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .collect();
            if timeout == Some(0) {
                return Err(CannotRun("--timeout: must be at least 1 second".into()));
            }
            let req = serde_json::json!({"op": "exec", "code": code, "globals": globals, "return": names, "timeout_s": timeout});
            let wait = std::time::Duration::from_secs(session::MAX_CALL_TIMEOUT_S + 60);
            let reply = session::request(&name, &req, wait).map_err(|e| CannotRun(e.0))?;
            outln!("{reply}");
            Ok(if reply["success"] == serde_json::Value::Bool(true) { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        SessionCommand::Stop { name } => {
            let reply = session::request(&name, &serde_json::json!({"op": "stop"}), std::time::Duration::from_secs(30))
                .map_err(|e| CannotRun(e.0))?;
            outln!("{reply}");
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::List => {
            outln!("{}", session::list().map_err(|e| CannotRun(e.0))?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn executor_install(
    package: &std::path::Path,
    signature: Option<&std::path::Path>,
    opts: agent::executor_install::InstallOptions,
    json: bool,
    config: Option<PathBuf>,
) -> Result<ExitCode, CannotRun> {
    use agent::executor_install as ei;
    // A stop signal stops the install before its change, removing what it staged (and its
    // pip, and the sandbox precompiling it); the exit status is then 128 + the signal.
    stop_sandboxes_on_signals()?;
    let mut opts = opts;
    // pip runs in `/`: a relative `--find-links` is made absolute here, where the operator
    // typed it (pip would look under `/`, or only warn that the path is ignored).
    for dir in &mut opts.find_links {
        if !dir.is_dir() {
            return Err(CannotRun(format!("--find-links {}: not a directory", dir.display())));
        }
        *dir = std::path::absolute(&*dir).map_err(|e| CannotRun(format!("--find-links {}: {e}", dir.display())))?;
    }
    // Checked whether or not the package needs it: a mistyped one is an error now, not at
    // the install of a package that has requirements.
    if let Some(url) = &opts.index_url {
        let rest = ["https://", "http://", "file://"].iter().find_map(|s| url.strip_prefix(s));
        if rest.is_none_or(str::is_empty) || url.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(CannotRun(format!(
                "--index-url {}: not an https://, http:// or file:// URL",
                one_terminal_line(url)
            )));
        }
    }
    let config = agent::config::Config::load(config.as_deref())?;
    let policy = AgentPolicy::from_config(&config)?;
    let trust = agent::package_signing::Trust::from_config(&config).map_err(CannotRun)?;
    agent::audit::init(&config)?;
    let root = config.executors.root();
    let package_text = package.to_string_lossy();
    let installed = ei::signature_for(package, signature).and_then(|signature| {
        let check = ei::PackageCheck {
            trust: &trust,
            signature,
            sha256: None,
            source: "cli",
            command_id: None,
            kind: None,
            max_bytes: config.executors.max_package_bytes(),
            label: None,
        };
        ei::install(package, &root, &policy, &opts, &check)
    });
    let installed = match installed {
        Ok(i) => i,
        Err(e) => {
            let error = e.to_string();
            agent::audit::record(
                "executor_install_failed",
                &[("source", "cli"), ("package", &package_text), ("reason", e.reason()), ("error", &error)],
            );
            // Named once: an archive's errors name it already.
            let named = format!("{}: ", package.display());
            return Err(CannotRun(if error.starts_with(&named) { error } else { named + &error }));
        }
    };
    agent::audit::record(
        "executor_installed",
        &[
            ("executor", &installed.name),
            ("version", &installed.version),
            ("source", "cli"),
            ("package", &package_text),
            ("signed_by", installed.signed_by.as_deref().unwrap_or("")),
        ],
    );
    if json {
        outln!("{}", serde_json::to_string(&installed)?);
    } else {
        // Warnings name the package's files: control characters escaped, never raw.
        for w in &installed.warnings {
            errln!("opservant: warning: {}", one_terminal_line(w));
        }
        outln!("installed {} {} in {}", installed.name, installed.version, installed.path.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn executor_list(json: bool, config: Option<PathBuf>) -> Result<ExitCode, CannotRun> {
    let config = agent::config::Config::load(config.as_deref())?;
    let list = agent::executor_install::list(&config.executors.root()).map_err(|e| CannotRun(e.to_string()))?;
    if json {
        outln!("{}", serde_json::to_string(&list)?);
    } else {
        for e in &list {
            let fields = [&e.name, &e.version, &e.supported_actions.join(",")].map(|f| one_terminal_line(f));
            outln!("{}", fields.join("\t"));
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn executor_remove(name: &str, config: Option<PathBuf>) -> Result<ExitCode, CannotRun> {
    let config = agent::config::Config::load(config.as_deref())?;
    agent::audit::init(&config)?;
    match agent::executor_install::remove(&config.executors.root(), name, "cli", None)
        .map_err(|e| CannotRun(e.to_string()))?
    {
        true => {
            agent::audit::record("executor_removed", &[("executor", name)]);
            Ok(ExitCode::SUCCESS)
        }
        false => {
            errln!("opservant: {name}: not installed");
            Ok(ExitCode::from(1))
        }
    }
}

fn lint(dir: PathBuf, json: bool, config: Option<PathBuf>) -> Result<ExitCode, CannotRun> {
    let config = agent::config::Config::load(config.as_deref())?;
    let policy = AgentPolicy::from_config(&config)?;
    if !dir.is_dir() {
        return Err(CannotRun(format!("{}: not a directory", dir.display())));
    }
    let report = agent::lint::lint(&dir, &policy)?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        out!("{}", report.render(&dir));
    }
    Ok(if report.errors.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn doctor(json: bool, config: Option<PathBuf>) -> Result<ExitCode, CannotRun> {
    // What the configuration requires decides what is missing (as the daemon's heartbeat
    // reports it): a Landlock floor above the kernel's ABI fails every run.
    // Named, or the default one: it must load (exit 2 naming what is wrong). Only a default
    // one this user may not read (not root) leaves the host described against the defaults.
    let default_unreadable = config.is_none()
        && std::env::var_os(agent::config::PATH_ENV).is_none_or(|p| p.is_empty())
        && std::fs::File::open(agent::config::DEFAULT_PATH)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied);
    let policy = if default_unreadable {
        errln!(
            "opservant: warning: {}: permission denied; checking against the default requirements",
            agent::config::DEFAULT_PATH
        );
        AgentPolicy::from_config(&agent::config::Config::default())?
    } else {
        AgentPolicy::from_config(&agent::config::Config::load(config.as_deref())?)?
    };
    let report = agent::doctor::examine(policy.landlock_min_abi, policy.allow_degraded, policy.host_uids.as_ref());
    if json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        out!("{}", agent::doctor::render(&report));
    }
    Ok(if report.failed() { ExitCode::from(1) } else { ExitCode::SUCCESS })
}
