//! The Vault secrets provider end to end, as root: the real `opservant` (`run`, and `agent` +
//! `submit`) against a test Vault (tests/common/vault.rs: HTTPS on 127.0.0.1, AppRole login,
//! token renewal, KV v2). A declared secret delivered and redacted; an undeclared one (and a
//! name that would add path segments) refused before Vault is asked; a 403 answered by one new
//! login; renewal or a new login while a run keeps using an expiring token; one login shared
//! by the daemon's runs; a wrong secret_id, a secret without its `value` field and a server
//! certificate from another CA failing that secret (audited, nothing leaked); bad
//! configurations refused with exit status 2 naming the key. No timed assertions.

mod common;

use common::sha256_hex;
#[path = "common/platform.rs"]
mod platform;
#[path = "common/vault.rs"]
mod vault;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::{require_root, HostDir};
use platform::Pki;
use serde_json::{json, Value};
use vault::TestVault;

const ROLE_ID: &str = "opservant-role";
const KV_PREFIX: &str = "secret/data/opservant";

fn secret_id() -> String {
    format!("secret-ID-{}-xq", std::process::id())
}

fn value() -> String {
    format!("vault-VALUE-{}-zq", std::process::id())
}

/// Asks for `params.names` in order (pausing `params.pause` seconds between), returning the
/// SHA-256 of each value or the `PermissionError`; `params.leak` puts the value everywhere.
const EXECUTOR: &str = r#"
import hashlib
import time

from opservant.executor import BaseExecutor, ExecutorResult


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        vault, out = context["vault"], {}
        for i, name in enumerate(params["names"]):
            if i and params.get("pause"):
                time.sleep(params["pause"])
            try:
                value = vault.get_secret(name)
                out["%d:%s" % (i, name)] = hashlib.sha256(value.encode()).hexdigest()
                if params.get("leak"):
                    print("leak", value)
                    context["logger"].info("log leak " + value)
                    out["echo"] = "value=" + value
            except PermissionError as e:
                out["%d:%s" % (i, name)] = "PermissionError: %s" % e
        return ExecutorResult(output=out)
"#;

fn put(root: &Path, rel: &str, content: &str, mode: u32) -> PathBuf {
    let p = root.join(rel);
    let parent = p.parent().expect("parent");
    std::fs::create_dir_all(parent).expect("mkdir");
    std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    std::fs::write(&p, content).expect("write");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod file");
    p
}

/// An executor package named `name` declaring `secrets`.
fn executor(dir: &Path, name: &str, secrets: &[&str]) -> PathBuf {
    let m = json!({
        "name": name, "version": "1.0.0", "description": "vault test", "author": "tests",
        "supported_actions": ["act-vault"], "entry_point": "vault_test.TestExecutor",
        "requirements": {"python": ">=3.9", "packages": []},
        "permissions": {"secrets": secrets},
        "resource_limits": {"timeout_seconds": 60}
    });
    let pkg = dir.join(name);
    put(&pkg, "manifest.json", &m.to_string(), 0o644);
    put(&pkg, "vault_test/__init__.py", EXECUTOR, 0o644);
    pkg
}

/// A test Vault with `api_key` (and `other_key`, `no_value`) stored, and its CA.
fn vault_with_secrets(ttl: Duration) -> (Pki, TestVault) {
    let pki = Pki::new("vault");
    let v = TestVault::start(&pki, ROLE_ID, &secret_id(), ttl);
    v.put(&format!("{KV_PREFIX}/api_key"), json!({"value": value(), "note": "test"}));
    v.put(&format!("{KV_PREFIX}/other_key"), json!({"value": "other-value"}));
    v.put(&format!("{KV_PREFIX}/no_value"), json!({"password": "x"}));
    (pki, v)
}

/// A config for `vault` in `dir`: the CA (`ca_pem`), the secret_id file (`sid`, mode 0600) and
/// the audit log in `dir`; `extra` is appended under `secrets:`.
fn config(dir: &HostDir, address: &str, ca_pem: &str, sid: &str, extra: &str) -> PathBuf {
    let ca = put(&dir.path, "conf/vault-ca.pem", ca_pem, 0o644);
    let sid_file = put(&dir.path, "conf/vault-secret-id", &format!("{sid}\n"), 0o600);
    let text = format!(
        "agent:\n  id: ag-vault\naudit:\n  path: {}\nsecrets:\n  provider: vault\n  vault_address: {address}\n  \
         vault_ca: {}\n  vault_path: secret/data/opservant\n  auth_method: approle\n  role_id: {ROLE_ID}\n  \
         secret_id_file: {}\n{extra}",
        dir.path.join("audit/audit.jsonl").display(),
        ca.display(),
        sid_file.display()
    );
    put(&dir.path, "conf/config.yaml", &text, 0o644)
}

#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    fn result(&self) -> Value {
        let j: Value = serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not a result ({e}): {self:?}"));
        assert_eq!(self.code, if j["status"] == "completed" { 0 } else { 1 }, "{self:?}");
        j
    }

    fn cannot_run(&self, needles: &[&str]) {
        assert_eq!(self.code, 2, "{self:?}");
        assert!(self.stdout.is_empty(), "{self:?}");
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line on stderr: {self:?}");
        for n in needles {
            assert!(lines[0].contains(n), "stderr should mention {n:?}: {}", lines[0]);
        }
    }

    fn audit_lines(&self, event: &str) -> Vec<&str> {
        let tag = format!("event=\"{event}\"");
        self.stderr.lines().filter(|l| l.contains(&tag)).collect()
    }
}

fn op(args: &[&str], env: &[(&str, &str)]) -> Out {
    let _view = common::host_view();
    let out = common::command()
        .args(args)
        .env_remove("OPSERVANT_LOG")
        .env_remove("CREDENTIALS_DIRECTORY")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("spawn opservant");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn run(pkg: &Path, config: &Path, params: Value) -> Out {
    run_env(pkg, config, params, &[])
}

fn run_env(pkg: &Path, config: &Path, params: Value, env: &[(&str, &str)]) -> Out {
    op(&["run", pkg.to_str().unwrap(), "--config", config.to_str().unwrap(), "--params", &params.to_string()], env)
}

#[test]
fn declared_secret_comes_from_vault_and_is_redacted() {
    if !require_root() {
        return;
    }
    let (pki, v) = vault_with_secrets(Duration::from_secs(600));
    let dir = HostDir::new();
    let conf = config(&dir, &v.address(), &pki.ca, &secret_id(), "  vault_namespace: team-a\n");
    let pkg = executor(&dir.path, "vault-user", &["api_key", "no_value", "missing"]);
    let out = run_env(
        &pkg,
        &conf,
        json!({"names": ["api_key", "no_value", "missing"], "leak": true}),
        &[("OPSERVANT_LOG", "info")],
    );
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    let o = &r["output"];
    assert_eq!(o["0:api_key"], sha256_hex(value().as_bytes()), "{r}");
    // Redacted from everything that leaves the agent.
    for text in [&out.stdout, &out.stderr] {
        assert!(!text.contains(&value()), "secret value leaked: {text}");
        assert!(!text.contains(&secret_id()), "secret_id leaked: {text}");
        assert!(!text.contains("hvs.test-"), "token leaked: {text}");
    }
    assert_eq!(o["echo"], "value=[REDACTED]");
    assert_eq!(r["stdout"], "leak [REDACTED]\n");
    assert!(r["logs"].as_array().unwrap().iter().any(|l| l["msg"] == "log leak [REDACTED]"), "{r}");
    // A secret without its `value` field: a clear failure for that secret, audited.
    assert_eq!(o["1:no_value"], "PermissionError: secret 'no_value' could not be read from the configured provider");
    // A secret Vault does not have.
    assert_eq!(o["2:missing"], "PermissionError: secret 'missing' is not available from the configured provider");
    let granted = out.audit_lines("secret_access");
    assert_eq!(granted.len(), 1, "{}", out.stderr);
    assert!(granted[0].contains("\"secret\":\"api_key\""), "{}", granted[0]);
    let denied = out.audit_lines("secret_denied");
    assert_eq!(denied.len(), 2, "{}", out.stderr);
    assert!(denied[0].contains("\"secret\":\"no_value\"") && denied[0].contains("provider error"), "{}", denied[0]);
    assert!(denied[0].contains("has no field 'value'"), "{}", denied[0]);
    assert!(denied[1].contains("\"secret\":\"missing\"") && denied[1].contains("unknown"), "{}", denied[1]);

    v.with(|s| {
        assert_eq!(s.logins(), 1, "one login per process: {:?}", s.log);
        assert_eq!(s.renewals(), 0, "{:?}", s.log);
        assert_eq!(s.count("GET", "/v1/secret/data/opservant/api_key"), 1, "{:?}", s.log);
        assert!(s.log.iter().all(|l| l.namespace.as_deref() == Some("team-a")), "{:?}", s.log);
    });

    // A 403 on a read (the token was revoked): one new login, one retry, the value delivered.
    v.with(|s| {
        s.deny_reads = 1;
        s.log.clear();
    });
    let r = run(&pkg, &conf, json!({"names": ["api_key"]})).result();
    assert_eq!(r["output"]["0:api_key"], sha256_hex(value().as_bytes()), "{r}");
    v.with(|s| {
        let statuses: Vec<(String, u16)> = s.log.iter().map(|l| (l.path.clone(), l.status)).collect();
        let read = "/v1/secret/data/opservant/api_key".to_string();
        let login = "/v1/auth/approle/login".to_string();
        assert_eq!(statuses, vec![(login.clone(), 200), (read.clone(), 403), (login, 200), (read, 200)]);
    });

    // A name Vault fails on, asked for in a loop: asked of Vault 3 times in the run, then
    // refused without asking (each error a request — after a 403 a fresh login and token).
    v.with(|s| s.log.clear());
    let r = run(&pkg, &conf, json!({"names": vec!["no_value"; 10]})).result();
    assert_eq!(
        r["output"]["2:no_value"],
        "PermissionError: secret 'no_value' could not be read from the configured provider"
    );
    assert_eq!(
        r["output"]["9:no_value"],
        "PermissionError: secret 'no_value' could not be read from the configured provider (3 tries in this run)",
        "{r}"
    );
    v.with(|s| assert_eq!(s.count("GET", "/v1/secret/data/opservant/no_value"), 3, "{:?}", s.log));

    // The log at its most verbose, the HTTP client's asked for by name: its requests and
    // responses (which hold the token, the login's client_token and the value) stay out.
    let out = run_env(
        &pkg,
        &conf,
        json!({"names": ["api_key"]}),
        &[("OPSERVANT_LOG", "trace,ureq=trace,ureq_proto=trace,rustls=trace")],
    );
    assert_eq!(out.result()["status"], "completed");
    assert!(out.stderr.contains("TRACE"), "the trace level is on: {}", out.stderr);
    assert!(!out.stderr.contains("ureq"), "the HTTP client logged: {}", out.stderr);
    for secret in [value(), secret_id(), "hvs.test-".to_string()] {
        assert!(!out.stderr.contains(&secret), "{secret} in the log: {}", out.stderr);
        let hex: String = secret.bytes().map(|b| format!("{b:02x}")).collect();
        assert!(!out.stderr.replace(' ', "").contains(&hex), "{secret} in the log, as hex");
    }
}

/// `network.proxy.https` carries Vault's traffic too (HTTP `CONNECT`, TLS to Vault end to
/// end through it), as the platform's; `no_proxy` naming Vault's host sends it directly —
/// here past a proxy address nothing listens on.
#[test]
fn vault_is_reached_through_the_configured_proxy_unless_no_proxy_names_it() {
    if !require_root() {
        return;
    }
    let (pki, v) = vault_with_secrets(Duration::from_secs(600));
    let port = v.address().rsplit_once(':').map(|(_, p)| p.to_string()).unwrap();
    let (proxy_port, connects) = common::connect_proxy();
    let dir = HostDir::new();
    let pkg = executor(&dir.path, "vault-proxied", &["api_key"]);
    let conf = config(
        &dir,
        &v.address(),
        &pki.ca,
        &secret_id(),
        &format!("network:\n  proxy:\n    https: http://127.0.0.1:{proxy_port}\n    no_proxy: [\"192.0.2.0/24\"]\n"),
    );
    let r = run(&pkg, &conf, json!({"names": ["api_key"]})).result();
    assert_eq!(r["output"]["0:api_key"], sha256_hex(value().as_bytes()), "{r}");
    {
        let connects = connects.lock().unwrap();
        assert!(!connects.is_empty(), "nothing went through the proxy");
        assert!(connects.iter().all(|c| c == &format!("CONNECT 127.0.0.1:{port} HTTP/1.1")), "{connects:?}");
    }
    v.with(|s| assert_eq!(s.count("GET", "/v1/secret/data/opservant/api_key"), 1, "{:?}", s.log));

    // Named by no_proxy: directly, the proxy (a port nothing listens on) never tried.
    let dir = HostDir::new();
    let pkg = executor(&dir.path, "vault-direct", &["api_key"]);
    let conf = config(
        &dir,
        &v.address(),
        &pki.ca,
        &secret_id(),
        "network:\n  proxy:\n    https: http://127.0.0.1:9\n    no_proxy: [\"127.0.0.0/8\"]\n",
    );
    let r = run(&pkg, &conf, json!({"names": ["api_key"]})).result();
    assert_eq!(r["output"]["0:api_key"], sha256_hex(value().as_bytes()), "{r}");
}

#[test]
fn undeclared_names_never_reach_vault() {
    if !require_root() {
        return;
    }
    let (pki, v) = vault_with_secrets(Duration::from_secs(600));
    let dir = HostDir::new();
    let conf = config(&dir, &v.address(), &pki.ca, &secret_id(), "");
    // `../api_key` and `a/b` are valid manifest names but not one Vault path segment.
    let pkg = executor(&dir.path, "vault-undeclared", &["api_key", "../api_key", "a/b"]);
    let out = run(&pkg, &conf, json!({"names": ["other_key", "../api_key", "a/b", "api_key"]}));
    let r = out.result();
    let o = &r["output"];
    assert_eq!(o["0:other_key"], "PermissionError: secret 'other_key' is not declared in permissions.secrets");
    for (k, name) in [("1:../api_key", "../api_key"), ("2:a/b", "a/b")] {
        assert_eq!(
            o[k],
            format!("PermissionError: secret '{name}' could not be read from the configured provider"),
            "{r}"
        );
    }
    assert_eq!(o["3:api_key"], sha256_hex(value().as_bytes()), "{r}");
    let denied = out.audit_lines("secret_denied");
    assert_eq!(denied.len(), 3, "{}", out.stderr);
    assert!(denied[0].contains("\"secret\":\"other_key\"") && denied[0].contains("not declared"), "{}", denied[0]);
    assert!(denied[1].contains("not one Vault path segment"), "{}", denied[1]);
    v.with(|s| {
        assert!(s.log.iter().all(|l| !l.path.contains("other_key")), "Vault was asked for other_key: {:?}", s.log);
        assert!(s.log.iter().all(|l| !l.path.contains("..") && !l.path.contains("/a/b")), "{:?}", s.log);
        let reads = s.under("/v1/secret/");
        assert_eq!(reads.len(), 1, "only the declared api_key was read: {:?}", s.log);
    });
}

#[test]
fn an_expiring_token_is_renewed_or_replaced_while_in_use() {
    if !require_root() {
        return;
    }
    // Leases of 2 s; four reads 1.5 s apart: each later read finds the token past 2/3 of its
    // lease (or expired), whatever the machine's speed. Four names: a run asks the provider
    // about each name once (its answer serves the repeats).
    let (pki, v) = vault_with_secrets(Duration::from_secs(2));
    let names = ["api_key", "api_key_1", "api_key_2", "api_key_3"];
    for n in &names[1..] {
        v.put(&format!("{KV_PREFIX}/{n}"), json!({"value": value()}));
    }
    let dir = HostDir::new();
    let conf = config(&dir, &v.address(), &pki.ca, &secret_id(), "");
    let pkg = executor(&dir.path, "vault-renewal", &names);
    let r = run(&pkg, &conf, json!({"names": names, "pause": 1.5})).result();
    let want = sha256_hex(value().as_bytes());
    for (i, n) in names.iter().enumerate() {
        assert_eq!(r["output"][format!("{i}:{n}")], want, "read {i}: {r}");
    }
    v.with(|s| {
        assert!(s.logins() >= 1, "{:?}", s.log);
        // Renewal when the token is between 2/3 of its lease and its end, a new login once it
        // is over: which of the two depends on the machine's speed, not asserted.
        assert!(s.renewals() + s.logins() >= 4, "a renewal or a new login before each later read: {:?}", s.log);
        eprintln!("renewals {}, logins {}", s.renewals(), s.logins());
    });
}

#[test]
fn the_daemon_keeps_one_vault_login_across_runs() {
    if !require_root() {
        return;
    }
    let (pki, v) = vault_with_secrets(Duration::from_secs(600));
    let dir = HostDir::new();
    let p = |s: &str| dir.path.join(s);
    assert_eq!(op(&["keygen", "--out", p("keys").to_str().unwrap()], &[]).code, 0);
    let extra = format!("  vault_namespace: ns1\nexecutors:\n  dir: {}\n", p("executors").display());
    let conf = config(&dir, &v.address(), &pki.ca, &secret_id(), &extra);
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text = text.replace(
        "agent:\n  id: ag-vault\n",
        &format!(
            "agent:\n  id: ag-vault\n  platform_public_key: {}\n  state_dir: {}\n  socket: {}\n",
            p("keys/signing.pub").display(),
            p("state").display(),
            p("run/agent.sock").display()
        ),
    );
    std::fs::write(&conf, text).unwrap();
    let c = conf.to_str().unwrap();
    let pkg = executor(&dir.path, "vault-daemon", &["api_key"]);
    let out = op(&["executor", "install", pkg.to_str().unwrap(), "--config", c], &[]);
    assert_eq!(out.code, 0, "{out:?}");
    let out = op(&["agent", "--check-config", "--config", c], &[]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(v.with(|s| s.log.is_empty()), "--check-config contacts nothing");

    let _view = common::host_view();
    let mut child = common::command()
        .args(["agent", "--config", c])
        .env_remove("CREDENTIALS_DIRECTORY")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the agent");
    let socket = p("run/agent.sock");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(std::time::Instant::now() < deadline, "the agent did not start listening");
        std::thread::sleep(Duration::from_millis(20));
    }
    let submit = |id: &str| -> Value {
        let cmd = json!({"command_id": id, "action": "execute", "executor": "vault-daemon",
                         "parameters": {"names": ["api_key"]}});
        let mut s = common::command()
            .args(["sign", "--key", p("keys/signing.key").to_str().unwrap(), "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        s.stdin.take().unwrap().write_all(cmd.to_string().as_bytes()).unwrap();
        let signed = s.wait_with_output().unwrap();
        assert!(signed.status.success());
        let mut c = common::command()
            .args(["submit", "-", "--socket", socket.to_str().unwrap()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(&signed.stdout).unwrap();
        let out = c.wait_with_output().unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| json!({"raw": String::from_utf8_lossy(&out.stdout)}))
    };
    let want = sha256_hex(value().as_bytes());
    let replies = [submit("vault-cmd-1"), submit("vault-cmd-2")];
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    for r in &replies {
        assert_eq!(r["status"], "completed", "{r}");
        assert_eq!(r["output"]["0:api_key"], want, "{r}");
    }
    v.with(|s| {
        assert_eq!(s.logins(), 1, "one login for both runs: {:?}", s.log);
        assert_eq!(s.count("GET", "/v1/secret/data/opservant/api_key"), 2, "{:?}", s.log);
    });
}

#[test]
fn a_wrong_secret_id_fails_the_secret_clearly() {
    if !require_root() {
        return;
    }
    let (pki, v) = vault_with_secrets(Duration::from_secs(600));
    let dir = HostDir::new();
    let wrong = format!("WRONG-secret-id-{}", std::process::id());
    let conf = config(&dir, &v.address(), &pki.ca, &wrong, "");
    let pkg = executor(&dir.path, "vault-wrong-id", &["api_key"]);
    let out = run_env(&pkg, &conf, json!({"names": ["api_key"]}), &[("OPSERVANT_LOG", "info")]);
    let r = out.result();
    assert_eq!(r["status"], "completed", "the executor handled the refusal: {r}");
    assert_eq!(
        r["output"]["0:api_key"],
        "PermissionError: secret 'api_key' could not be read from the configured provider"
    );
    let denied = out.audit_lines("secret_denied");
    assert_eq!(denied.len(), 1, "{}", out.stderr);
    for needle in ["provider error", "approle login", "HTTP 400", "invalid role or secret ID"] {
        assert!(denied[0].contains(needle), "{needle}: {}", denied[0]);
    }
    for text in [&out.stdout, &out.stderr] {
        assert!(!text.contains(&wrong), "secret_id leaked: {text}");
        assert!(!text.contains("panicked"), "{text}");
    }
    // The audit log file has it too.
    let log = std::fs::read_to_string(dir.path.join("audit/audit.jsonl")).unwrap();
    assert!(log.contains("secret_denied") && log.contains("invalid role or secret ID"), "{log}");
    assert!(!log.contains(&wrong));
    v.with(|s| {
        assert_eq!(s.logins(), 1, "{:?}", s.log);
        assert!(s.under("/v1/secret/").is_empty(), "no read without a token: {:?}", s.log);
    });
}

#[test]
fn a_server_certificate_from_another_ca_is_refused() {
    if !require_root() {
        return;
    }
    let (_pki, v) = vault_with_secrets(Duration::from_secs(600));
    let other = Pki::new("other");
    let dir = HostDir::new();
    let conf = config(&dir, &v.address(), &other.ca, &secret_id(), "");
    let pkg = executor(&dir.path, "vault-foreign-ca", &["api_key"]);
    let out = run(&pkg, &conf, json!({"names": ["api_key"]}));
    let r = out.result();
    assert_eq!(
        r["output"]["0:api_key"],
        "PermissionError: secret 'api_key' could not be read from the configured provider"
    );
    assert!(!out.stdout.contains(&value()) && !out.stderr.contains(&value()));
    assert!(!out.stderr.contains(&secret_id()), "the secret_id was never sent: {}", out.stderr);
    let denied = out.audit_lines("secret_denied");
    assert_eq!(denied.len(), 1, "{}", out.stderr);
    assert!(denied[0].to_lowercase().contains("certificate"), "{}", denied[0]);
    assert!(v.with(|s| s.log.is_empty()), "no request got through: {:?}", v.with(|s| s.log.clone()));
}

/// With `secrets.vault_crl`, a Vault server whose certificate its CA revoked is refused
/// before anything is sent (the secret_id included); a current list that does not name it
/// lets the secret through.
#[test]
fn a_revoked_vault_certificate_is_refused() {
    if !require_root() {
        return;
    }
    let (pki, v) = vault_with_secrets(Duration::from_secs(600));
    let dir = HostDir::new();
    let crl = dir.path.join("conf/vault.crl");
    let conf = config(&dir, &v.address(), &pki.ca, &secret_id(), &format!("  vault_crl: {}\n", crl.display()));
    let pkg = executor(&dir.path, "vault-crl", &["api_key"]);
    std::fs::write(&crl, pki.crl(&[platform::CLIENT_SERIAL], 2099)).unwrap();
    let r = run(&pkg, &conf, json!({"names": ["api_key"]})).result();
    assert_eq!(r["output"]["0:api_key"], sha256_hex(value().as_bytes()), "{r}");
    let served = v.with(|s| s.log.len());

    std::fs::write(&crl, pki.crl(&[platform::SERVER_SERIAL], 2099)).unwrap();
    let out = run(&pkg, &conf, json!({"names": ["api_key"]}));
    assert_eq!(
        out.result()["output"]["0:api_key"],
        "PermissionError: secret 'api_key' could not be read from the configured provider"
    );
    let denied = out.audit_lines("secret_denied");
    assert_eq!(denied.len(), 1, "{}", out.stderr);
    assert!(denied[0].contains("is revoked by a revocation list of secrets.vault_crl"), "{}", denied[0]);
    assert!(!out.stderr.contains(&secret_id()), "the secret_id was never sent: {}", out.stderr);
    assert_eq!(v.with(|s| s.log.len()), served, "no request got through: {:?}", v.with(|s| s.log.clone()));
}

#[test]
fn bad_configurations_are_refused_naming_the_key() {
    if !require_root() {
        return;
    }
    let (pki, v) = vault_with_secrets(Duration::from_secs(600));
    let dir = HostDir::new();
    assert_eq!(op(&["keygen", "--out", dir.path.join("keys").to_str().unwrap()], &[]).code, 0);
    let pkg = executor(&dir.path, "vault-config", &["api_key"]);
    let daemon_keys = format!(
        "  platform_public_key: {}\n  state_dir: {}\n  socket: {}\n",
        dir.path.join("keys/signing.pub").display(),
        dir.path.join("state").display(),
        dir.path.join("run/agent.sock").display()
    );
    // (text of the good config, its replacement, the key the error must name, a word it must contain)
    let cases = [
        ("https://", "http://", "secrets.vault_address", "http"),
        ("auth_method: approle", "auth_method: userpass", "secrets.auth_method", "userpass"),
        ("  vault_ca:", "  #vault_ca:", "secrets.vault_ca", "required"),
        // A device is never read (it would be read for ever).
        ("  vault_ca: ", "  vault_ca: /dev/zero\n  #", "secrets.vault_ca", "not a regular file"),
        ("vault_path: secret/data/opservant", "vault_path: secret/../x", "secrets.vault_path", ".."),
        ("  role_id:", "  #role_id:", "secrets.role_id", "required"),
    ];
    for (from, to, key, word) in cases {
        let sub = HostDir::new();
        let conf = config(&sub, &v.address(), &pki.ca, &secret_id(), "");
        let text = std::fs::read_to_string(&conf)
            .unwrap()
            .replace("agent:\n  id: ag-vault\n", &format!("agent:\n  id: ag-vault\n{daemon_keys}"));
        std::fs::write(&conf, text.replace(from, to)).unwrap();
        run(&pkg, &conf, json!({"names": []})).cannot_run(&[key, word]);
        op(&["agent", "--check-config", "--config", conf.to_str().unwrap()], &[]).cannot_run(&[key, word]);
    }
    // A secret_id file others can read, and a missing one.
    let sub = HostDir::new();
    let conf = config(&sub, &v.address(), &pki.ca, &secret_id(), "");
    let text = std::fs::read_to_string(&conf)
        .unwrap()
        .replace("agent:\n  id: ag-vault\n", &format!("agent:\n  id: ag-vault\n{daemon_keys}"));
    std::fs::write(&conf, text).unwrap();
    let sid = sub.path.join("conf/vault-secret-id");
    std::fs::set_permissions(&sid, std::fs::Permissions::from_mode(0o644)).unwrap();
    run(&pkg, &conf, json!({"names": []})).cannot_run(&["secrets.secret_id_file", "mode 0600"]);
    op(&["agent", "--check-config", "--config", conf.to_str().unwrap()], &[])
        .cannot_run(&["secrets.secret_id_file", "mode 0600"]);
    std::fs::remove_file(&sid).unwrap();
    run(&pkg, &conf, json!({"names": []})).cannot_run(&["secrets.secret_id_file", "No such file"]);
    // ... which the systemd credential replaces.
    let creds = HostDir::new();
    put(&creds.path, "opservant-vault-secret-id", &secret_id(), 0o600);
    let out =
        op(&["agent", "--check-config", "--config", conf.to_str().unwrap()], &[("CREDENTIALS_DIRECTORY", creds.str())]);
    assert_eq!(out.code, 0, "{out:?}");
    let out = run_env(&pkg, &conf, json!({"names": ["api_key"]}), &[("CREDENTIALS_DIRECTORY", creds.str())]);
    assert_eq!(out.result()["output"]["0:api_key"], sha256_hex(value().as_bytes()), "{out:?}");
    // Checking never contacted Vault; only the last run did.
    v.with(|s| assert_eq!(s.logins(), 1, "{:?}", s.log));
}
