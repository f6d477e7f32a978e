"""The `LoraArray` type: a frozen weight plus a trainable low-rank update."""

import functools as ft
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, PRNGKeyArray

import quaxlike
from quaxlike.internal import ShapedArray


_REFUSE_MSG = (
    "Refusing to materialise a LoraArray of shape {shape}: a primitive with no "
    "LoraArray rule needed the dense `W + A @ B`, and building it defeats the point of "
    "LoRA. Ways out: (1) express the computation with the operations LoraArray "
    "supports (matrix products, transposes, slicing and reshaping of batch dimensions, "
    "scaling; see quaxlike/examples/lora/README.md); "
    "(2) register a rule for that primitive; (3) bake the update in with "
    "`quaxlike.examples.lora.merge(model)`; or (4) construct the LoraArray with "
    "`allow_materialise=True` if a dense copy is acceptable."
)
_BAD_WEIGHT_MSG = (
    "LoraArray needs a floating-point weight with at least two dimensions "
    "`(*batch, m, n)`; got {what}. For a vector (a bias, say) a low-rank update makes "
    "no sense: leave it out of `loraify(..., where=...)`."
)
_BAD_RANK_MSG = "LoraArray needs a positive integer `rank`; got {rank!r}."
_NO_WEIGHT_MSG = (
    "This LoraArray's weight `w` is missing (None where its arrays should be): it is "
    "the trainable half of `partition(model)` (or of `eqx.partition`). Put the model "
    "back together with `eqx.combine(trainable, frozen)` before calling it through "
    "`quaxlike.quaxify`."
)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


class LoraArray(quaxlike.ArrayValue):
    """A weight `W` plus a trainable low-rank update `A @ B`, as one array value.

    `W` has shape `(*batch, m, n)`, `A` has shape `(*batch, m, rank)` and `B` has
    shape `(*batch, rank, n)`; the array stood for is `W + A @ B` (batched over the
    leading dimensions). `A` starts random (scaled by `scale`) and `B` starts at
    zero, so at first the array equals `W`.

    Inside `quaxlike.quaxify`, matrix products with it cost `O((m + n) * rank)`
    extra and never form `W + A @ B`; transposes, scaling by a scalar, dtype
    conversion, and slicing, indexing and reshaping of the batch dimensions (what
    `lax.scan` over a stack of layers or `x[i]` does) give another `LoraArray`.
    Any other primitive raises an error rather than building the dense array,
    unless `allow_materialise=True`.

    With `stop_gradient=True`, `W` is frozen: it is wrapped in `lax.stop_gradient`
    wherever it is used, so gradients with respect to it are zero and only `A` and
    `B` train (use `quaxlike.examples.lora.partition` to split them off for optax).

    **Arguments:**

    - `weight`: the frozen weight `W`, a floating-point array (or an `ArrayValue`,
        such as a quantised weight) with at least two dimensions.
    - `rank`: the rank of the update.
    - `scale`: standard deviation of the initial `A`.
    - `allow_materialise`: whether a primitive with no LoraArray rule may build
        the dense `W + A @ B` (by default that raises an error instead).
    - `stop_gradient`: whether gradients stop at `W` (it is frozen).
    - `key`: a JAX PRNG key for the initial `A`.

    !!! example

        ```python
        w = jnp.ones((64, 32))
        lora = LoraArray(w, rank=4, key=jax.random.key(0))
        y = quaxlike.quaxify(lambda m, x: m @ x)(lora, jnp.ones(32))  # W x + A (B x)
        ```
    """

    # W + A @ B is bilinear in (A, B): a tangent of the leaves is not a LoraArray.
    structured_tangents: ClassVar[bool] = False

    w: Array | quaxlike.ArrayValue
    a: Array | quaxlike.ArrayValue
    b: Array | quaxlike.ArrayValue
    allow_materialise: bool = eqx.field(static=True)
    stop_gradient: bool = eqx.field(static=True)

    def __init__(
        self,
        weight: ArrayLike | quaxlike.ArrayValue,
        *,
        rank: int,
        scale: float = 0.01,
        allow_materialise: bool = False,
        stop_gradient: bool = True,
        key: PRNGKeyArray,
    ):
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(_BAD_RANK_MSG.format(rank=rank))
        if not isinstance(weight, (jax.Array, quaxlike.Value)):
            weight = jnp.asarray(weight)
        shape = _shape(weight)
        if len(shape) < 2 or not jnp.issubdtype(weight.dtype, jnp.inexact):
            raise ValueError(
                _BAD_WEIGHT_MSG.format(what=f"an array of dtype {weight.dtype} and shape {shape}")
            )
        *batch, m, n = shape
        self.w = weight
        self.a, self.b = _initial_factors(
            key, scale, tuple(batch), m, n, int(rank), np.dtype(weight.dtype)
        )
        self.allow_materialise = allow_materialise
        self.stop_gradient = stop_gradient

    @property
    def rank(self) -> int:
        """The rank of the update (the last dimension of `a`)."""
        return _shape(self.a)[-1]

    def aval(self) -> ShapedArray:
        # Reads shapes and dtypes only: no operation enters a traced program.
        try:
            return ShapedArray(_shape(self.w), self.w.dtype)
        except (AttributeError, TypeError) as error:
            is_none = lambda x: x is None  # noqa: E731
            if any(map(is_none, jax.tree_util.tree_leaves(self.w, is_leaf=is_none))):
                raise TypeError(_NO_WEIGHT_MSG) from error
            raise

    def frozen_weight(self) -> Any:
        """`W`, behind `lax.stop_gradient` when the weight is frozen."""
        if not self.stop_gradient:
            return self.w
        if isinstance(self.w, quaxlike.Value):
            # A Value stands for a function of its leaves, so stopping the
            # gradient at every leaf stops it at the value, whatever the type
            # (quantised, sparse, another LoRA), with no rule needed.
            stop = lambda x: lax.stop_gradient(x) if eqx.is_array(x) else x  # noqa: E731
            return jax.tree_util.tree_map(stop, self.w)
        return lax.stop_gradient(self.w)

    def materialise(self) -> Any:
        if not self.allow_materialise:
            raise RuntimeError(_REFUSE_MSG.format(shape=_shape(self.w)))
        return self.dense()

    def dense(self) -> Any:
        """`W + A @ B` as a dense array, whatever `allow_materialise` says (it is what
        `materialise()` builds when allowed). `W` is behind `lax.stop_gradient` when
        the weight is frozen.

        **Returns:**

        An array (or a Value, if `W` is one) of this LoraArray's shape and dtype.
        """
        return _dense(self.frozen_weight(), self.a, self.b)

    def with_factors(self, w: Any, a: Any, b: Any) -> "LoraArray":
        """A copy with `w`, `a` and `b` replaced (shapes may change; the flags are
        kept).

        **Arguments:**

        - `w`, `a`, `b`: the new weight and factors.

        **Returns:**

        A new `LoraArray`.
        """
        return eqx.tree_at(lambda x: (x.w, x.a, x.b), self, (w, a, b))


@ft.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _initial_factors(key, scale, batch, m, n, rank, dtype):
    # One compiled program per shape, rather than one per operation. The barrier
    # keeps XLA from folding `scale` into the constants of the normal draw (which
    # changes the last bit of most entries), so `A` is bit for bit what Quax
    # draws op by op for the same key.
    draw = lax.optimization_barrier(jr.normal(key, (*batch, m, rank), dtype=dtype))
    return draw * jnp.asarray(scale, dtype), jnp.zeros((*batch, rank, n), dtype=dtype)


def _dense(w, a, b):
    # The factors may themselves be Values (a LoRA over a quantised weight).
    return quaxlike.quaxify(lambda w, a, b: w + jnp.matmul(a, b))(w, a, b)
