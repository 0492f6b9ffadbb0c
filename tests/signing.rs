//! `opservant keygen | sign | verify` end to end: the real binary, real key files, OpenSSL
//! interoperability, and every rejection the command line promises (exit 1 for a command
//! that does not verify, exit 2 for input that cannot be read as a command).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

use common::HostDir;
use serde_json::{json, Value};

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn op(args: &[&str], stdin: Option<&[u8]>) -> Out {
    op_with(args, stdin, Stdio::piped())
}

/// `opservant args…` with `stdin` written to it and its stdout on `stdout` (captured when
/// piped).
fn op_with(args: &[&str], stdin: Option<&[u8]>, stdout: Stdio) -> Out {
    use std::io::Write;
    let mut child = common::command()
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn opservant");
    if let Some(data) = stdin {
        // A writer that is refused early (oversize input) may see EPIPE: that is fine.
        let _ = child.stdin.take().expect("stdin").write_all(data);
    }
    let out = child.wait_with_output().expect("wait");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn keys(dir: &HostDir) -> (String, String) {
    let out = op(&["keygen", "--out", s(&dir.path.join("keys"))], None);
    assert_eq!(out.code, 0, "{}", out.stderr);
    (s(&dir.path.join("keys/signing.key")).to_string(), s(&dir.path.join("keys/signing.pub")).to_string())
}

fn command() -> Value {
    json!({"command_id": "cmd-8821", "action": "execute", "executor": "port-scanner",
           "parameters": {"target_host": "10.0.1.5", "ports": [22, 80]}})
}

fn sign(key: &str, cmd: &Value) -> Value {
    let out = op(&["sign", "--key", key, "-"], Some(cmd.to_string().as_bytes()));
    assert_eq!(out.code, 0, "{}", out.stderr);
    serde_json::from_str(out.stdout.trim()).expect("signed command is JSON")
}

fn verify(public: &str, signed: &[u8]) -> Out {
    op(&["verify", "--pub", public, "--json", "-"], Some(signed))
}

fn timestamp(offset_s: i64) -> String {
    agent::signing::format_rfc3339(agent::signing::now() + offset_s)
}

#[test]
fn keygen_writes_a_private_key_only_root_can_read_and_never_overwrites() {
    let dir = HostDir::new();
    let (key, public) = keys(&dir);
    let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "private key mode");
    assert!(std::fs::read_to_string(&key).unwrap().starts_with("-----BEGIN PRIVATE KEY-----"));
    assert!(std::fs::read_to_string(&public).unwrap().starts_with("-----BEGIN PUBLIC KEY-----"));
    let before = std::fs::read(&key).unwrap();
    let again = op(&["keygen", "--out", s(&dir.path.join("keys"))], None);
    assert_eq!(again.code, 2, "{}", again.stderr);
    assert!(again.stderr.contains("refusing to overwrite"), "{}", again.stderr);
    assert_eq!(std::fs::read(&key).unwrap(), before, "the old key is untouched");

    // A private key readable by others is refused.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = op(&["sign", "--key", &key, "-"], Some(command().to_string().as_bytes()));
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("chmod 600"), "{}", out.stderr);
}

#[test]
fn sign_adds_timestamp_and_verify_accepts_then_rejects_tampering() {
    let dir = HostDir::new();
    let (key, public) = keys(&dir);
    let signed = sign(&key, &command());
    assert!(signed["timestamp"].is_string() && signed["signature"].is_string(), "{signed}");
    let out = verify(&public, signed.to_string().as_bytes());
    assert_eq!(out.code, 0, "{} {}", out.stdout, out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["valid"], true);

    // Tampered parameters, action, executor: each breaks the signature.
    for (path, value) in [
        ("/parameters/ports", json!([22, 80, 443])),
        ("/action", json!("remove_executor")),
        ("/executor", json!("other")),
    ] {
        let mut bad = signed.clone();
        *bad.pointer_mut(path).unwrap() = value;
        let out = verify(&public, bad.to_string().as_bytes());
        assert_eq!(out.code, 1, "{path}: {}", out.stdout);
        let v: Value = serde_json::from_str(&out.stdout).unwrap();
        assert_eq!(v["signature"], "bad signature", "{path}");
    }
    // Unsigned.
    let out = verify(&public, command().to_string().as_bytes());
    assert_eq!(out.code, 1);
    assert!(out.stdout.contains("missing signature"), "{}", out.stdout);
    // Signed by another key.
    let other = HostDir::new();
    let (other_key, _) = keys(&other);
    let out = verify(&public, sign(&other_key, &command()).to_string().as_bytes());
    assert_eq!(out.code, 1);
    // Re-serialised with other key order and whitespace: still valid (canonical form).
    let pretty = serde_json::to_string_pretty(&signed).unwrap();
    assert_eq!(verify(&public, pretty.as_bytes()).code, 0);
}

#[test]
fn timestamps_six_minutes_old_or_ahead_are_rejected() {
    let dir = HostDir::new();
    let (key, public) = keys(&dir);
    for (offset, word) in [(-360, "behind"), (360, "ahead")] {
        let mut cmd = command();
        cmd["timestamp"] = json!(timestamp(offset));
        let signed = sign(&key, &cmd);
        assert_eq!(signed["timestamp"], cmd["timestamp"], "sign keeps an existing timestamp");
        let out = verify(&public, signed.to_string().as_bytes());
        assert_eq!(out.code, 1, "{offset}: {}", out.stdout);
        let v: Value = serde_json::from_str(&out.stdout).unwrap();
        assert_eq!(v["signature"], "valid");
        assert!(v["timestamp"].as_str().unwrap().contains(word), "{v}");
    }
    let mut cmd = command();
    cmd["timestamp"] = json!(timestamp(-120));
    assert_eq!(verify(&public, sign(&key, &cmd).to_string().as_bytes()).code, 0, "2 minutes is within the window");
    // A timestamp that is no date-time (a day that does not exist, an offset out of range,
    // not a string) is refused by `sign` (exit 2: the command could never verify).
    for bad in
        [json!("yesterday"), json!("2026-02-30T00:00:00Z"), json!("2026-04-28T12:00:00+99:00"), json!(1_777_377_600)]
    {
        let mut cmd = command();
        cmd["timestamp"] = bad.clone();
        let out = op(&["sign", "--key", &key, "-"], Some(cmd.to_string().as_bytes()));
        assert_eq!((out.code, out.stdout.as_str()), (2, ""), "{bad}: {}", out.stderr);
        assert!(out.stderr.contains("timestamp") && out.stderr.contains(&bad.to_string()), "{bad}: {}", out.stderr);
    }
}

#[test]
fn malformed_commands_are_refused_cleanly() {
    let dir = HostDir::new();
    let (key, public) = keys(&dir);
    let deep = format!("{{\"a\":{}1{}}}", "[".repeat(100), "]".repeat(100));
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (br#"{"command_id":"a","command_id":"b"}"#.to_vec(), "duplicate key"),
        (br#"{"parameters":{"x":1,"x":2},"signature":"AA=="}"#.to_vec(), "duplicate key"),
        (vec![b'{', 0xc3, 0x28, b'}'], "UTF-8"),
        (deep.into_bytes(), "deep"),
        (b"[1, 2]".to_vec(), "JSON object"),
        (b"{\"a\": }".to_vec(), "not valid JSON"),
        (vec![b' '; agent::signing::MAX_COMMAND_BYTES + 10], "bytes"),
        // 100 000 deep: refused at the depth limit, no stack overflow.
        (format!("{{\"a\":{}1{}}}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(), "deep"),
        // An integer a double cannot hold: the signature would cover a different number.
        (br#"{"command_id":"c","n":9007199254740993}"#.to_vec(), "not exactly representable"),
    ];
    for (input, needle) in cases {
        for out in [op(&["sign", "--key", &key, "-"], Some(&input)), verify(&public, &input)] {
            assert_eq!(out.code, 2, "{needle}: {} {}", out.stdout, out.stderr);
            assert!(out.stdout.is_empty());
            assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
            assert!(out.stderr.contains(needle), "{needle}: {}", out.stderr);
        }
    }
    // A public key that is not one.
    let bogus = dir.path.join("bogus.pub");
    std::fs::write(&bogus, "not a key\n").unwrap();
    let out = verify(s(&bogus), b"{}");
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("not an Ed25519 public key"), "{}", out.stderr);
}

#[test]
fn openssl_keys_interoperate() {
    if !common::require("openssl binary", Command::new("openssl").arg("version").output().is_ok()) {
        return;
    }
    let dir = HostDir::new();
    let (key, public) = keys(&dir);
    // OpenSSL derives the same public key from our private key…
    let derived = Command::new("openssl").args(["pkey", "-in", &key, "-pubout"]).output().unwrap();
    assert!(derived.status.success(), "{}", String::from_utf8_lossy(&derived.stderr));
    assert_eq!(String::from_utf8_lossy(&derived.stdout), std::fs::read_to_string(&public).unwrap());
    // …and a key OpenSSL generates signs commands we verify.
    let okey = dir.path.join("openssl.key");
    let opub = dir.path.join("openssl.pub");
    assert!(Command::new("openssl")
        .args(["genpkey", "-algorithm", "ed25519", "-out", s(&okey)])
        .status()
        .unwrap()
        .success());
    std::fs::set_permissions(&okey, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(Command::new("openssl")
        .args(["pkey", "-in", s(&okey), "-pubout", "-out", s(&opub)])
        .status()
        .unwrap()
        .success());
    let signed = sign(s(&okey), &command());
    assert_eq!(verify(s(&opub), signed.to_string().as_bytes()).code, 0);
}

/// A small gzip archive (its content does not matter for signing).
fn archive(dir: &HostDir, name: &str) -> String {
    let src = dir.path.join("pkgsrc");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("manifest.json"), "{}").unwrap();
    let path = dir.path.join(name);
    let st = Command::new("tar").args(["czf", s(&path), "-C", s(&dir.path), "pkgsrc"]).status().unwrap();
    assert!(st.success());
    s(&path).to_string()
}

#[test]
fn packages_are_signed_into_a_sig_file_and_verified() {
    let dir = HostDir::new();
    let (key, public) = keys(&dir);
    let pkg = archive(&dir, "pkg.tar.gz");
    let out = op(&["sign", "--key", &key, "--package", &pkg], None);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let sig = format!("{pkg}.sig");
    assert_eq!(out.stdout.trim(), sig);
    // One line of base64: 64 bytes of signature.
    let text = std::fs::read_to_string(&sig).unwrap();
    assert_eq!(text.trim().len(), 88, "{text:?}");
    let out = op(&["verify", "--pub", &public, "--package", &pkg], None);
    assert_eq!(out.code, 0, "{} {}", out.stdout, out.stderr);
    assert!(out.stdout.contains("signature: valid"), "{}", out.stdout);
    let out = op(&["verify", "--pub", &public, "--package", &pkg, "--json"], None);
    let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!((v["valid"].clone(), v["signature"].clone()), (json!(true), json!("valid")), "{v}");

    // Tampered archive (one byte more): exit 1.
    let tampered = format!("{pkg}.tampered.tar.gz");
    let mut bytes = std::fs::read(&pkg).unwrap();
    bytes.push(0);
    std::fs::write(&tampered, &bytes).unwrap();
    let out = op(&["verify", "--pub", &public, "--package", &tampered, "--signature", &sig], None);
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(out.stdout.contains("INVALID"), "{}", out.stdout);
    // A signature file of raw bytes (not base64, not UTF-8): a bad signature, exit 1.
    let raw_sig = dir.path.join("raw.sig");
    std::fs::write(&raw_sig, [0xff, 0xfe, 0x00, 0x80]).unwrap();
    let out = op(&["verify", "--pub", &public, "--package", &pkg, "--signature", s(&raw_sig)], None);
    assert_eq!(out.code, 1, "{} {}", out.stdout, out.stderr);
    assert!(out.stdout.contains("INVALID") && out.stdout.contains("base64"), "{}", out.stdout);
    // No signature file: exit 1, saying so.
    let out = op(&["verify", "--pub", &public, "--package", &tampered], None);
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(out.stdout.contains("MISSING"), "{}", out.stdout);
    // Another key: exit 1.
    let other = HostDir::new();
    let (_, other_pub) = keys(&other);
    let out = op(&["verify", "--pub", &other_pub, "--package", &pkg], None);
    assert_eq!(out.code, 1, "{}", out.stdout);
    // A signature file that is not one: exit 1 with the reason.
    let junk = dir.path.join("junk.sig");
    std::fs::write(&junk, "not base64 at all!\n").unwrap();
    let out = op(&["verify", "--pub", &public, "--package", &pkg, "--signature", s(&junk)], None);
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(out.stdout.contains("base64"), "{}", out.stdout);

    // Re-signing replaces the file atomically; nothing else is left beside it.
    assert_eq!(op(&["sign", "--key", &key, "--package", &pkg], None).code, 0);
    let left: Vec<String> = std::fs::read_dir(&dir.path)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // Bad input: exit 2 and a reason naming it; no signature written.
    let out = op(&["sign", "--key", &key, "--package", s(&dir.path.join("pkgsrc"))], None);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("a directory cannot be signed"), "{}", out.stderr);
    assert!(!dir.path.join("pkgsrc.sig").exists());
    let notes = dir.path.join("notes.txt");
    std::fs::write(&notes, "x").unwrap();
    let out = op(&["sign", "--key", &key, "--package", s(&notes)], None);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains(".tar.gz"), "{}", out.stderr);
    assert!(!dir.path.join("notes.txt.sig").exists());
    // Bytes that are not an archive — a command's canonical JSON, whose signature with the
    // same key would be that command's — are not signed.
    let fake = dir.path.join("command.tar.gz");
    std::fs::write(&fake, serde_json::to_vec(&command()).unwrap()).unwrap();
    let out = op(&["sign", "--key", &key, "--package", s(&fake)], None);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("not a gzip or tar archive"), "{}", out.stderr);
    assert!(!dir.path.join("command.tar.gz.sig").exists());
    // Uncompressed archives, POSIX and old v7 (no `ustar` magic), are signed.
    for format in ["posix", "v7"] {
        let tar = dir.path.join(format!("pkg-{format}.tar"));
        let st = Command::new("tar")
            .args([&format!("--format={format}"), "-cf", s(&tar), "-C", s(&dir.path), "pkgsrc"])
            .status()
            .unwrap();
        assert!(st.success());
        let out = op(&["sign", "--key", &key, "--package", s(&tar)], None);
        assert_eq!(out.code, 0, "{format}: {}", out.stderr);
    }
    let out = op(&["sign", "--key", &public, "--package", &pkg], None);
    assert_eq!(out.code, 2, "a public key does not sign: {}", out.stderr);
    let out = op(&["verify", "--pub", &public, "--package", s(&dir.path.join("absent.tar.gz"))], None);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("absent.tar.gz"), "{}", out.stderr);
    let out = op(&["sign", "--key", &key], None);
    assert_eq!(out.code, 2, "neither a command nor --package: {}", out.stderr);
}

#[test]
fn sign_package_out_never_overwrites_the_key_the_package_or_other_files() {
    use std::os::unix::fs::MetadataExt;
    let dir = HostDir::new();
    let (key, _public) = keys(&dir);
    let pkg = archive(&dir, "pkg.tar.gz");
    let key_before = std::fs::read(&key).unwrap();
    let pkg_before = std::fs::read(&pkg).unwrap();
    let notes = dir.file("notes.txt", "keep me\n", 0o644);
    let key_link = dir.path.join("key-link");
    std::fs::hard_link(&key, &key_link).unwrap();
    let sym = dir.path.join("sym.sig");
    std::os::unix::fs::symlink(&notes, &sym).unwrap();
    for (target, says) in [
        (key.as_str(), "signing key"),
        (s(&key_link), "signing key"),
        (pkg.as_str(), "the package"),
        (s(&notes), "does not hold a signature"),
        (s(&sym), "not a regular file"),
        (s(&dir.path), "not a regular file"),
    ] {
        let out = op(&["sign", "--key", &key, "--package", &pkg, "--out", target], None);
        assert_eq!(out.code, 2, "--out {target}: {} {}", out.stdout, out.stderr);
        assert!(out.stderr.contains(target) && out.stderr.contains(says), "--out {target}: {}", out.stderr);
    }
    assert_eq!(std::fs::read(&key).unwrap(), key_before, "the key was overwritten");
    assert_eq!(std::fs::metadata(&key).unwrap().mode() & 0o777, 0o600);
    assert_eq!(std::fs::read(&pkg).unwrap(), pkg_before, "the package was overwritten");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "keep me\n");
    assert!(std::fs::symlink_metadata(&sym).unwrap().file_type().is_symlink());

    // A new file, then the same file again (it holds a previous signature): replaced.
    let sig = dir.path.join("elsewhere.sig");
    for _ in 0..2 {
        let out = op(&["sign", "--key", &key, "--package", &pkg, "--out", s(&sig)], None);
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert_eq!(std::fs::read_to_string(&sig).unwrap().trim().len(), 88);
    }

    // --out without --package: refused, nothing written.
    let cmd = dir.file("cmd.json", &command().to_string(), 0o644);
    let dest = dir.path.join("signed.json");
    let out = op(&["sign", "--key", &key, "--out", s(&dest), s(&cmd)], None);
    assert_eq!(out.code, 2, "{} {}", out.stdout, out.stderr);
    assert!(out.stderr.contains("--out") && out.stderr.contains("--package"), "{}", out.stderr);
    assert!(out.stdout.is_empty() && !dest.exists());
}

#[test]
fn package_signatures_are_plain_ed25519_as_openssl_makes_them() {
    if !common::require("openssl binary", Command::new("openssl").arg("version").output().is_ok()) {
        return;
    }
    let dir = HostDir::new();
    let (key, public) = keys(&dir);
    let pkg = archive(&dir, "pkg.tar.gz");
    // OpenSSL signs the archive's bytes (pure Ed25519) — and we accept that signature…
    let raw = dir.path.join("raw.sig");
    let st = Command::new("openssl")
        .args(["pkeyutl", "-sign", "-rawin", "-inkey", &key, "-in", &pkg, "-out", s(&raw)])
        .status()
        .unwrap();
    assert!(st.success());
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&raw).unwrap());
    std::fs::write(format!("{pkg}.sig"), format!("{b64}\n")).unwrap();
    let out = op(&["verify", "--pub", &public, "--package", &pkg], None);
    assert_eq!(out.code, 0, "{}", out.stdout);
    // …and OpenSSL verifies ours.
    assert_eq!(op(&["sign", "--key", &key, "--package", &pkg], None).code, 0);
    let ours = base64::engine::general_purpose::STANDARD
        .decode(std::fs::read_to_string(format!("{pkg}.sig")).unwrap().trim())
        .unwrap();
    std::fs::write(&raw, ours).unwrap();
    let st = Command::new("openssl")
        .args(["pkeyutl", "-verify", "-rawin", "-pubin", "-inkey", &public, "-in", &pkg, "-sigfile", s(&raw)])
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stdout));
}

#[test]
fn a_full_stdout_is_exit_2_naming_stdout_never_a_panic() {
    let dir = HostDir::new();
    let (key, public) = keys(&dir);
    let signed = sign(&key, &command()).to_string();
    let pkg = archive(&dir, "pkg.tar.gz");
    let cmd = command().to_string();
    let cases: Vec<(Vec<&str>, Option<&[u8]>)> = vec![
        (vec!["sign", "--key", &key, "-"], Some(cmd.as_bytes())),
        (vec!["verify", "--pub", &public, "-"], Some(signed.as_bytes())),
        (vec!["verify", "--pub", &public, "--json", "-"], Some(signed.as_bytes())),
        (vec!["sign", "--key", &key, "--package", &pkg], None),
        (vec!["verify", "--pub", &public, "--package", &pkg], None),
        (vec!["doctor"], None),
        (vec!["doctor", "--json"], None),
    ];
    for (args, stdin) in &cases {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").expect("/dev/full");
        let Out { code, stderr, .. } = op_with(args, *stdin, Stdio::from(full));
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains("stdout") && stderr.contains("No space left"), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
    }
    // A closed descriptor 1 stays as it was: the output is dropped, the status is the command's.
    let out = Command::new("/bin/sh")
        .args(["-c", "exec \"$0\" verify --pub \"$1\" --package \"$2\" >&-", common::opservant(), &public, &pkg])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

/// An error message that cannot be written (stderr full) is dropped; the exit status is the
/// command's own — never an abort from a panic in the message's printing.
#[test]
fn a_full_stderr_keeps_the_exit_status_and_never_panics() {
    let dir = HostDir::new();
    let (key, _public) = keys(&dir);
    let cases: Vec<(Vec<&str>, i32)> = vec![
        (vec!["verify", "--pub", "/nonexistent/key.pub", "-"], 2),
        (vec!["run", "/nonexistent/executor"], 2),
        (vec!["sign", "--key", &key, "--package", "/nonexistent/pkg.tar.gz"], 2),
        (vec!["executor", "lint", "/nonexistent/executor"], 2),
    ];
    for (args, want) in &cases {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").expect("/dev/full");
        let out = common::command()
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(full))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(*want), "{args:?}: {:?}", out.status);
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    }
}

#[test]
fn keygen_on_a_full_disk_leaves_nothing_behind_and_a_retry_succeeds() {
    if !common::require_root() {
        return;
    }
    if !common::require("unshare(1)", Command::new("unshare").arg("--version").output().is_ok()) {
        return;
    }
    let dir = HostDir::new();
    // A small tmpfs in a private mount namespace (gone with the shell), filled to the last page.
    let script = r#"set -u
mount -t tmpfs -o size=64k,mode=0755 tmpfs "$1" || exit 99
mkdir "$1/keys"
dd if=/dev/zero of="$1/fill" bs=4096 2>/dev/null
err=$("$0" keygen --out "$1/keys" 2>&1 >/dev/null); echo "first=$?"
echo "left=$(ls -A "$1/keys" | tr '\n' ' ')"
echo "err=$err"
rm "$1/fill"
"$0" keygen --out "$1/keys" >/dev/null 2>&1; echo "second=$?"
echo "now=$(ls -A "$1/keys" | tr '\n' ' ')"
"#;
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "/bin/sh", "-c", script, common::opservant(), dir.str()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text} {}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "first=2", "{text}");
    assert_eq!(lines[1].trim_end(), "left=", "a partial key was left behind: {text}");
    assert!(lines[2].contains("signing.") && lines[2].contains("No space left"), "{text}");
    assert_eq!(lines[3], "second=0", "the retry was refused: {text}");
    assert_eq!(lines[4].trim_end(), "now=signing.key signing.pub", "{text}");
}

#[test]
fn key_files_must_be_small_regular_files() {
    let dir = HostDir::new();
    let (key, _public) = keys(&dir);
    let signed = sign(&key, &command()).to_string();
    let fifo = dir.path.join("fifo.pub");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let big = dir.path.join("big.pub");
    std::fs::File::create(&big).unwrap().set_len(3 << 30).unwrap(); // sparse: 3 GiB of zeros
    for (path, says) in [("/dev/zero", "not a regular file"), (s(&fifo), "not a regular file"), (s(&big), "too large")]
    {
        // Under timeout(1): before the fix a FIFO blocked forever and /dev/zero read without end.
        let out = Command::new("timeout")
            .args(["-k", "5", "30", common::opservant(), "verify", "--pub", path, "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                let _ = c.stdin.take().unwrap().write_all(signed.as_bytes());
                c.wait_with_output()
            })
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{path}: {stderr}");
        assert!(stderr.contains(path) && stderr.contains(says), "{path}: {stderr}");
    }
    let out = op(&["sign", "--key", "/dev/zero", "-"], Some(command().to_string().as_bytes()));
    assert_eq!(out.code, 2, "{}", out.stderr);
}

/// `submit` of an empty command says so (exit 2) before it reaches for the agent, instead of
/// "the agent closed the connection without a reply" (an empty connection is the agent's
/// liveness probe, answered with nothing).
#[test]
fn submitting_an_empty_command_is_refused_naming_it() {
    let dir = HostDir::new();
    let empty = dir.file("empty.json", " \n", 0o644);
    let out = op(&["submit", s(&empty), "--socket", s(&dir.path.join("no-agent.sock"))], None);
    assert_eq!((out.code, out.stdout.as_str()), (2, ""), "{}", out.stderr);
    assert!(out.stderr.contains("empty.json: the command is empty"), "{}", out.stderr);
}

/// Every file the command line or the configuration names as a file of a kind (a manifest,
/// a script, a configuration, the audit log, an archive, a signature) must be a regular file:
/// a FIFO is refused at once, naming it, with exit 2 — before, each of these blocked for ever
/// in `open` or `read` — and `/dev/zero` as a configuration is refused instead of read.
/// (`--params @FILE` and a command read from a path may be FIFOs: they are data, e.g. `<(…)`.)
#[test]
fn files_of_a_kind_must_be_regular_files_and_a_fifo_never_blocks() {
    let dir = HostDir::new();
    let (key, public) = keys(&dir);
    let fifo = |name: &str| {
        let p = dir.path.join(name);
        assert!(Command::new("mkfifo").args(["-m", "600"]).arg(&p).status().unwrap().success());
        s(&p).to_string()
    };
    let executor = dir.path.join("executor");
    std::fs::create_dir(&executor).unwrap();
    let manifest = fifo("executor/manifest.json");
    let script = fifo("script.py");
    let config = fifo("config.yaml");
    let audit_log = fifo("audit.jsonl");
    let audit_config = dir.file("audit.yaml", &format!("audit:\n  path: {audit_log}\n"), 0o600);
    let archive = fifo("package.tar.gz");
    let signature = fifo("good.tar.gz.sig");
    let good = dir.path.join("good.tar.gz");
    let packaged = Path::new(env!("CARGO_MANIFEST_DIR")).join("../executors");
    assert!(Command::new("tar").args(["czf", s(&good), "-C", s(&packaged), "disk-usage"]).status().unwrap().success());
    let plain_script = dir.file("plain.py", "print(1)\n", 0o644);
    let disk_usage = s(&packaged.join("disk-usage")).to_string();
    let cases: Vec<(Vec<&str>, &str, &str)> = vec![
        (vec!["run", s(&executor)], &manifest, "not a regular file"),
        (vec!["executor", "lint", s(&executor)], &manifest, "not a regular file"),
        (vec!["script", "python", &script], &script, "not a regular file"),
        (vec!["script", "python", s(&plain_script), "--manifest", &manifest], &manifest, "not a regular file"),
        (vec!["run", &disk_usage, "--config", &config], &config, "not a regular file"),
        (vec!["run", &disk_usage, "--config", "/dev/zero"], "/dev/zero", "not a regular file"),
        (vec!["run", &disk_usage, "--config", s(&audit_config)], &audit_log, "not a regular file"),
        (vec!["audit", "verify", "--config", s(&audit_config)], &audit_log, "not a regular file"),
        (vec!["audit", "tail", "--config", s(&audit_config)], &audit_log, "not a regular file"),
        (vec!["audit", "tail", "--follow", "--config", s(&audit_config)], &audit_log, "not a regular file"),
        (vec!["sign", "--key", &key, "--package", &archive], &archive, "not a file"),
        (vec!["verify", "--pub", &public, "--package", &archive], &archive, "not a file"),
        (
            vec!["verify", "--pub", &public, "--package", s(&good), "--signature", &signature],
            &signature,
            "not a regular file",
        ),
    ];
    for (args, path, says) in cases {
        // Under timeout(1), so that a regression fails here instead of hanging the suite.
        let out = Command::new("timeout")
            .args(["-k", "5", "30", common::opservant()])
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(path) && stderr.contains(says), "{args:?}: {stderr}");
    }
}
