"""Locked environments: the snapshot's `uv.lock` turned into a warm uv cache before any job is submitted.

When a snapshot holds `pyproject.toml` and `uv.lock` at its root (and `[environment] mode = "uv"`), the kernel
fills a uv cache for that lockfile on the kernel's host, in the build jail, with the network, once per distinct
(lockfile, pyproject, interpreter, index, uv version): `<run_dir>/envs/<key>/` holds

    uv/           the uv cache (UV_CACHE_DIR) with every wheel the lock names for this interpreter
    project/      the pyproject.toml and uv.lock the cache was built from, as the kernel re-serialised them
    venv/         the environment every job uses, installed from uv/ by hard link and byte-compiled; every write
                  bit cleared (`make_read_only`)
    ready.json    written last: the interpreter's version and the installed packages (`EnvReady`)
    used          touched at each use; a cache unused for `keep_days` is pruned
    warm.log      uv's output

No job builds anything: with jail = "bwrap" the venv is built at jail.SHARED_VENV (the entry mounted at
jail.SHARED_ENV_ROOT in the build jail), the path its scripts and pyvenv.cfg name, and every job's jail binds it
read-only there (kernel.node.wrapper); with "apptainer" it is relocatable (`uv venv --relocatable`: each script
finds the interpreter beside it) and bound read-only at jail.SHARED_VENV; with "none" it is relocatable and used
where it is, read-only by its mode bits alone (a task running as root, or one that chmods it back as the
kernel's user, can change it: jail = "none" contains nothing). No network in the jail, and the same lockfile
gives every job the same files across sleeps and workspaces. On Slurm the entry is in `run_dir`, which the
nodes must see at the same path.

The lockfile is the agent's. With jail = "bwrap", on the kernel's host only the kernel's own TOML parser reads it
outside the build jail (`lock_problem`, `accepted_files`), and nothing it makes uv download runs at build time:

- `lock_problem` accepts only packages from the configured index, each file a canonical
  `https://<the index's file host>/<path>` URL (a grammar on which urllib and uv's WHATWG parser read the same
  host, so the host checked is the host uv fetches from) with a sha256 hash uv verifies, and no other URL; the
  refusal names the entry (`package "six" wheels[2].url`).
- uv is given both files re-serialised by the kernel (`accepted_files`, `canonical_toml`), not the agent's bytes:
  uv's TOML parser reads the very values the kernel's parser read and checked.
- uv never builds (`--no-build`: a package without a wheel is refused, because building runs its setup code),
  never installs the project itself (`--no-install-project`), reads no configuration file (`--no-config`) and
  gets an environment built from nothing but the proxy and CA settings.
- With jail = "bwrap", `uv sync` runs in the build jail (`kernel.node.jail.build_bwrap_argv`): it can write only
  the entry being built (its cache, venv and home; the uv-managed Python directory when `environment.python` is
  a version), read only that entry's lockfile and pyproject, the uv binary, the CA files, the job jail's system
  directories and /etc allowlist and `extra_dirs`; it has the network (it downloads). The kernel's state, the
  rest of the run directory and the workspaces are not in it.
- The byte-compilation runs the environment's interpreter with `-S -I` (no site processing: no `.pth` of an
  installed wheel is read, no sitecustomize imported; the stdlib alone on sys.path) in the same jail without the
  network, able to write only the cache: no package code runs.
- What the build wrote to the cache is checked before any task uses it (`stray_entries`: no link leaving the
  cache, no special file).

With another jail kind (`apptainer`, or `none` for tests and a single-user laptop) uv and compileall run on the
host as the kernel's user, without a jail (logged at start, `environment_build_unjailed`): then the lock checks,
`--no-build`, the hashes and `-S -I` are what hold, and a bug in uv's handling of a hostile lock or wheel would
run with the kernel's rights. A lockfile that does not install fails its build: the sleeps waiting for it wake with
`environment.failed`, refunded (kernel.service.building: builds run in the background, never before an answer).

Before an entry is built, uv's own check (`check_lock`: `uv lock --check --offline` on the accepted files, jailed
like the build but without the network) tells whether the lock satisfies its pyproject; one that does not is
refused at sleep (`environment.lock_outdated`, nothing charged). One build per key runs at a time, across
processes too: `builds/<key>.lock` is an flock its builder holds, `builds/<key>.json` names the builder (found
with the flock free, the builder died mid-build: built again), `builds/<key>.log` is uv's output as it prints it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final
from urllib.parse import urlsplit

import anyio
import msgspec

from kernel.core.config import EnvironmentConfig
from kernel.io import hostproc
from kernel.io import log as klog
from kernel.io.crash import crash_point
from kernel.io.store import timestamp
from kernel.node.jail import (
    SHARED_ENV_ROOT,
    JailPolicy,
    JobEnvironment,
    build_bwrap_argv,
    sync_argv,
)

LOCK_FILE: Final = "uv.lock"
PROJECT_FILE: Final = "pyproject.toml"
PYTHON_DIR: Final = "python"  # uv-managed interpreters (environment.python = "3.12")
WORKSPACES_DIR: Final = "workspaces"  # each workspace's latest locked environment (kernel.io.jobenv)
READY: Final = "ready.json"
USED: Final = "used"
WARM_LOG: Final = "warm.log"
# Per cache key, beside the entries: `<key>.lock` (an flock held by the kernel building it), `<key>.json` (who
# builds it, since when: `Builder`) and `<key>.log` (uv's output as it runs: what `status` and `tail` show).
BUILDS_DIR: Final = "builds"
# How often a build waits for another process's build of the same key to let its lock go.
LOCK_POLL_S: Final = 1.0
# The longest uv's offline check of a lock against its pyproject.toml may take (it reads two files).
CHECK_TIMEOUT_S: Final = 60.0
# A lockfile or pyproject larger than this is refused (a real uv.lock of a large ML project is ~1 MiB).
MAX_FILE_BYTES: Final = 8 * 1024 * 1024
MESSAGE_TAIL: Final = 1500
# The deepest nesting of arrays and tables accepted in either file (a real uv.lock nests 5 levels).
MAX_TOML_DEPTH: Final = 32
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
# Of PASSED_VARS, the files and directories uv reads (bound read-only into the build jail where they exist).
CERT_VARS: Final = ("SSL_CERT_FILE", "SSL_CERT_DIR")
_ANSI: Final = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
UV_SYNC: Final = hostproc.declare(
    "uv.sync",
    agent_input="the agent's uv.lock and pyproject.toml, accepted by lock_problem and re-serialised by the kernel "
    "(registry packages from the configured index, canonical https file URLs with sha256 hashes); wheels only "
    "(--no-build, --no-install-project, --no-config)",
    containment="jail = bwrap: the build jail (kernel.node.jail.build_bwrap_argv: writes only the entry being "
    "built, reads only its project files, the uv binary, CA files and system directories; network); otherwise "
    "unjailed, logged at start (environment_build_unjailed); an environment built from nothing but the proxy "
    "and CA settings, environment.warm_timeout_seconds, at most 16 MiB of output",
    output_cap=16 << 20,
)
UV_LOCK_CHECK: Final = hostproc.declare(
    "uv.lock_check",
    agent_input="the agent's uv.lock and pyproject.toml, accepted by lock_problem and re-serialised by the kernel: "
    "uv compares them (`uv lock --check --offline --no-config`), resolving nothing it cannot read from the lock",
    containment="jail = bwrap: the build jail without the network, writing only a throwaway cache and home of the "
    "check; otherwise unjailed, logged at start (environment_build_unjailed); an environment built from nothing "
    "but the proxy and CA settings, 60 s, at most 1 MiB of output",
    timeout_s=CHECK_TIMEOUT_S,
    output_cap=1 << 20,
)
UV_VENV: Final = hostproc.declare(
    "uv.venv",
    agent_input="none: an empty relocatable venv for the configured interpreter (jail kinds other than bwrap), "
    "before uv sync installs the agent's lock into it",
    containment="unjailed, as the kernel's user (like uv.sync with jail = apptainer or none); an environment "
    "built from nothing but the proxy and CA settings, environment.warm_timeout_seconds, at most 16 MiB of output",
    output_cap=16 << 20,
)
COMPILE: Final = hostproc.declare(
    "uv.compile",
    agent_input="the Python sources of the locked packages' wheels, compiled to bytecode, never run: the "
    "interpreter starts with -S -I (no .pth, no sitecustomize, the stdlib alone on sys.path)",
    containment="the build jail without the network, writing only the cache (jail = bwrap; otherwise unjailed, "
    "logged at start), environment.warm_timeout_seconds, at most 16 MiB of output",
    output_cap=16 << 20,
)


class EnvironmentFailed(Exception):
    """The workspace's locked environment cannot be built; the message is for the agent (the sleep is refused
    with `environment.failed` and refunded)."""


class LockOutdated(EnvironmentFailed):
    """uv.lock does not match pyproject.toml (uv's own check said so): the sleep is refused at once with
    `environment.lock_outdated`, nothing charged; the message says to run `uv lock`."""


class Builder(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`builds/<key>.json`: the process building the entry and since when. Found while its flock is free, it is
    a build whose builder died (a SIGKILLed kernel): its leftovers are removed and the entry is built again."""

    pid: int
    started_at: str
    lock_sha256: str


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


@dataclass(frozen=True, slots=True)
class Prepared:
    """A project the kernel accepted (`EnvCache.prepare`): its cache key and the files uv is given
    (`accepted_files`: the kernel's re-serialisation, never the agent's bytes)."""

    key: str
    project: LockedProject
    files: tuple[bytes, bytes]


# --- pure ----------------------------------------------------------------------------------------------------


PYPI_INDEX: Final = "https://pypi.org/simple"
PYPI_FILES: Final = "files.pythonhosted.org"
# What a host and port must look like to be compared at all: lower-case ASCII labels, no trailing dot.
_LABEL: Final = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
_AUTHORITY: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*(?::[1-9][0-9]{{0,4}})?")
# A file's path: `/`-separated non-empty segments of these characters, none of them `.` or `..`.
_SEGMENT: Final = re.compile(r"[A-Za-z0-9._~+-]+")
_SHA256: Final = re.compile(r"sha256:[0-9a-f]{64}")
# What a wheel or sdist entry may hold: where the file is (a URL, nothing else), its hash, and two facts.
_FILE_KEYS: Final = frozenset({"url", "hash", "size", "upload-time"})


def index_of(index_url: str) -> str:
    """The index a lock must name (`source.registry`) and uv installs from: the configured one, else PyPI."""
    return (index_url or PYPI_INDEX).rstrip("/")


def file_authority(index_url: str) -> str:
    """`host[:port]` the files of the index live on (PyPI's: files.pythonhosted.org), lower-cased, the default
    port dropped; "" when the configured index has no host of the canonical form (_AUTHORITY)."""
    index = index_of(index_url)
    if index == PYPI_INDEX:
        return PYPI_FILES
    try:
        parts = urlsplit(index)
        host, port = (parts.hostname or "").rstrip("."), parts.port
    except ValueError:
        return ""
    authority = host if port in (None, 443) else f"{host}:{port}"
    return authority if _AUTHORITY.fullmatch(authority) else ""


def file_url_problem(url: object, authority: str) -> str | None:
    """Why `url` is not a canonical file URL of `authority`, or None.

    Canonical: exactly `https://<authority>/<segment>/.../<segment>`, each segment of [A-Za-z0-9._~+-] and not
    `.` or `..`. Nothing else may appear: no `\\` (WHATWG parsers, uv's among them, read it as `/`, so
    `https://a\\@b/` is host `a` to uv and `b` to urllib), no `@` (userinfo), no `%` (a percent-escape in
    a host decodes differently by parser), no `?`, `#`, whitespace or control character, no other port, no
    other scheme, no upper case, trailing dot or non-ASCII in the host. Since the authority is followed by `/` and
    the rest holds none of `\\ @ % ? # :` or a character a parser strips (tab, newline, space), every parser
    (urllib's urlsplit, the WHATWG URL standard that uv's `url` crate implements) ends the authority at that
    same `/` and reads the same host and port (and uv gets the lock re-serialised: `accepted_files`)."""
    if not isinstance(url, str):
        return "is not a string"
    prefix = f"https://{authority}/"
    if not url.startswith(prefix):
        return f"does not start with {prefix}"
    segments = url[len(prefix) :].split("/")
    for seg in segments:
        if seg in (".", "..") or not _SEGMENT.fullmatch(seg):
            return (
                f"has a path segment {seg[:80]!r} outside [A-Za-z0-9._~+-] (no `\\`, `@`, `%`, `?`, `#`, `:`, "
                "space or control character, no empty, `.` or `..` segment)"
            )
    return None


def relock(index: str) -> str:
    """The fix for a lock made against another index than the kernel's: the exact command that makes it again
    against `index` (uv writes that URL as every package's `source.registry`, and its files' URLs on its host)."""
    return (
        f"lock again against the kernel's index {index} alone: `uv lock --default-index {index}`, with no other "
        "index in pyproject.toml's [tool.uv]"
    )


def _entry(name: str, where: str) -> str:
    return f"package {json.dumps(name)} {where}"  # the agent's name, quoted and escaped


def parse_toml(data: bytes, name: str) -> dict[str, Any] | str:
    """`data` (the agent's `name`) parsed, or why not: not UTF-8, not TOML, or nested deeper than MAX_TOML_DEPTH
    (checked without recursion; tomllib itself gives up near a thousand levels with RecursionError)."""
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        return f"{name} is not UTF-8 text"
    except tomllib.TOMLDecodeError as e:
        return f"{name} is not valid TOML: {e}"
    except RecursionError:
        return f"{name} nests arrays or tables more than {MAX_TOML_DEPTH} deep"
    stack: list[tuple[object, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_TOML_DEPTH:
            return f"{name} nests arrays or tables more than {MAX_TOML_DEPTH} deep"
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack += [(v, depth + 1) for v in children]
    return doc


def _file_problem(name: str, where: str, entry: object, authority: str, index: str) -> str | None:
    if not isinstance(entry, dict):
        return f"uv.lock {_entry(name, where)} is not a table"
    extra = sorted(set(entry) - _FILE_KEYS)
    if extra:
        return (
            f"uv.lock {_entry(name, where)} has {', '.join(extra)}; a file must be named by its `url` on "
            f"https://{authority}/ with its `hash` ({relock(index)})"
        )
    why = file_url_problem(entry.get("url"), authority)
    if why is not None:
        shown = str(entry.get("url"))[:200]
        return (
            f"uv.lock {_entry(name, where + '.url')} {shown!r} {why}; files must come from https://{authority}/ "
            f"in canonical form ({relock(index)}; do not edit the URLs)"
        )
    digest = entry.get("hash")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        return (
            f"uv.lock {_entry(name, where + '.hash')} is {str(digest)[:80]!r}, not `sha256:` and 64 lower-case "
            "hex digits; every file needs the hash uv verifies it against (lock again with uv)"
        )
    return None


def _strings(value: object, where: str) -> list[tuple[str, str]]:
    """Every string in a TOML value with its path (`a.b[2].c`)."""
    if isinstance(value, str):
        return [(where, value)]
    if isinstance(value, dict):
        return [got for k, v in value.items() for got in _strings(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [got for i, v in enumerate(value) for got in _strings(v, f"{where}[{i}]")]
    return []


def _url_like(text: str) -> bool:
    return "\\" in text or ":/" in text


def lock_problem(lock: bytes, index_url: str = "") -> str | None:
    """Why the kernel will not install this lockfile, or None; the reason names the entry (`package "six"
    wheels[2].url`) and how to fix it.

    Accepted: packages whose `source` is `{ registry = <the configured index> }` (the project itself, `virtual`
    or `editable` ".", is never installed), each wheel and sdist a table of `url`, `hash`, `size` and
    `upload-time` only, its url canonical (`file_url_problem`: `https://<the index's file host>/<path>`, a
    grammar on which urllib and uv read the same host) and its hash `sha256:<64 hex>` (uv verifies every file
    against it), and no other URL anywhere in the lock but the index's own. Anything else would make uv read
    files or repositories outside the jail, build code, or fetch a URL the agent chose."""
    doc = parse_toml(lock, LOCK_FILE)
    return doc if isinstance(doc, str) else lock_doc_problem(doc, index_url)


def lock_doc_problem(doc: Mapping[str, Any], index_url: str) -> str | None:
    """`lock_problem` of a lock tomllib already parsed (control characters in the reason escaped)."""
    problem = _lock_problem(doc, index_url)
    return None if problem is None else _printable(problem)


def _printable(text: str) -> str:
    """`text` with every control character escaped (a refusal quotes the agent's keys and names)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _lock_problem(doc: Mapping[str, Any], index_url: str) -> str | None:
    index = index_of(index_url)
    authority = file_authority(index_url)
    if not authority:
        return (
            f"the kernel's package index {index!r} (the operator's environment.index_url) has no host of the "
            "form `name.domain[:port]` in lower case, so no file URL can be checked against it (ask the operator)"
        )
    packages = doc.get("package", [])
    if not isinstance(packages, list):
        return "uv.lock has no [[package]] list"
    for i, pkg in enumerate(packages):
        if not isinstance(pkg, dict):
            return f"uv.lock package #{i + 1} is not a table"
        name = str(pkg.get("name", f"#{i + 1}"))[:100]
        problem = _package_problem(name, pkg, index, authority)
        if problem is not None:
            return problem
    others = {k: v for k, v in doc.items() if k != "package"}
    for where, text in _strings(others, ""):
        if _url_like(text) and text.rstrip("/") != index:
            return _stray_url(where, text, index)
    return None


def _stray_url(where: str, text: str, index: str) -> str:
    return (
        f"uv.lock {where} is {text[:200]!r}: the only URL a lock may name outside its files is the kernel's "
        f"index {index} ({relock(index)})"
    )


def _package_problem(name: str, pkg: dict[str, object], index: str, authority: str) -> str | None:
    source = pkg.get("source")
    if not isinstance(source, dict) or len(source) != 1:
        return f"uv.lock {_entry(name, 'source')}: not a single `source`"
    ((kind, where),) = source.items()
    files: list[tuple[str, object]] = []
    if kind in ("virtual", "editable") and where == ".":
        pass  # the project itself: never installed (--no-install-project); a URL in it is a stray one below
    elif kind != "registry":
        return (
            f"uv.lock {_entry(name, 'source')} is a {kind} source ({str(where)[:200]!r}); the kernel installs "
            "only packages from a package index (publish it to the index, or vendor its code into the workspace)"
        )
    elif not isinstance(where, str) or where.rstrip("/") != index:
        return (
            f"uv.lock {_entry(name, 'source.registry')} is the index {str(where)[:200]!r}; this kernel installs "
            f"only from {index}, written exactly so: {relock(index)}"
        )
    else:
        files += [("sdist", pkg["sdist"])] if "sdist" in pkg else []
        wheels = pkg.get("wheels", [])
        if not isinstance(wheels, list):
            return f"uv.lock {_entry(name, 'wheels')} is not a list"
        files += [(f"wheels[{j}]", w) for j, w in enumerate(wheels)]
    for where_in, entry in files:
        problem = _file_problem(name, where_in, entry, authority, index)
        if problem is not None:
            return problem
    checked = {"source", *(["sdist", "wheels"] if kind == "registry" else [])}
    rest = {k: v for k, v in pkg.items() if k not in checked}
    for where_in, text in _strings(rest, ""):
        if _url_like(text) and text.rstrip("/") != index:
            return _stray_url(_entry(name, where_in), text, index)
    return None


def canonical_toml(doc: Mapping[str, object]) -> bytes:
    """`doc` (what tomllib parsed) as one canonical TOML document: every top-level key on its own line, every
    table inline, every key a quoted string, every string a basic string of printable ASCII with `\\"`, `\\\\`,
    `\\uXXXX` and `\\UXXXXXXXX` its only escapes. The kernel hands uv this, not the agent's bytes, so uv's TOML
    parser reads exactly the values the kernel's did (no multi-line, literal or dotted form, comment, or other
    spelling that two parsers might read apart). `tomllib.loads(canonical_toml(d)) == d`."""
    return "".join(f"{_toml_str(k)} = {_toml_value(v)}\n" for k, v in doc.items()).encode("ascii")


def _toml_str(text: str) -> str:
    out = []
    for c in text:
        n = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif 0x20 <= n < 0x7F:
            out.append(c)
        else:
            out.append(f"\\u{n:04x}" if n <= 0xFFFF else f"\\U{n:08x}")
    return '"' + "".join(out) + '"'


def _toml_value(value: object) -> str:
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # `1.5`, `1e+20`, `inf`, `-inf`, `nan`: TOML floats
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date; isoformat is TOML's RFC 3339
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_str(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"not a TOML value: {type(value).__name__}")


_REQUIREMENT_NAME: Final = re.compile(r"\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")


def _normal_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stale_lock_problem(pyproject: Mapping[str, Any], lock: Mapping[str, Any]) -> str | None:
    """Why uv.lock is out of date with pyproject.toml, or None: a package `[project].dependencies` names that the
    lock's entry of the project does not require (`uv add` or an edit without `uv lock`). Only what is certain
    is refused (a changed version specifier is left to uv); without a `[project]` table or a locked entry of
    the project there is nothing to compare."""
    proj = pyproject.get("project")
    deps = proj.get("dependencies") if isinstance(proj, dict) else None
    name = proj.get("name") if isinstance(proj, dict) else None
    if not isinstance(deps, list) or not isinstance(name, str):
        return None
    packages = lock.get("package")
    root = next(
        (
            p
            for p in (packages if isinstance(packages, list) else [])
            if isinstance(p, dict)
            and isinstance(p.get("name"), str)
            and _normal_name(p["name"]) == _normal_name(name)
            and isinstance(p.get("source"), dict)
            and ({"virtual", "editable"} & set(p["source"]))
        ),
        None,
    )
    meta = root.get("metadata") if root is not None else None
    locked = meta.get("requires-dist") if isinstance(meta, dict) else None
    if root is None or not isinstance(locked, list):
        return None
    have = {_normal_name(r["name"]) for r in locked if isinstance(r, dict) and isinstance(r.get("name"), str)}
    missing = []
    for dep in deps:
        m = _REQUIREMENT_NAME.match(dep) if isinstance(dep, str) else None
        if m is not None and _normal_name(m.group(1)) not in have:
            missing.append(m.group(1))
    if not missing:
        return None
    shown = ", ".join(repr(n) for n in missing[:5]) + (
        f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    )
    return (
        f"uv.lock is out of date: pyproject.toml depends on {shown}, which uv.lock does not lock; run `uv lock` "
        "(or `uv add` the package), commit uv.lock and sleep again"
    )


def accepted_files(project: LockedProject, index_url: str) -> tuple[bytes, bytes]:
    """The (pyproject.toml, uv.lock) uv is given, in canonical form (`canonical_toml`); EnvironmentFailed when
    the lock is refused (`lock_problem`) or either file is not TOML, LockOutdated when it is certainly out of date
    with pyproject.toml (`stale_lock_problem`; uv's own check, `EnvCache.check_lock`, finds the rest), or either
    file is not TOML. Each file is parsed once: the values
    checked are the values re-serialised."""
    docs: list[dict[str, Any]] = []
    for data, name in ((project.pyproject, PROJECT_FILE), (project.lock, LOCK_FILE)):
        doc = parse_toml(data, name)
        problem = doc if isinstance(doc, str) else None
        if name == LOCK_FILE and not isinstance(doc, str):
            problem = lock_doc_problem(doc, index_url)
            stale = None if problem is not None else stale_lock_problem(docs[0], doc)
            if stale is not None:
                raise LockOutdated(_printable(stale))
        if problem is not None:
            raise EnvironmentFailed(_printable(problem))
        assert not isinstance(doc, str)
        docs.append(doc)
    return canonical_toml(docs[0]), canonical_toml(docs[1])


def cache_key(project: LockedProject, python: str, index_url: str, uv_version: str) -> str:
    # v2: uv given the re-serialised files, compileall run with -S (a v1 entry holds the agent's bytes).
    # v3: built at jail.SHARED_ENV_ROOT, keeping its venv for jobs to bind.
    # v4: every jail kind keeps the venv (relocatable where not built in bwrap), read-only by its mode bits.
    h = hashlib.sha256(b"syscall-uv-env-v4\0")
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


def relocatable(venv: Path) -> bool:
    """Whether the venv's pyvenv.cfg says `relocatable = true` (its scripts find the interpreter beside them)."""
    try:
        lines = (venv / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return False
    return any([p.strip() for p in line.partition("=")[::2]] == ["relocatable", "true"] for line in lines)


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


# --- I/O -----------------------------------------------------------------------------------------------------


def cert_paths(env: Mapping[str, str]) -> list[str]:
    """The CA bundle and directory uv is told of (SSL_CERT_FILE, SSL_CERT_DIR) that exist: bound read-only into
    the build jail so uv trusts what the kernel's host trusts."""
    return [env[k] for k in CERT_VARS if k in env and os.path.isabs(env[k]) and os.path.exists(env[k])]


def stray_entries(root: Path) -> list[str]:
    """What under `root` (a cache the build jail wrote) is neither a directory, a regular file nor a symlink
    whose target, read as a path, stays below `root` (uv links wheels to archive entries with relative links):
    the venv every task uses is installed from the cache, and where uv copies (its fallback when a hard link
    fails) it follows a link."""
    out = []
    top = os.path.normpath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                target = os.path.normpath(os.path.join(dirpath, os.readlink(path)))
                if not target.startswith(top + os.sep):
                    out.append(os.path.relpath(path, root))
            elif not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                out.append(os.path.relpath(path, root))
    return out


def _append(log: BinaryIO, also: Callable[[bytes], object] | None, chunk: bytes) -> None:
    log.write(chunk)
    log.flush()  # the whole log, readable while uv runs
    if also is not None:
        also(chunk)


def lock_check_argv(uv: str, project: str, python: str) -> list[str]:
    """uv's own check that the project's uv.lock satisfies its pyproject.toml, changing nothing and reading no
    configuration file, offline (`EnvCache.check_lock`)."""
    return [uv, "lock", "--check", "--offline", "--no-config", "--project", project, "--python", python]


def make_read_only(root: Path) -> None:
    """Clear every write bit below `root` (directories and files; links have none): the venv every job shares.
    A process of another user, or of the kernel's own user other than root, can then neither change a file
    nor add or remove one; root, or the owner after a chmod, still can (with bwrap, the read-only bind holds
    for every user)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in [*filenames, *dirnames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if not stat.S_ISLNK(st.st_mode):
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o222)
    os.chmod(root, stat.S_IMODE(os.lstat(root).st_mode) & ~0o222)


def remove_entry(path: Path) -> None:
    """Remove a cache entry (its venv read-only: `make_read_only`): the owner's write bit restored on every
    directory first, then the tree."""
    for dirpath, dirnames, _ in os.walk(path):
        for d in [dirpath, *(os.path.join(dirpath, n) for n in dirnames)]:
            with contextlib.suppress(OSError):
                st = os.lstat(d)
                if stat.S_ISDIR(st.st_mode):
                    os.chmod(d, stat.S_IMODE(st.st_mode) | 0o700)
    shutil.rmtree(path, ignore_errors=True)


def uv_binary() -> str:
    """The uv the `uv` package installed beside the kernel."""
    import uv

    return str(uv.find_uv_bin())


class EnvCache:
    """The kernel's warm caches under `root`, `<run_dir>/envs/` (StatePaths.envs; one kernel per run_dir: warm-ups of one key are
    serialised in-process; concurrent kernels would only waste a download, as an entry appears by rename).
    `jail` is the kernel's job jail policy: its kind decides whether the build is jailed (`bwrap`), its system
    directories, /etc allowlist, `ro_dirs` and `hide` are the build jail's too."""

    def __init__(
        self,
        cfg: EnvironmentConfig,
        root: str | os.PathLike[str],
        *,
        jail: JailPolicy,
        uv: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.root = Path(root)
        self.uv = uv or uv_binary()
        self.jail = jail
        self._uv_version: str | None = None
        self._locks: dict[str, anyio.Lock] = {}
        self._checked: set[str] = set()  # keys uv's lock check passed (`check_lock`)
        if jail.kind != "bwrap":
            klog.event(
                "environment_build_unjailed",
                logging.WARNING,
                jail=jail.kind,
                note="uv runs on the kernel's host without a jail; lock checks, --no-build and -S -I still apply",
            )

    @property
    def managed_python(self) -> bool:
        return not self.cfg.python.startswith("/")

    @property
    def python_install_dir(self) -> Path:
        return self.root / PYTHON_DIR

    async def uv_version(self) -> str:
        if self._uv_version is None:
            got = await hostproc.run_async(
                hostproc.TOOL_QUERY,
                [self.uv, "--version"],
                env=uv_env({}, home="/nonexistent", cache="/nonexistent"),
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
            venv=str(entry / "venv"),
        )

    def touch(self, key: str) -> None:
        """Mark the entry used now (`prune` keeps it `keep_days` from here)."""
        with contextlib.suppress(OSError):
            (self.entry(key) / USED).touch()

    def ready(self, key: str) -> EnvReady | None:
        try:
            return msgspec.json.decode((self.entry(key) / READY).read_bytes(), type=EnvReady)
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def build_log(self, key: str) -> Path:
        """uv's output for the build of `key` as it runs (`builds/<key>.log`; the entry keeps it as warm.log)."""
        return self.root / BUILDS_DIR / f"{key}.log"

    async def prepare(self, project: LockedProject) -> Prepared:
        """The lockfile checked and re-serialised (`accepted_files`) and its cache key; EnvironmentFailed when
        the kernel will not install it."""
        # A thread: checking and re-serialising a lock takes ~0.3 s per MiB (about 2 s at MAX_FILE_BYTES).
        files = await anyio.to_thread.run_sync(accepted_files, project, self.cfg.index_url)
        key = cache_key(project, self.cfg.python, self.cfg.index_url, await self.uv_version())
        return Prepared(key, project, files)

    async def check_lock(self, prepared: Prepared) -> None:
        """uv's own check that uv.lock satisfies pyproject.toml (`uv lock --check --offline`): LockOutdated when
        it does not. uv is given the accepted files (never the agent's bytes) in a directory of their own, in the
        build jail without the network (jail = bwrap), with a throwaway cache: a lock that satisfies its
        pyproject is validated from the lock alone, one that does not sends uv to resolve, which it cannot
        offline (exit status 1). A check that cannot run (uv's own error, no interpreter yet, its deadline) is
        logged (`environment_check_skipped`) and passes: the build says what is wrong then. A key that passed
        is not checked again by this process."""
        if prepared.key in self._checked:
            return
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.root / f".check.{os.getpid()}.{time.monotonic_ns()}.tmp"
        tmp.mkdir(mode=0o700)
        try:
            for d in ("project", "home", "uv"):
                (tmp / d).mkdir()
            (tmp / "project" / PROJECT_FILE).write_bytes(prepared.files[0])
            (tmp / "project" / LOCK_FILE).write_bytes(prepared.files[1])
            extra = {"UV_OFFLINE": "1", "UV_PYTHON_DOWNLOADS": "never"}
            if self.cfg.index_url:
                extra["UV_INDEX_URL"] = self.cfg.index_url
            readable = [self.uv, str(tmp / "project")]
            if self.managed_python:
                extra["UV_PYTHON_INSTALL_DIR"] = str(self.python_install_dir)
                self.python_install_dir.mkdir(mode=0o700, exist_ok=True)
                readable.append(str(self.python_install_dir))
            env = uv_env(os.environ, home=str(tmp / "home"), cache=str(tmp / "uv"), **extra)
            argv = lock_check_argv(self.uv, str(tmp / "project"), self.cfg.python)
            got = await self._run_jailed(
                UV_LOCK_CHECK,
                argv,
                network=False,
                writable=[str(tmp / "uv"), str(tmp / "home")],
                readable=readable,
                env=env,
                cwd=str(tmp / "project"),
                limit_s=CHECK_TIMEOUT_S,
            )
        finally:
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(tmp, ignore_errors=True))
        if got is not None and got[0] == 0:
            self._checked.add(prepared.key)
            return
        said = "" if got is None else tail(got[1].decode("utf-8", "replace"), 600)
        if got is not None and got[0] == 1:
            raise LockOutdated(
                "uv.lock is out of date: it does not satisfy pyproject.toml (uv's own check, `uv lock --check`, "
                "could not confirm it from uv.lock alone); run `uv lock`, commit uv.lock and sleep again. "
                f"uv said: {said}"
            )
        klog.event(
            "environment_check_skipped",
            logging.WARNING,
            key=prepared.key,
            status="timeout" if got is None else got[0],
            problem=said[:500],
        )

    async def build(
        self, prepared: Prepared, *, on_output: Callable[[bytes], object] | None = None
    ) -> tuple[EnvReady, bool]:
        """The entry of `prepared`, built now unless it is ready; (ready, built now?). EnvironmentFailed when uv
        cannot install it. `on_output` is given uv's output as it prints it (also in `build_log(key)`).

        One build per key at a time: in this process an anyio lock, across processes `builds/<key>.lock`, an
        flock the builder holds (the kernel lets it go when it dies, SIGKILL included, so a dead builder is never
        waited on). `builds/<key>.json` names the builder while it builds: found with the flock free, it is a
        build whose builder died; its leftovers go and the entry is built again (`environment_build_stale`)."""
        key = prepared.key
        lock = self._locks.setdefault(key, anyio.Lock())
        built = False
        async with lock:
            ready = self.ready(key)
            if ready is None:
                fd = await self._hold(key)
                try:
                    ready = self.ready(key)  # another process's build, finished while this one waited
                    if ready is None:
                        self._clear_stale(key)
                        record = Builder(
                            pid=os.getpid(), started_at=timestamp(), lock_sha256=prepared.project.lock_sha256
                        )
                        (self.root / BUILDS_DIR / f"{key}.json").write_bytes(msgspec.json.encode(record))
                        crash_point("build")
                        ready = await self._warm(key, prepared.project, prepared.files, on_output)
                        built = True
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        (self.root / BUILDS_DIR / f"{key}.json").unlink()
                    os.close(fd)  # lets the flock go
            with contextlib.suppress(OSError):
                (self.entry(key) / USED).touch()
        return ready, built

    async def _hold(self, key: str) -> int:
        """The fd of `builds/<key>.lock`, flocked by this process (waiting, LOCK_POLL_S at a time, while another
        process holds it)."""
        builds = self.root / BUILDS_DIR
        builds.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(builds / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        waited = False
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                if not waited:
                    waited = True
                    klog.event("environment_build_waiting", key=key, note="another process builds this lock")
                await anyio.sleep(LOCK_POLL_S)
        except BaseException:
            os.close(fd)
            raise

    def _clear_stale(self, key: str) -> None:
        """(holding the key's flock) Remove what a builder that died left of the key's build."""
        record = self.root / BUILDS_DIR / f"{key}.json"
        try:
            was = msgspec.json.decode(record.read_bytes(), type=Builder)
        except FileNotFoundError:
            return
        except msgspec.DecodeError:
            was = None
        klog.event(
            "environment_build_stale",
            logging.WARNING,
            key=key,
            pid=was.pid if was else "?",
            started_at=was.started_at if was else "?",
            note="its builder died mid-build; built again",
        )
        for left in self.root.glob(f".{key}.*.tmp"):
            shutil.rmtree(left, ignore_errors=True)
        record.unlink()

    async def _warm(
        self,
        key: str,
        project: LockedProject,
        files: tuple[bytes, bytes],
        on_output: Callable[[bytes], object] | None = None,
    ) -> EnvReady:
        """Build the entry `key` from `files` (`accepted_files`: what uv reads instead of the agent's bytes)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.root / f".{key}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        tmp.mkdir(mode=0o700)
        try:
            for d in ("project", "home", "uv", "venv"):  # the venv empty: uv makes it one
                (tmp / d).mkdir()
            (tmp / "project" / PROJECT_FILE).write_bytes(files[0])
            (tmp / "project" / LOCK_FILE).write_bytes(files[1])
            # In bwrap the entry is built where every job's jail binds its venv (jail.SHARED_ENV_ROOT, one
            # mount, so uv links from its cache into the venv), the project files read-only over it; elsewhere
            # at its own path into a relocatable venv (its scripts find their interpreter beside them), which
            # jobs use where the entry ends up (jail = none) or bind at jail.SHARED_VENV (apptainer).
            shared = self.jail.kind == "bwrap"
            at = Path(SHARED_ENV_ROOT) if shared else tmp
            mounts = [(str(tmp), str(at), True), (str(tmp / "project"), str(at / "project"), False)]
            extra = {"UV_PROJECT_ENVIRONMENT": str(at / "venv")}
            if self.cfg.index_url:
                extra["UV_INDEX_URL"] = self.cfg.index_url
            writable = [] if shared else [str(tmp / d) for d in ("uv", "venv", "home")]
            if self.managed_python:
                extra["UV_PYTHON_INSTALL_DIR"] = str(self.python_install_dir)
                self.python_install_dir.mkdir(mode=0o700, exist_ok=True)
                writable.append(str(self.python_install_dir))
            else:
                extra["UV_PYTHON_DOWNLOADS"] = "never"
            env = uv_env(os.environ, home=str(at / "home"), cache=str(at / "uv"), **extra)
            certs = cert_paths(env)
            # Without bwrap uv installs into the relocatable venv made first, named by its own interpreter (a
            # request it satisfies: any other, uv replaces the venv with one that is not relocatable).
            python = self.cfg.python if shared else str(tmp / "venv" / "bin" / "python")
            argv = sync_argv(self.uv, str(at / "project"), python, offline=False)
            started = time.monotonic()
            if not shared:
                await self._relocatable_venv(tmp / "venv", env)
            log = self.build_log(key).open("wb")  # written as uv prints, closed below
            try:
                got = await self._run_jailed(
                    UV_SYNC,
                    argv,
                    network=True,
                    writable=writable,
                    readable=[self.uv, *certs] if shared else [self.uv, str(tmp / "project"), *certs],
                    env=env,
                    cwd=str(at / "project"),
                    mounts=mounts if shared else (),
                    on_output=functools.partial(_append, log, on_output),
                )
            finally:
                log.close()
            if got is None:
                raise EnvironmentFailed(
                    f"uv did not finish installing the locked environment within "
                    f"{self.cfg.warm_timeout_seconds:g} s"
                )
            out = got[1].decode("utf-8", "replace")
            (tmp / WARM_LOG).write_text(out)
            if got[0] != 0:
                raise EnvironmentFailed(f"uv could not install the locked environment: {tail(out)}")
            venv = tmp / "venv"
            if not shared and not relocatable(venv):
                raise EnvironmentFailed(
                    "uv replaced the environment's relocatable venv with one that is not (its scripts would "
                    f"name the build's temporary directory): {tail(out)}"
                )
            await self._compile(tmp, at, shared, tmp / WARM_LOG)
            # What the jail wrote is what every task's venv is linked from: no link may leave it.
            stray = await anyio.to_thread.run_sync(stray_entries, tmp / "uv")
            if stray:
                raise EnvironmentFailed(
                    f"the environment build left {len(stray)} entries in its cache that are not plain files or "
                    f"links within it (first: {stray[0]!r})"
                )
            # Jobs share it: no job may change it (with bwrap also bound read-only; with none these bits are
            # what holds, for a kernel user other than root).
            await anyio.to_thread.run_sync(make_read_only, venv)
            ready = EnvReady(
                key=key,
                lock_sha256=project.lock_sha256,
                python=self.cfg.python,
                python_version=venv_python_version(venv),
                uv_version=await self.uv_version(),
                packages=tuple(site_packages(venv)),
                warm_seconds=round(time.monotonic() - started, 3),
            )
            shutil.rmtree(tmp / "home", ignore_errors=True)
            (tmp / READY).write_bytes(msgspec.json.encode(ready))
            try:
                os.rename(tmp, self.entry(key))
            except OSError:
                if self.ready(key) is None:  # not another kernel's identical entry: a real failure
                    raise
            with contextlib.suppress(FileNotFoundError):
                self.build_log(key).unlink()  # the entry keeps it (warm.log)
            return ready
        finally:
            if tmp.exists():  # a plain thread: the kernel's own cache, not one workspace's files
                await anyio.to_thread.run_sync(remove_entry, tmp)

    async def _relocatable_venv(self, venv: Path, env: dict[str, str]) -> None:
        """An empty relocatable venv at `venv` for uv sync to install into (jail kinds other than bwrap: the entry
        is renamed into place after the build, and its scripts must find their interpreter wherever it ends up)."""
        argv = [self.uv, "venv", "--relocatable", "--no-config", "--quiet", "--python", self.cfg.python]
        argv.append(str(venv))
        got = await self._run_jailed(
            UV_VENV, argv, network=False, writable=[], readable=[], env=env, cwd=str(venv.parent)
        )
        if got is None:
            raise EnvironmentFailed("uv could not create the environment's venv: it timed out")
        if got[0] != 0:
            said = (
                tail(got[1].decode("utf-8", "replace")) or f"it exited with status {got[0]} and said nothing"
            )
            raise EnvironmentFailed(f"uv could not create the environment's venv: {said}")

    async def _compile(self, tmp: Path, at: Path, shared: bool, log: Path) -> None:
        """Byte-compile the cache's unpacked wheels (and the venv jobs bind, where the entry keeps one) with the
        environment's interpreter; `tmp` is the entry being built, mounted at `at` in the jail when `shared`.
        Jobs' venvs are read-only (the shared one, or one installed by hard link from the cache, `__pycache__`
        included), so without this every job would compile every module it imports from source (over a second
        for a few common packages).

        Compiling runs no package code: `-S -I` starts the interpreter without site processing (no `.pth` file
        of an installed wheel is read, no sitecustomize imported) and with the stdlib alone on sys.path
        (`compileall` only compiles: it imports nothing it compiles); it runs in the build jail too, without
        network, able to write only the entry. A module that does not compile (a Python 2 leftover) is only
        logged."""
        dirs = [str(at / "uv" / "archive-v0")] if (tmp / "uv" / "archive-v0").is_dir() else []
        if shared:
            dirs.append(str(at / "venv"))
        if not dirs:
            return
        python = str(at / "venv" / "bin" / "python")
        argv = [python, "-S", "-I", "-m", "compileall", "-q", "-j", "0", *dirs]
        managed = [str(self.python_install_dir)] if self.managed_python else []
        got = await self._run_jailed(
            COMPILE,
            argv,
            network=False,
            writable=[] if shared else [str(tmp / "uv")],
            readable=managed if shared else [str(tmp / "venv"), *managed],
            env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"},
            cwd=str(at / "uv"),
            mounts=[(str(tmp), str(at), True)] if shared else (),
        )
        if got is not None and got[0] != 0:
            with log.open("ab") as f:
                f.write(b"\ncompileall (not fatal):\n" + got[1][-8000:])

    async def _run_jailed(
        self,
        site: hostproc.Site,
        argv: list[str],
        *,
        network: bool,
        writable: list[str],
        readable: list[str],
        env: dict[str, str],
        cwd: str,
        mounts: Sequence[tuple[str, str, bool]] = (),
        limit_s: float | None = None,
        on_output: Callable[[bytes], object] | None = None,
    ) -> tuple[int, bytes] | None:
        """Run one step of the build (uv sync, compileall) through its hostproc site; (exit status, stdout then
        stderr; `on_output` is given each piece as it is printed), or None past `limit_s`, else
        `warm_timeout_seconds` (the process is killed; bwrap's --die-with-parent takes its
        children); EnvironmentFailed past the site's output cap.

        What it touches that the agent chose: the lockfile and pyproject uv reads, the wheels it downloads
        and unpacks, the modules compiled. Containment with jail = "bwrap": `build_bwrap_argv` (only
        `writable` can be written, only `readable` and the system directories read; the network only for uv).
        With another jail kind the step runs directly on the host as the kernel's user: then only what the
        lock checks, `--no-build`, the hashes and `-S -I` guarantee holds (docs/operator.md)."""
        if self.jail.kind == "bwrap":
            argv = build_bwrap_argv(
                self.jail,
                network=network,
                writable=writable,
                readable=readable,
                env=env,
                cwd=cwd,
                argv=argv,
                mounts=mounts,
            )
            env = {"PATH": SAFE_PATH}
            cwd = "/"  # bwrap's own: the step's is the jail's (--chdir), which may exist only there
        try:
            got = await hostproc.run_async(
                site,
                argv,
                env=env,
                cwd=cwd,
                limit_s=limit_s if limit_s is not None else self.cfg.warm_timeout_seconds,
                on_output=on_output,
            )
        except hostproc.TimeoutExpired:
            return None
        except hostproc.OutputTooLarge:
            raise EnvironmentFailed(
                f"{os.path.basename(argv[0])} printed more than {site.output_cap} bytes while building the "
                "locked environment"
            ) from None
        return got.returncode, got.stdout + got.stderr

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
            if child.name in (PYTHON_DIR, WORKSPACES_DIR, BUILDS_DIR):
                continue
            mark = child / USED if (child / USED).exists() else child
            try:
                if mark.stat().st_mtime >= horizon:
                    continue
            except FileNotFoundError:
                continue
            remove_entry(child)
            removed.append(child.name)
        return removed
