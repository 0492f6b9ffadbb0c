//! `opservant secrets {set|get|list|rm}`: the operator's side of the built-in encrypted store
//! ([`crate::secrets_store`]), at `secrets.store` / `secrets.key_file` of the configuration.
//!
//! Guarantees:
//! - A value never comes from the command line (any user can read argv in /proc): it comes
//!   from `--from-file` (byte for byte), from stdin when that is not a terminal (one trailing
//!   newline dropped, so `echo … |` does what it says), or from a prompt that does not echo,
//!   typed twice. It is held only in buffers that are wiped after use, and written to stdout
//!   (`get`) without passing through a userspace buffer.
//! - `get` does not print a value on a terminal unless `--reveal` is given.
//! - `set` and `rm` hold the store lock from reading to writing, and write atomically.
//! - `set`, `get` and `rm` are audited (`secret_store_set|get|rm`, by name, to the configured
//!   audit log) before they take effect: one whose record cannot be appended changes and
//!   prints nothing.
//! - Exit status: 0 done; 1 no such secret (`get`, `rm`); 2 could not — bad name or value,
//!   unreadable, exposed or altered store, missing or wrong key — as a [`SecretsCliError`],
//!   which the binary prints as one line.

use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Subcommand;
use thiserror::Error;
use zeroize::{Zeroize, Zeroizing};

use crate::audit;
use crate::config::{Config, ConfigError};
use crate::secrets_store::{check_name, check_value, Location, StoreError, MAX_VALUE};

#[derive(Debug, Subcommand)]
pub enum SecretsCommand {
    /// Store or replace a secret. The value comes from --from-file (byte for byte), from stdin
    /// when it is not a terminal (one trailing newline dropped), or from a prompt that does
    /// not echo — never from the command line. Creates the store, and its key file when there
    /// is neither a key nor a store.
    Set {
        name: String,
        /// Read the value from this file.
        #[arg(long, value_name = "FILE")]
        from_file: Option<PathBuf>,
        /// Agent configuration (default $OPSERVANT_CONFIG, else /etc/opservant/config.yaml when
        /// it exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Print a secret's value on stdout exactly as stored. Exit 1 when there is no such
    /// secret.
    Get {
        name: String,
        /// Print it even when stdout is a terminal.
        #[arg(long)]
        reveal: bool,
        /// Agent configuration (default $OPSERVANT_CONFIG, else /etc/opservant/config.yaml when
        /// it exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// List the names in the store, one per line (no value is decrypted).
    List {
        /// A JSON array of names instead.
        #[arg(long)]
        json: bool,
        /// Agent configuration (default $OPSERVANT_CONFIG, else /etc/opservant/config.yaml when
        /// it exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Remove a secret. Exit 1 when there is no such secret.
    Rm {
        name: String,
        /// Agent configuration (default $OPSERVANT_CONFIG, else /etc/opservant/config.yaml when
        /// it exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

/// Why a `secrets` command could not do its work (exit status 2).
#[derive(Debug, Error)]
pub enum SecretsCliError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Audit(#[from] audit::AuditError),
    #[error("{0}")]
    Input(String),
}

fn input(what: &str) -> impl FnOnce(std::io::Error) -> SecretsCliError + '_ {
    move |e| SecretsCliError::Input(format!("{what}: {e}"))
}

/// Standard output's reader went away (a closed pipe): the output is dropped and the
/// command's own exit status stands; any other write error is one.
fn reader_gone(e: std::io::Error) -> Result<(), SecretsCliError> {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Ok(())
    } else {
        Err(SecretsCliError::Input(format!("stdout: {e}")))
    }
}

/// Run one `secrets` command; `Ok` carries the exit status (0, or 1 for "no such secret",
/// already explained on stderr).
pub fn run(cmd: SecretsCommand) -> Result<u8, SecretsCliError> {
    match cmd {
        SecretsCommand::Set { name, from_file, config } => {
            check_name(&name)?;
            let loc = location(config.as_deref(), true)?;
            // Read the value first: a prompt must not hold the store lock.
            let value = read_value(&name, from_file.as_deref())?;
            let _lock = loc.lock()?;
            let (mut store, created_key) = loc.open_or_create()?;
            let replaced = store.set(&name, &value)?;
            // A change that cannot be audited is not made (fail closed, as for `get`).
            let store_path = store.path().display().to_string();
            let replaced = if replaced { "true" } else { "false" };
            if let Err(e) = audit::try_record(
                "secret_store_set",
                &[("secret", &name), ("store", &store_path), ("replaced", replaced)],
            ) {
                // Nothing of the refused change stays: not even a key made for it.
                if let Some(k) = &created_key {
                    let _ = std::fs::remove_file(k);
                }
                return Err(e.into());
            }
            if let Err(e) = store.save() {
                // The record above said a change was to be made: this one says it was not.
                audit::record(
                    "secret_store_failed",
                    &[("secret", &name), ("store", &store_path), ("op", "set"), ("error", &e.to_string())],
                );
                // A key made for a store that was not written goes with it (the next `set`
                // makes one and says so); one whose store was put in place (a failure after
                // the rename) is the store's key now, and announced.
                if let Some(k) = &created_key {
                    if std::fs::symlink_metadata(&store_path).is_ok() {
                        crate::stdout::eprint(&format!(
                            "opservant: created the store key {} (mode 0600); keep a copy somewhere safe: without it the store cannot be read\n",
                            k.display()
                        ));
                    } else {
                        let _ = std::fs::remove_file(k);
                    }
                }
                return Err(e.into());
            }
            if let Some(k) = created_key {
                crate::stdout::eprint(&format!(
                    "opservant: created the store key {} (mode 0600); keep a copy somewhere safe: without it the store cannot be read\n",
                    k.display()
                ));
            }
            Ok(0)
        }
        SecretsCommand::Get { name, reveal, config } => {
            check_name(&name)?;
            let loc = location(config.as_deref(), true)?;
            let terminal = std::io::stdout().is_terminal();
            if terminal && !reveal {
                return Err(SecretsCliError::Input(format!(
                    "stdout is a terminal: pass --reveal to show the value of '{name}', or redirect it"
                )));
            }
            let Some(store) = loc.open_existing()? else { return Ok(not_found(&name, &loc.store)) };
            let Some(value) = store.get(&name)? else { return Ok(not_found(&name, &loc.store)) };
            // A read that cannot be audited is refused (fail closed).
            audit::try_record(
                "secret_store_get",
                &[("secret", &name), ("store", &store.path().display().to_string())],
            )?;
            // Straight to the descriptor: std's stdout buffer would keep a copy.
            let mut out = File::from(std::io::stdout().as_fd().try_clone_to_owned().map_err(input("stdout"))?);
            // A reader that went away only drops the output (as for every command).
            let newline = if terminal && !value.ends_with('\n') { &b"\n"[..] } else { b"" };
            out.write_all(value.as_bytes()).and_then(|()| out.write_all(newline)).or_else(reader_gone)?;
            Ok(0)
        }
        SecretsCommand::List { json, config } => {
            let loc = location(config.as_deref(), false)?;
            let store = loc.open_existing()?;
            let names: Vec<&str> = store.iter().flat_map(|s| s.names()).collect();
            let text = if json {
                format!("{}\n", serde_json::Value::from(names))
            } else {
                names.iter().map(|n| format!("{n}\n")).collect()
            };
            std::io::stdout().write_all(text.as_bytes()).or_else(reader_gone)?;
            Ok(0)
        }
        SecretsCommand::Rm { name, config } => {
            check_name(&name)?;
            let loc = location(config.as_deref(), true)?;
            let _lock = loc.lock()?;
            let Some(mut store) = loc.open_existing()? else { return Ok(not_found(&name, &loc.store)) };
            if !store.remove(&name) {
                return Ok(not_found(&name, &loc.store));
            }
            let store_path = store.path().display().to_string();
            audit::try_record("secret_store_rm", &[("secret", &name), ("store", &store_path)])?;
            if let Err(e) = store.save() {
                audit::record(
                    "secret_store_failed",
                    &[("secret", &name), ("store", &store_path), ("op", "rm"), ("error", &e.to_string())],
                );
                return Err(e.into());
            }
            Ok(0)
        }
    }
}

/// The store's location; with `audited`, the audit log is opened too (set, get and rm are
/// audited there; `list` shows no value).
fn location(config: Option<&Path>, audited: bool) -> Result<Location, SecretsCliError> {
    let config = Config::load(config)?;
    if audited {
        audit::init(&config)?;
    }
    Ok(Location::from_config(&config.secrets))
}

fn not_found(name: &str, store: &Path) -> u8 {
    crate::stdout::eprint(&format!(
        "opservant: {}\n",
        StoreError::NotFound { name: name.to_string(), path: store.to_path_buf() }
    ));
    1
}

/// At most `MAX_VALUE + 1` bytes, into a buffer allocated once (so no reallocation leaves an
/// unwiped copy behind).
fn read_limited(r: impl Read, what: &str) -> Result<Zeroizing<Vec<u8>>, SecretsCliError> {
    let mut buf = Zeroizing::new(Vec::with_capacity(MAX_VALUE + 1));
    r.take(MAX_VALUE as u64 + 1).read_to_end(&mut buf).map_err(input(what))?;
    Ok(buf)
}

/// The value to store, checked (non-empty UTF-8, at most `MAX_VALUE` bytes).
fn read_value(name: &str, from_file: Option<&Path>) -> Result<Zeroizing<String>, SecretsCliError> {
    let mut bytes = match from_file {
        Some(path) => {
            // A regular file only: a FIFO would block the command, a device act when opened.
            let f = crate::bounded::open_regular(path)
                .map_err(|e| SecretsCliError::Input(format!("--from-file {}: {e}", path.display())))?;
            read_limited(f, &format!("--from-file {}", path.display()))?
        }
        None => {
            // A descriptor of our own: std's stdin buffer would keep a copy.
            let stdin = File::from(std::io::stdin().as_fd().try_clone_to_owned().map_err(input("stdin"))?);
            if stdin.is_terminal() {
                prompt(&stdin, name)?
            } else {
                let mut b = read_limited(stdin, "stdin")?;
                if b.last() == Some(&b'\n') {
                    b.pop();
                    if b.last() == Some(&b'\r') {
                        b.pop();
                    }
                }
                b
            }
        }
    };
    check_value(&bytes)?;
    match String::from_utf8(std::mem::take(&mut *bytes)) {
        Ok(s) => Ok(Zeroizing::new(s)),
        Err(e) => {
            e.into_bytes().zeroize();
            Err(StoreError::BadValue("not UTF-8 text".into()).into())
        }
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Ask for the value twice on the terminal, without echo. Ctrl-C (or SIGTERM, SIGQUIT) ends
/// the prompt with the terminal restored.
fn prompt(tty: &File, name: &str) -> Result<Zeroizing<Vec<u8>>, SecretsCliError> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    use nix::sys::termios::{tcgetattr, tcsetattr, LocalFlags, SetArg};

    let term_err = |e: nix::Error| SecretsCliError::Input(format!("terminal: {e}"));
    let saved = tcgetattr(tty).map_err(term_err)?;
    let mut quiet = saved.clone();
    quiet.local_flags.remove(LocalFlags::ECHO);
    quiet.local_flags.insert(LocalFlags::ECHONL);
    INTERRUPTED.store(false, Ordering::SeqCst);
    // No SA_RESTART: a signal makes the blocked read return EINTR, and the prompt ends.
    let action = SigAction::new(SigHandler::Handler(note_signal), SaFlags::empty(), SigSet::empty());
    let mut previous = Vec::new();
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGQUIT] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe); the previous
        // disposition is put back below before this function returns.
        let old = unsafe { sigaction(sig, &action) }.map_err(term_err)?;
        previous.push((sig, old));
    }
    let result = tcsetattr(tty, SetArg::TCSAFLUSH, &quiet).map_err(term_err).and_then(|()| {
        let first = read_line(tty, &format!("Value for {name}: "))?;
        let second = read_line(tty, "Again, to confirm: ")?;
        if *first != *second {
            return Err(SecretsCliError::Input("the two values differ; nothing was stored".into()));
        }
        Ok(first)
    });
    let restored = tcsetattr(tty, SetArg::TCSANOW, &saved);
    for (sig, old) in previous {
        // SAFETY: reinstates the disposition that was in place before this function.
        let _ = unsafe { sigaction(sig, &old) };
    }
    if INTERRUPTED.load(Ordering::SeqCst) {
        crate::stdout::eprint("\n");
    }
    restored.map_err(term_err)?;
    result
}

/// One line from the terminal, without its newline.
fn read_line(mut tty: &File, label: &str) -> Result<Zeroizing<Vec<u8>>, SecretsCliError> {
    crate::stdout::eprint(label);
    let mut line = Zeroizing::new(Vec::with_capacity(MAX_VALUE + 1));
    let mut byte = Zeroizing::new([0u8; 1]);
    loop {
        match tty.read(&mut byte[..]) {
            Ok(0) => return Err(SecretsCliError::Input("no value given (end of input)".into())),
            Ok(_) if byte[0] == b'\n' => return Ok(line),
            Ok(_) if line.len() > MAX_VALUE => {
                return Err(StoreError::BadValue(format!("longer than {MAX_VALUE} bytes")).into())
            }
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                if INTERRUPTED.load(Ordering::SeqCst) {
                    return Err(SecretsCliError::Input("interrupted; nothing was stored".into()));
                }
            }
            Err(e) => return Err(SecretsCliError::Input(format!("terminal: {e}"))),
        }
    }
}
