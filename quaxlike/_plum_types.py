"""plum and JAX's array types, as Quax sets them up.

- **Typed scalars.** `bind` hands rules Python scalars as JAX's typed scalars
  (`TypedInt(5, dtype=int32)`, a subclass of `int` carrying its dtype; see
  `_jax_compat.TYPED_SCALAR_TYPES`). They are `ArrayLike` but not `jax.Array`;
  a conversion lets `plum.convert(x, jax.Array)` (and plum's conversion of a
  result to a `-> jax.Array` annotation) turn one into a 0-d array of its own
  dtype, as Quax registers.
- **Faithful `jax.Array`.** plum caches a function's method resolution by
  argument type only when every annotation is *faithful* (an `isinstance`
  answer that depends on the type alone). `jax.Array`'s metaclass makes plum
  treat it as unfaithful, which switches the cache off for every function
  with a `jax.Array` method, plum's global `convert` included once the
  conversions above are registered. Quax marks `jax.Array` faithful
  (`jax.Array.__faithful__ = True`), and so does this module, so that code
  mixing both libraries sees one behaviour. (A tracer counts as a `jax.Array`
  by its aval; quaxlike's own rule matching keys on the aval's class too,
  see `_rules.dispatch_kind`, and does not use plum's cache.)
"""

import jax
import jax.numpy as jnp
import plum

from . import _jax_compat as jc


def typed_scalar_to_array(obj) -> jax.Array:
    """A JAX typed scalar (`TypedInt`, `TypedFloat`, `TypedComplex`) as a 0-d
    array of its dtype.

    **Arguments:**

    - `obj`: the typed scalar.

    **Returns:**

    `jnp.asarray(obj, dtype=obj.dtype)`.
    """
    return jnp.asarray(obj, dtype=obj.dtype)


for _typed in jc.TYPED_SCALAR_TYPES:
    plum.add_conversion_method(_typed, jax.Array, typed_scalar_to_array)

jax.Array.__faithful__ = True  # pyright: ignore[reportAttributeAccessIssue]
