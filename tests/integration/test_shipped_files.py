"""The deployment files ship inside the package and fit together (issue 24).

- `syscall-kernel unit`, `example-config` and `dashboard` print deploy/'s files byte for byte; the package's
  copies are links into deploy/ (one source), and the messages that point an operator to them name the commands.
- The drop-in docs/operator.md gives for `ReadWritePaths=` replaces the template's list (systemd list semantics:
  an empty assignment first), read by systemd's own unit parser (`systemd --test`), not by ours; its drop-in
  for a site CA and proxy (`Environment=SSL_CERT_FILE=...`) adds to the unit's environment.
- The example config fits the unit's layout: its state_dir is the instance's StateDirectory= and each workspace
  glob lies under a path the instance may write.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from testenv import IN_CI, ROOT

from kernel.core.config import ConfigError, load

DEPLOY = ROOT / "deploy"
SHARE = ROOT / "kernel" / "share"
FILES = {
    "unit": DEPLOY / "systemd" / "syscall-kernel@.service",
    "example-config": DEPLOY / "config.example.toml",
    "dashboard": DEPLOY / "grafana" / "syscall-kernel.json",
}
SYSTEMD = "/lib/systemd/systemd"


def cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "kernel.cli", *args], cwd=ROOT, capture_output=True, timeout=60, check=False
    )


@pytest.mark.parametrize("verb", sorted(FILES))
def test_each_command_prints_its_deploy_file(verb: str) -> None:
    done = cli(verb)
    assert done.returncode == 0, done.stderr
    assert done.stdout == FILES[verb].read_bytes()


def test_the_package_copies_are_links_into_deploy() -> None:
    """One source: kernel/share/ holds links (the wheel build copies their targets), nothing edited twice."""
    shared = sorted(SHARE.iterdir())
    assert len(shared) == len(FILES)
    assert {p.resolve() for p in shared} == {p.resolve() for p in FILES.values()}
    assert all(p.is_symlink() for p in shared)


def test_an_unknown_key_points_to_the_example_config_command(tmp_path: Path) -> None:
    bad = tmp_path / "k.toml"
    bad.write_text("stat_dir = '/x'\n")
    with pytest.raises(ConfigError) as got:
        load(bad, env={})
    assert "`syscall-kernel example-config`" in str(got.value)
    assert "deploy/" not in str(got.value)


def systemd_view(unit_dir: Path, instance: str) -> dict[str, list[str]]:
    """The instance's settings as systemd itself loads them with its drop-ins (`systemd --test` dumps them; it
    refuses to run as root, so root runs it as uid 1000 of a user namespace of its own)."""
    if not Path(SYSTEMD).exists() or shutil.which("unshare") is None:
        if IN_CI:
            pytest.fail("systemd (/lib/systemd/systemd) is not installed; CI must check the unit's drop-ins")
        pytest.skip("systemd is not installed")
    argv = [SYSTEMD, "--test", "--system", f"--unit={instance}"]
    if os.geteuid() == 0:
        argv = ["unshare", "--user", "--map-user=1000", "--map-group=1000", *argv]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SYSTEMD_UNIT_PATH": f"{unit_dir}:"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    dump = done.stdout.split(f"-> Unit {instance}:", 1)
    assert len(dump) == 2, done.stderr[-2000:]
    section = re.split(r"^\t-> Unit ", dump[1], maxsplit=1, flags=re.M)[0]
    settings: dict[str, list[str]] = {}
    for key, value in re.findall(r"^\t\t(\w+): (.*)$", section, re.M):
        settings.setdefault(key, []).append(value)
    return settings


def documented_drop_in(setting: str) -> str:
    text = (ROOT / "docs" / "operator.md").read_text()
    blocks = [b for b in re.findall(r"```ini\n(.*?)```", text, re.S) if f"{setting}=" in b]
    assert len(blocks) == 1, f"docs/operator.md should show one {setting}= drop-in"
    return blocks[0]


def with_drop_in(unit_dir: Path, text: str) -> dict[str, list[str]]:
    shutil.copy(FILES["unit"], unit_dir)
    (unit_dir / "syscall-kernel@alice.service.d").mkdir(exist_ok=True)
    (unit_dir / "syscall-kernel@alice.service.d" / "site.conf").write_text(text)
    return systemd_view(unit_dir, "syscall-kernel@alice.service")


def test_the_documented_drop_in_replaces_the_templates_paths(tmp_path: Path) -> None:
    drop_in = documented_drop_in("ReadWritePaths")
    wanted = re.findall(r"^ReadWritePaths=(.+)$", drop_in, re.M)[-1].split()
    got = with_drop_in(tmp_path, drop_in)
    assert got["ReadWritePaths"] == [" ".join(wanted)]
    # The parse is systemd's: without the empty assignment the template's path stays (the finding).
    got = with_drop_in(tmp_path, f"[Service]\nReadWritePaths={' '.join(wanted)}\n")
    assert got["ReadWritePaths"][0].split() == ["/srv/agents/alice", *wanted]


def test_the_documented_ca_drop_in_adds_to_the_units_environment(tmp_path: Path) -> None:
    """The unit's environment is all the kernel gets (and passes SSL_CERT_FILE and proxies on to uv): the
    documented drop-in adds them and keeps the unit's TMPDIR."""
    got = with_drop_in(tmp_path, documented_drop_in("SSL_CERT_FILE"))
    env = dict(v.split("=", 1) for v in got["Environment"])
    assert env["TMPDIR"] == "/var/cache/syscall-kernel/alice"
    assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca-certificates.crt"
    assert "HTTPS_PROXY" in env


def test_the_example_config_fits_the_units_layout(tmp_path: Path) -> None:
    shutil.copy(FILES["unit"], tmp_path)
    got = systemd_view(tmp_path, "syscall-kernel@alice.service")
    writable = [Path(p.lstrip("-")) for p in got["ReadWritePaths"][0].split()]
    cfg = load(FILES["example-config"], env={"HOME": "/home/alice"})
    assert cfg.state_dir == f"/var/lib/{got['StateDirectory'][0]}"
    assert cfg.workspaces
    for pattern in cfg.workspaces:
        assert any(Path(pattern).parent.is_relative_to(w) for w in writable), (
            f"{pattern}: its matches are not under a writable path of the unit ({writable})"
        )
