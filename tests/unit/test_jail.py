"""Pure tests of the jail argv/env builders, and of the wrapper's node-side rendering of their template."""

from __future__ import annotations

import pytest

from kernel.node import jail as J
from kernel.node import wrapper as W

PATHS = J.JailPaths(tree="/scratch/j1/tree", home="/scratch/j1/home", work="/scratch/j1/work")


def _pairs(argv: list[str], flag: str, n: int = 2) -> list[tuple[str, ...]]:
    return [tuple(argv[i + 1 : i + 1 + n]) for i, a in enumerate(argv) if a == flag]


def _bwrap(policy: J.JailPolicy | None = None, env: dict[str, str] | None = None) -> list[str]:
    return J.bwrap_argv(policy or J.JailPolicy(), PATHS, J.env_args("bwrap", env or {}), "python train.py")


def test_bwrap_isolates_every_namespace_drops_caps_and_clears_env() -> None:
    argv = _bwrap()
    head = argv[: argv.index("--")]
    for flag in (
        "--unshare-user",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ):
        assert head.count(flag) == 1, flag
    assert _pairs(head, "--cap-drop", 1) == [("ALL",)]
    assert argv[argv.index("--") :] == ["--", "sh", "-c", "python train.py"]


def test_bwrap_binds_only_the_tree_and_home_writable_and_chdirs_into_the_tree() -> None:
    argv = _bwrap()
    assert _pairs(argv, "--bind") == [(PATHS.home, PATHS.home), (PATHS.tree, PATHS.tree)]
    assert _pairs(argv, "--chdir", 1) == [(PATHS.tree,)]
    ro = [src for src, _ in _pairs(argv, "--ro-bind-try")]
    assert "/usr" in ro
    assert "/etc/passwd" in ro
    assert "/etc" not in ro, "the whole /etc (shadow, ssh keys, kernel config) must not be bound"
    assert "/etc/resolv.conf" not in ro, "no network, no resolver"
    assert all(src == dst for src, dst in _pairs(argv, "--ro-bind-try"))
    assert _pairs(argv, "--tmpfs", 1) == [("/tmp",)]
    assert _pairs(argv, "--proc", 1) == [("/proc",)]
    assert _pairs(argv, "--dev", 1) == [("/dev",)]
    # The tree is bound after the fresh /tmp, or the tmpfs would hide a tree that lives under /tmp.
    assert argv.index("--tmpfs") < argv.index("--bind")


def test_bwrap_network_policy_keeps_the_net_namespace_shared_and_binds_the_resolver() -> None:
    argv = _bwrap(J.JailPolicy(network=True))
    assert "--unshare-net" not in argv
    assert ("/etc/resolv.conf", "/etc/resolv.conf") in _pairs(argv, "--ro-bind-try")


def test_bwrap_masks_hidden_kernel_dirs_only_where_a_bound_dir_would_expose_them() -> None:
    policy = J.JailPolicy(hide=("/opt/syscall/state", "/srv/runs", "/usr"))
    tmpfs = [a for (a,) in _pairs(_bwrap(policy), "--tmpfs", 1)]
    assert "/opt/syscall/state" in tmpfs  # /opt is bound read-only: mask it
    assert "/srv/runs" not in tmpfs  # nothing binds /srv: already invisible
    assert "/usr" in tmpfs


def test_bwrap_env_is_exactly_the_allowlist() -> None:
    env = J.jail_env(home=PATHS.home, task_index=3, eval_seed="42", forwarded={"CUDA_VISIBLE_DEVICES": "1"})
    argv = _bwrap(env=env)
    got = {k: v for k, v in _pairs(argv, "--setenv")}
    assert got == {
        "PATH": J.JAIL_PATH,
        "LANG": "C.UTF-8",
        "HOME": PATHS.home,
        "TMPDIR": "/tmp",
        "SWEEP_INDEX": "3",
        "SLURM_ARRAY_TASK_ID": "3",
        "EVAL_SEED": "42",
        "CUDA_VISIBLE_DEVICES": "1",
    }


def test_jail_env_forwards_nothing_but_the_gpu_list() -> None:
    env = J.jail_env(home="/h", forwarded={"AWS_SECRET_ACCESS_KEY": "x", "SSH_AUTH_SOCK": "/s"})
    assert set(env) == {"PATH", "LANG", "HOME", "TMPDIR"}


def test_apptainer_argv_follows_the_site_profile() -> None:
    policy = J.JailPolicy(kind="apptainer", image="/images/py.sif")
    argv = J.apptainer_argv(policy, PATHS, J.env_args("apptainer", {"PATH": "/usr/bin"}), "make", gpus=0)
    assert argv == [
        "apptainer",
        "exec",
        "--containall",
        "--cleanenv",
        "--net",
        "--network",
        "none",
        "--bind",
        PATHS.tree,
        "--pwd",
        PATHS.tree,
        "--home",
        PATHS.home,
        "--workdir",
        PATHS.work,
        "--env",
        "PATH=/usr/bin",
        "/images/py.sif",
        "sh",
        "-c",
        "make",
    ]


def test_apptainer_gpus_add_nv_and_network_policy_drops_the_none_network() -> None:
    policy = J.JailPolicy(kind="apptainer", image="/i.sif", network=True)
    argv = J.apptainer_argv(policy, PATHS, [], "true", gpus=2)
    assert "--nv" in argv
    assert "--net" not in argv
    assert "none" not in argv


def test_apptainer_without_an_image_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="needs an image"):
        J.apptainer_argv(J.JailPolicy(kind="apptainer"), PATHS, [], "true", gpus=0)


def test_none_is_just_sh_c() -> None:
    assert J.build_argv(J.JailPolicy(kind="none"), PATHS, [], "echo hi") == ["sh", "-c", "echo hi"]
    assert "WITHOUT a jail" in J.NONE_WARNING


def test_relative_paths_are_refused() -> None:
    with pytest.raises(ValueError, match="absolute"):
        J.bwrap_argv(J.JailPolicy(), J.JailPaths("tree", "/h", "/w"), [], "true")
    with pytest.raises(ValueError, match="absolute"):
        J.bwrap_argv(J.JailPolicy(system_dirs=("usr",)), PATHS, [], "true")


@pytest.mark.parametrize("kind", ["bwrap", "apptainer", "none"])
def test_wrapper_env_args_mirror_the_kernels(kind: J.JailKind) -> None:
    env = {"B": "2", "A": "x=y", "SWEEP_INDEX": "0"}
    assert W.env_args(kind, env) == J.env_args(kind, env)


@pytest.mark.parametrize(
    "policy",
    [
        J.JailPolicy(),
        J.JailPolicy(network=True, hide=("/opt/k",)),
        J.JailPolicy(kind="apptainer", image="/i.sif"),
        J.JailPolicy(kind="none"),
    ],
    ids=["bwrap", "bwrap-net", "apptainer", "none"],
)
def test_the_wrappers_rendering_of_the_template_equals_the_direct_build(policy: J.JailPolicy) -> None:
    env = J.jail_env(home=PATHS.home, task_index=1)
    command = "echo '@@SYSCALL_TREE@@' $HOME"  # a token inside the command is data, not a placeholder
    direct = J.build_argv(policy, PATHS, J.env_args(policy.kind, env), command, gpus=1)
    rendered = W.render_argv(
        J.template_argv(policy, gpus=1), policy.kind, PATHS.tree, PATHS.home, PATHS.work, env, command
    )
    assert rendered == direct


def test_wrapper_tokens_match_the_kernels() -> None:
    assert (W.TREE_TOKEN, W.HOME_TOKEN, W.WORK_TOKEN, W.ENV_TOKEN, W.COMMAND_TOKEN) == (
        J.TREE_TOKEN,
        J.HOME_TOKEN,
        J.WORK_TOKEN,
        J.ENV_TOKEN,
        J.COMMAND_TOKEN,
    )
