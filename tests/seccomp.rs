//! The default seccomp profile, seen from inside a real sandbox: a Python ctypes probe makes
//! every refused system call with harmless invalid arguments and must get `EPERM` (`ENOSYS`
//! for `clone3`); i386 `int 0x80` must kill the payload with SIGSYS; bash, coreutils and
//! CPython networking must keep working. (`sandbox::seccomp`'s unit tests prove, as root
//! with all capabilities, that the filter and not a missing privilege is what refuses.)
#![cfg(target_arch = "x86_64")]

mod common;

use std::collections::BTreeMap;

/// One refused call: probe name, syscall number, Python argument expressions (names defined
/// by [`probe_script`]), the errno the sandbox must answer.
struct Refused {
    name: &'static str,
    nr: i64,
    args: &'static str,
    errno: i32,
}

fn refused() -> Vec<Refused> {
    use libc::*;
    let r = |name, nr, args| Refused { name, nr, args, errno: EPERM };
    // A netlink socket, in this sandbox without egress: the filter stacked last refuses the
    // family (EAFNOSUPPORT) and its errno is the one seen; the default profile's EPERM for
    // these protocols is what an egress run meets (tests/egress.rs).
    let nl = |name, nr, args| Refused { name, nr, args, errno: EAFNOSUPPORT };
    let x32 = 0x4000_0000;
    vec![
        // Namespaces: unshare(0) succeeds unprivileged without seccomp.
        r("unshare(0)", SYS_unshare, "0"),
        r("unshare(NEWUSER)", SYS_unshare, "CLONE_NEWUSER"),
        r("unshare(NEWUSER|bad)", SYS_unshare, "CLONE_NEWUSER | 1"),
        r("setns(-1,0)", SYS_setns, "-1, 0"),
        r("setns(-1,NEWNET)", SYS_setns, "-1, CLONE_NEWNET"),
        r("clone(NEWUSER|FS)", SYS_clone, "CLONE_NEWUSER | CLONE_FS"),
        r("clone(NEWNS|FS)", SYS_clone, "CLONE_NEWNS | CLONE_FS"),
        r("clone(THREAD|NEWPID)", SYS_clone, "CLONE_THREAD | CLONE_NEWPID"),
        r("clone(THREAD|NEWNET)", SYS_clone, "CLONE_THREAD | CLONE_NEWNET"),
        r("clone(THREAD|NEWIPC)", SYS_clone, "CLONE_THREAD | CLONE_NEWIPC"),
        r("clone(THREAD|NEWUTS)", SYS_clone, "CLONE_THREAD | CLONE_NEWUTS"),
        r("clone(THREAD|NEWCGROUP)", SYS_clone, "CLONE_THREAD | CLONE_NEWCGROUP"),
        r("clone(1<<32|NEWUSER|FS)", SYS_clone, "1 << 32 | CLONE_NEWUSER | CLONE_FS"),
        Refused { name: "clone3(NULL,0)", nr: SYS_clone3, args: "0, 0", errno: ENOSYS },
        // The mount family.
        r("mount(NULL,missing)", SYS_mount, "0, MISSING, 0, 0, 0"),
        r("umount2(missing)", SYS_umount2, "MISSING, 0"),
        r("pivot_root(missing)", SYS_pivot_root, "MISSING, MISSING"),
        r("chroot(missing)", SYS_chroot, "MISSING"),
        r("fsopen(NULL)", SYS_fsopen, "0, 0"),
        r("fsconfig(-1)", SYS_fsconfig, "-1, 0, 0, 0, 0"),
        r("fsmount(-1)", SYS_fsmount, "-1, 0, 0"),
        r("fspick(-1,\"\")", SYS_fspick, "-1, EMPTY, 0"),
        r("open_tree(-1,\"\")", SYS_open_tree, "-1, EMPTY, 0"),
        r("move_mount(-1,\"\")", SYS_move_mount, "-1, EMPTY, -1, EMPTY, 0"),
        r("mount_setattr(-1)", SYS_mount_setattr, "-1, EMPTY, 0, 0, 0"),
        // Process inspection.
        r("ptrace(PEEKDATA,-1)", SYS_ptrace, "2, -1, 0, 0"),
        r("process_vm_readv(-1)", SYS_process_vm_readv, "-1, LIOV, 1, RIOV, 1, 0"),
        r("process_vm_writev(-1)", SYS_process_vm_writev, "-1, LIOV, 1, RIOV, 1, 0"),
        // Kernel attack surface.
        r("bpf(9999)", SYS_bpf, "9999, 0, 0"),
        r("io_uring_setup(0,NULL)", SYS_io_uring_setup, "0, 0"),
        r("io_uring_enter(-1)", SYS_io_uring_enter, "-1, 0, 0, 0, 0, 0"),
        r("io_uring_register(-1)", SYS_io_uring_register, "-1, 0, 0, 0"),
        // Native AIO: io_setup reserves from the host-wide fs.aio-max-nr (ENOSYS: libraries
        // fall back to threads).
        Refused { name: "io_setup(1)", nr: SYS_io_setup, args: "1, BUF", errno: ENOSYS },
        Refused { name: "io_setup(65536)", nr: SYS_io_setup, args: "65536, BUF", errno: ENOSYS },
        Refused { name: "io_destroy(0)", nr: SYS_io_destroy, args: "0", errno: ENOSYS },
        Refused { name: "io_submit(0)", nr: SYS_io_submit, args: "0, 1, BUF", errno: ENOSYS },
        Refused { name: "io_cancel(0)", nr: SYS_io_cancel, args: "0, BUF, BUF", errno: ENOSYS },
        Refused { name: "io_getevents(0)", nr: SYS_io_getevents, args: "0, 1, 1, BUF, 0", errno: ENOSYS },
        Refused {
            name: "io_pgetevents(0)",
            nr: 333, // io_pgetevents (not in libc)
            args: "0, 1, 1, BUF, 0, 0",
            errno: ENOSYS,
        },
        r("keyctl(9999)", SYS_keyctl, "9999, 0, 0, 0, 0"),
        r("add_key(NULL)", SYS_add_key, "0, 0, 0, 0, -2"),
        r("request_key(NULL)", SYS_request_key, "0, 0, 0, 0"),
        r("perf_event_open(NULL)", SYS_perf_event_open, "0, 0, -1, -1, 0"),
        r("userfaultfd(0xdead)", SYS_userfaultfd, "0xdead"),
        r("kexec_load(17_segments)", SYS_kexec_load, "0, 17, 0, 0"),
        r("kexec_file_load(bad_flags)", SYS_kexec_file_load, "-1, -1, 0, 0, 0xdead0000"),
        r("init_module(NULL,0,\"\")", SYS_init_module, "0, 0, EMPTY"),
        r("finit_module(-1)", SYS_finit_module, "-1, EMPTY, 0"),
        r("delete_module(no_such)", SYS_delete_module, "NO_MODULE, 0"),
        r("reboot(bad_magic)", SYS_reboot, "0, 0, 0, 0"),
        r("swapon(missing)", SYS_swapon, "MISSING, 0"),
        r("swapoff(missing)", SYS_swapoff, "MISSING"),
        r("acct(missing)", SYS_acct, "MISSING"),
        // Clocks (the adjtimex queries would succeed unprivileged without seccomp).
        r("settimeofday(NULL,NULL)", SYS_settimeofday, "0, 0"),
        r("clock_settime(12345,NULL)", SYS_clock_settime, "12345, 0"),
        r("adjtimex(modes_0)", SYS_adjtimex, "TIMEX"),
        r("clock_adjtime(REALTIME,modes_0)", SYS_clock_adjtime, "0, TIMEX"),
        // Files by handle, raw I/O ports.
        r("open_by_handle_at(-1,NULL)", SYS_open_by_handle_at, "-1, 0, 0"),
        r("iopl(0)", SYS_iopl, "0"),
        r("ioperm(0,0,0)", SYS_ioperm, "0, 0, 0"),
        // Terminal injection, also with high bits in the 64-bit cmd (a pipe, never a tty).
        r("ioctl(pipe,TIOCSTI)", SYS_ioctl, "PIPE, 0x5412, BUF"),
        r("ioctl(pipe,1<<32|TIOCSTI)", SYS_ioctl, "PIPE, 1 << 32 | 0x5412, BUF"),
        r("ioctl(pipe,~0<<32|TIOCSTI)", SYS_ioctl, "PIPE, 0xffffffff00005412, BUF"),
        r("ioctl(pipe,TIOCLINUX)", SYS_ioctl, "PIPE, 0x541C, BUF"),
        r("ioctl(pipe,1<<32|TIOCLINUX)", SYS_ioctl, "PIPE, 1 << 32 | 0x541C, BUF"),
        // Socket families outside the allowlist.
        r("socket(AF_PACKET,RAW)", SYS_socket, "17, 3, 0"),
        r("socket(AF_VSOCK,STREAM)", SYS_socket, "40, 1, 0"),
        // Protocols of allowed families the kernel would load a module for (SCTP, L2TP, SMC,
        // netlink RDMA and CRYPTO); an invalid type, so that a filter that let them through
        // gets EINVAL, not a module.
        r("socket(AF_INET,15,SCTP)", SYS_socket, "2, 15, 132"),
        r("socket(AF_INET,15,1<<32|SCTP)", SYS_socket, "2, 15, 1 << 32 | 132"),
        r("socket(AF_INET6,15,L2TP)", SYS_socket, "10, 15, 115"),
        r("socket(AF_INET,15,SMC)", SYS_socket, "2, 15, 256"),
        nl("socket(AF_NETLINK,15,RDMA)", SYS_socket, "16, 15, 20"),
        nl("socket(AF_NETLINK,15,CRYPTO)", SYS_socket, "16, 15, 21"),
        // socketpair creates both sockets in the family asked for before the family's own
        // socketpair can refuse: only AF_UNIX (today EOPNOTSUPP, after the family's code ran).
        r("socketpair(AF_INET,STREAM)", SYS_socketpair, "2, 1, 0, BUF"),
        r("socketpair(AF_VSOCK,STREAM)", SYS_socketpair, "40, 1, 0, BUF"),
        // Huge pages are not charged to the memory cgroup (today ENOMEM: no pool here).
        r("mmap(MAP_HUGETLB)", SYS_mmap, "0, 2 << 20, 3, 0x40022, -1, 0"),
        r("mmap(1<<32|MAP_HUGETLB)", SYS_mmap, "0, 2 << 20, 3, 1 << 32 | 0x40022, -1, 0"),
        r("memfd_create(MFD_HUGETLB)", SYS_memfd_create, "BUF, 4"),
        r("shmget(SHM_HUGETLB)", SYS_shmget, "0, 2 << 20, 0x200 | 0x800 | 0o600"),
        // Netlink uevents: a prepared (zygote/pool) network namespace is owned by the host user
        // namespace, so the kernel would broadcast the host's device uevents into it.
        nl("socket(AF_NETLINK,DGRAM,KOBJECT_UEVENT)", SYS_socket, "16, 2, 15"),
        nl("socket(AF_NETLINK,RAW,KOBJECT_UEVENT)", SYS_socket, "16, 3, 15"),
        nl("socket(AF_NETLINK,RAW|CLOEXEC,1<<32|KOBJECT_UEVENT)", SYS_socket, "16, 3 | 0x80000, 1 << 32 | 15"),
        // x32 system call numbers.
        r("x32_getpid", x32 | SYS_getpid, ""),
        r("x32_unshare(0)", x32 | SYS_unshare, "0"),
    ]
}

/// A Python program that makes every call of `probes` and prints `name<TAB>errno<TAB>ret`
/// (errno 0 on success), then `/proc/self/status`.
fn probe_script(probes: &[Refused]) -> String {
    let table: Vec<String> =
        probes.iter().map(|p| format!("    ({:?}, {}, ({}{})),", p.name, p.nr, p.args, sep(p.args))).collect();
    format!(
        r#"import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_FS, CLONE_THREAD, CLONE_NEWNS = 0x200, 0x10000, 0x20000
CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
def addr(obj):
    return ctypes.addressof(obj)
KEEP = [ctypes.create_string_buffer(b"/nonexistent-opservant"), ctypes.create_string_buffer(b""),
        ctypes.create_string_buffer(b"opservant_no_such_module"), ctypes.create_string_buffer(64),
        ctypes.create_string_buffer(512)]
MISSING, EMPTY, NO_MODULE, BUF, TIMEX = (addr(b) for b in KEEP)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
IOVS = [iovec(BUF, 8), iovec(BUF, 8)]
LIOV, RIOV = (addr(v) for v in IOVS)
PIPE, _w = os.pipe()
assert not os.isatty(PIPE)
PROBES = [
{table}
]
for name, nr, args in PROBES:
    argv = [ctypes.c_long(a) for a in args] + [ctypes.c_long(0)] * (6 - len(args))
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(nr), *argv)
    if nr in (56, 57) and ret == 0:
        os._exit(0)  # a child of a clone that should have been refused: never continue
    err = ctypes.get_errno() if ret == -1 else 0
    print(f"{{name}}\t{{err}}\t{{ret}}", flush=True)
print(open("/proc/self/status").read(), flush=True)
"#,
        table = table.join("\n")
    )
}

/// Python needs a trailing comma in a one-element tuple.
fn sep(args: &str) -> &'static str {
    if args.is_empty() || args.contains(',') {
        ""
    } else {
        ","
    }
}

#[test]
fn every_refused_syscall_fails_inside_the_sandbox() {
    if !common::require_root() {
        return;
    }
    let probes = refused();
    let run = common::python(None, &probe_script(&probes));
    assert_eq!(run.status(), "completed", "probe did not complete: {:#}", run.json);
    let seen: BTreeMap<&str, (i32, i64)> = run
        .stdout()
        .lines()
        .filter_map(|l| {
            let mut f = l.split('\t');
            let (name, err, ret) = (f.next()?, f.next()?.parse().ok()?, f.next()?.parse().ok()?);
            Some((name, (err, ret)))
        })
        .collect();
    let mut failures = Vec::new();
    for p in &probes {
        match seen.get(p.name) {
            Some(&(err, _)) if err == p.errno => {}
            Some(&(err, ret)) => failures.push(format!("{}: errno {err} (ret {ret}), want {}", p.name, p.errno)),
            None => failures.push(format!("{}: no report", p.name)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} call(s) not refused:\n{}\nstdout:\n{}",
        failures.len(),
        failures.join("\n"),
        run.stdout()
    );

    // The filters really are installed (and the payload cannot gain privileges): the
    // profile's two and, without egress, the one refusing netlink.
    let out = run.stdout();
    for line in ["Seccomp:\t2", "Seccomp_filters:\t3", "NoNewPrivs:\t1", "CapEff:\t0000000000000000"] {
        assert!(out.lines().any(|l| l == line), "/proc/self/status lacks {line:?}:\n{out}");
    }
    assert_eq!(run.json["sandbox"]["seccomp"], "enforced", "{:#}", run.json["sandbox"]);
}

#[test]
fn namespace_tools_fail_inside_the_sandbox() {
    if !common::require_root() {
        return;
    }
    let code = r#"import os, subprocess
if hasattr(os, "unshare"):
    for flag in ("CLONE_NEWUSER", "CLONE_NEWNS", "CLONE_NEWNET"):
        try:
            os.unshare(getattr(os, flag))
            print("os.unshare", flag, "succeeded")
        except PermissionError:
            print("os.unshare", flag, "EPERM")
else:
    print("os.unshare unavailable")
p = subprocess.run(["/usr/bin/unshare", "-U", "true"], capture_output=True, text=True)
print("unshare -U", p.returncode, p.stderr.strip())
p = subprocess.run(["/usr/bin/unshare", "-r", "-n", "true"], capture_output=True, text=True)
print("unshare -r -n", p.returncode, p.stderr.strip())
"#;
    let run = common::python(None, code);
    let out = run.stdout();
    assert_eq!(run.status(), "completed", "{:#}", run.json);
    assert!(!out.contains("succeeded"), "a namespace was created:\n{out}");
    for tool in ["unshare -U", "unshare -r -n"] {
        let line = out.lines().find(|l| l.starts_with(tool)).unwrap_or_else(|| panic!("no {tool} report:\n{out}"));
        assert!(!line.starts_with(&format!("{tool} 0")), "{tool} succeeded: {line}");
        assert!(line.contains("Operation not permitted"), "{tool} failed for another reason: {line}");
    }
}

#[test]
fn i386_int80_kills_the_payload_with_sigsys() {
    if !common::require_root() {
        return;
    }
    // mov eax, 20 (i386 getpid); int 0x80; ret
    let code = r#"import ctypes, mmap
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")
fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
print("calling", flush=True)
print("survived", fn(), flush=True)
"#;
    let run = common::python(None, code);
    assert!(run.stdout().contains("calling"), "the probe did not reach int 0x80: {:#}", run.json);
    assert!(!run.stdout().contains("survived"), "int 0x80 returned: {:#}", run.json);
    assert_eq!(run.killed_by(), Some("signal:31"), "{:#}", run.json);
    assert_eq!(run.status(), "failed", "{:#}", run.json);
}

#[test]
fn bash_coreutils_and_python_networking_work() {
    if !common::require_root() {
        return;
    }
    let script = r#"set -euo pipefail
up=$(echo hello | tr a-z A-Z)
n=$(ls / | wc -l)
f=$(mktemp)
printf 'b\na\n' > "$f"
sorted=$(sort "$f" | head -n1)
sum=$(sha256sum "$f" | cut -c1-8)
rm -f "$f"
( sleep 0; echo sub ) | cat
echo "$up $sorted $sum $((n > 0)) $(id -u) $(date +%Y | wc -c)"
"#;
    let run = common::sandbox(None, &["/bin/bash", "-c", script]);
    assert_eq!(run.status(), "completed", "bash: {:#}", run.json);
    let out = run.stdout();
    assert!(out.contains("sub\n"), "{out}");
    assert!(out.contains("HELLO a "), "{out}");
    let (uid, _) = common::executor_ids();
    assert!(out.trim_end().ends_with(&format!(" 1 {uid} 5")), "{out}");

    let code = r#"import os, socket, subprocess, threading
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen(1)
port = srv.getsockname()[1]
def serve():
    conn, _ = srv.accept()
    with conn:
        conn.sendall(conn.recv(64).upper())
t = threading.Thread(target=serve)
t.start()
with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
    c.sendall(b"ping")
    print("tcp", c.recv(64).decode())
t.join()
a, b = socket.socketpair()
a.sendall(b"unix"); print("unix", b.recv(4).decode())
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 0))
u.sendto(b"udp", u.getsockname()); print("udp", u.recv(3).decode())
print("subprocess", subprocess.run(["/bin/echo", "child"], capture_output=True, text=True).stdout.strip())
open("xattr-probe", "w").close()
os.setxattr("xattr-probe", "user.opservant", b"1")
print("xattr", os.getxattr("xattr-probe", "user.opservant").decode())
"#;
    let run = common::python(None, code);
    assert_eq!(run.status(), "completed", "python: {:#}", run.json);
    let out = run.stdout();
    for want in ["tcp PING", "unix unix", "udp udp", "subprocess child", "xattr 1"] {
        assert!(out.lines().any(|l| l == want), "missing {want:?}:\n{out}\nstderr:\n{}", run.err());
    }
}
