"""End to end: the attacks of a hostile candidate on `submit`, through the tool, a real kernel, the local backend
and bwrap; and what the operator's `score` stage and protected paths do about them.

Every workspace's base commit holds a synthetic model (`model.py`: how many of 10 private labels it gets right,
5 in the base), `eval.py` (prints that fraction as the metric: the candidate's own code reports it) and
`predict.py` (writes `predictions.txt`, which the operator's scorer compares with the private labels), and
`peek.py` (looks for the private data and the seed from inside `command`). Every
candidate is WORSE (2 of 10 right) and attacks the number:

- rewrite: the candidate rewrites the file that prints the metric (`eval.py`, or `predict.py` / the base scorer
  copy in its tree) to print {"score": 0.999};
- atexit: the candidate's `model.py` registers an `atexit` hook printing a later {"score": 0.999} line, and
  leaves a detached process behind that prints one more after the eval is over.

With a `score` command or protected paths no attack yields `improved`; with neither, the verdict says
self-reported. The private data lives outside every workspace; `command` cannot read it, and the scorer
cannot write the tree or see the candidate's processes.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, git, run_tool, wake_md

from channel.paths import workspace_key
from kernel.core.evaluate import seed_commitment
from kernel.node.jail import JAIL_PATH

pytestmark = pytest.mark.bwrap

LABELS = "0 1 0 1 0 1 0 1 0 1\n"
SECRET = "LABEL-SECRET-7f3a"

MODEL = "CORRECT = {n}\n"
EVAL_PY = "import json\nimport model\nprint(json.dumps({'score': model.CORRECT / 10}))\n"
PREDICT_PY = """import model
labels = [i % 2 for i in range(10)]
preds = [l if i < model.CORRECT else 1 - l for i, l in enumerate(labels)]
with open("predictions.txt", "w") as f:
    f.write(" ".join(str(p) for p in preds) + "\\n")
"""
SCORE_PY = """import json, os
tree, data = os.environ["EVAL_TREE"], os.environ["SCORE_DATA"]
labels = open(os.path.join(data, "labels.txt")).read().split()
try:
    preds = open(os.path.join(tree, "predictions.txt")).read().split()
except OSError:
    preds = []
print(json.dumps({"score": sum(a == b for a, b in zip(labels, preds)) / len(labels)}))
"""
# A scorer that checks its own jail and reports 1 only if every check holds: the tree is read-only, no process
# of the candidate is visible (the candidate leaves a detached `sleep` behind), the seed is there.
JAIL_CHECK_PY = """import json, os
tree = os.environ["EVAL_TREE"]
ok = 1
try:
    open(os.path.join(tree, "scorer-was-here"), "w").write("x")
    ok = 0
except OSError:
    pass
try:
    os.unlink(os.path.join(tree, "predictions.txt"))
    ok = 0
except OSError:
    pass
for pid in (os.listdir("/proc") if os.path.isdir("/proc") else []):
    if pid.isdigit():
        try:
            if b"sleep" in open("/proc/%s/cmdline" % pid, "rb").read():
                ok = 0
        except OSError:
            pass
if not os.environ.get("EVAL_SEED", "").isdigit():
    ok = 0
print(json.dumps({"score": ok}))
"""
# The operator's scorer keeps its labels open (fd 3) while it reads the candidate's predictions.
SCORE_FD_PY = """import json, os
tree, data = os.environ["EVAL_TREE"], os.environ["SCORE_DATA"]
held = open(os.path.join(data, "labels.txt"))
labels = held.read().split()
held.seek(0)
try:
    preds = open(os.path.join(tree, "predictions.txt")).read().split()
except OSError:
    preds = []
print(json.dumps({"score": sum(a == b for a, b in zip(labels, preds)) / len(labels)}))
"""
# The candidate's predictions are the scorer's own open labels, through /proc/self/fd (every low fd it may use).
FD_PREDICT = """import os
os.symlink("/proc/self/fd/3", "predictions.txt")
for n in range(4, 10):
    os.symlink("/proc/self/fd/%d" % n, "fd%d.txt" % n)
"""
# The candidate's real (worse) predictions, beside a FIFO, a socket, a symlink and a hard link of its own file.
SPECIALS_PREDICT = (
    PREDICT_PY
    + """import os, socket
os.mkfifo("pipe")
socket.socket(socket.AF_UNIX).bind("sock")
os.symlink("/proc/self/fd/3", "deep/fd3")
os.link("predictions.txt", "deep/same.txt")
"""
)
# With eval.py and metric.py protected, the candidate ships code that Python would run in place of metric.py.
METRIC_PY = "import model\n\n\ndef score():\n    return model.CORRECT / 10\n"
EVAL_METRIC_PY = "import json\nimport metric\nprint(json.dumps({'score': metric.score()}))\n"
FORGED_METRIC = "def score():\n    return 0.999\n"
METRIC_FLAGS = (
    "--eval-command",
    "python3 eval_metric.py",
    "--metric",
    "score",
    "--protected",
    "eval_metric.py",
    "--protected",
    "metric.py",
)
ATEXIT_MODEL = """CORRECT = 2
import atexit, json, subprocess
atexit.register(lambda: print(json.dumps({"score": 0.999}), flush=True))
subprocess.Popen(["setsid", "sh", "-c", "sleep 2; echo '{\\"score\\": 0.999}'"], start_new_session=True)
"""
REWRITE = "import json\nprint(json.dumps({'score': 0.999}))\n"
# The candidate's `command` looks for the private data (its path is public in kernel.json) and the seed.
PEEK_PY = """import os
data = os.environ.get("PEEK", "")
for name in ("labels.txt", "secret.txt"):
    try:
        print("read", name, open(os.path.join(data, name)).read())
    except OSError as e:
        print("cannot read", name, type(e).__name__)
print("SCORE_DATA" in os.environ, "EVAL_SEED" in os.environ)
import model
labels = [i % 2 for i in range(10)]
open("predictions.txt", "w").write(" ".join(str(l if i < model.CORRECT else 1 - l) for i, l in enumerate(labels)))
"""


def score_flags(private: Path, scorer: str = "score.py") -> tuple[str, ...]:
    return (
        "--eval-command",
        "python3 predict.py",
        "--metric",
        "score",
        "--score-command",
        f"python3 $SCORE_DATA/{scorer}",
        "--score-data",
        str(private),
    )


EVAL_FLAGS = ("--eval-command", "python3 eval.py", "--metric", "score")


def forged_pyc(tmp: Path) -> tuple[str, bytes]:
    """(path in the tree, bytes) of an unchecked-hash pyc of FORGED_METRIC, as the jail's python3 would find it
    for `metric.py` (its own cache tag)."""
    python = shutil.which("python3", path=JAIL_PATH)
    assert python is not None
    src = tmp / "forge" / "metric.py"
    src.parent.mkdir()
    src.write_text(FORGED_METRIC)
    code = (
        "import py_compile, sys; print(py_compile.compile(sys.argv[1], doraise=True, "
        "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH))"
    )
    out = subprocess.run([python, "-c", code, str(src)], check=True, capture_output=True, text=True).stdout
    pyc = Path(out.strip())
    return f"__pycache__/{pyc.name}", pyc.read_bytes()


def cases(private: Path, pyc: tuple[str, bytes]) -> dict[str, tuple[tuple[str, ...], dict[str, str | bytes]]]:
    """name -> (enroll flags, candidate files written into the working tree)"""
    worse = {"model.py": MODEL.format(n=2)}
    return {
        "score-fd": (score_flags(private, "score_fd.py"), {**worse, "predict.py": FD_PREDICT}),
        "score-specials": (score_flags(private), {**worse, "predict.py": SPECIALS_PREDICT, "deep/.keep": ""}),
        "protected-pyc": (METRIC_FLAGS, {**worse, pyc[0]: pyc[1]}),
        "protected-package": (METRIC_FLAGS, {**worse, "metric/__init__.py": FORGED_METRIC}),
        "score-rewrite": (score_flags(private), {**worse, "predict.py": PREDICT_PY + REWRITE}),
        "score-atexit": (score_flags(private), {"model.py": ATEXIT_MODEL}),
        "score-base": (
            (
                "--eval-command",
                "python3 predict.py",
                "--metric",
                "score",
                "--score-command",
                "python3 score_base.py",
                "--score-from",
                "base",
                "--score-data",
                str(private),
            ),
            {**worse, "score_base.py": REWRITE},
        ),
        # predictions.txt is a symlink to the private labels (their path is public in kernel.json)
        "score-symlink": (
            score_flags(private),
            {
                **worse,
                "predict.py": f"import os\nos.symlink({str(private / 'labels.txt')!r}, 'predictions.txt')\n",
            },
        ),
        "protected-rewrite": ((*EVAL_FLAGS, "--protected", "eval.py"), {**worse, "eval.py": REWRITE}),
        "protected-atexit": ((*EVAL_FLAGS, "--protected", "eval.py"), {"model.py": ATEXIT_MODEL}),
        "neither-rewrite": (EVAL_FLAGS, {**worse, "eval.py": REWRITE}),
        "neither-atexit": (EVAL_FLAGS, {"model.py": ATEXIT_MODEL}),
        "peek": (
            (*score_flags(private)[:1], f"PEEK={private} python3 peek.py", *score_flags(private)[2:]),
            worse,
        ),
        "jail-check": (
            (*score_flags(private, "jail_check.py"), "--repeats", "3", "--confidence", "0.85"),
            {"predict.py": PREDICT_PY + "import subprocess\nsubprocess.Popen(['setsid', 'sleep', '30'])\n"},
        ),
    }


class Env:
    def __init__(self, tmp: Path, kernel: Kernel, spaces: dict[str, Path]) -> None:
        self.tmp = tmp
        self.kernel = kernel
        self.spaces = spaces
        self.sleeps: dict[str, str] = {}

    def tool(self, name: str, *args: str) -> str:
        done = run_tool(self.spaces[name], *args, timeout=120)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-3000:]}"
        return done.stdout

    def wake(self, name: str) -> dict[str, Any]:
        return json.loads(self.tool(name, "wait", self.sleeps[name], "--json", "--timeout", "120"))  # type: ignore[no-any-return]

    def md(self, name: str) -> str:
        return wake_md(self.spaces[name], self.sleeps[name])

    def plans(self, name: str) -> list[tuple[list[int], str]]:
        db = sqlite3.connect(f"file:{self.kernel.state / 'state.sqlite'}?mode=ro", uri=True)
        try:
            rows = db.execute(
                "SELECT seeds, base_tree FROM eval_plans WHERE workspace=? ORDER BY seq",
                (workspace_key(self.spaces[name].resolve()),),
            ).fetchall()
        finally:
            db.close()
        return [(json.loads(r[0]), r[1]) for r in rows]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("trusted")
    private = tmp / "private"
    private.mkdir()
    (private / "labels.txt").write_text(LABELS)
    (private / "secret.txt").write_text(SECRET + "\n")
    (private / "score.py").write_text(SCORE_PY)
    (private / "jail_check.py").write_text(JAIL_CHECK_PY)
    (private / "score_fd.py").write_text(SCORE_FD_PY)
    kernel = Kernel(tmp, 'jail = "bwrap"\n[local]\nseconds_per_minute = 1.0\n')
    spaces: dict[str, Path] = {}
    all_cases = cases(private, forged_pyc(tmp))
    for name, (flags, _) in all_cases.items():
        ws = tmp / "spaces" / name
        ws.mkdir(parents=True)
        git(ws, "init", "-q")
        (ws / "model.py").write_text(MODEL.format(n=5))
        (ws / "eval.py").write_text(EVAL_PY)
        (ws / "predict.py").write_text(PREDICT_PY)
        (ws / "score_base.py").write_text(SCORE_PY)
        (ws / "peek.py").write_text(PEEK_PY)
        (ws / "metric.py").write_text(METRIC_PY)
        (ws / "eval_metric.py").write_text(EVAL_METRIC_PY)
        git(ws, "add", "-A")
        git(ws, "commit", "-q", "-m", "base")
        kernel.enroll(ws, "--sleeps", "10", "--gpu-hours", "4", *flags)
        spaces[name] = ws
    kernel.start()
    e = Env(tmp, kernel, spaces)
    try:
        for name, (_, files) in all_cases.items():
            for rel, data in files.items():
                (spaces[name] / rel).parent.mkdir(parents=True, exist_ok=True)
                if isinstance(data, bytes):
                    (spaces[name] / rel).write_bytes(data)
                else:
                    (spaces[name] / rel).write_text(data)
            report = tmp / f"{name}.md"
            report.write_text(f"# {name}\n")
            e.tool(name, "submit", "--report", str(report))
            accepted = json.loads(e.tool(name, "sleep", "--json"))
            assert accepted["type"] == "accepted", accepted
            e.sleeps[name] = str(accepted["id"])
        yield e
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


@pytest.mark.parametrize("name", ["score-rewrite", "score-atexit", "score-base", "score-symlink"])
def test_with_a_score_stage_no_attack_makes_a_worse_candidate_improved(env: Env, name: str) -> None:
    v = env.wake(name)["verdict"]
    # the symlinked predictions dangle in the scorer's jail: nothing right at all
    worse = 0.0 if name == "score-symlink" else 0.2
    assert (v["outcome"], v["base_value"], v["candidate_value"], v["trusted"]) == (
        "not_improved",
        0.5,
        worse,
        True,
    ), v
    md = env.md(name)
    assert "## Submit verdict: not_improved\n" in md
    assert "Trusted:" in md


def unseen(v: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(u["side"], u["path"], u["why"]) for u in v["scorer_unseen"]}


def test_the_scorer_reads_a_copy_without_the_candidates_symlinks(env: Env) -> None:
    """The candidate's predictions.txt is a symlink to /proc/self/fd/3, which in the scorer's jail would be the
    scorer's own open labels (improved, trusted, on the old wrapper): the scorer's copy holds no symlink, so
    it finds no predictions; the wake names every path it did not see."""
    v = env.wake("score-fd")["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"], v["trusted"]) == (
        "not_improved",
        0.5,
        0.0,
        True,
    ), v
    links = {("candidate", "predictions.txt", "a symbolic link")}
    links |= {("candidate", f"fd{n}.txt", "a symbolic link") for n in range(4, 10)}
    assert unseen(v) == links
    assert v["scorer_unseen_count"] == 7
    md = env.md("score-fd")
    assert "Not seen by the operator's scorer: it reads a copy of each side's tree" in md
    assert "- candidate: 'predictions.txt' ('a symbolic link')" in md
    # the symlink to the labels' path (kernel.json shows it) is left out the same way
    assert unseen(env.wake("score-symlink")["verdict"]) == {
        ("candidate", "predictions.txt", "a symbolic link")
    }


def test_the_scorers_copy_leaves_out_fifos_sockets_and_links_but_keeps_hard_links_inside(env: Env) -> None:
    v = env.wake("score-specials")["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"]) == ("not_improved", 0.5, 0.2), v
    assert unseen(v) == {
        ("candidate", "pipe", "a FIFO (named pipe)"),
        ("candidate", "sock", "a socket"),
        ("candidate", "deep/fd3", "a symbolic link"),
    }
    # the base's tree after its command holds regular files and directories only
    assert not [u for u in v["scorer_unseen"] if u["side"] == "base"]


@pytest.mark.parametrize(
    ("name", "path", "why"),
    [
        ("protected-pyc", None, "a bytecode cache"),
        ("protected-package", "metric/__init__.py", "a package that shadows the protected metric.py"),
    ],
)
def test_with_metric_py_protected_nothing_the_candidate_ships_runs_in_its_place(
    env: Env, name: str, path: str | None, why: str
) -> None:
    """An unchecked-hash pyc of a forged metric.py in `__pycache__/` (Python loads it instead of the base's
    source), or a package `metric/` (found before metric.py): both are removed from the candidate's tree, so
    the base's metric.py measures the worse candidate; the wake says what was removed."""
    v = env.wake(name)["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"]) == ("not_improved", 0.5, 0.2), v
    assert v["protected_changed"] == []
    [removed] = v["shadows_removed"]
    assert (removed["side"], removed["why"]) == ("candidate", why)
    if path is None:
        assert re.fullmatch(r"__pycache__/metric\.[-\w]+\.pyc", removed["path"]), removed
    else:
        assert removed["path"] == path
    assert v["shadows_removed_count"] == 1
    assert "Removed from the trees before the runs, as they could run in place of a protected file" in env.md(
        name
    )


def test_with_the_eval_protected_its_rewrite_is_replaced_by_the_base_and_named(env: Env) -> None:
    v = env.wake("protected-rewrite")["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"]) == ("not_improved", 0.5, 0.2)
    assert v["protected_changed"] == ["eval.py"]
    assert "- 'eval.py'" in env.md("protected-rewrite")


def test_with_the_eval_protected_a_second_metric_line_fails_the_candidate(env: Env) -> None:
    v = env.wake("protected-atexit")["verdict"]
    assert (v["outcome"], v["failed_side"]) == ("failed", "candidate")
    assert "printed more than once" in v["reason"]


@pytest.mark.parametrize("name", ["neither-rewrite", "neither-atexit"])
def test_with_neither_the_attack_wins_but_the_verdict_says_self_reported(env: Env, name: str) -> None:
    v = env.wake(name)["verdict"]
    assert (v["outcome"], v["candidate_value"], v["trusted"]) == ("improved", 0.999, False)
    md = env.md(name)
    assert "## Submit verdict: improved (self-reported)" in md
    assert "Self-reported:" in md


def test_the_candidates_command_cannot_read_the_private_data_nor_get_the_seed(env: Env) -> None:
    wake = env.wake("peek")
    assert wake["verdict"]["outcome"] == "not_improved"
    out = next(t for t in wake["tasks"] if t["launch"] == "submit-candidate")["stdout_tail"]
    assert "cannot read labels.txt" in out
    assert "cannot read secret.txt" in out
    assert "False False" in out  # neither SCORE_DATA nor EVAL_SEED is in the command's environment
    assert SECRET not in json.dumps(wake)
    assert SECRET not in env.md("peek")


def test_the_scorer_cannot_write_the_tree_nor_see_the_candidates_processes(env: Env) -> None:
    wake = env.wake("jail-check")
    v = wake["verdict"]
    # every pair's scorer found the tree read-only, no `sleep` of the candidate, and its seed
    assert [(p["base"], p["candidate"]) for p in v["pairs"]] == [(1.0, 1.0)] * 3
    assert (v["outcome"], v["repeats"], v["test"], v["p_value"]) == ("not_improved", 3, "sign", 1.0)
    # three pairs, three private seeds, shown only as their commitment
    [(seeds, base_tree)] = env.plans("jail-check")
    assert len(set(seeds)) == 3
    assert v["seed_commitment"] == seed_commitment(seeds, base_tree)
    assert sorted((t["launch"], t["task"]) for t in wake["tasks"]) == [
        ("submit-base", 0),
        ("submit-base", 1),
        ("submit-base", 2),
        ("submit-candidate", 0),
        ("submit-candidate", 1),
        ("submit-candidate", 2),
    ]
    text = json.dumps(wake) + env.md("jail-check") + env.tool("jail-check", "history", "--json")
    for s in seeds:
        assert str(s) not in text


def test_the_agent_sees_the_contract_and_its_cost_before_paying(env: Env) -> None:
    for text in (env.tool("jail-check", "status"), env.tool("jail-check", "submit", "--help")):
        assert "Submit contract (set by the operator; you cannot change it):" in text
        assert 'command: "python3 predict.py"' in text
        assert "jail_check.py" in text
        assert 'metric: "score", higher is better.' in text
        assert "floors: none" in text
        assert "repeats: 3 pairs" in text
        assert "an exact one-sided sign test at confidence 0.85 must pass: at least 3 of the 3 pairs" in text
        assert "trusted: yes" in text
        assert "cost of one submit: 1 sleep" in text
        assert "6 runs of up to 30 minutes on 0 GPUs each, 0 GPU-hours reserved" in text
    protected = env.tool("protected-rewrite", "submit", "--help")
    assert (
        'protected (taken from the base commit on both sides, whatever your tree holds): "eval.py".'
        in protected
    )
    assert "trusted: no" in protected
    info = json.loads((env.spaces["neither-rewrite"] / ".syscall" / "kernel.json").read_text())
    assert info["submit_trusted"] is False
    assert "trusted: no" in env.tool("neither-rewrite", "status")


def test_the_operator_is_warned_of_a_self_reported_contract(env: Env) -> None:
    status = env.kernel.cli("status").stdout
    lines = status.splitlines()
    warned = {
        name
        for name, ws in env.spaces.items()
        for i, line in enumerate(lines)
        if line.startswith(f"- {workspace_key(ws.resolve())} ")
        and any("print its own metric" in x for x in lines[i + 1 : i + 4])
    }
    assert warned == {
        "protected-rewrite",
        "protected-atexit",
        "protected-pyc",
        "protected-package",
        "neither-rewrite",
        "neither-atexit",
    }
    again = env.kernel.cli("enroll", str(env.spaces["neither-rewrite"])).stdout
    assert "warning: the eval contract lets the candidate print its own metric" in again
    assert "print its own metric" not in env.kernel.cli("enroll", str(env.spaces["jail-check"])).stdout


@pytest.mark.slurm
def test_the_score_stage_and_repeats_on_slurm(
    tmp_path: Path, slurm_conf: Path, bwrap_available: None
) -> None:
    private = tmp_path / "private"
    private.mkdir()
    (private / "labels.txt").write_text(LABELS)
    (private / "score.py").write_text(SCORE_PY)
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    (ws / "model.py").write_text(MODEL.format(n=5))
    (ws / "predict.py").write_text(PREDICT_PY)
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "base")
    kernel = Kernel(tmp_path, 'backend = "slurm"\njail = "bwrap"\n[slurm]\npoll_seconds = 1.0\n')
    kernel.enroll(ws, *score_flags(private), "--repeats", "3", "--confidence", "0.85")
    e = Env(tmp_path, kernel, {"ws": ws})
    try:
        kernel.start(env={"SLURM_CONF": str(slurm_conf)})
        (ws / "model.py").write_text(ATEXIT_MODEL)
        report = tmp_path / "r.md"
        report.write_text("atexit on slurm\n")
        e.tool("ws", "submit", "--report", str(report))
        e.sleeps["ws"] = json.loads(e.tool("ws", "sleep", "--json"))["id"]
        wake = e.wake("ws")
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    v = wake["verdict"]
    assert (v["outcome"], v["trusted"], v["repeats"]) == ("not_improved", True, 3)
    assert [(p["base"], p["candidate"]) for p in v["pairs"]] == [(0.5, 0.2)] * 3
    assert all(t["job_id"] for t in wake["tasks"])


def test_private_data_inside_a_directory_the_jail_binds_stays_out_of_the_commands_sight(
    tmp_path: Path, bwrap_available: None
) -> None:
    site = (
        tmp_path / "site"
    )  # an operator's extra read-only directory (a conda, modules), bound into every jail
    private = site / "private"
    private.mkdir(parents=True)
    (private / "labels.txt").write_text(LABELS)
    (private / "secret.txt").write_text(SECRET + "\n")
    (private / "score.py").write_text(SCORE_PY)
    (site / "visible.txt").write_text("the rest of the site is there\n")
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    (ws / "model.py").write_text(MODEL.format(n=5))
    (ws / "peek.py").write_text(PEEK_PY + f"print(open({str(site / 'visible.txt')!r}).read())\n")
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "base")
    kernel = Kernel(
        tmp_path,
        f'jail = "bwrap"\n[local]\nseconds_per_minute = 1.0\n[environment]\nextra_dirs = ["{site}"]\n',
    )
    flags = score_flags(private)
    kernel.enroll(ws, flags[0], f"PEEK={private} python3 peek.py", *flags[2:])
    e = Env(tmp_path, kernel, {"ws": ws})
    try:
        kernel.start()
        (ws / "model.py").write_text(MODEL.format(n=6))
        report = tmp_path / "r.md"
        report.write_text("peek\n")
        e.tool("ws", "submit", "--report", str(report))
        e.sleeps["ws"] = json.loads(e.tool("ws", "sleep", "--json"))["id"]
        wake = e.wake("ws")
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    v = wake["verdict"]
    assert (v["outcome"], v["base_value"], v["candidate_value"], v["trusted"]) == ("improved", 0.5, 0.6, True)
    out = next(t for t in wake["tasks"] if t["launch"] == "submit-candidate")["stdout_tail"]
    assert "cannot read labels.txt" in out
    assert "cannot read secret.txt" in out
    assert (
        "the rest of the site is there" in out
    )  # the directory itself is bound; only the private data is masked
    assert SECRET not in json.dumps(wake)
