//! The opservant agent library: manifests, limit and sandbox policy, result reporting and
//! host diagnostics. The isolation engine itself is the `sandbox` crate.

pub mod app;
pub mod audit;
pub mod bench;
pub mod bounded;
pub mod bytecode;
pub mod command;
pub mod config;
pub mod daemon;
pub mod dns;
pub mod doctor;
pub mod egress;
pub mod egress_proxy;
pub mod executor_install;
pub mod executor_run;
pub mod executor_test;
pub mod inflight;
pub mod integrity;
pub mod launch;
pub mod limits;
pub mod lint;
pub mod manifest;
pub mod package_signing;
pub mod platform;
pub mod policy;
mod python_printable;
pub mod random;
pub mod redact;
pub mod replay;
pub mod result;
pub mod rfc3339;
pub mod script_run;
pub mod secrets;
pub mod secrets_cli;
pub mod secrets_store;
pub mod secrets_vault;
pub mod session;
pub mod signing;
pub mod stdout;
pub mod tls;
pub mod warm_pool;
pub mod whole_file;

/// A message as one line that cannot drive a terminal: it often quotes what the user or a
/// package gave (archive member names, manifest values, paths), so newlines become spaces
/// and other control characters are escaped (`\u{1b}`), never written raw.
pub fn one_terminal_line(message: &str) -> String {
    let mut line = String::with_capacity(message.len());
    for c in message.chars() {
        match c {
            '\n' => line.push(' '),
            c if c.is_control() => line.extend(c.escape_unicode()),
            c => line.push(c),
        }
    }
    line
}
