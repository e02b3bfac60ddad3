"""The trusted-scoring parts of the eval contract: config keys and enroll flags, protected-path matching, the
score stage's jail, and when a verdict counts as trusted."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from channel.messages import EvalContract
from kernel.core.config import ConfigError, load, score_data_problem
from kernel.core.evaluate import EvalRun, MetricError, contract_problem, is_trusted, measure
from kernel.node import jail as J
from kernel.node.wrapper import is_protected, protected_match, render_argv, shadowing

BASE = "[defaults.submit]\ncommand = 'python3 predict.py'\nmetric = 'acc'\n"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("repeats = 0", "key 'defaults.submit.repeats'"),
        ("repeats = 17", "key 'defaults.submit.repeats'"),
        ("confidence = 1.0", "key 'defaults.submit.confidence'"),
        ("test = 't'", "key 'defaults.submit.test'"),
        ("protected = ['/etc/passwd']", "key 'defaults.submit.protected"),
        ("protected = ['a/../b']", "key 'defaults.submit.protected"),
        ("score_from = 'candidate'", "key 'defaults.submit.score_from'"),
        ("score_data = 'relative/dir'", "key 'defaults.submit.score_data'"),
        ("score_data = '/data'", "key 'defaults.submit.score_data': private score data needs a `score`"),
        ("score_from = 'base'", "key 'defaults.submit.score_from': \"base\" names where"),
        (
            "score = 'python3 /s.py'\nscore_data = '/no/such/dir'",
            "'/no/such/dir' is not an existing directory",
        ),
        ("score = ' '", "key 'defaults.submit.score': the score command is empty"),
        (
            "score = 'python3 /srv/p/s.py'\nscore_data = '/srv/p'",
            "key 'defaults.submit.score': name the private",
        ),
    ],
)
def test_a_bad_trusted_contract_is_refused_at_config_load_with_the_key_named(
    tmp_path: Path, extra: str, needle: str
) -> None:
    f = tmp_path / "k.toml"
    f.write_text(BASE + extra + "\n")
    with pytest.raises(ConfigError) as info:
        load(f, env={})
    assert needle in str(info.value)


def test_a_good_trusted_contract_loads(tmp_path: Path) -> None:
    data = tmp_path / "private"
    data.mkdir()
    f = tmp_path / "k.toml"
    f.write_text(
        BASE
        + f"score = 'python3 $SCORE_DATA/score.py'\nscore_data = '{data}'\nprotected = ['eval.py', 'data/val/**']\n"
        "repeats = 9\nconfidence = 0.9\ntest = 'bootstrap'\n"
    )
    c = load(f, env={}).defaults.submit
    assert c is not None
    assert (c.repeats, c.confidence, c.test, c.protected) == (9, 0.9, "bootstrap", ("eval.py", "data/val/**"))


def test_private_data_inside_the_workspace_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ws" / "labels").mkdir(parents=True)
    c = EvalContract(command="x", metric="m", score="s", score_data=str(tmp_path / "ws" / "labels"))
    problem = score_data_problem(c, str(tmp_path / "ws"))
    assert problem is not None
    assert problem[0] == "score_data"
    assert "outside every workspace" in problem[1]
    holding = EvalContract(command="x", metric="m", score="s", score_data=str(tmp_path))
    assert score_data_problem(holding, str(tmp_path / "ws")) is not None
    assert contract_problem(EvalContract(command="x", metric="m", score="s", score_data="/")) is not None


@pytest.mark.parametrize(
    ("pattern", "path", "covered"),
    [
        ("eval.py", "eval.py", True),
        ("eval.py", "sub/eval.py", False),
        ("data/val", "data/val/x.csv", True),
        ("data/val/**", "data/val/a/b.csv", True),
        ("data/val/**", "data/valx/a", False),
        ("*.py", "a.py", True),
        ("*.py", "pkg/a.py", False),
        ("**/*.py", "pkg/sub/a.py", True),
        ("**", "anything/at/all", True),
        ("ev?l.py", "eval.py", True),
    ],
)
def test_protected_patterns(pattern: str, path: str, covered: bool) -> None:
    assert protected_match(pattern, path) is covered
    assert is_protected(["nothing", pattern], path) is covered


def test_trusted_only_with_a_score_stage_or_the_whole_tree_protected_in_a_real_jail() -> None:
    plain = EvalContract(command="python3 eval.py", metric="m")
    assert not is_trusted(plain, "bwrap")
    assert not is_trusted(EvalContract(command="c", metric="m", protected=("eval.py",)), "bwrap")
    assert is_trusted(EvalContract(command="c", metric="m", protected=("**",)), "bwrap")
    scored = EvalContract(command="c", metric="m", score="python3 /s/score.py")
    assert is_trusted(scored, "bwrap")
    assert is_trusted(scored, "apptainer")
    assert not is_trusted(scored, "none")


def test_with_a_score_stage_only_its_stdout_counts() -> None:
    c = EvalContract(command="c", metric="m", score="s")
    run = EvalRun(exit_code=0, stdout='{"m": 0.999}\n', score_code=0, score_stdout='{"m": 0.2}\n')
    assert str(measure(run, c)) == "0.2"
    with pytest.raises(MetricError, match="score command exited with code 3"):
        measure(EvalRun(exit_code=0, stdout="", score_code=3, score_stdout=""), c)
    with pytest.raises(MetricError, match="did not run"):
        measure(EvalRun(exit_code=0, stdout='{"m": 1}'), c)
    with pytest.raises(MetricError, match="exited with code 1"):  # the command's failure comes first
        measure(EvalRun(exit_code=1, stdout="", score_code=0, score_stdout='{"m": 1}'), c)


def test_with_protected_files_a_metric_printed_twice_fails() -> None:
    c = EvalContract(command="c", metric="m", protected=("eval.py",))
    with pytest.raises(MetricError, match="more than once"):
        measure(EvalRun(exit_code=0, stdout='{"m": 0.2}\n{"m": 0.999}\n'), c)
    assert str(measure(EvalRun(exit_code=0, stdout='{"m": 0.2}\n{"loss": 1}\n'), c)) == "0.2"
    # without protection the last line wins, as before (and the verdict is self-reported)
    plain = EvalContract(command="c", metric="m")
    assert str(measure(EvalRun(exit_code=0, stdout='{"m": 0.2}\n{"m": 0.999}\n'), plain)) == "0.999"


def test_the_score_jail_has_no_network_a_read_only_tree_and_its_cwd_in_the_scorer() -> None:
    policy = J.JailPolicy(network=True, hide=("/opt/state",))
    argv = J.score_template_argv(policy, data="/srv/private")
    filled = render_argv(
        argv, "bwrap", "/s/tree", "/s/home", "/s/work", {"A": "1"}, "python3 x.py", "/s/scorer"
    )
    joined = " ".join(filled)
    assert "--unshare-net" in filled  # even when the workspace's jobs may use the network
    assert "--ro-bind /s/tree /s/tree" in joined
    assert "--bind /s/tree" not in joined.replace("--ro-bind /s/tree", "")
    assert f"--ro-bind /srv/private {J.SCORE_DATA_TOKEN}" in joined  # mounted where the wrapper draws
    drawn = render_argv(argv, "bwrap", "/t", "/h", "/w", {}, "c", "/s", score_data="/score-data-ab12")
    assert drawn[drawn.index("/srv/private") + 1] == "/score-data-ab12"
    assert "--ro-bind /s/scorer /s/scorer" in joined
    assert filled[filled.index("--chdir") + 1] == "/s/scorer"
    assert filled[-3:] == ["sh", "-c", "python3 x.py"]
    assert "--tmpfs /opt/state" in joined
    assert "--proc" not in filled  # no /proc/self/fd/N reaches the scorer's own open files
    assert "/proc" not in joined
    app = J.score_template_argv(J.JailPolicy(kind="apptainer", image="/i.sif"), data=None)
    filled = render_argv(
        app, "apptainer", "/s/tree", "/s/home", "/s/work", {}, "c", "/s/scorer", score_data="/d"
    )
    assert "/s/tree:/s/tree:ro" in filled
    assert "/s/scorer:/s/scorer:ro" in filled
    assert filled[filled.index("--network") + 1] == "none"


OLD_VERDICT = (
    b'{"outcome":"improved","metric":"score","direction":"higher","base_value":0.5,"candidate_value":0.9,'
    b'"delta":0.4,"seed":211611861,"baseline_reused":false,"base_commit":"b","candidate_commit":"c"}'
)


def test_a_verdict_stored_by_an_older_kernel_with_its_seed_still_reads_without_it() -> None:
    from kernel.core.records import SleepRow
    from kernel.core.rules import history_answer
    from kernel.io.submit import stored_verdict

    v = stored_verdict(OLD_VERDICT)
    assert (v.outcome, v.candidate_value, v.trusted) == ("improved", 0.9, False)
    assert b"211611861" not in msgspec.json.encode(v)
    row = SleepRow("w", 1, "s1", "woken", "", b"{}", "2026-11-30T12:00:00.000Z", None, OLD_VERDICT)
    entry = history_answer("h1", [(row, [])]).sleeps[0]
    assert entry.verdict == "improved"
    with pytest.raises(msgspec.ValidationError):
        stored_verdict(OLD_VERDICT.replace(b'"seed":211611861', b'"surprise":1'))


def test_with_protected_paths_what_could_run_in_place_of_a_protected_file_is_named() -> None:
    base = ["metric.py", "eval.py", "lib/util.py", "pkg/__init__.py", "README.md"]
    side = [
        "metric.py",
        "__pycache__/metric.cpython-311.pyc",
        "lib/__pycache__/util.cpython-311.pyc",
        "old.pyc",
        "deps.PTH",
        "sitecustomize.py",
        "lib/usercustomize.py",
        "metric/__init__.py",
        "metric.cpython-311-x86_64-linux-gnu.so",
        "metric.pyd",
        "lib/util/core.py",
        "eval/notes.md",  # eval.py is not protected: its package is not touched
        "metric.pyi",
        "metricx/__init__.py",
        "lib/util",  # a symlink to a directory would be a package
        "model.py",
        "pkg/__pycache__/x.pyc",  # protected itself (pkg/**): from the base, not removed
    ]
    got = dict(shadowing(["metric.py", "lib/util.py", "pkg"], base, side))
    assert got == {
        "__pycache__/metric.cpython-311.pyc": "a bytecode cache",
        "lib/__pycache__/util.cpython-311.pyc": "a bytecode cache",
        "old.pyc": "a bytecode cache",
        "deps.PTH": "an interpreter hook",
        "sitecustomize.py": "an interpreter hook",
        "lib/usercustomize.py": "an interpreter hook",
        "metric/__init__.py": "a package that shadows the protected metric.py",
        "metric.cpython-311-x86_64-linux-gnu.so": "an extension module that shadows the protected metric.py",
        "metric.pyd": "an extension module that shadows the protected metric.py",
        "lib/util/core.py": "a package that shadows the protected lib/util.py",
        "lib/util": "a package that shadows the protected lib/util.py",
    }
    # with nothing protected no module is shadowed: only the caches and hooks go (a side's own pyc included)
    assert set(dict(shadowing([], base, side)).values()) == {"a bytecode cache", "an interpreter hook"}
    assert "pkg/__pycache__/x.pyc" in dict(shadowing([], base, side))
