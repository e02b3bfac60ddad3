"""Pure tests of the jail argv/env builders, and of the wrapper's node-side rendering of their template."""

from __future__ import annotations

import pytest

from kernel.core.config import Config
from kernel.io.snapshot import listing_jail
from kernel.node import jail as J
from kernel.node import wrapper as W

PATHS = J.JailPaths(tree="/scratch/j1/tree", home="/scratch/j1/home", work="/scratch/j1/work")


# Every bwrap jail: each namespace unshared (the network's too, without a network policy), bound to its parent's
# life, a session of its own, an empty environment.
ISOLATION = (
    "--unshare-user",
    "--unshare-ipc",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-uts",
    "--unshare-cgroup",
    "--die-with-parent",
    "--new-session",
    "--clearenv",
)


def _pairs(argv: list[str], flag: str, n: int = 2) -> list[tuple[str, ...]]:
    return [tuple(argv[i + 1 : i + 1 + n]) for i, a in enumerate(argv) if a == flag]


def _bwrap(policy: J.JailPolicy | None = None, env: dict[str, str] | None = None) -> list[str]:
    return J.bwrap_argv(policy or J.JailPolicy(), PATHS, J.env_args("bwrap", env or {}), "python train.py")


def _assert_isolated(head: list[str]) -> None:
    """Every namespace unshared (the network's too), no capability, a new session, an empty environment."""
    for flag in ISOLATION:
        assert head.count(flag) == 1, flag
    assert _pairs(head, "--cap-drop", 1) == [("ALL",)]


def test_bwrap_isolates_every_namespace_drops_caps_and_clears_env() -> None:
    argv = _bwrap()
    head = argv[: argv.index("--")]
    _assert_isolated(head)
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
    assert _pairs(argv, "--tmpfs", 1) == [("/dev/shm",), ("/tmp",)]
    assert _pairs(argv, "--remount-ro", 1) == [("/dev",)]
    assert "--size" not in argv, "no size given: the tmpfs default"
    assert _pairs(argv, "--proc", 1) == [("/proc",)]
    assert _pairs(argv, "--dev", 1) == [("/dev",)]
    # The tree is bound after the fresh /tmp, or the tmpfs would hide a tree that lives under /tmp.
    assert argv.index("--tmpfs") < argv.index("--bind")
    assert not [a for a in argv if "nvidia" in a or a.startswith("/sys")], "no GPU without gpus"


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
        J.JailPolicy(venv=True, ro_dirs=("/opt/site",), tmp_mb=64, shm_mb=32),
        J.JailPolicy(kind="apptainer", image="/i.sif", venv=True, ro_dirs=("/opt/site",)),
    ],
    ids=["bwrap", "bwrap-net", "apptainer", "none", "bwrap-venv-limits", "apptainer-venv"],
)
@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_the_wrappers_rendering_of_the_template_equals_the_direct_build(
    policy: J.JailPolicy, gpus: int
) -> None:
    venv = "/scratch/j1/env"
    env = J.jail_env(home=PATHS.home, task_index=1, venv=venv if policy.venv else None)
    command = "echo '@@SYSCALL_TREE@@' $HOME"  # a token inside the command is data, not a placeholder
    devices = J.gpu_bind_args(None, ["nvidia0", "nvidia1", "nvidiactl"], constrained=False)
    direct = J.build_argv(
        policy, PATHS, J.env_args(policy.kind, env), command, gpus=gpus, venv=venv, gpu_args=devices
    )
    rendered = W.render_argv(
        J.template_argv(policy, gpus=gpus),
        policy.kind,
        PATHS.tree,
        PATHS.home,
        PATHS.work,
        env,
        command,
        venv=venv,
        gpus=devices,
    )
    assert rendered == direct


# --- GPUs: fake device lists ---------------------------------------------------------------------------------

NODE_DEV = ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
NODE_DEV += ["nvidia-modeset", "nvidia-caps", "dri/renderD128", "dri/renderD129", "dri/card0"]


def _devices(argv: list[str]) -> list[str]:
    return [src for src, dst in _pairs(argv, "--dev-bind-try") if src == dst]


def _gpu_argv(gpus: int, visible: str | None, present: list[str], constrained: bool = False) -> list[str]:
    args = J.gpu_bind_args(visible, present, constrained=constrained)
    return J.bwrap_argv(J.JailPolicy(), PATHS, [], "nvidia-smi -L", gpus=gpus, gpu_args=args)


def test_a_task_without_gpus_sees_no_gpu_device_nor_the_drivers_proc_and_sys() -> None:
    argv = _gpu_argv(0, "0,1", NODE_DEV)
    assert _devices(argv) == []
    assert J.GPU_PROC not in argv
    assert not [a for a in argv if a.startswith("/sys")]


def test_one_gpu_binds_its_card_the_control_nodes_and_render_nodes_read_only_proc_and_sys() -> None:
    argv = _gpu_argv(1, "2", NODE_DEV)
    assert _devices(argv) == [
        "/dev/nvidia2",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
        "/dev/dri/renderD128",
        "/dev/dri/renderD129",
    ]
    ro = [src for src, _ in _pairs(argv, "--ro-bind-try")]
    assert J.GPU_PROC in ro
    assert "/sys/bus/pci" in ro
    assert "/sys/devices" in ro
    assert ("/sys", "/sys") not in _pairs(argv, "--ro-bind-try"), "only what CUDA reads from /sys"
    # The devices come after the fresh /dev and before it is made read-only; /dev/shm stays writable.
    assert argv.index("--dev") < argv.index("--dev-bind-try") < argv.index("--remount-ro")
    assert argv.index("--remount-ro") > len(argv) - argv[::-1].index("/dev/shm") - 1


def test_two_gpus_bind_exactly_the_two_visible_cards() -> None:
    argv = _gpu_argv(2, "1,3", NODE_DEV)
    cards = [d for d in _devices(argv) if d[len("/dev/nvidia") :].isdigit()]
    assert cards == ["/dev/nvidia1", "/dev/nvidia3"]


def test_constrained_devices_or_uuids_bind_every_card_present() -> None:
    # Slurm's ConstrainDevices renumbers CUDA_VISIBLE_DEVICES from 0 and its cgroup denies the other cards.
    for visible, constrained in (("0,1", True), ("GPU-3f2a,GPU-77b1", False), (None, False)):
        argv = _gpu_argv(2, visible, NODE_DEV, constrained)
        cards = [d for d in _devices(argv) if d[len("/dev/nvidia") :].isdigit()]
        assert cards == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"]


def test_only_nodes_that_exist_are_bound() -> None:
    argv = _gpu_argv(1, "0", ["nvidia0", "nvidiactl"])
    assert _devices(argv) == ["/dev/nvidia0", "/dev/nvidiactl"]


@pytest.mark.parametrize("visible", [None, "0", "1,3", "GPU-x", "", " 2 , 0"])
@pytest.mark.parametrize("constrained", [False, True])
def test_the_wrappers_gpu_binds_mirror_the_kernels(visible: str | None, constrained: bool) -> None:
    assert W.gpu_bind_args(visible, NODE_DEV, constrained) == J.gpu_bind_args(
        visible, NODE_DEV, constrained=constrained
    )


def test_the_wrapper_lists_nvidia_and_dri_nodes(tmp_path: pytest.TempPathFactory) -> None:
    import pathlib

    dev = pathlib.Path(str(tmp_path))
    for name in ("nvidia0", "nvidiactl", "null", "dri/renderD128"):
        (dev / name).parent.mkdir(exist_ok=True)
        (dev / name).touch()
    assert sorted(W.dev_listing(str(dev))) == ["dri/renderD128", "nvidia0", "nvidiactl"]


def test_apptainer_keeps_nv_for_gpu_tasks_only() -> None:
    pol = J.JailPolicy(kind="apptainer", image="/i.sif")
    assert "--nv" in J.build_argv(pol, PATHS, [], "true", gpus=1)
    assert "--nv" not in J.build_argv(pol, PATHS, [], "true", gpus=0)


# --- the private environment, extra directories, sizes -------------------------------------------------------


def test_the_venv_is_bound_read_only_and_first_on_path() -> None:
    venv = "/scratch/j1/env"
    argv = J.bwrap_argv(J.JailPolicy(venv=True), PATHS, [], "python -V", venv=venv)
    assert (venv, venv) in _pairs(argv, "--ro-bind")
    assert (venv, venv) not in _pairs(argv, "--bind")
    env = J.jail_env(home="/h", venv=venv, path_dirs=("/opt/site/bin",))
    assert env["PATH"].split(":")[:2] == [f"{venv}/bin", "/opt/site/bin"]
    assert env["PATH"].endswith(J.JAIL_PATH)
    assert env["VIRTUAL_ENV"] == venv
    with pytest.raises(ValueError, match="venv"):
        J.bwrap_argv(J.JailPolicy(venv=True), PATHS, [], "true")


def test_extra_dirs_are_bound_read_only() -> None:
    argv = J.bwrap_argv(J.JailPolicy(ro_dirs=("/opt/site",)), PATHS, [], "true")
    assert ("/opt/site", "/opt/site") in _pairs(argv, "--ro-bind-try")
    with pytest.raises(ValueError, match="absolute"):
        J.bwrap_argv(J.JailPolicy(ro_dirs=("site",)), PATHS, [], "true")


def test_tmp_and_shm_sizes() -> None:
    argv = J.bwrap_argv(J.JailPolicy(tmp_mb=64, shm_mb=32), PATHS, [], "true")
    sized = [(argv[i + 1], argv[i + 3]) for i, a in enumerate(argv) if a == "--size"]
    assert sized == [(str(32 << 20), "/dev/shm"), (str(64 << 20), "/tmp")]


def test_wrapper_tokens_match_the_kernels() -> None:
    assert (
        W.TREE_TOKEN,
        W.HOME_TOKEN,
        W.WORK_TOKEN,
        W.ENV_TOKEN,
        W.COMMAND_TOKEN,
        W.VENV_TOKEN,
        W.VENV_SOURCE_TOKEN,
        W.GPU_TOKEN,
    ) == (
        J.TREE_TOKEN,
        J.HOME_TOKEN,
        J.WORK_TOKEN,
        J.ENV_TOKEN,
        J.COMMAND_TOKEN,
        J.VENV_TOKEN,
        J.VENV_SOURCE_TOKEN,
        J.GPU_TOKEN,
    )
    assert W.GPU_CONTROL == J.GPU_CONTROL


def test_the_listing_jail_binds_the_workspace_and_scratch_read_only_without_network_state_or_run_dir() -> (
    None
):
    """The snapshot's git listing on the kernel's host (kernel.io.gitlisting): nothing of the host is writable,
    the workspace is bound from the kernel's directory fd at its own path, the state directory is masked where a
    system directory would show it, and the run directory, /proc and /tmp are simply not there."""
    policy = J.JailPolicy(hide=("/opt/syscall/state", "/srv/runs"), ro_dirs=("/site/bin",))
    env = {"GIT_DIR": "/opt/syscall/state/tmp/s1/gitdir", "PATH": "/usr/bin"}
    argv = J.listing_bwrap_argv(
        policy,
        workspace="/home/agent/ws",
        workspace_fd=7,
        readable=["/opt/syscall/state/tmp/s1/gitdir"],
        env=env,
        info_fd=9,
        argv=["git", "ls-files", "--others"],
    )
    head = argv[: argv.index("--")]
    assert argv[argv.index("--") + 1 :] == ["git", "ls-files", "--others"]
    # --as-pid-1: the pid bwrap reports is git's own, the one the watch reads and whose kill ends the namespace.
    for flag in (*ISOLATION, "--disable-userns", "--as-pid-1"):
        assert head.count(flag) == 1, flag
    assert _pairs(head, "--cap-drop", 1) == [("ALL",)]
    assert _pairs(head, "--info-fd", 1) == [("9",)]
    assert _pairs(head, "--ro-bind-fd") == [("7", "/home/agent/ws")]
    assert _pairs(head, "--ro-bind") == [("/opt/syscall/state/tmp/s1/gitdir",) * 2]
    assert not {"--bind", "--bind-try", "--bind-fd", "--dev-bind", "--proc"} & set(head), (
        "nothing writable, no /proc"
    )
    assert {src for src, _ in _pairs(head, "--ro-bind-try")} == {*policy.system_dirs, *policy.etc}
    assert "/etc/resolv.conf" not in head, "no resolver"
    assert "/site/bin" not in head, "no extra directories"
    assert "/srv/runs" not in head, "the run directory is never bound (nor masked: nothing shows it)"
    tmpfs = [a for (a,) in _pairs(head, "--tmpfs", 1)]
    assert tmpfs == ["/opt/syscall/state"], "the state directory masked below /opt; no /tmp"
    assert head.index("/opt/syscall/state") < head.index("/opt/syscall/state/tmp/s1/gitdir"), "scratch on top"
    assert _pairs(head, "--remount-ro", 1) == [("/",)]
    assert _pairs(head, "--chdir", 1) == [("/home/agent/ws",)]
    assert {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--setenv"} == env
    with pytest.raises(ValueError, match="workspace must be an absolute path"):
        J.listing_bwrap_argv(
            policy, workspace="ws", workspace_fd=7, readable=[], env=env, info_fd=9, argv=["git"]
        )


@pytest.mark.parametrize("kind", ["bwrap", "apptainer", "none"])
def test_the_kernel_lists_snapshots_in_the_jail_exactly_when_its_jail_is_bwrap(kind: J.JailKind) -> None:
    cfg = Config(state_dir="/opt/k/state", run_dir="/srv/runs", jail=kind, apptainer_image="/img.sif")
    expected = J.JailPolicy(kind="bwrap", hide=("/opt/k/state", "/srv/runs")) if kind == "bwrap" else None
    assert listing_jail(cfg) == expected
