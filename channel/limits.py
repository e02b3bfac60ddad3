"""Every protocol limit, stated once.

The Structs in `channel.messages` annotate their fields with these numbers (so the JSON Schema carries them),
the decoder enforces them, `kernel.json` publishes them to the tool, and `spec/PROTOCOL.md` quotes them.
Policy limits (a workspace's ceilings, set by the operator) live in `channel.messages.Policy`; the numbers here
are the protocol's absolute bounds, which no policy can widen.
"""

from typing import Final

PROTOCOL_VERSION: Final = 1

REQUEST_MAX_BYTES: Final = 64 * 1024
JSON_MAX_DEPTH: Final = 16

# Anchored by lookarounds, not `^`/`$`: `(?<![\s\S])` holds only at the start of the string and `(?![\s\S])`
# only at its end, in ECMA-262 (JSON Schema), Python `re`, PCRE and Oniguruma (jq) alike, whether the engine
# searches or matches whole; `$` would also match before a final newline in Python and Oniguruma.
ID_PATTERN: Final = r"(?<![\s\S])[a-z0-9][a-z0-9-]{0,63}(?![\s\S])"
NAME_PATTERN: Final = r"(?<![\s\S])[a-z0-9][a-z0-9-]{0,31}(?![\s\S])"
# The launch names of a submit's evaluation runs: a launch may not take them in a sleep that carries a submit.
EVAL_LAUNCH_NAMES: Final = ("submit-base", "submit-candidate")

MAX_LAUNCHES: Final = 8
COMMAND_MAX_CHARS: Final = 2000
MINUTES_MIN: Final = 1
MINUTES_DEFAULT: Final = 30
MINUTES_CEILING: Final = 7 * 24 * 60  # no policy may allow more than a week
GPUS_CEILING: Final = 64
# A launch's own memory (MB) and CPUs per task (absent: the site's default); no policy may allow more.
MEM_MB_MIN: Final = 16
MEM_MB_CEILING: Final = 4 * 1024 * 1024  # 4 TiB
CPUS_CEILING: Final = 1024
ARRAY_MAX: Final = 16
MAX_ARTIFACTS: Final = 8
ARTIFACT_MAX_CHARS: Final = 500
WHY_MAX_CHARS: Final = 200
NOTE_MAX_CHARS: Final = 2000
REPORT_MAX_CHARS: Final = 8000
CANCEL_MAX_NAMES: Final = MAX_LAUNCHES * 4
# A sleep's `wake_on` (spec 4.4.1): when it wakes. `all` (every task ended), `first-failure`, `first-exit`, or a
# count of ended tasks, at most every task a sleep can have; `rest` says what the early wake does with the others.
WAKE_ON_CONDITIONS: Final = ("all", "first-failure", "first-exit")
WAKE_ON_MAX: Final = MAX_LAUNCHES * ARRAY_MAX
REST_CHOICES: Final = ("run", "cancel")
HISTORY_MAX: Final = 100
HISTORY_DEFAULT: Final = 20
# A launch's sweep (spec 4.4.6): named axes of values whose cartesian product is the launch's array. A key names
# the task's variable `SWEEP_<KEY>` (upper-cased), so it is lowercase and not one of the names the kernel sets
# itself; a value is a plain token (no blank, quote, `|`, `,` or `=`), so it reads the same in the environment,
# on the tool's command line and in a wake's table.
SWEEP_MAX_KEYS: Final = 4
SWEEP_KEY_PATTERN: Final = r"(?<![\s\S])[a-z][a-z0-9_]{0,31}(?![\s\S])"
SWEEP_RESERVED_KEYS: Final = ("index", "params")
SWEEP_VALUE_PATTERN: Final = r"(?<![\s\S])[A-Za-z0-9._+:/-]{1,64}(?![\s\S])"
# A launch's `rank` and history's `metric`: a key of the tasks' last JSON line, `-` first when higher is better.
METRIC_KEY_PATTERN: Final = r"(?<![\s\S])-?[A-Za-z_][A-Za-z0-9_.:/-]{0,63}(?![\s\S])"

# The submit contract (operator-set; the kernel refuses a config or enrollment beyond these).
REPEATS_MAX: Final = 16  # pairs per submit (each pair is one base and one candidate run)
PROTECTED_MAX: Final = 64  # protected path patterns
PROTECTED_MAX_CHARS: Final = 256
PATH_MAX_CHARS: Final = 4096

# Kernel-written sizes. A tail is whole lines (the last line alone is cut if it is longer than the byte cap).
TAIL_MAX_BYTES: Final = 4000
TAIL_MAX_LINES: Final = 40
RESULT_MAX_CHARS: Final = 2000
LOG_MAX_BYTES: Final = 16 * 1024 * 1024
# Kernel-side snapshot limits (the operator's `[snapshot]`): a workspace past one is refused `snapshot.too_large`.
SNAPSHOT_MAX_FILES: Final = 200_000
SNAPSHOT_MAX_BYTES: Final = 2 * 1024 * 1024 * 1024
SNAPSHOT_MAX_DEPTH: Final = 64
# `tail` (a running task's output so far): lines asked for by default and at most, and the answer's byte cap.
TAIL_VERB_DEFAULT_LINES: Final = 20
TAIL_VERB_MAX_LINES: Final = 200
TAIL_VERB_MAX_BYTES: Final = 16000

# Policy defaults (operator-configurable per workspace, never above the ceilings above).
POLICY_MAX_MINUTES: Final = 240
POLICY_MAX_GPUS: Final = 8
POLICY_MAX_MEM_MB: Final = 65536
POLICY_MAX_CPUS: Final = 16
# Sleeps a workspace may have in flight at once (accepted, not yet gathered); no policy may allow more.
POLICY_MAX_SLEEPS_IN_FLIGHT: Final = 4
SLEEPS_IN_FLIGHT_CEILING: Final = 16
BUDGET_LAUNCHES: Final = 100
BUDGET_SLEEPS: Final = 50
BUDGET_GPU_HOURS: Final = 100.0
