"""``__repr__`` and ``__eq__`` for dataclasses without generating their source (cold start).

``dataclasses`` writes each method it adds as Python source and ``exec``s it: parsing and
compiling those ~150 small functions is a fifth of a cold ``kvdoctor diagnose --bundle``
(issue 8, class 10; callgrind: ~0.7 M instructions per method). :func:`shared_methods` gives a
class declared ``@dataclass(repr=False, eq=False)`` the very ``__repr__`` and ``__eq__`` (and,
frozen, ``__hash__``) that ``@dataclass`` would have generated, as closures (no source, no
``exec``). ``__init__`` (and a frozen class's ``__setattr__``/``__delattr__``) stay generated:
``__init__`` runs once per fact, the others rarely.

Same semantics as Python 3.11's generated methods: ``repr`` is ``QualName(a=1, b='x')`` over
the fields with ``repr=True`` (a recursive reference prints ``...``); ``==`` compares the
fields with ``compare=True`` as one tuple (so an object ``is`` itself counts as equal, NaN
included) when both objects are of the very same class, else ``NotImplemented``; and, as for
any non-frozen dataclass with ``eq``, instances are unhashable unless the class body defines
``__hash__``; a frozen one hashes the tuple of its fields with ``hash=True`` (or ``hash=None``
and ``compare=True``). ``dataclasses.fields``/``asdict``/``replace`` see an ordinary dataclass.
"""

from __future__ import annotations

import dataclasses
import operator
import reprlib
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["shared_methods"]

T = TypeVar("T", bound=type)


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if len(names) == 1:
        (name,) = names
        return lambda obj: (getattr(obj, name),)  # attrgetter of one name gives no tuple
    if not names:
        return lambda obj: ()
    return operator.attrgetter(*names)


def shared_methods(cls: T) -> T:
    """Add the ``__repr__`` and ``__eq__`` (and, for a frozen class, ``__hash__``) that
    ``@dataclass`` generates to ``cls``, a dataclass declared with ``repr=False, eq=False``
    (frozen or not). A method the class body defines itself is kept. Raises TypeError for any
    other class."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or params.repr or params.eq or params.unsafe_hash or params.order:
        raise TypeError(f"{cls.__name__}: expected @dataclass(repr=False, eq=False)")
    fields = dataclasses.fields(cls)
    shown = tuple(f.name for f in fields if f.repr)
    values = _getter(tuple(f.name for f in fields if f.compare))

    @reprlib.recursive_repr()
    def __repr__(self: Any) -> str:  # noqa: N807 - the method's own name
        return f"{self.__class__.__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in shown)})"

    def __eq__(self: Any, other: object) -> Any:  # noqa: N807
        if other.__class__ is self.__class__:
            return values(self) == values(other)
        return NotImplemented

    for name, method in (("__repr__", __repr__), ("__eq__", __eq__)):
        if name not in cls.__dict__:
            method.__qualname__ = f"{cls.__qualname__}.{name}"
            setattr(cls, name, method)
    if "__hash__" in cls.__dict__ and cls.__dict__["__hash__"] is not None:
        return cls  # the class body's own
    if params.frozen:
        # frozen with eq: hashed by the fields that take part in it, as one tuple
        hashed = _getter(tuple(f.name for f in fields if f.hash or (f.hash is None and f.compare)))

        def __hash__(self: Any) -> int:  # noqa: N807
            return hash(hashed(self))

        __hash__.__qualname__ = f"{cls.__qualname__}.__hash__"
        cls.__hash__ = __hash__  # type: ignore[assignment]
    else:
        cls.__hash__ = None  # type: ignore[assignment]  # eq without frozen: unhashable
    return cls
