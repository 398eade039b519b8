"""Chain requests: a sequence of adjacent handlers served by one worker process, in one request.

A worker process declares, with each of its handlers, the set of handler names it serves
(`HandlerDeclaration.handler_set`). Handlers whose declarations name the same set are served
by replicas of the same worker, so a dispatcher may send a sequence of them (adjacent in call
order) as one request to that set's chain subject; the worker runs them in order with
amplifier-core's semantics and answers every handler's reply at once (`HookReply.chain`).

The set's id is a digest of its names (`handler_set_id`), so a NATS permission can bind it:
a worker identity allowed to serve handlers ``{a, b}`` may subscribe to the chain subjects
of exactly ``{a, b}`` (see `hookbus.schemas.worker`), and a dispatcher only sends a chain to
the subject of a set that names every handler in it. The subject also names the event, so
processes serving the same names for different events never share a queue group.

The chain subjects are built with the others in `_subjects` (`chain_subject`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final

from ._subjects import encode_token

__all__ = ["MAX_HANDLER_SET", "handler_set_id"]

MAX_HANDLER_SET: Final = 64
"""Most handler names a declaration's ``handler_set`` may list (a larger set is not sent)."""


def handler_set_id(names: Iterable[str]) -> str:
    """The id of a set of handler names: 32 hex digits of SHA-256 over the sorted, unique,
    encoded names (`encode_token`), one per line. Order and repeats do not matter.

    Raises:
        BadRequestError: a name is empty.
    """
    tokens = sorted({encode_token(n) for n in names})
    return hashlib.sha256("\n".join(tokens).encode()).hexdigest()[:32]
