"""Locked environments: the snapshot's `uv.lock` turned into a warm uv cache before any job is submitted.

When a snapshot holds `pyproject.toml` and `uv.lock` at its root (and `[environment] mode = "uv"`), the kernel
fills a uv cache for that lockfile OUTSIDE the jail, with the network, once per distinct (lockfile, pyproject,
interpreter, index, uv version): `<run_dir>/envs/<key>/` holds

    uv/           the uv cache (UV_CACHE_DIR) with every wheel the lock names for this interpreter
    project/      the pyproject.toml and uv.lock the cache was built from (what each job syncs)
    ready.json    written last: the interpreter's version and the installed packages (`EnvReady`)
    used          touched at each use; a cache unused for `keep_days` is pruned
    warm.log      uv's output

Each job then copies (hard links where it can) the cache into node scratch and runs
`uv sync --frozen --offline` into a private venv, bound read-only into the jail (kernel.node.wrapper): no network
in the jail, and the same lockfile gives every job the same environment across sleeps and workspaces.

The lockfile is the agent's, so nothing in it may run code or read files outside the jail: only packages from a
registry are accepted (a path, directory, git or url source is refused by `lock_problem` before uv sees it), uv
never builds (`--no-build`: a package without a wheel is refused, because building runs its setup code with the
kernel's rights and network), never installs the project itself (`--no-install-project`), reads no
configuration file (`--no-config`) and gets an environment built from nothing but the proxy settings. A lockfile
that does not resolve is refused before any job is submitted (`environment.failed`, refunded).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import anyio
import msgspec

from kernel.core.config import EnvironmentConfig
from kernel.io import hostproc
from kernel.node.jail import JobEnvironment

LOCK_FILE: Final = "uv.lock"
PROJECT_FILE: Final = "pyproject.toml"
ENVS_DIR: Final = "envs"
PYTHON_DIR: Final = "python"  # uv-managed interpreters (environment.python = "3.12")
WORKSPACES_DIR: Final = "workspaces"  # each workspace's latest locked environment (kernel.io.jobenv)
READY: Final = "ready.json"
USED: Final = "used"
WARM_LOG: Final = "warm.log"
# A lockfile or pyproject larger than this is refused (a real uv.lock of a large ML project is ~1 MiB).
MAX_FILE_BYTES: Final = 8 * 1024 * 1024
MESSAGE_TAIL: Final = 1500
# Passed from the kernel's environment to uv when set (a site's proxy and CA bundle); nothing else is.
PASSED_VARS: Final = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
)
SAFE_PATH: Final = "/usr/local/bin:/usr/bin:/bin"
_ANSI: Final = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
UV_VERSION: Final = hostproc.declare(
    "uv.version",
    agent_input="none",
    containment="the uv beside the kernel, an environment built from nothing, a deadline of 30 s",
    timeout_s=30,
    output_cap=1 << 16,
)
UV_SYNC: Final = hostproc.declare(
    "uv.sync",
    agent_input="the agent's uv.lock and pyproject.toml, accepted by lock_problem (registry packages from the "
    "configured index only), installed as wheels only (--no-build, --no-install-project, --no-config)",
    containment="uv with an environment built from nothing but the proxy settings, writing only the warm-up's "
    "temporary entry, the deadline environment.warm_timeout_seconds, at most 16 MiB of output",
    output_cap=16 << 20,
)
COMPILE: Final = hostproc.declare(
    "uv.compile",
    agent_input="the Python sources of the locked packages' wheels, compiled to bytecode (never run)",
    containment="the environment's interpreter, a minimal environment, the deadline "
    "environment.warm_timeout_seconds, at most 16 MiB of output",
    output_cap=16 << 20,
)


class EnvironmentFailed(Exception):
    """The workspace's locked environment cannot be built; the message is for the agent (the sleep is refused
    with `environment.failed` and refunded)."""


class EnvReady(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`ready.json`: what a warm cache holds."""

    key: str
    lock_sha256: str
    python: str  # as configured
    python_version: str  # the interpreter's version_info, as the venv recorded it
    uv_version: str
    packages: tuple[tuple[str, str], ...]  # (name, version), sorted by name
    warm_seconds: float


@dataclass(frozen=True, slots=True)
class LockedProject:
    pyproject: bytes
    lock: bytes

    @property
    def lock_sha256(self) -> str:
        return hashlib.sha256(self.lock).hexdigest()


# --- pure ----------------------------------------------------------------------------------------------------


PYPI_INDEX: Final = "https://pypi.org/simple"
PYPI_FILES: Final = "files.pythonhosted.org"


def lock_problem(lock: bytes, index_url: str = "") -> str | None:
    """Why the kernel will not install this lockfile, or None. Only packages from the configured index are
    accepted, with files on that index's host (PyPI: files.pythonhosted.org) over https: any other source would
    make uv read files or repositories outside the jail, build code with the kernel's rights, or fetch URLs the
    agent chose from the kernel's host."""
    index = (index_url or PYPI_INDEX).rstrip("/")
    file_host = PYPI_FILES if index == PYPI_INDEX else urlsplit(index).hostname
    try:
        doc = tomllib.loads(lock.decode("utf-8"))
    except UnicodeDecodeError:
        return "uv.lock is not UTF-8 text"
    except tomllib.TOMLDecodeError as e:
        return f"uv.lock is not valid TOML: {e}"
    packages = doc.get("package", [])
    if not isinstance(packages, list):
        return "uv.lock has no [[package]] list"
    for i, pkg in enumerate(packages):
        if not isinstance(pkg, dict):
            return f"uv.lock package #{i + 1} is not a table"
        name = pkg.get("name", f"#{i + 1}")
        source = pkg.get("source")
        if not isinstance(source, dict) or len(source) != 1:
            return f"uv.lock package {name!r} has no single `source`"
        ((kind, where),) = source.items()
        if kind in ("virtual", "editable") and where == ".":
            continue  # the project itself: never installed (--no-install-project)
        if kind != "registry":
            return (
                f"uv.lock package {name!r} comes from a {kind} source ({where!r}); the kernel installs only "
                "packages from a package index (publish it to the index, or vendor its code into the workspace)"
            )
        if not isinstance(where, str) or where.rstrip("/") != index:
            return (
                f"uv.lock package {name!r} comes from the index {where!r}; this kernel installs only from "
                f"{index} (lock again without a custom index)"
            )
        files = [pkg.get("sdist"), *list(pkg.get("wheels") or [])]
        for f in files:
            url = f.get("url") if isinstance(f, dict) else None
            if url is None:
                continue
            parts = urlsplit(str(url))
            if parts.scheme != "https" or parts.hostname != file_host:
                return (
                    f"uv.lock package {name!r} names the file {str(url)[:200]!r}; files must come from "
                    f"https://{file_host}/ (lock again against {index})"
                )
    return None


def cache_key(project: LockedProject, python: str, index_url: str, uv_version: str) -> str:
    h = hashlib.sha256(b"syscall-uv-env-v1\0")
    for part in (
        project.lock_sha256,
        hashlib.sha256(project.pyproject).hexdigest(),
        python,
        index_url,
        uv_version,
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def tail(text: str, limit: int = MESSAGE_TAIL) -> str:
    text = _ANSI.sub("", text).strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def site_packages(venv: Path) -> list[tuple[str, str]]:
    """(name, version) of each distribution installed in the venv, from its `.dist-info` directory names."""
    out = []
    for info in sorted(venv.glob("lib/python*/site-packages/*.dist-info")):
        stem = info.name[: -len(".dist-info")]
        name, _, version = stem.partition("-")
        out.append((name.replace("_", "-").lower(), version))
    return sorted(out)


def venv_python_version(venv: Path) -> str:
    try:
        for line in (venv / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version_info", "version"):
                return value.strip()
    except OSError:
        pass
    return ""


def uv_env(base: Mapping[str, str], *, home: str, cache: str, **extra: str) -> dict[str, str]:
    """uv's whole environment: built from nothing (the kernel's own variables stay out) plus the proxy settings."""
    env = {k: base[k] for k in PASSED_VARS if k in base}
    env.update(
        PATH=SAFE_PATH,
        HOME=home,
        LANG="C.UTF-8",
        NO_COLOR="1",
        UV_NO_CONFIG="1",
        UV_CACHE_DIR=cache,
        UV_NO_PROGRESS="1",
    )
    env.update(extra)
    return env


def sync_argv(uv: str, project: str, python: str, *, offline: bool) -> list[str]:
    """`uv sync` as the kernel (warm-up) and the wrapper (per job) run it; the wrapper keeps a stdlib copy."""
    argv = [uv, "sync", "--frozen", "--no-build", "--no-install-project", "--no-config", "--project", project]
    argv += ["--python", python]
    if offline:
        argv.append("--offline")
    return argv


# --- I/O -----------------------------------------------------------------------------------------------------


def uv_binary() -> str:
    """The uv the `uv` package installed beside the kernel."""
    import uv

    return str(uv.find_uv_bin())


class EnvCache:
    """The kernel's warm caches under `<run_dir>/envs/` (one kernel per run_dir: warm-ups of one key are
    serialised in-process; concurrent kernels would only waste a download, as an entry appears by rename)."""

    def __init__(
        self, cfg: EnvironmentConfig, run_dir: str | os.PathLike[str], *, uv: str | None = None
    ) -> None:
        self.cfg = cfg
        self.root = Path(run_dir) / ENVS_DIR
        self.uv = uv or uv_binary()
        self._uv_version: str | None = None
        self._locks: dict[str, anyio.Lock] = {}

    @property
    def managed_python(self) -> bool:
        return not self.cfg.python.startswith("/")

    @property
    def python_install_dir(self) -> Path:
        return self.root / PYTHON_DIR

    async def uv_version(self) -> str:
        if self._uv_version is None:
            got = await hostproc.run_async(
                UV_VERSION, [self.uv, "--version"], env=uv_env({}, home="/nonexistent", cache="/nonexistent")
            )
            self._uv_version = got.stdout.decode().strip()
        return self._uv_version

    def entry(self, key: str) -> Path:
        return self.root / key

    def job_environment(self, key: str, project: LockedProject) -> JobEnvironment:
        entry = self.entry(key)
        return JobEnvironment(
            uv=self.uv,
            cache=str(entry / "uv"),
            project=str(entry / "project"),
            python=self.cfg.python,
            python_install_dir=str(self.python_install_dir) if self.managed_python else None,
            lock_sha256=project.lock_sha256,
        )

    def ready(self, key: str) -> EnvReady | None:
        try:
            return msgspec.json.decode((self.entry(key) / READY).read_bytes(), type=EnvReady)
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    async def ensure(self, project: LockedProject) -> tuple[EnvReady, JobEnvironment, bool]:
        """The warm cache for `project` (built now if missing); (ready, job environment, built now?).
        EnvironmentFailed when the lockfile is refused or uv cannot install it."""
        problem = lock_problem(project.lock, self.cfg.index_url)
        if problem is not None:
            raise EnvironmentFailed(problem)
        key = cache_key(project, self.cfg.python, self.cfg.index_url, await self.uv_version())
        lock = self._locks.setdefault(key, anyio.Lock())
        async with lock:
            ready = self.ready(key)
            built = ready is None
            if ready is None:
                ready = await self._warm(key, project)
            with contextlib.suppress(OSError):
                (self.entry(key) / USED).touch()
        return ready, self.job_environment(key, project), built

    async def _warm(self, key: str, project: LockedProject) -> EnvReady:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.root / f".{key}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        tmp.mkdir(mode=0o700)
        try:
            (tmp / "project").mkdir()
            (tmp / "home").mkdir()
            (tmp / "project" / PROJECT_FILE).write_bytes(project.pyproject)
            (tmp / "project" / LOCK_FILE).write_bytes(project.lock)
            extra = {"UV_PROJECT_ENVIRONMENT": str(tmp / "venv")}
            if self.cfg.index_url:
                extra["UV_INDEX_URL"] = self.cfg.index_url
            if self.managed_python:
                extra["UV_PYTHON_INSTALL_DIR"] = str(self.python_install_dir)
            else:
                extra["UV_PYTHON_DOWNLOADS"] = "never"
            env = uv_env(os.environ, home=str(tmp / "home"), cache=str(tmp / "uv"), **extra)
            argv = sync_argv(self.uv, str(tmp / "project"), self.cfg.python, offline=False)
            started = time.monotonic()
            try:
                got = await hostproc.run_async(
                    UV_SYNC, argv, env=env, cwd=tmp, limit_s=self.cfg.warm_timeout_seconds
                )
            except hostproc.TimeoutExpired:
                raise EnvironmentFailed(
                    f"uv did not finish installing the locked environment within "
                    f"{self.cfg.warm_timeout_seconds:g} s"
                ) from None
            out = got.stdout.decode("utf-8", "replace") + got.stderr.decode("utf-8", "replace")
            (tmp / WARM_LOG).write_text(out)
            if got.returncode != 0:
                raise EnvironmentFailed(f"uv could not install the locked environment: {tail(out)}")
            venv = tmp / "venv"
            await self._compile(venv, tmp / "uv", tmp / WARM_LOG)
            ready = EnvReady(
                key=key,
                lock_sha256=project.lock_sha256,
                python=self.cfg.python,
                python_version=venv_python_version(venv),
                uv_version=await self.uv_version(),
                packages=tuple(site_packages(venv)),
                warm_seconds=round(time.monotonic() - started, 3),
            )
            shutil.rmtree(venv, ignore_errors=True)
            shutil.rmtree(tmp / "home", ignore_errors=True)
            (tmp / READY).write_bytes(msgspec.json.encode(ready))
            try:
                os.rename(tmp, self.entry(key))
            except OSError:
                if self.ready(key) is None:  # not another kernel's identical entry: a real failure
                    raise
            return ready
        finally:
            if tmp.exists():  # a plain thread: the kernel's own cache, not one workspace's files
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(tmp, ignore_errors=True))

    async def _compile(self, venv: Path, cache: Path, log: Path) -> None:
        """Byte-compile the cache's unpacked wheels with the environment's interpreter. Each job's venv is
        read-only and installed by hard link from the cache, `__pycache__` included, so without this every job
        would compile every module it imports from source (over a second for a few common packages). Compiling
        runs no package code; a module that does not compile (a Python 2 leftover) is only logged."""
        archive = cache / "archive-v0"
        if not archive.is_dir():
            return
        argv = [str(venv / "bin" / "python"), "-I", "-m", "compileall", "-q", "-j", "0", str(archive)]
        try:
            got = await hostproc.run_async(
                COMPILE,
                argv,
                env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"},
                limit_s=self.cfg.warm_timeout_seconds,
            )
        except hostproc.TimeoutExpired:
            return
        if got.returncode != 0:
            with log.open("ab") as f:
                f.write(b"\ncompileall (not fatal):\n" + got.stdout[-4000:] + got.stderr[-4000:])

    def prune(self, now: float | None = None) -> list[str]:
        """Remove caches unused for `keep_days` (and warm-ups abandoned by a crash); returns their names."""
        now = time.time() if now is None else now
        horizon = now - self.cfg.keep_days * 86400
        removed = []
        try:
            children = list(self.root.iterdir())
        except FileNotFoundError:
            return []
        for child in children:
            if child.name in (PYTHON_DIR, WORKSPACES_DIR):
                continue
            mark = child / USED if (child / USED).exists() else child
            try:
                if mark.stat().st_mtime >= horizon:
                    continue
            except FileNotFoundError:
                continue
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
        return removed
