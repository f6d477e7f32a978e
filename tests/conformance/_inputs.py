"""The `Case` record of the conformance table, and builders for its example inputs.

Inputs come from one NumPy generator seeded once, so the table is the same on every
run; each builder returns a `jax.Array` with the dtype its name says.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import quaxlike


_rng = np.random.default_rng(20240611)


def f32(*shape, low=-2.0, high=2.0):
    return jnp.asarray(_rng.uniform(low, high, shape).astype(np.float32))


def pos(*shape):
    """Positive float32 (for log, sqrt, ...)."""
    return f32(*shape, low=0.5, high=2.0)


def unit(*shape):
    """Float32 strictly inside (-1, 1) (for arcsin, arctanh, erf_inv, ...)."""
    return f32(*shape, low=-0.9, high=0.9)


def bf16(*shape):
    return f32(*shape).astype(jnp.bfloat16)


def f16(*shape):
    return f32(*shape).astype(jnp.float16)


def i32(*shape, low=-5, high=6):
    return jnp.asarray(_rng.integers(low, high, shape).astype(np.int32))


def idx(*shape, high):
    """int32 indices in `[0, high)`."""
    return i32(*shape, low=0, high=high)


def u32(*shape, high=2**32 - 1):
    return jnp.asarray(_rng.integers(0, high, shape, dtype=np.uint64).astype(np.uint32))


def u8(*shape):
    return jnp.asarray(_rng.integers(0, 256, shape).astype(np.uint8))


def i8(*shape):
    return jnp.asarray(_rng.integers(-128, 128, shape).astype(np.int8))


def boolean(*shape):
    return jnp.asarray(_rng.integers(0, 2, shape).astype(bool))


def c64(*shape):
    z = _rng.normal(size=shape) + 1j * _rng.normal(size=shape)
    return jnp.asarray(z.astype(np.complex64))


def weak(value):
    """A weakly typed scalar array, as `jnp.asarray(<Python scalar>)` makes."""
    out = jnp.asarray(value)
    assert out.weak_type
    return out


def spd(n):
    """A symmetric positive definite float32 matrix."""
    a = _rng.normal(size=(n, n)).astype(np.float32)
    return jnp.asarray(a @ a.T + n * np.eye(n, dtype=np.float32))


def sym(n):
    a = _rng.normal(size=(n, n)).astype(np.float32)
    return jnp.asarray((a + a.T) / 2)


def lower(n):
    """A well-conditioned lower-triangular float32 matrix."""
    a = np.tril(_rng.normal(size=(n, n)).astype(np.float32)) + 3 * np.eye(n, dtype=np.float32)
    return jnp.asarray(a)


def key(seed=0):
    """A new-style typed PRNG key (dtype `key<fry>`)."""
    return jax.random.key(seed)


def raw_key(seed=0):
    """An old-style raw `uint32[2]` PRNG key."""
    return jax.random.PRNGKey(seed)


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the conformance table.

    - `name`: unique id.
    - `fn`: a small function of `args`.
    - `args`: example arguments. `jax.Array`s are the positions a Value may take;
        anything else (Python numbers, shapes) is passed as it is.
    - `prims`: names of the primitives this row is meant to reach. The coverage
        test checks each one appears in `jax.make_jaxpr(fn)` and, unless it is in
        `valueless`, that it was dispatched with a Value among its operands.
    - `valueless`: primitives of `prims` that take no array operand (`iota`), so
        never see a Value.
    - `grad`, `jit`, `vmap`: whether the row takes part in the transform tests.
        `grad` also needs a real floating argument and output, which is checked.
    - `tol`: `rtol`/`atol` for comparisons, for results that may differ in the last
        bits when the same primitives run through another path.
    - `axis_name`: run every call (plain and with Values) under
        `jax.vmap(..., axis_name=axis_name)`, for collectives over a named axis.
    - `compare`: "values" (default), or "aval" for results that are not
        reproducible (non-deterministic RNG), which compares shape/dtype only.
    - `all_values`: whether, with a Value in every position, every output must be
        a Value (False where the core legitimately materialises, e.g. a scan carry
        that starts as a plain array).
    - `loose_promotion`: the row mixes dtypes or ranks on purpose, so it runs
        with JAX's default promotion rather than the suite's strict one.
    - `xfail`: mode -> reason, marking known bugs; modes are "values" (every run
        with a Value), "position", "dense", "jit", "grad", "vmap", "jit_inside",
        "vmap_inside" and "leak".
    """

    name: str
    fn: Callable
    args: tuple
    prims: tuple[str, ...]
    valueless: tuple[str, ...] = ()
    grad: bool = True
    jit: bool = True
    vmap: bool = True
    tol: dict[str, float] | None = None
    axis_name: str | None = None
    compare: str = "values"
    all_values: bool = True
    loose_promotion: bool = False
    xfail: dict[str, str] = dataclasses.field(default_factory=dict)

    def array_positions(self) -> list[int]:
        return [i for i, a in enumerate(self.args) if isinstance(a, jax.Array)]

    def call(self, fn: Callable, args: tuple) -> Any:
        """Call `fn(*args)`, under a named `vmap` when the row asks for one."""
        if self.axis_name is None:
            return fn(*args)
        axes = tuple(0 if isinstance(a, (jax.Array, quaxlike.Value)) else None for a in args)
        return jax.vmap(fn, in_axes=axes, axis_name=self.axis_name)(*args)


def case(name: str, fn: Callable, *args, prims, **options) -> Case:
    if isinstance(prims, str):
        prims = (prims,)
    valueless = options.pop("valueless", ())
    if isinstance(valueless, str):
        valueless = (valueless,)
    return Case(name, fn, tuple(args), tuple(prims), tuple(valueless), **options)
