//! The built-in encrypted secrets store end to end: `opservant secrets set|get|list|rm` with a
//! store and key in a test directory (never /etc), the key rules (root-only file, systemd
//! credential), wrong keys and altered stores (exit 2, store left unchanged), the terminal
//! behaviour (no-echo prompt, `get` refusing a terminal without `--reveal`), and an executor
//! run with `secrets.provider: builtin` — a declared secret delivered through
//! `context["vault"].get_secret` and redacted, an undeclared one refused, and common
//! credential patterns redacted from the result and the log.

mod common;

use common::sha256_hex;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{require_root, HostDir};
use serde_json::{json, Value};

/// One `opservant` invocation.
#[derive(Debug)]
struct Out {
    code: i32,
    stdout: Vec<u8>,
    stderr: String,
}

impl Out {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    fn ok(&self) -> &Self {
        assert_eq!(self.code, 0, "{self:?}");
        self
    }

    /// Exit 2, nothing on stdout, one line on stderr naming every needle.
    fn cannot(&self, needles: &[&str]) {
        assert_eq!(self.code, 2, "{self:?}");
        assert!(self.stdout.is_empty(), "nothing on stdout: {self:?}");
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line on stderr: {self:?}");
        assert!(lines[0].starts_with("opservant: "), "{self:?}");
        for n in needles {
            assert!(lines[0].contains(n), "stderr should mention {n:?}: {}", lines[0]);
        }
    }

    /// Exit 1: no such secret.
    fn not_found(&self, name: &str) {
        assert_eq!(self.code, 1, "{self:?}");
        assert!(self.stdout.is_empty(), "{self:?}");
        assert!(self.stderr.contains(&format!("secret '{name}' is not in the secrets store")), "{self:?}");
    }
}

fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = common::command();
    c.args(args).env_remove("OPSERVANT_LOG").env_remove("CREDENTIALS_DIRECTORY").envs(env.iter().copied());
    c
}

fn invoke(args: &[&str], stdin: Option<&[u8]>, env: &[(&str, &str)]) -> Out {
    let _view = common::host_view();
    let mut child = command(args, env)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn opservant");
    if let Some(data) = stdin {
        let mut s = child.stdin.take().expect("stdin");
        // The command may refuse (and exit) before reading it all.
        let _ = s.write_all(data);
    }
    let out = child.wait_with_output().expect("wait opservant");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A configuration whose store and key live in their own test directory.
struct Setup {
    dir: HostDir,
    config: PathBuf,
}

impl Setup {
    fn new(extra_yaml: &str) -> Setup {
        let dir = HostDir::new();
        let config = dir.path.join("config.yaml");
        let text = format!(
            "{extra_yaml}secrets:\n  provider: builtin\n  store: {}\n  key_file: {}\naudit:\n  path: {}\n  journald: false\n",
            dir.path.join("secrets.enc").display(),
            dir.path.join("secrets.key").display(),
            dir.path.join("audit/audit.jsonl").display()
        );
        std::fs::write(&config, text).expect("write config");
        Setup { dir, config }
    }

    fn store(&self) -> PathBuf {
        self.dir.path.join("secrets.enc")
    }

    fn key(&self) -> PathBuf {
        self.dir.path.join("secrets.key")
    }

    /// The audit log's records (events and fields).
    fn audit(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(self.dir.path.join("audit/audit.jsonl")).unwrap_or_default();
        text.lines().map(|l| serde_json::from_str(l).expect("audit record")).collect()
    }

    fn cfg(&self) -> &str {
        self.config.to_str().expect("utf-8")
    }

    fn secrets(&self, args: &[&str], stdin: Option<&[u8]>) -> Out {
        self.secrets_env(args, stdin, &[])
    }

    fn secrets_env(&self, args: &[&str], stdin: Option<&[u8]>, env: &[(&str, &str)]) -> Out {
        let mut all = vec!["secrets"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--config", self.cfg()]);
        invoke(&all, stdin, env)
    }

    fn set(&self, name: &str, value: &str) {
        self.secrets(&["set", name], Some(value.as_bytes())).ok();
    }

    fn get(&self, name: &str) -> String {
        let out = self.secrets(&["get", name], None);
        out.ok();
        out.stdout()
    }
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).expect("stat").permissions().mode() & 0o7777
}

fn dir_names(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into())
        .collect();
    v.sort();
    v
}

fn unique(tag: &str) -> String {
    format!("{tag}-{}-Zq9", std::process::id())
}

#[test]
fn set_get_list_rm_round_trip() {
    if !require_root() {
        return;
    }
    let s = Setup::new("");
    // Nothing yet: an empty list, no such secret, no key needed.
    assert_eq!(s.secrets(&["list"], None).ok().stdout(), "");
    s.secrets(&["get", "api_key"], None).not_found("api_key");
    s.secrets(&["rm", "api_key"], None).not_found("api_key");
    assert!(!s.key().exists() && !s.store().exists());

    // The first `set` creates the key (and says so) and the store, both mode 0600.
    let v1 = unique("value-one");
    let out = s.secrets(&["set", "api_key"], Some(format!("{v1}\n").as_bytes()));
    out.ok();
    assert!(out.stderr.contains("created the store key") && out.stderr.contains("secrets.key"), "{out:?}");
    assert!(!out.stderr.contains(&v1), "{out:?}");
    assert_eq!(mode(&s.key()), 0o600);
    assert_eq!(mode(&s.store()), 0o600);
    assert_eq!(std::fs::read_to_string(s.key()).unwrap().trim().len(), 64, "64 hex digits");
    // stdin: one trailing newline dropped.
    assert_eq!(s.get("api_key"), v1);

    // --from-file: byte for byte, trailing newline and all.
    let pem = format!("-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n", unique("MIIB"));
    let f = s.dir.file("cert.pem", &pem, 0o600);
    let out = s.secrets(&["set", "tls/cert.pem", "--from-file", f.to_str().unwrap()], None);
    out.ok();
    assert!(!out.stderr.contains("created the store key"), "the key exists now: {out:?}");
    assert_eq!(s.get("tls/cert.pem"), pem);

    // Replace a value.
    let v2 = unique("value-two");
    s.set("api_key", &v2);
    assert_eq!(s.get("api_key"), v2);

    assert_eq!(s.secrets(&["list"], None).ok().stdout(), "api_key\ntls/cert.pem\n");
    let listed: Value = serde_json::from_slice(&s.secrets(&["list", "--json"], None).ok().stdout).unwrap();
    assert_eq!(listed, json!(["api_key", "tls/cert.pem"]));

    // Values are never in the file in the clear.
    let raw = std::fs::read_to_string(s.store()).unwrap();
    assert!(!raw.contains(&v1) && !raw.contains(&v2) && !raw.contains("MIIB"), "{raw}");
    let doc: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!((doc["format"].as_str(), doc["version"].as_u64()), (Some("opservant-secrets"), Some(1)));

    s.secrets(&["rm", "tls/cert.pem"], None).ok();
    s.secrets(&["rm", "tls/cert.pem"], None).not_found("tls/cert.pem");
    s.secrets(&["get", "tls/cert.pem"], None).not_found("tls/cert.pem");
    assert_eq!(s.secrets(&["list"], None).ok().stdout(), "api_key\n");
    assert_eq!(s.get("api_key"), v2);
    // No temporary files left behind.
    assert_eq!(dir_names(&s.dir.path), ["audit", "cert.pem", "config.yaml", "secrets.enc", "secrets.key"]);
    // Audited by name, never by value.
    let events: Vec<(String, String)> = s
        .audit()
        .iter()
        .map(|r| (r["event"].as_str().unwrap_or("").into(), r["fields"]["secret"].as_str().unwrap_or("").into()))
        .collect();
    for (event, name) in [
        ("secret_store_set", "api_key"),
        ("secret_store_get", "api_key"),
        ("secret_store_set", "tls/cert.pem"),
        ("secret_store_rm", "tls/cert.pem"),
    ] {
        assert!(events.contains(&(event.to_string(), name.to_string())), "{event} {name}: {events:?}");
    }
    let log = std::fs::read_to_string(s.dir.path.join("audit/audit.jsonl")).unwrap();
    assert!(!log.contains(&v1) && !log.contains(&v2) && !log.contains("MIIB"), "{log}");

    // Bad input: exit 2, nothing changed.
    let before = std::fs::read(s.store()).unwrap();
    s.secrets(&["set", "bad name"], Some(b"x")).cannot(&["invalid secret name"]);
    s.secrets(&["set", "empty"], Some(b"\n")).cannot(&["secret value: empty"]);
    s.secrets(&["set", "binary"], Some(&[0xff, 0xfe, 0x00])).cannot(&["not UTF-8"]);
    s.secrets(&["set", "big"], Some(&vec![b'a'; 64 * 1024 + 1])).cannot(&["longer than 65536 bytes"]);
    s.secrets(&["set", "nofile", "--from-file", "/nonexistent/value"], None).cannot(&["--from-file", "/nonexistent"]);
    // A FIFO (which blocked the command for ever) and a device: refused at once.
    let fifo = std::env::temp_dir().join(format!("opservant-secrets-fifo-{}", std::process::id()));
    let _ = std::fs::remove_file(&fifo);
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    s.secrets(&["set", "fifo", "--from-file", fifo.to_str().unwrap()], None)
        .cannot(&["--from-file", "not a regular file"]);
    std::fs::remove_file(&fifo).unwrap();
    s.secrets(&["set", "dev", "--from-file", "/dev/zero"], None).cannot(&["--from-file", "not a regular file"]);
    s.secrets(&["get", "a/../b c"], None).cannot(&["invalid secret name"]);
    assert_eq!(std::fs::read(s.store()).unwrap(), before);
    // A value on the command line is not even accepted.
    let out = invoke(&["secrets", "set", "api_key", "the-value", "--config", s.cfg()], None, &[]);
    assert_eq!(out.code, 2, "{out:?}");

    // A change that cannot be audited is not made (its last lines not records, the log
    // refuses appends): set and rm fail (exit 2) and the store is unchanged.
    let mut f = std::fs::OpenOptions::new().append(true).open(s.dir.path.join("audit/audit.jsonl")).unwrap();
    std::io::Write::write_all(&mut f, b"garbage\nmore garbage\n").unwrap();
    drop(f);
    let before = std::fs::read(s.store()).unwrap();
    let out = s.secrets(&["set", "new_one"], Some(b"value"));
    assert_eq!(out.code, 2, "{out:?}");
    let out = s.secrets(&["rm", "api_key"], None);
    assert_eq!(out.code, 2, "{out:?}");
    assert_eq!(std::fs::read(s.store()).unwrap(), before, "changed without an audit record");
}

#[test]
fn exposed_key_or_store_is_refused() {
    if !require_root() {
        return;
    }
    let s = Setup::new("");
    s.set("api_key", &unique("v"));
    std::fs::set_permissions(s.key(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let key = s.key().display().to_string();
    s.secrets(&["get", "api_key"], None).cannot(&["secrets key", &key, "mode 0600 or stricter", "0644"]);
    s.secrets(&["list"], None).cannot(&["mode 0600 or stricter"]);
    s.secrets(&["set", "other"], Some(b"x")).cannot(&["mode 0600 or stricter"]);
    // Owned by someone else, even with mode 0600.
    std::fs::set_permissions(s.key(), std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(s.key(), Some(65534), None).unwrap();
    s.secrets(&["get", "api_key"], None).cannot(&["owned by root", "uid 65534"]);
    std::os::unix::fs::chown(s.key(), Some(0), None).unwrap();
    // The store itself, too.
    std::fs::set_permissions(s.store(), std::fs::Permissions::from_mode(0o640)).unwrap();
    s.secrets(&["get", "api_key"], None).cannot(&["secrets store", "mode 0600 or stricter"]);
    std::fs::set_permissions(s.store(), std::fs::Permissions::from_mode(0o600)).unwrap();
    s.secrets(&["get", "api_key"], None).ok();
    // A key file that is not a key.
    std::fs::write(s.key(), "not a key\n").unwrap();
    s.secrets(&["get", "api_key"], None).cannot(&["must hold a 256-bit key"]);
}

#[test]
fn wrong_key_and_altered_store_leave_it_unchanged() {
    if !require_root() {
        return;
    }
    let s = Setup::new("");
    let (va, vb) = (unique("alpha"), unique("beta"));
    s.set("a", &va);
    s.set("b", &vb);
    let good_store = std::fs::read(s.store()).unwrap();
    let good_key = std::fs::read(s.key()).unwrap();
    let store = s.store().display().to_string();

    // Another key.
    std::fs::write(s.key(), format!("{}\n", "ab".repeat(32))).unwrap();
    s.secrets(&["get", "a"], None).cannot(&["secrets store", &store, "wrong key"]);
    s.secrets(&["list"], None).cannot(&["wrong key"]);
    s.secrets(&["set", "c"], Some(b"new")).cannot(&["wrong key"]);
    s.secrets(&["rm", "a"], None).cannot(&["wrong key"]);
    assert_eq!(std::fs::read(s.store()).unwrap(), good_store, "a wrong key changes nothing");

    // No key at all while the store exists: refused, and no new key is made.
    std::fs::remove_file(s.key()).unwrap();
    s.secrets(&["set", "c"], Some(b"new")).cannot(&["exists but has no key"]);
    assert!(!s.key().exists(), "a new key would make the store unreadable");
    assert_eq!(std::fs::read(s.store()).unwrap(), good_store);
    std::fs::write(s.key(), &good_key).unwrap();
    std::fs::set_permissions(s.key(), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(s.get("a"), va);

    let doc: Value = serde_json::from_slice(&good_store).unwrap();
    let write_doc = |d: &Value| {
        std::fs::write(s.store(), serde_json::to_vec_pretty(d).unwrap()).unwrap();
        std::fs::read(s.store()).unwrap()
    };
    let check_refused = |altered: &[u8], what: &str| {
        for args in [&["get", "a"][..], &["list"], &["rm", "b"]] {
            s.secrets(args, None).cannot(&["secrets store", &store, "altered"]);
        }
        s.secrets(&["set", "c"], Some(b"new")).cannot(&["altered"]);
        assert_eq!(std::fs::read(s.store()).unwrap(), altered, "{what}: the store is left as it is");
    };

    // One ciphertext character changed.
    let mut flipped = doc.clone();
    let ct = flipped["entries"]["a"]["ct"].as_str().unwrap().to_string();
    let first = if ct.starts_with('A') { "B" } else { "A" };
    flipped["entries"]["a"]["ct"] = format!("{first}{}", &ct[1..]).into();
    check_refused(&write_doc(&flipped), "flipped");

    // Two entries' ciphertexts swapped.
    let mut swapped = doc.clone();
    swapped["entries"]["a"] = doc["entries"]["b"].clone();
    swapped["entries"]["b"] = doc["entries"]["a"].clone();
    check_refused(&write_doc(&swapped), "swapped");

    // An entry removed.
    let mut dropped = doc.clone();
    dropped["entries"].as_object_mut().unwrap().remove("b");
    check_refused(&write_doc(&dropped), "dropped");

    // Truncated and garbage files: named, never a panic.
    std::fs::write(s.store(), &good_store[..good_store.len() / 2]).unwrap();
    s.secrets(&["get", "a"], None).cannot(&["secrets store", "not an opservant secrets store"]);
    let mut future = doc.clone();
    future["version"] = 9.into();
    write_doc(&future);
    s.secrets(&["list"], None).cannot(&["format version 9 is not supported"]);

    // The original is still good.
    std::fs::write(s.store(), &good_store).unwrap();
    assert_eq!(s.get("b"), vb);
}

#[test]
fn a_systemd_credential_supplies_the_key() {
    if !require_root() {
        return;
    }
    let s = Setup::new("");
    let creds = HostDir::new();
    std::fs::set_permissions(&creds.path, std::fs::Permissions::from_mode(0o500)).unwrap();
    let key = [0x5au8; 32];
    let b64 = {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(key)
    };
    let cred = creds.path.join("opservant-secrets-key");
    std::fs::write(&cred, format!("{b64}\n")).unwrap();
    std::fs::set_permissions(&cred, std::fs::Permissions::from_mode(0o400)).unwrap();
    let env = [("CREDENTIALS_DIRECTORY", creds.str())];

    let v = unique("from-credential");
    let out = s.secrets_env(&["set", "api_key"], Some(v.as_bytes()), &env);
    out.ok();
    assert!(!out.stderr.contains("created the store key"), "{out:?}");
    assert!(!s.key().exists(), "no key file is made when the credential provides the key");
    let out = s.secrets_env(&["get", "api_key"], None, &env);
    out.ok();
    assert_eq!(out.stdout(), v);
    // Without the credential there is no key...
    s.secrets(&["get", "api_key"], None).cannot(&["exists but has no key"]);
    // ... and the same key as a file (hex this time) reads it: it was sealed with that key.
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    s.dir.file("secrets.key", &hex, 0o600);
    assert_eq!(s.get("api_key"), v);
    // A credential directory without our credential: the key file is used.
    let other = HostDir::new();
    let out = s.secrets_env(&["get", "api_key"], None, &[("CREDENTIALS_DIRECTORY", other.str())]);
    out.ok();
    assert_eq!(out.stdout(), v);
    // An exposed credential is refused like a key file.
    std::fs::set_permissions(&cred, std::fs::Permissions::from_mode(0o444)).unwrap();
    s.secrets_env(&["get", "api_key"], None, &env).cannot(&["systemd credential", "mode 0600 or stricter"]);
}

// ---------------------------------------------------------------------------------------
// Terminals
// ---------------------------------------------------------------------------------------

/// Run `opservant args…` with the given standard streams on a new pseudo-terminal (the rest
/// piped); whenever the terminal shows `steps[i].0`, type `steps[i].1`. Returns the outcome
/// and everything the terminal showed.
fn on_terminal(args: &[&str], stdin_tty: bool, stdout_tty: bool, steps: &[(&str, &str)]) -> (Out, String) {
    let _view = common::host_view();
    let pty = nix::pty::openpty(None, None).expect("openpty");
    let tty = |on: bool| -> Stdio {
        if on {
            Stdio::from(pty.slave.try_clone().expect("dup"))
        } else {
            Stdio::piped()
        }
    };
    let mut child = command(args, &[])
        .stdin(tty(stdin_tty))
        .stdout(tty(stdout_tty))
        .stderr(tty(stdin_tty))
        .spawn()
        .expect("spawn opservant");
    drop(pty.slave);
    let mut master = std::fs::File::from(pty.master);
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let mut reader = master.try_clone().expect("dup master");
    let shown = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        // EIO once every slave descriptor is closed.
        while let Ok(n @ 1..) = reader.read(&mut buf) {
            if tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = String::new();
    for (wait_for, typed) in steps {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !seen.contains(wait_for) {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(chunk) => seen.push_str(&String::from_utf8_lossy(&chunk)),
                Err(_) => panic!("terminal never showed {wait_for:?}; it showed {seen:?}"),
            }
        }
        master.write_all(typed.as_bytes()).expect("type");
    }
    let mut stdout = Vec::new();
    if let Some(mut o) = child.stdout.take() {
        o.read_to_end(&mut stdout).expect("stdout");
    }
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut stderr).expect("stderr");
    }
    let status = child.wait().expect("wait");
    drop(master);
    shown.join().expect("reader");
    for chunk in rx.try_iter() {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    (Out { code: status.code().unwrap_or(-1), stdout, stderr }, seen)
}

#[test]
fn terminals_prompt_without_echo_and_get_needs_reveal() {
    if !require_root() {
        return;
    }
    let s = Setup::new("");
    let v = unique("typed-secret");
    let typed = format!("{v}\n");
    let (out, shown) = on_terminal(
        &["secrets", "set", "api_key", "--config", s.cfg()],
        true,
        false,
        &[("Value for api_key: ", &typed), ("Again, to confirm: ", &typed)],
    );
    assert_eq!(out.code, 0, "{out:?} {shown:?}");
    assert!(!shown.contains(&v), "the typed value is not echoed: {shown:?}");
    assert_eq!(s.get("api_key"), v);

    // Two different answers: nothing stored.
    let (out, shown) = on_terminal(
        &["secrets", "set", "other", "--config", s.cfg()],
        true,
        false,
        &[("Value for other: ", "one\n"), ("Again, to confirm: ", "two\n")],
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(shown.contains("the two values differ"), "{shown:?}");
    s.secrets(&["get", "other"], None).not_found("other");

    // `get` on a terminal: refused without --reveal, shown with it.
    let (out, shown) = on_terminal(&["secrets", "get", "api_key", "--config", s.cfg()], false, true, &[]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("--reveal"), "{out:?}");
    assert!(!shown.contains(&v), "{shown:?}");
    let (out, shown) = on_terminal(&["secrets", "get", "api_key", "--reveal", "--config", s.cfg()], false, true, &[]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(shown.contains(&v), "{shown:?}");
}

// ---------------------------------------------------------------------------------------
// Executor runs with `secrets.provider: builtin`
// ---------------------------------------------------------------------------------------

const EXECUTOR: &str = r#"
import hashlib
import sys

from opservant.executor import BaseExecutor, ExecutorResult

PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEAzZq9\n-----END RSA PRIVATE KEY-----"


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        vault, log = context["vault"], context["logger"]
        out = {}
        for name in params["names"]:
            try:
                value = vault.get_secret(name)
            except PermissionError as e:
                out[name] = "PermissionError: %s" % e
                continue
            out[name] = "granted:" + value
            out[name + ".sha256"] = hashlib.sha256(value.encode()).hexdigest()
            print("stdout %s=%s" % (name, value))
            sys.stderr.write("stderr %s=%s\n" % (name, value))
            log.info("log %s=%s" % (name, value), value=value)
            # As Python shows it: repr() (tracebacks, printed containers), its bytes, a log
            # field the runtime can only send as its repr().
            out[name + ".repr"] = repr(value)
            out[name + ".bytes"] = repr(value.encode())
            log.info("as bytes", token=value.encode())
        # Credentials the run did not get from the vault: redacted by pattern.
        out["pem"] = PEM
        out["aws"] = {"id": "AKIAIOSFODNN7EXAMPLE", "aws_secret_access_key": "aws_secret_access_key=wJalrXUtnFEMIK7MDENG"}
        out["header"] = "Authorization: Bearer zq9TOKEN0123456789"
        print("pem " + PEM)
        log.warning("calling with Authorization: Bearer zq9TOKEN0123456789", key="AKIAIOSFODNN7EXAMPLE")
        return ExecutorResult(output=out)
"#;

fn put(root: &Path, rel: &str, content: &[u8]) {
    let p = root.join(rel);
    let parent = p.parent().expect("parent");
    std::fs::create_dir_all(parent).expect("mkdir");
    std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    std::fs::write(&p, content).expect("write");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod file");
}

fn executor(declared: &[&str]) -> HostDir {
    let d = HostDir::new();
    let manifest = json!({
        "name": "store-test",
        "version": "1.0.0",
        "description": "built-in store test executor",
        "author": "tests",
        "supported_actions": ["act-test"],
        "entry_point": "test_executor.TestExecutor",
        "requirements": {"python": ">=3.9", "packages": []},
        "permissions": {"secrets": declared},
        "resource_limits": {"max_cpu_percent": 50, "timeout_seconds": 60}
    });
    put(&d.path, "manifest.json", manifest.to_string().as_bytes());
    put(&d.path, "test_executor/__init__.py", EXECUTOR.as_bytes());
    d
}

#[test]
fn executor_gets_declared_secrets_from_the_store_redacted() {
    if !require_root() {
        return;
    }
    let s = Setup::new("agent:\n  id: ag-store\n");
    // A backslash, both quotes and a letter outside ASCII: its repr() and bytes differ from it.
    let core = unique("store-s3cr3t");
    let (value, other) = (format!("{core}\\\"'ü"), unique("other-s3cr3t"));
    s.set("api_key", &value);
    s.set("other_key", &other);
    let d = executor(&["api_key", "missing_key"]);
    let params = json!({"names": ["api_key", "other_key", "missing_key"]}).to_string();
    let out = invoke(&["run", d.str(), "--config", s.cfg(), "--params", &params], None, &[("OPSERVANT_LOG", "info")]);
    let stdout = out.stdout();
    assert_eq!(out.code, 0, "{out:?}");
    let r: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert_eq!(r["status"], "completed", "{r}");
    let o = &r["output"];
    // Delivered, and the right value (its digest), but redacted wherever it appears.
    assert_eq!(o["api_key.sha256"], sha256_hex(value.as_bytes()), "{r}");
    assert_eq!(o["api_key"], "granted:[REDACTED]");
    assert!(r["stdout"].as_str().unwrap().contains("stdout api_key=[REDACTED]\n"), "{r}");
    assert!(r["stderr"].as_str().unwrap().contains("stderr api_key=[REDACTED]\n"), "{r}");
    let rec = r["logs"].as_array().unwrap().iter().find(|l| l["msg"] == "log api_key=[REDACTED]").expect("log record");
    assert_eq!(rec["fields"], json!({"value": "[REDACTED]"}));
    assert_eq!((&o["api_key.repr"], &o["api_key.bytes"]), (&json!("'[REDACTED]'"), &json!("b'[REDACTED]'")), "{r}");
    let rec = r["logs"].as_array().unwrap().iter().find(|l| l["msg"] == "as bytes").expect("log record");
    assert_eq!(rec["fields"], json!({"token": "b'[REDACTED]'"}));
    // Only declared names, only what the store has.
    assert_eq!(o["other_key"], "PermissionError: secret 'other_key' is not declared in permissions.secrets");
    assert_eq!(o["missing_key"], "PermissionError: secret 'missing_key' is not available from the configured provider");
    // Credential patterns.
    assert_eq!(o["pem"], "[REDACTED]");
    assert_eq!(o["aws"], json!({"id": "[REDACTED]", "aws_secret_access_key": "aws_secret_access_key=[REDACTED]"}));
    assert_eq!(o["header"], "Authorization: Bearer [REDACTED]");
    assert!(r["stdout"].as_str().unwrap().contains("pem [REDACTED]"), "{r}");
    let warn = r["logs"].as_array().unwrap().iter().find(|l| l["level"] == "warning").expect("warning record");
    assert_eq!(warn["msg"], "calling with Authorization: Bearer [REDACTED]");
    assert_eq!(warn["fields"], json!({"key": "[REDACTED]"}));
    // Nothing of it leaves the agent: not in the result, not in its own log.
    for leak in [
        &value[..],
        &core,
        &other,
        "MIIEpAIBAAKCAQEAzZq9",
        "AKIAIOSFODNN7EXAMPLE",
        "wJalrXUtnFEMIK7MDENG",
        "zq9TOKEN0123456789",
    ] {
        assert!(!stdout.contains(leak), "{leak} in the result: {stdout}");
        assert!(!out.stderr.contains(leak), "{leak} in the agent's log: {}", out.stderr);
    }
    // Audited by name, never by value.
    let log = std::fs::read_to_string(s.dir.path.join("audit/audit.jsonl")).unwrap();
    assert!(!log.contains(&value) && !log.contains(&other), "{log}");
    assert!(s.audit().iter().any(|r| r["event"] == "secret_access" && r["fields"]["secret"] == "api_key"), "{log}");
    assert!(out.stderr.lines().any(|l| l.contains("secret_access") && l.contains("api_key")), "{}", out.stderr);
    assert!(out.stderr.lines().any(|l| l.contains("secret_denied") && l.contains("other_key")), "{}", out.stderr);

    // A store sealed with another key stops the run before anything starts.
    let good = std::fs::read(s.key()).unwrap();
    std::fs::write(s.key(), format!("{}\n", "cd".repeat(32))).unwrap();
    let out = invoke(&["run", d.str(), "--config", s.cfg(), "--params", &params], None, &[]);
    out.cannot(&["secrets.provider builtin", "wrong key"]);
    std::fs::write(s.key(), good).unwrap();

    // No store yet: the run goes ahead, and no secret is available.
    std::fs::remove_file(s.store()).unwrap();
    let out = invoke(&["run", d.str(), "--config", s.cfg(), "--params", r#"{"names": ["api_key"]}"#], None, &[]);
    assert_eq!(out.code, 0, "{out:?}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        r["output"]["api_key"],
        "PermissionError: secret 'api_key' is not available from the configured provider"
    );
}

#[test]
fn a_store_configured_over_its_own_key_is_a_configuration_error() {
    if !require_root() {
        return;
    }
    let s = Setup::new("");
    s.set("api_key", "keep-me");
    let key_before = std::fs::read(s.key()).unwrap();
    let key = s.key().display().to_string();
    // The same path (spelt with a `./`), then a hard link to the key under another name.
    let link = s.dir.path.join("store-link.enc");
    std::fs::hard_link(s.key(), &link).unwrap();
    for store in [s.dir.path.join("./secrets.key"), link] {
        let text = std::fs::read_to_string(&s.config)
            .unwrap()
            .replace(&format!("store: {}", s.store().display()), &format!("store: {}", store.display()));
        let conf = s.dir.path.join("same.yaml");
        std::fs::write(&conf, text).unwrap();
        let c = conf.to_str().unwrap();
        let out = invoke(&["secrets", "set", "other", "--config", c], Some(b"value"), &[]);
        out.cannot(&["secrets.store", "secrets.key_file"]);
        let out = invoke(&["agent", "--check-config", "--config", c], None, &[]);
        out.cannot(&["secrets.store", "secrets.key_file"]);
        assert_eq!(std::fs::read(s.key()).unwrap(), key_before, "the key was overwritten ({key})");
    }
    assert_eq!(s.get("api_key"), "keep-me");
    // Before either file exists: the key's directory reached through a link, or through
    // `..` — one file all the same, which the first `set` would make the key and then
    // replace with the store.
    let fresh = HostDir::new();
    std::fs::create_dir(fresh.path.join("real")).unwrap();
    std::fs::create_dir(fresh.path.join("real/sub")).unwrap();
    std::os::unix::fs::symlink(fresh.path.join("real"), fresh.path.join("linked")).unwrap();
    let key = fresh.path.join("real/secrets.key");
    for store in [fresh.path.join("linked/secrets.key"), fresh.path.join("real/sub/../secrets.key")] {
        let conf = fresh.path.join("conf.yaml");
        std::fs::write(
            &conf,
            format!(
                "secrets:\n  provider: builtin\n  store: {}\n  key_file: {}\naudit:\n  path: {}\n  journald: false\n",
                store.display(),
                key.display(),
                fresh.path.join("audit/audit.jsonl").display()
            ),
        )
        .unwrap();
        let out = invoke(&["secrets", "set", "x", "--config", conf.to_str().unwrap()], Some(b"value"), &[]);
        out.cannot(&["secrets.store", "secrets.key_file"]);
        assert!(!key.exists(), "{}: a key was made", store.display());
    }
}

/// A `set` that makes the store's key and then cannot write the store (here: its directory,
/// a small tmpfs in a mount namespace of the command's own, full) leaves no key behind: the
/// key stayed, and the notice to keep a copy of it was never printed — not by the next
/// `set` either, which found it.
#[test]
fn a_key_made_for_a_store_that_could_not_be_written_does_not_stay() {
    if !require_root() {
        return;
    }
    let s = Setup::new("");
    let store_dir = s.dir.path.join("full");
    std::fs::create_dir(&store_dir).unwrap();
    let text = std::fs::read_to_string(&s.config)
        .unwrap()
        .replace(&format!("store: {}", s.store().display()), &format!("store: {}/secrets.enc", store_dir.display()));
    std::fs::write(&s.config, text).unwrap();
    let script = format!(
        "mount --make-rprivate / && mount -t tmpfs -o size=8k tmpfs {d} && (head -c 1M /dev/zero > {d}/fill || true) && exec {bin} secrets set api_key --config {c}",
        d = store_dir.display(),
        bin = env!("CARGO_BIN_EXE_opservant"),
        c = s.cfg()
    );
    let _view = common::host_view();
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .env_remove("OPSERVANT_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"value")?;
            c.wait_with_output()
        })
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("No space left on device"), "{stderr}");
    assert!(!s.key().exists(), "the key made for the store stayed: {stderr}");
    // The audit's record of the change to be made is followed by one that it was not.
    let audit = s.audit();
    let failed = audit.iter().find(|r| r["event"] == "secret_store_failed").unwrap_or_else(|| panic!("{audit:?}"));
    assert_eq!((&failed["fields"]["secret"], &failed["fields"]["op"]), (&json!("api_key"), &json!("set")), "{failed}");
    assert!(failed["fields"]["error"].as_str().unwrap().contains("No space left"), "{failed}");
    // The next `set` makes a key again, and says so.
    std::fs::remove_dir(&store_dir).unwrap();
    let out = s.secrets(&["set", "api_key"], Some(b"value"));
    out.ok();
    assert!(out.stderr.contains("created the store key"), "{out:?}");
}

/// `get` and `list` whose reader went away (a closed pipe) drop the output and keep their
/// own exit status, as every command does; and a `secrets` command, which holds the store's
/// key and a value, cannot dump core (no core size, not dumpable), like the daemon.
#[test]
fn secrets_commands_keep_their_status_for_a_gone_reader_and_dump_no_core() {
    if !require_root() {
        return;
    }
    let s = Setup::new("");
    s.set("api_key", "v");
    for args in [&["get", "api_key"][..], &["list"][..]] {
        let _view = common::host_view();
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = command(&[&["secrets"][..], args, &["--config", s.cfg()]].concat(), &[])
            .stdin(Stdio::null())
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    // `set` waiting for its value on stdin.
    let mut child = command(&["secrets", "set", "other", "--config", s.cfg()], &[])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let limits = format!("/proc/{}/limits", child.id());
    let deadline = Instant::now() + Duration::from_secs(10);
    let core = loop {
        let text = std::fs::read_to_string(&limits).unwrap();
        let core = text.lines().find(|l| l.starts_with("Max core file size")).unwrap().to_string();
        // Until the command has set it (it inherits the test's at first, whose soft limit
        // may be 0 already: the hard one tells).
        if core.split_whitespace().nth(5) == Some("0") || Instant::now() > deadline {
            break core;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(core.split_whitespace().skip(4).take(2).collect::<Vec<_>>(), ["0", "0"], "{core}");
    // (The dumpable flag, set by the same call, is not visible from outside a root process.)
    drop(child.stdin.take());
    let _ = child.wait();
}
