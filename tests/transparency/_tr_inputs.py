"""Arguments for the transparency cases: dtypes, shapes and deterministic arrays.

The dtypes are those JAX's own tests sweep (bool, signed and unsigned integers,
bfloat16, float16, float32, complex; 64-bit ones where x64 is on), reduced to the
ones the running configuration can hold, so that no case asks for a dtype JAX
would silently narrow.
"""

import jax
import jax.numpy as jnp
import numpy as np


def _available(dtypes) -> tuple:
    seen = []
    for d in dtypes:
        canonical = jax.dtypes.canonicalize_dtype(d)
        if canonical not in seen:
            seen.append(canonical)
    return tuple(seen)


BOOL = _available([np.bool_])
SIGNED = _available([np.int8, np.int16, np.int32, np.int64])
UNSIGNED = _available([np.uint8, np.uint32])
INTS = SIGNED + UNSIGNED
FLOATS = _available([jnp.bfloat16, np.float16, np.float32, np.float64])
COMPLEX = _available([np.complex64, np.complex128])
INEXACT = FLOATS + COMPLEX
NUMBERS = INTS + INEXACT
ALL = BOOL + NUMBERS

# Float values chosen to reach the edges of elementwise functions.
_SPECIALS = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, 1e-3, 40.0, -40.0, np.inf, -np.inf, np.nan]


def name_of(dtype) -> str:
    """A short dtype name for test ids (`f32`, `bf16`, `c64`, `bool`)."""
    name = np.dtype(dtype).name
    return {
        "bool": "bool",
        "bfloat16": "bf16",
        "float16": "f16",
        "float32": "f32",
        "float64": "f64",
        "complex64": "c64",
        "complex128": "c128",
    }.get(name, name.replace("uint", "u").replace("int", "i"))


def array(seed: int, shape: tuple, dtype, *, kind: str = "normal") -> np.ndarray:
    """A deterministic array.

    **Arguments:**

    - `seed`: NumPy seed.
    - `shape`, `dtype`: of the result (the dtype is one of the available ones).
    - `kind`: `"normal"` (small integers, standard normal floats, random booleans),
        `"positive"` (values in (0.1, 3)), `"unit"` (values in (-0.9, 0.9)),
        `"special"` (zeros of both signs, infinities, NaN and ordinary values, cycled).

    **Returns:**

    A NumPy array of that shape and dtype (the tests make JAX arrays of it when
    they run, so that collecting the cases costs no JAX work).
    """
    rng = np.random.RandomState(seed)
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=int))
    if dtype == np.bool_:
        x = rng.rand(size) < 0.5
    elif np.issubdtype(dtype, np.unsignedinteger):
        x = rng.randint(1 if kind == "positive" else 0, 8, size)
    elif np.issubdtype(dtype, np.integer):
        x = rng.randint(1 if kind == "positive" else -6, 7, size)
    elif kind == "special":
        x = np.resize(np.array(_SPECIALS), size)
        if np.issubdtype(dtype, np.complexfloating):
            x = x + 1j * np.roll(x, 3)
    else:
        if kind == "positive":
            x = rng.uniform(0.1, 3.0, size)
        elif kind == "unit":
            x = rng.uniform(-0.9, 0.9, size)
        else:
            x = rng.randn(size) * 2
        if np.issubdtype(dtype, np.complexfloating):
            x = x + 1j * rng.uniform(0.1, 2.0, size)
    return np.asarray(x).astype(dtype).reshape(shape)
