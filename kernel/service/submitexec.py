"""The executor with submit: paired evaluation runs as job rows of the sleep, the verdict at gathering, the hook.

A sleep carrying a submit holds two extra job rows from its acceptance (`evaluate.eval_jobs`: `submit-base` and
`submit-candidate`, the contract's command, its GPU time reserved like a launch's). Here:

- `prepare` (once the snapshot is recorded, before anything is submitted; idempotent) decides the plan in one
  transaction: `unchanged` when the snapshot's tree equals the base's, `reuse` when a finished baseline with the
  same `baseline_key` is stored, `no_base` when the workspace has no recorded base, else `run`. Rows that will
  not run are cancelled there and their reservation refunded in full (nothing is charged for them).
- `specs_of` gives both evaluation runs the workspace's seed as `EVAL_SEED` and points the base run at the base
  commit and tree; they run on the workspace's backend and jail next to the sleep's launches.
- `judge` (inside the gather transaction) reads each side's full stdout from its run directory, decides the
  verdict (`evaluate.decide`), stores it with the report and, when the base was measured, the baseline. The
  wake shows the runs that happened as tasks (tails fenced as job output) labelled by a kernel-written hint.
- `on_verdict`: after the verdict is committed, the operator's command gets the verdict and report as JSON on
  stdin (cwd = state_dir, clean env, a timeout). A failing or hanging hook is logged and recorded; the verdict
  is already in the store and the wake. A kernel killed while a hook runs runs it again at restart.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Final

import anyio.to_thread
import msgspec

from channel.lifecycle import TaskEvent, next_task_state
from channel.messages import EvalContract, JobRef, Submit, TaskResult, Verdict
from channel.paths import RunPaths
from kernel.backends.base import DEFAULT_OUTPUT_MAX_BYTES, JobSpec, RunnableBackend
from kernel.core import evaluate as E
from kernel.core.budget import release
from kernel.core.config import Config
from kernel.core.records import JobRow, SleepRow
from kernel.io import log as klog
from kernel.io import submit as S
from kernel.io.store import StoreWorker, timestamp
from kernel.service.execute import RealExecutor
from kernel.service.executor import SleepOrder

_submit_decoder: Final = msgspec.json.Decoder(Submit)
HOOK_ENV: Final = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def read_stdout(run_dir: str | None) -> str:
    """A side's whole stdout (the wrapper caps it), for the metric contract."""
    if run_dir is None:
        return ""
    try:
        fd = os.open(
            Path(run_dir) / RunPaths.STDOUT, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        )
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
        done = subprocess.run(
            list(argv),
            input=payload,
            cwd=cwd,
            env=dict(HOOK_ENV),
            capture_output=True,
            timeout=timeout,
            check=False,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return f"failed: timed out after {timeout:g} s"
    except OSError as e:
        return f"failed: could not start {argv[0]!r}: {e.strerror or e}"
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", "replace").strip()[-300:]
        return f"failed: exit status {done.returncode}" + (f": {err}" if err else "")
    return "ok"


class SubmitExecutor(RealExecutor):
    def __init__(self, cfg: Config, worker: StoreWorker, backend: RunnableBackend) -> None:
        super().__init__(cfg, worker, backend, judge=self._judge)
        self._plans: dict[tuple[str, int], S.Plan] = {}
        self._hooking = False
        self.hook_argv: tuple[str, ...] = tuple(shlex.split(cfg.on_verdict)) if cfg.on_verdict else ()

    def _setup(self) -> None:
        super()._setup()
        S.ensure_schema(self.store)

    # --- dispatch -----------------------------------------------------------------------------------------

    def _jail_id(self, order: SleepOrder) -> str:
        return f"{self.cfg.jail}:network={order.workspace.policy.network}"

    def prepare(self, order: SleepOrder, commit: str, tree: str) -> None:
        key, seq = order.workspace.key, order.sleep.seq
        sleep = self.store.sleep(key, seq)
        if sleep is None or sleep.submit is None:
            return
        self._hold_base(order.workspace.path, key)
        with self.store.transaction():
            plan = S.plan_of(self.store, key, seq)
            if plan is None:
                plan = self._decide_plan(order, commit, tree)
                S.put_plan(self.store, plan)
                self._cancel_unrun(key, seq, plan.decision)
        self._plans[(key, seq)] = plan
        klog.event("submit_planned", ws=key, seq=seq, decision=plan.decision)

    def _hold_base(self, path: str, key: str) -> None:
        """Re-point the base ref at the recorded base if the agent moved or deleted it (the base run reads the
        commit it holds). A base commit already gone stays gone: the base run then fails and the verdict says so."""
        base = S.base_of(self.store, key)
        if base is None:
            return
        try:
            S.hold_base(path, key, base[0])
        except (S.BaseError, OSError, subprocess.TimeoutExpired) as exc:
            klog.event("submit_base_unheld", logging.WARNING, ws=key, problem=str(exc)[:300])

    def _decide_plan(self, order: SleepOrder, commit: str, tree: str) -> S.Plan:
        ws = order.workspace
        contract = ws.policy.submit
        jobs = {j.launch: j for j in self.store.jobs_of(ws.key, order.sleep.seq)}
        if contract is None:
            # Withdrawn after acceptance: judge by the rows' command; no line carries this metric, so it fails.
            contract = EvalContract(command=jobs[E.EVAL_CANDIDATE].command, metric="contract_withdrawn")
        seed = S.seed_of(self.store, ws.key) if contract.seed else None
        base = S.base_of(self.store, ws.key)
        decision: S.Decision = "no_base"
        bkey: str | None = None
        stored: Decimal | None = None
        if base is not None and base[1] == tree:
            decision = "unchanged"
        elif base is not None:
            bkey = E.baseline_key(
                base_tree=base[1],
                contract=contract,
                seed=seed,
                jail=self._jail_id(order),
                image=self.cfg.apptainer_image or None,
                gpus=jobs[E.EVAL_BASE].gpus,
                backend=self.cfg.backend,
            )
            stored = S.baseline(self.store, bkey)
            decision = "run" if stored is None else "reuse"
        return S.Plan(
            workspace=ws.key,
            seq=order.sleep.seq,
            decision=decision,
            contract=contract,
            seed=seed,
            base_commit=None if base is None else base[0],
            base_tree=None if base is None else base[1],
            candidate_commit=commit,
            candidate_tree=tree,
            baseline_key=bkey,
            reused_value=stored,
        )

    def _cancel_unrun(self, key: str, seq: int, decision: S.Decision) -> None:
        """Cancel the evaluation rows the plan does not run, refunding their whole reservation."""
        unrun = {"run": (), "reuse": (E.EVAL_BASE,)}.get(decision, E.EVAL_LAUNCHES)
        ws = self.store.workspace(key)
        assert ws is not None
        balance = ws.balance
        now = timestamp()
        for j in self.store.jobs_of(key, seq):
            if j.launch in unrun and j.state == "PENDING" and j.job_id is None:
                balance = release(balance, j.reserved_gpu_s, 0)
                state = next_task_state(j.state, TaskEvent.CANCEL)
                self.store.update_job(replace(j, state=state, reserved_gpu_s=0, ended_at=now, updated_at=now))
        self.store.set_balance(key, balance)

    def specs_of(
        self, order: SleepOrder, commit: str, tree: str, jobs: Sequence[JobRow]
    ) -> dict[str, JobSpec]:
        specs = super().specs_of(order, commit, tree, jobs)
        plan = self._plans.get((order.workspace.key, order.sleep.seq))
        if plan is None:
            return specs
        seed = None if plan.seed is None else str(plan.seed)
        for name in E.EVAL_LAUNCHES:
            spec = specs.get(name)
            if spec is None:
                continue
            if name == E.EVAL_BASE:
                assert plan.base_commit is not None
                assert plan.base_tree is not None
                spec = msgspec.structs.replace(spec, commit=plan.base_commit, tree=plan.base_tree)
            specs[name] = msgspec.structs.replace(spec, eval_seed=seed)
        return specs

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        try:
            return await super().dispatch(order)
        finally:
            self._plans.pop((order.workspace.key, order.sleep.seq), None)

    # --- gathering ----------------------------------------------------------------------------------------

    def _judge(
        self, sleep: SleepRow, tasks: tuple[TaskResult, ...]
    ) -> tuple[tuple[TaskResult, ...], Verdict | None]:
        if sleep.submit is None:
            return tasks, None
        key, seq = sleep.workspace, sleep.seq
        plan = S.plan_of(self.store, key, seq)
        if plan is None:  # cannot happen: a submitted sleep was prepared
            return tasks, None
        rows = {j.launch: j for j in self.store.jobs_of(key, seq) if j.launch in E.EVAL_LAUNCHES}
        verdict = self._verdict(plan, rows)
        shown = tuple(self._label(t, plan) for t in tasks if not self._unrun(t, plan))
        report = _submit_decoder.decode(sleep.submit).report
        S.put_verdict(self.store, key, seq, sleep.id, verdict, report, hook=bool(self.hook_argv))
        klog.event(
            "verdict",
            ws=key,
            seq=seq,
            outcome=verdict.outcome,
            side=verdict.failed_side,
            reused=verdict.baseline_reused,
        )
        return shown, verdict

    def _verdict(self, plan: S.Plan, rows: dict[str, JobRow]) -> Verdict:
        c = plan.contract
        if plan.decision == "unchanged":
            assert plan.base_commit is not None
            return E.unchanged_verdict(c, plan.base_commit, plan.candidate_commit)
        if plan.decision == "no_base":
            return Verdict(
                outcome="failed",
                metric=c.metric,
                direction=c.direction,
                min_delta=c.min_delta,
                min_relative=c.min_relative,
                seed=plan.seed,
                failed_side="base",
                reason="the workspace has no recorded base commit (it had no commit when enrolled); the "
                "operator sets one with `syscall-kernel rebase`",
                candidate_commit=plan.candidate_commit,
            )
        assert plan.base_commit is not None
        cand = _run_of(rows[E.EVAL_CANDIDATE])
        base: E.EvalRun | Decimal
        if plan.decision == "reuse":
            assert plan.reused_value is not None
            base = plan.reused_value
        else:
            base = _run_of(rows[E.EVAL_BASE])
            try:
                value = E.measure(base, c.metric)
            except E.MetricError:
                pass
            else:
                assert plan.baseline_key is not None
                S.put_baseline(self.store, plan.baseline_key, value, plan.workspace, plan.seq)
        return E.decide(
            c,
            base,
            cand,
            seed=plan.seed,
            base_commit=plan.base_commit,
            candidate_commit=plan.candidate_commit,
            baseline_reused=plan.decision == "reuse",
        )

    @staticmethod
    def _unrun(t: TaskResult, plan: S.Plan) -> bool:
        if t.launch == E.EVAL_BASE:
            return plan.decision != "run"
        if t.launch == E.EVAL_CANDIDATE:
            return plan.decision not in ("run", "reuse")
        return False

    @staticmethod
    def _label(t: TaskResult, plan: S.Plan) -> TaskResult:
        if t.launch not in E.EVAL_LAUNCHES:
            return t
        side, commit = (
            ("base", plan.base_commit) if t.launch == E.EVAL_BASE else ("candidate", plan.candidate_commit)
        )
        label = f"the kernel's evaluation run of the {side} (commit {(commit or '')[:12]}), the operator's eval command"
        return msgspec.structs.replace(t, hint=label if t.hint is None else f"{label}; {t.hint}")

    # --- the operator's hook ------------------------------------------------------------------------------

    async def _tick(self) -> None:
        await super()._tick()
        await self._run_hooks()

    async def _maybe_gather(self, key: str, seq: int) -> None:
        await super()._maybe_gather(key, seq)
        await self._run_hooks()

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

    async def _run_hooks(self) -> None:
        if not self.hook_argv or self._hooking:
            return
        self._hooking = True
        try:
            for key, seq, payload in await self._call(self._pending_hooks):
                status = await anyio.to_thread.run_sync(
                    run_hook, self.hook_argv, payload, self.cfg.state_dir, self.cfg.on_verdict_timeout_seconds
                )
                if status != "ok":
                    klog.event("on_verdict_failed", logging.WARNING, ws=key, seq=seq, problem=status)
                else:
                    klog.event("on_verdict_ran", ws=key, seq=seq)
                await self._call(S.set_hook_status, self.store, key, seq, status)
        finally:
            self._hooking = False


def _run_of(row: JobRow) -> E.EvalRun:
    return E.EvalRun(exit_code=row.exit_code, stdout=read_stdout(row.run_dir), state=row.state)
