"""The copy of a large event's data made by walking it (sharing its strings) is the copy a
JSON round trip makes: generated values, compared type for type with the decoded copy, for
`json_safe_encoded` (the emit's copy) and `json_copy` (each handler's).

Pure: no server. `json_safe_encoded` walks data whose encoding is at least
`SHARE_FROM_BYTES` long instead of decoding the bytes back; these cases show that whatever
the data holds, the result (the copy, its bytes, or the error) is the one the decode gives.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import math
from collections import OrderedDict
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hookbus._core.copies import json_copy
from hookbus.schemas import BadRequestError, event_data
from hookbus.schemas.event_data import _shared_copy, json_safe_encoded

_SETTINGS = settings(
    max_examples=400,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


class _Color(enum.Enum):
    RED = "red"


class _Str(str):
    pass


class _Int(int):
    pass


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
_odd = st.one_of(
    st.decimals(allow_nan=False, allow_infinity=False, places=3),
    st.datetimes(),
    st.sampled_from([_Color.RED, _Str("sub"), _Int(7), b"bytes", (1, 2), frozenset({1})]),
)
_native = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)
_anything = st.recursive(
    st.one_of(_scalars, _odd),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=8), inner, max_size=5),
        st.dictionaries(st.integers(-5, 5), inner, max_size=3),
        st.builds(OrderedDict, st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    ),
    max_leaves=30,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, with the same exact type at every level (-0.0 and 0.0 told apart)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return bool(a == b)


def _containers(value: Any) -> list[int]:
    """The ids of every dict and list in `value`."""
    if isinstance(value, dict):
        return [id(value), *(i for v in value.values() for i in _containers(v))]
    if isinstance(value, list):
        return [id(value), *(i for v in value for i in _containers(v))]
    return []


def _decoded(data: Any) -> Any:
    """What the JSON round trip gives, or None where msgspec cannot encode or the copy is
    not the same value (the cases the decode path leaves to its general conversion)."""
    try:
        copy = msgspec.json.decode(msgspec.json.encode(data))
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError, msgspec.DecodeError):
        return None
    return copy if copy == data else None


@_SETTINGS
@given(value=st.dictionaries(st.text(max_size=8), _native, max_size=6))
def test_walk_copies_json_native_data_as_the_round_trip_does(value: dict[str, Any]) -> None:
    shared = _shared_copy(value, 10**9)
    decoded = _decoded(value)
    if decoded is None:  # a NaN, an infinity: not JSON, the walk must not vouch for it
        assert shared is None
        return
    big_int = any(  # over 64 bits: the walk leaves those to the decode
        isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v <= 2**64 - 1
        for v in _leaves(value)
    )
    if big_int:
        assert shared is None
        return
    assert shared is not None
    assert _same(shared, decoded)
    assert not set(_containers(shared)) & set(_containers(value)), "a container is shared"


@_SETTINGS
@given(value=st.dictionaries(st.text(max_size=8), _anything, max_size=6))
def test_walk_never_vouches_for_what_the_round_trip_changes(value: dict[str, Any]) -> None:
    shared = _shared_copy(value, 10**9)
    if shared is not None:
        decoded = _decoded(value)
        assert decoded is not None, f"the walk copied {value!r}, which JSON changes"
        assert _same(shared, decoded)


@_SETTINGS
@given(value=st.dictionaries(st.text(max_size=8), _anything, max_size=6))
def test_json_safe_encoded_gives_the_same_with_and_without_the_walk(
    value: dict[str, Any],
) -> None:
    walked = _outcome(value, share_from=0)
    decoded = _outcome(value, share_from=10**12)
    assert type(walked) is type(decoded)
    if isinstance(walked, tuple):
        assert _same(walked[0], decoded[0])
        assert walked[1] == decoded[1]
    else:
        assert str(walked) == str(decoded)


@_SETTINGS
@given(value=st.dictionaries(st.text(max_size=8), _anything, max_size=6))
def test_json_copy_gives_the_same_with_and_without_the_walk(value: dict[str, Any]) -> None:
    walked = _outcome(value, share_from=0, copy=json_copy)
    decoded = _outcome(value, share_from=10**12, copy=json_copy)
    assert type(walked) is type(decoded)
    if isinstance(walked, dict):
        assert _same(walked, decoded)
    else:
        assert str(walked) == str(decoded)


@_SETTINGS
@given(value=st.dictionaries(st.text(max_size=8), _native, max_size=6))
def test_json_copy_of_decoded_data_needs_no_encode_for_the_same_copy(
    value: dict[str, Any],
) -> None:
    """Data msgspec decoded (a worker's request) is copied for a chain's next step with its
    size given instead of encoded again: the same copy, whether the walk is tried or not."""
    try:
        encoded = msgspec.json.encode(value)
        decoded = msgspec.json.decode(encoded)
    except (ValueError, msgspec.EncodeError, msgspec.DecodeError):
        return  # a NaN, an infinity: not what a decoder hands out
    plain = json_copy(decoded)
    for share_from in (0, 10**12):
        saved = event_data.SHARE_FROM_BYTES, event_data.BYTES_PER_NODE
        event_data.SHARE_FROM_BYTES, event_data.BYTES_PER_NODE = share_from, 1
        try:
            sized = json_copy(decoded, len(encoded))
        finally:
            event_data.SHARE_FROM_BYTES, event_data.BYTES_PER_NODE = saved
        assert _same(sized, plain)
        assert not set(_containers(sized)) & set(_containers(decoded)), "a container is shared"


@pytest.mark.parametrize(
    "odd",
    [
        _Str("sub"), _Int(7), True, _Color.RED, (1, 2), [1, (2, 3)], frozenset({1}), b"raw",
        decimal.Decimal("1.25"), datetime.datetime(2026, 1, 2, 3, 4, 5), math.inf, -math.nan,
        2**64, -(2**63) - 1, OrderedDict(a=1), {1: "int key"}, {None: "null key"},
    ],
    ids=repr,
)  # fmt: skip
def test_walk_copies_each_odd_value_as_the_round_trip_does_or_leaves_it(odd: Any) -> None:
    value = {"odd": odd, "text": "x" * 100}
    shared = _shared_copy(value, 10**9)
    if shared is not None:
        decoded = _decoded(value)
        assert decoded is not None and _same(shared, decoded)
    assert str(_outcome(value, share_from=0)) == str(_outcome(value, share_from=10**12))
    walked = _outcome(value, share_from=0, copy=json_copy)
    decoded = _outcome(value, share_from=10**12, copy=json_copy)
    assert _same(walked, decoded) if isinstance(decoded, dict) else str(walked) == str(decoded)


def test_walk_gives_up_past_its_budget() -> None:
    data = {"items": list(range(100))}
    assert _shared_copy(data, 50) is None
    assert _shared_copy(data, 200) == data


def test_a_large_event_is_copied_by_the_walk_and_encoded_once() -> None:
    text = "the quick brown fox\n" * 4096  # 80 KB: over SHARE_FROM_BYTES
    data = {"tool_name": "write", "tool_input": {"content": text, "mode": 0o644}, "n": 1.5}
    copy, encoded = json_safe_encoded(data)
    assert encoded == msgspec.json.encode(data)
    assert copy == data
    assert copy is not data and copy["tool_input"] is not data["tool_input"]
    assert copy["tool_input"]["content"] is text  # shared: a str cannot be changed in place


def test_a_large_event_that_is_not_json_still_fails_as_before() -> None:
    with pytest.raises(BadRequestError, match="not JSON"):
        json_safe_encoded({"content": "x" * 40_000, "ratio": math.nan})


def _outcome(value: dict[str, Any], *, share_from: int, copy: Any = json_safe_encoded) -> Any:
    """`copy(value)` (`json_safe_encoded` or `json_copy`; or its error) with the walk tried
    from `share_from` encoded bytes, with budget for every value (each takes at least one
    byte)."""
    saved = event_data.SHARE_FROM_BYTES, event_data.BYTES_PER_NODE
    event_data.SHARE_FROM_BYTES, event_data.BYTES_PER_NODE = share_from, 1
    try:
        return copy(value)
    except BadRequestError as exc:
        return exc
    finally:
        event_data.SHARE_FROM_BYTES, event_data.BYTES_PER_NODE = saved


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]
