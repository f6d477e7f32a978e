from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array, ArrayLike, DTypeLike

import quaxlike
from quaxlike.internal import ShapedArray, with_leaf_specs


_NOT_SCALAR_MSG = (
    "`Constant` holds one scalar that fills its whole shape, but got a value of shape "
    "{shape}. Pass a scalar (and the array's shape as `shape`), or use an ordinary "
    "array if the entries differ."
)

_STATIC_TRACER_MSG = (
    "`Constant(..., static=True)` needs a value known while tracing, but got a traced "
    "array ({aval}). Either pass a Python or NumPy number, or leave `static` unset so "
    "that the value is kept as a traced leaf."
)


class _StaticScalar:
    """A NumPy scalar for a static field, compared bit for bit.

    JAX compares static fields with `==` to decide whether a cached trace can be
    reused, and quaxlike does so to check that loop carries keep their type. With
    float `==`, `nan != nan` and `0.0 == -0.0`; comparing bits gives the answer
    both need.
    """

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def _key(self):
        return self.array.dtype.name, self.array.tobytes()

    def __eq__(self, other):
        return type(other) is _StaticScalar and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return repr(self.array.item())


def _default_dtype(value) -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(jax.dtypes.result_type(value)))


class Constant(quaxlike.ArrayValue):
    """An array whose every entry is the same scalar, stored as that one scalar.

    The scalar is either **static** (a Python or NumPy number, kept as a static
    field: it is part of the PyTree structure, so `jax.jit` specialises on it) or
    **traced** (a JAX scalar array kept as a leaf: `jax.jit`, `jax.grad` and
    `jax.vmap` see it). By default a Python or NumPy number is static and a JAX
    array is traced; `static=` overrides that.

    Inside `quaxify`, elementwise operations between Constants (and scalars) give a
    Constant whose scalar is computed once: at trace time for static ones, with
    JAX's own dtype semantics (integer wrap-around, truncating integer division,
    rounding to the dtype), or as a single scalar operation for traced ones.
    Broadcasts, reshapes, slices, reductions (`sum` is `value * count`) and matrix
    products with dense arrays are done in closed form, and `x * 1`, `x + 0`,
    `x * 0` are simplified. See the README for the full list.

    **Arguments:**

    - `value`: the scalar.
    - `shape`: the shape of the array it fills.
    - `dtype`: its dtype; by default the dtype JAX gives `value`.
    - `static`: whether to keep `value` as a static field (`True`) or a traced
        leaf (`False`); by default, static exactly when `value` is not a JAX array.

    !!! example

        ```python
        c = Constant(2.0, (3, 4), jnp.float32)
        out = quaxlike.quaxify(lambda c: jnp.sum(c * 3.0 + 1.0))(c)
        assert isinstance(out, Constant) and out.value == 84.0
        ```
    """

    _static_value: _StaticScalar | None = eqx.field(static=True)
    _traced_value: Array | None
    _shape: tuple[int, ...] = eqx.field(static=True)
    _dtype: np.dtype = eqx.field(static=True)

    def __init__(
        self,
        value: ArrayLike,
        shape: Sequence[int] = (),
        dtype: DTypeLike | None = None,
        *,
        static: bool | None = None,
    ):
        if np.ndim(value) != 0:
            raise ValueError(_NOT_SCALAR_MSG.format(shape=tuple(np.shape(value))))
        if static is None:
            static = not isinstance(value, jax.Array)
        dtype = _default_dtype(value) if dtype is None else np.dtype(dtype)
        self._shape = tuple(int(d) for d in shape)
        self._dtype = dtype
        if static:
            if isinstance(value, jax.core.Tracer):
                raise ValueError(_STATIC_TRACER_MSG.format(aval=value.aval.str_short()))
            self._static_value = _StaticScalar(np.asarray(value, dtype=dtype))
            self._traced_value = None
        else:
            # (A JAX array is kept as it is, so that Constants derived from one
            # another share their scalar and can be recognised as equal.)
            traced = value if isinstance(value, jax.Array) else jnp.asarray(value)
            if traced.dtype != dtype:
                traced = lax.convert_element_type(traced, dtype)
            self._static_value = None
            self._traced_value = traced

    @property
    def is_static(self) -> bool:
        """Whether the scalar is static (known at trace time) rather than traced."""
        return self._static_value is not None

    @property
    def value(self) -> Any:
        """The scalar: a Python number when static, a JAX scalar array when traced."""
        if self._static_value is not None:
            return self._static_value.array.item()
        return self._traced_value

    def scalar(self) -> Any:
        """The scalar as a 0-d array of the Constant's dtype: a NumPy array when
        static (so it stays a literal under `jax.jit`), a JAX array when traced."""
        if self._static_value is not None:
            return self._static_value.array
        return self._traced_value

    def logical_leaf_specs(self, spec: Any) -> "Constant":
        """The one scalar (a traced leaf, or static) stands for every entry: each device keeps it whole, whatever the sharding (see `quaxlike.leaf_specs`).

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with a `PartitionSpec` in place of each leaf.
        """
        return with_leaf_specs(self, _traced_value=PartitionSpec())

    def aval(self) -> ShapedArray:
        return ShapedArray(self._shape, self._dtype)

    def materialise(self) -> Array:
        return lax.full(self._shape, self.scalar(), self._dtype)
