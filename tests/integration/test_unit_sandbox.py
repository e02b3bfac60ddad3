"""The job jail under the shipped unit's sandboxing (issue 24, first part): the unit's settings that reach bwrap,
read from deploy/systemd/syscall-kernel@.service and applied the way systemd applies them, in a namespace the
test makes, and the kernel's real job jail run inside.

- `ProtectProc=` / `ProcSubset=`: /proc is mounted with `hidepid=` and `subset=pid` as systemd mounts it (a new
  mount and pid namespace, as root).
- `RestrictAddressFamilies=`: a seccomp filter refusing `socket(2)` for the families the unit leaves out
  (`EAFNOSUPPORT`, systemd's errno), installed with `no_new_privs` by a launcher that then execs bwrap.

Before the fix, `ProcSubset=pid` hid /proc/sys (`bwrap: Can't read /proc/sys/kernel/overflowuid`) and the family
list lacked AF_NETLINK (`bwrap: loopback: Failed to create NETLINK_ROUTE socket`): every job failed. A new unit
setting among these two that breaks the jail fails this test.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kernelproc import Kernel
from testenv import IN_CI

from kernel.node import jail as J

pytestmark = pytest.mark.bwrap

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "syscall-kernel@.service"
FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17}
SOCKET_NR = {"x86_64": 41, "aarch64": 198}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

# Installs a seccomp filter refusing socket(family, ...) for the families in argv[1] (comma-separated numbers),
# then execs argv[2:]. The classic-BPF program: the arch must be this one, the call socket(2), the family (the
# first argument's low word) one of the refused: ERRNO(EAFNOSUPPORT); anything else is allowed.
LAUNCHER = r"""
import ctypes, os, struct, sys
refused = [int(f) for f in sys.argv[1].split(",") if f]
nr, arch, n = int(sys.argv[2]), int(sys.argv[3]), len(refused)
LD, JEQ, RET, ALLOW, DENY = 0x20, 0x15, 0x06, 0x7FFF0000, 0x00050000 | 97
prog = [(LD, 0, 0, 4), (JEQ, 0, 3 + n, arch), (LD, 0, 0, 0), (JEQ, 0, 1 + n, nr), (LD, 0, 0, 16)]
prog += [(JEQ, n - i, 0, fam) for i, fam in enumerate(refused)]
prog += [(RET, 0, 0, ALLOW), (RET, 0, 0, DENY)]
filt = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *ins) for ins in prog))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(prog), ctypes.cast(filt, ctypes.c_void_p))
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
    sys.exit("seccomp: " + os.strerror(ctypes.get_errno()))
os.execvp(sys.argv[4], sys.argv[4:])
"""


def unit_settings() -> dict[str, str]:
    """The [Service] settings, the last assignment of each key winning (systemd's rule for these keys)."""
    out: dict[str, str] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def proc_options(settings: dict[str, str]) -> str:
    opts = []
    if settings.get("ProtectProc", "default") != "default":
        opts.append(f"hidepid={settings['ProtectProc']}")
    if settings.get("ProcSubset", "all") == "pid":
        opts.append("subset=pid")
    return ",".join(opts) or "defaults"


def refused_families(settings: dict[str, str]) -> list[int]:
    allowed = settings.get("RestrictAddressFamilies", "").split()
    if not allowed or allowed[0].startswith("~"):
        return []
    return sorted(n for name, n in FAMILIES.items() if name not in allowed)


def under_unit(argv: list[str], settings: dict[str, str]) -> subprocess.CompletedProcess[str]:
    machine = platform.machine()
    if machine not in SOCKET_NR:
        pytest.skip(f"no socket(2) number known for {machine}")
    inner = [
        sys.executable,
        "-c",
        LAUNCHER,
        ",".join(map(str, refused_families(settings))),
        str(SOCKET_NR[machine]),
        str(AUDIT_ARCH[machine]),
        *argv,
    ]
    script = f'mount -t proc -o {proc_options(settings)} proc /proc && exec "$@"'
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--pid",
            "--fork",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            *inner,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.fixture
def can_make_namespaces() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        why = "mounting a /proc as systemd does needs root and unshare(1)"
        if IN_CI:
            pytest.fail(f"{why} (CI=true runs as root)")
        pytest.skip(why)


def test_the_launcher_applies_what_it_is_given(can_make_namespaces: None, bwrap_available: None) -> None:
    """The emulation is real: the unit's old settings break bwrap here exactly as they did under systemd."""
    old = {
        "ProtectProc": "invisible",
        "ProcSubset": "pid",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    }
    probe = ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"]
    got = under_unit(probe, old)
    assert got.returncode != 0
    assert "/proc/sys/kernel/overflowuid" in got.stderr, got.stderr
    got = under_unit(probe, {**old, "ProcSubset": "all"})
    assert got.returncode != 0
    assert "NETLINK_ROUTE" in got.stderr, got.stderr


def test_a_job_jail_runs_under_the_units_sandboxing(
    tmp_path: Path, can_make_namespaces: None, bwrap_available: None
) -> None:
    settings = unit_settings()
    tree, home, work = (tmp_path / n for n in ("tree", "home", "work"))
    for d in (tree, home, work):
        d.mkdir()
    paths = J.JailPaths(str(tree), str(home), str(work))
    argv = J.bwrap_argv(
        J.JailPolicy(), paths, J.env_args("bwrap", {}), "echo ran > proof && ls /proc/sys/kernel"
    )
    got = under_unit(argv, settings)
    assert got.returncode == 0, f"the job jail failed under the unit's settings {settings}:\n{got.stderr}"
    assert (tree / "proof").read_text() == "ran\n"


def test_serve_refuses_to_start_where_its_jail_cannot_run_jobs(
    tmp_path: Path, can_make_namespaces: None, bwrap_available: None
) -> None:
    """Under the old unit's settings the kernel said `ready` and then failed every task; now `serve` tries the
    jail first and stops with bwrap's own message (a local backend with jail = "bwrap", the defaults)."""
    old = {
        "ProtectProc": "invisible",
        "ProcSubset": "pid",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    }
    k = Kernel(tmp_path)
    got = under_unit([sys.executable, "-m", "kernel.cli", "serve", "--config", str(k.config)], old)
    assert got.returncode == 2, got.stdout + got.stderr
    assert "event=jail_unusable" in got.stderr
    assert "Can't read /proc/sys/kernel/overflowuid" in got.stderr
    assert "event=ready" not in got.stderr
    # The same kernel starts where bwrap works.
    k.start()
    k.stop()
