"""`ArrayOperators`: an opt-in mixin giving an `ArrayValue` the interface of a `jax.Array`.

Every operator, method and property is routed through `quaxify`: the Value is
lifted into a fresh trace, where it is a tracer and so already has all of
`jax.Array`'s operators, and the same operator is applied there. What comes back
is exactly what the rules decided (a Value, or an array). Because each call opens
its own trace, this is equally correct eagerly, under `jax.jit`/`grad`/`vmap`, and
for a Value built inside another `quaxify` call: there the new trace sits on top of
the enclosing one, and anything the rules hand back is returned as it is.
"""

import operator
from collections.abc import Callable, Iterator
from typing import Any, cast

import equinox as eqx
import jax
import numpy as np

from ._diagnostics import MaterialisationError, QuaxlikeError
from ._quaxify import quaxify
from ._values import ArrayValue, materialise_value, Value


MSG_CONCRETE = (
    "`{what}` needs the concrete contents of a {type_name}, so it has to be "
    "materialised, and `{type_name}.materialise()` raised {error}. Operators, "
    "methods and `quaxlike.numpy` functions keep a {type_name} structured; turning "
    "one into a Python scalar, a bool or a NumPy array cannot. Ways out: reduce it "
    "first with operations the rules support, or construct it so that it may "
    "materialise."
)
MSG_SETITEM = (
    "`{type_name}` does not support item assignment: like a `jax.Array` it is "
    "immutable. Instead of `x[index] = y`, write `x = x.at[index].set(y)`."
)
MSG_MIXIN_ORDER = (
    "`class {name}(...)`: `ArrayOperators` must come before every Equinox Module in "
    "the bases, or `eqx.Module`'s structural `__eq__` and `__hash__` win over the "
    "array ones. Write `class {name}(quaxlike.ArrayOperators, {base}): ...`."
)
MSG_MIXIN_NOT_ARRAY = (
    "`class {name}` mixes in `ArrayOperators` but is not a `quaxlike.ArrayValue`: the "
    "operators need a shape and dtype. Subclass `quaxlike.ArrayValue` (or a subclass "
    "of it) as well."
)


def _in_trace(name: str, kind: str) -> Callable[..., Any]:
    """A quaxified function applying `getattr(x, name)` to the lifted Value `x`:
    called with the remaining arguments when `kind` is "method", returned when
    "property"."""

    if kind == "method":
        # One name, two signatures (one per branch): pyright flags the pair.
        def on_tracer(x, *args, **kwargs):  # pyright: ignore[reportRedeclaration]
            return getattr(x, name)(*args, **kwargs)
    else:

        def on_tracer(x):
            return getattr(x, name)

    on_tracer.__name__ = on_tracer.__qualname__ = name
    return quaxify(on_tracer)


def _doc(name: str) -> str | None:
    # Methods keep `jax.Array`'s docstrings; its dunders have none worth copying.
    return getattr(getattr(jax.Array, name, None), "__doc__", None)


def _method(name: str) -> Callable[..., Any]:
    run = _in_trace(name, "method")

    def method(self, *args: Any, **kwargs: Any) -> Any:
        return run(self, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"ArrayOperators.{name}"
    method.__doc__ = _doc(name)
    return method


def _property(name: str) -> property:
    run = _in_trace(name, "property")

    def getter(self) -> Any:
        return run(self)

    getter.__name__ = name
    return property(getter, doc=_doc(name))


def _dense(x: Any, what: str) -> Any:
    """`x` materialised if it is a Value (for conversions to Python/NumPy objects,
    which need actual contents); with a teaching error if its type refuses."""
    if not isinstance(x, Value):
        return x
    try:
        return materialise_value(x)
    except QuaxlikeError:
        raise
    except Exception as error:
        raise MaterialisationError(
            MSG_CONCRETE.format(
                what=what, type_name=type(x).__qualname__, error=f"{type(error).__name__}: {error}"
            )
        ) from error


_contains = _in_trace("__contains__", "method")
_unstack = quaxify(list)
_reverse_unstack = quaxify(lambda x: list(x[::-1]))


class ArrayOperators:
    """Opt-in mixin giving an `ArrayValue` subclass the operators, methods and
    properties of a `jax.Array`, so that `z * 2`, `2 * z`, `lora @ x`, `q.T` and
    `q.sum(axis=0)` work without writing `quaxify`.

    Each operation is routed through `quaxify`: the Value is lifted and the same
    `jax.Array` operation is applied to it, so the registered rules decide the
    result, a Value or an array, exactly as inside a quaxified function. It works
    eagerly, under `jax.jit`, `eqx.filter_jit`, `grad` and `vmap`, and inside an
    enclosing `quaxify` call.

    Put it first among the bases, before the Value type:
    `class MyArray(quaxlike.ArrayOperators, quaxlike.ArrayValue)`. Without it, a
    Value keeps Quax's behaviour: no operators, only `quaxify`.

    What it provides:

    - arithmetic, bitwise and matrix operators with their reflected forms
        (`+ - * / // % divmod ** @ & | ^ << >>`), unary `- + abs ~` and `round`;
    - comparisons `< <= > >= == !=`, all elementwise, as for arrays;
    - `x[index]`, `x.at[index].set(...)` (and `.add`, `.get`, ...), `len`, `iter`,
        `reversed`, `in`;
    - the methods of `jax.Array` (`reshape`, `astype`, `sum`, `mean`, `max`,
        `argmax`, `std`, `var`, `cumsum`, `clip`, `transpose`, ...) and the
        properties `T`, `mT`, `real`, `imag`;
    - `__array_namespace__`, returning `quaxlike.numpy`.

    Conversions to Python or NumPy objects (`bool(x)`, `int(x)`, `float(x)`,
    `x.item()`, `x.tolist()`, `np.asarray(x)`) need the contents, so they
    materialise the Value; under `jax.jit` they fail as they would for an array.

    !!! info "Equality and hashing"

        `==` and `!=` are elementwise, as for a `jax.Array`, and replace Equinox's
        structural comparison of Modules. For the same reason instances are
        unhashable (`__hash__ = None`, as for `jax.Array`): they cannot be set
        members, dict keys or `static_argnums` of `jax.jit`. PyTree operations,
        `jax.jit` and `eqx.filter_jit` are unaffected; compare two Values
        structurally with `eqx.tree_equal(a, b)`.

    !!! info "No `__jax_array__`"

        The mixin does not define `__jax_array__`: that hook would make every plain
        `jax.numpy` function silently materialise the Value, bypassing its rules (or
        raising, for types that refuse to become dense). Use `quaxlike.numpy`
        instead: `qnp.sin(x)` runs the rules. For the same reason NumPy's ufuncs are
        refused (`__array_ufunc__ = None`), which also makes `numpy_array * x` use
        the reflected operator of `x`.

    **Arguments:**

    None of its own: it adds methods only. The class it is mixed into keeps its
    fields and constructor.

    !!! example

        ```python
        from quaxlike.symbolic.zero import Zero

        class MyZero(quaxlike.ArrayOperators, Zero):
            pass

        z = MyZero((3, 3), jnp.float32)
        x = jnp.arange(6.0).reshape(3, 2)
        assert isinstance(z * 2, Zero)          # Zero's `mul` rule
        assert isinstance(z @ x, Zero) and (z @ x).shape == (3, 2)
        assert (z + jnp.ones((3, 3)) == 1).all()  # Zero's `add` rule: the other operand
        ```
    """

    # NumPy: no ufuncs on Values, and defer binary operators to the reflected ones.
    __array_ufunc__ = None
    # Elementwise `__eq__` below, as for `jax.Array` (which also sets this).
    __hash__ = None  # pyright: ignore[reportAssignmentType]

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if not issubclass(cls, eqx.Module):
            return  # another mixin built on this one; checked when it meets a Module
        if not issubclass(cls, ArrayValue):
            raise TypeError(MSG_MIXIN_NOT_ARRAY.format(name=cls.__qualname__))
        mro = cls.__mro__
        if mro.index(ArrayOperators) > mro.index(eqx.Module):
            base = next(b for b in cls.__bases__ if issubclass(b, eqx.Module))
            raise TypeError(MSG_MIXIN_ORDER.format(name=cls.__qualname__, base=base.__qualname__))

    # --- operators -------------------------------------------------------------

    __neg__ = _method("__neg__")
    __pos__ = _method("__pos__")
    __abs__ = _method("__abs__")
    __invert__ = _method("__invert__")
    __round__ = _method("__round__")

    __eq__ = _method("__eq__")  # pyright: ignore[reportAssignmentType]
    __ne__ = _method("__ne__")  # pyright: ignore[reportAssignmentType]
    __lt__ = _method("__lt__")
    __le__ = _method("__le__")
    __gt__ = _method("__gt__")
    __ge__ = _method("__ge__")

    __add__ = _method("__add__")
    __radd__ = _method("__radd__")
    __sub__ = _method("__sub__")
    __rsub__ = _method("__rsub__")
    __mul__ = _method("__mul__")
    __rmul__ = _method("__rmul__")
    __truediv__ = _method("__truediv__")
    __rtruediv__ = _method("__rtruediv__")
    __floordiv__ = _method("__floordiv__")
    __rfloordiv__ = _method("__rfloordiv__")
    __mod__ = _method("__mod__")
    __rmod__ = _method("__rmod__")
    __divmod__ = _method("__divmod__")
    __rdivmod__ = _method("__rdivmod__")
    __pow__ = _method("__pow__")
    __rpow__ = _method("__rpow__")
    __matmul__ = _method("__matmul__")
    __rmatmul__ = _method("__rmatmul__")
    __and__ = _method("__and__")
    __rand__ = _method("__rand__")
    __or__ = _method("__or__")
    __ror__ = _method("__ror__")
    __xor__ = _method("__xor__")
    __rxor__ = _method("__rxor__")
    __lshift__ = _method("__lshift__")
    __rlshift__ = _method("__rlshift__")
    __rshift__ = _method("__rshift__")
    __rrshift__ = _method("__rrshift__")

    # --- indexing and the sequence protocol --------------------------------------

    __getitem__ = _method("__getitem__")

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError(MSG_SETITEM.format(type_name=type(self).__qualname__))

    @property
    def at(self) -> "_IndexUpdateHelper":
        """Indexed updates, as `jax.Array.at`: `x.at[index].set(y)`, `.add(y)`,
        `.multiply(y)`, `.min(y)`, `.max(y)`, `.get()`, ... each routed through
        `quaxify`."""
        # `__init_subclass__` makes every Module using this mixin an `ArrayValue`.
        return _IndexUpdateHelper(cast(ArrayValue, self))

    def __len__(self) -> int:
        shape = self.shape  # pyright: ignore[reportAttributeAccessIssue]
        if not shape:
            raise TypeError("len() of unsized object")  # as for a 0-d array
        return shape[0]

    def __iter__(self) -> Iterator[Any]:
        # One trace for all the slices, rather than one `x[i]` call each.
        return iter(_unstack(self))

    def __reversed__(self) -> Iterator[Any]:
        return iter(_reverse_unstack(self))

    def __contains__(self, item: Any) -> bool:
        return bool(_dense(_contains(self, item), "in"))

    # --- methods and properties of jax.Array ---------------------------------------

    all = _method("all")
    any = _method("any")
    argmax = _method("argmax")
    argmin = _method("argmin")
    argpartition = _method("argpartition")
    argsort = _method("argsort")
    astype = _method("astype")
    choose = _method("choose")
    clip = _method("clip")
    compress = _method("compress")
    conj = _method("conj")
    conjugate = _method("conjugate")
    copy = _method("copy")
    cumprod = _method("cumprod")
    cumsum = _method("cumsum")
    diagonal = _method("diagonal")
    dot = _method("dot")
    flatten = _method("flatten")
    max = _method("max")
    mean = _method("mean")
    min = _method("min")
    nonzero = _method("nonzero")
    prod = _method("prod")
    ptp = _method("ptp")
    ravel = _method("ravel")
    repeat = _method("repeat")
    reshape = _method("reshape")
    round = _method("round")
    searchsorted = _method("searchsorted")
    sort = _method("sort")
    squeeze = _method("squeeze")
    std = _method("std")
    sum = _method("sum")
    swapaxes = _method("swapaxes")
    take = _method("take")
    trace = _method("trace")
    transpose = _method("transpose")
    var = _method("var")
    view = _method("view")

    T = _property("T")
    mT = _property("mT")
    real = _property("real")
    imag = _property("imag")

    @property
    def itemsize(self) -> int:
        """Length of one array element in bytes."""
        return self.dtype.itemsize  # pyright: ignore[reportAttributeAccessIssue]

    def __array_namespace__(self, *, api_version: str | None = None) -> Any:
        """The array API namespace for Values: `quaxlike.numpy`."""
        del api_version
        from . import numpy as qnp

        return qnp

    # --- conversions: these need the contents, so they materialise ----------------

    def __bool__(self) -> bool:
        return bool(_dense(self, "bool()"))

    def __int__(self) -> int:
        return int(_dense(self, "int()"))

    def __float__(self) -> float:
        return float(_dense(self, "float()"))

    def __complex__(self) -> complex:
        return complex(_dense(self, "complex()"))

    def __index__(self) -> int:
        return operator.index(_dense(self, "operator.index()"))

    def item(self, *args: Any) -> Any:
        """Copy an element to a standard Python scalar (materialises the Value)."""
        return np.asarray(_dense(self, ".item()")).item(*args)

    def tolist(self) -> Any:
        """The contents as nested Python lists (materialises the Value)."""
        return np.asarray(_dense(self, ".tolist()")).tolist()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = np.asarray(_dense(self, "np.asarray()"), dtype=dtype)
        return out.copy() if copy else out


class _IndexUpdateHelper:
    """`value.at`: indexing it gives an `_IndexUpdateRef`."""

    __slots__ = ("value",)

    def __init__(self, value: ArrayValue):
        self.value = value

    def __getitem__(self, index: Any) -> "_IndexUpdateRef":
        return _IndexUpdateRef(self.value, index)

    def __repr__(self) -> str:
        return f"_IndexUpdateHelper({self.value!r})"


def _at_update(x, index, name, args, kwargs):
    return getattr(x.at[index], name)(*args, **kwargs)


_run_at_update = quaxify(_at_update)


class _IndexUpdateRef:
    """`value.at[index]`: each method (`set`, `add`, `get`, ...) applies the
    `jax.Array.at[index]` method of the same name inside `quaxify`."""

    __slots__ = ("value", "index")

    def __init__(self, value: ArrayValue, index: Any):
        self.value = value
        self.index = index

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)

        def update(*args: Any, **kwargs: Any) -> Any:
            return _run_at_update(self.value, self.index, name, args, kwargs)

        update.__name__ = name
        return update

    def __repr__(self) -> str:
        return f"_IndexUpdateRef({self.value!r}, {self.index!r})"
