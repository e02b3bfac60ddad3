"""Installing the agent's tool into a channel, and saying what changed when it is refreshed.

The kernel ships `tool/syscall.py`; enrollment (and every start) installs it as `.syscall/syscall` (mode 0755)
whenever the channel's copy differs from the kernel's, and then writes `.syscall/tool-news.md`, a short note on
what is new (version, verbs and options added or removed), so an agent whose tool changed under it can tell.
The comparison is pure (`summarize`, `news`); the writes go through `channel.safefs`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import re
from dataclasses import dataclass, field
from typing import Final

from channel import release, safefs
from channel.paths import ChannelPaths
from channel.render import data_block

TOOL_NEWS: Final = "tool-news.md"
TOOL_MODE: Final = 0o755
# The tool is one stdlib file; anything much larger in the channel is not a copy of it.
TOOL_READ_CAP: Final = 4 * 1024 * 1024

_VERSION_RE: Final = re.compile(
    rb"""^(?:__version__|VERSION|TOOL_VERSION)\s*=\s*["']([^"'\n]{1,40})["']""", re.M
)
# A subcommand: the first string argument of `add_parser(...)` or of a helper wrapping it, e.g. `_sub(subs, p, "x")`.
_VERB_RE: Final = re.compile(
    rb"""(?:add_parser|_sub)\(\s*(?:[A-Za-z_]\w*\s*,\s*)*["']([a-z][a-z0-9-]{0,30})["']"""
)
_FLAG_RE: Final = re.compile(rb"""["'](--[a-z][a-z0-9-]{0,40})["']""")


class ToolMissing(Exception):
    """The kernel's own copy of the tool cannot be read (a broken installation)."""


@dataclass(frozen=True, slots=True)
class ToolSource:
    data: bytes
    sha256: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha256", hashlib.sha256(self.data).hexdigest())

    @classmethod
    def bundled(cls) -> ToolSource:
        """The tool shipped with this kernel (`tool/syscall.py`), stamped with this kernel's release."""
        try:
            src = importlib.resources.files("tool").joinpath("syscall.py").read_bytes()
        except (FileNotFoundError, ModuleNotFoundError) as exc:
            raise ToolMissing(f"the kernel's copy of the tool (tool/syscall.py) is missing: {exc}") from None
        return cls(stamped(src, release.VERSION, release.COMMIT))


_UNSTAMPED: Final = (b'__version__ = "0+unstamped"\n', b"__commit__ = None  # type: Optional[str]\n")


def stamped(src: bytes, version: str, commit: str | None) -> bytes:
    """The tool's source with its release lines (`__version__`, `__commit__`) naming `version` and `commit`: a
    copy in a channel runs without the package, so it carries them itself."""
    if any(src.count(line) != 1 for line in _UNSTAMPED):
        raise ToolMissing("the kernel's copy of the tool (tool/syscall.py) lacks its unstamped release lines")
    version_line, commit_line = _UNSTAMPED
    return src.replace(version_line, f"__version__ = {version!r}\n".encode()).replace(
        commit_line, f"__commit__ = {commit!r}  # type: Optional[str]\n".encode()
    )


@dataclass(frozen=True, slots=True)
class ToolSummary:
    version: str | None
    verbs: frozenset[str]
    flags: frozenset[str]


def summarize(src: bytes) -> ToolSummary:
    m = _VERSION_RE.search(src)
    return ToolSummary(
        version=m.group(1).decode("ascii", "replace") if m else None,
        verbs=frozenset(v.decode() for v in _VERB_RE.findall(src)),
        flags=frozenset(f.decode() for f in _FLAG_RE.findall(src)),
    )


@functools.lru_cache(maxsize=4)
def _described(src: bytes) -> tuple[ToolSummary, str]:
    """The kernel's own tool, summarized once (not once per channel: 10,000 enrollments install it)."""
    return summarize(src), hashlib.sha256(src).hexdigest()


def news(old: bytes | None, new: bytes) -> str:
    """A short markdown note on what `new` changes relative to `old` (None: no previous copy was readable).

    `new` is the kernel's own tool; `old` is whatever was in the channel, which the agent may have edited, so
    everything read from it (its version string, the verbs and options only it has) is shown inside a fence
    labelled as data, never as the kernel's words."""
    n, new_sha = _described(new)
    version = f"version {n.version}" if n.version else "a copy that declares no version"
    lines = ["# The syscall tool was updated", "", f"Installed {version} (sha256 {new_sha[:16]})."]
    if old is not None:
        o = summarize(old)
        old_sha = hashlib.sha256(old).hexdigest()
        lines.append(f"It replaced the copy with sha256 {old_sha[:16]}.")
        for label, items in (("New verbs", n.verbs - o.verbs), ("New options", n.flags - o.flags)):
            if items:
                lines.append(f"- {label}: {', '.join(f'`{x}`' for x in sorted(items))}")
        data = [f"version: {o.version if o.version is not None else '(none declared)'}"]
        for label, items in (("removed verbs", o.verbs - n.verbs), ("removed options", o.flags - n.flags)):
            if items:
                data.append(f"{label}: {', '.join(sorted(items))}")
        lines += ["", data_block("What the replaced copy declared", "\n".join(data)).rstrip("\n")]
    lines += ["", "Run `python3 .syscall/syscall --help` (and `<verb> --help`) for details.", ""]
    return "\n".join(lines)


def installed_copy(ch: safefs.Channel) -> bytes | None:
    """The channel's current tool bytes, or None if absent or not a plain file."""
    try:
        return safefs.read_capped_at(ch.fd, ChannelPaths.TOOL, TOOL_READ_CAP)
    except safefs.Refused:
        return None


def install(ch: safefs.Channel, tool: ToolSource, *, durable: bool = True) -> str | None:
    """Make `.syscall/syscall` the kernel's copy (and `.gitignore` the kernel's). Returns the news note if the tool
    was (re)installed, else None. `durable=False`: the caller syncs the channel's filesystem (safefs)."""
    try:
        ignore = safefs.read_capped_at(ch.fd, ChannelPaths.GITIGNORE, len(ChannelPaths.GITIGNORE_BYTES))
    except safefs.Refused:
        ignore = None
    if ignore != ChannelPaths.GITIGNORE_BYTES:
        ch.write_file(None, ChannelPaths.GITIGNORE, ChannelPaths.GITIGNORE_BYTES, durable=durable)
    current = installed_copy(ch)
    if current == tool.data:
        return None
    note = news(current, tool.data)
    ch.write_file(None, ChannelPaths.TOOL, tool.data, TOOL_MODE, durable=durable)
    ch.write_file(None, TOOL_NEWS, note.encode(), durable=durable)
    return note
