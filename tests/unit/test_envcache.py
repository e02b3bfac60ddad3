"""Pure parts of locked environments: which lockfiles the kernel accepts, the cache key, the config keys, what
a task's wrapper is told, and how its environment and memory failures are reported."""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import tomllib
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel.backends import jobscript
from kernel.backends.base import JobSpec
from kernel.core.config import ConfigError, parse
from kernel.io import envcache as E
from kernel.node import jail as J
from kernel.node import wrapper as W
from kernel.service import gather

REGISTRY = """\
version = 1
revision = 5
requires-python = ">=3.8"

[[package]]
name = "demo"
version = "0.1.0"
source = { virtual = "." }
dependencies = [
    { name = "six" },
]

[package.metadata]
requires-dist = [{ name = "six", specifier = "==1.16.0" }]

[[package]]
name = "six"
version = "1.16.0"
source = { registry = "https://pypi.org/simple" }
sdist = { url = "https://files.pythonhosted.org/packages/71/39/171f1c67cd00715f190ba0b100d606d440a28c93c7714febeca8b79af85e/six-1.16.0.tar.gz", hash = "sha256:1e61c37477a1626458e36f7b1d82aa5c9b094fa4802892072e49de9c60c4c926", size = 34041, upload-time = "2021-05-05T14:18:18.379Z" }
wheels = [
    { url = "https://files.pythonhosted.org/packages/d9/5a/e7c31adbe875f2abbb91bd84cf2dc52d792b5a01506781dbcf25c91daf11/six-1.16.0-py2.py3-none-any.whl", hash = "sha256:8abb2f1d86890a2dfb989f9a77cfcfd3e47c2a354b01111771326f8aa26e0254", size = 11053, upload-time = "2021-05-05T14:18:17.237Z" },
]
"""
SIX_WHEEL = (
    "https://files.pythonhosted.org/packages/d9/5a/e7c31adbe875f2abbb91bd84cf2dc52d792b5a01506781dbcf25c91daf11/"
    "six-1.16.0-py2.py3-none-any.whl"
)
SIX_SDIST = "https://files.pythonhosted.org/packages/71/39/171f1c67cd00715f190ba0b100d606d440a28c93c7714febeca8b79af85e/six-1.16.0.tar.gz"


def test_a_real_uv_lock_is_accepted() -> None:
    """REGISTRY is `uv lock` 0.13.9's output for `six==1.16.0` (tests/integration/test_job_environment.py makes
    it against PyPI), verbatim."""
    assert SIX_WHEEL in REGISTRY
    assert SIX_SDIST in REGISTRY
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
    assert 'package "six" source' in problem
    assert kind in problem
    assert "package index" in problem


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        (
            'registry = "https://pypi.org/simple"',
            'registry = "https://evil.invalid/simple"',
            "source.registry",
        ),
        (SIX_WHEEL, "https://169.254.169.254/six-1.16.0-py2.py3-none-any.whl", "wheels[0].url"),
        (SIX_WHEEL, SIX_WHEEL.replace("https:", "http:"), "wheels[0].url"),
    ],
)
def test_only_the_configured_index_and_its_file_host_are_fetched(old: str, new: str, why: str) -> None:
    lock = REGISTRY.replace(old, new)
    problem = E.lock_problem(lock.encode())
    assert problem is not None
    assert why in problem
    # A site mirror: its own host (and port) is the one allowed.
    mirror = REGISTRY.replace("https://pypi.org/simple", "https://mirror.example:8443/simple").replace(
        "files.pythonhosted.org", "mirror.example:8443"
    )
    assert E.lock_problem(mirror.encode(), "https://mirror.example:8443/simple/") is None
    assert E.lock_problem(mirror.encode()) is not None
    assert E.lock_problem(mirror.encode(), "https://mirror.example/simple/") is not None


# Each a file URL that some parser reads differently from another, or that is not in the one canonical form.
TRICKS = {
    "backslash": "https://127.0.0.1:9\\@files.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "backslash in path": "https://files.pythonhosted.org\\x/six-1.16.0-py2.py3-none-any.whl",
    "userinfo": "https://evil.invalid@files.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "userinfo and port": "https://files.pythonhosted.org:1@files.pythonhosted.org/six.whl",
    "percent in host": "https://files%2epythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "percent in path": "https://files.pythonhosted.org/x/%2e%2e/six-1.16.0-py2.py3-none-any.whl",
    "query": "https://files.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl?x=1",
    "fragment": "https://files.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl#sha256=00",
    "default port": "https://files.pythonhosted.org:443/x/six-1.16.0-py2.py3-none-any.whl",
    "other port": "https://files.pythonhosted.org:8443/x/six-1.16.0-py2.py3-none-any.whl",
    "http": "http://files.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "upper-case scheme": "HTTPS://files.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "file scheme": "file:///etc/passwd",
    "scheme-relative": "//files.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "three slashes": "https:///files.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "tab": "https://files.pythonhosted.org/x/six-1.16.0\t-py2.py3-none-any.whl",
    "newline in host": "https://files.python\nhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "leading space": " https://files.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "control character": "https://files.pythonhosted.org/x/six-1.16.0\x07-py2.py3-none-any.whl",
    "upper-case host": "https://Files.PythonHosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "trailing dot": "https://files.pythonhosted.org./x/six-1.16.0-py2.py3-none-any.whl",
    "IDNA ligature": "https://\ufb01les.pythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "fullwidth dot": "https://files\uff0epythonhosted.org/x/six-1.16.0-py2.py3-none-any.whl",
    "dot-dot segment": "https://files.pythonhosted.org/x/../six-1.16.0-py2.py3-none-any.whl",
    "empty segment": "https://files.pythonhosted.org//six-1.16.0-py2.py3-none-any.whl",
    "host only": "https://files.pythonhosted.org",
}


def _toml(text: str) -> str:
    """`text` as a TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(text)


def _refused(lock: str) -> str:
    """Why lock_problem refuses `lock` (it must)."""
    problem = E.lock_problem(lock.encode())
    assert problem is not None, lock
    return problem


@pytest.mark.parametrize("trick", sorted(TRICKS))
def test_a_file_url_in_any_but_the_canonical_form_is_refused_naming_its_entry(trick: str) -> None:
    url = TRICKS[trick]
    wheel = f'{{ url = "{SIX_WHEEL}", hash = "sha256:{"a" * 64}" }}'
    odd = f'{{ url = {_toml(url)}, hash = "sha256:{"b" * 64}" }}'
    # The trick in the second of two wheels, then in the sdist: the refusal names the entry.
    two = REGISTRY.replace("wheels = [\n", f"wheels = [\n    {wheel},\n    {odd},\n")
    problem = E.lock_problem(two.encode())
    assert problem is not None, url
    assert 'package "six" wheels[1].url' in problem
    assert "https://files.pythonhosted.org/" in problem, "the refusal says where files must come from"
    assert "lock again" in problem
    sdist = REGISTRY.replace(f'url = "{SIX_SDIST}"', f"url = {_toml(url)}")
    problem = E.lock_problem(sdist.encode())
    assert problem is not None
    assert 'package "six" sdist.url' in problem


REGISTRY_TRICKS = {
    "backslash": "https://127.0.0.1:9\\@pypi.org/simple",
    "userinfo": "https://evil.invalid@pypi.org/simple",
    "port": "https://pypi.org:8443/simple",
    "percent": "https://pypi%2eorg/simple",
    "upper case": "https://PyPI.org/simple",
    "trailing dot": "https://pypi.org./simple",
    "query": "https://pypi.org/simple?x=1",
    "http": "http://pypi.org/simple",
}


@pytest.mark.parametrize("trick", sorted(REGISTRY_TRICKS))
def test_a_registry_in_any_but_the_configured_form_is_refused_naming_its_entry(trick: str) -> None:
    url = REGISTRY_TRICKS[trick]
    lock = REGISTRY.replace('registry = "https://pypi.org/simple"', f"registry = {_toml(url)}")
    problem = E.lock_problem(lock.encode())
    assert problem is not None
    assert 'package "six" source.registry' in problem
    assert "https://pypi.org/simple" in problem
    # The same URL where a dependency names its source: refused too, by its path in the lock.
    ref = REGISTRY.replace(
        '{ name = "six" },', f'{{ name = "six", source = {{ registry = {_toml(url)} }} }},'
    )
    problem = E.lock_problem(ref.encode())
    assert problem is not None
    assert 'package "demo" dependencies[0].source.registry' in problem


@pytest.mark.parametrize(
    ("entry", "where"),
    [
        (f'{{ url = "{SIX_WHEEL}" }}', "wheels[0].hash"),
        (f'{{ url = "{SIX_WHEEL}", hash = "md5:00" }}', "wheels[0].hash"),
        (f'{{ url = "{SIX_WHEEL}", hash = "sha256:{"A" * 64}" }}', "wheels[0].hash"),
        (f'{{ path = "/etc/x.whl", hash = "sha256:{"a" * 64}" }}', "wheels[0] has path"),
        (f'{{ filename = "x.whl", hash = "sha256:{"a" * 64}" }}', "wheels[0] has filename"),
        (f'{{ hash = "sha256:{"a" * 64}" }}', "wheels[0].url"),
        ('"just a string"', "wheels[0] is not a table"),
    ],
)
def test_every_file_is_a_url_with_a_sha256(entry: str, where: str) -> None:
    start = REGISTRY.index("wheels = [")
    lock = REGISTRY[:start] + f"wheels = [{entry}]\n"
    problem = E.lock_problem(lock.encode())
    assert problem is not None
    assert f'package "six" {where}' in problem


def test_a_url_anywhere_else_in_the_lock_is_refused_by_its_path() -> None:
    meta = REGISTRY.replace(
        '{ name = "six", specifier = "==1.16.0" }', '{ name = "six", url = "https://evil.invalid/six.whl" }'
    )
    assert 'package "demo" metadata.requires-dist[0].url' in _refused(meta)
    top = REGISTRY + '\n[manifest]\noverrides = [{ name = "six", url = "https://evil\\\\@pypi.org/x" }]\n'
    problem = E.lock_problem(top.encode())
    assert problem is not None
    assert "manifest.overrides[0].url" in problem


def _whatwg_host(url: str) -> tuple[str, int]:
    """The host and port a WHATWG URL parser (uv's `url` crate) reads from a special-scheme URL: leading and
    trailing C0/space stripped, tab and newlines removed, `\\` read as `/`, any number of slashes after the
    scheme, userinfo up to the last `@` dropped, the host percent-decoded, IDNA-mapped and lower-cased."""
    url = url.strip("".join(chr(c) for c in range(0x21)))
    url = re.sub("[\t\n\r]", "", url).replace("\\", "/")
    rest = url.partition(":")[2].lstrip("/")
    authority = re.split("[/?#]", rest, maxsplit=1)[0].rpartition("@")[2]
    host, colon, port = authority.rpartition(":")
    if not colon or not port.isdigit():
        host, port = authority, ""
    host = urllib.parse.unquote(host)
    with contextlib.suppress(UnicodeError):
        host = host.encode("idna").decode("ascii")
    return host.lower().rstrip("."), int(port) if port else 443


def _urllib_host(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    return (parts.hostname or "").rstrip("."), parts.port or 443


_SCHEMES = st.sampled_from(["https://", "http://", "HTTPS://", "https:/", "https:\\\\", "https:///", ""])
_USERINFO = st.sampled_from(["", "127.0.0.1:9\\@", "evil.invalid@", "127.0.0.1\\", "a:b@", "%40"])
_HOSTS = st.sampled_from(
    [
        "files.pythonhosted.org",
        "Files.pythonhosted.org",
        "files.pythonhosted.org.",
        "\ufb01les.pythonhosted.org",
        "files%2epythonhosted.org",
        "127.0.0.1",
    ]
)
_PORTS = st.sampled_from(["", ":443", ":9", ":"])
_PIECES = st.lists(
    st.sampled_from(
        ["/", "six.whl", "a", "-", "+", "~", ".", "..", "%2e", "@", "\\", "?", "#", ":", "\t", " "]
    ),
    max_size=6,
)


@settings(max_examples=500, deadline=None)
@given(_SCHEMES, _USERINFO, _HOSTS, _PORTS, _PIECES)
def test_every_accepted_file_url_has_the_same_host_for_urllib_and_whatwg(
    scheme: str, userinfo: str, host: str, port: str, rest: list[str]
) -> None:
    url = scheme + userinfo + host + port + "".join(rest)
    lock = REGISTRY.replace(f'url = "{SIX_WHEEL}"', f"url = {_toml(url)}")
    if E.lock_problem(lock.encode()) is None:
        expected = ("files.pythonhosted.org", 443)
        assert _urllib_host(url) == expected, url
        assert _whatwg_host(url) == expected, url


def test_the_property_sees_urls_both_accepted_and_refused() -> None:
    """The property above is not vacuous: the whatwg reading differs from urllib's on the classic trick, and a
    canonical URL is accepted."""
    trick = TRICKS["backslash"]
    assert _urllib_host(trick) == ("files.pythonhosted.org", 443)
    assert _whatwg_host(trick) == ("127.0.0.1", 9)
    assert _whatwg_host(TRICKS["IDNA ligature"]) == ("files.pythonhosted.org", 443)
    assert _urllib_host(TRICKS["IDNA ligature"]) != ("files.pythonhosted.org", 443)
    assert E.lock_problem(REGISTRY.replace(SIX_WHEEL, SIX_WHEEL + "+x~1").encode()) is None


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


def test_the_build_jail_writes_only_the_entry_reads_only_what_it_is_given_and_has_network_only_for_uv() -> (
    None
):
    policy = J.JailPolicy(hide=("/opt/state",), ro_dirs=("/site/bin",))
    env = {"PATH": "/usr/bin", "UV_CACHE_DIR": "/runs/envs/.k.tmp/uv"}
    common = {
        "writable": ["/runs/envs/.k.tmp/uv", "/runs/envs/.k.tmp/venv"],
        "readable": ["/k/uv", "/runs/envs/.k.tmp/project", "/tmp/ca.pem"],
        "env": env,
        "cwd": "/runs/envs/.k.tmp/project",
        "argv": ["/k/uv", "sync"],
    }
    uv = J.build_bwrap_argv(policy, network=True, **common)  # type: ignore[arg-type]
    compile_ = J.build_bwrap_argv(policy, network=False, **common)  # type: ignore[arg-type]
    assert "--unshare-net" not in uv
    assert "--unshare-net" in compile_
    assert "/etc/resolv.conf" in uv
    assert "/etc/resolv.conf" not in compile_
    for argv in (uv, compile_):
        assert argv[0] == "bwrap"
        assert argv[argv.index("--") + 1 :] == ["/k/uv", "sync"]
        for flag in ("--clearenv", "--unshare-user", "--unshare-pid", "--die-with-parent", "--new-session"):
            assert flag in argv
        assert argv[argv.index("--cap-drop") + 1] == "ALL"
        rw = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
        assert rw == common["writable"], "nothing else of the host is writable"
        ro = [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"]
        assert ro == common["readable"]
        tries = {argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind-try"}
        assert tries == {
            *policy.system_dirs,
            *policy.etc,
            *policy.ro_dirs,
            *(J.NETWORK_ETC if argv is uv else ()),
        }
        # The state directory, under /opt (bound), is masked; the entry is bound after that mask.
        assert argv.index("/opt/state") < argv.index("/runs/envs/.k.tmp/uv")
        assert argv[argv.index("/opt/state") - 1] == "--tmpfs"
        got_env = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--setenv"}
        assert got_env == env
        assert argv[argv.index("--chdir") + 1] == common["cwd"]
    with pytest.raises(ValueError, match="writable path"):
        J.build_bwrap_argv(policy, network=False, **{**common, "writable": ["relative"]})  # type: ignore[arg-type]


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
        uv="/k/uv",
        cache="/runs/envs/k/uv",
        project="/runs/envs/k/project",
        python="/usr/bin/python3",
        venv="/runs/envs/k/venv",
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
    environment = dict(cfg["environment"])  # type: ignore[call-overload]
    assert environment == {
        "uv": "/k/uv",
        "cache": "/runs/envs/k/uv",
        "project": "/runs/envs/k/project",
        "python": "/usr/bin/python3",
        "python_install_dir": None,
        "lock_sha256": "",
        "venv": "/runs/envs/k/venv",  # the cache entry's, shared by every task: none syncs its own
        "mount": J.SHARED_VENV,
    }
    assert cfg["gpu"] == {"count": 2, "constrained": False}
    assert cfg["limits"] == {"mem_mb": 512, "max_procs": 100, "tree_mb": 0, "cpus": 0}
    assert cfg["forward_vars"] == ["CUDA_VISIBLE_DEVICES"]
    argv = cfg["jail"]["argv"]  # type: ignore[index]
    # bound from the cache entry's venv at the path the job sees
    assert argv[argv.index("--ro-bind") + 1 : argv.index("--ro-bind") + 3] == [
        J.VENV_SOURCE_TOKEN,
        J.VENV_TOKEN,
    ]
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


def test_a_cpu_limit_is_a_cgroup_v2_quota_where_the_cpu_controller_is_there(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / W.CGROUP_GROUP).mkdir()
    (tmp_path / W.CGROUP_GROUP / "cgroup.subtree_control").write_text("")
    lim = W.Limiter({"cpus": 2, "mem_mb": 64}, "t", str(tmp_path))
    assert (lim.setup(), lim.cpu_by) == ("cgroup", "cgroup")
    group = tmp_path / W.CGROUP_GROUP / "t"
    assert (group / "cpu.max").read_text() == "200000 100000"  # two CPUs' worth of each 100 ms period
    assert (group / "memory.max").read_text() == str(64 << 20)
    assert "+cpu" in (tmp_path / "cgroup.subtree_control").read_text().split()


def test_without_a_cgroup_a_cpu_limit_pins_the_task_to_its_own_block_of_cpus(tmp_path: Path) -> None:
    """No cgroup can be made under `tmp_path`: the task is pinned to `cpus` CPUs, task k to the k-th block."""
    lim = W.Limiter({"cpus": 2, "slot": 1}, "t", str(tmp_path))
    assert (lim.setup(), lim.cpu_by) == ("rlimit", "affinity")
    assert lim.affinity({0, 1, 2, 3, 4, 5}) == {2, 3}
    assert W.Limiter({"cpus": 2, "slot": 3}, "t").affinity({0, 1, 2, 3, 4, 5}) == {0, 1}  # round again
    assert W.Limiter({"cpus": 4, "slot": 2}, "t").affinity({5, 7}) == {5, 7}  # no more than asked: all
    import os

    allowed = os.sched_getaffinity(0)
    one = W.Limiter({"cpus": 1, "slot": 0}, "t", str(tmp_path))
    one.setup()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the jail's side: enter() before exec
        one.enter()
        os.write(write, ",".join(map(str, sorted(os.sched_getaffinity(0)))).encode())
        os._exit(0)
    os.close(write)
    got = os.read(read, 4096).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert got == str(min(allowed))


def test_a_launchs_own_memory_and_cpus_replace_the_sites_in_its_jail_policy() -> None:
    site = J.JailPolicy(mem_mb=4096, shm_mb=2048, max_procs=100)
    assert J.with_resources(site, None, None) is site
    own = J.with_resources(site, 64, 2)
    assert (own.mem_mb, own.shm_mb, own.cpus, own.max_procs) == (64, 32, 2, 100)
    assert (J.with_resources(site, None, 3).mem_mb, J.with_resources(site, None, 3).cpus) == (4096, 3)


def test_prune_removes_caches_unused_for_keep_days(tmp_path: Path) -> None:
    import os
    import time

    from kernel.core.config import EnvironmentConfig

    root = tmp_path / "envs"
    cache = E.EnvCache(EnvironmentConfig(keep_days=2), root, jail=J.JailPolicy(), uv="/bin/true")
    now = time.time()
    for name, age_days in (("old", 3), ("fresh", 1), (E.PYTHON_DIR, 30), ("workspaces", 30)):
        entry = root / name
        entry.mkdir(parents=True)
        (entry / E.USED).touch()
        os.utime(entry / E.USED, (now - age_days * 86400, now - age_days * 86400))
        os.utime(entry, (now - age_days * 86400, now - age_days * 86400))
    # An entry's venv is read-only (make_read_only): pruning restores the owner's bits on directories first.
    (root / "old" / "venv" / "lib").mkdir(parents=True)
    (root / "old" / "venv" / "lib" / "m.py").write_text("x = 1\n")
    E.make_read_only(root / "old" / "venv")
    removed = cache.prune(now)
    assert removed == ["old"]
    assert sorted(p.name for p in root.iterdir()) == ["fresh", E.PYTHON_DIR, "workspaces"]


def test_the_shared_venv_is_left_without_a_write_bit_and_its_links_untouched(tmp_path: Path) -> None:
    import os
    import stat

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / "pkg").mkdir(parents=True)
    (venv / "lib" / "pkg" / "m.py").write_text("x = 1\n")
    (venv / "bin" / "tool").write_text("#!/bin/sh\n")
    (venv / "bin" / "tool").chmod(0o775)
    outside = tmp_path / "outside"
    outside.write_text("not the venv's\n")
    (venv / "bin" / "python").symlink_to(outside)
    E.make_read_only(venv)
    modes = {
        str(p.relative_to(tmp_path)): stat.S_IMODE(p.lstat().st_mode)
        for p in [venv, *venv.rglob("*")]
        if not p.is_symlink()
    }
    assert modes == {
        "venv": 0o555,
        "venv/bin": 0o555,
        "venv/lib": 0o555,
        "venv/lib/pkg": 0o555,
        "venv/lib/pkg/m.py": 0o444,
        "venv/bin/tool": 0o555,
    }
    assert stat.S_IMODE(os.stat(outside).st_mode) & 0o200, "a link's target is not the venv's to change"
    E.remove_entry(tmp_path)
    assert not tmp_path.exists()


def test_uv_is_given_the_accepted_files_in_canonical_form() -> None:
    pyproject = (
        b'[project]\nname = "demo"\n# a comment\ndependencies = [\n  "six==1.16.0",\n]\n[tool.x]\nf = 1.5\n'
    )
    got_pyproject, got_lock = E.accepted_files(
        E.LockedProject(pyproject=pyproject, lock=REGISTRY.encode()), ""
    )
    assert tomllib.loads(got_lock.decode()) == tomllib.loads(REGISTRY)
    assert tomllib.loads(got_pyproject.decode()) == tomllib.loads(pyproject.decode())
    assert got_lock.splitlines()[3].startswith(b'"package" = [{"name" = "demo", ')
    assert b"#" not in got_pyproject
    with pytest.raises(E.EnvironmentFailed, match=r'package "six" sdist\.url'):
        E.accepted_files(
            E.LockedProject(
                pyproject=pyproject, lock=REGISTRY.replace("https://files", "http://files").encode()
            ),
            "",
        )
    with pytest.raises(E.EnvironmentFailed, match=r"pyproject\.toml is not valid TOML"):
        E.accepted_files(E.LockedProject(pyproject=b"[project", lock=REGISTRY.encode()), "")


_TOML_SCALARS = (
    st.text()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.booleans()
    | st.floats(allow_nan=False)
    | st.datetimes(timezones=st.none() | st.just(datetime.UTC))
    | st.dates()
    | st.times()
)
_TOML_VALUES = st.recursive(
    _TOML_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), _TOML_VALUES, max_size=5))
def test_canonical_toml_reads_back_as_the_same_document_in_printable_ascii(doc: dict[str, object]) -> None:
    text = E.canonical_toml(doc)
    assert all(0x20 <= b < 0x7F or b == 0x0A for b in text)
    assert tomllib.loads(text.decode("ascii")) == doc


@pytest.mark.parametrize("depth", [E.MAX_TOML_DEPTH + 1, 5000])
def test_a_file_nested_too_deep_is_refused_not_a_crash(depth: int) -> None:
    deep = "x = " + "[" * depth + "]" * depth + "\n"
    problem = E.lock_problem((REGISTRY + deep).encode())
    assert problem is not None
    assert f"uv.lock nests arrays or tables more than {E.MAX_TOML_DEPTH} deep" in problem
    with pytest.raises(E.EnvironmentFailed, match=r"pyproject\.toml nests"):
        E.accepted_files(E.LockedProject(pyproject=deep.encode(), lock=REGISTRY.encode()), "")


def test_a_package_name_is_quoted_and_escaped_in_the_refusal() -> None:
    lock = REGISTRY.replace('name = "six"\n', 'name = "six\\n\\u001b[2Jok"\n').replace(
        "https://files", "http://files"
    )
    problem = _refused(lock)
    assert 'package "six\\n\\u001b[2Jok" sdist.url' in problem
    assert "\n" not in problem
    assert "\x1b" not in problem


def test_a_key_of_the_agents_is_escaped_in_the_refusal() -> None:
    lock = REGISTRY.replace(
        'source = { registry = "https://pypi.org/simple" }', 'source = { "git\\u001b[2J\\n" = "x" }'
    )
    problem = _refused(lock)
    assert "git\\x1b[2J\\n source" in problem
    assert "\x1b" not in problem


def test_a_cache_link_that_leaves_the_cache_is_found(tmp_path: Path) -> None:
    """What a subverted build could plant for each task's copy (outside its jail) to follow."""
    import os

    root = tmp_path / "uv"
    (root / "archive-v0" / "abc" / "six").mkdir(parents=True)
    (root / "archive-v0" / "abc" / "six" / "__init__.py").write_text("")
    (root / "wheels-v8" / "pypi" / "six").mkdir(parents=True)
    os.symlink("../../../archive-v0/abc", root / "wheels-v8" / "pypi" / "six" / "1.16.0")
    assert E.stray_entries(root) == [], "uv's own relative links stay inside"
    os.symlink("/etc/shadow", root / "archive-v0" / "abc" / "six" / "shadow.py")
    os.symlink("../../../../outside", root / "archive-v0" / "abc" / "six" / "up")
    os.symlink("../..", root / "archive-v0" / "abc" / "top")  # the cache root itself is not below it
    os.mkfifo(root / "archive-v0" / "fifo")
    assert sorted(E.stray_entries(root)) == [
        "archive-v0/abc/six/shadow.py",
        "archive-v0/abc/six/up",
        "archive-v0/abc/top",
        "archive-v0/fifo",
    ]


def test_a_lock_out_of_date_with_pyproject_is_refused_with_uv_lock() -> None:
    # a dependency added to pyproject.toml without `uv lock`: refused before any build, with the fix
    stale = b'[project]\nname = "Demo"\ndependencies = ["six==1.16.0", "numpy>=2", "scikit_learn[x]; python_version>\'3\'"]\n'
    with pytest.raises(E.EnvironmentFailed) as info:
        E.accepted_files(E.LockedProject(pyproject=stale, lock=REGISTRY.encode()), "")
    assert "uv.lock is out of date" in str(info.value)
    assert "'numpy', 'scikit_learn'" in str(info.value)
    assert "run `uv lock`" in str(info.value)
    # names compare normalised (Six == six), and a changed specifier alone is left to uv
    fresh = b'[project]\nname = "demo"\ndependencies = ["Six>=1"]\n'
    E.accepted_files(E.LockedProject(pyproject=fresh, lock=REGISTRY.encode()), "")
    # nothing to compare: no [project] table, or no locked entry of the project
    E.accepted_files(E.LockedProject(pyproject=b"[tool.uv]\n", lock=REGISTRY.encode()), "")
    other = b'[project]\nname = "other"\ndependencies = ["numpy"]\n'
    E.accepted_files(E.LockedProject(pyproject=other, lock=REGISTRY.encode()), "")
