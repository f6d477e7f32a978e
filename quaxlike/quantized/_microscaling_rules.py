"""Rules of the microscaling types (`MXArray`, `NVFP4Array`) where they differ
from every quantised array's (`_rules.py`): their scales are `uint8` codes, not
floats of the array's dtype, so a dtype conversion changes only the last cast,
negation flips the codes' sign bits, and a scalar factor folds into NVFP4's
per-tensor scale but has no place in MX's power-of-two scales."""

import dataclasses

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike

from ._microscaling import MicroscaledArray, MXArray, NVFP4Array


_MX_SCALAR_MSG = (
    "MXArray: `{op}` of an {fmt} array by a scalar cannot stay in the MX format: its "
    "block scales are E8M0 powers of two and its elements {element} codes, so an "
    "arbitrary factor would need re-quantising, changing the values. Scale the "
    "product instead (`(x @ w.T) * c`), call `.dequantize()` for a dense weight, "
    "or build the array with `allow_materialise=True` to let this fall back to "
    "the dense weight."
)


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_microscaled(x: MicroscaledArray, *, new_dtype, **params):
    if params.get("weak_type") or not jnp.issubdtype(new_dtype, jnp.floating):
        return NotImplemented  # integer or weakly typed results: materialise
    return x.with_dtype(new_dtype)


@quaxlike.register(lax.neg_p)
def neg_p_microscaled(x: MicroscaledArray, **params):
    return x.negated()


@quaxlike.register("stop_gradient")
def stop_gradient_p_mx(x: MXArray, **params):
    # Codes and exponents only: nothing a derivative reaches.
    return x


@quaxlike.register("stop_gradient")
def stop_gradient_p_nvfp4(x: NVFP4Array, **params):
    return dataclasses.replace(x, per_tensor_scale=lax.stop_gradient(x.per_tensor_scale))


def _mx_scalar(x: MXArray, y: ArrayLike, op, name: str):
    if x.allow_materialise:
        return op(x.dequantize(), y)
    raise TypeError(_MX_SCALAR_MSG.format(op=name, fmt=x.format, element=x.element))


@quaxlike.register(lax.mul_p)
def mul_p_mx_any(x: MXArray, y: ArrayLike, **params):
    return _mx_scalar(x, y, lax.mul, "mul")


@quaxlike.register(lax.div_p)
def div_p_mx_any(x: MXArray, y: ArrayLike, **params):
    return _mx_scalar(x, y, lax.div, "div")


def _nvfp4_scaled(x: NVFP4Array, y: ArrayLike, multiply: bool):
    if jnp.ndim(y) != 0:
        return NotImplemented
    y = jnp.asarray(y, x.per_tensor_scale.dtype)
    # The factor folds into the per-tensor scale: multiplied for torchao's
    # convention, divided for compressed-tensors' (whose blocks are divided by it).
    scaled = lax.mul if multiply != x.divide else lax.div
    return dataclasses.replace(x, per_tensor_scale=scaled(x.per_tensor_scale, y))


@quaxlike.register(lax.mul_p)
def mul_p_nvfp4_scalar(x: NVFP4Array, y: ArrayLike, **params):
    return _nvfp4_scaled(x, y, multiply=True)


@quaxlike.register(lax.div_p)
def div_p_nvfp4_scalar(x: NVFP4Array, y: ArrayLike, **params):
    return _nvfp4_scaled(x, y, multiply=False)
