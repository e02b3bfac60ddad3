"""Config: TOML into strict Structs; every bad key is named with its file."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from channel.messages import VERBS
from kernel.core.config import ConfigError, default_config_paths, load, parse


def test_defaults_without_a_file_use_the_users_state_dir_for_cli_and_service_alike() -> None:
    # systemd's $STATE_DIRECTORY is not used: `enroll` run by hand would write another store than the service's.
    cli = parse("", "<defaults>", env={"XDG_STATE_HOME": "/home/a/.state"})
    svc = parse("", "<defaults>", env={"XDG_STATE_HOME": "/home/a/.state", "STATE_DIRECTORY": "/var/lib/sk"})
    assert cli.state_dir == svc.state_dir == "/home/a/.state/syscall-kernel"
    assert cli.run_dir == "/home/a/.state/syscall-kernel/runs"
    assert cli.watch == "auto"
    assert cli.defaults.launches == 100
    assert cli.allow_root is False


def test_the_example_config_gives_cli_and_service_the_same_state_dir() -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "config.example.toml"
    cli = load(example, env={"HOME": "/home/alice"})
    svc = load(example, env={"HOME": "/home/alice", "STATE_DIRECTORY": "/var/lib/syscall-kernel/alice"})
    assert cli.state_dir == svc.state_dir
    assert cli.state_dir.startswith("/var/lib/syscall-kernel/")


def test_relative_paths_resolve_against_the_config_file(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('state_dir = "state"\nworkspaces = ["agents/*"]\n[defaults]\ngpu_hours = 2.5\n')
    cfg = load(f, env={})
    assert cfg.state_dir == str(tmp_path / "state")
    assert cfg.workspaces == (str(tmp_path / "agents/*"),)
    assert cfg.defaults.gpu_hours == 2.5
    assert cfg.source == str(f)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("stat_dir = '/x'", "key 'stat_dir' is not a known setting"),
        ("[defaults]\nlaunchs = 3", "key 'defaults.launchs' is not a known setting"),
        ("watch = 'fanotify'", "key 'watch'"),
        ("[defaults]\nlaunches = true", "key 'defaults.launches'"),
        ("[defaults]\nlaunches = -1", "key 'defaults.launches'"),
        ("[defaults]\nmax_minutes = 100000", "key 'defaults.max_minutes'"),
        ("rescan_seconds = 0", "key 'rescan_seconds'"),
        ("[slurm]\npartition = 3", "key 'slurm.partition'"),
        ("workspaces = ['']", "key 'workspaces.0' is empty"),
        ("[defaults]\nmax_gpus = 9\nmax_concurrent_gpus = 4", "key 'defaults.max_gpus'"),
        ("state_dir = ", "not valid TOML"),
        ("source = 'x'", "key 'source' is not a known setting"),
        ("[defaults]\nverbs = ['sleep', 'tail-all']", "key 'defaults.verbs"),
    ],
)
def test_bad_config_names_the_file_and_key(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(f, env={})
    assert str(info.value).startswith(f"{f}: ")
    assert needle in str(info.value)


def test_defaults_verbs_narrow_the_policy(tmp_path: Path) -> None:
    f = tmp_path / "v.toml"
    f.write_text("[defaults]\nverbs = ['sleep', 'status']\n")
    assert load(f, env={}).defaults.policy().verbs == ("sleep", "status")
    assert parse("", "<defaults>", env={}).defaults.policy().verbs == VERBS


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: config file not found"):
        load(tmp_path / "nope.toml", env={})


def test_env_variable_picks_the_file(tmp_path: Path) -> None:
    f = tmp_path / "e.toml"
    f.write_text("watch = 'poll'\n")
    assert load(None, env={"SYSCALL_KERNEL_CONFIG": str(f)}).watch == "poll"


def test_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "config.example.toml"
    cfg = load(example, env={})
    assert cfg.backend in ("local", "slurm")
    assert cfg.workspaces


def test_share_baselines_is_the_kernels_setting_in_the_submit_table() -> None:
    assert not parse("").defaults.share_baselines
    cfg = parse("[defaults.submit]\ncommand = 'sh e.sh'\nmetric = 'm'\nshare_baselines = true\n")
    assert cfg.defaults.share_baselines
    assert cfg.defaults.submit is not None
    assert cfg.defaults.submit.command == "sh e.sh"
    only = parse("[defaults.submit]\nshare_baselines = true\n")
    assert (only.defaults.share_baselines, only.defaults.submit) == (True, None)
    with pytest.raises(ConfigError, match=r"'defaults\.submit\.share_baselines' must be true or false"):
        parse("[defaults.submit]\nshare_baselines = 1\n")
    with pytest.raises(ConfigError, match=r"'defaults.share_baselines' belongs in \[defaults.submit\]"):
        parse("[defaults]\nshare_baselines = true\n")
    assert parse("repo_gc_hours = 1.5\n").repo_gc_hours == 1.5
    with pytest.raises(ConfigError, match="repo_gc_hours"):
        parse("repo_gc_hours = 0\n")


def test_without_a_flag_the_users_own_config_comes_first(tmp_path: Path) -> None:
    # The unit syscall-kernel@<user> passes /etc/syscall-kernel/<user>.toml; the CLI run by hand as that user
    # finds the same file, so `enroll` writes the store the service serves.
    user = pwd.getpwuid(os.geteuid()).pw_name
    (tmp_path / "config.toml").write_text('watch = "poll"\n')
    assert load(None, env={}, config_dir=tmp_path).watch == "poll"
    (tmp_path / f"{user}.toml").write_text('watch = "inotify"\n')
    cfg = load(None, env={}, config_dir=tmp_path)
    assert (cfg.watch, cfg.source) == ("inotify", str(tmp_path / f"{user}.toml"))
    # $SYSCALL_KERNEL_CONFIG still wins
    (tmp_path / "other.toml").write_text('watch = "auto"\n')
    assert (
        load(None, env={"SYSCALL_KERNEL_CONFIG": str(tmp_path / "other.toml")}, config_dir=tmp_path).watch
        == "auto"
    )


def test_a_user_name_never_leaves_the_config_dir() -> None:
    d = Path("/etc/syscall-kernel")
    assert default_config_paths("alice", d) == (d / "alice.toml", d / "config.toml")
    for odd in ("../x", ".hidden", "", None):
        assert default_config_paths(odd, d) == (d / "config.toml",)


def test_the_slurm_wckey_reaches_the_sbatch_policy() -> None:
    from kernel.backends.slurm.backend import policy_from_config

    cfg = parse('[slurm]\nwckey = "agents"\naccount = "site"\n')
    policy = policy_from_config(cfg.slurm)
    assert (policy.wckey, policy.account) == ("agents", "site")
    assert policy_from_config(parse("").slurm).wckey is None
    with pytest.raises(ConfigError, match=r"'slurm\.wckey'"):
        parse('[slurm]\nwckey = "a b"\n')


def test_the_kernels_own_files_stay_where_earlier_kernels_left_them() -> None:
    """One name for each (kernel.core.statepaths): an upgraded kernel finds its store, lock, temps and caches."""
    p = parse('state_dir = "/srv/k"\n', "<test>", env={}).paths
    assert (p.state_dir, p.store, p.lock, p.tmp) == (
        Path("/srv/k"),
        Path("/srv/k/state.sqlite"),
        Path("/srv/k/kernel.lock"),
        Path("/srv/k/tmp"),
    )
    assert (p.run_dir, p.envs) == (Path("/srv/k/runs"), Path("/srv/k/runs/envs"))
    own = parse('state_dir = "/srv/k"\nrun_dir = "/scratch/r"\n', "<test>", env={}).paths
    assert (own.store, own.run_dir, own.envs) == (
        Path("/srv/k/state.sqlite"),
        Path("/scratch/r"),
        Path("/scratch/r/envs"),
    )
