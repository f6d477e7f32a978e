"""Small Values of the ready types, each with the dense array it stands for."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr

from quaxlike.lora import LoraArray
from quaxlike.quantized import quantize_int8
from quaxlike.sparse import BCOO
from quaxlike.structured import Diagonal, TriDiagonal


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


# --- Equinox custom-derivative functions whose rules differ from the primal's
# derivative, so a skipped rule shows --------------------------------------------


@eqx.filter_custom_jvp
def doubled_tangent_matvec(w, x):
    """`w @ x`, whose rule gives twice the tangent with respect to `x` and none
    with respect to `w`."""
    return w @ x


@doubled_tangent_matvec.def_jvp
def _doubled_tangent_matvec_jvp(primals, tangents):
    w, x = primals
    _, tx = tangents
    return doubled_tangent_matvec(w, x), 2.0 * (w @ tx)


@eqx.filter_custom_vjp
def _clipped_matvec_of(x, w):
    # Differentiable with respect to `x` (Equinox's first argument) only.
    return w @ x


@_clipped_matvec_of.def_fwd
def _clipped_matvec_fwd(perturbed, x, w):
    return w @ x, None


@_clipped_matvec_of.def_bwd
def _clipped_matvec_bwd(residuals, g, perturbed, x, w):
    return jnp.clip(w.T @ g, -0.1, 0.1)


def clipped_matvec(w, x):
    """`w @ x`, whose backward pass clips the cotangent of `x` to [-0.1, 0.1]."""
    return _clipped_matvec_of(x, w)
