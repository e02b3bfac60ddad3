"""Backends that run job wrappers: `local` (embedded: laptops, tests, the demo) and, later, `slurm`."""
