"""Shared test helpers: comparison against plain JAX, and simple Value types."""

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

import quaxlike
from quaxlike.internal import ShapedArray


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-6) -> bool:
    x_leaves, x_tree = jtu.tree_flatten(x)
    y_leaves, y_tree = jtu.tree_flatten(y)
    if x_tree != y_tree:
        return False
    for a, b in zip(x_leaves, y_leaves):
        if eqx.is_array(a) or eqx.is_array(b):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape or a.dtype != b.dtype:
                return False
            if not np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif a != b:
            return False
    return True


def materialise_tree(tree):
    """Replace every Value in `tree` by its materialised array."""
    return jtu.tree_map(
        lambda x: quaxlike.internal.materialise_value(x) if isinstance(x, quaxlike.Value) else x,
        tree,
        is_leaf=lambda x: isinstance(x, quaxlike.Value),
    )


class PassThrough(quaxlike.ArrayValue):
    """Wraps an array; every primitive runs on the wrapped arrays and re-wraps
    the results, so the Value survives any computation."""

    array: jax.Array

    def aval(self):
        a = jax.typeof(self.array)
        return ShapedArray(a.shape, a.dtype, weak_type=a.weak_type)

    def materialise(self):
        return self.array

    @staticmethod
    def default(primitive, values, params):
        arrays = [v.array if isinstance(v, PassThrough) else v for v in values]
        out = primitive.bind(*arrays, **params)
        if primitive.multiple_results:
            return [PassThrough(o) for o in out]
        return PassThrough(out)


def randn(seed, shape, scale=1.0):
    """A float32 array of standard normals from a NumPy seed."""
    rng = np.random.default_rng(seed)
    # `device_put` rather than `jnp.asarray`: with the leak checker on, JAX's
    # caches are off and `jnp.asarray` compiles a conversion on every call.
    return jax.device_put(np.asarray(scale * rng.standard_normal(shape), dtype=np.float32))
