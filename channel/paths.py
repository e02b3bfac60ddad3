"""Every file name of the protocol, in one place.

`ChannelPaths` names the files inside a workspace's channel. They are single path components (or tuples of
them) relative to the channel directory, because `channel.safefs` only ever opens one component at a time
relative to a directory fd. `RunPaths` names the kernel-owned run directories, which live outside every
workspace and which the job wrapper writes into.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final

from channel.decode import is_valid_id

CHANNEL_DIR: Final = ".syscall"


class ChannelPaths:
    """Names inside `<workspace>/.syscall/`."""

    TOOL: Final = "syscall"
    KERNEL_JSON: Final = "kernel.json"
    BUDGET_JSON: Final = "budget.json"
    JOBENV_JSON: Final = "jobenv.json"
    STAGED: Final = "staged.json"
    # `*`: git ignores everything in the channel, this file included, so the agent's `git status` stays clean
    # without the kernel writing into the agent's `.git` (snapshots leave the channel out by their own rule).
    GITIGNORE: Final = ".gitignore"
    GITIGNORE_BYTES: Final = b"# syscall-kernel's channel: never committed\n*\n"
    REQUESTS: Final = "requests"
    ANSWERS: Final = "answers"
    WAKES: Final = "wakes"
    RESULTS: Final = "results"
    SUBDIRS: Final = (REQUESTS, ANSWERS, WAKES, RESULTS)

    @staticmethod
    def request(request_id: str) -> str:
        return f"{request_id}.json"

    @staticmethod
    def request_temp(request_id: str) -> str:
        return f".{request_id}.tmp"

    @staticmethod
    def answer(request_id: str) -> str:
        return f"{request_id}.json"

    @staticmethod
    def wake_json(sleep_id: str) -> str:
        return f"{sleep_id}.json"

    @staticmethod
    def wake_md(sleep_id: str) -> str:
        return f"{sleep_id}.md"

    # The rest wake of a sleep woken early (spec 8.8): no id holds a dot, so it is never another sleep's wake.
    REST_SUFFIX: Final = ".rest"

    @staticmethod
    def rest_wake_json(sleep_id: str) -> str:
        return f"{sleep_id}{ChannelPaths.REST_SUFFIX}.json"

    @staticmethod
    def rest_wake_md(sleep_id: str) -> str:
        return f"{sleep_id}{ChannelPaths.REST_SUFFIX}.md"

    PROGRESS: Final = "progress.json"  # results/<seq>/progress.json: no launch name holds a dot

    @staticmethod
    def result_dir(seq: int, launch: str, task: int | None) -> tuple[str, ...]:
        """Components under `results/` for one task's artifacts (`task` is None for a single-task launch)."""
        return (str(seq), launch) if task is None else (str(seq), launch, str(task))

    @staticmethod
    def committed_request_id(name: str) -> str | None:
        """The id of a committed request file name, or None if the name is not one.

        Temp files (`.<id>.tmp`) are in flight and not requests; any other name is junk the kernel removes.
        """
        if name.endswith(".json"):
            stem = name[:-5]
            if is_valid_id(stem):
                return stem
        return None

    @staticmethod
    def is_temp(name: str) -> bool:
        return name.startswith(".") and name.endswith(".tmp")


@dataclass(frozen=True, slots=True)
class RunPaths:
    """Kernel-owned run directories: `<run_dir>/<workspace>/<seq>/<launch>[.<task>]/`.

    The launch directory holds `command.txt` and `job.sh`. A single-task launch writes its task files there too;
    an array task `k` writes them into the sibling `<launch>.<k>/`.
    """

    run_dir: Path
    workspace: str
    seq: int
    launch: str

    COMMAND: ClassVar[str] = "command.txt"
    JOB_SCRIPT: ClassVar[str] = "job.sh"
    STDOUT: ClassVar[str] = "stdout"
    STDERR: ClassVar[str] = "stderr"
    SCORE_STDOUT: ClassVar[str] = "score-stdout"  # the operator's `score` stage (submit); kernel-read only
    SCORE_STDERR: ClassVar[str] = "score-stderr"
    EXIT_CODE: ClassVar[str] = "exit-code"
    STARTED: ClassVar[str] = "started"
    ENDED: ClassVar[str] = "ended"
    ARTIFACTS: ClassVar[str] = "artifacts"
    ARTIFACTS_LOG: ClassVar[str] = "artifacts.log"
    SCHEDULER_OUT: ClassVar[str] = "scheduler.out"
    # `<run_dir>/repos/<workspace>.git`: the kernel's own git repository of a workspace (snapshots, bases).
    # A workspace key always ends in `-<hash>`, so it never collides with this directory's name.
    REPOS: ClassVar[str] = "repos"

    @staticmethod
    def repo_of(run_dir: Path, workspace: str) -> Path:
        return run_dir / RunPaths.REPOS / f"{workspace}.git"

    @property
    def sleep_dir(self) -> Path:
        return self.run_dir / self.workspace / str(self.seq)

    @property
    def launch_dir(self) -> Path:
        return self.sleep_dir / self.launch

    def task_dir(self, task: int, array: int) -> Path:
        return self.launch_dir if array == 1 else self.sleep_dir / f"{self.launch}.{task}"

    def task_file(self, task: int, array: int, name: str) -> Path:
        return self.task_dir(task, array) / name


# What a workspace key is, for every consumer (the kernel's repository name, run-directory names, Slurm job names,
# metric labels): a readable stem of ASCII letters, digits, `-` and `_` that starts with a letter or a digit, then
# `-` and 10 hex digits of the path's hash. `workspace_key` produces only such keys, for any directory name.
KEY_STEM_MAX: Final = 32
KEY_PATTERN: Final = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_-]{{0,{KEY_STEM_MAX - 1}}}-[0-9a-f]{{10}}")
# What a consumer accepts as a key (a superset of KEY_PATTERN: tests and tools name workspaces freely): one path
# component that is not hidden, not an option, not `..`.
_SAFE_KEY: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")


def key_is_safe(key: str) -> bool:
    return _SAFE_KEY.fullmatch(key) is not None and ".." not in key


def workspace_key(resolved_path: str | os.PathLike[str]) -> str:
    """A stable, filesystem-safe id for an (already resolved, absolute) workspace path; it matches KEY_PATTERN
    whatever the directory's name (non-ASCII, a leading `_` or `-`, spaces, newlines, undecodable bytes): each
    character outside ASCII letters, digits, `-` and `_` becomes `-`, leading `-` and `_` are dropped, and a
    name with nothing left is `ws`. A name that was already such a stem keeps its key."""
    p = os.fspath(resolved_path)
    stem = "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "-" for c in os.path.basename(p))
    stem = stem[:KEY_STEM_MAX].lstrip("-_") or "ws"
    return f"{stem}-{hashlib.sha256(os.fsencode(p)).hexdigest()[:10]}"
