//! Seccomp: profiles are data (`policies/seccomp/*.json`, in seccompiler's JSON format),
//! compiled once in the parent and shipped to the sandbox as raw BPF; the payload installs
//! them as the very last step before `execve` (with `seccompiler::apply_filter`).
//!
//! A profile may hold several filters; they are installed in lexical order of their names.
//! The kernel evaluates every installed filter and applies the most restrictive verdict; for
//! two `ERRNO` verdicts the most recently installed filter's errno wins, which is how the
//! default profile answers `clone3` with `ENOSYS` while its allowlist answers `EPERM`.
//!
//! Code generation: seccompiler dispatches on the syscall number with one linear chain (1447
//! instructions for the default allowlist), which costs ~550 µs per sandbox to load, mostly
//! in the kernel's per-syscall action-cache emulation. This module emits the same decisions
//! as a binary search over contiguous *ranges* of syscall numbers (~110 instructions, ~30 µs).
//! seccompiler stays the reference: the tests run both programs through a BPF interpreter
//! over every syscall number, both architectures and edge-case arguments and require
//! identical verdicts. The build script compiles the default profile ahead of time, so a
//! sandbox start pays neither the JSON parse nor the code generation. Like seccompiler, every filter starts with an architecture check that
//! kills the process on a foreign architecture (i386 `int 0x80` on x86_64); x32 system calls
//! carry a flag in the number and so never match a rule.

pub mod compiler;

use seccompiler::sock_filter;

use crate::error::{Stage, StepError};
use crate::spec::SeccompPolicy;
#[cfg(test)]
use compiler::Insn;

/// The default profile (see `policies/seccomp/README.md`).
pub const DEFAULT_PROFILE_JSON: &str = include_str!("../../../policies/seccomp/default.json");

/// Compile a JSON profile for the running architecture.
pub fn compile(name: &str, json: &str) -> Result<SeccompPolicy, String> {
    let filters = compiler::compile_profile(json).map_err(|e| format!("seccomp profile '{name}': {e}"))?;
    Ok(SeccompPolicy::Enforced { profile: name.to_string(), filters: filters.into_iter().map(|(_, f)| f).collect() })
}

// `DEFAULT_FILTERS: Option<&[&[u64]]>`, compiled by build.rs from `DEFAULT_PROFILE_JSON`
// (None when cross-compiling: the build host's syscall numbers would be wrong).
include!(concat!(env!("OUT_DIR"), "/default_seccomp.rs"));

/// The default profile, compiled (ahead of time when possible).
pub fn default_policy() -> Result<SeccompPolicy, String> {
    match DEFAULT_FILTERS {
        Some(filters) => Ok(SeccompPolicy::Enforced {
            profile: "default".into(),
            filters: filters.iter().map(|f| f.to_vec()).collect(),
        }),
        None => compile("default", DEFAULT_PROFILE_JSON),
    }
}

fn unpack(v: u64) -> sock_filter {
    let i = compiler::Insn::unpack(v);
    sock_filter { code: i.code, jt: i.jt, jf: i.jf, k: i.k }
}

/// Install every filter of `policy` on the calling thread (sets `no_new_privs` first).
/// Returns the number of filters installed.
pub fn install(policy: &SeccompPolicy) -> Result<usize, StepError> {
    let SeccompPolicy::Enforced { filters, profile } = policy else { return Ok(0) };
    for (i, f) in filters.iter().enumerate() {
        let prog: Vec<sock_filter> = f.iter().copied().map(unpack).collect();
        seccompiler::apply_filter(&prog)
            .map_err(|e| StepError::new(Stage::Seccomp, format!("profile '{profile}' filter {i}: {e}")))?;
    }
    Ok(filters.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use compiler::{AUDIT_ARCH, BPF_AND_K, BPF_JA, BPF_JEQ_K, BPF_JGE_K, BPF_JGT_K, BPF_LD_W_ABS, BPF_RET_K};

    /// A classic-BPF interpreter for seccomp programs (the subset both compilers emit).
    fn run(prog: &[Insn], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_ne_bytes());
        data[4..8].copy_from_slice(&arch.to_ne_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
        }
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let ins = &prog[pc];
            pc += 1;
            match ins.code {
                BPF_LD_W_ABS => {
                    let k = ins.k as usize;
                    acc = u32::from_ne_bytes(data[k..k + 4].try_into().unwrap());
                }
                BPF_AND_K => acc &= ins.k,
                BPF_JA => pc += ins.k as usize,
                BPF_JEQ_K | BPF_JGT_K | BPF_JGE_K => {
                    let t = match ins.code {
                        BPF_JEQ_K => acc == ins.k,
                        BPF_JGT_K => acc > ins.k,
                        _ => acc >= ins.k,
                    };
                    pc += usize::from(if t { ins.jt } else { ins.jf });
                }
                BPF_RET_K => return ins.k,
                c => panic!("interpreter: unsupported opcode {c:#x} at {}", pc - 1),
            }
        }
    }

    fn programs(json: &str) -> (Vec<Vec<Insn>>, Vec<Vec<Insn>>) {
        let SeccompPolicy::Enforced { filters, .. } = compile("t", json).unwrap() else { panic!() };
        let ours = filters.iter().map(|f| f.iter().copied().map(Insn::unpack).collect()).collect();
        let arch = std::env::consts::ARCH.try_into().unwrap();
        let mut reference: Vec<_> =
            seccompiler::compile_from_json(json.as_bytes(), arch).unwrap().into_iter().collect();
        reference.sort_by(|a, b| a.0.cmp(&b.0));
        let conv =
            |p: Vec<sock_filter>| p.into_iter().map(|f| Insn { code: f.code, jt: f.jt, jf: f.jf, k: f.k }).collect();
        (ours, reference.into_iter().map(|(_, p)| conv(p)).collect())
    }

    #[test]
    fn precompiled_default_equals_runtime_compilation() {
        assert!(DEFAULT_FILTERS.is_some(), "the build script precompiles for native builds");
        assert_eq!(default_policy().unwrap(), compile("default", DEFAULT_PROFILE_JSON).unwrap());
    }

    fn arg_cases() -> Vec<[u64; 6]> {
        let mut v = vec![[0u64; 6]];
        let interesting: Vec<u64> = vec![
            1,
            2,
            10,
            16,
            17,
            0x5412,
            0x541C,
            0x1_0000_5412,
            0xffff_ffff_0000_5412,
            0x20000,
            0x10000000,
            0x10000000 | 0x20000,
            0x4000_0000,
            0x8000_0000,
            0x11,
            0x3d0f00,
            u64::MAX,
            0xffff_ffff,
            0x1_0000_0000,
            1 << 33,
        ];
        for &x in &interesting {
            for i in 0..3 {
                let mut a = [0u64; 6];
                a[i] = x;
                v.push(a);
            }
        }
        v
    }

    #[test]
    fn default_profile_matches_seccompiler_everywhere() {
        let (ours, reference) = programs(DEFAULT_PROFILE_JSON);
        assert_eq!(ours.len(), 3);
        assert_eq!(ours.len(), reference.len());
        let mut numbers: Vec<u32> = (0..=600).collect();
        numbers.extend([0x4000_0000, 0x4000_0001, 0x4000_0000 | 39, 0x4000_0000 | 435, 0xffff_ffff]);
        assert!(
            ours[0].len() * 8 < reference[0].len(),
            "allowlist: ours {} vs seccompiler {}",
            ours[0].len(),
            reference[0].len()
        );
        for (o, r) in ours.iter().zip(&reference) {
            for arch in [AUDIT_ARCH, 0x4000_0003] {
                for &nr in &numbers {
                    for args in arg_cases() {
                        assert_eq!(
                            run(o, arch, nr, args),
                            run(r, arch, nr, args),
                            "arch {arch:#x} nr {nr} args {args:x?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn qword_and_multi_condition_rules_match_seccompiler() {
        let json = r#"{
          "f": {"mismatch_action": "allow", "match_action": {"errno": 13}, "filter": [
            {"syscall": "read", "args": [{"index": 0, "type": "qword", "op": "gt", "val": 4294967300}]},
            {"syscall": "write", "args": [{"index": 1, "type": "qword", "op": "le", "val": 4294967296},
                                           {"index": 2, "type": "dword", "op": "ne", "val": 7}]},
            {"syscall": "write", "args": [{"index": 0, "type": "qword", "op": {"masked_eq": 18446744069414584320}, "val": 4294967296}]},
            {"syscall": "close", "args": [{"index": 3, "type": "qword", "op": "lt", "val": 17179869184}]},
            {"syscall": "openat", "args": [{"index": 1, "type": "qword", "op": "ge", "val": 5}]},
            {"syscall": "getpid"},
            {"syscall": "dup", "args": [{"index": 5, "type": "qword", "op": "eq", "val": 12884901890}]},
            {"syscall": "dup2", "args": [{"index": 0, "type": "qword", "op": "ne", "val": 3}]}
          ]}}"#;
        let (ours, reference) = programs(json);
        let mut cases = arg_cases();
        for x in [
            4294967299u64,
            4294967300,
            4294967301,
            4294967296,
            4294967295,
            7,
            17179869183,
            17179869184,
            12884901890,
            3,
            5,
            4,
        ] {
            for i in 0..6 {
                let mut a = [0u64; 6];
                a[i] = x;
                a[2] = 7;
                cases.push(a);
                a[2] = 0;
                cases.push(a);
            }
        }
        for nr in 0..=40 {
            for args in &cases {
                assert_eq!(
                    run(&ours[0], AUDIT_ARCH, nr, *args),
                    run(&reference[0], AUDIT_ARCH, nr, *args),
                    "nr {nr} {args:x?}"
                );
            }
        }
    }

    #[test]
    fn long_programs_use_far_jumps() {
        // Every 3rd syscall conditional: no ranges merge, the tree is deep and wide.
        let rules: Vec<String> = (0..300)
            .filter_map(syscalls::Sysno::new)
            .enumerate()
            .map(|(i, s)| {
                if i % 3 == 0 {
                    format!(r#"{{"syscall":"{}","args":[{{"index":0,"type":"dword","op":"eq","val":{i}}}]}}"#, s.name())
                } else if i % 3 == 1 {
                    format!(r#"{{"syscall":"{}"}}"#, s.name())
                } else {
                    String::new()
                }
            })
            .filter(|s| !s.is_empty())
            .collect();
        let json = format!(
            r#"{{"f":{{"mismatch_action":{{"errno":1}},"match_action":"allow","filter":[{}]}}}}"#,
            rules.join(",")
        );
        let (ours, reference) = programs(&json);
        for nr in 0..=320 {
            for a0 in [0u64, 1, u64::from(nr), 3 * u64::from(nr)] {
                let args = [a0, 0, 0, 0, 0, 0];
                assert_eq!(run(&ours[0], AUDIT_ARCH, nr, args), run(&reference[0], AUDIT_ARCH, nr, args), "nr {nr}");
            }
        }
    }

    #[test]
    fn pack_roundtrip() {
        let f = Insn { code: 0x15, jt: 3, jf: 250, k: 0xdead_beef };
        assert_eq!(Insn::unpack(f.pack()), f);
        let s = unpack(f.pack());
        assert_eq!((s.code, s.jt, s.jf, s.k), (f.code, f.jt, f.jf, f.k));
    }

    #[test]
    fn bad_profiles_are_errors() {
        assert!(compile("x", "{").is_err());
        assert!(compile("x", "{}").is_err());
        let unknown =
            r#"{"a":{"mismatch_action":"allow","match_action":"allow","filter":[{"syscall":"no_such_call"}]}}"#;
        assert!(compile("x", unknown).unwrap_err().contains("no_such_call"));
        let typo = r#"{"a":{"mismatch_action":"allow","match_action":"allow","filter":[{"syscal":"read"}]}}"#;
        assert!(compile("x", typo).is_err());
        let big = r#"{"a":{"mismatch_action":"allow","match_action":"allow","filter":[{"syscall":"read","args":[{"index":0,"type":"dword","op":"eq","val":4294967296}]}]}}"#;
        assert!(compile("x", big).unwrap_err().contains("dword"));
        let mixed = r#"{"a":{"mismatch_action":"allow","match_action":"allow","filter":[{"syscall":"read"},{"syscall":"read","args":[{"index":0,"type":"dword","op":"eq","val":1}]}]}}"#;
        assert!(compile("x", mixed).unwrap_err().contains("both"));
        let idx = r#"{"a":{"mismatch_action":"allow","match_action":"allow","filter":[{"syscall":"read","args":[{"index":6,"type":"dword","op":"eq","val":1}]}]}}"#;
        assert!(compile("x", idx).unwrap_err().contains("index"));
    }
}
