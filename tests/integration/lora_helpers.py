"""Helpers shared by the Flax tests: the dense model a LoRA one stands for, and
LoRA factors that are not at their initial values."""

import jax
import numpy as np

from quaxlike.lora import LoraArray


def is_lora(x) -> bool:
    return isinstance(x, LoraArray)


def dense(tree):
    """The plain tree a LoRA one stands for, `W + A @ B` by hand (not with `merge`)."""
    return jax.tree.map(lambda x: x.w + x.a @ x.b if is_lora(x) else x, tree, is_leaf=is_lora)


def randn(seed: int, shape, scale: float = 1.0) -> jax.Array:
    # By NumPy: eager `jax.random` calls (and `jnp.asarray`) compile a program for
    # every new shape.
    rng = np.random.default_rng(seed)
    return jax.device_put((scale * rng.standard_normal(shape)).astype(np.float32))


def with_nonzero_b(tree):
    """As if trained already: a non-zero `B` in every LoraArray, so that `A @ B`
    matters."""
    seeds = iter(range(100, 200))
    return jax.tree.map(
        lambda x: x.with_factors(x.w, x.a, randn(next(seeds), x.b.shape, 0.3)) if is_lora(x) else x,
        tree,
        is_leaf=is_lora,
    )
