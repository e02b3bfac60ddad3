"""Reading what a kernel wrote as a client must (spec 1.5): unknown members and values ignored, the rest strict.

The Structs of `channel.messages` refuse unknown members and list the values known today; the published
kernel-written schemas (`scripts/gen_spec.py` `open_schema`) allow both. `decode_open` decodes like those
schemas validate: it drops the members a Struct does not declare and stands a known value in for a string the
Struct's `Literal` does not list, then decodes strictly. So a kernel that adds a member or a task state still
conforms, and one that writes a wrong type, a missing member or an out-of-range number still does not.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import inspect


def decode_open(data: bytes, tp: Any) -> Any:
    """`data` decoded as `tp`, ignoring what a client must ignore; raises msgspec.DecodeError otherwise.

    A string standing in for an unknown value is the Literal's first value, so the result is for judging the
    document's shape, not for reading such a member's value."""
    obj = msgspec.json.decode(data)
    return msgspec.convert(_known(obj, inspect.type_info(tp)), tp)


def _known(obj: Any, t: inspect.Type) -> Any:
    match t:
        case inspect.Metadata():
            return _known(obj, t.type)
        case inspect.StructType():
            return _struct(obj, t)
        case inspect.UnionType():
            return _union(obj, t)
        case inspect.LiteralType():
            strings = [v for v in t.values if isinstance(v, str)]
            if isinstance(obj, str) and strings and obj not in t.values:
                return strings[0]
            return obj
        case inspect.ListType() | inspect.VarTupleType() | inspect.SetType() | inspect.FrozenSetType():
            return [_known(v, t.item_type) for v in obj] if isinstance(obj, list) else obj
        case inspect.DictType():
            return {k: _known(v, t.value_type) for k, v in obj.items()} if isinstance(obj, dict) else obj
    return obj


def _struct(obj: Any, t: inspect.StructType) -> Any:
    if not isinstance(obj, dict):
        return obj
    fields = {f.encode_name: f.type for f in t.fields}
    out = {k: _known(v, fields[k]) for k, v in obj.items() if k in fields}
    if t.tag_field is not None and t.tag_field in obj:
        out[t.tag_field] = obj[t.tag_field]
    return out


def _union(obj: Any, t: inspect.UnionType) -> Any:
    structs = [m for m in t.types if isinstance(m, inspect.StructType)]
    if isinstance(obj, dict) and structs:
        tagged = [s for s in structs if s.tag_field is not None and obj.get(s.tag_field) == s.tag]
        if tagged:
            return _struct(obj, tagged[0])
        if len(structs) == 1 and structs[0].tag_field is None:
            return _struct(obj, structs[0])
        return obj  # an unknown tag: a new answer type comes only with a new verb, so it stays an error
    if isinstance(obj, str) and not any(isinstance(m, inspect.StrType) for m in t.types):
        for m in t.types:
            inner = m.type if isinstance(m, inspect.Metadata) else m
            if isinstance(inner, inspect.LiteralType):
                return _known(obj, inner)
    if isinstance(obj, list):
        for m in t.types:
            inner = m.type if isinstance(m, inspect.Metadata) else m
            if isinstance(inner, inspect.ListType | inspect.VarTupleType):
                return _known(obj, inner)
    return obj
