"""The one error the pure Slurm layer raises for text it reads: output of a Slurm client that is not what it must be."""

from __future__ import annotations


class SlurmOutputError(ValueError):
    """Output of sbatch/squeue/sacct that cannot be understood; the message quotes the offending text."""
