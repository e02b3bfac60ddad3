"""A systemd unit's sandboxing, emulated without systemd: the shipped unit file parsed, each setting the emulation
knows turned into a plan, and the plan applied by `unitsandbox_launch.py` in namespaces that `unshare(1)` makes
(as root), before it execs the service's command (in the same process: signals sent to it reach the service).

Why not systemd itself: a system instance needs its own root file system (`systemd-nspawn`, not installed in the
CI containers); one started in a mere PID and mount namespace shares the host's disk, and its boot-time
`systemd-tmpfiles --remove` empties the host's /tmp.

The emulation follows systemd 252's src/core/namespace.c for the mounts (the same paths, read-only or
inaccessible, the same order: new /proc, private /tmp and /dev, binds, then read-only remounts), seccomp for
`RestrictAddressFamilies=`, `SystemCallFilter=` and `SystemCallArchitectures=` (the groups expanded by
`systemd-analyze syscall-filter`), and the capability bounding set, `NoNewPrivileges=`, `UMask=` and
`LimitNOFILE=` as the service's process gets them, and `User=` (an account that exists here: the test's
instance is `nobody`) with the environment systemd gives it.

Every [Service] key is classified: APPLIED, INERT (not sandboxing, or sandboxing that no job jail can trip over,
with the reason) or unknown. An unknown key makes `plan` raise `UnknownSetting`: a new sandboxing setting in the
unit is not silently left out of the test that proves the unit runs jobs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "systemd" / "syscall-kernel@.service"
LAUNCHER = Path(__file__).resolve().parent / "unitsandbox_launch.py"
UNISTD = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")

# Keys whose values accumulate over assignments (an empty assignment clears what came before), as systemd reads them.
LIST_KEYS = frozenset(
    {
        "ReadWritePaths",
        "ReadOnlyPaths",
        "InaccessiblePaths",
        "RestrictAddressFamilies",
        "SystemCallFilter",
        "Environment",
        "StateDirectory",
        "CacheDirectory",
        "CapabilityBoundingSet",
        "AmbientCapabilities",
        "SystemCallArchitectures",
    }
)

APPLIED = frozenset(
    {
        "ProtectSystem",
        "ReadWritePaths",
        "ReadOnlyPaths",
        "InaccessiblePaths",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
        "PrivateMounts",
        "PrivateIPC",
        "ProtectHostname",
        "ProtectProc",
        "ProcSubset",
        "ProtectKernelTunables",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "StateDirectory",
        "CacheDirectory",
        "StateDirectoryMode",
        "CacheDirectoryMode",
        "Environment",
        "UMask",
        "LimitNOFILE",
        "NoNewPrivileges",
        "CapabilityBoundingSet",
        "AmbientCapabilities",
        "RestrictAddressFamilies",
        "SystemCallFilter",
        "SystemCallErrorNumber",
        "SystemCallArchitectures",
        "User",
    }
)

INERT = {
    "Type": "how systemd learns the service is up",
    "NotifyAccess": "how systemd learns the service is up",
    "ExecStart": "the command: the test runs this checkout's kernel",
    "ExecReload": "reload only",
    "WatchdogSec": "service manager timing",
    "Restart": "service manager",
    "RestartSec": "service manager",
    "RestartPreventExitStatus": "service manager",
    "TimeoutStartSec": "service manager",
    "TimeoutStopSec": "service manager",
    "KillMode": "what stop kills, not what runs",
    # Seccomp filters on calls neither bwrap nor a job jail makes: clock_settime/adjtimex, init_module,
    # realtime scheduling, setuid/setgid bits on new files, personality(2).
    "ProtectClock": "refuses setting the clock, which no jail does",
    "ProtectKernelModules": "refuses loading modules, which no jail does",
    "RestrictRealtime": "refuses realtime scheduling, which no jail asks for",
    "RestrictSUIDSGID": "refuses making setuid/setgid files, which no jail does",
    "LockPersonality": "refuses personality(2) changes, which no jail makes",
    "KeyringMode": "the session keyring, which bwrap does not use",
}


class UnknownSetting(Exception):
    pass


@dataclass
class Unit:
    """The [Service] settings with systemd's semantics: a list key's values accumulate (an empty assignment
    clears them), any other key's last assignment wins."""

    scalars: dict[str, str] = field(default_factory=dict)
    lists: dict[str, list[str]] = field(default_factory=dict)

    def get(self, key: str, default: str = "") -> str:
        return self.scalars.get(key, default)

    def items(self, key: str) -> list[str]:
        return self.lists.get(key, [])

    def names(self) -> set[str]:
        return set(self.scalars) | set(self.lists)


def parse(text: str, instance: str) -> Unit:
    unit = Unit()
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section != "[Service]":
            continue
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip().replace("%i", instance)
        if key in LIST_KEYS:
            if not value:
                unit.lists[key] = []
            else:
                unit.lists.setdefault(key, []).extend(value.split())
        else:
            unit.scalars[key] = value
    return unit


def with_setting(text: str, key: str, value: str | None) -> str:
    """The unit text with `key` set to `value` (appended to [Service]) or, for None, every `key=` line removed."""
    text = re.sub(rf"^{re.escape(key)}=.*\n", "", text, flags=re.M)
    if value is None:
        return text
    return text.replace("\n[Install]", f"\n{key}={value}\n\n[Install]")


def unknown_keys(unit: Unit) -> list[str]:
    return sorted(k for k in unit.names() if k not in APPLIED and k not in INERT)


FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17, "AF_BLUETOOTH": 31}


def syscall_numbers() -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+) (\d+)", UNISTD.read_text())}


def expand_filter(names: list[str]) -> list[str]:
    """`@group` names expanded (recursively) the way systemd does, by asking `systemd-analyze syscall-filter`."""
    out: list[str] = []
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if not name.startswith("@"):
            out.append(name)
            continue
        listing = subprocess.run(
            ["systemd-analyze", "syscall-filter", "--no-pager", name],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        for row in listing.splitlines()[1:]:
            row = row.strip()
            if row and not row.startswith("#"):
                todo.append(row)
    return out


def can_emulate() -> str:
    """Why the emulation cannot run here ("" when it can)."""
    import os
    import platform

    if os.geteuid() != 0:
        return "mounting /proc and making namespaces as systemd does needs root"
    for tool in ("unshare", "systemd-analyze"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if platform.machine() != "x86_64" or not UNISTD.exists():
        return f"the syscall numbers of {platform.machine()} are not known here ({UNISTD})"
    return ""


def plan(
    unit: Unit, site: dict[str, Path], stage: Path, software: list[Path] | None = None
) -> dict[str, Any]:
    """What the launcher applies. `site` maps the unit's absolute paths (after %i) to the test's (the state,
    cache and workspace directories, the config file); `stage` is an empty directory for the launcher's own
    inaccessible nodes; `software` what ExecStart runs where it lies in a directory the unit hides (the test's
    interpreter under /tmp; /opt/syscall-kernel in production), bound read-only into the sandbox."""
    if unknown := unknown_keys(unit):
        raise UnknownSetting(
            f"the unit sets {', '.join(unknown)}, which the sandbox emulation in tests/unitsandbox.py does not "
            "know: teach it how systemd applies each (or, where no job jail can notice it, add it to INERT "
            "with the reason), so that the test of the unit's jobs runs under it"
        )

    def here(path: str) -> str:
        for unit_path, test_path in sorted(site.items(), key=lambda kv: -len(kv[0])):
            if path == unit_path or path.startswith(unit_path + "/"):
                return str(test_path) + path[len(unit_path) :]
        return path

    def paths(key: str) -> list[tuple[str, bool]]:
        out = []
        for p in unit.items(key):
            optional = p.startswith("-")
            out.append((here(p.lstrip("-+")), optional))
        return out

    managed = [
        (f"/var/lib/{d}", unit.get("StateDirectoryMode", "0755")) for d in unit.items("StateDirectory")
    ]
    managed += [
        (f"/var/cache/{d}", unit.get("CacheDirectoryMode", "0755")) for d in unit.items("CacheDirectory")
    ]
    families = unit.items("RestrictAddressFamilies")
    refused: list[int] = []
    if families and not families[0].startswith("~"):
        refused = sorted(n for name, n in FAMILIES.items() if name not in families)
    elif families:
        refused = sorted(FAMILIES[f.lstrip("~")] for f in families)
    allowed_calls: list[int] | None = None
    if unit.items("SystemCallFilter"):
        calls = unit.items("SystemCallFilter")
        assert not calls[0].startswith("~"), "a deny-list SystemCallFilter= is not emulated"
        numbers = syscall_numbers()
        # systemd always lets the service's own execve and exit through (the filter is installed before).
        names = expand_filter([*calls, "execve", "exit", "exit_group"])
        allowed_calls = sorted({numbers[n] for n in names if n in numbers})
    errno = {"EPERM": 1, "EACCES": 13, "ENOSYS": 38, "": 1}[unit.get("SystemCallErrorNumber")]
    protect_proc = unit.get("ProtectProc", "default")
    proc_opts = [f"hidepid={protect_proc}"] if protect_proc != "default" else []
    if unit.get("ProcSubset", "all") == "pid":
        proc_opts.append("subset=pid")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin", "LANG": "C.UTF-8"}
    user = None
    if unit.get("User"):
        import pwd

        account = pwd.getpwnam(unit.get("User"))
        user = {"uid": account.pw_uid, "gid": account.pw_gid}
        env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name, SHELL=account.pw_shell)
    for assignment in unit.items("Environment"):
        key, _, value = assignment.partition("=")
        env[key] = here(value)
    nofile = unit.get("LimitNOFILE")
    return {
        "stage": str(stage),
        "proc_options": ",".join(proc_opts),
        "private_tmp": yes(unit.get("PrivateTmp")),
        "private_devices": yes(unit.get("PrivateDevices")),
        "protect_system": unit.get("ProtectSystem", "no"),
        "protect_home": unit.get("ProtectHome", "no"),
        "kernel_tunables": yes(unit.get("ProtectKernelTunables")),
        "kernel_logs": yes(unit.get("ProtectKernelLogs")),
        "control_groups": yes(unit.get("ProtectControlGroups")),
        "managed": [(here(p), int(mode, 8)) for p, mode in managed],
        "read_write": paths("ReadWritePaths"),
        "read_only": [
            *paths("ReadOnlyPaths"),
            *[(str(p), False) for p in site.values() if p.is_file()],
            *[(str(p), False) for p in software or []],
        ],
        "inaccessible": paths("InaccessiblePaths"),
        "drop_capabilities": not unit.items("CapabilityBoundingSet"),
        "ambient": unit.items("AmbientCapabilities"),
        "no_new_privileges": yes(unit.get("NoNewPrivileges")) or allowed_calls is not None or bool(refused),
        "refused_families": refused,
        "allowed_syscalls": allowed_calls,
        "native_only": unit.items("SystemCallArchitectures") == ["native"],
        "syscall_errno": errno,
        "umask": int(unit.get("UMask", "0022"), 8),
        "user": user,
        "nofile": int(nofile) if nofile else None,
        "env": env,
    }


def yes(value: str) -> bool:
    return value.lower() in ("yes", "true", "1", "on")


def unshare_argv(unit: Unit) -> list[str]:
    """The namespaces the unit's settings give the service: a mount namespace (where systemd mounts a new /proc
    instance, of the host's pids, as here), IPC and UTS where asked; no pid namespace (systemd 252 has none)."""
    argv = ["unshare", "--mount", "--propagation", "private"]
    if yes(unit.get("PrivateIPC")):
        argv.append("--ipc")
    if yes(unit.get("ProtectHostname")):
        argv.append("--uts")
    return argv


def prefix(unit: Unit, site: dict[str, Path], stage: Path, python: str, software: list[Path]) -> list[str]:
    """A command prefix that runs the command after it under the unit's sandboxing (the launcher run by
    `python`, as root)."""
    spec = stage.parent / f"{stage.name}.plan.json"
    spec.write_text(json.dumps(plan(unit, site, stage, software)))
    return [*unshare_argv(unit), python, str(LAUNCHER), str(spec), "--"]
