"""Bytes -> a request, or a `Rejected` answer saying exactly what is wrong and where.

The checks run in the order the spec fixes (section 4): the file (size, UTF-8), the JSON (syntax, duplicate
keys, non-finite numbers, depth, lone surrogates), the shape (type tag, fields, JSON types, via msgspec with the
limits annotated on the Structs), then the rules a schema cannot say (id equals stem, unique launch names,
artifact path form, one-line `why`). Policy checks (a workspace's ceilings) are separate: `check_policy`.

The stdlib parser is used for the JSON stage because msgspec silently keeps the last of duplicate keys, which
another client's parser may resolve the other way; we refuse them instead. The shape stage then decodes the same
bytes with msgspec's typed decoder, which is several times faster than converting the parsed objects.

Messages quote at most `ECHO_MAX_CHARS` characters of any agent-written string, so an answer never carries a
large part of the request back (nor lets a request smuggle long text into the model's context as if from us).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

import msgspec

from channel import limits as L
from channel.errors import CODES
from channel.messages import (
    VERBS,
    ErrorInfo,
    Launch,
    Policy,
    Rejected,
    Request,
    SleepRequest,
)
from channel.sweep import sweep_problem

ECHO_MAX_CHARS: Final = 64
INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**63 - 1

_ID_RE: Final = re.compile(L.ID_PATTERN)
# A member name written `.name` in a path (section 1.4); any other is written `["name"]`.
_MEMBER_RE: Final = re.compile(r"[A-Za-z0-9_]+")
_REQUEST_DECODER: Final = msgspec.json.Decoder(Request)
_BOM: Final = b"\xef\xbb\xbf"
# Control characters are Unicode category Cc: C0, DEL and C1 (U+0080-U+009F, which include NEL, a line break).
_CONTROL_RE: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_PATH_CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_WHY_BAD_RE: Final = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# "blank" is judged on ASCII whitespace only, so that every implementation agrees on it
_ASCII_SPACE: Final = " \t\n\r\x0b\x0c"


class RequestError(Exception):
    """A request fault, carrying its code, a message for the model, and the JSON path."""

    def __init__(self, code: str, message: str, path: str | None = None) -> None:
        assert code in CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
        self.path = path

    def info(self) -> ErrorInfo:
        return ErrorInfo(code=self.code, message=self.message, path=self.path)


def is_valid_id(stem: str) -> bool:
    return _ID_RE.fullmatch(stem) is not None


def rejected(request_id: str, err: RequestError) -> Rejected:
    return Rejected(protocol=L.PROTOCOL_VERSION, id=request_id, error=err.info())


def decode_request(data: bytes, stem: str) -> Request | Rejected:
    """Decode one committed request file named `<stem>.json`.

    `stem` must already be a valid id (names that are not cannot be answered and never reach here).
    """
    try:
        return parse_request(data, stem)
    except RequestError as err:
        return rejected(stem, err)


def parse_request(data: bytes, stem: str) -> Request:
    """Like `decode_request`, raising `RequestError` instead of returning a `Rejected`."""
    if len(data) > L.REQUEST_MAX_BYTES:
        raise RequestError(
            "request.too_large",
            f"the request is {len(data)} bytes; the limit is {L.REQUEST_MAX_BYTES} bytes",
        )
    req = _fast_path(data)
    if req is None:
        req = _slow_path(data)
    if req.id != stem:
        raise RequestError(
            "request.id.mismatch",
            f"id {req.id!r} differs from the file name's stem {stem!r}; write <id>.json with the same id",
            "$.id",
        )
    if isinstance(req, SleepRequest):
        _check_sleep(req)
    return req


def _fast_path(data: bytes) -> Request | None:
    """The request, if msgspec's typed decode accepts it and the document has no duplicate keys; else None.

    msgspec refuses everything the JSON stage refuses except duplicate keys (it keeps the last). A document has
    none when its key-preserving compact form equals the re-encoding of its parsed value, which cannot repeat a
    key. Anything else (duplicates, but also escapes or number spellings that re-encode differently) takes the
    slow path, which decides exactly and in the spec's order.
    """
    try:
        req: Request = _REQUEST_DECODER.decode(data)
        if msgspec.json.format(data, indent=-1) != msgspec.json.encode(msgspec.json.decode(data)):
            return None
    except (msgspec.MsgspecError, RecursionError):
        return None
    return req


def _slow_path(data: bytes) -> Request:
    obj = _parse_json(data)
    if not isinstance(obj, dict):
        _check_json_limits(obj)
        raise RequestError("request.not_object", "the request must be a JSON object", "$")
    try:
        try:
            req: Request = _REQUEST_DECODER.decode(data)
        except msgspec.ValidationError:
            raise
        except msgspec.DecodeError:  # pragma: no cover - the stdlib accepted what msgspec did not
            req = msgspec.convert(obj, Request)
    except msgspec.ValidationError as exc:
        # A document that passes the shape stage has no number outside its fields' bounds and no nesting
        # deeper than the Structs, so these JSON-stage checks only need to run when the shape check fails.
        _check_json_limits(obj)
        raise _shape_error(obj, str(exc)) from None
    return req


# --- the JSON stage ---------------------------------------------------------------------------------------


class _Duplicate(Exception):
    pass


class _NonFinite(Exception):
    pass


class _OutOfRange(Exception):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return d


def _no_constant(name: str) -> Any:
    raise _NonFinite(name)


def _float(text: str) -> float:
    f = float(text)
    if f in (float("inf"), float("-inf")):
        raise _OutOfRange(text)
    return f


# One decoder for all requests: json.loads with hooks would build a new scanner per call.
_JSON: Final = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_no_constant, parse_float=_float)


def _too_deep() -> RequestError:
    return RequestError(
        "json.too_deep", f"objects and arrays are nested more than {L.JSON_MAX_DEPTH} levels deep", None
    )


def _parse_json(data: bytes) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(
            "request.invalid_utf8",
            f"the file is not valid UTF-8 (bad byte at offset {exc.start}); write the request as UTF-8 JSON",
        ) from None
    if data.startswith(_BOM):
        raise RequestError(
            "json.syntax", "the file starts with a byte order mark (U+FEFF); write the JSON without one"
        )
    if not text.strip():
        raise RequestError("json.syntax", "the file is empty; write one JSON object")
    try:
        obj = _JSON.decode(text)
    except _Duplicate as exc:
        raise RequestError(
            "json.duplicate_key", f"the key {_quote(str(exc))} appears twice in one object; keep one"
        ) from None
    except _NonFinite as exc:
        raise RequestError(
            "json.non_finite", f"{exc} is not a JSON number; use a finite number or null"
        ) from None
    except _OutOfRange as exc:
        raise _out_of_range(str(exc)) from None
    except RecursionError:
        raise _too_deep() from None
    except json.JSONDecodeError as exc:
        raise RequestError(
            "json.syntax", f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except ValueError:  # int() refuses literals of more than 4300 digits
        raise _out_of_range("an integer of thousands of digits") from None
    if "\\u" in text or "\\U" in text:
        _check_surrogates(obj, "$")
    return obj


def _check_surrogates(obj: Any, path: str) -> None:
    def bad(s: str) -> bool:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    if isinstance(obj, str):
        if bad(obj):
            raise RequestError(
                "request.lone_surrogate",
                "a string contains half of a UTF-16 surrogate pair (an unpaired \\ud800-\\udfff escape)",
                path,
            )
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if bad(k):
                raise RequestError(
                    "request.lone_surrogate", "an object key contains an unpaired surrogate escape", path
                )
            # a key too long to echo is not named: the path stops at the object that holds it
            _check_surrogates(v, path if len(k) > ECHO_MAX_CHARS else _join(path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_surrogates(v, f"{path}[{i}]")


def _out_of_range(number: str) -> RequestError:
    what = number if number.startswith("an ") else f"the number {_quote(number)}"
    return RequestError(
        "json.number_out_of_range",
        f"{what} is out of range (an integer must fit 64 bits signed, any other number a 64-bit float)",
    )


def _check_json_limits(obj: Any) -> None:
    """Nesting depth and integer range, the JSON-stage checks the parser's hooks do not make."""
    if _depth(obj) > L.JSON_MAX_DEPTH:
        raise _too_deep()
    if (n := _int_out_of_range(obj)) is not None:
        raise _out_of_range(str(n) if n.bit_length() < 200 else "an integer of many digits")


def _depth(obj: Any) -> int:
    if isinstance(obj, dict):
        return 1 + max((_depth(v) for v in obj.values()), default=0)
    if isinstance(obj, list):
        return 1 + max((_depth(v) for v in obj), default=0)
    return 0


def _int_out_of_range(obj: Any) -> int | None:
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, list):
        if type(obj) is int and not INT_MIN <= obj <= INT_MAX:
            return obj
        return None
    for v in obj:
        if (n := _int_out_of_range(v)) is not None:
            return n
    return None


# --- the shape stage: msgspec's validation errors -> codes -----------------------------------------------

_AT_RE: Final = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.S)
_LAUNCH_FIELD_RE: Final = re.compile(r"^\$\.launches\[\d+\]\.(?P<field>\w+)(?P<item>\[\d+\])?$")
_SWEEP_FIELD_RE: Final = re.compile(r"^\$\.launches\[\d+\]\.sweep\[\d+\]\.(?P<field>\w+)(?P<item>\[\d+\])?$")
_TOP_FIELD_RE: Final = re.compile(r"^\$\.(?P<field>\w+)(?P<item>\[\d+\])?$")
_SUBMIT_FIELD_RE: Final = re.compile(r"^\$\.submit\.(?P<field>\w+)$")


def _shape_error(obj: dict[str, Any], text: str) -> RequestError:
    m = _AT_RE.match(text)
    assert m is not None
    msg, path = m.group("msg"), m.group("path") or "$"
    verb = obj.get("type")
    if msg.startswith("Object missing required field"):
        name = _field_name(msg)
        if path == "$" and name == "type":
            return RequestError("request.type.missing", _type_help("the request has no `type`"), "$.type")
        return RequestError("field.missing", f"{_join(path, name)} is required but absent", _join(path, name))
    if msg.startswith("Object contains unknown field"):
        name = _field_name(msg)
        if len(name) > ECHO_MAX_CHARS:  # too long to echo: point at the object that holds it
            return RequestError(
                "field.unknown",
                f"{path} has a key of {len(name)} characters that is not a field of this request; remove it",
                path,
            )
        return RequestError(
            "field.unknown",
            f"{_join(path, name)} is not a field of this request; remove it (see kernel.json or the spec)",
            _join(path, name),
        )
    if path == "$.type":
        shown = _quote(verb) if isinstance(verb, str) else json.dumps(verb)[:ECHO_MAX_CHARS]
        return RequestError("request.type.unknown", _type_help(f"type {shown} is unknown"), path)
    if ", got " in msg:
        expected = msg.removeprefix("Expected ").split(",")[0].strip("`")
        got = msg.rsplit("got ", 1)[1].strip("`")
        if path == "$.protocol":
            return RequestError(
                "request.protocol.unsupported",
                f"protocol must be the integer {L.PROTOCOL_VERSION}, got a {got}",
                path,
            )
        if path == "$.wake_on" and verb == "sleep":
            return RequestError("field.type", f"$.wake_on must be {WAKE_ON_WORDS}, got {_article(got)}", path)
        return RequestError("field.type", f"{path} must be {_article(expected)}, got {_article(got)}", path)
    return _constraint_error(str(verb), path, msg)


def _constraint_error(verb: str, path: str, msg: str) -> RequestError:
    if path == "$.protocol":
        return RequestError(
            "request.protocol.unsupported",
            f'this kernel speaks protocol {L.PROTOCOL_VERSION}; set "protocol": {L.PROTOCOL_VERSION}',
            path,
        )
    if path == "$.id":
        return RequestError(
            "request.id.invalid",
            "id must be 1 to 64 lowercase letters, digits and '-', not starting with '-'",
            path,
        )
    scope, field, item = _scope(verb, path)
    kind = _kind(msg, is_item=item)
    code = f"{scope}.{field}.{kind}"
    if code not in CODES:  # e.g. an array element: launch.artifacts[i] -> launch.artifact
        code = f"{scope}.{field.removesuffix('s')}.{kind}"
    if code not in CODES:
        code = f"{scope}.{field.removesuffix('s')}.invalid"
    if code not in CODES:  # pragma: no cover - a constraint added to a Struct without a code
        raise AssertionError(f"no error code for {scope}.{field} ({msg})")
    limit = msg.split("<=")[-1].split(">=")[-1].strip() if ("<=" in msg or ">=" in msg) else ""
    return RequestError(code, _constraint_message(path, msg, kind, limit), path)


def _scope(verb: str, path: str) -> tuple[str, str, bool]:
    if (m := _SWEEP_FIELD_RE.match(path)) and verb == "sleep":
        return "launch.sweep", m.group("field"), m.group("item") is not None
    if (m := _LAUNCH_FIELD_RE.match(path)) and verb == "sleep":
        return "launch", m.group("field"), m.group("item") is not None
    if m := _SUBMIT_FIELD_RE.match(path):
        return "submit", m.group("field"), False
    if verb == "cancel" and re.fullmatch(r"\$\.launches\[\d+\]", path):
        return "cancel", "name", False
    if m := _TOP_FIELD_RE.match(path):
        return verb, m.group("field"), m.group("item") is not None
    return verb, "field", False  # pragma: no cover


def _kind(msg: str, *, is_item: bool) -> str:
    if "matching regex" in msg or msg.startswith("Invalid enum value"):
        return "invalid"
    if "of length >=" in msg:
        return "empty"
    if "of length <=" in msg:
        return "too_many" if msg.startswith("Expected `array`") else "too_long"
    return "out_of_range"


# What a pattern asks for, in words, for the patterns whose regex says it less plainly.
PATTERN_WORDS: Final = {
    L.SWEEP_KEY_PATTERN: "be 1 to 32 characters: a lowercase letter, then lowercase letters, digits or '_' "
    "(the task's variable is SWEEP_<KEY>)",
    L.SWEEP_VALUE_PATTERN: "be 1 to 64 letters, digits or . _ + : / - (no blank, quote, comma, '=' or '|')",
    L.ID_PATTERN: "be a sleep id: 1 to 64 lowercase letters, digits and '-', not starting with '-'",
    L.METRIC_KEY_PATTERN: "be a key of your JSON line (a letter or '_', then letters, digits or _ . : / -, at "
    "most 64), with '-' first when higher is better: val_loss, -accuracy",
}


# What `wake_on` and `rest` accept, in words (their messages never echo the agent's string).
WAKE_ON_WORDS: Final = (
    f"one of {', '.join(repr(c) for c in L.WAKE_ON_CONDITIONS)}, or a JSON integer N (1 to the sleep's task "
    "count): wake once N tasks have ended"
)
REST_WORDS: Final = (
    "'run' (the tasks still running at an early wake go on; the rest wake delivers them) or 'cancel' (they "
    "are cancelled, and the sleep wakes once they have stopped)"
)


def _constraint_message(path: str, msg: str, kind: str, limit: str) -> str:
    if path == "$.wake_on":
        if kind == "invalid":
            digits = msg.removeprefix("Invalid enum value ").strip("'").isdigit()
            return f"$.wake_on must be {WAKE_ON_WORDS}" + (
                "; write the count as a number, without quotes" if digits else ""
            )
        if ">=" in msg:
            return (
                "$.wake_on's count must be at least 1: the sleep wakes once that many of its tasks have ended"
            )
        return (
            f"$.wake_on's count is above {L.WAKE_ON_MAX}, more tasks than any sleep can have; use 1 to the "
            "sleep's task count, or 'all'"
        )
    if path == "$.rest":
        return f"$.rest must be {REST_WORDS}"
    if kind == "invalid":
        pattern = msg.split("matching regex ", 1)[1].strip("'")
        words = PATTERN_WORDS.get(pattern.replace("\\\\", "\\"))  # msgspec doubles the backslashes
        if words is not None:
            return f"{path} must {words}"
        return f"{path} must match {pattern}"
    if kind == "empty":
        return f"{path} must not be empty"
    if kind == "too_long":
        return f"{path} is longer than {limit} characters; shorten it"
    if kind == "too_many":
        return f"{path} has more than {limit} entries"
    return f"{path} is out of range; it must be {msg.rsplit('`', 1)[-1].strip()}"


# --- rules a schema cannot say ---------------------------------------------------------------------------


def _check_sleep(req: SleepRequest) -> None:
    _check_wake_on(req)
    names: set[str] = set()
    for i, launch in enumerate(req.launches):
        at = f"$.launches[{i}]"
        if launch.name in names:
            raise RequestError(
                "launch.name.duplicate",
                f"two launches are named {launch.name!r}; names must be unique within a sleep",
                f"{at}.name",
            )
        if req.submit is not None and launch.name in L.EVAL_LAUNCH_NAMES:
            raise RequestError(
                "launch.name.duplicate",
                f"{at}.name {launch.name!r} is the name of the submit's own evaluation run; rename the launch",
                f"{at}.name",
            )
        names.add(launch.name)
        _check_launch(launch, at)


def _check_wake_on(req: SleepRequest) -> None:
    """`wake_on` and `rest` against the sleep itself (stage 4): a count no larger than its tasks, no early wake in a
    sleep that carries a submit (its verdict needs every run), `rest` "cancel" only with an early condition."""
    tasks = sum(launch.array for launch in req.launches)
    if isinstance(req.wake_on, int) and req.wake_on > tasks:
        raise RequestError(
            "sleep.wake_on.out_of_range",
            f"$.wake_on is {req.wake_on} but the sleep has {count_of(tasks, 'task')} (its launches' arrays "
            f"summed); use 1..{tasks}, or 'all'",
            "$.wake_on",
        )
    if req.wake_on != "all" and req.submit is not None:
        raise RequestError(
            "sleep.wake_on.invalid",
            "a sleep that carries a submit wakes when its verdict is reached, which needs every evaluation run; "
            "drop wake_on, or commit the submit in a sleep of its own",
            "$.wake_on",
        )
    if req.rest == "cancel" and req.wake_on == "all":
        raise RequestError(
            "sleep.rest.invalid",
            "rest says what happens to the tasks still running at an early wake, and wake_on 'all' never wakes "
            "early; drop rest, or set wake_on (first-failure, first-exit or a count)",
            "$.rest",
        )


def _check_launch(launch: Launch, at: str) -> None:
    if not launch.command.strip(_ASCII_SPACE):
        raise RequestError(
            "launch.command.empty", f"{at}.command is blank; give a shell command", f"{at}.command"
        )
    if _CONTROL_RE.search(launch.command):
        raise RequestError(
            "launch.command.invalid",
            f"{at}.command contains a control character (only tab and newline are allowed)",
            f"{at}.command",
        )
    if launch.rank is not None and launch.array == 1 and not launch.sweep:
        raise RequestError(
            "launch.rank.invalid",
            f"{at}.rank ranks the tasks of an array or a sweep, and this launch has one task; drop rank, or "
            "give the launch a sweep or an array",
            f"{at}.rank",
        )
    if (problem := sweep_problem(launch.sweep, launch.array, at)) is not None:
        raise RequestError(*problem)
    if launch.concurrency > launch.array:
        raise RequestError(
            "launch.concurrency.out_of_range",
            f"{at}.concurrency is {launch.concurrency} but the array has {launch.array} tasks; "
            "use 0..array (0 = all at once)",
            f"{at}.concurrency",
        )
    for j, path in enumerate(launch.artifacts):
        if reason := artifact_path_problem(path):
            raise RequestError(
                "launch.artifact.invalid", f"{at}.artifacts[{j}] {reason}", f"{at}.artifacts[{j}]"
            )
    if _WHY_BAD_RE.search(launch.why):
        raise RequestError("launch.why.multiline", f"{at}.why must be one line of text", f"{at}.why")


# Glob characters: the kernel copies exactly the named file, so a pattern would silently deliver nothing.
_GLOB_RE: Final = re.compile(r"[*?\[]")
# Names the kernel itself delivers next to a task's artifacts (its full stdout and stderr).
RESERVED_ARTIFACTS: Final = ("stdout", "stderr")


def artifact_path_problem(path: str) -> str | None:
    """Why `path` is not an acceptable artifact path, or None. Shared with the kernel's copy-out."""
    if path.startswith("/"):
        return "must be relative to the workspace root, not absolute"
    if path.startswith("~"):
        return "must not start with '~'"
    if "\\" in path:
        return "must use '/' as the separator (no backslashes)"
    if _PATH_CONTROL_RE.search(path):
        return "must not contain control characters"
    parts = path.split("/")
    if len(parts) > 1 and parts[-1] == "" and all(p not in ("", ".", "..") for p in parts[:-1]):
        return (
            "ends with '/', naming a directory; artifacts are single files: name each file, or archive the "
            "directory in your command (e.g. tar czf {0}.tgz {0}) and name the archive".format(path[:-1])
        )
    if "" in parts:
        return "must not contain empty parts ('//' or a trailing '/')"
    if "." in parts or ".." in parts:
        return "must not contain '.' or '..' parts"
    if _GLOB_RE.search(path):
        return (
            "contains a glob character (*, ? or [); artifacts are single files, not patterns: "
            "name each file, or archive them in your command and name the archive"
        )
    if path in RESERVED_ARTIFACTS:
        return (
            f"is {path!r}, where the kernel delivers the job's own {path}; copy the file under another name"
        )
    return None


# --- policy ----------------------------------------------------------------------------------------------


def at_a_time(array: int, concurrency: int, gpus: int, max_concurrent_gpus: int) -> int:
    """How many tasks of an array run at once when it is the sleep's only GPU launch and no sleep in flight
    holds GPUs: `concurrency` (0 = all), lowered so that the tasks running together hold at most the
    workspace's `max_concurrent_gpus` (but never below one task). A sleep's widths are decided at acceptance
    (kernel.core.rules.share_gpus), which gives a launch at most this."""
    width = concurrency or array
    if gpus > 0:
        width = min(width, max(1, max_concurrent_gpus // gpus))
    return min(width, array)


def clamp_note(
    array: int, concurrency: int, gpus: int, max_concurrent_gpus: int, width: int | None = None
) -> str | None:
    """Why fewer tasks of a launch run at once than it asked for (`width`, the tasks at once it was given at
    acceptance, or without it `at_a_time`, below `concurrency`, or below the whole array when `concurrency` is
    0), or None when nothing lowered it. The one wording of the wake and `status` (tool/syscall.py's clamp_text
    says the same for staged launches; a test keeps them equal)."""
    alone = at_a_time(array, concurrency, gpus, max_concurrent_gpus)
    width = alone if width is None else width
    if width >= (concurrency or array):
        return None
    head = f"{width} at a time, not {concurrency or f'all {array}'}: "
    each = f"each task takes {count_of(gpus, 'GPU')}"
    if width == alone:
        return f"{head}this workspace runs at most {count_of(max_concurrent_gpus, 'GPU')} at once (max_concurrent_gpus) and {each}"
    # Shared (or decided under a ceiling a reload has changed since): true whatever the sharers were.
    return (
        f"{head}its share, at the sleep's acceptance, of this workspace's max_concurrent_gpus "
        f"({count_of(max_concurrent_gpus, 'GPU')} at once now), beside any other GPU launches of the sleep and any "
        f"sleeps in flight then; {each}"
    )


def count_of(n: int, unit: str) -> str:
    """`n` units, plural when `n` is not 1: "1 GPU", "2 GPUs"."""
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


def check_policy(req: Request, policy: Policy) -> None:
    """Raise `RequestError` if the request asks for more than the workspace's policy allows."""
    verb = req.__struct_config__.tag
    if verb not in policy.verbs:
        raise RequestError(
            "policy.verb_disabled",
            f"{verb} is not enabled for this workspace; it may use: {', '.join(policy.verbs) or 'nothing'}",
            "$.type",
        )
    if isinstance(req, SleepRequest):
        _check_sleep_policy(req, policy)


def _check_sleep_policy(req: SleepRequest, policy: Policy) -> None:
    for i, launch in enumerate(req.launches):
        at = f"$.launches[{i}]"
        if launch.minutes > policy.max_minutes:
            raise RequestError(
                "policy.minutes",
                f"{at}.minutes is {launch.minutes}; this workspace allows at most {policy.max_minutes}",
                f"{at}.minutes",
            )
        if launch.gpus > policy.max_gpus:
            raise RequestError(
                "policy.gpus",
                f"{at}.gpus is {launch.gpus}; this workspace allows at most {policy.max_gpus}",
                f"{at}.gpus",
            )
        if launch.mem_mb is not None and launch.mem_mb > policy.max_mem_mb:
            raise RequestError(
                "policy.mem_mb",
                f"{at}.mem_mb is {launch.mem_mb} (MB per task); this workspace allows at most "
                f"{policy.max_mem_mb} (kernel.json policy.max_mem_mb): ask for {policy.max_mem_mb} or less",
                f"{at}.mem_mb",
            )
        if launch.cpus is not None and launch.cpus > policy.max_cpus:
            raise RequestError(
                "policy.cpus",
                f"{at}.cpus is {launch.cpus} (per task); this workspace allows at most {policy.max_cpus} "
                f"(kernel.json policy.max_cpus): ask for {policy.max_cpus} or fewer",
                f"{at}.cpus",
            )
    if req.submit is not None:
        if policy.submit is None:
            raise RequestError(
                "policy.submit_disabled",
                "this workspace has no evaluation contract, so submit is unavailable (kernel.json policy.submit)",
                "$.submit",
            )
        if req.submit.eval_minutes is not None and req.submit.eval_minutes > policy.max_minutes:
            raise RequestError(
                "policy.eval_minutes",
                f"$.submit.eval_minutes is {req.submit.eval_minutes}; "
                f"this workspace allows at most {policy.max_minutes}",
                "$.submit.eval_minutes",
            )
    _check_gpus_at_once(req, policy)


def gpu_launches(req: SleepRequest, policy: Policy) -> tuple[tuple[str, int], ...]:
    """The sleep's launches that take GPUs, as (name, GPUs per task), in order: its own launches, then a
    submit's two evaluation runs (`EVAL_LAUNCH_NAMES`, which start with them) when the contract's runs take
    GPUs."""
    own = tuple((x.name, x.gpus) for x in req.launches if x.gpus > 0)
    contract = policy.submit
    if req.submit is None or contract is None or contract.gpus == 0:
        return own
    return own + tuple((name, contract.gpus) for name in L.EVAL_LAUNCH_NAMES)


def _check_gpus_at_once(req: SleepRequest, policy: Policy) -> None:
    """One task of each GPU launch runs at once at the least, so their GPUs together must fit the ceiling."""
    cap = policy.max_concurrent_gpus
    gpu = gpu_launches(req, policy)
    need = sum(g for _, g in gpu)
    if need <= cap:
        return
    at, total = "$.submit", 0
    for i, x in enumerate(req.launches):
        total += x.gpus
        if x.gpus > 0 and total > cap:
            at = f"$.launches[{i}].gpus"
            break
    each = ", ".join(f"{name} {g}" for name, g in gpu)
    evals = len(gpu) - sum(1 for x in req.launches if x.gpus > 0)
    among = f" (its submit's {evals} evaluation runs among them)" if evals else ""
    raise RequestError(
        "policy.concurrent_gpus",
        f"this sleep's {len(gpu)} GPU launches{among} need at least {count_of(need, 'GPU')} at once (one task of each: "
        f"{each}), above this workspace's max_concurrent_gpus ({cap}): put some of them in another sleep, "
        "or ask fewer GPUs per task",
        at,
    )


# --- helpers ---------------------------------------------------------------------------------------------


def _field_name(msg: str) -> str:
    # msgspec writes the key between backticks; the key itself may contain backticks.
    start, end = msg.find("`"), msg.rfind("`")
    return msg[start + 1 : end] if 0 <= start < end else "?"


def _join(path: str, name: str) -> str:
    """Section 1.4: `.name` for an ASCII word, else `["name"]` as ECMA-262's JSON.stringify writes it."""
    return (
        f"{path}.{name}" if _MEMBER_RE.fullmatch(name) else f"{path}[{json.dumps(name, ensure_ascii=False)}]"
    )


def _quote(s: str) -> str:
    return json.dumps(s[:ECHO_MAX_CHARS])


def _article(t: str) -> str:
    if t.endswith(" | null"):
        return f"{_article(t.removesuffix(' | null'))} or null"
    t = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "null": "null"}.get(t, t)
    return f"an {t}" if t[:1] in "aeiou" else f"a {t}"


def _type_help(prefix: str) -> str:
    return f"{prefix}; use one of: {', '.join(VERBS)}"
