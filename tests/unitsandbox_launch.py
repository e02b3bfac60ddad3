"""Applies a unit's sandboxing plan (made by tests/unitsandbox.py) to this process, then execs the command.

Run as root in a new mount namespace (`unshare --mount --propagation private`, which execs it):
`python unitsandbox_launch.py PLAN.json -- COMMAND...`. The mounts follow systemd 252's namespace.c: a new /proc
with the unit's options, a private /tmp and /var/tmp, a private /dev, the read-write, read-only and inaccessible
paths, ProtectSystem='s read-only remounts, ProtectKernelTunables=/Logs= and ProtectControlGroups=; then the
process's own: RLIMIT_NOFILE, umask, capability bounding set, User=, no_new_privs, seccomp filters.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import struct
import sys
from typing import Any

libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
FLAG_OF = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}

# systemd 252, src/core/namespace.c: protect_kernel_tunables_{proc,sys}_table, protect_kernel_logs_*_table.
TUNABLES_RO = [
    "/proc/acpi",
    "/proc/apm",
    "/proc/asound",
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/latency_stats",
    "/proc/mtrr",
    "/proc/scsi",
    "/proc/sys",
    "/proc/sysrq-trigger",
    "/proc/timer_stats",
    "/sys",
    "/sys/fs/bpf",
    "/sys/kernel/debug",
    "/sys/kernel/tracing",
]
TUNABLES_HIDDEN = ["/proc/kallsyms", "/proc/kcore"]
LOGS_HIDDEN = ["/proc/kmsg", "/dev/kmsg"]
HOME_DIRS = ["/home", "/root", "/run/user"]
DEVICES = ["null", "zero", "full", "random", "urandom", "tty"]
DEVICE_DIRS = ["pts", "shm", "mqueue", "hugepages"]


def fail(what: str) -> None:
    sys.exit(f"unitsandbox: {what}: {os.strerror(ctypes.get_errno())}")


def mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) != 0:
        fail(f"mount {src} on {target}")


def mountinfo() -> list[tuple[str, int]]:
    """Each mount point with its per-mount flags, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = 0
            for opt in fields[5].split(","):
                flags |= FLAG_OF.get(opt, 0)
            out.append((point, flags))
    return out


def under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def bind_from(fd: int, target: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)


def chown_tree(top: str, uid: int, gid: int) -> None:
    os.chown(top, uid, gid)
    for where, dirs, files in os.walk(top):
        for name in dirs + files:
            os.chown(os.path.join(where, name), uid, gid, follow_symlinks=False)


def remount_ro(point: str, flags: int) -> None:
    mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)


def apply(p: dict[str, Any]) -> None:
    stage = p["stage"]
    with open("/proc/sys/kernel/cap_last_cap") as f:  # before a ProcSubset=pid /proc hides it
        last_cap = int(f.read())
    # The inaccessible nodes (systemd's /run/systemd/inaccessible/), on a tmpfs of their own.
    mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    os.mkdir(f"{stage}/dir", 0)
    os.close(os.open(f"{stage}/reg", os.O_CREAT | os.O_WRONLY, 0))
    hidden = {True: os.open(f"{stage}/dir", os.O_PATH), False: os.open(f"{stage}/reg", os.O_PATH)}

    for path, mode in p["managed"]:  # StateDirectory=, CacheDirectory=: made, and chowned as a tree to User=
        os.makedirs(path, exist_ok=True)
        os.chmod(path, mode)
        if p["user"] is not None and os.stat(path).st_uid != p["user"]["uid"]:
            chown_tree(path, p["user"]["uid"], p["user"]["gid"])
    visible: list[tuple[str, bool]] = []  # the paths re-bound after /tmp and /dev are replaced
    for path, optional in p["read_write"] + p["read_only"]:
        if not os.path.exists(path):
            if optional:
                continue
            sys.exit(f"unitsandbox: {path} does not exist: systemd would refuse to start the unit")
        visible.append((path, os.path.isdir(path)))
    visible += [(path, True) for path, _ in p["managed"]]
    fds = {path: os.open(path, os.O_PATH) for path, _ in visible}

    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, p["proc_options"] or None)
    private: list[str] = []
    if p["private_tmp"]:
        for where in ("/tmp", "/var/tmp"):
            mount("tmpfs", where, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
            private.append(where)
    if p["private_devices"]:
        nodes = {d: os.open(f"/dev/{d}", os.O_PATH) for d in DEVICES if os.path.exists(f"/dev/{d}")}
        dirs = {d: os.open(f"/dev/{d}", os.O_PATH) for d in DEVICE_DIRS if os.path.isdir(f"/dev/{d}")}
        mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_STRICTATIME, "mode=0755")
        for d, fd in nodes.items():
            bind_from(fd, f"/dev/{d}", False)
        for d, fd in dirs.items():
            bind_from(fd, f"/dev/{d}", True)
        for name, to in [
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
        ]:
            os.symlink(to, f"/dev/{name}")
        os.symlink("/proc/self/fd/2", "/dev/stderr")
        os.symlink("pts/ptmx", "/dev/ptmx")
    # Every read-write, read-only and managed path its own mount (re-bound where /tmp or /dev was replaced).
    for path, is_dir in sorted(visible):
        bind_from(fds[path], path, is_dir)
    for path, optional in p["inaccessible"]:
        if os.path.exists(path):
            bind_from(hidden[os.path.isdir(path)], path, os.path.isdir(path))
        elif not optional:
            sys.exit(f"unitsandbox: {path} does not exist: systemd would refuse to start the unit")
    home = p["protect_home"]
    for path in HOME_DIRS:
        if home in ("yes", "true") and os.path.isdir(path):
            bind_from(hidden[True], path, True)
        elif home == "tmpfs" and os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=0755")

    writable = [path for path, _ in p["read_write"]] + [path for path, _ in p["managed"]]
    read_only: list[str] = [path for path, _ in p["read_only"]]
    system = p["protect_system"]
    if system == "strict":
        read_only.append("/")
    elif system in ("yes", "true", "full"):
        read_only += ["/usr", "/boot", "/efi"] + (["/etc"] if system == "full" else [])
    if home == "read-only":
        read_only += HOME_DIRS
    api = ["/dev", "/proc", "/sys"]
    for top in read_only:
        if top != "/" and os.path.exists(top) and top not in [m for m, _ in mountinfo()]:
            bind_from(os.open(top, os.O_PATH), top, os.path.isdir(top))
    named = {path for path, _ in p["read_only"]}  # asked for by name: read-only wherever they lie
    for point, flags in mountinfo():
        if point not in named:
            if not any(under(point, top) for top in read_only):
                continue
            # strict leaves the API file systems to the Protect*= settings; the writable and private ones stay so
            if "/" in read_only and any(under(point, a) for a in api):
                continue
            if any(under(point, w) for w in [*writable, *private]):
                continue
        remount_ro(point, flags)

    protect: list[str] = []
    if p["kernel_tunables"]:
        protect += TUNABLES_RO
        for path in TUNABLES_HIDDEN:
            if os.path.exists(path):
                bind_from(hidden[os.path.isdir(path)], path, os.path.isdir(path))
    if p["control_groups"]:
        protect.append("/sys/fs/cgroup")
    if p["kernel_logs"]:
        for path in LOGS_HIDDEN:
            if os.path.exists(path):
                bind_from(hidden[False], path, False)
    for top in protect:
        if os.path.exists(top) and top not in [m for m, _ in mountinfo()]:
            bind_from(os.open(top, os.O_PATH), top, os.path.isdir(top))
    for point, flags in mountinfo():
        if any(under(point, top) for top in protect):
            remount_ro(point, flags)

    if p["nofile"]:
        # Up to the hard limit where this process may not raise it (a container without CAP_SYS_RESOURCE).
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        n = p["nofile"] if hard == resource.RLIM_INFINITY else min(p["nofile"], hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    os.umask(p["umask"])
    if p["drop_capabilities"]:
        for cap in range(last_cap + 1):
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                fail(f"dropping capability {cap}")
    if p["user"] is not None:  # systemd's order: groups, gid, uid (which clears root's capabilities)
        os.setgroups([])
        os.setgid(p["user"]["gid"])
        os.setuid(p["user"]["uid"])
    if p["no_new_privileges"] and libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        fail("no_new_privs")
    errno = p["syscall_errno"]
    if p["allowed_syscalls"] is not None:
        seccomp(syscall_filter(p["allowed_syscalls"], errno, p["native_only"]))
    if p["refused_families"]:
        seccomp(family_filter(p["refused_families"]))


# Classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}: offsets 0, 4, 16 (args[0] low).
LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06
ALLOW, ERRNO = 0x7FFF0000, 0x00050000
AUDIT_ARCH_X86_64, X32_BIT, SOCKET_NR = 0xC000003E, 0x40000000, 41
EAFNOSUPPORT = 97


def syscall_filter(allowed: list[int], errno: int, native_only: bool) -> list[tuple[int, int, int, int]]:
    """SystemCallFilter= as an allow-list (the rest: ERRNO(errno)); SystemCallArchitectures=native: another
    architecture's calls (and x32's) are refused too."""
    deny = (RET, 0, 0, ERRNO | errno)
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, AUDIT_ARCH_X86_64), deny if native_only else (RET, 0, 0, ALLOW)]
    prog += [(LD, 0, 0, 0), (JGE, 0, 1, X32_BIT), deny]
    for nr in allowed:
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, ALLOW)]
    return [*prog, deny]


def family_filter(refused: list[int]) -> list[tuple[int, int, int, int]]:
    """RestrictAddressFamilies=: socket(2) for a family left out fails with EAFNOSUPPORT, as under systemd."""
    n = len(refused)
    prog = [(LD, 0, 0, 4), (JEQ, 0, 3 + n, AUDIT_ARCH_X86_64), (LD, 0, 0, 0), (JEQ, 0, 1 + n, SOCKET_NR)]
    prog += [(LD, 0, 0, 16), *[(JEQ, n - i, 0, fam) for i, fam in enumerate(refused)]]
    return [*prog, (RET, 0, 0, ALLOW), (RET, 0, 0, ERRNO | EAFNOSUPPORT)]


def seccomp(prog: list[tuple[int, int, int, int]]) -> None:
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    filt = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *ins) for ins in prog))
    fprog = Fprog(len(prog), ctypes.cast(filt, ctypes.c_void_p))
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        fail("seccomp")


def main() -> None:
    spec, sep, *command = sys.argv[1:]
    if sep != "--" or not command:
        sys.exit("usage: unitsandbox_launch.py PLAN.json -- COMMAND...")
    with open(spec) as f:
        p = json.load(f)
    apply(p)
    os.chdir("/")  # systemd's WorkingDirectory= default for a system service
    os.execvpe(command[0], command, p["env"])


if __name__ == "__main__":
    main()
