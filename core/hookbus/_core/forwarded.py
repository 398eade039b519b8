"""`Forwarded`: an attribute of an object that lives on a part it holds (a setting the
part reads at each use), read and written through the owner."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

__all__ = ["Forwarded"]

T = TypeVar("T")


class Forwarded(Generic[T]):
    """A read-write attribute kept on the owner's part `part` under the same name:
    ``grant_ttl_s = Forwarded[float]("_answers", "Seconds ...")`` in a class body reads
    and writes ``self._answers.grant_ttl_s``. On the class it is the descriptor itself,
    with `doc` as its docstring."""

    def __init__(self, part: str, doc: str) -> None:
        self._part = part
        self._name = ""
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Forwarded[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self._part), self._name)

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self._part), self._name, value)
