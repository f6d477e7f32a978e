"""`LowRankValue`: what `LoraArray` and `LoraConvKernel` share.

Both stand for a frozen weight `W` plus a trainable low-rank update built from two
factors `A` and `B`, and differ only in how the factors are laid out (a matrix
product for `LoraArray`, a 1x1 convolution after a kernel for `LoraConvKernel`).
The fields, the checks on them, freezing `W` and refusing to materialise live here
once; each subclass says how its update is laid out and built.
"""

import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

import quaxlike
from quaxlike.internal import ShapedArray


_BAD_RANK_MSG = "{cls} needs a positive integer `rank`; got {rank!r}."
_NO_WEIGHT_MSG = (
    "This {cls}'s weight `w` is missing (None where its arrays should be): it is "
    "the trainable half of `partition(model)` (or of `eqx.partition`). Put the model "
    "back together with `eqx.combine(trainable, frozen)` before calling it through "
    "`quaxlike.quaxify`."
)


def shape_of(x: Any) -> tuple[int, ...]:
    """The shape of an array, a Value or an array-like."""
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def check_rank(cls: type, rank: Any) -> int:
    """`rank` as an int, or a `ValueError` naming `cls` if it is not a positive integer."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(_BAD_RANK_MSG.format(cls=cls.__name__, rank=rank))
    return int(rank)


def check_weight(
    weight: ArrayLike | quaxlike.ArrayValue, min_ndim: int, message: str
) -> Array | quaxlike.ArrayValue:
    """`weight` as an array (or the Value it is), or a `ValueError` with `message`
    (formatted with `what=`) unless it is floating-point with `min_ndim` dimensions."""
    if not isinstance(weight, (jax.Array, quaxlike.Value)):
        weight = jnp.asarray(weight)
    shape = shape_of(weight)
    if len(shape) < min_ndim or not jnp.issubdtype(weight.dtype, jnp.inexact):
        raise ValueError(message.format(what=f"an array of dtype {weight.dtype} and shape {shape}"))
    return weight


class LowRankValue(quaxlike.ArrayValue):
    """A frozen weight `w` plus a trainable low-rank update built from `a` and `b`.

    The base of `LoraArray` and `LoraConvKernel`: it holds the three arrays and the
    two flags, reads the value's shape and dtype from `w`, freezes `w` with
    `frozen_weight()` and refuses to materialise unless `allow_materialise`. A
    subclass sets `refuse_message` and defines `dense_from(w, a, b)`, how its
    update is laid out.

    **Arguments:**

    - `w`: the frozen weight, an array or a Value (such as an `Int4Array`).
    - `a`, `b`: the trainable factors, laid out as the subclass says.
    - `allow_materialise`: let primitives with no rule for the type fall back to
        the dense weight (otherwise they raise).
    - `stop_gradient`: keep gradients from reaching `w`.

    !!! example

        ```python
        lora = LoraArray(jnp.ones((3, 4)), rank=2, key=jr.key(0))
        assert isinstance(lora, LowRankValue) and lora.rank == 2
        ```
    """

    # W + update(A, B) is bilinear in (A, B): a tangent of the leaves is not one.
    structured_tangents: ClassVar[bool] = False
    # Formatted with `shape=` when a primitive with no rule needs the dense array.
    refuse_message: ClassVar[str] = "Refusing to materialise a {cls} of shape {shape}."

    w: Array | quaxlike.ArrayValue
    a: Array | quaxlike.ArrayValue
    b: Array | quaxlike.ArrayValue
    allow_materialise: bool = eqx.field(static=True)
    stop_gradient: bool = eqx.field(static=True)

    @property
    def rank(self) -> int:
        """The rank of the update (the last dimension of `a`)."""
        return shape_of(self.a)[-1]

    def aval(self) -> ShapedArray:
        # Reads shapes and dtypes only: no operation enters a traced program.
        try:
            return ShapedArray(shape_of(self.w), self.w.dtype)
        except (AttributeError, TypeError) as error:
            is_none = lambda x: x is None  # noqa: E731
            if any(map(is_none, jax.tree_util.tree_leaves(self.w, is_leaf=is_none))):
                raise TypeError(_NO_WEIGHT_MSG.format(cls=type(self).__name__)) from error
            raise

    def frozen_weight(self) -> Any:
        """`W`, behind `lax.stop_gradient` when the weight is frozen.

        **Returns:**

        `w` itself when `stop_gradient` is off. Otherwise a dense `w` behind
        `lax.stop_gradient`, or a Value `w` with every array leaf behind it: a Value
        stands for a function of its leaves, so stopping the gradient at every leaf
        stops it at the value, whatever the type (quantised, sparse, another LoRA),
        with no rule needed.
        """
        if not self.stop_gradient:
            return self.w
        if isinstance(self.w, quaxlike.Value):
            stop = lambda x: lax.stop_gradient(x) if eqx.is_array(x) else x  # noqa: E731
            return jax.tree_util.tree_map(stop, self.w)
        return lax.stop_gradient(self.w)

    def thawed(self) -> Any:
        """This value with its frozen weight behind `lax.stop_gradient` and the flag
        off: the same array and the same derivatives, for rules that combine `W`
        with other traced values.

        **Returns:**

        A value of the same type (`self` when `W` is not frozen).
        """
        if not self.stop_gradient:
            return self
        return self._replaced(w=self.frozen_weight(), stop_gradient=False)

    def joinable_form(self) -> Any:
        # Where a plain array meets this value (a loop state that starts as
        # zeros), the plain side holds the array in `W`: `W` must not be frozen
        # there, or the array's derivative would stop. Thawed, both sides agree.
        return self.thawed()

    def holding_plain(self, array: Any) -> Any:
        # `array + 0 @ 0`: the array in `W`, zero factors, exactly `array`. A Value
        # `W` (a quantised weight) cannot hold an arbitrary array.
        parts = (self.w, self.a, self.b)
        if any(isinstance(part, quaxlike.Value) for part in parts):
            return None
        if shape_of(array) != shape_of(self.w) or jnp.result_type(array) != self.w.dtype:
            return None
        fields = dataclasses.fields(self)
        others = (getattr(self, f.name) for f in fields if f.name not in ("w", "a", "b"))
        if any(hasattr(other, "shape") for other in others):
            return None  # other arrays (a subclass's): nothing known to put there
        zeros = lambda leaf: jnp.zeros(leaf.shape, leaf.dtype)  # noqa: E731
        return self._replaced(w=array, a=zeros(self.a), b=zeros(self.b))

    def materialise(self) -> Any:
        if not self.allow_materialise:
            raise RuntimeError(
                self.refuse_message.format(cls=type(self).__name__, shape=shape_of(self.w))
            )
        return self.dense()

    def logical_ndim(self) -> int:
        """The number of axes of the array this value stands for, read from
        whichever of `w`, `a`, `b` is present (one half of a partitioned model
        holds only some)."""
        if jax.tree_util.tree_leaves(self.w):  # not the trainable half's empty `w`
            return len(shape_of(self.w))
        return self._ndim_from_factors()

    def _ndim_from_factors(self) -> int:
        return len(shape_of(self.a if self.a is not None else self.b))

    def weight_leaf_specs(self, spec: Any) -> Any:
        """The specs of `w`'s leaves when the value is sharded by `spec` (`w` has
        the value's shape): `spec` for a dense `w`, a Value's own declaration
        otherwise (a quantised `W` of a QLoRA weight splits its codes and scales
        along the same rows)."""
        return quaxlike.leaf_specs(self.w, spec)

    def dense(self) -> Any:
        """The dense array this value stands for, whatever `allow_materialise` says
        (it is what `materialise()` builds when allowed). `W` is behind
        `lax.stop_gradient` when the weight is frozen.

        **Returns:**

        An array (or a Value, if `W` is one) of this value's shape and dtype.
        """
        return self.dense_from(self.frozen_weight(), self.a, self.b)

    def dense_for_derivatives(self) -> Any:
        # Derivatives need the dense array's tangent or a cotangent's pull-back
        # (`ct @ B.T`, `A.T @ ct`), never the array itself: quaxlike differentiates
        # this inside `jax.jit`, so `allow_materialise` need not be set for them.
        # A quantised W: its own array for derivatives.
        w = quaxlike.internal.array_for_derivatives(self.frozen_weight())
        return self.dense_from(w, self.a, self.b)

    def merged(self) -> Any:
        """`W` plus the update as one array, with no `stop_gradient` at `W`: what
        `merge` bakes into a model.

        **Returns:**

        An array (or a Value, if `W` is one) of this value's shape and dtype.
        """
        return self.dense_from(self.w, self.a, self.b)

    def dense_from(self, w: Any, a: Any, b: Any) -> Any:
        """`w` plus the update built from `a` and `b`, in this type's layout."""
        raise NotImplementedError(f"{type(self).__name__} defines no `dense_from`.")

    def _replaced(self, **changes: Any) -> Any:
        """A copy with the fields in `changes` replaced, built field by field (the
        static ones too, which `eqx.tree_at` cannot change)."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        fields.update(changes)
        return type(self)._from_fields(**fields)

    @classmethod
    def _from_fields(cls, **fields: Any) -> Any:
        # Equinox's own unflattening builds Modules this way: the fields are set
        # directly, bypassing `__init__` (which would draw `a`).
        self = object.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        return self
