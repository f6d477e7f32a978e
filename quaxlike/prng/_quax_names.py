"""Quax's names for PRNG keys: `PRNG` and `ThreeFry(seed)`.

Both are `PRNGKeyValue`s, so every rule for keys applies to them and they draw
exactly what `jax.random` draws from the same key. New keys made from a
`ThreeFry` (by `split`, `fold_in`, `jnp.where`, ...) are `ThreeFry`s again.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from ._functions import split
from ._value import PRNGKeyValue


_CUSTOM_GENERATOR_MSG = (
    "{cls} overrides `{method}`, as a new generator for Quax's `PRNG` would. quaxlike "
    "does not call it: keys draw through JAX's own PRNG implementations (the "
    "`random_bits` primitive), so a custom `{method}` would be silently ignored. "
    "Ways out: build keys of another JAX implementation, "
    "`PRNGKeyValue(jax.random.key(seed, impl='rbg'))`; or write a new type with its "
    "own rules for the `random_bits` and `random_split` primitives."
)


class PRNG(PRNGKeyValue):
    """The base class of Quax-style PRNG keys (Quax's `prng.PRNG`).

    A `PRNGKeyValue` with Quax's two methods, `random_bits` and `split`. Use it
    in `isinstance` checks and rule annotations as with Quax; build keys with a
    subclass such as `ThreeFry`. Unlike Quax, a subclass cannot define a new
    generator by overriding `random_bits` or `split` (that raises a `TypeError`
    at class creation): draws go through JAX's PRNG implementations.

    **Arguments:**

    As `PRNGKeyValue`: `key`, a typed key array (or raw key data), `impl` and
    `raw`.

    !!! example

        ```python
        key = ThreeFry(0)
        assert isinstance(key, PRNG) and isinstance(key, PRNGKeyValue)
        bits = key.random_bits(32, (3,))
        assert jnp.array_equal(bits, jax.random.bits(jax.random.key(0), (3,)))
        ```
    """

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        for method in ("random_bits", "split"):
            if method in vars(cls):
                raise TypeError(_CUSTOM_GENERATOR_MSG.format(cls=cls.__qualname__, method=method))

    def random_bits(self, bit_width: int, shape: tuple[int, ...]) -> Array:
        """Random unsigned integers of `bit_width` bits (Quax's method); the same as
        `jax.random.bits` draws from this key.

        **Arguments:**

        - `bit_width`: 8, 16, 32 or 64.
        - `shape`: the shape of the result.

        **Returns:**

        An array of dtype `uint{bit_width}` and shape `shape`.

        !!! example

            ```python
            bits = ThreeFry(1).random_bits(8, (2, 2))
            assert bits.dtype == jnp.uint8
            ```
        """
        if bit_width not in (8, 16, 32, 64):
            raise ValueError(f"`random_bits`: bit_width must be 8, 16, 32 or 64; got {bit_width}.")
        return jax.random.bits(self.key, tuple(shape), dtype=jnp.dtype(f"uint{bit_width}"))

    def split(self, num: int = 2) -> list[Any]:
        """Split this key into `num` keys of the same class (Quax's method).

        **Arguments:**

        - `num`: how many keys.

        **Returns:**

        A list of `num` keys, the same keys as `split(key, num)` unpacked.

        !!! example

            ```python
            key, subkey = ThreeFry(0).split()
            assert isinstance(subkey, ThreeFry)
            ```
        """
        return list(split(self, num))


class ThreeFry(PRNG):
    """A threefry PRNG key made from an integer seed (Quax's `prng.ThreeFry`).

    It holds `jax.random.key(seed, impl="threefry2x32")`, presented as a typed
    key. `uniform`, `normal` and `split` accept it outside `quaxify`; inside,
    the `jax.random` functions and `jnp.where` work on it. Keys made from it
    are `ThreeFry`s; arithmetic on it raises (a `TypeError` outside `quaxify`, a
    `KeyArithmeticError` inside).

    **Arguments:**

    - `seed`: an integer scalar.

    !!! example

        ```python
        key = ThreeFry(0)
        key, subkey = split(key)
        x = normal(subkey, (3,))
        _, plain_subkey = jax.random.split(jax.random.key(0))
        assert jnp.array_equal(x, jax.random.normal(plain_subkey, (3,)))
        ```
    """

    def __init__(self, seed: ArrayLike):
        self.key = jax.random.key(seed, impl="threefry2x32")
        self.raw = False
