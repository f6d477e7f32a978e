"""The `LoraArray` type: a frozen weight plus a trainable low-rank update."""

import functools as ft
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax import lax
from jaxtyping import ArrayLike, PRNGKeyArray

import quaxlike
from quaxlike.internal import follow_axes, logical_entries, with_leaf_specs

from ._base import check_rank, check_weight, LowRankValue, shape_of


_REFUSE_MSG = (
    "Refusing to materialise a LoraArray of shape {shape}: a primitive with no "
    "LoraArray rule needed the dense `W + A @ B`, and building it defeats the point of "
    "LoRA. Ways out: (1) express the computation with the operations LoraArray "
    "supports (matrix products, transposes, slicing and reshaping of batch dimensions, "
    "scaling; see quaxlike/lora/README.md); "
    "(2) register a rule for that primitive; (3) bake the update in with "
    "`quaxlike.lora.merge(model)`; or (4) construct the LoraArray with "
    "`allow_materialise=True` if a dense copy is acceptable."
)
_BAD_WEIGHT_MSG = (
    "LoraArray needs a floating-point weight with at least two dimensions "
    "`(*batch, m, n)`; got {what}. For a vector (a bias, say) a low-rank update makes "
    "no sense: leave it out of `loraify(..., where=...)`."
)


class LoraArray(LowRankValue):
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
    `B` train (use `quaxlike.lora.partition` to split them off for optax).

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

    refuse_message: ClassVar[str] = _REFUSE_MSG

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
        rank = check_rank(LoraArray, rank)
        weight = check_weight(weight, 2, _BAD_WEIGHT_MSG)
        *batch, m, n = shape_of(weight)
        self.w = weight
        self.a, self.b = _initial_factors(
            key, scale, tuple(batch), m, n, rank, np.dtype(weight.dtype)
        )
        self.allow_materialise = allow_materialise
        self.stop_gradient = stop_gradient

    @classmethod
    def from_factors(
        cls,
        w: Any,
        a: Any,
        b: Any,
        *,
        allow_materialise: bool = False,
        stop_gradient: bool = True,
    ) -> "LoraArray":
        """A `LoraArray` with the given arrays, drawing nothing.

        **Arguments:**

        - `w`: the weight `W`, `(*batch, m, n)`.
        - `a`: `(*batch, m, rank)`.
        - `b`: `(*batch, rank, n)`.
        - `allow_materialise`, `stop_gradient`: as for the constructor.

        **Returns:**

        A new `LoraArray`.

        !!! example

            ```python
            w, a, b = jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.zeros((2, 3))
            lora = LoraArray.from_factors(w, a, b)
            assert lora.rank == 2 and lora.shape == (4, 3)
            ```
        """
        *batch, m, n = shape_of(w)
        rank = shape_of(a)[-1] if shape_of(a) else 0
        if shape_of(a) != (*batch, m, rank) or shape_of(b) != (*batch, rank, n) or rank < 1:
            raise ValueError(
                f"LoraArray.from_factors: for a weight of shape {shape_of(w)}, `a` must "
                f"have shape {(*batch, m)} + (rank,) and `b` {tuple(batch)} + (rank, {n}); "
                f"got `a` {shape_of(a)} and `b` {shape_of(b)}."
            )
        return cls._from_fields(
            w=w, a=a, b=b, allow_materialise=allow_materialise, stop_gradient=stop_gradient
        )

    def logical_leaf_specs(self, spec: Any) -> "LoraArray":
        """How `W`, `A` and `B` follow a sharding of `W + A @ B` (see
        `quaxlike.leaf_specs`): `W` like the array, `A` along its rows, `B` along
        its columns, the rank axis never split (so rows or columns of the array
        split alike leave the factors' product on each device exact).

        **Arguments:**

        - `spec`: a `PartitionSpec` of `(*batch, m, n)`.

        **Returns:**

        This value with a `PartitionSpec` in place of each leaf.
        """
        return matrix_factor_leaf_specs(self, spec, self.weight_leaf_specs)

    def dense_from(self, w: Any, a: Any, b: Any) -> Any:
        """`w + a @ b`."""
        return _dense(w, a, b)

    def with_factors(self, w: Any, a: Any, b: Any) -> "LoraArray":
        """A copy with `w`, `a` and `b` replaced (shapes may change; the flags are
        kept).

        **Arguments:**

        - `w`, `a`, `b`: the new weight and factors.

        **Returns:**

        A new `LoraArray`.
        """
        return eqx.tree_at(lambda x: (x.w, x.a, x.b), self, (w, a, b))


def matrix_factor_leaf_specs(value: LowRankValue, spec: Any, weight_specs) -> Any:
    """`value` (with `A` of shape `(*lead, m, rank)` and `B` `(*lead, rank, n)`)
    with a `PartitionSpec` in place of each leaf, for a sharding `spec` of the
    array it stands for: `A` along its rows, `B` along its columns, the rank axis
    never split, and `W` as `weight_specs(spec)` says (`LoraArray` and
    `MultiLoraArray` differ only there)."""
    ndim = value.logical_ndim()
    entries = logical_entries(spec, ndim)
    lead = list(range(ndim - 2))
    return with_leaf_specs(
        value,
        w=weight_specs(spec),
        a=follow_axes(entries, [*lead, ndim - 2, None]),
        b=follow_axes(entries, [*lead, None, ndim - 1]),
    )


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
