"""Pure parts of locked environments: which lockfiles the kernel accepts, the cache key, the config keys, what
a task's wrapper is told, and how its environment and memory failures are reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel.backends import jobscript
from kernel.backends.base import JobSpec
from kernel.core.config import ConfigError, parse
from kernel.io import envcache as E
from kernel.node import jail as J
from kernel.node import wrapper as W
from kernel.service import gather

REGISTRY = """\
version = 1
requires-python = ">=3.8"

[[package]]
name = "demo"
version = "0.1.0"
source = { virtual = "." }
dependencies = [{ name = "six" }]

[[package]]
name = "six"
version = "1.16.0"
source = { registry = "https://pypi.org/simple" }
wheels = [{ url = "https://files.pythonhosted.org/six-1.16.0-py2.py3-none-any.whl", hash = "sha256:00" }]
"""


def test_a_registry_only_lock_is_accepted() -> None:
    assert E.lock_problem(REGISTRY.encode()) is None


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ('{ path = "/etc/secret.whl" }', "path"),
        ('{ directory = "../other-workspace" }', "directory"),
        ('{ git = "https://example.invalid/x.git?rev=1#abc" }', "git"),
        ('{ url = "https://example.invalid/x.whl" }', "url"),
        ('{ editable = "libs/sub" }', "editable"),
        ('{ virtual = "libs/sub" }', "virtual"),
    ],
)
def test_any_other_source_is_refused_by_name(source: str, kind: str) -> None:
    lock = REGISTRY.replace('source = { registry = "https://pypi.org/simple" }', f"source = {source}")
    problem = E.lock_problem(lock.encode())
    assert problem is not None
    assert "'six'" in problem
    assert kind in problem
    assert "package index" in problem


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        ('registry = "https://pypi.org/simple"', 'registry = "https://evil.invalid/simple"', "index"),
        ("https://files.pythonhosted.org/six", "https://169.254.169.254/six", "files must come from"),
        ("https://files.pythonhosted.org/six", "http://files.pythonhosted.org/six", "files must come from"),
    ],
)
def test_only_the_configured_index_and_its_file_host_are_fetched(old: str, new: str, why: str) -> None:
    lock = REGISTRY.replace(old, new)
    problem = E.lock_problem(lock.encode())
    assert problem is not None
    assert why in problem
    # A site mirror: its own host is the one allowed.
    mirror = REGISTRY.replace("https://pypi.org/simple", "https://mirror.example/simple").replace(
        "files.pythonhosted.org", "mirror.example"
    )
    assert E.lock_problem(mirror.encode(), "https://mirror.example/simple/") is None
    assert E.lock_problem(mirror.encode()) is not None


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\xff\xfe", "UTF-8"),
        (b"version = [", "TOML"),
        (b"package = 3", "[[package]]"),
        (b"[[package]]\nname='x'\n", "source"),
    ],
)
def test_a_lock_that_is_not_a_lock_is_refused(data: bytes, why: str) -> None:
    problem = E.lock_problem(data)
    assert problem is not None
    assert why in problem


def test_the_cache_key_follows_lock_pyproject_interpreter_index_and_uv() -> None:
    p = E.LockedProject(pyproject=b"[project]\n", lock=REGISTRY.encode())
    base = E.cache_key(p, "/usr/bin/python3", "", "uv 0.9")
    assert base == E.cache_key(
        E.LockedProject(pyproject=b"[project]\n", lock=REGISTRY.encode()), "/usr/bin/python3", "", "uv 0.9"
    )
    others = {
        E.cache_key(
            E.LockedProject(pyproject=b"[project]\n", lock=REGISTRY.encode() + b"\n"),
            "/usr/bin/python3",
            "",
            "uv 0.9",
        ),
        E.cache_key(
            E.LockedProject(pyproject=b"[project] \n", lock=REGISTRY.encode()),
            "/usr/bin/python3",
            "",
            "uv 0.9",
        ),
        E.cache_key(p, "3.12", "", "uv 0.9"),
        E.cache_key(p, "/usr/bin/python3", "https://mirror.invalid/simple", "uv 0.9"),
        E.cache_key(p, "/usr/bin/python3", "", "uv 0.10"),
    }
    assert base not in others
    assert len(others) == 5


def test_installed_packages_are_read_from_dist_info(tmp_path: Path) -> None:
    sp = tmp_path / "lib" / "python3.11" / "site-packages"
    for d in ("six-1.16.0.dist-info", "typing_extensions-4.1.0.dist-info", "six.py"):
        (sp / d).mkdir(parents=True)
    (tmp_path / "pyvenv.cfg").write_text("home = /usr/bin\nversion_info = 3.11.2\n")
    assert E.site_packages(tmp_path) == [("six", "1.16.0"), ("typing-extensions", "4.1.0")]
    assert E.venv_python_version(tmp_path) == "3.11.2"


def test_uv_gets_no_kernel_variable() -> None:
    env = E.uv_env({"AWS_SECRET_ACCESS_KEY": "x", "HTTPS_PROXY": "http://proxy:3128"}, home="/h", cache="/c")
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert env["HTTPS_PROXY"] == "http://proxy:3128"
    assert env["UV_NO_CONFIG"] == "1"
    argv = E.sync_argv("uv", "/p", "/usr/bin/python3", offline=True)
    for flag in ("--frozen", "--no-build", "--no-install-project", "--no-config", "--offline"):
        assert flag in argv


def test_the_environment_config_keys() -> None:
    cfg = parse(
        '[environment]\nmode = "none"\npython = "3.12"\nextra_dirs = ["/opt/conda/bin"]\nkeep_days = 3\n'
    )
    assert (cfg.environment.mode, cfg.environment.python, cfg.environment.extra_dirs) == (
        "none",
        "3.12",
        ("/opt/conda/bin",),
    )
    assert parse("").environment.mode == "uv"
    with pytest.raises(ConfigError, match=r"environment\.extra_dirs\.0"):
        parse('[environment]\nextra_dirs = ["relative/bin"]\n')
    with pytest.raises(ConfigError, match=r"environment\.python"):
        parse('[environment]\npython = "bin/python"\n')
    with pytest.raises(ConfigError, match=r"environment\.mode"):
        parse('[environment]\nmode = "conda"\n')
    with pytest.raises(ConfigError, match=r"local\.mem_mb"):
        parse("[local]\nmem_mb = -1\n")


def _spec(**kw: object) -> JobSpec:
    base: dict[str, object] = {
        "workspace": "ws-1",
        "workspace_path": "/w",
        "seq": 3,
        "launch": "train",
        "run_dir": "/runs",
        "command": "python t.py",
        "commit": "c" * 40,
        "tree": "t" * 40,
        "minutes": 5,
        "sleep_id": "1764460800000-3fa9c2d1",
    }
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def test_the_wrapper_is_told_the_job_variables_environment_gpus_and_limits() -> None:
    envspec = J.JobEnvironment(
        uv="/k/uv", cache="/runs/envs/k/uv", project="/runs/envs/k/project", python="/usr/bin/python3"
    )
    spec = _spec(
        environment=envspec, gpus=2, jail=J.JailPolicy(mem_mb=512, max_procs=100), path_dirs=("/opt/site",)
    )
    cfg = jobscript.wrapper_config(spec)
    env = cfg["env"]
    assert isinstance(env, dict)
    assert env["SYSCALL_LAUNCH"] == "train"
    assert env["SYSCALL_SLEEP"] == "1764460800000-3fa9c2d1"
    assert env["SYSCALL_SNAPSHOT"] == "c" * 40
    assert env["PATH"].startswith(J.VENV_TOKEN + "/bin:/opt/site:")
    assert cfg["index_vars"] == ["SWEEP_INDEX", "SLURM_ARRAY_TASK_ID", "SYSCALL_TASK"]
    assert cfg["environment"] == {
        "uv": "/k/uv",
        "cache": "/runs/envs/k/uv",
        "project": "/runs/envs/k/project",
        "python": "/usr/bin/python3",
        "python_install_dir": None,
        "lock_sha256": "",
    }
    assert cfg["gpu"] == {"count": 2, "constrained": False}
    assert cfg["limits"] == {"mem_mb": 512, "max_procs": 100, "tree_mb": 0}
    assert cfg["forward_vars"] == ["CUDA_VISIBLE_DEVICES"]
    argv = cfg["jail"]["argv"]  # type: ignore[index]
    assert argv[argv.index("--ro-bind") + 1 : argv.index("--ro-bind") + 3] == [J.VENV_TOKEN, J.VENV_TOKEN]
    assert J.GPU_TOKEN in argv
    # Without GPUs the node's GPU list is not forwarded and no device is bound.
    plain = jobscript.wrapper_config(_spec())
    assert plain["forward_vars"] == []
    assert J.GPU_TOKEN not in plain["jail"]["argv"]  # type: ignore[index]
    assert plain["environment"] is None
    assert "VIRTUAL_ENV" not in plain["env"]  # type: ignore[operator]


def test_environment_and_memory_failures_are_reported_with_their_own_hints() -> None:
    env_fail = gather.outcome(jobscript.ExitRecord(W.EXIT_ENVIRONMENT_FAILED, W.KIND_ENVIRONMENT))
    assert env_fail.state == "FAILED"
    assert env_fail.hint is not None
    assert "uv" in env_fail.hint
    oom = gather.outcome(jobscript.ExitRecord(137, W.KIND_OOM, command_code=137))
    assert oom.state == "OUT_OF_MEMORY"
    assert oom.hint is not None
    assert "memory limit" in oom.hint


def test_the_limiter_parses_proc_self_cgroup() -> None:
    text = "12:pids:/user.slice\n4:memory:/process_api/abc\n1:name=systemd:/\n0::/init.scope\n"
    got = W.own_cgroups(text)
    assert got["memory"] == "/process_api/abc"
    assert got["pids"] == "/user.slice"
    assert got[""] == "/init.scope"


def test_without_limits_nothing_is_set_up(tmp_path: Path) -> None:
    lim = W.Limiter({}, "t", str(tmp_path))
    assert lim.setup() == "none"
    assert lim.groups == []


def test_prune_removes_caches_unused_for_keep_days(tmp_path: Path) -> None:
    import os
    import time

    from kernel.core.config import EnvironmentConfig

    cache = E.EnvCache(EnvironmentConfig(keep_days=2), tmp_path, uv="/bin/true")
    root = tmp_path / E.ENVS_DIR
    now = time.time()
    for name, age_days in (("old", 3), ("fresh", 1), (E.PYTHON_DIR, 30), ("workspaces", 30)):
        entry = root / name
        entry.mkdir(parents=True)
        (entry / E.USED).touch()
        os.utime(entry / E.USED, (now - age_days * 86400, now - age_days * 86400))
        os.utime(entry, (now - age_days * 86400, now - age_days * 86400))
    removed = cache.prune(now)
    assert removed == ["old"]
    assert sorted(p.name for p in root.iterdir()) == ["fresh", E.PYTHON_DIR, "workspaces"]
