"""The kernel under the shipped unit's sandboxing (issue 24): deploy/systemd/syscall-kernel@.service parsed, its
settings applied as systemd applies them (tests/unitsandbox.py: mount, IPC and UTS namespaces, a new /proc,
ProtectSystem=strict with the unit's read-write paths, a private /tmp and /dev, the kernel-tunable and log
masks, the capability bounding set, no_new_privs, the address-family and system-call filters), and a whole
kernel (`serve`, local backend, bwrap jail) run inside taking a real sleep to its wake.

A setting that breaks the jail fails `test_a_sleep_completes_under_the_units_sandboxing`; the unit's past
breakages are replayed against the emulation to show that they would (`ProcSubset=pid`: bwrap cannot read
/proc/sys/kernel/overflowuid; no AF_NETLINK: bwrap cannot bring up the job's loopback; `ProtectKernelTunables=`
or `ProtectKernelLogs=`: locked mounts over /proc make the kernel refuse bwrap a new /proc). A setting the
emulation does not know fails `test_every_setting_of_the_unit_is_emulated`, naming it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import unitsandbox as U
from kernelproc import Kernel, make_workspace
from testenv import need

pytestmark = pytest.mark.bwrap

# The unit's User=%i: an unprivileged account that exists here. (As root without capabilities bwrap may not map
# uid 0 into its namespace, so the kernel must run as another user, as it does under the unit.)
INSTANCE = "nobody"
PSEUDO_DEVICES = {"null", "zero", "full", "random", "urandom", "tty", "pts", "shm", "mqueue", "hugepages"}
PSEUDO_DEVICES |= {"fd", "stdin", "stdout", "stderr", "ptmx"}


@pytest.fixture
def can_emulate() -> None:
    why = U.can_emulate()
    need("the unit sandbox emulation", not why, why)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory that INSTANCE can reach (pytest's are root's alone), removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="sk-unit-"))
    where.chmod(0o755)
    try:
        yield where
    finally:
        shutil.rmtree(where)


@pytest.fixture
def python(base: Path, can_emulate: None) -> str:
    """An interpreter INSTANCE can run that imports this checkout's kernel: the test's own, or (where it lies
    under root's home, as pyenv's does) the system's of the same version with a venv that adds the test's
    site-packages (where the kernel is installed, editable), or, where the checkout itself is out of
    INSTANCE's reach, that venv with a copy of the site-packages and of the kernel's packages."""
    tried: list[str] = []

    def runs(exe: str) -> bool:
        # The resolved file, searched for as the user (here an exec of pyenv's venv symlink succeeded as that
        # user outside the sandbox, and failed inside, where /root is searched as the mode says).
        real = os.path.realpath(exe)
        done = as_instance("sh", "-c", f"test -x {real} && exec {exe} -c 'import kernel.cli'", cwd=Path("/"))
        if done.returncode != 0:
            tried.append(f"{exe}: {done.stderr.strip()[-200:]}")
        return done.returncode == 0

    if runs(sys.executable):
        return sys.executable
    system = Path(f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}")
    if system.exists():
        here = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
        shim = base / "python"
        subprocess.run([str(system), "-m", "venv", "--without-pip", str(shim)], check=True, timeout=120)
        there = shim / "lib" / system.name / "site-packages"
        (there / "test-site.pth").write_text(f"import site; site.addsitedir({str(here)!r})\n")
        if runs(str(shim / "bin" / "python")):
            return str(shim / "bin" / "python")
        copy = base / "python-copy"
        subprocess.run([str(system), "-m", "venv", "--without-pip", str(copy)], check=True, timeout=120)
        there = copy / "lib" / system.name / "site-packages"
        skip = shutil.ignore_patterns("__editable__*", "__pycache__")
        shutil.copytree(here, there, symlinks=True, dirs_exist_ok=True, ignore=skip)
        src = copy / "src"  # inside the venv: the sandbox binds that directory only
        for package in ("kernel", "channel", "tool"):
            shutil.copytree(U.ROOT / package, src / package, ignore=skip)
        (there / "test-src.pth").write_text(f"{src}\n")
        for tool in ("uv", "uvx"):  # the environment builder, found beside the interpreter
            if (Path(sys.executable).parent / tool).exists():
                shutil.copy2(Path(sys.executable).parent / tool, copy / "bin" / tool)
        if runs(str(copy / "bin" / "python")):
            return str(copy / "bin" / "python")
    need("an interpreter the unit's user can run", False, "; ".join(tried))
    raise AssertionError("unreachable")


def as_instance(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command run as the unit's user (the agents' and the kernel's account), outside the sandbox."""
    account = pwd.getpwnam(INSTANCE)
    return subprocess.run(
        ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(cwd)},
    )


def chown_tree(top: Path) -> None:
    account = pwd.getpwnam(INSTANCE)
    for p in [top, *top.rglob("*")]:
        os.chown(p, account.pw_uid, account.pw_gid, follow_symlinks=False)


class Site:
    """The test's directories standing in for the unit's: its state, cache and workspace roots and config."""

    def __init__(self, tmp: Path) -> None:
        self.base = tmp
        self.kernel = Kernel(tmp, 'jail = "bwrap"\n')
        self.cache = tmp / "cache"
        self.spaces = tmp / "spaces"
        self.stage = tmp / "stage"
        for d in (self.cache, self.spaces, self.stage):
            d.mkdir()
        self.paths = {
            f"/var/lib/syscall-kernel/{INSTANCE}": self.kernel.state,
            f"/var/cache/syscall-kernel/{INSTANCE}": self.cache,
            f"/srv/agents/{INSTANCE}": self.spaces,
            f"/etc/syscall-kernel/{INSTANCE}.toml": self.kernel.config,
        }

    def prefix(self, unit_text: str, python: str) -> list[str]:
        software = [Path(python).parent.parent] if Path(python).is_relative_to(self.base) else []
        return U.prefix(U.parse(unit_text, INSTANCE), self.paths, self.stage, sys.executable, software)


def test_every_setting_of_the_unit_is_emulated() -> None:
    unit = U.parse(U.UNIT.read_text(), INSTANCE)
    assert U.unknown_keys(unit) == []
    new = U.parse(U.with_setting(U.UNIT.read_text(), "ProtectFutureThing", "yes"), INSTANCE)
    with pytest.raises(U.UnknownSetting, match=r"ProtectFutureThing.*teach it how systemd applies"):
        U.plan(new, {}, Path("/nonexistent"))


def test_the_emulation_applies_the_units_settings(base: Path, python: str) -> None:
    """What the kernel's process sees inside: the settings took effect (an emulation that applied nothing
    would pass the job test too)."""
    site = Site(base)
    site.kernel.state.mkdir()
    # Owned by the user, so that only the mounts can refuse a write.
    chown_tree(site.spaces)
    chown_tree(site.kernel.config)
    probe = r"""
import errno, json, os, socket, sys
def appendable(p):
    try:
        open(p, "a").close(); return True
    except OSError as e:
        return e.errno
def writable(p):
    try:
        open(os.path.join(p, ".probe"), "w").close(); os.unlink(os.path.join(p, ".probe")); return True
    except OSError as e:
        return e.errno
def family(f):
    try:
        socket.socket(f, socket.SOCK_DGRAM if f != socket.AF_NETLINK else socket.SOCK_RAW).close(); return True
    except OSError as e:
        return e.errno
status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
print(json.dumps({
    "usr": writable("/usr"), "etc": writable("/etc"), "state": writable(sys.argv[1]),
    "spaces": writable(sys.argv[2]), "cache": writable(sys.argv[3]), "tmp": os.listdir("/tmp"),
    "config": appendable(sys.argv[4]), "config_read": open(sys.argv[4]).read() != "",
    "proc": [l for l in open("/proc/mounts") if " /proc " in l],
    "packet": family(socket.AF_PACKET), "netlink": family(socket.AF_NETLINK), "inet": family(socket.AF_INET),
    "capbnd": status["CapBnd"].strip(), "nnp": status["NoNewPrivs"].strip(), "umask": status["Umask"].strip(),
    "dev": sorted(os.listdir("/dev")), "uid": os.getuid(),
    "tmpdir": os.environ.get("TMPDIR"), "cwd": os.getcwd(),
}))
"""
    argv = [
        python,
        "-c",
        probe,
        str(site.kernel.state),
        str(site.spaces),
        str(site.cache),
        str(site.kernel.config),
    ]
    done = subprocess.run(
        [*site.prefix(U.UNIT.read_text(), python), *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    EROFS, EAFNOSUPPORT = 30, 97
    assert (seen["usr"], seen["etc"], seen["config"]) == (EROFS,) * 3, seen
    assert (seen["state"], seen["spaces"], seen["cache"]) == (True, True, True), seen
    assert seen["config_read"]
    # PrivateTmp: only the test's own directories are re-bound into the new /tmp.
    expected = [base.relative_to("/tmp").parts[0]] if base.is_relative_to("/tmp") else []
    assert seen["tmp"] == expected, seen["tmp"]
    assert "hidepid=invisible" in seen["proc"][-1], seen["proc"]
    assert (seen["packet"], seen["netlink"], seen["inet"]) == (EAFNOSUPPORT, True, True)
    assert (seen["capbnd"], seen["nnp"], seen["umask"]) == ("0000000000000000", "1", "0077")
    # PrivateDevices: the pseudo devices only (no disk, no kmsg).
    assert "null" in seen["dev"], seen["dev"]
    assert set(seen["dev"]) <= PSEUDO_DEVICES, seen["dev"]
    assert seen["uid"] == pwd.getpwnam(INSTANCE).pw_uid
    assert (seen["tmpdir"], seen["cwd"]) == (str(site.cache), "/")


def test_a_sleep_completes_under_the_units_sandboxing(base: Path, python: str, bwrap_available: None) -> None:
    site = Site(base)
    ws = make_workspace(site.spaces / "ws")
    # The agents' files and the store are the unit's user's, who enrolls (the CLI run by hand as that user).
    site.kernel.state.mkdir()
    chown_tree(site.spaces)
    chown_tree(site.kernel.state)
    enroll = ["-m", "kernel.cli", "enroll", str(ws), "--launches", "5", "--sleeps", "5", "--gpu-hours", "1"]
    done = as_instance(python, *enroll, "--config", str(site.kernel.config), cwd=Path("/"))
    assert done.returncode == 0, done.stderr
    site.kernel.start(prefix=site.prefix(U.UNIT.read_text(), python), python=python)
    try:

        def ok(*args: str) -> str:
            done = as_instance(python, str(ws / ".syscall" / "syscall"), *args, cwd=ws)
            assert done.returncode == 0, (
                f"{args}: {done.stdout}{done.stderr}\n{site.kernel.log_text()[-3000:]}"
            )
            return done.stdout

        ok(
            "launch",
            "--name",
            "nap",
            "--artifact",
            "out.txt",
            "--",
            "sh",
            "-c",
            "sleep 1 && echo rested > out.txt",
        )
        wake = json.loads(ok("sleep", "--wait", "--json", "--timeout", "90"))
        [task] = wake["tasks"]
        assert task["state"] == "COMPLETED", (wake, site.kernel.log_text()[-3000:])
        assert (ws / ".syscall" / "wakes" / f"{wake['id']}.json").is_file()
        [art] = task["artifacts"]
        assert (ws / ".syscall" / art["delivered"]).read_text() == "rested\n"
        assert site.kernel.stop() == 0
    finally:
        site.kernel.ensure_stopped()


@pytest.mark.parametrize(
    ("key", "value", "bwrap_says"),
    [
        ("ProcSubset", "pid", "Can't read /proc/sys/kernel/overflowuid"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6", "Failed to create NETLINK_ROUTE socket"),
        ("ProtectKernelTunables", "yes", "Can't mount proc on /newroot/proc"),
        ("ProtectKernelLogs", "yes", "Can't mount proc on /newroot/proc"),
    ],
)
def test_a_setting_that_breaks_the_jail_is_caught(
    base: Path, python: str, bwrap_available: None, key: str, value: str, bwrap_says: str
) -> None:
    """Each of these, put back into the unit, stops the kernel before `ready` with bwrap's message (serve tries
    the jail first), so the sleep above cannot complete."""
    site = Site(base)
    site.kernel.state.mkdir()
    unit = U.with_setting(U.UNIT.read_text(), key, value)
    site.kernel.start(prefix=site.prefix(unit, python), python=python, wait_ready=False)
    try:
        assert site.kernel.proc is not None
        assert site.kernel.proc.wait(120) == 2, site.kernel.log_text()
        log = site.kernel.log_text()
        assert "event=jail_unusable" in log, log
        assert bwrap_says in log, log
        assert "event=ready" not in log
    finally:
        site.kernel.ensure_stopped()
