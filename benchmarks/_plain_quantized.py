"""Quantised matrix products written by hand in plain JAX, for the benchmarks to
compare quaxlike's `Int8Array`/`Int4Array` rules against.

They read the same stored leaves (`values` and `scale` of an `Int8Array`; `packed`
and `scale` of an `Int4Array`) and compute `x @ W.T` for activations `x` of shape
`(batch, in)`, two ways:

- `naive`: dequantise the whole weight, then one matrix product: what one writes
  first. XLA's CPU scheduler starts every such dequantisation early, so a model's
  dense weights are all alive at once.
- `blocked`: what quaxlike's rule does, by hand: a `lax.scan` over blocks of
  `rows` stored rows, each step (under `jax.checkpoint`) dequantising its block
  and multiplying it; for 4-bit codes, the even and odd columns (low and high
  nibbles) as two products, against the even and odd columns of `x`.
"""

import jax
import jax.numpy as jnp
from jax import lax


def int8_rows(values, scale):
    return values.astype(scale.dtype) * scale[..., None]


def _groups(codes, scale):
    *lead, size = codes.shape
    w = codes.astype(scale.dtype).reshape(*lead, scale.shape[-1], -1)
    return (w * scale[..., None]).reshape(codes.shape)


def nibbles(packed):
    """The codes of the low and high nibbles (columns `2j` and `2j + 1`)."""
    return (packed & 0xF).astype(jnp.int8) - 8, (packed >> 4).astype(jnp.int8) - 8


def int4_rows(packed, scale):
    low, high = nibbles(packed)
    codes = jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)
    return _groups(codes, scale)


def naive(kind, leaves, x):
    """`x @ W.T`, with `W` dequantised whole."""
    w = int8_rows(*leaves) if kind == "int8" else int4_rows(*leaves)
    return x @ w.T


def blocked(kind, leaves, x, rows, *, checkpoint=True, phases=True):
    """`x @ W.T`, a block of `rows` rows of `W` at a time (`rows` divides `out`).
    `checkpoint=False` or `phases=False` leave out one of the two refinements,
    to measure what each buys."""
    data, scale = leaves
    n = data.shape[0] // rows
    split = kind == "int4" and phases
    xs = [x[:, 0::2], x[:, 1::2]] if split else [x]

    def block(i, data, scale, xs):
        d = lax.dynamic_slice_in_dim(data, i * rows, rows)
        s = lax.dynamic_slice_in_dim(scale, i * rows, rows)
        if kind == "int8":
            return xs[0] @ int8_rows(d, s).T
        if not split:
            return xs[0] @ int4_rows(d, s).T
        low, high = nibbles(d)
        return xs[0] @ _groups(low, s).T + xs[1] @ _groups(high, s).T

    if checkpoint:
        block = jax.checkpoint(block, prevent_cse=False)

    def step(out, i):
        return lax.dynamic_update_slice_in_dim(out, block(i, data, scale, xs), i * rows, 1), None

    out = jnp.zeros((x.shape[0], data.shape[0]), x.dtype)
    return lax.scan(step, out, jnp.arange(n))[0]


def leaves_of(q):
    """The stored leaves of an `Int8Array` or `Int4Array`."""
    return (q.values, q.scale) if hasattr(q, "values") else (q.packed, q.scale)
