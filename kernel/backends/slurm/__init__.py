"""The Slurm backend's pure core: sbatch argv, squeue/sacct commands and parsers, classification.

No I/O here: the backend runs the commands and feeds their exit status and text to these functions, so every
Slurm quirk is covered by table tests on golden text (tests/unit/test_slurm_*.py) and proven against a real
throwaway cluster (tests/integration/test_slurm_cluster.py).
"""

from kernel.backends.slurm.classify import (
    Classification,
    Resolution,
    classify_exit_file,
    classify_state,
    pending_verdict,
    poll_interval,
    resolve_task,
)
from kernel.backends.slurm.errors import SlurmOutputError
from kernel.backends.slurm.ids import JobId, parse_job_id
from kernel.backends.slurm.query import (
    SacctResult,
    SacctRow,
    SqueueResult,
    SqueueRow,
    TaskKey,
    clusters_args,
    parse_sacct,
    parse_squeue,
    read_sacct,
    read_squeue,
    sacct_argv,
    scancel_argv,
    squeue_argv,
    squeue_by_name_argv,
)
from kernel.backends.slurm.submit import (
    SbatchJob,
    SbatchPolicy,
    Submitted,
    job_comment,
    job_name,
    parse_job_name,
    parse_sbatch_output,
    render_sbatch_argv,
    sbatch_failure,
)

__all__ = [
    "Classification",
    "JobId",
    "Resolution",
    "SacctResult",
    "SacctRow",
    "SbatchJob",
    "SbatchPolicy",
    "SlurmOutputError",
    "SqueueResult",
    "SqueueRow",
    "Submitted",
    "TaskKey",
    "classify_exit_file",
    "classify_state",
    "clusters_args",
    "job_comment",
    "job_name",
    "parse_job_id",
    "parse_job_name",
    "parse_sacct",
    "parse_sbatch_output",
    "parse_squeue",
    "pending_verdict",
    "poll_interval",
    "read_sacct",
    "read_squeue",
    "render_sbatch_argv",
    "resolve_task",
    "sacct_argv",
    "sbatch_failure",
    "scancel_argv",
    "squeue_argv",
    "squeue_by_name_argv",
]
