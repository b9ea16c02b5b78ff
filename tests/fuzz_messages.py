"""Hypothesis strategies for any protobuf message, read from its descriptor: every
field left unset or set to an edge-leaning value of its type (huge and negative
integers, NaN and infinities, unknown enum values, odd Unicode, deep nesting), so the
fuzzer reaches fields nobody wrote a strategy for."""

from __future__ import annotations

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_MAX_DEPTH = 3
_INT32 = st.one_of(st.integers(-3, 300), st.integers(-(2**31), 2**31 - 1))
_UINT32 = st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1))
_INT64 = st.one_of(st.integers(-3, 300), st.integers(-(2**63), 2**63 - 1))
_UINT64 = st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1))
# No subnormals: torch may flush them to zero process-wide (FTZ/DAZ), and hypothesis
# refuses to draw them then.
_DOUBLE = st.one_of(
    st.floats(-3, 3, allow_subnormal=False),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
)
_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=32, allow_subnormal=False)
_TEXT = st.one_of(st.text(max_size=24), st.sampled_from(["", " ", "\x00", "🙂" * 8, "a" * 300]))

_SCALARS = {
    FieldDescriptor.TYPE_INT32: _INT32,
    FieldDescriptor.TYPE_SINT32: _INT32,
    FieldDescriptor.TYPE_SFIXED32: _INT32,
    FieldDescriptor.TYPE_UINT32: _UINT32,
    FieldDescriptor.TYPE_FIXED32: _UINT32,
    FieldDescriptor.TYPE_INT64: _INT64,
    FieldDescriptor.TYPE_SINT64: _INT64,
    FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT64: _UINT64,
    FieldDescriptor.TYPE_FIXED64: _UINT64,
    FieldDescriptor.TYPE_DOUBLE: _DOUBLE,
    FieldDescriptor.TYPE_FLOAT: _FLOAT,
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: _TEXT,
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
    # proto3 enums are open: unknown numbers are legal on the wire.
    FieldDescriptor.TYPE_ENUM: st.integers(-2, 12),
}


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type with any subset of fields set."""
    cls = message_factory.GetMessageClass(descriptor)
    fields = {
        field.name: _field_values(field, depth)
        for field in descriptor.fields
        if depth < _MAX_DEPTH or field.type != FieldDescriptor.TYPE_MESSAGE
    }

    def build(values: dict[str, object]) -> Message:
        message = cls()
        for name, value in values.items():
            _set(message, descriptor.fields_by_name[name], value)
        return message

    return st.fixed_dictionaries({}, optional=fields).map(build)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _field_values(field: FieldDescriptor, depth: int) -> st.SearchStrategy[object]:
    if _is_map(field):  # map<K, V>: a dict (keys are scalars, values scalars here)
        entry = field.message_type
        key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
        return st.dictionaries(_SCALARS[key.type], _field_values(value, depth + 1), max_size=8)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        one = st.deferred(lambda: messages(field.message_type, depth + 1))
    else:
        one = _SCALARS[field.type]
    if field.is_repeated:
        return st.lists(one, max_size=6 if field.type == FieldDescriptor.TYPE_MESSAGE else 40)
    return one


def _set(message: Message, field: FieldDescriptor, value: object) -> None:
    target = getattr(message, field.name)
    if _is_map(field):
        for key, item in value.items():
            if isinstance(item, Message):
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif field.is_repeated:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


def mutated(valid: st.SearchStrategy[Message]) -> st.SearchStrategy[Message]:
    """A valid message with a random partial message merged over it: most fields stay
    sensible, so the request gets past the first check and into deeper code."""

    def merge(pair: tuple[Message, Message]) -> Message:
        base, noise = pair
        out = type(base)()
        out.CopyFrom(base)
        out.MergeFrom(noise)
        return out

    return valid.flatmap(lambda m: st.tuples(st.just(m), messages(m.DESCRIPTOR)).map(merge))
