"""`DoraArray`: weight-decomposed low-rank adaptation (DoRA, Liu et al. 2024), over
any base, without ever forming `W + A @ B`.

A DoRA weight is `D = (m / n) ⊙ (W + A B)`, scaled row by row: `m` is a trainable
magnitude per output row and `n = ‖W + A B‖` is the norm of each row of the
adapted weight, over the input axis, *detached* (treated as a constant by
derivatives, as the DoRA paper's §4.3 and PEFT do). The norm is never computed
from the dense `W + A B`:

    n² = ‖W‖² + 2 rowsum(A ⊙ (W Bᵀ)) + rowsum((A G) ⊙ A),    G = B Bᵀ

- `‖W‖²` per row is a property of the frozen base: computed once, when the
  `DoraArray` is made, block of rows by block of rows (`row_norms_squared`), so a
  quantised base is never dequantised whole;
- the cross term multiplies the base by the dense `(in, r)` matrix `Bᵀ` through
  the base's own product rule (a quantised base's blockwise product);
- the update's own part comes from the `r × r` Gram matrix `G`.
"""

import math
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, PRNGKeyArray

import quaxlike
from quaxlike.internal import follow_axes, logical_entries, ShapedArray, with_leaf_specs

from ._base import check_rank, check_weight, LowRankValue, shape_of
from ._value import _initial_factors, LoraArray


_REFUSE_MSG = (
    "Refusing to materialise a DoraArray of shape {shape}: a primitive with no "
    "DoraArray rule needed the dense `(m / ‖W + A B‖) ⊙ (W + A B)`. Ways out: (1) use "
    "the operations DoraArray supports (matrix products in either orientation, "
    "transposes, scaling by a scalar, dtype conversion, and indexing, slicing and "
    "reshaping of the batch axes; see quaxlike/lora/README.md, 'DoRA'); (2) register a "
    "rule for that primitive; (3) bake the update in with `quaxlike.lora.merge(model)`; "
    "or (4) make the DoraArray with `allow_materialise=True` if a dense copy is "
    "acceptable."
)
_BAD_WEIGHT_MSG = (
    "DoraArray needs a floating-point weight with at least two dimensions "
    "`(*batch, out, in)`; got {what}. Leave vectors (biases) out of "
    "`loraify(..., dora=True, where=...)`."
)
_BAD_MAGNITUDE_MSG = (
    "DoraArray: the magnitude `m` must have shape {want} (one entry per output row of "
    "each matrix); got {got}."
)
# Elements of one block of dense rows when `‖W‖²` is computed from a Value base.
DEFAULT_BLOCK_ELEMENTS = 1 << 20


def with_magnitude(value: Any, m: Any, want: tuple[int, ...], message: str) -> Any:
    """`value`, made with no magnitude, given the magnitude `m`: where `m` is
    `None`, the value's own norm (PEFT's initial magnitude, at which the weight
    equals `W + A B`). Shared by `DoraArray` and `DoraConvKernel`.

    **Arguments:**

    - `value`: a DoRA value whose field `m` is still `None`.
    - `m`: the magnitude, or `None`.
    - `want`: the shape `m` must have.
    - `message`: the error raised otherwise, with `{want}` and `{got}`.

    **Returns:**

    `value` itself, holding the magnitude.
    """
    if m is None:
        m = value.norm().astype(value.w.dtype)
    m = jnp.asarray(m)
    if shape_of(m) != want:
        raise ValueError(message.format(want=want, got=shape_of(m)))
    object.__setattr__(value, "m", m)
    return value


class DoraArray(LowRankValue):
    """A DoRA weight: `(m / ‖W + A @ B‖) ⊙ (W + A @ B)`, row by row, as one array value.

    `W` has shape `(*batch, out, in)` (an array or any Value whose rows can be
    sliced and which can be multiplied by a dense matrix: a quantised weight, say),
    `A` `(*batch, out, rank)`, `B` `(*batch, rank, in)`, and the magnitude `m`
    `(*batch, out)`. The norm is taken per output row over the input axis and is
    detached: derivatives treat it as a constant (the DoRA paper's §4.3, as PEFT
    does), so gradients reach `m`, `A` and `B` as PEFT's do. `A @ B` plays PEFT's
    `s · lora_B @ lora_A` (the scale `s` folded into `B`, as for `LoraArray`).

    Inside `quaxlike.quaxify`, a product `D x` is `(m / n) ⊙ (W x + A (B x))`, the
    base's own product plus the low-rank one, and the norm `n` costs one product of
    the base with the `(in, rank)` matrix `Bᵀ` plus `O(out · rank²)`, with `‖W‖²`
    per row computed once, when the value is made (block of rows by block of rows,
    so a quantised `W` is never dequantised whole). `W + A @ B` is never formed.
    `transposed=True` stands for the transpose `Dᵀ` (the norm still over `W`'s
    input axis); `.T` gives one.

    **Arguments:**

    - `weight`: the frozen weight `W`, `(*batch, out, in)`.
    - `rank`: the rank of the update.
    - `scale`: standard deviation of the initial `A` (`B` starts at zero).
    - `magnitude`: the initial `m`, `(*batch, out)`. By default PEFT's: the row
        norms of `W` (so that at first the array equals `W`). Give the row norms of
        the weight before quantisation for Answer.AI's QDoRA
        (`loraify(..., dora=True, magnitude_from=...)` does).
    - `allow_materialise`, `stop_gradient`: as for `LoraArray`.
    - `block_elements`: how many elements of `W` at most are dense at once while
        `‖W‖²` is computed from a Value base.
    - `key`: a JAX PRNG key for the initial `A`.

    !!! example

        ```python
        w = jr.normal(jr.key(0), (64, 32))
        dora = DoraArray(w, rank=4, key=jr.key(1))
        y = quaxlike.quaxify(lambda d, x: d @ x)(dora, jnp.ones(32))
        assert jnp.allclose(y, w @ jnp.ones(32), atol=1e-4)  # B = 0: D = W at first
        ```
    """

    refuse_message: ClassVar[str] = _REFUSE_MSG

    m: Array
    w_norm_sq: Array
    transposed: bool = eqx.field(static=True)

    def __init__(
        self,
        weight: ArrayLike | quaxlike.ArrayValue,
        *,
        rank: int,
        scale: float = 0.01,
        magnitude: ArrayLike | None = None,
        allow_materialise: bool = False,
        stop_gradient: bool = True,
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
        key: PRNGKeyArray,
    ):
        rank = check_rank(DoraArray, rank)
        weight = check_weight(weight, 2, _BAD_WEIGHT_MSG)
        *batch, out, n = shape_of(weight)
        dtype = np.dtype(weight.dtype)
        self.w = weight
        self.a, self.b = _initial_factors(key, scale, tuple(batch), out, n, rank, dtype)
        self.w_norm_sq = row_norms_squared(weight, block_elements=block_elements)
        self.m = _magnitude(magnitude, self.w_norm_sq, (*batch, out), dtype)
        self.allow_materialise = allow_materialise
        self.stop_gradient = stop_gradient
        self.transposed = False

    @classmethod
    def from_factors(
        cls,
        w: Any,
        a: Any,
        b: Any,
        m: Any = None,
        *,
        w_norm_sq: Any = None,
        allow_materialise: bool = False,
        stop_gradient: bool = True,
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    ) -> "DoraArray":
        """A `DoraArray` with the given arrays, drawing nothing.

        **Arguments:**

        - `w`: the base weight, `(*batch, out, in)`.
        - `a`: `(*batch, out, rank)`; `b`: `(*batch, rank, in)`.
        - `m`: the magnitude, `(*batch, out)`; by default the row norms of `W + A B`
            (so that the array equals `W + A B`), computed without forming it.
        - `w_norm_sq`: `‖W‖²` per row, if known (else computed from `w`).
        - `allow_materialise`, `stop_gradient`, `block_elements`: as for the
            constructor.

        **Returns:**

        A new `DoraArray`.

        !!! example

            ```python
            w, a, b = jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.zeros((2, 3))
            dora = DoraArray.from_factors(w, a, b)
            assert dora.rank == 2 and dora.m.shape == (4,)
            ```
        """
        *batch, out, n = shape_of(w)
        rank = shape_of(a)[-1] if shape_of(a) else 0
        if shape_of(a) != (*batch, out, rank) or shape_of(b) != (*batch, rank, n) or rank < 1:
            raise ValueError(
                f"DoraArray.from_factors: for a weight of shape {shape_of(w)}, `a` must "
                f"have shape {(*batch, out)} + (rank,) and `b` {tuple(batch)} + (rank, {n}); "
                f"got `a` {shape_of(a)} and `b` {shape_of(b)}."
            )
        if w_norm_sq is None:
            w_norm_sq = row_norms_squared(w, block_elements=block_elements)
        self = cls._from_fields(
            w=w,
            a=a,
            b=b,
            m=None,
            w_norm_sq=jnp.asarray(w_norm_sq),
            allow_materialise=allow_materialise,
            stop_gradient=stop_gradient,
            transposed=False,
        )
        return with_magnitude(self, m, (*batch, out), _BAD_MAGNITUDE_MSG)

    # --- what the value stands for -------------------------------------------

    def aval(self) -> ShapedArray:
        aval = super().aval()
        if not self.transposed:
            return aval
        *batch, out, n = aval.shape
        return ShapedArray((*batch, n, out), aval.dtype)

    def logical_ndim(self) -> int:
        if jax.tree_util.tree_leaves(self.w):
            return len(shape_of(self.w))
        return self._ndim_from_factors()

    def as_lora(self) -> LoraArray:
        """`W + A @ B` (in `W`'s orientation, whatever `transposed` says) as a
        `LoraArray` with this value's flags.

        **Returns:**

        A `LoraArray` sharing `w`, `a` and `b`.
        """
        return LoraArray._from_fields(
            w=self.w,
            a=self.a,
            b=self.b,
            allow_materialise=self.allow_materialise,
            stop_gradient=self.stop_gradient,
        )

    def norm(self) -> Array:
        """`‖W + A @ B‖` per row of `W`, over its input axis, behind
        `lax.stop_gradient` (DoRA's detached norm), never forming `W + A @ B`.

        `n² = ‖W‖² + 2 rowsum(A ⊙ (W Bᵀ)) + rowsum((A G) ⊙ A)` with `G = B Bᵀ`; the
        sum can come out a little below zero by round-off where the row is (nearly)
        zero, so it is clipped at zero before the square root.

        **Returns:**

        An array of shape `(*batch, out)`, in float32 or wider.
        """
        return dora_norm(self.w, self.a, self.b, self.weight_norm_squared())

    def weight_norm_squared(self) -> Array:
        """`‖W‖²` per row of `W`, over its input axis: the one computed when the
        array was made while `W` is frozen (`stop_gradient=True`), else computed
        again from the current `W`, which training moves (a cached one would be
        stale after the first step, and the norm wrong).

        **Returns:**

        An array of shape `(*batch, out)`, in float32 or wider.
        """
        if self.stop_gradient:
            return self.w_norm_sq
        return row_norms_squared(self.w)

    def row_scale(self) -> Array:
        """`m / n`, the factor of each row of `W + A @ B` (`n` detached).

        **Returns:**

        An array of shape `(*batch, out)`, of the value's dtype.
        """
        norm = self.norm()
        return (self.m.astype(norm.dtype) / norm).astype(self.dtype)

    def dense_from(self, w: Any, a: Any, b: Any) -> Any:
        """`(m / n) ⊙ (w + a @ b)`, transposed if the value is, `n` detached."""
        scale = self.row_scale()

        def build(w, a, b):
            dense = (w + jnp.matmul(a, b)) * scale[..., None]
            return jnp.swapaxes(dense, -1, -2) if self.transposed else dense

        return quaxlike.quaxify(build)(w, a, b)

    def dense_for_derivatives(self) -> Any:
        w = quaxlike.internal.array_for_derivatives(self.frozen_weight())
        return self.dense_from(w, self.a, self.b)

    def merged(self) -> Any:
        """The dense weight `W'` PEFT's `merge_and_unload` bakes in: `(m / n) ⊙
        (W + A @ B)`, an ordinary array (a Value base dequantised).

        **Returns:**

        An array of this value's shape and dtype.
        """
        w = self.w
        if isinstance(w, quaxlike.Value):
            # Asked for on purpose: a quantised base's own dequantisation.
            dequantize = getattr(w, "dequantize", None)
            w = dequantize() if dequantize is not None else quaxlike.internal.materialise_value(w)
        return self.dense_from(w, self.a, self.b)

    def with_factors(self, w: Any, a: Any, b: Any) -> "DoraArray":
        """A copy with `w`, `a` and `b` replaced (the magnitude and `‖W‖²` kept).

        **Arguments:**

        - `w`, `a`, `b`: the new weight and factors.

        **Returns:**

        A new `DoraArray`.
        """
        return self._replaced(w=w, a=a, b=b)

    def holding_plain(self, array: Any) -> Any:
        return None  # no magnitude and norm to put an arbitrary array in

    def logical_leaf_specs(self, spec: Any) -> "DoraArray":
        """How the leaves follow a sharding `spec` of the array (see
        `quaxlike.leaf_specs`): `W` like the array, `A`, `m` and `‖W‖²` along the
        rows, `B` along the columns, the rank axis never split.

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array this value stands for.

        **Returns:**

        This value with a `PartitionSpec` in place of each leaf.
        """
        ndim = self.logical_ndim()
        entries = list(logical_entries(spec, ndim))
        if self.transposed:
            entries[-2], entries[-1] = entries[-1], entries[-2]
        w_spec = jax.sharding.PartitionSpec(*entries)
        lead = list(range(ndim - 2))
        rows = follow_axes(entries, [*lead, ndim - 2])
        return with_leaf_specs(
            self,
            w=quaxlike.leaf_specs(self.w, w_spec),
            a=follow_axes(entries, [*lead, ndim - 2, None]),
            b=follow_axes(entries, [*lead, None, ndim - 1]),
            m=rows,
            w_norm_sq=rows,
        )


# --- the norm, without the dense weight --------------------------------------


def _accumulation_dtype(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def row_norms_squared(
    w: ArrayLike | quaxlike.Value, *, block_elements: int = DEFAULT_BLOCK_ELEMENTS
) -> Array:
    """`‖W‖²` of every row of `w` (over its last axis), in float32 or wider.

    For a Value `w` (a quantised weight) the rows are taken a block at a time
    under `quaxlike.quaxify`, with `lax.dynamic_slice` over the row axis, so only
    one block of rows is ever dense (at most `block_elements` elements, and never
    the whole weight when it has more than one row).

    **Arguments:**

    - `w`: an array or a Value of shape `(*batch, out, in)`.
    - `block_elements`: the most elements of `w` dense at once.

    **Returns:**

    An array of shape `(*batch, out)`.

    !!! example

        ```python
        w = jnp.arange(6.0).reshape(2, 3)
        assert jnp.allclose(row_norms_squared(w), jnp.array([5.0, 50.0]))
        ```
    """
    if not isinstance(w, quaxlike.Value):
        w = jnp.asarray(w)
        w = w.astype(_accumulation_dtype(w.dtype))
        return jnp.sum(w * w, axis=-1)
    acc = _accumulation_dtype(w.dtype)
    *batch, out, n = shape_of(w)
    per_row = max(1, math.prod(batch) * n)
    rows = max(1, min(block_elements // per_row, out // 2 if out > 1 else 1))
    full = out // rows

    def block(w, start, size):
        part = lax.dynamic_slice_in_dim(w, start, size, axis=len(batch)).astype(acc)
        return jnp.sum(part * part, axis=-1)

    def blocks(w):
        starts = jnp.arange(full, dtype=jnp.int32) * rows
        sums = lax.map(lambda start: block(w, start, rows), starts)  # (full, *batch, rows)
        sums = jnp.moveaxis(sums, 0, len(batch))
        parts = [sums.reshape(*batch, full * rows)]
        if full * rows < out:
            parts.append(block(w, jnp.int32(full * rows), out - full * rows))
        return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

    stop = lambda x: lax.stop_gradient(x) if eqx.is_array(x) else x  # noqa: E731
    return quaxlike.quaxify(blocks)(jax.tree_util.tree_map(stop, w))


def dora_norm(w: Any, a: Any, b: Any, w_norm_sq: Any) -> Array:
    """`‖W + A B‖` per row, detached, from `‖W‖²` per row, one product of `W` with
    `Bᵀ` (the base's own rule) and the Gram matrix `B Bᵀ`.

    **Arguments:**

    - `w`: the base, `(*batch, out, in)` (an array or a Value).
    - `a`: `(*batch, out, r)`; `b`: `(*batch, r, in)`.
    - `w_norm_sq`: `‖W‖²` per row, `(*batch, out)`.

    **Returns:**

    An array of shape `(*batch, out)` behind `lax.stop_gradient`, in float32 or
    wider.
    """

    def norm(w, a, b, w_norm_sq):
        bt = jnp.swapaxes(b, -1, -2).astype(w.dtype)
        return norm_from_cross(jnp.matmul(w, bt), a, b, w_norm_sq)  # W Bᵀ: the base's rule

    stop = lambda x: lax.stop_gradient(x) if eqx.is_array(x) else x  # noqa: E731
    w, a, b, w_norm_sq = jax.tree_util.tree_map(stop, (w, a, b, w_norm_sq))
    return lax.stop_gradient(quaxlike.quaxify(norm)(w, a, b, w_norm_sq))


def norm_from_cross(cross: Any, a: Any, b: Any, w_norm_sq: Any) -> Array:
    """`‖W + A B‖` per row from `‖W‖²`, the cross product `W Bᵀ` `(*batch, out, r)`,
    and the factors (`A B`'s part from the Gram matrix `B Bᵀ`), detached.

    Round-off can leave a (nearly) zero row's `n²` a little below zero: it is
    clipped at zero before the square root.
    """
    acc = _accumulation_dtype(w_norm_sq.dtype)
    cross, a, b = (lax.stop_gradient(v).astype(acc) for v in (cross, a, b))
    gram = jnp.matmul(b, jnp.swapaxes(b, -1, -2))  # (*batch, r, r)
    squared = (
        lax.stop_gradient(w_norm_sq).astype(acc)
        + 2 * jnp.sum(a * cross, axis=-1)
        + jnp.sum(jnp.matmul(a, gram) * a, axis=-1)
    )
    return lax.stop_gradient(jnp.sqrt(jnp.maximum(squared, 0)))


def _magnitude(magnitude: Any, w_norm_sq: Array, shape: tuple, dtype: Any) -> Array:
    if magnitude is None:
        return jnp.sqrt(w_norm_sq).astype(dtype)
    magnitude = jnp.asarray(magnitude)
    if shape_of(magnitude) != shape:
        raise ValueError(_BAD_MAGNITUDE_MSG.format(want=shape, got=shape_of(magnitude)))
    return magnitude.astype(dtype)


def row_norms(w: ArrayLike | quaxlike.Value) -> Array:
    """`‖W‖` of every row of `w` (over its last axis): PEFT's initial DoRA
    magnitude, and Answer.AI's from the weight before quantisation.

    **Arguments:**

    - `w`: an array or a Value of shape `(*batch, out, in)`.

    **Returns:**

    An array of shape `(*batch, out)` of `w`'s dtype.

    !!! example

        ```python
        w = jnp.array([[3.0, 4.0], [0.0, 1.0]])
        assert jnp.allclose(row_norms(w), jnp.array([5.0, 1.0]))
        ```
    """
    dtype = w.dtype if isinstance(w, quaxlike.Value) else jnp.result_type(w)
    return jnp.sqrt(row_norms_squared(w)).astype(dtype)
