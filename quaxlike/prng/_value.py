"""The `PRNGKeyValue` type: a PRNG key that refuses to be used as a number."""

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, cast, TypeVar

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import cannot_follow, logical_entries, ShapedArray, with_leaf_specs


class KeyArithmeticError(quaxlike.QuaxlikeError):
    """A primitive that treats its operands as numbers was applied to a PRNG key.

    !!! example

        ```python
        key = PRNGKeyValue(jax.random.PRNGKey(0))  # a legacy uint32[2] key
        try:
            quaxlike.quaxify(lambda k: k + 1)(key)
        except KeyArithmeticError as error:
            print(error)  # `add` was applied to a PRNG key ...
        ```"""


_NOT_A_NUMBER_MSG = (
    "`{primitive}` was applied to a PRNG key (a {type_name} presented as {presented}, "
    "argument {position}). PRNG keys are not numbers: arithmetic, reductions or "
    "dtype conversions on one give a key that is correlated with the original, or no "
    "valid key at all. Ways out: derive new keys with `jax.random.split(key)` or "
    "`jax.random.fold_in(key, i)`; draw numbers with `jax.random.uniform`, `normal` "
    "or `bits`; if you really need the raw bits, take them outside `quaxify` with "
    "`jax.random.key_data(value.key)`."
)
_NOT_A_KEY_MSG = (
    "PRNGKeyValue needs a typed key array (from `jax.random.key`) or raw uint32 key "
    "data (from `jax.random.PRNGKey`); got an array of dtype {dtype}."
)


_NOT_ITERABLE_MSG = (
    "Cannot iterate over a single PRNG key ({type_name} of key shape ()): only an "
    "array of keys, such as the result of `split(key, n)`, unpacks into keys. Split "
    "it first: `key, subkey = split(key)`."
)


def is_typed_key(x: Any) -> bool:
    """Whether `x` is (or stands for) a typed PRNG key array, of dtype `key<impl>`."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


@functools.cache
def key_data_struct(key_dtype) -> jax.ShapeDtypeStruct:
    """Shape and dtype of the raw data of one key of `key_dtype` (`u32[2]` for
    threefry), worked out abstractly."""
    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), key_dtype))


class PRNGKeyValue(quaxlike.ArrayValue):
    """A JAX PRNG key (or an array of them) that refuses to be used as a number.

    It always stores a typed key array (`jax.random.key`, dtype `key<impl>`), and
    presents itself to JAX code in one of two ways:

    - as that typed key array (`raw=False`, the default for typed keys), for code
      written against `jax.random.key`;
    - as its raw uint32 key data (`raw=True`, the default for data from the legacy
      `jax.random.PRNGKey`), for code that expects `u32[..., 2]` keys. JAX itself
      cannot tell such data from numbers and lets `key + 1` through; this Value
      does not.

    Inside `quaxlike.quaxify`, `jax.random.split`, `fold_in`, `uniform`, `normal`,
    `bits` and the other `jax.random` functions work on it and draw exactly the
    numbers they would draw from the wrapped key; new keys (from `split`,
    `fold_in`, indexing, reshaping, stacking, `jnp.where`, loop carries, ...) come
    back as `PRNGKeyValue`s presented the same way. Any primitive that would treat
    the key as a number (`add`, `mul`, `reduce_sum`, `convert_element_type`, ...)
    raises a `KeyArithmeticError` naming the primitive.

    **Arguments:**

    - `key`: a typed key array, or raw uint32 key data with the key shape of
        `impl` as its trailing dimensions.
    - `impl`: the PRNG implementation of raw key data (`"threefry2x32"`, `"rbg"`,
        ...); default: JAX's default implementation. Ignored for typed keys.
    - `raw`: present the key as raw key data (`True`) or as a typed key
        (`False`); default: the way `key` was given.

    !!! example

        ```python
        import jax
        import quaxlike
        from quaxlike.prng import PRNGKeyValue

        key = PRNGKeyValue(jax.random.key(0))

        @quaxlike.quaxify
        def draw(key):
            key, subkey = jax.random.split(key)
            return key, jax.random.normal(subkey, (3,))

        key, x = draw(key)  # key is a PRNGKeyValue; x equals the plain-JAX draw
        ```
    """

    key: jax.Array
    raw: bool = eqx.field(static=True)

    def __init__(self, key: ArrayLike, *, impl: str | None = None, raw: bool | None = None):
        if is_typed_key(key):
            self.key = key  # pyright: ignore[reportAttributeAccessIssue]
            self.raw = False if raw is None else raw
            return
        dtype = jnp.result_type(key)
        if not jnp.issubdtype(dtype, jnp.unsignedinteger):
            raise TypeError(_NOT_A_KEY_MSG.format(dtype=dtype))
        # `wrap_key_data` is annotated `Array` but binds a primitive, which takes
        # any array-like of unsigned integers.
        self.key = jax.random.wrap_key_data(cast(jax.Array, key), impl=impl)
        self.raw = True if raw is None else raw

    def logical_leaf_specs(self, spec: Any) -> "PRNGKeyValue":
        """The key array follows the sharding of the keys' axes (see
        `quaxlike.leaf_specs`); a raw value's last axis, the words of one key,
        cannot be split.

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with a `PartitionSpec` for its key array.
        """
        ndim = len(self.key.shape)
        entries = logical_entries(spec, ndim + (1 if self.raw else 0))
        if self.raw and entries[-1] is not None:
            raise cannot_follow(
                self, spec, ndim, "its last axis holds the words of one key, kept together."
            )
        return with_leaf_specs(self, key=PartitionSpec(*entries[:ndim]))

    def aval(self) -> ShapedArray:
        if self.raw:
            data = key_data_struct(self.key.dtype)
            return ShapedArray((*self.key.shape, *data.shape), data.dtype)
        return ShapedArray(self.key.shape, self.key.dtype)

    def materialise(self) -> jax.Array:
        return jax.random.key_data(self.key) if self.raw else self.key

    def __iter__(self) -> Iterator["PRNGKeyValue"]:
        # Unpacking an array of keys gives keys, as for a JAX key array
        # (`key, subkey = split(key)`), presented the same way and of the same
        # class. Raw key data never unpacks into its uint32 words.
        if not self.key.shape:
            raise TypeError(_NOT_ITERABLE_MSG.format(type_name=type(self).__qualname__))
        for i in range(self.key.shape[0]):
            yield with_key(self, self.key[i], self.raw)

    @property
    def impl(self) -> str:
        """The name of the PRNG implementation (`"threefry2x32"`, ...)."""
        return str(jax.random.key_impl(self.key))

    @staticmethod
    def default(
        primitive: jax.extend.core.Primitive, values: Sequence[Any], params: dict[str, Any]
    ) -> Any:
        # Every primitive the rules do not list as key-safe treats keys as numbers.
        position = next(i for i, v in enumerate(values) if isinstance(v, PRNGKeyValue))
        value = values[position]
        raise KeyArithmeticError(
            _NOT_A_NUMBER_MSG.format(
                primitive=primitive.name,
                type_name=type(value).__qualname__,
                presented=value.aval().str_short(),
                position=position,
            )
        )


_KeyT = TypeVar("_KeyT", bound=PRNGKeyValue)


def with_key(like: _KeyT, key: jax.Array, raw: bool) -> _KeyT:
    """A key of the same class as `like`, holding the typed key array `key`,
    presented raw or typed as `raw` says.

    New keys made by the rules (`split`, `fold_in`, indexing, `jnp.where`, ...)
    go through here, so a subclass (such as `ThreeFry`) gets its own class back
    and keeps any other fields of `like`. It does not call the subclass's
    `__init__`, which may take other arguments (a seed).
    """
    if type(like) is PRNGKeyValue:
        return cast(_KeyT, PRNGKeyValue(key, raw=raw))
    out = object.__new__(type(like))
    for field in dataclasses.fields(like):
        object.__setattr__(out, field.name, getattr(like, field.name))
    object.__setattr__(out, "key", key)
    object.__setattr__(out, "raw", raw)
    return out
