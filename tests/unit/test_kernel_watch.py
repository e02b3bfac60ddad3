"""The watch-mode decision: network filesystems are polled, local ones watched."""

from __future__ import annotations

import pytest

from kernel.io.watch import choose_mode, fs_type_of, is_network_fs, parse_mountinfo

MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
40 22 0:35 / /home rw,relatime shared:20 - nfs4 srv:/home rw,vers=4.2
41 40 0:36 / /home/fast rw shared:21 - xfs /dev/sdb rw
42 22 0:37 / /scratch rw shared:22 - lustre 10.0.0.1@o2ib:/scratch rw
43 22 0:38 / /mnt/my\\040disk rw shared:23 - fuse.sshfs host:/x rw
44 22 0:39 / /gpfs rw - gpfs gpfs0 rw
"""


def test_parse_mountinfo_unescapes_mount_points() -> None:
    mounts = parse_mountinfo(MOUNTINFO + "garbage line\n")
    assert ("/mnt/my disk", "fuse.sshfs") in mounts
    assert len(mounts) == 6


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/", "ext4"),
        ("/srv/ws", "ext4"),
        ("/home/alice/ws", "nfs4"),
        ("/home/fast/ws", "xfs"),
        ("/homework", "ext4"),
        ("/scratch/a", "lustre"),
        ("/mnt/my disk/ws", "fuse.sshfs"),
        ("/gpfs/p", "gpfs"),
    ],
)
def test_longest_mount_prefix_wins(path: str, fstype: str) -> None:
    assert fs_type_of(path, parse_mountinfo(MOUNTINFO)) == fstype


@pytest.mark.parametrize(
    ("fstype", "network"),
    [
        ("ext4", False),
        ("xfs", False),
        ("tmpfs", False),
        ("overlay", False),
        ("nfs", True),
        ("nfs4", True),
        ("lustre", True),
        ("gpfs", True),
        ("cifs", True),
        ("ceph", True),
        ("fuse.sshfs", True),
        ("beegfs", True),
    ],
)
def test_network_filesystems(fstype: str, network: bool) -> None:
    assert is_network_fs(fstype) is network


def test_choose_mode() -> None:
    assert choose_mode("auto", "nfs4") == "poll"
    assert choose_mode("auto", "ext4") == "inotify"
    assert choose_mode("inotify", "nfs4") == "inotify"
    assert choose_mode("poll", "ext4") == "poll"
