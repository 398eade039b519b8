"""Subjects, queue groups and KV keys: the one reversible token encoding and every builder.

Pure functions: no server needed. The shapes pinned here are the ones documented in
`hookbus.schemas._subjects` (and relied on by agents in other languages).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hookbus.schemas
from hookbus._core.inboxes import inbox_reply_subject
from hookbus.schemas import (
    APPROVALS_BUCKET,
    COLLECT_SERVICE_WILDCARD,
    DISPATCHER_QUEUE_GROUP,
    EMIT_SERVICE_WILDCARD,
    GRANT_NONE,
    HANDLERS_BUCKET,
    SUBJECT_PREFIX,
    SUSPENSION_EVENTS_WILDCARD,
    SUSPENSIONS_BUCKET,
    BadRequestError,
    agent_from_service_subject,
    approval_answer_key,
    collect_service_subject,
    collect_subject,
    decode_token,
    emit_service_subject,
    encode_token,
    event_from_service_subject,
    grant_key,
    handler_instance_subject,
    handler_key,
    handler_queue_group,
    handler_subject,
    is_answer_key,
    label_from_key,
    lease_key,
    parse_grant_key,
    parse_handler_key,
    parse_suspension_key,
    suspension_event_subject,
    suspension_events_subject,
    suspension_key,
    validate_name,
)
from hookbus.schemas._subjects import run_claim_key

TRICKY_NAMES = [
    "tool:pre",
    "a.b",
    "*",
    ">",
    "with space",
    "ünïcode",
    "=3A",
    "=",
    "==",
    "_-_",
    "😀",
    "emoji 🚀 in: a.name",
    "tab\tand\nnewline",
    "slash/and\\back",
    "plain",
    "A-Z_0-9",
    "%41",
    "\x00nul",
    "中文.事件",
    "tool:pre.>.*",
    "x" * 200,
]

SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_=-]+")
"""Characters an encoded token may hold: safe in a NATS subject token (no `.`, `*`, `>`,
whitespace) and in a queue group name."""
KV_KEY = re.compile(r"[-/_=.a-zA-Z0-9]+")
"""JetStream KV key charset (nats-py's `VALID_KEY_RE`)."""


@pytest.mark.parametrize("name", TRICKY_NAMES)
def test_token_round_trip(name: str) -> None:
    token = encode_token(name)
    assert decode_token(token) == name


@pytest.mark.parametrize("name", TRICKY_NAMES)
def test_token_has_only_allowed_characters(name: str) -> None:
    token = encode_token(name)
    assert SUBJECT_TOKEN.fullmatch(token), token
    assert KV_KEY.fullmatch(token), token
    assert "." not in token


def test_tokens_are_distinct_for_distinct_names() -> None:
    tokens = [encode_token(n) for n in TRICKY_NAMES]
    assert len(set(tokens)) == len(TRICKY_NAMES)


def test_known_encodings() -> None:
    assert encode_token("tool:pre") == "tool=3Apre"
    assert encode_token("plain_name-1") == "plain_name-1"
    assert encode_token("a.b") == "a=2Eb"
    assert encode_token("=") == "=3D"
    assert encode_token("ü") == "=C3=BC"  # UTF-8 bytes, upper-case hex


def test_empty_name_rejected() -> None:
    with pytest.raises(BadRequestError, match="empty"):
        encode_token("")


@pytest.mark.parametrize(
    "token",
    [
        "",  # empty
        "tool=3apre",  # lower-case hex
        "=41",  # 'A' is plain: must not be escaped
        "=5F",  # '_' is plain
        "=2D",  # '-' is plain
        "=",  # dangling escape
        "=3",  # short escape
        "=G1",  # not hex
        "a.b",  # '.' is never in a token
        "a b",
        "*",
        ">",
        "=C3",  # an incomplete UTF-8 sequence
        "=FF",  # not UTF-8 at all
        "=C0=80",  # overlong NUL: not valid UTF-8
        "ü",  # raw non-ASCII: must be escaped
    ],
)
def test_non_canonical_tokens_rejected(token: str) -> None:
    with pytest.raises(BadRequestError, match="token"):
        decode_token(token)


def _reference_decode(token: str) -> str | None:
    """`decode_token` spelled out byte by byte (None: refused): the judge of the fast one."""
    if not re.fullmatch(r"(?:[A-Za-z0-9_-]|=[0-9A-F]{2})+", token):
        return None
    raw, i = bytearray(), 0
    while i < len(token):
        if token[i] == "=":
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(token[i]))
            i += 1
    try:
        name = raw.decode()
    except UnicodeDecodeError:
        return None
    return name if encode_token(name) == token else None


_TOKEN_PARTS = st.one_of(
    st.text(alphabet="Az09_-.=* ", min_size=1, max_size=3),
    st.sampled_from(
        ["=C3", "=BC", "=A9", "=3A", "=2E", "=41", "=3a", "=C0=80", "=F0=9F=98=80", "=FF", "="]
    ),
    st.text(min_size=1, max_size=2).map(encode_token),
)


@settings(max_examples=3000, derandomize=True, deadline=None)
@given(st.lists(_TOKEN_PARTS, min_size=1, max_size=6).map("".join))
def test_decode_token_agrees_with_the_byte_by_byte_reference(token: str) -> None:
    expected = _reference_decode(token)
    if expected is None:
        with pytest.raises(BadRequestError, match="token"):
            decode_token(token)
    else:
        assert decode_token(token) == expected


@settings(max_examples=2000, derandomize=True, deadline=None)
@given(st.text(min_size=1, max_size=12))
def test_any_text_round_trips_through_a_token(name: str) -> None:
    token = encode_token(name)
    assert decode_token(token) == name == _reference_decode(token)


def test_validate_name() -> None:
    assert validate_name("event", "tool:pre") == "tool:pre"
    for bad in ("", None, 1, "x" * 201):
        with pytest.raises(BadRequestError, match="event name"):
            validate_name("event", bad)
    with pytest.raises(BadRequestError, match="handler name"):
        validate_name("handler", "")


def test_constants() -> None:
    assert SUBJECT_PREFIX == "hookbus.v1"
    assert HANDLERS_BUCKET == "hookbus_handlers"
    for bucket in (HANDLERS_BUCKET, SUSPENSIONS_BUCKET, APPROVALS_BUCKET):
        assert re.fullmatch(r"[a-zA-Z0-9_-]+", bucket)  # bucket charset (no '.')
    assert len({HANDLERS_BUCKET, SUSPENSIONS_BUCKET, APPROVALS_BUCKET}) == 3
    assert SUSPENSION_EVENTS_WILDCARD == "hookbus.v1.suspension.>"
    assert DISPATCHER_QUEUE_GROUP == "hookbus-dispatcher"
    assert EMIT_SERVICE_WILDCARD == "hookbus.v1.emit.*.*"
    assert COLLECT_SERVICE_WILDCARD == "hookbus.v1.emit_and_collect.*.*"


def test_handler_subject_shape() -> None:
    assert handler_subject("tool:pre", "security") == "hookbus.v1.handler.tool=3Apre.security"
    for event in TRICKY_NAMES:
        for handler in ("h", "a.b", "> *"):
            subject = handler_subject(event, handler)
            tokens = subject.split(".")
            assert tokens[:3] == ["hookbus", "v1", "handler"]
            assert len(tokens) == 5, subject  # a '.' in a name never adds a token
            assert decode_token(tokens[3]) == event
            assert decode_token(tokens[4]) == handler


def test_handler_queue_group_shape() -> None:
    assert handler_queue_group("security") == "security"
    assert handler_queue_group("my handler") == "my=20handler"
    for name in TRICKY_NAMES:
        assert SUBJECT_TOKEN.fullmatch(handler_queue_group(name))


def test_collect_subject_shape() -> None:
    assert collect_subject("tool:pre") == "hookbus.v1.collect.tool=3Apre"
    for event in TRICKY_NAMES:
        tokens = collect_subject(event).split(".")
        assert tokens[:3] == ["hookbus", "v1", "collect"]
        assert len(tokens) == 4
        assert decode_token(tokens[3]) == event


def test_inbox_reply_subject_shape() -> None:
    assert inbox_reply_subject("_INBOX.abc", "1f") == "_INBOX.abc.1f"
    assert inbox_reply_subject("_INBOX.abc", "*") == "_INBOX.abc.*"


def test_service_subject_shapes() -> None:
    assert emit_service_subject("tool:pre") == "hookbus.v1.emit.=.tool=3Apre"
    assert emit_service_subject("tool:pre", "a 1") == "hookbus.v1.emit.a=201.tool=3Apre"
    assert collect_service_subject("tool:pre", "a1") == "hookbus.v1.emit_and_collect.a1.tool=3Apre"
    for event in TRICKY_NAMES:
        for agent in (None, *TRICKY_NAMES):
            emit = emit_service_subject(event, agent)
            collect = collect_service_subject(event, agent)
            # each matches its service wildcard: same prefix, exactly two more tokens
            assert emit.split(".")[:3] == EMIT_SERVICE_WILDCARD.split(".")[:3]
            assert collect.split(".")[:3] == COLLECT_SERVICE_WILDCARD.split(".")[:3]
            assert len(emit.split(".")) == len(EMIT_SERVICE_WILDCARD.split("."))
            assert len(collect.split(".")) == len(COLLECT_SERVICE_WILDCARD.split("."))
            assert event_from_service_subject(emit) == event
            assert event_from_service_subject(collect) == event
            assert agent_from_service_subject(emit) == agent
            assert agent_from_service_subject(collect) == agent


def test_event_from_bad_service_subject() -> None:
    with pytest.raises(BadRequestError):
        event_from_service_subject("hookbus.v1.emit.tool=3apre")
    with pytest.raises(BadRequestError):
        event_from_service_subject("hookbus.v1.emit.")


def test_handler_key_shape() -> None:
    assert handler_key("tool:pre", "security") == "tool=3Apre.security"
    for event in TRICKY_NAMES:
        for handler in ("h", "a.b", "😀"):
            key = handler_key(event, handler)
            assert KV_KEY.fullmatch(key), key
            assert key.count(".") == 1
            assert parse_handler_key(key) == (event, handler)


@pytest.mark.parametrize("key", ["nodot", "a.b.c", "tool=3apre.x", ".x", "x."])
def test_parse_handler_key_rejects(key: str) -> None:
    with pytest.raises(BadRequestError):
        parse_handler_key(key)


def test_suspension_key_shape() -> None:
    """``<agent>.<label>``: the agent a token of its own, so that a NATS permission on
    ``$KV.hookbus_suspensions.<agent>.*`` confines an agent to its records; an answer proof
    adds the approver as a third token, which the agent's permission does not cover."""
    assert suspension_key("l:1") == "=.l=3A1"
    assert suspension_key("l:1", "payments") == "payments.l=3A1"
    for label in TRICKY_NAMES:
        for agent in (None, *TRICKY_NAMES):
            key = suspension_key(label, agent)
            assert KV_KEY.fullmatch(key) and key.count(".") == 1, key
            assert label_from_key(key) == label
            assert parse_suspension_key(key) == (agent, label)
            proof = approval_answer_key(label, agent, "alice.b")
            assert KV_KEY.fullmatch(proof) and proof.count(".") == 2
            assert proof.startswith(key + ".") and is_answer_key(proof) and not is_answer_key(key)
    with pytest.raises(BadRequestError):
        label_from_key("not.a.label")
    with pytest.raises(BadRequestError):
        suspension_key("")
    with pytest.raises(BadRequestError):
        approval_answer_key("l", "a", "")


@pytest.mark.parametrize("status", ["pending", "resolved", "cancelled"])
def test_suspension_event_subject_shape(status: str) -> None:
    assert (
        suspension_event_subject("approve:42", status, "a1")
        == f"hookbus.v1.suspension.a1.approve=3A42.{status}"
    )
    prefix = SUSPENSION_EVENTS_WILDCARD.removesuffix(">")
    for label in TRICKY_NAMES:
        for agent in (None, "a1", "a.b"):
            subject = suspension_event_subject(label, status, agent)
            assert subject.startswith(prefix)  # the wildcard hears it
            assert subject.startswith(suspension_events_subject(agent).removesuffix(">"))
            tokens = subject.split(".")
            assert len(tokens) == 6 and tokens[-1] == status
            assert decode_token(tokens[4]) == label


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    if p[-1] == ">":
        return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s, strict=False))
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s, strict=True))


def test_handler_and_suspension_subjects_never_meet() -> None:
    """A handler request and a suspension event differ in their third token (``handler``,
    ``suspension``), not by one letter: no wildcard of one family hears the other."""
    handler_wildcards = (
        "hookbus.v1.handler.*.*",
        "hookbus.v1.handler.*.*.*",
        "hookbus.v1.handler.>",
    )
    for name in TRICKY_NAMES:
        for agent in (None, "a1", name):
            for status in ("pending", "resolved", "cancelled"):
                event = suspension_event_subject(name, status, agent)
                assert event.split(".")[2] == "suspension"
                assert _matches(SUSPENSION_EVENTS_WILDCARD, event)
                assert not any(_matches(w, event) for w in handler_wildcards), event
        for subject in (handler_subject(name, "h"), handler_instance_subject(name, "h", "i1")):
            assert subject.split(".")[2] == "handler"
            assert any(_matches(w, subject) for w in handler_wildcards)
            assert not _matches(SUSPENSION_EVENTS_WILDCARD, subject), subject
            assert not _matches(suspension_events_subject(name), subject), subject


def test_the_former_names_are_gone() -> None:
    """One name per concept: the suspension-event subjects' names before they said
    *suspension* are not kept beside the new ones."""
    for name in ("HOOK_EVENTS_WILDCARD", "hook_event_subject", "hook_events_subject"):
        assert not hasattr(hookbus.schemas, name), name
    assert suspension_event_subject("l", "pending", "a") == "hookbus.v1.suspension.a.l.pending"


def test_grant_key_shape() -> None:
    """agent.session.event.handler.tool, each part encoded; an absent agent or tool is
    GRANT_NONE, which no name encodes to; no session, no key."""
    assert grant_key("a1", "s1", "tool:pre", "security", "bash") == "a1.s1.tool=3Apre.security.bash"
    assert grant_key(None, "s1", "e", "h", None) == f"{GRANT_NONE}.s1.e.h.{GRANT_NONE}"
    assert not hasattr(hookbus.schemas, "always_allow_key")  # its former name, gone
    scopes = [
        (a, s, "e", h, t)
        for a in (None, "a", "-", "=")
        for s in ("s1", "a.b", "ü")
        for h in ("h", "h.x")
        for t in (None, "bash", "*")
    ]
    keys = [grant_key(*scope) for scope in scopes]
    assert len(set(keys)) == len(scopes)  # one key per scope
    for key, scope in zip(keys, scopes, strict=True):
        assert KV_KEY.fullmatch(key), key
        assert parse_grant_key(key) == scope
    for bad in ("", "a.b.c", "a.=.e.h.t", "a.s.e.h.t.x", "a.s.e.h.x=1"):
        with pytest.raises(BadRequestError):
            parse_grant_key(bad)
    with pytest.raises(BadRequestError):
        grant_key("a", "", "e", "h", "t")


def test_run_claim_key_shape() -> None:
    """``r.<agent>.<run>`` in the leases bucket, beside the waiter leases ``w.<id>``: the
    agent a token of its own (a permission on ``r.<agent>.*`` confines an agent to its
    claims), the run id one encoded token; an unusable id is refused."""
    assert run_claim_key("payments", "run-42") == "r.payments.run-42"
    assert run_claim_key(None, "run:1") == "r.=.run=3A1"
    assert lease_key("0a1b") == "w.0a1b"
    keys = {run_claim_key(a, r) for a in (None, *TRICKY_NAMES) for r in TRICKY_NAMES}
    assert len(keys) == (1 + len(TRICKY_NAMES)) * len(TRICKY_NAMES)  # one key per run
    for key in keys:
        assert KV_KEY.fullmatch(key) and key.count(".") == 2, key
    assert run_claim_key("a", "é" * 170).count("=") == 340  # encoded: within the limit
    for bad in ("", None, 42, "x" * 1025, "é" * 171):
        with pytest.raises(BadRequestError, match="run id"):
            run_claim_key("a", bad)  # type: ignore[arg-type]
    for agent in ("x" * 201, 7):
        with pytest.raises(BadRequestError, match="agent"):
            run_claim_key(agent, "r")  # type: ignore[arg-type]
