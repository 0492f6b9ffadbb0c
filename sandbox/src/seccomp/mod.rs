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

/// The filter the agent stacks on a profile in every sandbox
/// (`policies/seccomp/no-netlink.json`): netlink sockets refused.
pub const NO_NETLINK_PROFILE_JSON: &str = include_str!("../../../policies/seccomp/no-netlink.json");

/// `policy` with netlink sockets refused as well (`EAFNOSUPPORT`), by one more filter: what
/// the kernel queues on a netlink socket is charged to no memory cgroup, so a sandbox that
/// may open them holds host kernel memory past its limit. A disabled policy stays disabled.
pub fn refusing_netlink(policy: &SeccompPolicy) -> Result<SeccompPolicy, String> {
    let SeccompPolicy::Enforced { profile, filters } = policy else { return Ok(policy.clone()) };
    let extra: Vec<Vec<u64>> = match NO_NETLINK_FILTERS {
        Some(f) => f.iter().map(|f| f.to_vec()).collect(),
        None => compiler::compile_profile(NO_NETLINK_PROFILE_JSON)
            .map_err(|e| format!("seccomp profile 'no-netlink': {e}"))?
            .into_iter()
            .map(|(_, f)| f)
            .collect(),
    };
    let mut filters = filters.clone();
    filters.extend(extra);
    Ok(SeccompPolicy::Enforced { profile: format!("{profile}+no-netlink"), filters })
}

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
        let SeccompPolicy::Enforced { filters: plain, .. } = default_policy().unwrap() else { panic!() };
        let SeccompPolicy::Enforced { filters, profile } = refusing_netlink(&default_policy().unwrap()).unwrap() else {
            panic!()
        };
        let SeccompPolicy::Enforced { filters: extra, .. } = compile("no-netlink", NO_NETLINK_PROFILE_JSON).unwrap()
        else {
            panic!()
        };
        assert_eq!(profile, "default+no-netlink");
        assert_eq!(
            filters,
            [plain, extra].concat(),
            "the profile's filters, then the no-netlink one, as compiled at run time"
        );
        assert_eq!(refusing_netlink(&SeccompPolicy::Disabled).unwrap(), SeccompPolicy::Disabled);
    }

    #[test]
    fn the_no_netlink_filter_refuses_netlink_sockets_only() {
        let (ours, reference) = programs(NO_NETLINK_PROFILE_JSON);
        assert_eq!(ours.len(), 1);
        let socket = libc::SYS_socket as u32;
        // AF_NETLINK (16), whatever the protocol, and with high bits the kernel drops.
        for family in [16u64, 1 << 32 | 16] {
            assert_eq!(run(&ours[0], AUDIT_ARCH, socket, [family, 3, 0, 0, 0, 0]), libc::SECCOMP_RET_ERRNO | 97);
        }
        for (nr, args) in [(socket, [2u64, 1, 0, 0, 0, 0]), (socket, [1, 1, 0, 0, 0, 0]), (0, [16, 0, 0, 0, 0, 0])] {
            assert_eq!(run(&ours[0], AUDIT_ARCH, nr, args), libc::SECCOMP_RET_ALLOW, "nr {nr} args {args:?}");
        }
        for nr in 0..=450u32 {
            for args in arg_cases() {
                assert_eq!(run(&ours[0], AUDIT_ARCH, nr, args), run(&reference[0], AUDIT_ARCH, nr, args), "nr {nr}");
            }
        }
    }

    fn arg_cases() -> Vec<[u64; 6]> {
        let mut v = vec![[0u64; 6]];
        let interesting: Vec<u64> = vec![
            0o4755,
            0o2755,
            0o1777,
            0o755,
            1 << 32 | 0o4000,
            1,
            2,
            6,
            10,
            16,
            17,
            58,
            132,
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
            // Every argument a rule looks at (openat's mode is its fourth).
            for i in 0..4 {
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
        assert_eq!(ours.len(), 2);
        assert_eq!(ours.len(), reference.len());
        let mut numbers: Vec<u32> = (0..=600).collect();
        numbers.extend([0x4000_0000, 0x4000_0001, 0x4000_0000 | 39, 0x4000_0000 | 435, 0xffff_ffff]);
        assert!(
            ours[0].len() * 5 < reference[0].len(),
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
        // A profile that means something other than it reads: a filter named twice (a map
        // keeps the last), an errno the 16-bit action data would cut to 0 ("success").
        let one = r#"{"mismatch_action":{"errno":1},"match_action":"allow","filter":[{"syscall":"read"}]}"#;
        let twice = format!(r#"{{"a":{one},"a":{one}}}"#);
        assert!(compile("x", &twice).unwrap_err().contains("defined twice"));
        for errno in [0u32, 4096, 65536] {
            let big = one.replace(r#"{"errno":1}"#, &format!(r#"{{"errno":{errno}}}"#));
            let e = compile("x", &format!(r#"{{"a":{big}}}"#)).unwrap_err();
            assert!(e.contains("not an error number"), "{errno}: {e}");
        }
        let trace = one.replace(r#"{"errno":1}"#, r#"{"trace":65536}"#);
        assert!(compile("x", &format!(r#"{{"a":{trace}}}"#)).unwrap_err().contains("16 bits"));
        let dup_field = r#"{"a":{"mismatch_action":"allow","mismatch_action":{"errno":1},"match_action":"allow","filter":[{"syscall":"read"}]}}"#;
        assert!(compile("x", dup_field).is_err());
    }

    // --- The default profile in the real kernel ------------------------------------------

    /// What one probe child observed.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Outcome {
        /// The call returned this non-negative value.
        Ret(i64),
        /// The call failed with this errno.
        Errno(i32),
        /// The child was killed by this signal.
        Signal(i32),
        /// The child exited without reporting (status), e.g. a filter did not install.
        Lost(i32),
    }

    /// What a probe must observe.
    #[derive(Debug, Clone, Copy)]
    enum Want {
        /// Any non-negative return value.
        Success,
        /// One of these errnos.
        Errno(&'static [i32]),
        /// Success or one of these errnos (a harmless outcome that is not a refusal).
        SuccessOr(&'static [i32]),
        /// Killed by this signal.
        Signal(i32),
    }

    impl Want {
        fn accepts(self, o: Outcome) -> bool {
            match (self, o) {
                (Want::Success | Want::SuccessOr(_), Outcome::Ret(_)) => true,
                (Want::Errno(set) | Want::SuccessOr(set), Outcome::Errno(e)) => set.contains(&e),
                (Want::Signal(s), Outcome::Signal(got)) => s == got,
                _ => false,
            }
        }

        /// A refusal by the filter (as opposed to an allowed call reaching the kernel).
        fn is_refusal(self) -> bool {
            match self {
                Want::Errno(set) => set.contains(&libc::EPERM) || set.contains(&libc::ENOSYS),
                Want::Signal(_) => true,
                Want::Success | Want::SuccessOr(_) => false,
            }
        }
    }

    #[derive(Debug, Clone, Copy)]
    enum Call {
        /// `syscall(nr, args…)`.
        Sys(i64, [u64; 6]),
        /// i386 `int 0x80` with this syscall number in eax (no arguments).
        Int80(u32),
    }

    struct Probe {
        name: &'static str,
        call: Call,
        /// Outcome with the default profile installed.
        filtered: Want,
        /// Outcome of the identical call without it, as root with all capabilities.
        control: Want,
    }

    const EPERM_ONLY: Want = Want::Errno(&[libc::EPERM]);

    fn sys(nr: i64, args: &[u64]) -> Call {
        let mut a = [0u64; 6];
        a[..args.len()].copy_from_slice(args);
        Call::Sys(nr, a)
    }

    /// The probe child: runs after `fork()` in a copy of the multi-threaded test process,
    /// so it only makes raw system calls on data prepared before the fork, reports through
    /// `wfd` and never returns.
    ///
    /// # Safety
    /// Must only be called in a freshly forked child; pointers in `call` must be valid.
    unsafe fn probe_child(call: Call, filters: Option<&[Vec<sock_filter>]>, wfd: i32) -> ! {
        let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: plain system calls on valid pointers; `_exit` never returns.
        unsafe {
            libc::setrlimit(libc::RLIMIT_CORE, &no_core);
            if let Some(filters) = filters {
                for f in filters {
                    // apply_filter only makes prctl/seccomp calls (no allocation on success).
                    if seccompiler::apply_filter(f).is_err() {
                        libc::_exit(100);
                    }
                }
            }
            let value: i64 = match call {
                Call::Sys(nr, a) => {
                    let r = libc::syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
                    let r = if r == -1 { -i64::from(*libc::__errno_location()) } else { r };
                    if nr == libc::SYS_clone || nr == libc::SYS_fork {
                        if r == 0 {
                            libc::_exit(0); // a grandchild: never do anything else
                        }
                        if r > 0 {
                            libc::waitpid(r as libc::pid_t, std::ptr::null_mut(), 0);
                        }
                    }
                    r
                }
                Call::Int80(nr) => {
                    let mut eax = nr;
                    // The 64-bit kernel's int 0x80 entry zeroes r8-r11 and preserves the rest.
                    std::arch::asm!(
                        "int 0x80",
                        inout("eax") eax,
                        lateout("r8") _,
                        lateout("r9") _,
                        lateout("r10") _,
                        lateout("r11") _,
                        options(nostack)
                    );
                    // The i386 ABI returns -errno in eax as well.
                    i64::from(eax as i32)
                }
            };
            let bytes = value.to_ne_bytes();
            libc::write(wfd, bytes.as_ptr().cast(), bytes.len());
            libc::_exit(0)
        }
    }

    /// Fork a probe child (filtered or not), collect what it observed.
    fn observe(call: Call, filters: Option<&[Vec<sock_filter>]>) -> Outcome {
        let mut fds = [0i32; 2];
        // SAFETY: `fds` is a valid array of two ints.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0, "pipe2");
        // SAFETY: the child only calls `probe_child`, which makes raw system calls on data
        // prepared before the fork and ends with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: freshly forked child; the arguments in `call` point to live data.
            unsafe { probe_child(call, filters, fds[1]) }
        }
        // SAFETY: closing our copy of the write end, which we own.
        unsafe { libc::close(fds[1]) };
        let mut buf = [0u8; 8];
        let mut got = 0usize;
        while got < buf.len() {
            // SAFETY: reading into the remaining part of `buf` from our pipe.
            let n = unsafe { libc::read(fds[0], buf[got..].as_mut_ptr().cast(), buf.len() - got) };
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if n <= 0 {
                break;
            }
            got += n as usize;
        }
        // SAFETY: closing the read end, which we own.
        unsafe { libc::close(fds[0]) };
        let mut status = 0;
        // SAFETY: waiting for our own child with a valid status pointer.
        let w = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(w, pid, "waitpid: {}", std::io::Error::last_os_error());
        if libc::WIFSIGNALED(status) {
            return Outcome::Signal(libc::WTERMSIG(status));
        }
        if got < buf.len() || libc::WEXITSTATUS(status) != 0 {
            return Outcome::Lost(status);
        }
        let v = i64::from_ne_bytes(buf);
        if v < 0 {
            Outcome::Errno((-v) as i32)
        } else {
            Outcome::Ret(v)
        }
    }

    /// Root with the capabilities the controls depend on, or skip (fail under CI).
    fn privileged_enough() -> bool {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let cap_eff = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0);
        // CAP_SYS_ADMIN 21, CAP_SYS_BOOT 22, CAP_SYS_TIME 25, CAP_SYS_MODULE 16, CAP_SYS_PTRACE 19,
        // CAP_NET_RAW 13, CAP_DAC_READ_SEARCH 2, CAP_SYS_RAWIO 17, CAP_SYS_PACCT 20, CAP_PERFMON 38,
        // CAP_BPF 39.
        let needed = [21u32, 22, 25, 16, 19, 13, 2, 17, 20, 38, 39].iter().fold(0u64, |m, b| m | (1 << b));
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 && cap_eff & needed == needed {
            return true;
        }
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "filters_refuse_in_the_real_kernel needs root with all capabilities under CI");
        eprintln!("SKIPPED: needs root with all capabilities (CapEff {cap_eff:#x})");
        false
    }

    /// Every refusal the default profile promises, tried in the real kernel from a child that
    /// is still root with all capabilities, with harmless invalid arguments; each identical
    /// call without the filter must end differently, so the filter (not a missing privilege)
    /// is what refuses. Ordinary calls must stay allowed.
    #[test]
    fn filters_refuse_in_the_real_kernel() {
        if !privileged_enough() {
            return;
        }
        let SeccompPolicy::Enforced { filters, .. } = default_policy().unwrap() else { panic!("default is enforced") };
        let filters: Vec<Vec<seccompiler::sock_filter>> =
            filters.iter().map(|f| f.iter().copied().map(unpack).collect()).collect();
        assert_eq!(filters.len(), 2);

        // Everything the children touch is prepared here, before any fork.
        let missing = c"/nonexistent-opservant";
        assert!(!std::path::Path::new("/nonexistent-opservant").exists(), "the probe path must not exist");
        let missing_p = missing.as_ptr() as u64;
        let missing_x = c"/nonexistent-opservant/x".as_ptr() as u64;
        let empty = c"".as_ptr() as u64;
        let no_module = c"opservant_no_such_module".as_ptr() as u64;
        let xattr_name = c"user.opservant".as_ptr() as u64;
        // SAFETY: `timex` is plain old data; all-zero is valid (modes = 0: a read-only query).
        let mut timex: Box<libc::timex> = Box::new(unsafe { std::mem::zeroed() });
        let timex_p = std::ptr::addr_of_mut!(*timex) as u64;
        let mut scratch = Box::new([0u8; 64]);
        let scratch_p = scratch.as_mut_ptr() as u64;
        let local_iov = Box::new(libc::iovec { iov_base: scratch.as_mut_ptr().cast(), iov_len: 8 });
        let remote_iov = Box::new(libc::iovec { iov_base: scratch.as_mut_ptr().cast(), iov_len: 8 });
        let (liov, riov) = (std::ptr::addr_of!(*local_iov) as u64, std::ptr::addr_of!(*remote_iov) as u64);
        // The ioctl target: a pipe, never a terminal (an unfiltered TIOCSTI on a tty would
        // inject input).
        let mut pipe = [0i32; 2];
        // SAFETY: `pipe` is a valid array of two ints.
        assert_eq!(unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: `isatty` only inspects the descriptor.
        assert_eq!(unsafe { libc::isatty(pipe[0]) }, 0);
        let pfd = pipe[0] as u64;
        let minus1 = u64::MAX; // -1 as a register value (fd, pid)

        use libc::*;
        let clone_newuser = CLONE_NEWUSER as u64;
        let clone_thread = CLONE_THREAD as u64;
        let x32 = 0x4000_0000i64;
        let refuse = |name, call, control| Probe { name, call, filtered: EPERM_ONLY, control };
        let e = |set: &'static [i32]| Want::Errno(set);
        // Kernels built without KEXEC/MODULES/X86_IOPL_IOPERM answer ENOSYS unfiltered.
        let probes = vec![
            // Namespaces.
            refuse("unshare(0)", sys(SYS_unshare, &[0]), Want::Success),
            refuse("unshare(NEWUSER|bad)", sys(SYS_unshare, &[clone_newuser | 1]), e(&[EINVAL])),
            refuse("unshare(NEWNS|bad)", sys(SYS_unshare, &[CLONE_NEWNS as u64 | 1]), e(&[EINVAL])),
            refuse("setns(-1, 0)", sys(SYS_setns, &[minus1, 0]), e(&[EBADF])),
            refuse("setns(-1, NEWNET)", sys(SYS_setns, &[minus1, CLONE_NEWNET as u64]), e(&[EBADF])),
            refuse("clone(NEWUSER|FS)", sys(SYS_clone, &[clone_newuser | CLONE_FS as u64]), e(&[EINVAL])),
            refuse("clone(NEWNS|FS)", sys(SYS_clone, &[CLONE_NEWNS as u64 | CLONE_FS as u64]), e(&[EINVAL])),
            refuse("clone(THREAD|NEWPID)", sys(SYS_clone, &[clone_thread | CLONE_NEWPID as u64]), e(&[EINVAL])),
            refuse("clone(THREAD|NEWNET)", sys(SYS_clone, &[clone_thread | CLONE_NEWNET as u64]), e(&[EINVAL])),
            refuse("clone(THREAD|NEWIPC)", sys(SYS_clone, &[clone_thread | CLONE_NEWIPC as u64]), e(&[EINVAL])),
            refuse("clone(THREAD|NEWUTS)", sys(SYS_clone, &[clone_thread | CLONE_NEWUTS as u64]), e(&[EINVAL])),
            refuse("clone(THREAD|NEWCGROUP)", sys(SYS_clone, &[clone_thread | CLONE_NEWCGROUP as u64]), e(&[EINVAL])),
            refuse(
                "clone(1<<32|NEWUSER|FS)",
                sys(SYS_clone, &[1 << 32 | clone_newuser | CLONE_FS as u64]),
                e(&[EINVAL]),
            ),
            Probe {
                name: "clone3(NULL, 0)",
                call: sys(SYS_clone3, &[0, 0]),
                filtered: e(&[ENOSYS]),
                control: e(&[EINVAL]),
            },
            // The mount family.
            refuse("mount(NULL, missing)", sys(SYS_mount, &[0, missing_p, 0, 0, 0]), e(&[ENOENT])),
            refuse("umount2(missing)", sys(SYS_umount2, &[missing_p, 0]), e(&[ENOENT])),
            refuse("pivot_root(missing)", sys(SYS_pivot_root, &[missing_p, missing_p]), e(&[ENOENT])),
            refuse("chroot(missing)", sys(SYS_chroot, &[missing_p]), e(&[ENOENT])),
            refuse("fsopen(NULL)", sys(SYS_fsopen, &[0, 0]), e(&[EFAULT])),
            refuse("fsconfig(-1)", sys(SYS_fsconfig, &[minus1, 0, 0, 0, 0]), e(&[EINVAL, EBADF])),
            refuse("fsmount(-1)", sys(SYS_fsmount, &[minus1, 0, 0]), e(&[EBADF])),
            refuse("fspick(-1, \"\")", sys(SYS_fspick, &[minus1, empty, 0]), e(&[ENOENT, EBADF])),
            refuse("open_tree(-1, \"\")", sys(SYS_open_tree, &[minus1, empty, 0]), e(&[ENOENT, EBADF])),
            refuse(
                "move_mount(-1, \"\")",
                sys(SYS_move_mount, &[minus1, empty, minus1, empty, 0]),
                e(&[ENOENT, EBADF]),
            ),
            refuse("mount_setattr(-1)", sys(SYS_mount_setattr, &[minus1, empty, 0, 0, 0]), e(&[EINVAL, EBADF])),
            // Process inspection.
            refuse("ptrace(PEEKDATA, -1)", sys(SYS_ptrace, &[PTRACE_PEEKDATA as u64, minus1, 0, 0]), e(&[ESRCH])),
            refuse("process_vm_readv(-1)", sys(SYS_process_vm_readv, &[minus1, liov, 1, riov, 1, 0]), e(&[ESRCH])),
            refuse("process_vm_writev(-1)", sys(SYS_process_vm_writev, &[minus1, liov, 1, riov, 1, 0]), e(&[ESRCH])),
            // Kernel attack surface.
            refuse("bpf(9999)", sys(SYS_bpf, &[9999, 0, 0]), e(&[EINVAL])),
            refuse("io_uring_setup(0, NULL)", sys(SYS_io_uring_setup, &[0, 0]), e(&[EINVAL, EFAULT])),
            refuse("io_uring_enter(-1)", sys(SYS_io_uring_enter, &[minus1, 0, 0, 0, 0, 0]), e(&[EBADF])),
            refuse("io_uring_register(-1)", sys(SYS_io_uring_register, &[minus1, 0, 0, 0]), e(&[EBADF, EINVAL])),
            // Native AIO (host-wide fs.aio-max-nr): ENOSYS, so libraries fall back to threads.
            Probe {
                name: "io_setup(1, NULL)",
                call: sys(SYS_io_setup, &[1, 0]),
                filtered: e(&[ENOSYS]),
                control: e(&[EFAULT]),
            },
            Probe {
                name: "io_destroy(0)",
                call: sys(SYS_io_destroy, &[0]),
                filtered: e(&[ENOSYS]),
                control: e(&[EINVAL]),
            },
            Probe {
                name: "io_submit(0)",
                call: sys(SYS_io_submit, &[0, 1, scratch_p]),
                filtered: e(&[ENOSYS]),
                control: e(&[EINVAL]),
            },
            Probe {
                name: "io_cancel(0)",
                call: sys(SYS_io_cancel, &[0, scratch_p, scratch_p]),
                filtered: e(&[ENOSYS]),
                control: e(&[EINVAL, EFAULT]),
            },
            Probe {
                name: "io_getevents(0)",
                call: sys(SYS_io_getevents, &[0, 1, 1, scratch_p, 0]),
                filtered: e(&[ENOSYS]),
                control: e(&[EINVAL]),
            },
            Probe {
                name: "io_pgetevents(0)",
                call: sys(333 /* io_pgetevents, not in libc */, &[0, 1, 1, scratch_p, 0, 0]),
                filtered: e(&[ENOSYS]),
                control: e(&[EINVAL]),
            },
            refuse("keyctl(9999)", sys(SYS_keyctl, &[9999, 0, 0, 0, 0]), e(&[EOPNOTSUPP, EINVAL])),
            refuse("add_key(NULL)", sys(SYS_add_key, &[0, 0, 0, 0, KEY_SPEC_PROCESS_KEYRING as u64]), e(&[EFAULT])),
            refuse("request_key(NULL)", sys(SYS_request_key, &[0, 0, 0, 0]), e(&[EFAULT])),
            refuse("perf_event_open(NULL)", sys(SYS_perf_event_open, &[0, 0, minus1, minus1, 0]), e(&[EFAULT])),
            refuse("userfaultfd(0xdead)", sys(SYS_userfaultfd, &[0xdead]), e(&[EINVAL])),
            refuse("kexec_load(nr_segments 17)", sys(SYS_kexec_load, &[0, 17, 0, 0]), e(&[EINVAL, ENOSYS])),
            refuse(
                "kexec_file_load(bad flags)",
                sys(SYS_kexec_file_load, &[minus1, minus1, 0, 0, 0xdead_0000]),
                e(&[EINVAL, EBADF, ENOSYS]),
            ),
            refuse("init_module(NULL, 0, \"\")", sys(SYS_init_module, &[0, 0, empty]), e(&[EFAULT, ENOEXEC, ENOSYS])),
            refuse("finit_module(-1)", sys(SYS_finit_module, &[minus1, empty, 0]), e(&[EBADF, ENOSYS])),
            refuse("delete_module(no such)", sys(SYS_delete_module, &[no_module, 0]), e(&[ENOENT, ENOSYS])),
            refuse("reboot(bad magic)", sys(SYS_reboot, &[0, 0, 0, 0]), e(&[EINVAL])),
            refuse("swapon(missing)", sys(SYS_swapon, &[missing_p, 0]), e(&[ENOENT])),
            refuse("swapoff(missing)", sys(SYS_swapoff, &[missing_p]), e(&[ENOENT])),
            refuse("acct(missing)", sys(SYS_acct, &[missing_p]), e(&[ENOENT])),
            // Clocks.
            refuse("settimeofday(NULL, NULL)", sys(SYS_settimeofday, &[0, 0]), Want::Success),
            refuse("clock_settime(12345, NULL)", sys(SYS_clock_settime, &[12345, 0]), e(&[EINVAL])),
            refuse("adjtimex(modes 0)", sys(SYS_adjtimex, &[timex_p]), Want::Success),
            refuse(
                "clock_adjtime(REALTIME, modes 0)",
                sys(SYS_clock_adjtime, &[CLOCK_REALTIME as u64, timex_p]),
                Want::Success,
            ),
            // Files by handle, raw I/O ports.
            refuse("open_by_handle_at(-1, NULL)", sys(SYS_open_by_handle_at, &[minus1, 0, 0]), e(&[EBADF, EFAULT])),
            refuse("iopl(0)", sys(SYS_iopl, &[0]), Want::SuccessOr(&[ENOSYS])),
            refuse("ioperm(0, 0, 0)", sys(SYS_ioperm, &[0, 0, 0]), Want::SuccessOr(&[EINVAL, ENOSYS])),
            // Terminal injection, also with high bits set in the 64-bit cmd.
            refuse("ioctl(pipe, TIOCSTI)", sys(SYS_ioctl, &[pfd, TIOCSTI, scratch_p]), e(&[ENOTTY])),
            refuse("ioctl(pipe, 1<<32|TIOCSTI)", sys(SYS_ioctl, &[pfd, 1 << 32 | TIOCSTI, scratch_p]), e(&[ENOTTY])),
            refuse(
                "ioctl(pipe, ~0<<32|TIOCSTI)",
                sys(SYS_ioctl, &[pfd, 0xffff_ffff_0000_0000 | TIOCSTI, scratch_p]),
                e(&[ENOTTY]),
            ),
            refuse("ioctl(pipe, TIOCLINUX)", sys(SYS_ioctl, &[pfd, TIOCLINUX, scratch_p]), e(&[ENOTTY])),
            refuse(
                "ioctl(pipe, 1<<32|TIOCLINUX)",
                sys(SYS_ioctl, &[pfd, 1 << 32 | TIOCLINUX, scratch_p]),
                e(&[ENOTTY]),
            ),
            // Socket families outside the allowlist (an invalid type keeps the control harmless).
            refuse("socket(AF_PACKET, 15)", sys(SYS_socket, &[AF_PACKET as u64, 15, 0]), e(&[EINVAL])),
            refuse("socket(AF_VSOCK, 15)", sys(SYS_socket, &[AF_VSOCK as u64, 15, 0]), e(&[EINVAL])),
            // Protocols outside the allowlist of an allowed family, which the kernel would load
            // a module for (the invalid type keeps the control from loading one).
            refuse("socket(AF_INET, 15, SCTP)", sys(SYS_socket, &[AF_INET as u64, 15, 132]), e(&[EINVAL])),
            refuse("socket(AF_INET6, 15, L2TP)", sys(SYS_socket, &[AF_INET6 as u64, 15, 115]), e(&[EINVAL])),
            refuse("socket(AF_NETLINK, 15, RDMA)", sys(SYS_socket, &[AF_NETLINK as u64, 15, 20]), e(&[EINVAL])),
            // Netlink uevents (the host's device events reach a prepared network namespace).
            refuse(
                "socket(AF_NETLINK, DGRAM, KOBJECT_UEVENT)",
                sys(SYS_socket, &[AF_NETLINK as u64, SOCK_DGRAM as u64, NETLINK_KOBJECT_UEVENT as u64]),
                Want::Success,
            ),
            refuse(
                "socket(AF_NETLINK, RAW|CLOEXEC, 1<<32|KOBJECT_UEVENT)",
                sys(
                    SYS_socket,
                    &[AF_NETLINK as u64, (SOCK_RAW | SOCK_CLOEXEC) as u64, 1 << 32 | NETLINK_KOBJECT_UEVENT as u64],
                ),
                Want::Success,
            ),
            // Set-user-ID modes (a file left in a writable grant is a host file): refused
            // however the mode is given; the same calls without it reach the kernel (below).
            // The missing directory keeps the controls from creating anything.
            refuse("chmod(missing, 04755)", sys(SYS_chmod, &[missing_p, 0o4755]), e(&[ENOENT])),
            refuse("fchmod(-1, 06755)", sys(SYS_fchmod, &[minus1, 0o6755]), e(&[EBADF])),
            refuse("fchmodat(missing, 04755)", sys(SYS_fchmodat, &[minus1, missing_p, 0o4755]), e(&[ENOENT])),
            refuse(
                "fchmodat2(missing, 04711)",
                sys(452 /* fchmodat2, not in libc */, &[minus1, missing_p, 0o4711, 0]),
                e(&[ENOENT, ENOSYS]),
            ),
            refuse("creat(missing/x, 04755)", sys(SYS_creat, &[missing_x, 0o4755]), e(&[ENOENT])),
            refuse(
                "open(missing/x, CREAT, 04755)",
                sys(SYS_open, &[missing_x, (O_CREAT | O_WRONLY) as u64, 0o4755]),
                e(&[ENOENT]),
            ),
            refuse(
                "openat(missing/x, TMPFILE, 04700)",
                sys(SYS_openat, &[AT_FDCWD as u64, missing_x, (O_TMPFILE | O_WRONLY) as u64, 0o4700]),
                e(&[ENOENT]),
            ),
            refuse(
                "openat(missing/x, CREAT, 1<<32|04755)",
                sys(SYS_openat, &[AT_FDCWD as u64, missing_x, (O_CREAT | O_WRONLY) as u64, 1 << 32 | 0o4755]),
                e(&[ENOENT]),
            ),
            refuse(
                "mknod(missing/x, REG|04755)",
                sys(SYS_mknod, &[missing_x, (S_IFREG | 0o4755) as u64, 0]),
                e(&[ENOENT]),
            ),
            refuse(
                "mknodat(missing/x, REG|04755)",
                sys(SYS_mknodat, &[AT_FDCWD as u64, missing_x, (S_IFREG | 0o4755) as u64, 0]),
                e(&[ENOENT]),
            ),
            Probe {
                name: "openat2(missing, NULL how)",
                call: sys(SYS_openat2, &[AT_FDCWD as u64, missing_p, 0, 0]),
                filtered: e(&[ENOSYS]),
                control: e(&[EFAULT, EINVAL]),
            },
            // Foreign architectures: x32 numbers, i386 `int 0x80` (kills with SIGSYS).
            refuse("x32 getpid", sys(x32 | SYS_getpid, &[]), Want::SuccessOr(&[ENOSYS])),
            refuse("x32 unshare(0)", sys(x32 | SYS_unshare, &[0]), Want::SuccessOr(&[ENOSYS])),
            Probe {
                name: "i386 int 0x80 getpid",
                call: Call::Int80(20),
                filtered: Want::Signal(SIGSYS),
                control: Want::Success,
            },
            // Ordinary calls stay allowed.
            Probe { name: "getpid", call: sys(SYS_getpid, &[]), filtered: Want::Success, control: Want::Success },
            Probe { name: "fork", call: sys(SYS_fork, &[]), filtered: Want::Success, control: Want::Success },
            Probe {
                name: "clone(SIGCHLD)",
                call: sys(SYS_clone, &[SIGCHLD as u64]),
                filtered: Want::Success,
                control: Want::Success,
            },
            Probe {
                name: "socket(AF_INET, STREAM)",
                call: sys(SYS_socket, &[AF_INET as u64, SOCK_STREAM as u64, 0]),
                filtered: Want::Success,
                control: Want::Success,
            },
            Probe {
                name: "socket(AF_INET, STREAM, TCP)",
                call: sys(SYS_socket, &[AF_INET as u64, SOCK_STREAM as u64, 6]),
                filtered: Want::Success,
                control: Want::Success,
            },
            Probe {
                name: "socket(AF_INET6, DGRAM, UDP)",
                call: sys(SYS_socket, &[AF_INET6 as u64, SOCK_DGRAM as u64, 17]),
                filtered: Want::Success,
                control: Want::Success,
            },
            Probe {
                name: "socket(AF_INET6, DGRAM)",
                call: sys(SYS_socket, &[AF_INET6 as u64, SOCK_DGRAM as u64, 0]),
                filtered: Want::Success,
                control: Want::Success,
            },
            Probe {
                name: "socket(AF_UNIX, STREAM)",
                call: sys(SYS_socket, &[AF_UNIX as u64, SOCK_STREAM as u64, 0]),
                filtered: Want::Success,
                control: Want::Success,
            },
            Probe {
                name: "socket(AF_NETLINK, ROUTE)",
                call: sys(SYS_socket, &[AF_NETLINK as u64, SOCK_RAW as u64, 0]),
                filtered: Want::Success,
                control: Want::Success,
            },
            Probe {
                name: "ioctl(pipe, FIONREAD)",
                call: sys(SYS_ioctl, &[pfd, FIONREAD, scratch_p]),
                filtered: Want::Success,
                control: Want::Success,
            },
            // Allowed calls that reach the kernel and fail there.
            Probe {
                name: "chmod(missing, 01777)",
                call: sys(SYS_chmod, &[missing_p, 0o1777]),
                filtered: e(&[ENOENT]),
                control: e(&[ENOENT]),
            },
            // Set-group-ID is left alone: a filter cannot tell a directory (a group-shared
            // one keeps the bit through `chmod g+w`) from a file.
            Probe {
                name: "chmod(missing, 02775)",
                call: sys(SYS_chmod, &[missing_p, 0o2775]),
                filtered: e(&[ENOENT]),
                control: e(&[ENOENT]),
            },
            // Without O_CREAT or O_TMPFILE the mode register is not looked at (a raw call
            // may leave anything in it).
            Probe {
                name: "openat(missing, RDONLY, junk 04000)",
                call: sys(SYS_openat, &[AT_FDCWD as u64, missing_p, O_RDONLY as u64, 0o4000]),
                filtered: e(&[ENOENT]),
                control: e(&[ENOENT]),
            },
            Probe {
                name: "open(missing, RDONLY, junk 06000)",
                call: sys(SYS_open, &[missing_p, O_RDONLY as u64, 0o6000]),
                filtered: e(&[ENOENT]),
                control: e(&[ENOENT]),
            },
            Probe {
                name: "openat(missing/x, CREAT, 0644)",
                call: sys(SYS_openat, &[AT_FDCWD as u64, missing_x, (O_CREAT | O_WRONLY) as u64, 0o644]),
                filtered: e(&[ENOENT]),
                control: e(&[ENOENT]),
            },
            Probe {
                name: "mknodat(missing/x, REG|0644)",
                call: sys(SYS_mknodat, &[AT_FDCWD as u64, missing_x, (S_IFREG | 0o644) as u64, 0]),
                filtered: e(&[ENOENT]),
                control: e(&[ENOENT]),
            },
            Probe {
                name: "setxattr(missing)",
                call: sys(SYS_setxattr, &[missing_p, xattr_name, scratch_p, 1, 0]),
                filtered: e(&[ENOENT]),
                control: e(&[ENOENT]),
            },
            Probe {
                name: "lsetxattr(missing)",
                call: sys(SYS_lsetxattr, &[missing_p, xattr_name, scratch_p, 1, 0]),
                filtered: e(&[ENOENT]),
                control: e(&[ENOENT]),
            },
        ];

        let mut table = String::new();
        let mut failures = Vec::new();
        for p in &probes {
            let control = observe(p.call, None);
            let filtered = observe(p.call, Some(&filters));
            let ok_control = p.control.accepts(control);
            let ok_filtered = p.filtered.accepts(filtered);
            // The control must end differently: a call the kernel already refuses with the
            // same answer proves nothing about the filter.
            let distinct = !p.filtered.is_refusal() || !p.filtered.accepts(control);
            table.push_str(&format!(
                "{:<36} filtered {:<16} unfiltered {:?}\n",
                p.name,
                format!("{filtered:?}"),
                control
            ));
            if !(ok_control && ok_filtered && distinct) {
                failures.push(format!(
                    "{}: filtered {filtered:?} (want {:?}), unfiltered {control:?} (want {:?})",
                    p.name, p.filtered, p.control
                ));
            }
        }
        eprintln!("{table}");
        // SAFETY: closing the pipe we created above.
        unsafe {
            libc::close(pipe[0]);
            libc::close(pipe[1]);
        }
        drop((timex, scratch, local_iov, remote_iov));
        assert!(failures.is_empty(), "{} probe(s) failed:\n{}", failures.len(), failures.join("\n"));
    }
}
