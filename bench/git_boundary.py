"""What the kernel-owned repository costs: snapshot, verified base import and job materialisation.

For workspaces of N files (1 KiB each, in directories of 100, plus a 20 MiB file), one JSON object per scenario:
the median and p90 of `--samples` runs of
- `snapshot`: kernel.io.snapshot.snapshot_sync (index copy, listing, the kernel reading every file, fast-import
  into the kernel's repository), after one file changed;
- `import_base`: kernel.io.repo.import_base (copy of the object store, every object re-hashed, import);
- `materialise`: the job wrapper writing the tree from the kernel's repository (every blob re-hashed, the tree
  id recomputed);
and, measured in the same run as baselines, plain git doing the nearest unverified thing: `git add -A` +
`git write-tree` against a temporary index (snapshot), and `git archive HEAD | tar -x` (materialise).

    .venv/bin/python bench/git_boundary.py --files 100,1000,5000 --samples 9
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernel.io import repo as R  # noqa: E402
from kernel.io import snapshot as S  # noqa: E402
from kernel.node import wrapper as W  # noqa: E402

ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_SYSTEM": "/dev/null",
    "GIT_AUTHOR_NAME": "b",
    "GIT_AUTHOR_EMAIL": "b@example.invalid",
    "GIT_COMMITTER_NAME": "b",
    "GIT_COMMITTER_EMAIL": "b@example.invalid",
}


def git(ws: Path, *args: str, **kw: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=ws, env=ENV, check=True, capture_output=True, **kw)  # type: ignore[call-overload,no-any-return]


def make_workspace(root: Path, files: int) -> Path:
    ws = root / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    for i in range(files):
        d = ws / f"d{i // 100:03d}"
        d.mkdir(exist_ok=True)
        (d / f"f{i:05d}.py").write_bytes(os.urandom(512).hex().encode())
    (ws / "big.bin").write_bytes(os.urandom(20 << 20))
    git(ws, "add", "-A")
    git(ws, "commit", "-qm", "base")
    return ws


def timed(fn: Callable[[], object], samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary(name: str, files: int, xs: list[float]) -> dict[str, object]:
    xs = sorted(xs)
    return {
        "scenario": name,
        "files": files + 1,
        "samples": len(xs),
        "p50_ms": round(statistics.median(xs) * 1000, 1),
        "p90_ms": round(xs[min(len(xs) - 1, int(len(xs) * 0.9))] * 1000, 1),
    }


def run(files: int, samples: int) -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="bench-git-") as t:
        root = Path(t)
        ws = make_workspace(root, files)
        repo = R.KernelRepo.at(root / "run", "bench-0123456789")
        repo.ensure()
        ktmp = root / "ktmp"
        seq = [0]

        def snapshot() -> S.Snapshot:
            seq[0] += 1
            (ws / "d000" / "f00000.py").write_text(f"changed {seq[0]}\n")
            return S.snapshot_sync(ws, repo, seq[0], tmp_dir=ktmp)

        def import_base() -> None:
            R.import_base(repo, ws, "HEAD", tmp_dir=ktmp)

        snap = snapshot()
        cfg = {
            "repo": str(repo.path),
            "tree": snap.tree,
            "env": R.neutral_env(str(repo.path)),
            "protected": None,
        }

        def materialise() -> None:
            scratch = Path(tempfile.mkdtemp(dir=root))
            (scratch / "tree").mkdir()
            W.materialise(cfg, str(scratch / "tree"), str(scratch))
            shutil.rmtree(scratch)

        def plain_snapshot() -> None:
            index = root / "plain-index"
            index.unlink(missing_ok=True)
            env = {**ENV, "GIT_INDEX_FILE": str(index)}
            subprocess.run(["git", "add", "-A"], cwd=ws, env=env, check=True)
            subprocess.run(["git", "write-tree"], cwd=ws, env=env, check=True, capture_output=True)

        def plain_materialise() -> None:
            out = Path(tempfile.mkdtemp(dir=root))
            archive = subprocess.Popen(["git", "archive", "HEAD"], cwd=ws, env=ENV, stdout=subprocess.PIPE)
            subprocess.run(["tar", "-x", "-C", str(out)], stdin=archive.stdout, check=True)
            archive.wait()
            shutil.rmtree(out)

        return [
            summary("snapshot", files, timed(snapshot, samples)),
            summary("baseline: git add -A + write-tree", files, timed(plain_snapshot, samples)),
            summary("import_base", files, timed(import_base, samples)),
            summary("materialise", files, timed(materialise, samples)),
            summary("baseline: git archive | tar -x", files, timed(plain_materialise, samples)),
        ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default="100,1000,5000")
    ap.add_argument("--samples", type=int, default=9)
    args = ap.parse_args()
    for n in (int(x) for x in args.files.split(",")):
        for row in run(n, args.samples):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
