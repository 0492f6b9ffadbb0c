//! Signed commands through the production verification (`agent::command::verify_command`,
//! which `Pipeline::handle` uses): size → strict parse → Ed25519 → clock skew → command_id.
//! Properties: every rejection carries one of the known reason codes for its stage; a command
//! accepted has a valid verdict and re-serialises canonically (its RFC 8785 form parses back
//! to the same command and verifies again); and any command the strict parser accepts, once
//! signed, verifies.
//!
//! The key is fixed ([7; 32]) and so is the clock (2026-04-28T12:00:00Z): the seed corpus
//! holds commands signed with them (fuzz/seeds/command/).
#![no_main]

use agent::command::{verify_command, Reason, Verification};
use agent::signing;
use ed25519_dalek::SigningKey;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const NOW: &str = "2026-04-28T12:00:00Z";

fn check(
    bytes: &[u8],
    key: &ed25519_dalek::VerifyingKey,
    now: i64,
) -> Option<(serde_json::Map<String, Value>, String)> {
    match verify_command(bytes, key, now) {
        Verification::Unreadable(r) => {
            assert!(matches!(r.reason, Reason::TooLarge | Reason::Malformed), "{r:?}");
            assert!(Reason::ALL.contains(&r.reason) && !r.message.is_empty());
            None
        }
        Verification::Checked { cmd, verdict, outcome } => {
            let id = cmd.get("command_id").and_then(Value::as_str).map(str::to_string);
            match outcome {
                Err(r) => {
                    assert!(
                        matches!(
                            r.reason,
                            Reason::Unsigned | Reason::BadSignature | Reason::ClockSkew | Reason::Malformed
                        ),
                        "{r:?}"
                    );
                    assert!(!r.message.is_empty());
                    assert_eq!(r.command_id, id);
                    match r.reason {
                        Reason::Unsigned | Reason::BadSignature => assert!(verdict.signature.is_err()),
                        Reason::ClockSkew => assert!(verdict.signature.is_ok() && verdict.timestamp.is_err()),
                        _ => assert!(verdict.valid()),
                    }
                    None
                }
                Ok(accepted) => {
                    assert!(verdict.valid(), "{verdict:?}");
                    assert_eq!(Some(&accepted), id.as_ref());
                    assert!(!accepted.is_empty() && accepted.len() <= 256);
                    // What was signed (the canonical form) is what is acted on: it parses
                    // back to the very command accepted.
                    let canonical = serde_json_canonicalizer::to_vec(&Value::Object(cmd.clone())).expect("canonical");
                    assert_eq!(
                        signing::parse_command(&canonical).as_ref(),
                        Ok(&cmd),
                        "canonical form {} is not the command accepted",
                        String::from_utf8_lossy(&canonical)
                    );
                    Some((cmd, accepted))
                }
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let key = SigningKey::from_bytes(&[7u8; 32]);
    let vk = key.verifying_key();
    let now = signing::parse_rfc3339(NOW).expect("NOW is RFC 3339");

    // 1. The bytes as received.
    if let Some((cmd, id)) = check(data, &vk, now) {
        // Accepted: its canonical form is the same command and verifies again.
        let canonical = serde_json_canonicalizer::to_vec(&Value::Object(cmd.clone())).expect("canonical form");
        let again = check(&canonical, &vk, now).expect("canonical form of an accepted command is accepted");
        assert_eq!(again, (cmd, id));
    }

    // 2. Anything the strict parser takes, signed now, verifies (sign and verify agree on
    //    the canonical form of every command, whatever it holds).
    if let Ok(mut cmd) = signing::parse_command(data) {
        cmd.insert("timestamp".into(), Value::String(NOW.into()));
        if !cmd.get("command_id").and_then(Value::as_str).is_some_and(|i| !i.is_empty() && i.len() <= 256) {
            cmd.insert("command_id".into(), Value::String("fuzz".into()));
        }
        if signing::sign(&mut cmd, &key, now).is_ok() {
            let bytes = serde_json::to_vec(&Value::Object(cmd.clone())).expect("serialise");
            if bytes.len() <= signing::MAX_COMMAND_BYTES {
                let (got, _) = check(&bytes, &vk, now).expect("a command signed now verifies");
                assert_eq!(got, cmd, "the verified command is the signed one");
            }
        }
    }
});
