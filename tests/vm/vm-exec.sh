#!/usr/bin/env bash
# Run a command as root inside a throw-away QEMU VM that boots the host's Debian
# kernel with a pure cgroup-v2 hierarchy (the host itself is cgroup v1 hybrid).
#
#   tests/vm/vm-exec.sh CMD [ARGS...]      e.g.  tests/vm/vm-exec.sh sh -c 'cat /proc/self/cgroup'
#
# CMD and ARGS are passed exec-style (each one shell-quoted), so use `sh -c '...'`
# for pipes/redirections. stdout and stderr are streamed separately; the exit
# status is CMD's own (124 = timed out, 255 = VM died without reporting a status,
# e.g. kernel panic).
#
# The guest is virtme-ng (vng) over the host root filesystem (9p, read-only, with
# tmpfs overlays on /etc /usr /var /tmp /home ...). The repo is overlaid too:
# the guest may write into it (e.g. target/), the host never sees those writes
# unless VM_REPO_RW=1 (then guest writes go straight to the host repo). Overlay
# upper layers live in guest tmpfs, i.e. count against VM_MEMORY.
# KVM does not work here, so the VM runs under QEMU TCG (--disable-kvm); a boot
# takes ~15-20 s. Nothing is installed by this script; needed:
#   apt-get install -y qemu-system-x86 linux-image-amd64 busybox-static
#   python3 -m pip install virtme-ng        (tested with virtme-ng 1.42)
#
# Environment knobs (all optional):
#   VM_KERNEL=/boot/vmlinuz-...   kernel to boot (default: newest /boot/vmlinuz-6.1*, else newest vmlinuz-*)
#   VM_TIMEOUT=600                seconds before the whole VM is killed
#   VM_MEMORY=1G VM_CPUS=2        guest size
#   VM_REPO_RW=1                  let guest writes to the repo reach the host
#   VM_APPEND='...'               extra kernel command-line options
#   VM_VERBOSE=1                  print the vng command line to stderr
#   VM_CONSOLE=1                  show the guest kernel's console (boot log, hung-task and lockup reports)
#   VM_PASS_ENV='RUST_LOG ...'    extra host variables to forward (RUST_BACKTRACE, RUST_LOG are always forwarded if set)
#   VM_SYSTEMD=1                  boot with systemd as PID 1 (vng --systemd); CMD runs once the
#                                 system is up, as root, from virtme-ng's serial-getty hook (see below)
#   VM_STATE_DIR=DIR              host directory for the VM_SYSTEMD helper files (default: target/vm-exec
#                                 in the repo, or a temporary /var/lib/opservant-vm-exec.* directory when the
#                                 repo is below /tmp or /var/tmp); must be visible in the guest
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
die() { echo "vm-exec: error: $*" >&2; exit 2; }

[ $# -ge 1 ] || die "usage: $0 CMD [ARGS...]"

# --- prerequisites (report, never install) ----------------------------------
command -v vng >/dev/null || die "vng not found on PATH (.ci/run installs virtme-ng into .ci/venv; tests/run puts it on PATH)"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found (install: apt-get install -y qemu-system-x86)"
command -v busybox >/dev/null || die "busybox not found (install: apt-get install -y busybox-static)"
command -v timeout >/dev/null || die "timeout (coreutils) not found"
if [ -z "${VM_KERNEL:-}" ]; then
    VM_KERNEL=$(ls -1 /boot/vmlinuz-6.1* 2>/dev/null | sort -V | tail -n1 || true)
    [ -n "$VM_KERNEL" ] || VM_KERNEL=$(ls -1 /boot/vmlinuz-* 2>/dev/null | sort -V | tail -n1 || true)
fi
[ -n "$VM_KERNEL" ] || die "no /boot/vmlinuz-* kernel (install: apt-get install -y linux-image-amd64) and VM_KERNEL unset"
[ -r "$VM_KERNEL" ] || die "kernel $VM_KERNEL not readable"
kver=${VM_KERNEL##*/vmlinuz-}
[ -d "/lib/modules/$kver" ] || die "/lib/modules/$kver missing (the kernel's modules, e.g. 9p/virtio, are needed)"

# --- build the guest command --------------------------------------------------
# The guest starts with a minimal environment (PATH=/sbin:/usr/sbin:/bin:/usr/bin:...,
# so `python3` is Debian's /usr/bin/python3); forward a few variables explicitly and
# put the host's cargo/rustc directory (if any) in front of PATH.
envs=()
for v in RUST_BACKTRACE RUST_LOG ${VM_PASS_ENV:-}; do
    if [ -n "${!v+x}" ]; then envs+=("$v=${!v}"); fi
done
guest_cmd=$(printf '%q ' env "${envs[@]}" "$@")
if cargo_bin=$(command -v cargo); then
    guest_cmd="export PATH=$(printf '%q' "${cargo_bin%/*}"):\$PATH; $guest_cmd"
fi

# virtme-ng's guest init mounts fresh tmpfs on a few host directories (/var/tmp, /var/log,
# /var/cache, /var/lib/apt, /var/lib/private) after it has set up the shared directories,
# so a repository below one of them would be hidden in the guest. There it is shared
# read-only at a neutral guest path instead and overlaid back at its own path (writable in
# the guest, as --overlay-rwdir would make it) before the command runs.
# With VM_SYSTEMD=1 the guest's /tmp is a fresh tmpfs as well (see below), so a repository
# below /tmp is re-shared the same way; there the neutral path is /mnt (an existing directory
# of the read-only root: a share on a path the guest must create first never came up under
# systemd as PID 1).
cwd_opt=(--cwd "$PWD")
hidden_in_guest() {
    case "$1/" in
        /var/tmp/*|/var/log/*|/var/cache/*|/var/lib/apt/*|/var/lib/private/*) return 0;;
        /tmp/*) [ "${VM_SYSTEMD:-0}" = 1 ];;
        *) return 1;;
    esac
}
if hidden_in_guest "$repo"; then
    lower=/run/opservant-vm-repo
    [ "${VM_SYSTEMD:-0}" = 1 ] && lower=/mnt
    if [ "${VM_REPO_RW:-0}" = 1 ]; then
        repo_opt=(--rwdir "$lower=$repo")
        remount="mkdir -p $(printf '%q' "$repo") && mount --bind $lower $(printf '%q' "$repo")"
    else
        repo_opt=(--rodir "$lower=$repo")
        remount="mkdir -p /run/opservant-vm-ovl $(printf '%q' "$repo") && mount -t tmpfs opservant-vm-ovl /run/opservant-vm-ovl \
            && mkdir /run/opservant-vm-ovl/upper /run/opservant-vm-ovl/work \
            && mount -t overlay opservant-vm-repo -o lowerdir=$lower,upperdir=/run/opservant-vm-ovl/upper,workdir=/run/opservant-vm-ovl/work $(printf '%q' "$repo")"
    fi
    guest_cmd="$remount && cd $(printf '%q' "$PWD") && $guest_cmd"
    cwd_opt=(--cwd /)
else
    if [ "${VM_REPO_RW:-0}" = 1 ]; then repo_opt=(--rwdir "$repo"); else repo_opt=(--overlay-rwdir "$repo"); fi
fi
append=()
[ -n "${VM_APPEND:-}" ] && append=(--append "$VM_APPEND")
console=()
[ "${VM_CONSOLE:-0}" = 1 ] && console=(--verbose)

# VM_SYSTEMD=1: systemd as PID 1. virtme-ng 1.42's --systemd boots /sbin/init over the host
# root and runs CMD from a drop-in for serial-getty@.service. Three things get in its way on
# a host like this one, each worked around here without touching the host:
# - /.dockerenv exists on the host root, so systemd believes it runs in a Docker container:
#   it then reads its kernel options from /proc/1/cmdline (ignoring every systemd.* option)
#   and its getty generator starts console-getty instead of serial-getty@ttyS0. `container=`
#   (empty) in PID 1's environment makes PID 1 itself detect no container; the generators
#   still say "container-other", so
# - systemd.unit=serial-getty@ttyS0.service makes the getty that runs CMD the boot target
#   (PID 1 parses that option itself): sysinit and basic units, then CMD — no host services.
# - systemd-tmpfiles-setup.service would walk the host's /tmp and /var/tmp over 9p trying to
#   clean them (read-only, but minutes of EROFS); virtme-ng's configurable fstab (bound over
#   /etc/fstab before PID 1 starts) mounts tmpfs on both first. virtme-ng reads its config
#   from $HOME, so vng runs with HOME pointing at a scratch directory holding that config.
vng_env=()
systemd_opt=()
if [ "${VM_SYSTEMD:-0}" = 1 ]; then
    [ -x /lib/systemd/systemd ] || die "VM_SYSTEMD=1 needs systemd on the host root (/lib/systemd/systemd)"
    state=${VM_STATE_DIR:-$repo/target/vm-exec}
    # A repository below /tmp or /var/tmp: its target/ is hidden in the guest, so the helper
    # files go to a directory of their own below /var/lib (the guest sees the host's /var
    # through an overlay), removed again when the VM is gone.
    state_tmp=
    if [ -z "${VM_STATE_DIR:-}" ]; then
        case "$state/" in
            /tmp/*|/var/tmp/*)
                state=$(mktemp -d /var/lib/opservant-vm-exec.XXXXXX)
                state_tmp=$state
                ;;
        esac
    fi
    mkdir -p "$state/home/.config/virtme-ng"
    state=$(cd "$state" && pwd)
    case "$state/" in
        /tmp/*|/var/tmp/*) die "VM_STATE_DIR=$state is hidden in the guest (tmpfs on /tmp and /var/tmp)";;
    esac
    printf '%s\n' 'tmpfs /tmp tmpfs mode=1777,nosuid,nodev 0 0' 'tmpfs /var/tmp tmpfs mode=1777,nosuid,nodev 0 0' \
        > "$state/fstab"
    printf '{"default_opts": {}, "clean_exclude": [], "systemd": {"masks": [], "fstab": "%s"}}\n' "$state/fstab" \
        > "$state/home/.config/virtme-ng/virtme-ng.conf"
    vng_env=(env "HOME=$state/home")
    systemd_opt=(--systemd --append "container= systemd.unit=serial-getty@ttyS0.service")
fi

# --force-9p: vng tries virtiofsd first; Debian 12's (QEMU's C /usr/lib/qemu/virtiofsd)
# rejects vng's arguments, and vng then waits ~5 s for it before falling back to 9p anyway.
vng_cmd=("${vng_env[@]}" vng --run "$VM_KERNEL" --disable-kvm --force-9p
    --memory "${VM_MEMORY:-1G}" --cpus "${VM_CPUS:-2}"
    "${repo_opt[@]}" "${cwd_opt[@]}" "${append[@]}" "${console[@]}" "${systemd_opt[@]}"
    -- "$guest_cmd")
[ "${VM_VERBOSE:-0}" = 1 ] && echo "vm-exec: timeout ${VM_TIMEOUT:-600} ${vng_cmd[*]@Q}" >&2

# --- run ------------------------------------------------------------------------
# QEMU opens /proc/self/fd/1 and /proc/self/fd/2 itself (O_TRUNC, separate file
# offsets): if they are regular files the two streams overwrite each other and the
# caller's log gets truncated. Feeding them through pipes (cat) avoids that.
# stdin is /dev/null so nothing depends on a TTY. `timeout` puts vng and its qemu
# child in their own process group and signals the whole group on expiry;
# the trap does the same if this script is interrupted, so no qemu is left behind.
timeout --kill-after=15 "${VM_TIMEOUT:-600}" "${vng_cmd[@]}" </dev/null \
    > >(cat) 2> >(cat >&2) &
vm_pid=$!
trap 'kill -TERM "$vm_pid" 2>/dev/null || true' INT TERM HUP
rc=0
while :; do
    wait "$vm_pid" && rc=0 || rc=$?
    kill -0 "$vm_pid" 2>/dev/null || break    # wait was only interrupted by a trapped signal
done
wait || true    # let the cat relays flush before returning
[ -n "${state_tmp:-}" ] && rm -rf "$state_tmp"
[ "$rc" = 124 ] && echo "vm-exec: timed out after ${VM_TIMEOUT:-600}s" >&2
exit "$rc"
