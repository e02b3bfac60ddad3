"""Which release this is: the version and commit setuptools-scm wrote at build time (`channel/_version.py`).

Every part of the distribution names itself from here: `--version` of the three console scripts, `kernel.json`
(`kernel.version`, `kernel.commit`), the `syscall_kernel_build_info` metric and the tool installed into
channels (stamped with these at install, `kernel.io.install`). A tree used without being built or installed (no
`_version.py`) says so rather than guessing.
"""

from __future__ import annotations

import importlib
from typing import Final


def _built() -> tuple[str, str | None]:
    try:
        # not a static import: the file exists only once the tree is built or installed
        built = importlib.import_module("channel._version")
    except ImportError:  # a source tree on sys.path that was never built or installed
        return "0+unknown", None
    commit = getattr(built, "COMMIT", None)
    # setuptools-scm writes the short commit id with a "g" in front (git describe's form)
    if isinstance(commit, str) and commit.startswith("g"):
        commit = commit[1:]
    return str(built.VERSION), commit if isinstance(commit, str) else None


VERSION: Final[str] = _built()[0]
# The short commit id, or None where the build had no git metadata.
COMMIT: Final[str | None] = _built()[1]


def describe(prog: str) -> str:
    """The `--version` line: `prog VERSION (commit C)`."""
    return f"{prog} {VERSION} (commit {COMMIT or 'unknown'})"
