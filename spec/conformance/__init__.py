"""`syscall-conformance`: certify a kernel or a client of the syscall channel protocol (CONFORMANCE.md).

Pure core: `vectors` (loading, placing and judging the vectors), `checks` (what each behavioural MUST looks
like from outside), `report` (table, JUnit, exit code). Thin I/O drivers: `inotify`, `kernel_mode`,
`client_mode`, `cli`. Nothing here imports `kernel` or `tool`: the runner sees an implementation only through
its channel's files.
"""
