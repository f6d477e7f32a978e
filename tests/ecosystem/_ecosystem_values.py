"""Small Values of the ready types, each with the dense array it stands for."""

import jax.numpy as jnp
import jax.random as jr

from quaxlike.examples.lora import LoraArray
from quaxlike.examples.quantized import quantize_int8
from quaxlike.examples.sparse import BCOO
from quaxlike.examples.structured import Diagonal, TriDiagonal


N = 5


def spd(key, n: int = N):
    """A well-conditioned symmetric positive definite matrix."""
    x = jr.normal(key, (n, n)) / n
    return 4.0 * jnp.eye(n) + x @ x.T


def lora_spd(key):
    """A LoRA matrix `W + A B` with `W` positive definite and `A B` symmetric and
    small (`B = c A^T`), so the sum is positive definite too."""
    w = spd(key)
    a = 0.1 * jr.normal(jr.fold_in(key, 1), (N, 2))
    return LoraArray.from_factors(w, a, 0.5 * a.T)


def lora_general(key):
    return LoraArray(spd(key), rank=2, key=jr.fold_in(key, 2))


def tridiagonal(key):
    off = 0.5 + 0.1 * jr.uniform(key, (N - 1,))
    return TriDiagonal(off, 3.0 + jr.uniform(jr.fold_in(key, 1), (N,)), off)


def diagonal(key):
    return Diagonal(1.0 + jr.uniform(key, (N,)))


def int8(key):
    return quantize_int8(spd(key))


def sparse(key):
    d = (
        jnp.diag(2.0 + jr.uniform(key, (N,)))
        + jnp.diag(jnp.full(N - 1, 0.3), 1)
        + jnp.diag(jnp.full(N - 2, -0.2), -2)
    )
    return BCOO.fromdense(d)


def dense_of(value):
    """The dense array `value` stands for."""
    for name in ("dense", "todense", "dequantize"):
        method = getattr(value, name, None)
        if callable(method):
            return method()
    return value.materialise()
