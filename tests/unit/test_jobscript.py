"""The job script writer and the wrapper's pure pieces; artifact copy-out on real directories."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from pathlib import Path

import pytest

from channel.paths import RunPaths
from kernel.backends import jobscript
from kernel.backends.base import JobSpec
from kernel.node import wrapper as W
from kernel.node.jail import JailPolicy


def _spec(tmp_path: Path, **kw: object) -> JobSpec:
    base: dict[str, object] = {
        "workspace": "ws-0123456789",
        "workspace_path": str(tmp_path / "ws"),
        "seq": 7,
        "launch": "train",
        "run_dir": str(tmp_path / "runs"),
        "command": "python train.py --lr 3e-4",
        "commit": "a" * 40,
        "tree": "b" * 40,
        "minutes": 5,
        "artifacts": ("out/curve.json",),
    }
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def _embedded(script: str) -> dict[str, object]:
    for node in ast.parse(script).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "CONFIG_JSON":
            assert isinstance(node.value, ast.Constant)
            assert isinstance(node.value.value, str)
            return json.loads(node.value.value)  # type: ignore[no-any-return]
    raise AssertionError("no CONFIG_JSON in the rendered script")


def test_rendered_script_is_python_with_the_config_embedded(tmp_path: Path) -> None:
    spec = _spec(tmp_path, array=4, eval_seeds=(1234, 5678), jail=JailPolicy(hide=("/opt/state",)))
    script = jobscript.render_job_script(spec)
    assert script.startswith("#!/usr/bin/env python3\n")
    compile(script, "job.sh", "exec")
    cfg = _embedded(script)
    assert cfg["launch_dir"] == str(spec.paths.launch_dir)
    assert cfg["array"] == 4
    assert cfg["artifacts"] == ["out/curve.json"]
    assert cfg["seeds"] == [1234, 5678]  # task i's EVAL_SEED, set by the wrapper
    assert cfg["seed_to_command"] is True
    assert cfg["score"] is None
    assert "EVAL_SEED" not in cfg["env"]  # type: ignore[operator]
    git = cfg["git"]
    assert isinstance(git, dict)
    assert git["commit"] == "a" * 40
    assert git["tree"] == "b" * 40
    assert git["env"]["GIT_CONFIG_GLOBAL"] == "/dev/null"
    assert "HOME" not in git["env"]
    assert jobscript.CONFIG_LINE not in script


def test_hostile_command_text_never_reaches_the_script(tmp_path: Path) -> None:
    spec = _spec(tmp_path, command="'''; import os; os.system('x') #\"\"\"")
    script = jobscript.render_job_script(spec)
    assert "import os; os.system" not in script  # the command is read from command.txt at run time
    compile(script, "job.sh", "exec")


def test_render_refuses_a_template_without_exactly_one_marker(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exactly one"):
        jobscript.render_job_script(_spec(tmp_path), source="print('no marker')\n")


def test_write_launch_creates_command_and_executable_job_script(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    job = jobscript.write_launch(spec)
    assert job == spec.paths.launch_dir / "job.sh"
    assert os.access(job, os.X_OK)
    assert (spec.paths.launch_dir / "command.txt").read_text() == spec.command
    assert jobscript.write_launch(spec) == job  # idempotent


@pytest.mark.parametrize(
    ("environ", "array", "want"),
    [
        ({}, 1, 0),
        ({"SWEEP_INDEX": "2"}, 4, 2),
        ({"SLURM_ARRAY_TASK_ID": "3", "SWEEP_INDEX": "1"}, 4, 3),
    ],
)
def test_task_index_comes_from_slurm_or_sweep_index(environ: dict[str, str], array: int, want: int) -> None:
    assert W.task_index(array, environ) == want


@pytest.mark.parametrize(
    ("environ", "array"), [({}, 2), ({"SWEEP_INDEX": "4"}, 4), ({"SWEEP_INDEX": "-1"}, 4)]
)
def test_a_missing_or_out_of_range_index_is_a_wrapper_error(environ: dict[str, str], array: int) -> None:
    with pytest.raises(W.WrapperError) as err:
        W.task_index(array, environ)
    assert err.value.code == W.EXIT_WRAPPER_ERROR


@pytest.mark.parametrize(("task", "array"), [(0, 1), (0, 3), (2, 3)])
def test_wrapper_task_dirs_match_run_paths(tmp_path: Path, task: int, array: int) -> None:
    paths = RunPaths(tmp_path, "ws", 3, "sweep")
    assert W.task_dir_for(str(paths.launch_dir), task, array) == str(paths.task_dir(task, array))


def test_exit_codes_are_distinct_and_outside_the_signal_range() -> None:
    codes = [
        jobscript.EXIT_EMPTY_COMMAND,
        jobscript.EXIT_MATERIALISE_FAILED,
        jobscript.EXIT_TERMINATED,
        jobscript.EXIT_TIMEOUT,
        jobscript.EXIT_WRAPPER_ERROR,
        jobscript.EXIT_LOST,
    ]
    assert len(set(codes)) == len(codes)
    assert all(0 < c < 128 for c in codes)


@pytest.mark.parametrize(
    ("path", "ok"),
    [(b"a/b.py", True), (b"../x", False), (b"a//b", False), (b".git/config", False), (b"a/.GIT/x", False)],
)
def test_unsafe_tree_paths_are_refused(path: bytes, ok: bool) -> None:
    assert W.valid_tree_path(path) is ok


# --- artifact copy-out on real directories -----------------------------------------------------------------


def _copy(
    tree: Path, out: Path, declared: list[str], max_bytes: int = 1000, total: int = 10_000
) -> dict[str, dict]:  # type: ignore[type-arg]
    log = out.parent / "artifacts.log"
    W.copy_artifacts(str(tree), declared, str(out), str(log), max_bytes, total)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["path"] for x in lines] == declared, "one log line per declared artifact, in order"
    return {x["path"]: x for x in lines}


def test_artifacts_copied_with_size_and_sha256(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "out").mkdir(parents=True)
    (tree / "out" / "curve.json").write_text('{"loss": 1}')
    got = _copy(tree, tmp_path / "task" / "artifacts", ["out/curve.json"])
    data = (tmp_path / "task" / "artifacts" / "out" / "curve.json").read_bytes()
    assert data == b'{"loss": 1}'
    assert got["out/curve.json"] == {
        "path": "out/curve.json",
        "status": "copied",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_hostile_artifacts_are_skipped_with_reasons(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "key").write_text("s3cret")
    (tree / "passwd").symlink_to("/etc/passwd")
    (tree / "dirlink").symlink_to(outside)
    (tree / "adir").mkdir()
    os.mkfifo(tree / "fifo")
    (tree / "big").write_bytes(b"x" * 1001)
    (tree / "inner").write_text("ok")
    (tree / "good-link").symlink_to("inner")
    declared = ["passwd", "dirlink/key", "adir", "fifo", "big", "missing", "../secret/key", "good-link"]
    got = _copy(tree, tmp_path / "task" / "artifacts", declared)
    assert "outside" in got["passwd"]["reason"]
    assert "outside" in got["dirlink/key"]["reason"]
    assert got["adir"]["reason"].startswith("is a directory; artifacts are single files")
    assert got["fifo"]["reason"] == "not a regular file"
    assert "larger than the artifact cap of 1000" in got["big"]["reason"]
    assert got["missing"]["reason"] == "not found in the job's tree"
    assert ".." in got["../secret/key"]["reason"]
    assert got["good-link"]["status"] == "copied"  # a symlink that stays inside the tree is fine
    copied = sorted(p.name for p in (tmp_path / "task" / "artifacts").rglob("*"))
    assert copied == ["good-link"]
    assert all(x["status"] == "skipped" for k, x in got.items() if k != "good-link")


def test_the_total_artifact_cap_holds_across_files(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("a", "b", "c"):
        (tree / name).write_bytes(b"y" * 400)
    got = _copy(tree, tmp_path / "task" / "artifacts", ["a", "b", "c"], max_bytes=1000, total=1000)
    assert [got[n]["status"] for n in "abc"] == ["copied", "copied", "skipped"]
    assert "total artifact cap" in got["c"]["reason"]


def test_exit_record_round_trip(tmp_path: Path) -> None:
    assert jobscript.read_exit(tmp_path) is None
    rec = jobscript.ExitRecord(jobscript.EXIT_LOST, jobscript.KIND_LOST, detail="gone")
    jobscript.write_exit(tmp_path, rec)
    assert jobscript.read_exit(tmp_path) == rec
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_the_run_dir_and_workspace_are_masked_when_below_a_bound_dir(tmp_path: Path) -> None:
    spec = _spec(tmp_path, run_dir="/opt/syscall/runs", workspace_path="/usr/local/agents/ws1")
    argv = _embedded(jobscript.render_job_script(spec))["jail"]["argv"]  # type: ignore[index]
    tmpfs = [argv[i + 1] for i, a in enumerate(argv) if a == "--tmpfs"]
    assert "/opt/syscall/runs" in tmpfs
    assert "/usr/local/agents/ws1" in tmpfs


def test_private_score_data_below_a_bound_directory_is_masked_from_the_command_only(tmp_path: Path) -> None:
    from kernel.backends.base import ScoreStage

    policy = JailPolicy(ro_dirs=("/srv/env",))
    for data in ("/opt/private/labels", "/srv/env/private"):
        spec = _spec(tmp_path, jail=policy, score=ScoreStage(command="python3 s.py", data=data))
        cfg = _embedded(jobscript.render_job_script(spec))
        command = cfg["jail"]["argv"]  # type: ignore[index]
        i = command.index(data)
        assert command[i - 1] == "--tmpfs", command  # the command's jail mounts an empty tmpfs over it
        assert data not in command[i + 1 :]
        score = cfg["score"]["argv"]  # type: ignore[index]
        masked = score.index(data)
        assert score[masked - 1] == "--tmpfs"
        bound = score.index(data, masked + 1)  # ...and the score's jail binds the data on top, read-only
        assert score[bound - 1 : bound + 2] == ["--ro-bind", data, "@@SYSCALL_SCORE_DATA@@"]
        assert cfg["score"]["env"]["SCORE_DATA"] == "@@SYSCALL_SCORE_DATA@@"  # type: ignore[index]


def _run_bpf(program: bytes, arch: int, nr: int) -> int:
    """A classic-BPF interpreter for the instructions a seccomp filter here uses (ld abs, jeq k, ret k)."""
    import struct

    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    data = struct.pack("=iI", nr, arch) + bytes(56)
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x15:
            pc += jt if acc == k else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
        pc += 1


def test_the_tree_limits_seccomp_filter_refuses_fallocate_only() -> None:
    import errno

    prog = W.no_fallocate_filter()
    deny, allow = 0x00050000 | errno.EOPNOTSUPP, 0x7FFF0000
    for arch, numbers in W.FALLOCATE_SYSCALLS.items():
        for nr in numbers:
            assert _run_bpf(prog, arch, nr) == deny, (hex(arch), nr)
        assert _run_bpf(prog, arch, 1) == allow  # write(2) on x86_64, and some call on the others
    assert _run_bpf(prog, 0xC000003E, 47) == allow  # aarch64's fallocate number is another call on x86_64
    assert _run_bpf(prog, 0x12345678, 285) == allow  # an unknown architecture is not second-guessed


def test_an_exit_record_cut_short_is_a_wrapper_failure_not_an_exception(tmp_path: Path) -> None:
    (tmp_path / RunPaths.EXIT_CODE).write_bytes(b'{"code": 0, "ki')
    rec = jobscript.read_exit(tmp_path)
    assert rec is not None
    assert (rec.code, rec.kind) == (jobscript.EXIT_WRAPPER_ERROR, "wrapper_error")
    assert "the exit-code record is not valid (15 bytes)" in (rec.detail or "")


def test_a_record_is_written_into_its_reserve_in_place(tmp_path: Path) -> None:
    W.reserve_record(str(tmp_path))
    reserve = tmp_path / W.RESERVE
    assert reserve.stat().st_blocks * 512 >= W.RESERVE_BYTES
    W.write_record(str(tmp_path), "exit-code", b'{"code": 0, "kind": "exited"}\n')
    assert not reserve.exists()
    assert (tmp_path / "exit-code").read_bytes() == b'{"code": 0, "kind": "exited"}\n'
    assert oct((tmp_path / "exit-code").stat().st_mode & 0o777) == "0o644"
    W.write_record(str(tmp_path), "exit-code", b"again\n")  # no reserve left: an ordinary atomic write
    assert (tmp_path / "exit-code").read_bytes() == b"again\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit-code"]


def test_the_tree_limit_reaches_the_wrapper(tmp_path: Path) -> None:
    spec = _spec(tmp_path, jail=JailPolicy(kind="bwrap", tree_mb=2048))
    assert jobscript.wrapper_config(spec)["limits"] == {
        "mem_mb": 0,
        "max_procs": 0,
        "tree_mb": 2048,
        "cpus": 0,
    }
