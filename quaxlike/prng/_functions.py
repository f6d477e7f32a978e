"""`split`, `fold_in`, `uniform` and `normal` that accept a `PRNGKeyValue` anywhere.

Each is the `jax.random` function under `quaxlike.quaxify`: called on a
`PRNGKeyValue` outside `quaxify`, it lifts the key and runs the rules; inside a
quaxified function (where the key is already lifted) or on a plain JAX key, it is
exactly the `jax.random` function.
"""

from collections.abc import Sequence
from typing import Any

import jax
from jaxtyping import ArrayLike, DTypeLike

import quaxlike

from ._value import PRNGKeyValue


def split(key: PRNGKeyValue | ArrayLike, num: int | tuple[int, ...] = 2) -> Any:
    """Split a key into `num` new keys, as `jax.random.split` does.

    **Arguments:**

    - `key`: a `PRNGKeyValue` (or a plain JAX key).
    - `num`: how many keys, or the shape of the array of keys.

    **Returns:**

    A `PRNGKeyValue` of shape `(num,)` (or `num`), presented like `key`.

    !!! example

        ```python
        keys = split(PRNGKeyValue(jax.random.key(0)), 4)
        ```
    """
    return quaxlike.quaxify(jax.random.split)(key, num)


def fold_in(key: PRNGKeyValue | ArrayLike, data: ArrayLike) -> Any:
    """Derive a new key from `key` and an integer, as `jax.random.fold_in` does.

    **Arguments:**

    - `key`: a `PRNGKeyValue` (or a plain JAX key).
    - `data`: a 32-bit integer (such as a step count).

    **Returns:**

    A `PRNGKeyValue`, presented like `key`.

    !!! example

        ```python
        key = fold_in(PRNGKeyValue(jax.random.key(0)), 3)
        assert jnp.array_equal(
            normal(key, (2,)), jax.random.normal(jax.random.fold_in(jax.random.key(0), 3), (2,))
        )
        ```
    """
    return quaxlike.quaxify(jax.random.fold_in)(key, data)


def uniform(
    key: PRNGKeyValue | ArrayLike,
    shape: Sequence[int] = (),
    dtype: DTypeLike = float,
    minval: ArrayLike = 0.0,
    maxval: ArrayLike = 1.0,
) -> jax.Array:
    """Uniform random numbers in `[minval, maxval)`, as `jax.random.uniform` draws.

    **Arguments:**

    - `key`: a `PRNGKeyValue` (or a plain JAX key).
    - `shape`, `dtype`, `minval`, `maxval`: as for `jax.random.uniform`.

    **Returns:**

    A plain array: the same numbers `jax.random.uniform` draws from the wrapped key.

    !!! example

        ```python
        draws = uniform(PRNGKeyValue(jax.random.key(0)), (3,), maxval=2.0)
        assert jnp.array_equal(draws, jax.random.uniform(jax.random.key(0), (3,), maxval=2.0))
        ```
    """
    return quaxlike.quaxify(jax.random.uniform)(key, tuple(shape), dtype, minval, maxval)


def normal(
    key: PRNGKeyValue | ArrayLike, shape: Sequence[int] = (), dtype: DTypeLike = float
) -> jax.Array:
    """Standard normal random numbers, as `jax.random.normal` draws.

    **Arguments:**

    - `key`: a `PRNGKeyValue` (or a plain JAX key).
    - `shape`, `dtype`: as for `jax.random.normal`.

    **Returns:**

    A plain array: the same numbers `jax.random.normal` draws from the wrapped key.

    !!! example

        ```python
        draws = normal(PRNGKeyValue(jax.random.key(0)), (3,))
        assert jnp.array_equal(draws, jax.random.normal(jax.random.key(0), (3,)))
        ```
    """
    return quaxlike.quaxify(jax.random.normal)(key, tuple(shape), dtype)
