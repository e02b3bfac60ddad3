"""The submit's evaluation strategy: paired evaluation runs as job rows of the sleep, the verdict, the hook.

A sleep carrying a submit holds `2 x repeats` extra job rows from its acceptance (`evaluate.eval_jobs`:
`submit-base[i]` and `submit-candidate[i]`, pair i; the contract's command, its GPU time reserved like a
launch's). Here:

- `prepare` (once the snapshot is recorded, before anything is submitted; idempotent) decides the plan in one
  transaction: `unchanged` when the snapshot's tree equals the base's, `reuse` when the operator allows it
  (`[verdicts] reuse_base = "same-seeds"`) and a finished base measurement with the same `baseline_key` is
  stored (its seeds come with it, and the verdict names the submit that drew them), `no_base` when the workspace
  has no recorded base, else `run` with fresh private seeds for both sides. Rows that will not run become REUSED or SKIPPED there and their
  reservation is refunded in full; an `unchanged` submit in a sleep with nothing else refunds the sleep too.
  The protected paths the candidate changed are listed from the kernel's repository here (`submit.changed_paths`,
  base tree against snapshot tree; never from the agent's `.git`), a git process run in the workspace's heavy
  pool before that transaction, never on the store worker.
- `specs` gives the evaluation runs their seeds (to the score stage, and to `command` only when there is no
  score stage), the protected files from the base tree, and the operator's score stage; the base runs read
  the base tree. Every tree is read on the node from the kernel's repository of the workspace.
- `precheck` (before the snapshot) makes sure the recorded base is held in the kernel's repository, importing
  it through the verified path when it is not (kernel.io.repo.import_base); a base the agent's `.git` cannot
  give intact refuses the sleep with `snapshot.failed`, nothing charged.
- `run` (for as long as the service runs) holds each workspace's recorded base once per start (`_upgrade`).
- `read_runs` (heavy pool, before the gather transaction) reads each evaluation run's exit record and stdout
  (and its score stage's) from its run directory; `judge` (inside the gather transaction, sqlite only) decides
  from them the verdict (`evaluate.decide`, `kernel.core.paired`), stores it exactly with the report and,
  when the base was measured, the measurement; the wake gets what `[verdicts] disclosure` shows of it
  (`kernel.core.disclosure`, its state moved in the same transaction). The wake shows every evaluation run as a task labelled by a kernel hint;
  a seed that a run's own output printed is blanked from its tails (the seeds stay private).
- `settle` runs `on_verdict`: after the verdict is committed, the operator's command gets the verdict and report as JSON on
  stdin (cwd = state_dir, clean env, a timeout). A failing or hanging hook is logged and recorded; the verdict
  is already in the store and the wake. A kernel killed while a hook runs runs it again at restart.
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import time
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Final, Literal

import anyio.to_thread
import msgspec

from channel.lifecycle import NOT_RUN_TASK_STATES, TaskEvent
from channel.messages import EvalContract, SidePath, Submit, TaskResult, TaskState, Verdict
from channel.paths import RunPaths
from kernel.backends.base import DEFAULT_OUTPUT_MAX_BYTES, BaseFiles, JobSpec, ScoreStage
from kernel.backends.jobscript import read_exit
from kernel.core import disclosure as D
from kernel.core import evaluate as E
from kernel.core import ledger
from kernel.core.config import Config, LiveConfig
from kernel.core.records import JobRow, SleepRow, WorkspaceRow
from kernel.io import crash, hostproc
from kernel.io import log as klog
from kernel.io import repo as R
from kernel.io import submit as S
from kernel.io.snapshot import SnapshotError
from kernel.io.store import StoreWorker, timestamp
from kernel.service.evaluation import RunFiles, Runs
from kernel.service.executor import SleepOrder
from kernel.service.heavy import HeavyPool

_submit_decoder: Final = msgspec.json.Decoder(Submit)
# Workspaces whose base the start's upgrade checks at a time (each check is a git process on a thread).
UPGRADE_WORKERS: Final = 4
HOOK_ENV: Final = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
HOOK: Final = hostproc.declare(
    "on_verdict",
    agent_input="the verdict and the agent's report as JSON on stdin: the operator's hook reads them as data",
    containment="the operator's command (config on_verdict), a clean environment (HOOK_ENV), cwd state_dir, its "
    "own session, the configured hook timeout, at most 1 MiB of output kept",
    output_cap=1 << 20,
)


def read_stdout(run_dir: str | None, name: str = RunPaths.STDOUT) -> str:
    """A run's whole stdout (or its score stage's; the wrapper caps both), for the metric contract."""
    if run_dir is None:
        return ""
    try:
        fd = os.open(Path(run_dir) / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        data = os.read(fd, DEFAULT_OUTPUT_MAX_BYTES + 1)
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace")


def run_hook(argv: Sequence[str], payload: bytes, cwd: str, timeout: float) -> str:
    """Run the operator's hook; returns "ok" or why it failed (never raises for the hook's own failure)."""
    try:
        done = hostproc.run(
            HOOK, argv, input=payload, cwd=cwd, env=HOOK_ENV, timeout=timeout, start_new_session=True
        )
    except hostproc.TimeoutExpired:
        return f"failed: timed out after {timeout:g} s"
    except hostproc.OutputTooLarge:
        return f"failed: printed more than {HOOK.output_cap} bytes"
    except OSError as e:
        return f"failed: could not start {argv[0]!r}: {e.strerror or e}"
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", "replace").strip()[-300:]
        return f"failed: exit status {done.returncode}" + (f": {err}" if err else "")
    return "ok"


class SubmitEvaluation:
    """The `Evaluation` (kernel.service.evaluation) of a kernel whose sleeps may carry a submit."""

    def __init__(self, live: LiveConfig, worker: StoreWorker, heavy: HeavyPool) -> None:
        self.live = live
        self.worker = worker
        self.store = worker.store
        self.heavy = heavy  # the executor's: a base import is heavy work of its workspace
        self.tmp_dir = live.current.paths.tmp
        self._plans: dict[tuple[str, int], S.Plan] = {}
        self._hooking = False
        # One hold at a time per workspace (the start's upgrade and a submit's preflight may meet): the second
        # finds the base held instead of importing it again.
        self._holding: dict[str, anyio.Lock] = {}
        self.hook_argv: tuple[str, ...] = (
            tuple(shlex.split(self.cfg.on_verdict)) if self.cfg.on_verdict else ()
        )
        # Thresholdout's Laplace noise: from the operating system, never a seed an agent could learn.
        self._noise = random.SystemRandom()

    @property
    def cfg(self) -> Config:
        """The running config, read at each use (kernel.core.config.LiveConfig)."""
        return self.live.current

    def repo_of(self, key: str) -> R.KernelRepo:
        """The kernel's own repository of a workspace (snapshots and bases; never the agent's `.git`)."""
        return R.KernelRepo.at(self.cfg.run_dir, key)

    # --- dispatch -----------------------------------------------------------------------------------------

    def _jail_id(self, order: SleepOrder) -> str:
        return f"{self.cfg.jail}:network={order.workspace.policy.network}"

    async def prepare(self, order: SleepOrder, commit: str, tree: str) -> None:
        """Decide a submit's plan: the comparison of the candidate's tree with the base (a git process in the
        workspace's repository) in its heavy pool, the decision on the store worker."""
        key = order.workspace.key
        submit, comparison = await self.worker.call(self._comparison, order)
        if not submit:
            return
        changed: tuple[tuple[str, ...], S.Removed] = ((), S.Removed())
        if comparison is not None:
            base_tree, protected = comparison
            changed = await self.heavy.run(
                key, _protected_changed, order.workspace, self.repo_of(key), base_tree, tree, protected
            )
        await self.worker.call(self._plan, order, commit, tree, changed)

    def _comparison(self, order: SleepOrder) -> tuple[bool, tuple[str, tuple[str, ...]] | None]:
        """(store worker) Whether the sleep carries a submit, and what its plan still needs compared: the base's
        tree and the protected patterns (None when the plan is decided already or nothing is protected)."""
        key, seq = order.workspace.key, order.sleep.seq
        sleep = self.store.sleep(key, seq)
        if sleep is None or sleep.submit is None:
            return False, None
        contract = order.workspace.policy.submit
        base = S.base_of(self.store, key)
        if S.plan_of(self.store, key, seq) is not None or contract is None or not contract.protected:
            return True, None
        return True, None if base is None else (base[1], contract.protected)

    def _plan(
        self, order: SleepOrder, commit: str, tree: str, changed: tuple[tuple[str, ...], S.Removed]
    ) -> None:
        """(store worker) Decide and record the plan (once), with the protected paths the candidate changed and
        the paths the node removes because they could shadow a protected file."""
        key, seq = order.workspace.key, order.sleep.seq
        with self.store.transaction():
            plan = S.plan_of(self.store, key, seq)
            if plan is None:
                plan = self._decide_plan(order, commit, tree, changed)
                S.put_plan(self.store, plan)
                self._skip_unrun(key, seq, plan.decision)
        self._plans[(key, seq)] = plan
        klog.event("submit_planned", ws=key, seq=seq, decision=plan.decision, pairs=len(plan.seeds))

    async def precheck(self, order: SleepOrder) -> None:
        """A sleep carrying a submit needs its base held in the kernel's repository: one recorded but not held
        (refused at enrollment, or left by an older kernel in the agent's repository) is imported now through
        the verified path; when the agent's `.git` cannot give it intact the sleep is refused (`snapshot.failed`,
        the path named, nothing charged)."""
        sleep = await self.worker.call(self.store.sleep, order.workspace.key, order.sleep.seq)
        if sleep is None or sleep.submit is None:
            return
        try:
            await self.hold_base(order.workspace.key, order.workspace.path)
        except R.UntrustedGit as exc:
            raise SnapshotError(
                f"the submit base cannot be taken from the workspace's repository: {exc}"
            ) from None

    def _base_to_hold(self, key: str) -> tuple[tuple[str, str] | None, str | None]:
        with self.store.transaction():
            return S.base_to_hold(self.store, key)

    def _record_held(self, key: str, before: tuple[str, str] | None, got: R.Base) -> None:
        with self.store.transaction():
            S.record_held(self.store, key, before, got)

    async def hold_base(self, key: str, path: str) -> None:
        """Make the kernel's repository hold the recorded base (R.UntrustedGit, R.RepoError when it cannot).
        Nothing recorded: nothing to do (HEAD becomes the base only at enrollment or by `rebase`)."""
        lock = self._holding.setdefault(key, anyio.Lock())
        async with lock:
            await self._hold_base(key, path)

    async def _hold_base(self, key: str, path: str) -> None:
        base, rev = await self.worker.call(self._base_to_hold, key)
        repo = self.repo_of(key)
        if rev is None or (base is not None and await self.heavy.run(key, R.held, repo, base[1])):
            return
        got = await self.heavy.run(key, S.take_base, repo, path, rev, self.tmp_dir)
        if got is not None:
            await self.worker.call(self._record_held, key, base, got)
            klog.event("submit_base_held", ws=key, commit=got.commit[:12], tree=got.tree[:12])

    async def run(self) -> None:
        # The upgrade runs once the workspaces are served (not in `recover`, which start-up waits for): a
        # restart with many enrolled workspaces is ready without a git process per workspace, and a base an
        # automatic enrollment left pending is imported in the background. A submit meanwhile holds its own
        # base first (preflight), so nothing waits on this.
        await self._upgrade()

    async def _upgrade(self) -> None:
        """Once per start: refs an older kernel left under `refs/syscall/` of an agent's repository are reported
        (once per workspace, ever) and never followed; each recorded base is held in the kernel's repository.
        UPGRADE_WORKERS workspaces at a time (the imports themselves go through the bounded heavy pool)."""
        todo = list(await self.worker.call(self.store.workspaces))
        todo.reverse()
        count, started = len(todo), time.monotonic()

        async def worker() -> None:
            while todo:
                await self._upgrade_one(todo.pop())

        async with anyio.create_task_group() as tg:
            for _ in range(UPGRADE_WORKERS):
                tg.start_soon(worker)
        klog.event("bases_checked", workspaces=count, seconds=round(time.monotonic() - started, 1))

    async def _upgrade_one(self, ws: WorkspaceRow) -> None:
        repo = self.repo_of(ws.key)
        try:
            found = await self.heavy.run(ws.key, _legacy_refs_once, repo, ws.path)  # reads the agent's .git
            if found:
                klog.event("legacy_refs_ignored", logging.WARNING, ws=ws.key, path=ws.path, refs=found[:20])
            await self.hold_base(ws.key, ws.path)
        except (R.UntrustedGit, R.RepoError, OSError) as exc:
            klog.event("submit_base_unheld", logging.WARNING, ws=ws.key, problem=str(exc)[:500])

    def _decide_plan(
        self, order: SleepOrder, commit: str, tree: str, changed: tuple[tuple[str, ...], S.Removed]
    ) -> S.Plan:
        ws = order.workspace
        contract = ws.policy.submit
        jobs = {j.launch: j for j in self.store.jobs_of(ws.key, order.sleep.seq)}
        if contract is None:
            # Withdrawn after acceptance: judge by the rows' command; no line carries this metric, so it fails.
            row = jobs[E.EVAL_CANDIDATE]
            contract = EvalContract(command=row.command, metric="contract_withdrawn", repeats=row.array_size)
        base = S.base_of(self.store, ws.key)
        decision: S.Decision = "no_base"
        bkey: str | None = None
        seeds: tuple[int, ...] = ()
        stored: tuple[Decimal, ...] | None = None
        seeds_from: int | None = None
        if base is not None and base[1] == tree:
            decision = "unchanged"
        elif base is not None:
            bkey = E.baseline_key(
                base_tree=base[1],
                contract=contract,
                jail=self._jail_id(order),
                image=self.cfg.apptainer_image or None,
                gpus=jobs[E.EVAL_BASE].gpus,
                backend=self.cfg.backend,
                workspace=None if self.cfg.defaults.share_baselines else ws.key,
            )
            found = S.measurement(self.store, bkey)
            if (
                self.cfg.verdicts.reuse_base == "same-seeds"
                and found is not None
                and len(found.values) == contract.repeats
            ):
                decision = "reuse"
                seeds, stored, seeds_from = found.seeds, found.values, found.seq
            else:
                decision = "run"
                seeds = S.draw_seeds(contract.repeats) if contract.seed else ()
        return S.Plan(
            workspace=ws.key,
            seq=order.sleep.seq,
            decision=decision,
            contract=contract,
            seed=None,
            base_commit=None if base is None else base[0],
            base_tree=None if base is None else base[1],
            candidate_commit=commit,
            candidate_tree=tree,
            baseline_key=bkey,
            reused_values=stored,
            seeds=seeds,
            protected_changed=changed[0] if decision in ("run", "reuse") else (),
            removed=changed[1] if decision in ("run", "reuse") else S.Removed(),
            seeds_from_seq=seeds_from,
        )

    def _skip_unrun(self, key: str, seq: int, decision: S.Decision) -> None:
        """Mark the evaluation rows the plan does not run REUSED or SKIPPED, refunding their whole reservation;
        an `unchanged` submit that is all its sleep carries refunds the sleep as well (it cost nothing)."""
        reused = E.EVAL_BASE if decision == "reuse" else None
        unrun = {"run": (), "reuse": (E.EVAL_BASE,)}.get(decision, E.EVAL_LAUNCHES)
        ws = self.store.workspace(key)
        assert ws is not None
        balance = ws.balance
        now = timestamp()
        jobs = self.store.jobs_of(key, seq)
        for j in jobs:
            if j.launch in unrun and j.state == "PENDING" and j.job_id is None:
                outcome: TaskState = "REUSED" if j.launch == reused else "SKIPPED"
                moved = self.store.advance_task(
                    key,
                    seq,
                    j.launch,
                    j.task,
                    "PENDING",
                    TaskEvent.SKIP,
                    outcome,
                    at=now,
                    ended_at=now,
                    release=True,
                )
                assert moved, (key, seq, j.launch, j.task)  # read in the caller's transaction
                balance = ledger.refund_unrun(balance, j)
        if decision == "unchanged" and all(j.launch in E.EVAL_LAUNCHES for j in jobs):
            balance = ledger.refund_sleep_count(balance)
        self.store.set_balance(key, balance)

    def specs(self, order: SleepOrder, specs: dict[str, JobSpec]) -> dict[str, JobSpec]:
        """The evaluation runs' seeds, protected files and score stage; the base runs read the base tree."""
        plan = self._plans.get((order.workspace.key, order.sleep.seq))
        if plan is None:
            return specs
        c = plan.contract
        base_files = score = None
        if plan.base_commit is not None and plan.base_tree is not None:
            if c.protected:
                base_files = BaseFiles(commit=plan.base_commit, tree=plan.base_tree, patterns=c.protected)
            if c.score is not None:
                from_base = c.score_from == "base"
                score = ScoreStage(
                    command=c.score,
                    data=c.score_data,
                    scorer_commit=plan.base_commit if from_base else None,
                    scorer_tree=plan.base_tree if from_base else None,
                )
        for name in E.EVAL_LAUNCHES:
            spec = specs.get(name)
            if spec is None:
                continue
            if name == E.EVAL_BASE:
                assert plan.base_commit is not None
                assert plan.base_tree is not None
                spec = msgspec.structs.replace(spec, commit=plan.base_commit, tree=plan.base_tree)
            specs[name] = msgspec.structs.replace(
                spec,
                eval_seeds=plan.seeds,
                seeds_to_command=c.score is None,
                base_files=base_files,
                score=score,
            )
        return specs

    def forget(self, order: SleepOrder) -> None:
        self._plans.pop((order.workspace.key, order.sleep.seq), None)

    # --- gathering ----------------------------------------------------------------------------------------

    def read_runs(self, jobs: Sequence[JobRow]) -> Runs:
        """(heavy pool; no store) The run directories of the evaluation runs among `jobs`, as `judge` reads them."""
        runs: dict[tuple[str, int], RunFiles] = {}
        for j in jobs:
            if j.launch not in E.EVAL_LAUNCHES or j.run_dir is None:
                continue
            rec = read_exit(Path(j.run_dir))
            scored = rec is not None and rec.score_code is not None
            runs[(j.launch, j.task)] = RunFiles(
                rec,
                read_stdout(j.run_dir),
                read_stdout(j.run_dir, RunPaths.SCORE_STDOUT) if scored else None,
            )
        return runs

    def judge(
        self, sleep: SleepRow, tasks: tuple[TaskResult, ...], runs: Runs
    ) -> tuple[tuple[TaskResult, ...], Verdict | None]:
        if sleep.submit is None:
            return tasks, None
        key, seq = sleep.workspace, sleep.seq
        plan = S.plan_of(self.store, key, seq)
        if plan is None:  # cannot happen: a submitted sleep was prepared
            return tasks, None
        every = self.store.jobs_of(key, seq)
        rows = [j for j in every if j.launch in E.EVAL_LAUNCHES]
        verdict, public = self._verdict(plan, rows, runs, only_submit=len(rows) == len(every))
        shown = tuple(self._label(t, plan) for t in tasks)
        report = _submit_decoder.decode(sleep.submit).report
        # The exact verdict is the operator's (history --verdicts, the hook); the wake gets what the disclosure
        # mode shows, and the mode's state moves in this same (gather) transaction.
        S.put_verdict(self.store, key, seq, sleep.id, verdict, report, hook=bool(self.hook_argv))
        before = S.disclosure_state(self.store, key)
        disclosed, after = D.disclose(verdict, self.cfg.verdicts, before, public=public, rng=self._noise)
        if after != before:
            S.put_disclosure_state(self.store, key, after)
        klog.event(
            "verdict",
            ws=key,
            seq=seq,
            outcome=verdict.outcome,
            side=verdict.failed_side,
            reused=verdict.baseline_reused,
            trusted=verdict.trusted,
            disclosure=disclosed.disclosure,
            shown=disclosed.outcome,
        )
        return shown, disclosed

    def _verdict(
        self, plan: S.Plan, rows: list[JobRow], runs: Runs, *, only_submit: bool
    ) -> tuple[Verdict, tuple[float, bool] | None]:
        """The exact verdict, and thresholdout's public estimate (evaluate.public_estimate) where there is one."""
        c = plan.contract
        trusted = E.is_trusted(c, self.cfg.jail)
        if plan.decision == "unchanged":
            assert plan.base_commit is not None
            return E.unchanged_verdict(
                c, plan.base_commit, plan.candidate_commit, trusted=trusted, sleep_refunded=only_submit
            ), None
        if plan.decision == "no_base":
            return Verdict(
                outcome="failed",
                metric=c.metric,
                direction=c.direction,
                min_delta=c.min_delta,
                min_relative=c.min_relative,
                failed_side="base",
                reason="the workspace has no recorded base commit (it had no commit when enrolled); the "
                "operator sets one with `syscall-kernel rebase`",
                candidate_commit=plan.candidate_commit,
                trusted=trusted,
                repeats=c.repeats,
            ), None
        assert plan.base_commit is not None
        assert plan.base_tree is not None
        by_task = sorted(rows, key=lambda j: j.task)
        cand = [_run_of(j, runs) for j in by_task if j.launch == E.EVAL_CANDIDATE]
        base: list[E.EvalRun] | list[Decimal]
        if plan.decision == "reuse":
            assert plan.reused_values is not None
            base = list(plan.reused_values)
        else:
            measured = [_run_of(j, runs) for j in by_task if j.launch == E.EVAL_BASE]
            base = measured
            try:
                values = tuple(E.measure(r, c) for r in measured)
            except E.MetricError:
                pass
            else:
                assert plan.baseline_key is not None
                S.put_measurement(self.store, plan.baseline_key, plan.seeds, values, plan.workspace, plan.seq)
        exact = E.decide(
            c,
            base,
            cand,
            seeds=plan.seeds,
            base_tree=plan.base_tree,
            base_commit=plan.base_commit,
            candidate_commit=plan.candidate_commit,
            trusted=trusted,
            baseline_reused=plan.decision == "reuse",
            seeds_from_seq=plan.seeds_from_seq,
            protected_changed=plan.protected_changed,
            shadows_removed=(plan.removed.paths, plan.removed.count),
            scorer_unseen=_unseen(plan, rows, runs),
        )
        return exact, E.public_estimate(c, base, cand, seeds=plan.seeds, base_tree=plan.base_tree)

    @staticmethod
    def _label(t: TaskResult, plan: S.Plan) -> TaskResult:
        if t.launch not in E.EVAL_LAUNCHES:
            return t
        side, commit = (
            ("base", plan.base_commit) if t.launch == E.EVAL_BASE else ("candidate", plan.candidate_commit)
        )
        # The same for every run of a side (its pair is its task index + 1, which the wake's runs table says
        # once), so the markdown wake shows a side's routine runs in one row.
        what = "the operator's eval command" + (
            ", scored by the operator's score command" if plan.contract.score is not None else ""
        )
        label = f"the kernel's evaluation run of the {side} (commit {(commit or '')[:12]}), {what}"
        if t.state == "REUSED":
            by = "an earlier submit" if plan.seeds_from_seq is None else f"submit #{plan.seeds_from_seq}"
            label = (
                f"not run: the {side}'s measurement by {by} with the same contract stands in for it, and the "
                "candidate ran on that submit's private seeds (nothing was charged)"
            )
        elif t.state == "SKIPPED":
            why = (
                "the candidate's tree equals the base's"
                if plan.decision == "unchanged"
                else "there is no base to compare against"
            )
            label = f"not run: {why} (nothing was charged)"
        elif t.state in NOT_RUN_TASK_STATES:
            label = f"not run ({t.state})"
        return msgspec.structs.replace(
            t,
            hint=label if t.hint is None else f"{label}; {t.hint}",
            stdout_tail=_blank_seeds(t.stdout_tail, plan.seeds),
            stderr_tail=_blank_seeds(t.stderr_tail, plan.seeds),
        )

    # --- the operator's hook ------------------------------------------------------------------------------

    def _pending_hooks(self) -> list[tuple[str, int, bytes]]:
        out = []
        for v in S.verdicts(self.store, hook_pending=True):
            ws = self.store.workspace(v.workspace)
            path = ws.path if ws is not None else ""
            out.append(
                (
                    v.workspace,
                    v.seq,
                    E.hook_payload(v.workspace, path, v.sleep_id, v.seq, v.verdict, v.report),
                )
            )
        return out

    async def settle(self) -> None:
        """Run the operator's hook for every verdict whose hook has not run (one pass at a time)."""
        if not self.hook_argv or self._hooking:
            return
        self._hooking = True
        try:
            for key, seq, payload in await self.worker.call(self._pending_hooks):
                # A plain thread: the operator's hook (kernel's own, run in state_dir, killed after
                # on_verdict_timeout_seconds), one at a time; no workspace's files are touched.
                status = await anyio.to_thread.run_sync(
                    run_hook, self.hook_argv, payload, self.cfg.state_dir, self.cfg.on_verdict_timeout_seconds
                )
                if status != "ok":
                    klog.event("on_verdict_failed", logging.WARNING, ws=key, seq=seq, problem=status)
                else:
                    klog.event("on_verdict_ran", ws=key, seq=seq)
                await self.worker.call(S.set_hook_status, self.store, key, seq, status)
        finally:
            self._hooking = False


def _protected_changed(
    ws: WorkspaceRow, repo: R.KernelRepo, base_tree: str, tree: str, protected: tuple[str, ...]
) -> tuple[tuple[str, ...], S.Removed]:
    """(heavy pool) The protected paths the candidate's tree changed against the base's, and the paths of both
    trees the node removes because they could shadow a protected file, from the kernel's repository of `ws`
    (the wake lists them); none when they cannot be compared (logged)."""
    crash.hang_point("diff", ws.path)
    try:
        return (
            S.changed_paths(repo, base_tree, tree, protected),
            S.shadows_removed(repo, base_tree, tree, protected),
        )
    except (R.RepoError, OSError) as exc:
        klog.event("submit_diff_failed", logging.WARNING, ws=ws.key, problem=str(exc)[:300])
        return (), S.Removed()


def _unseen(plan: S.Plan, rows: list[JobRow], runs: Runs) -> tuple[tuple[SidePath, ...], int]:
    """The paths of the sides' trees that the score stage's copy left out (from each run's exit record, the
    wrapper's list): the distinct ones (up to S.PATHS_KEPT), and the most that one run's copy left out."""
    if plan.contract.score is None:
        return (), 0
    shown: dict[SidePath, None] = {}
    count = 0
    for row in sorted(rows, key=lambda j: (j.launch, j.task)):
        got = runs.get((row.launch, row.task))
        rec = None if got is None else got.exit
        if rec is None:
            continue
        side: Literal["base", "candidate"] = "base" if row.launch == E.EVAL_BASE else "candidate"
        count = max(count, rec.score_unseen_count)
        for u in rec.score_unseen:
            if len(shown) < S.PATHS_KEPT:
                shown.setdefault(SidePath(side=side, path=u.path, why=u.why))
    return tuple(shown), count


def _legacy_refs_once(repo: R.KernelRepo, path: str) -> list[str]:
    """Names of refs an older kernel left in the workspace's `.git`, the first time only (a marker in the
    kernel's repository remembers it was said); nothing there is followed or changed."""
    repo.ensure()
    marker = repo.path / R.LEGACY_REPORTED
    if marker.exists():
        return []
    try:
        fd = R.open_dot_git(path)
    except R.UntrustedGit:
        return []
    try:
        found = R.legacy_refs(fd)
    finally:
        os.close(fd)
    marker.touch()
    return found


def _run_of(row: JobRow, runs: Runs) -> E.EvalRun:
    got = runs.get((row.launch, row.task))
    if got is None:  # never handed over: no run directory
        return E.EvalRun(exit_code=row.exit_code, stdout="", state=row.state)
    score_code = None if got.exit is None else got.exit.score_code
    return E.EvalRun(
        exit_code=row.exit_code,
        stdout=got.stdout,
        state=row.state,
        score_code=score_code,
        score_stdout=None if score_code is None else got.score_stdout,
    )


def _blank_seeds(text: str, seeds: tuple[int, ...]) -> str:
    """`text` with every seed's decimal digits blanked (a run that prints its EVAL_SEED does not show it)."""
    for seed in sorted(seeds, key=lambda s: -len(str(s))):
        text = text.replace(str(seed), "[seed]")
    return text
