"""The locked environment's build, end to end against a hostile agent: a real kernel with bwrap, the real uv, and
a local HTTPS package index this test starts (127.0.0.1 only, its own CA; no internet).

- A package on the configured index ships a `.pth` whose lines try to write marker files on the kernel's host
  (one in this test's directory, one in the kernel's state directory). It installs, it is byte-compiled, the job
  imports it; no marker is ever written: the warm-up's uv and compileall run in the build jail, compileall with
  `-S -I` (no site processing, so no `.pth` runs at all), and in the job's jail the `.pth` does run (the job
  starts Python with site) but neither path exists there.
- The same with jail = "none" (the build then runs unjailed on the host): `-S -I` alone keeps the `.pth` from
  running at build time.
- A lock whose wheel URL is `https://127.0.0.1:<other>\\@127.0.0.1:<index>/...` (urllib reads the index's host,
  uv reads `\\` as `/` and the other server's) is refused with `environment.failed` naming the entry, refunded,
  and the other server receives no request at all.
- A lock whose hash is not the wheel's is refused by uv (its sleep woken with environment.failed, refunded).
- The build jail's profile, run by bwrap: it writes only what it is given, reads the lockfile, and sees neither
  the kernel's state, another entry, /etc/shadow nor the network (when built without it).
- Every task uses the cache entry's one venv, read-only, and runs no uv (bwrap and none): the operator's
  interpreter is a launcher that would report any uv sync that ran it, and none does; the first of two serial
  tasks cannot append to, add or remove a module (EROFS, EACCES), the second imports the original, and the
  package's console script finds the venv's interpreter. With jail = none the mode bits alone hold: a kernel run
  as `nobody` shows its task refused EACCES.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import pwd
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import localindex
import pytest
from kernelproc import Kernel, make_workspace, run_tool
from localindex import make_tls, uv_lock
from testenv import need

from channel.paths import workspace_key
from kernel.io.envcache import canonical_toml, uv_binary
from kernel.node.jail import SHARED_VENV, JailPolicy, build_bwrap_argv

pytestmark = [pytest.mark.bwrap, pytest.mark.slow]

PYTHON = "/usr/bin/python3"
WHEEL = "hostile-1.0-py3-none-any.whl"
# The agent's project: one dependency, the hostile package.
PYPROJECT = '[project]\nname = "victim"\nversion = "0.1.0"\ndependencies = ["hostile==1.0"]\n'


# --- the servers (the CA and certificate: localindex.make_tls) ------------------------------------------------


def make_wheel(markers: list[Path]) -> bytes:
    """A pure wheel whose `hostile.pth` tries, line by line, to write each marker (an `import` line of a `.pth`
    is executed by site processing whenever an interpreter with that site-packages starts with site on); it
    ships a console script, `hostile-tool`, whose launcher uv writes at install time."""
    pth = "".join(f"import os; open({str(m)!r}, 'w').write('the .pth ran')\n" for m in markers)
    init = "VALUE = 42\n\n\ndef main():\n    import sys\n\n    print('tool', VALUE, sys.executable)\n"
    name, data = localindex.make_wheel(
        "hostile",
        "1.0",
        {"hostile/__init__.py": init, "hostile.pth": pth},
        entry_points="[console_scripts]\nhostile-tool = hostile:main\n",
    )
    assert name == WHEEL
    return data


class Server:
    """An HTTPS server on 127.0.0.1 that records every request path: a PEP 503 simple index for `hostile` (as
    `index`), or, as the decoy, a server that answers the wheel to any path."""

    def __init__(self, context: ssl.SSLContext, wheel: bytes, *, index: bool) -> None:
        self.requests: list[str] = []
        self.wheel = wheel
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.reply(head=False)

            def do_HEAD(self) -> None:  # uv asks whether the server takes range requests
                self.reply(head=True)

            def reply(self, *, head: bool) -> None:
                server.requests.append(self.path)
                body, kind = server.answer(self.path, index=index)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                if not head:
                    self.wfile.write(body or b"")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str, *, index: bool) -> tuple[bytes | None, str]:
        if not index or path == f"/files/{WHEEL}":
            return self.wheel, "application/octet-stream"
        if path.rstrip("/") == "/simple/hostile":
            digest = hashlib.sha256(self.wheel).hexdigest()
            link = f'<a href="{self.url}/files/{WHEEL}#sha256={digest}">{WHEEL}</a>'
            return f"<!DOCTYPE html><html><body>{link}</body></html>".encode(), "text/html"
        return None, "text/plain"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


# --- the kernel ---------------------------------------------------------------------------------------------


class Setup:
    def __init__(self, kernel: Kernel, spaces: dict[str, Path], index: Server, decoy: Server) -> None:
        self.kernel = kernel
        self.spaces = spaces
        self.index = index
        self.decoy = decoy
        self.markers: list[Path] = []
        self.jail = ""
        self.lock = ""

    def ok(self, name: str, *args: str) -> str:
        done = run_tool(self.spaces[name], *args, timeout=180)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-3000:]}"
        return done.stdout

    def budget(self, name: str) -> tuple[int, int]:
        doc = json.loads((self.spaces[name] / ".syscall" / "budget.json").read_text())["budget"]
        return doc["launches"], doc["sleeps"]


@pytest.fixture(scope="module", params=["bwrap", "none"])
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, bwrap_available: None
) -> Iterator[Setup]:
    """A kernel with jail = bwrap (the build jailed), or jail = none (the build on the host, unjailed: the lock
    checks and `-S -I` must hold alone)."""
    need("python3 at /usr/bin/python3", os.path.exists(PYTHON), "the jobs' interpreter")
    jail = request.param
    tmp = tmp_path_factory.mktemp(f"envjail-{jail}")
    kernel = Kernel(tmp, "")  # its state directory is known now; the config is written below
    markers = [tmp / "marker-on-the-host", kernel.state / "marker-in-the-state-dir"]
    ca, context = make_tls(tmp)
    wheel = make_wheel(markers)
    index = Server(context, wheel, index=True)
    decoy = Server(context, wheel, index=False)
    try:
        lock = uv_lock(tmp, PYPROJECT, index.url, ca, PYTHON)
        wheel_url = f"{index.url}/files/{WHEEL}"
        assert f'url = "{wheel_url}"' in lock, lock
        # Item 1: urllib reads host 127.0.0.1 (after the `@`), uv reads 127.0.0.1:<decoy> (`\` is `/`).
        tricked = lock.replace(
            wheel_url, f"https://127.0.0.1:{decoy.port}\\\\@127.0.0.1:{index.port}/files/{WHEEL}"
        )
        assert tricked != lock
        # A hash that is well-formed but not the wheel's: uv must refuse the download it gets.
        digest = hashlib.sha256(wheel).hexdigest()
        rehashed = lock.replace(f"sha256:{digest}", f"sha256:{hashlib.sha256(b'other').hexdigest()}")
        assert rehashed != lock
        kernel.config.write_text(
            kernel.config.read_text()
            + f'jail = "{jail}"\n[environment]\npython = "{PYTHON}"\nindex_url = "{index.url}/simple"\n'
        )
        spaces = {}
        for name, text in (("hostile", lock), ("backslash", tricked), ("rehashed", rehashed)):
            files = {"README": f"workspace {name}\n", "pyproject.toml": PYPROJECT, "uv.lock": text}
            spaces[name] = make_workspace(tmp / "spaces" / name, files)
            kernel.enroll(spaces[name], "--launches", "10", "--sleeps", "10", "--gpu-hours", "1")
        index.requests.clear()
        kernel.start(env={"SSL_CERT_FILE": str(ca), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"})
        s = Setup(kernel, spaces, index, decoy)
        s.markers = markers
        s.jail = jail
        s.lock = lock
        yield s
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        index.close()
        decoy.close()


def test_a_wheel_shipping_a_pth_installs_and_its_pth_never_runs_on_the_kernels_host(setup: Setup) -> None:
    if setup.jail == "bwrap":
        probe = "import hostile, sys; print('hostile', hostile.VALUE, sys.prefix)"
        command = f'python -c "{probe}"'
    else:  # no job jail: the job's own Python would run the .pth on the host, as the operator chose
        command = "python -S -c \"import sys; print('hostile', 42 if sys.prefix else 0)\""
    setup.ok("hostile", "launch", "--name", "imp", "--minutes", "2", "--", command)
    wake = json.loads(setup.ok("hostile", "sleep", "--wait", "--json", "--timeout", "170"))
    [t] = wake["tasks"]
    assert t["state"] == "COMPLETED", t
    assert "hostile 42" in t["stdout_tail"], t
    if setup.jail == "bwrap":
        # The package installed and the job imported it; in the job's jail the job's own Python does run the
        # .pth (site on), and neither marker path exists there.
        assert "hostile.pth" in t["stderr_tail"], t
    assert f"/files/{WHEEL}" in setup.index.requests, "uv downloaded the wheel from the local index"
    envs = setup.kernel.state / "runs" / "envs"
    # uv was given the lock the kernel parsed, re-serialised, not the agent's bytes.
    given = canonical_toml(tomllib.loads(setup.lock))
    assert given != setup.lock.encode()
    [entry] = [p for p in envs.glob("*/project/uv.lock") if p.read_bytes() == given]
    entry = entry.parent.parent
    assert list(entry.glob("uv/archive-v0/*/hostile/__pycache__/__init__.cpython-*.pyc")), (
        "the warm-up byte-compiled the wheel (so its .pth had every chance to run there)"
    )
    ready = json.loads((entry / "ready.json").read_text())
    assert ["hostile", "1.0"] in ready["packages"]
    for marker in setup.markers:
        assert not marker.exists(), f"{marker}: {marker.read_text()}"


# Task 0 tries to change the shared venv three ways (given `try`); every task reports what it runs and imports.
SHARED_PROBE = """\
import errno, hashlib, os, shutil, stat, subprocess, sys
import hostile
module = hostile.__file__
if os.environ["SWEEP_INDEX"] == "0" and sys.argv[1] == "try":
    attempts = (
        ("append", lambda: open(module, "a").write("VALUE = 0\\n")),
        ("create", lambda: open(os.path.join(os.path.dirname(module), "added.py"), "w").close()),
        ("remove", lambda: os.unlink(module)),
    )
    for what, attempt in attempts:
        try:
            attempt()
            print(what, "allowed")
        except OSError as e:
            print(what, "refused", errno.errorcode[e.errno])
writable = [p for p in (module, os.path.dirname(module), sys.prefix) if os.stat(p).st_mode & 0o222]
print("writable", writable or "none")
tool = shutil.which("hostile-tool")
print("shebang", open(tool).readline().strip())
print("ran", subprocess.run([tool], capture_output=True, text=True).stdout.strip())
print("prefix", sys.prefix, "value", hostile.VALUE, hashlib.sha256(open(module, "rb").read()).hexdigest())
"""


def test_a_backslash_url_is_refused_naming_the_entry_and_the_other_server_is_never_asked(
    setup: Setup,
) -> None:
    before = setup.budget("backslash")
    setup.ok("backslash", "launch", "--name", "never", "--", "echo should not run")
    done = run_tool(setup.spaces["backslash"], "sleep", "--json", timeout=180)
    assert done.returncode == 3, done.stdout + done.stderr
    ans = json.loads(done.stdout)
    assert ans["type"] == "rejected"
    assert ans["error"]["code"] == "environment.failed"
    message = ans["error"]["message"]
    assert 'package "hostile" wheels[0].url' in message, message
    assert f"https://127.0.0.1:{setup.index.port}/" in message, "the refusal says where files must come from"
    assert setup.budget("backslash") == before, "refunded"
    key = workspace_key(setup.spaces["backslash"].resolve())
    assert not list((setup.kernel.state / "runs" / key).glob("*/never")), "nothing may be submitted"
    assert setup.decoy.requests == [], "the server the backslash pointed at received no request"
    for marker in setup.markers:
        assert not marker.exists()


def test_the_build_jail_writes_only_its_entry_and_sees_nothing_of_the_kernel(
    tmp_path: Path, bwrap_available: None
) -> None:
    """The profile itself, run by real bwrap: what uv and compileall could do if a lock or wheel subverted them."""
    state = tmp_path / "state"
    entry = state / "runs" / "envs" / ".k.tmp"
    (entry / "uv").mkdir(parents=True)
    (entry / "project").mkdir()
    (entry / "project" / "uv.lock").write_text("version = 1\n")
    (state / "kernel.sqlite").write_text("the kernel's store\n")
    (state / "runs" / "envs" / "other").mkdir()
    (tmp_path / "host-file").write_text("the host's\n")
    script = (
        f"echo x > {entry}/uv/w && echo WROTE-CACHE; "
        f"echo x > {entry}/project/uv.lock && echo WROTE-LOCK; "
        f"cat {entry}/project/uv.lock; "
        f"ls {state}/kernel.sqlite && echo SAW-STATE; "
        f"ls {state}/runs/envs/other && echo SAW-OTHER; "
        f"cat {tmp_path}/host-file && echo SAW-HOST; "
        f"echo x > {tmp_path}/host-file; "
        "cat /etc/shadow && echo READ-SHADOW; "
        "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=3)' && echo NET; "
        "echo done"
    )
    argv = build_bwrap_argv(
        JailPolicy(hide=(str(state),)),
        network=False,
        writable=[str(entry / "uv")],
        readable=[str(entry / "project")],
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        cwd=str(entry / "uv"),
        argv=["sh", "-c", script],
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "WROTE-CACHE" in out
    assert "version = 1" in out, "the lockfile is readable"
    for never in ("WROTE-LOCK", "SAW-STATE", "SAW-OTHER", "SAW-HOST", "READ-SHADOW", "NET"):
        assert never not in out, (never, out, done.stderr)
    assert "done" in out
    assert (entry / "uv" / "w").exists()
    # The directories above the entry exist in the jail only as mount points on its own /tmp.
    assert (tmp_path / "host-file").read_text() == "the host's\n"
    assert (entry / "project" / "uv.lock").read_text() == "version = 1\n"


def test_a_file_whose_hash_is_not_the_locks_is_refused_by_uv_and_refunded(setup: Setup) -> None:
    """What the lock check relies on: uv verifies every file against the lock's sha256 (in the background build:
    the sleep is accepted, then woken with `environment.failed`, refunded)."""
    before = setup.budget("rehashed")
    setup.ok("rehashed", "launch", "--name", "never", "--", "echo should not run")
    ans = json.loads(setup.ok("rehashed", "sleep", "--json"))
    assert ans["type"] == "accepted", ans
    assert ans["building"] is not None
    wake = json.loads(setup.ok("rehashed", "wait", "--json", "--timeout", "170"))
    assert wake["error"]["code"] == "environment.failed"
    assert "hash" in wake["error"]["message"].lower(), wake["error"]["message"]
    assert setup.budget("rehashed") == before
    for marker in setup.markers:
        assert not marker.exists()


# The operator's interpreter as uv runs it. When `report` exists beside it (the test creates it between two
# launches), it prints what it sees to stderr and fails: uv's error, and so the task's stderr, carries the report.
LAUNCHER = """#!/bin/sh
if [ -e {site}/report ]; then
    r="pid1=$(basename "$(tr '\\0' ' ' < /proc/1/cmdline | cut -d' ' -f1)")"
    [ -e {state}/marker ] && r="$r state=visible" || r="$r state=absent"
    r="$r runs=$(ls -A {state}/runs | tr '\\n' ,)"
    [ -e "$UV_PROJECT_ENVIRONMENT/../../tree" ] && r="$r tree=visible" || r="$r tree=absent"
    r="$r $(cat {tmp}/host-file 2>/dev/null || echo host=unseen)"
    echo x > {tmp}/written-by-sync 2>/dev/null
    (echo x > "$UV_CACHE_DIR/probe") 2>/dev/null && r="$r cache=writable" || r="$r cache=unwritable"
    /usr/bin/python3 -S -I -c 'import socket; socket.create_connection(("127.0.0.1", {port}), timeout=3)' \\
        2>/dev/null && r="$r index=reachable" || r="$r index=unreachable"
    echo "report: $r ." >&2
    exit 7
fi
exec {python} "$@"
"""


@pytest.mark.parametrize("jail", ["bwrap", "none"])
def test_every_task_shares_the_caches_read_only_venv_and_runs_no_uv_of_its_own(
    tmp_path: Path, jail: str, bwrap_available: None
) -> None:
    """One venv per lockfile, used by every task: read-only (bwrap binds it so, over mode bits without a write
    bit; with jail = none the bits alone, which hold for a kernel user other than root: see the nobody test),
    its console script's launcher resolves where the task sees the venv, a task's attempts to change it leave
    the next task the original, and no task runs uv."""
    need("python3 at /usr/bin/python3", os.path.exists(PYTHON), "the jobs' interpreter")
    kernel = Kernel(tmp_path, "")
    site = tmp_path / "site"
    site.mkdir()
    ca, context = make_tls(tmp_path)
    index = Server(context, make_wheel([]), index=True)
    try:
        launcher = site / "python"
        launcher.write_text(
            LAUNCHER.format(site=site, state=kernel.state, tmp=tmp_path, port=index.port, python=PYTHON)
        )
        launcher.chmod(0o755)
        lock = uv_lock(tmp_path, PYPROJECT, index.url, ca, PYTHON)
        kernel.config.write_text(
            kernel.config.read_text()
            + f'jail = "{jail}"\n[environment]\npython = "{launcher}"\nextra_dirs = ["{site}"]\n'
            + f'index_url = "{index.url}/simple"\n'
        )
        files = {"README": "the sync\n", "pyproject.toml": PYPROJECT, "uv.lock": lock}
        ws = make_workspace(tmp_path / "spaces" / "sync", files)
        kernel.enroll(ws, "--launches", "10", "--sleeps", "10", "--gpu-hours", "1")
        kernel.start(env={"SSL_CERT_FILE": str(ca), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"})
        kernel.state.joinpath("marker").write_text("the kernel's state\n")
        (tmp_path / "host-file").write_text("host=seen\n")

        def tasks(name: str, command: str, *launch: str) -> list[dict[str, Any]]:
            for args in (
                ("launch", "--name", name, "--minutes", "2", *launch, "--", command),
                ("sleep", "--wait", "--json", "--timeout", "170"),
            ):
                done = run_tool(ws, *args, timeout=180)
                assert done.returncode == 0, (
                    f"{args}: {done.stdout}{done.stderr}\n{kernel.log_text()[-3000:]}"
                )
            return sorted(json.loads(done.stdout)["tasks"], key=lambda t: int(t["task"]))

        def task(name: str, command: str) -> dict[str, Any]:
            [t] = tasks(name, command)
            return t

        # The kernel built the venv where every job's jail binds it (read-only), or with jail = none where every
        # job uses it; no task syncs one of its own.
        probe = "import hostile, os, sys; print('hostile', hostile.VALUE, sys.prefix, os.stat(hostile.__file__).st_nlink)"
        t = task("imp", f'python -c "{probe}"')
        assert t["state"] == "COMPLETED", t
        [(value, prefix, links)] = [
            line.split()[1:] for line in t["stdout_tail"].splitlines() if "hostile" in line
        ]
        assert value == "42", t
        [entry] = [p.parent for p in (kernel.state / "runs" / "envs").glob("*/ready.json")]
        if jail == "bwrap":
            assert prefix == SHARED_VENV, (
                "the job's venv is the cache's own, bound at the path it was built at"
            )
        else:
            assert prefix == str(entry / "venv"), "the job's venv is the cache's own, where it is"
        # uv hard-linked the module from the cache into the venv (one mount in the build jail), not a copy.
        assert int(links) >= 2, t
        # Two tasks one after the other: the first tries to change the venv; both report what they see.
        (ws / "probe_shared.py").write_text(SHARED_PROBE)
        # With jail = none a task as root could change it (mode bits do not bind root): the nobody test tries.
        attempt = jail == "bwrap" or os.geteuid() != 0
        two = tasks("shared", f"python probe_shared.py {'try' if attempt else 'skip'}", "--array", "2")
        assert [t["state"] for t in two] == ["COMPLETED", "COMPLETED"], two
        module = next((entry / "venv").glob("lib/python*/site-packages/hostile/__init__.py"))
        digest = hashlib.sha256(module.read_bytes()).hexdigest()
        seen = SHARED_VENV if jail == "bwrap" else str(entry / "venv")
        for t in two:
            out = dict(line.split(" ", 1) for line in t["stdout_tail"].splitlines())
            assert out["prefix"] == f"{seen} value 42 {digest}", (out, t["stderr_tail"])
            assert out["writable"] == "none", out
            # uv wrote the launcher for where the task sees the venv (bwrap: the path it was built at;
            # otherwise a relocatable one that finds the interpreter beside itself): it runs the venv's python.
            assert out["shebang"] == (f"#!{SHARED_VENV}/bin/python" if jail == "bwrap" else "#!/bin/sh"), out
            assert out["ran"] == f"tool 42 {seen}/bin/python", out
        if attempt:
            first = dict(line.split(" ", 1) for line in two[0]["stdout_tail"].splitlines())
            said = [first[w] for w in ("append", "create", "remove")]
            if jail == "bwrap":
                # The mode bits refuse what the kernel checks first (a file's write), the read-only bind the rest.
                assert set(said) <= {"refused EROFS", "refused EACCES"}, first
                assert "refused EROFS" in said, first
            else:
                assert said == ["refused EACCES"] * 3, first
        assert not list(module.parent.glob("added.py"))
        # Asked to report, the operator's interpreter would say what a task's uv sync sees: no task runs one.
        (site / "report").write_text("")
        t = task("probe", "echo ran")
        assert t["state"] == "COMPLETED", t
        assert t["stdout_tail"] == "ran\n", t
        assert "report:" not in t["stderr_tail"], "nothing of the environment ran on the node for the task"
        assert not (tmp_path / "written-by-sync").exists()
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        index.close()


def nobodys_python(base: Path) -> str:
    """An interpreter `nobody` can start that imports this checkout's kernel (the test's own may lie under
    root's home): a venv of the system's Python of the same version, with the test's site-packages added and
    the uv binary beside it (where `uv.find_uv_bin` looks)."""
    system = Path(f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}")
    need(str(system), system.exists(), "the kernel's interpreter for the unprivileged user")
    shim = base / "python"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(shim)], check=True, timeout=120)
    here = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (shim / "lib" / system.name / "site-packages" / "test-site.pth").write_text(
        f"import site; site.addsitedir({str(here)!r})\n"
    )
    (shim / "bin" / "uv").symlink_to(uv_binary())
    return str(shim / "bin" / "python")


def test_with_jail_none_a_kernel_user_other_than_root_cannot_change_the_shared_venv() -> None:
    """With jail = none nothing but the venv's mode bits keeps a task from changing what every task uses: a
    kernel (and so every task) running as `nobody` here. Its first task's three attempts are refused EACCES and
    the next task imports the original module. (As root the bits bind nothing, as jail = none contains nothing:
    docs/operator.md.)"""
    if os.geteuid() != 0:
        pytest.skip(
            "runs the kernel as another user; as that user the shared-venv test above tries the writes"
        )
    need("setpriv", shutil.which("setpriv") is not None, "switches to the unprivileged user")
    need("python3 at /usr/bin/python3", os.path.exists(PYTHON), "the jobs' interpreter")
    account = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="sk-envnone-"))  # pytest's directories are root's alone
    as_nobody = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups"]
    env = {
        **os.environ,
        "HOME": str(base),
        "SSL_CERT_FILE": "",
        "NO_PROXY": "127.0.0.1",
        "no_proxy": "127.0.0.1",
    }
    ca, context = make_tls(base)
    env["SSL_CERT_FILE"] = str(ca)
    index = Server(context, make_wheel([]), index=True)
    kernel = Kernel(base, "")
    try:
        lock = uv_lock(base, PYPROJECT, index.url, ca, PYTHON)
        kernel.config.write_text(
            kernel.config.read_text()
            + f'jail = "none"\n[environment]\npython = "{PYTHON}"\nindex_url = "{index.url}/simple"\n'
        )
        files = {
            "README": "nobody's\n",
            "pyproject.toml": PYPROJECT,
            "uv.lock": lock,
            "probe.py": SHARED_PROBE,
        }
        ws = make_workspace(base / "spaces" / "ws", files)
        for p in [base, *base.rglob("*")]:
            os.chown(p, account.pw_uid, account.pw_gid, follow_symlinks=False)
        base.chmod(0o755)

        def nobody(*argv: str, cwd: Path) -> str:
            done = subprocess.run(
                [*as_nobody, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
            )
            assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}\n{kernel.log_text()[-3000:]}"
            return done.stdout

        python = nobodys_python(base)
        cli = [python, "-m", "kernel.cli"]
        nobody(*cli, "enroll", str(ws), "--config", str(kernel.config), "--launches", "4", cwd=kernel.root)
        kernel.start(env=env, prefix=as_nobody, python=python)
        tool = [python, str(ws / ".syscall" / "syscall")]
        nobody(*tool, "launch", "--name", "shared", "--array", "2", "--", "python probe.py try", cwd=ws)
        wake = json.loads(nobody(*tool, "sleep", "--wait", "--json", "--timeout", "170", cwd=ws))
        two = sorted(wake["tasks"], key=lambda t: int(t["task"]))
        assert [t["state"] for t in two] == ["COMPLETED", "COMPLETED"], two
        [entry] = [p.parent for p in (kernel.state / "runs" / "envs").glob("*/ready.json")]
        module = next((entry / "venv").glob("lib/python*/site-packages/hostile/__init__.py"))
        assert module.stat().st_uid == account.pw_uid, "the kernel's user owns the venv: only the bits hold"
        digest = hashlib.sha256(module.read_bytes()).hexdigest()
        first = dict(line.split(" ", 1) for line in two[0]["stdout_tail"].splitlines())
        assert [first[w] for w in ("append", "create", "remove")] == ["refused EACCES"] * 3, first
        for t in two:
            out = dict(line.split(" ", 1) for line in t["stdout_tail"].splitlines())
            assert out["prefix"] == f"{entry / 'venv'} value 42 {digest}", out
        assert not list(module.parent.glob("added.py"))
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        index.close()
        subprocess.run(["chmod", "-R", "u+w", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)
