from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, PRNGKeyArray, PyTree

import quaxlike
from quaxlike.internal import ShapedArray


_REFUSE_MSG = (
    "Refusing to materialise a LoraArray of shape {shape}: building `W + A @ B` "
    "densely defeats the point of LoRA. Construct it with `allow_materialise=True` "
    "if a dense copy is acceptable."
)


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else jnp.shape(x)


class LoraArray(quaxlike.ArrayValue):
    """A weight `W` plus a trainable low-rank update `A @ B`, as one array value.

    `W` has shape `(*batch, m, n)`, `A` has shape `(*batch, m, rank)` and `B` has
    shape `(*batch, rank, n)`. `A` starts random (scaled by `scale`) and `B` starts
    at zero, so at first the array equals `W`. Matrix products with it cost
    `O((m + n) * rank)` extra and never form `W + A @ B`.

    **Arguments:**

    - `weight`: the frozen weight `W`, with at least two dimensions.
    - `rank`: the rank of the update.
    - `scale`: standard deviation of the initial `A`.
    - `allow_materialise`: whether a primitive with no LoraArray rule may build
        the dense `W + A @ B` (by default that raises an error instead).
    - `stop_gradient`: whether gradients stop at `W` (it is frozen).
    - `key`: a JAX PRNG key for the initial `A`.
    """

    # W + A @ B is bilinear in (A, B): a tangent of the leaves is not a LoraArray.
    structured_tangents: ClassVar[bool] = False

    w: Array
    a: Array
    b: Array
    allow_materialise: bool = eqx.field(static=True)
    stop_gradient: bool = eqx.field(static=True)

    def __init__(
        self,
        weight: Array,
        *,
        rank: int,
        scale: float = 0.01,
        allow_materialise: bool = False,
        stop_gradient: bool = True,
        key: PRNGKeyArray,
    ):
        *batch, m, n = _shape(weight)
        dtype = weight.dtype
        self.w = weight
        self.a = jr.normal(key, (*batch, m, rank), dtype=dtype) * scale
        self.b = jnp.zeros((*batch, rank, n), dtype=dtype)
        self.allow_materialise = allow_materialise
        self.stop_gradient = stop_gradient

    def aval(self) -> ShapedArray:
        return ShapedArray(_shape(self.w), self.w.dtype)

    def frozen_weight(self):
        return lax.stop_gradient(self.w) if self.stop_gradient else self.w

    def materialise(self):
        if not self.allow_materialise:
            raise RuntimeError(_REFUSE_MSG.format(shape=_shape(self.w)))
        return self.dense()

    def dense(self):
        """`W + A @ B` as a dense array (what `materialise()` builds when allowed)."""
        return quaxlike.quaxify(lambda w, a, b: w + a @ b)(self.frozen_weight(), self.a, self.b)

    def with_factors(self, w, a, b) -> "LoraArray":
        """A copy with the three arrays replaced (shapes may change)."""
        return eqx.tree_at(lambda x: (x.w, x.a, x.b), self, (w, a, b))


def loraify(
    model: PyTree,
    *,
    rank: int,
    key: PRNGKeyArray,
    scale: float = 0.01,
    allow_materialise: bool = False,
    stop_gradient: bool = True,
    where: Callable[[PyTree], Any] | None = None,
) -> PyTree:
    """Replace the weight of every `eqx.nn.Linear` in `model` by a `LoraArray`.

    **Arguments:**

    - `model`: any PyTree holding Equinox layers.
    - `rank`, `scale`, `allow_materialise`, `stop_gradient`: as for `LoraArray`.
    - `key`: a PRNG key, split across the replaced weights.
    - `where`: instead of every `Linear` weight, the leaves this function selects
        (as for `eqx.tree_at`).

    **Returns:**

    The model with LoRA weights. Use `quaxlike.quaxify(model)(x)` to call it.
    """
    if where is None:
        is_linear = lambda x: isinstance(x, eqx.nn.Linear)  # noqa: E731
        linears = [x for x in jtu.tree_leaves(model, is_leaf=is_linear) if is_linear(x)]
        where = lambda m: [x.weight for x in jtu.tree_leaves(m, is_leaf=is_linear) if is_linear(x)]  # noqa: E731
        count = len(linears)
    else:
        selected = where(model)
        count = len(selected) if isinstance(selected, (list, tuple)) else 1
    keys = iter(jr.split(key, max(count, 1)))

    def make(weight):
        return LoraArray(
            weight,
            rank=rank,
            scale=scale,
            allow_materialise=allow_materialise,
            stop_gradient=stop_gradient,
            key=next(keys),
        )

    selected = where(model)
    if isinstance(selected, (list, tuple)):
        replacement = type(selected)(make(w) for w in selected)
    else:
        replacement = make(selected)
    return eqx.tree_at(where, model, replacement)


def trainable_filter(model: PyTree) -> PyTree[bool]:
    """A filter spec selecting only the LoRA factors `a` and `b` of `model`, for
    `eqx.partition(model, trainable_filter(model))`."""
    is_lora = lambda x: isinstance(x, LoraArray)  # noqa: E731

    def mark(x):
        if is_lora(x):
            return LoraArray.with_factors(x, False, True, True)
        return False

    return jtu.tree_map(mark, model, is_leaf=is_lora)


def merge(model: PyTree) -> PyTree:
    """Bake every `LoraArray` in `model` into a dense weight `W + A @ B`."""
    is_lora = lambda x: isinstance(x, LoraArray)  # noqa: E731
    return jtu.tree_map(lambda x: x.dense() if is_lora(x) else x, model, is_leaf=is_lora)
