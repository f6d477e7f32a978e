"""`DoraConvKernel`: DoRA (weight-decomposed low-rank adaptation, Liu et al. 2024) for
convolution kernels, as PEFT has it for `Conv1d`, `Conv2d` and `Conv3d`.

A DoRA kernel is `D = (m / n) ⊙ (W + A · B)`, scaled per output channel: `W + A · B`
is `LoraConvKernel`'s kernel (`A` `(out, rank)`, `B` shaped like `W` with `rank`
in place of the output channels), `m` a trainable magnitude per output channel and
`n = ‖W + A · B‖` the norm of each output channel's slice of the kernel over every
other axis (input channels and the spatial axes), *detached*, as for `DoraArray`.
With `W_f` and `B_f` the kernel and `B` flattened to `(out, K)` and `(rank, K)`
(the matrices a convolution multiplies its input patches by):

    n² = ‖W_f‖² + 2 rowsum(A ⊙ (W_f B_fᵀ)) + rowsum((A G) ⊙ A),    G = B_f B_fᵀ

`‖W_f‖²` is computed once, when the kernel is made. A convolution with `D` is
`(m / n) ⊙ (conv(x, W) + conv1x1(conv(x, B), A))` along the output's feature axis:
`W + A · B` is never formed.
"""

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, PRNGKeyArray

import quaxlike
from quaxlike.internal import cached_rule

from ._base import check_rank, check_weight, LowRankValue, shape_of
from ._conv import _conv_low_rank, _initial_factors, _normalise_axis, dense_kernel
from ._dora import _accumulation_dtype, norm_from_cross, with_magnitude


_REFUSE_MSG = (
    "Refusing to materialise a DoraConvKernel of shape {shape}: a primitive with no "
    "DoraConvKernel rule needed the dense kernel `(m / ‖W + A · B‖) ⊙ (W + A · B)`. "
    "DoraConvKernel supports only `lax.conv_general_dilated` with the kernel as its "
    "right-hand side and the kernel's `out_axis` as the convolution's output-feature "
    "axis (any strides, padding, dilations and groups), as `eqx.nn.Conv` and "
    "`eqx.nn.ConvTranspose` call it. Ways out: (1) register a rule for that "
    "primitive; (2) bake the update in with `quaxlike.lora.merge(model)`; or (3) make "
    "the kernel with `allow_materialise=True` if a dense copy is acceptable."
)
_CONV_AXIS_MSG = (
    "`lax.conv_general_dilated_p` got a DoraConvKernel of shape {shape} whose "
    "`out_axis` ({axis}) is not the convolution's output-feature axis (the kernel's "
    "dimension numbers are {rhs_spec}): DoRA's magnitude scales the kernel's output "
    "channels, which here would not be the convolution's outputs (a transposed "
    "convolution, or a derivative inside `quaxify`). Ways out: differentiate and map "
    "outside `quaxify` (`jax.grad(quaxify(f))`); call the convolution with the "
    "kernel's output channels as its output features; bake the update in with "
    "`quaxlike.lora.merge`; or make the kernel with `allow_materialise=True`."
)
_BAD_WEIGHT_MSG = (
    "DoraConvKernel needs a floating-point convolution kernel with at least three "
    "dimensions (output channels, input channels, one or more spatial axes); got "
    "{what}. For a matrix, use DoraArray."
)
_VALUE_WEIGHT_MSG = (
    "DoraConvKernel needs a plain array as its kernel `W`; got a {kind}. Its per-"
    "channel `‖W‖²` and the norm's cross term are computed from the dense kernel. "
    "Dequantise the kernel first (or adapt it with plain LoRA: `LoraConvKernel` "
    "takes any Value)."
)
_BAD_MAGNITUDE_MSG = (
    "DoraConvKernel: the magnitude `m` must have shape {want} (one entry per output "
    "channel); got {got}."
)


def _flat(kernel: Any, out_axis: int) -> Any:
    """A kernel as the `(out, K)` matrix of its output channels (its `out_axis` first,
    every other axis flattened, in order)."""
    moved = jnp.moveaxis(kernel, out_axis, 0)
    return moved.reshape(moved.shape[0], -1)


def channel_norms_squared(w: ArrayLike, out_axis: int = 0) -> Array:
    """`‖W‖²` of every output channel of a kernel, over every other axis, in float32
    or wider.

    **Arguments:**

    - `w`: a dense kernel.
    - `out_axis`: its output-channel axis.

    **Returns:**

    An array of shape `(out,)`.
    """
    w = jnp.asarray(w)
    w = w.astype(_accumulation_dtype(w.dtype))
    axis = _normalise_axis(out_axis, tuple(w.shape))
    return jnp.sum(w * w, axis=tuple(i for i in range(w.ndim) if i != axis))


def _check_plain(w: Any) -> None:
    if isinstance(w, quaxlike.Value):
        raise TypeError(_VALUE_WEIGHT_MSG.format(kind=type(w).__qualname__))


class DoraConvKernel(LowRankValue):
    """A DoRA convolution kernel: `(m / ‖W + A · B‖) ⊙ (W + A · B)` per output channel,
    as one array value.

    `W + A · B` is laid out as for `LoraConvKernel` (`A` `(out, rank)`, `B` the shape
    of `W` with `rank` at `out_axis`); `m` has one entry per output channel, and the
    norm is taken per output channel over every other axis (input channels and the
    spatial axes, as PEFT's DoRA `Conv1d/2d/3d` does) and is detached: derivatives
    treat it as a constant. `A · B` plays PEFT's `s · lora_B · lora_A`.

    Inside `quaxlike.quaxify`, `lax.conv_general_dilated` with it as the kernel (the
    kernel's `out_axis` being the convolution's output-feature axis, as for
    `eqx.nn.Conv` and `eqx.nn.ConvTranspose`) is computed as
    `(m / n) ⊙ (conv(x, W) + conv1x1(conv(x, B), A))` along the output's feature
    axis; `n` costs one `(out, K) x (K, rank)` product with `W` plus `O(out · rank²)`,
    with `‖W‖²` per channel computed once, when the kernel is made. `W + A · B` is
    never formed. Any other primitive raises an error rather than building the
    dense kernel, unless `allow_materialise=True`.

    **Arguments:**

    - `weight`: the frozen kernel `W`, a plain floating-point array with at least
        three dimensions (a Value is refused).
    - `rank`: the rank of the update.
    - `key`: a JAX PRNG key for the initial `A` (drawn as `LoraConvKernel` draws it;
        `B` starts at zero).
    - `out_axis`: the output-channel axis of `weight` (0 for Equinox kernels).
    - `scale`: standard deviation of the initial `A`.
    - `magnitude`: the initial `m`, `(out,)`; by default the channel norms of `W`
        (PEFT's), so that at first the kernel equals `W`.
    - `allow_materialise`, `stop_gradient`: as for `LoraConvKernel`.

    !!! example

        ```python
        conv = eqx.nn.Conv2d(3, 8, kernel_size=3, padding=1, key=jr.key(0))
        kernel = DoraConvKernel(conv.weight, rank=2, key=jr.key(1))
        dora_conv = eqx.tree_at(lambda c: c.weight, conv, kernel)
        y = quaxlike.quaxify(dora_conv)(jnp.ones((3, 16, 16)))
        assert jnp.allclose(y, conv(jnp.ones((3, 16, 16))), atol=1e-5)  # B = 0
        ```
    """

    refuse_message: ClassVar[str] = _REFUSE_MSG

    m: Array
    w_norm_sq: Array
    out_axis: int = eqx.field(static=True)

    def __init__(
        self,
        weight: ArrayLike | quaxlike.ArrayValue,  # a Value is refused, with a message
        *,
        rank: int,
        key: PRNGKeyArray,
        out_axis: int = 0,
        scale: float = 0.01,
        magnitude: ArrayLike | None = None,
        allow_materialise: bool = False,
        stop_gradient: bool = True,
    ):
        rank = check_rank(DoraConvKernel, rank)
        _check_plain(weight)
        weight = check_weight(weight, 3, _BAD_WEIGHT_MSG)
        assert isinstance(weight, jax.Array)  # a Value was refused above
        shape = shape_of(weight)
        axis = _normalise_axis(out_axis, shape)
        dtype = np.dtype(weight.dtype)
        self.w = weight
        self.a, self.b = _initial_factors(key, scale, shape, axis, rank, dtype)
        self.w_norm_sq = channel_norms_squared(weight, axis)
        if magnitude is None:
            m = jnp.sqrt(self.w_norm_sq).astype(dtype)
        else:
            m = jnp.asarray(magnitude)
            if shape_of(m) != (shape[axis],):
                raise ValueError(_BAD_MAGNITUDE_MSG.format(want=(shape[axis],), got=shape_of(m)))
            m = m.astype(dtype)
        self.m = m
        self.out_axis = axis
        self.allow_materialise = allow_materialise
        self.stop_gradient = stop_gradient

    @classmethod
    def from_factors(
        cls,
        w: Any,
        a: Any,
        b: Any,
        m: Any = None,
        *,
        w_norm_sq: Any = None,
        out_axis: int = 0,
        allow_materialise: bool = False,
        stop_gradient: bool = True,
    ) -> "DoraConvKernel":
        """A `DoraConvKernel` with the given arrays, drawing nothing.

        **Arguments:**

        - `w`: the kernel `W` (a plain array), output channels along `out_axis`.
        - `a`: `(out, rank)`; `b`: the shape of `w` with `rank` at `out_axis`.
        - `m`: the magnitude, `(out,)`; by default the channel norms of `W + A · B`
            (so that the kernel equals `W + A · B`), computed without forming it.
        - `w_norm_sq`: `‖W‖²` per output channel, if known (else computed from `w`).
        - `out_axis`, `allow_materialise`, `stop_gradient`: as for the constructor.

        **Returns:**

        A new `DoraConvKernel`.

        !!! example

            ```python
            w, a, b = jnp.ones((4, 2, 3)), jnp.ones((4, 1)), jnp.zeros((1, 2, 3))
            kernel = DoraConvKernel.from_factors(w, a, b)
            assert kernel.rank == 1 and kernel.m.shape == (4,)
            ```
        """
        _check_plain(w)
        shape = shape_of(w)
        axis = _normalise_axis(out_axis, shape)
        rank = shape_of(a)[-1] if shape_of(a) else 0
        expected_b = shape[:axis] + (rank,) + shape[axis + 1 :]
        if shape_of(a) != (shape[axis], rank) or shape_of(b) != expected_b or rank < 1:
            raise ValueError(
                f"DoraConvKernel.from_factors: for a kernel of shape {shape} with "
                f"out_axis={axis}, `a` must have shape ({shape[axis]}, rank) and `b` "
                f"the kernel's shape with rank at axis {axis}; got `a` {shape_of(a)} "
                f"and `b` {shape_of(b)}."
            )
        if w_norm_sq is None:
            w_norm_sq = channel_norms_squared(w, axis)
        self = cls._from_fields(
            w=w,
            a=a,
            b=b,
            m=None,
            w_norm_sq=jnp.asarray(w_norm_sq),
            out_axis=axis,
            allow_materialise=allow_materialise,
            stop_gradient=stop_gradient,
        )
        return with_magnitude(self, m, (shape[axis],), _BAD_MAGNITUDE_MSG)

    def _ndim_from_factors(self) -> int:
        return len(shape_of(self.b if self.b is not None else self.w))

    def norm(self) -> Array:
        """`‖W + A · B‖` per output channel, over every other axis, behind
        `lax.stop_gradient`, never forming `W + A · B`.

        **Returns:**

        An array of shape `(out,)`, in float32 or wider.
        """
        return dora_conv_norm(self.w, self.a, self.b, self.weight_norm_squared(), self.out_axis)

    def weight_norm_squared(self) -> Array:
        """`‖W‖²` per output channel: the one computed when the kernel was made
        while `W` is frozen (`stop_gradient=True`), else computed again from the
        current `W`, which training moves.

        **Returns:**

        An array of shape `(out,)`, in float32 or wider.
        """
        if self.stop_gradient:
            return self.w_norm_sq
        return channel_norms_squared(jnp.asarray(self.w), self.out_axis)  # a plain kernel

    def channel_scale(self) -> Array:
        """`m / n`, the factor of each output channel of `W + A · B` (`n` detached).

        **Returns:**

        An array of shape `(out,)`, of the kernel's dtype.
        """
        norm = self.norm()
        return (self.m.astype(norm.dtype) / norm).astype(self.dtype)

    def dense_from(self, w: Any, a: Any, b: Any) -> Any:
        """`(m / n) ⊙ (w + A · B)` per output channel, `n` detached."""
        scale = self.channel_scale()
        shape = [1] * len(shape_of(w))
        shape[self.out_axis] = -1

        def build(kernel):
            return kernel * scale.reshape(shape).astype(kernel.dtype)

        return quaxlike.quaxify(build)(dense_kernel(w, a, b, self.out_axis))

    def merged(self) -> Any:
        """The dense kernel `W'` PEFT's `merge_and_unload` bakes in:
        `(m / n) ⊙ (W + A · B)`, an ordinary array.

        **Returns:**

        An array of this kernel's shape and dtype.
        """
        return self.dense_from(self.w, self.a, self.b)

    def holding_plain(self, array: Any) -> Any:
        return None  # no magnitude and norm to put an arbitrary array in


def dora_conv_norm(w: Any, a: Any, b: Any, w_norm_sq: Any, out_axis: int) -> Array:
    """`‖W + A · B‖` per output channel of a kernel, detached, from `‖W‖²` per
    channel, the cross product `W_f B_fᵀ` `(out, rank)` and the Gram matrix
    `B_f B_fᵀ` of the flattened factors.

    **Arguments:**

    - `w`: the kernel; `a`: `(out, rank)`; `b`: like `w` with `rank` at `out_axis`.
    - `w_norm_sq`: `‖W‖²` per output channel, `(out,)`.
    - `out_axis`: the output-channel axis of `w` and `b`.

    **Returns:**

    An array of shape `(out,)` behind `lax.stop_gradient`, in float32 or wider.
    """
    w, a, b, w_norm_sq = (lax.stop_gradient(v) for v in (w, a, b, w_norm_sq))
    acc = _accumulation_dtype(w_norm_sq.dtype)
    w_flat = _flat(w, out_axis).astype(acc)
    b_flat = _flat(b, out_axis).astype(acc)
    cross = jnp.matmul(w_flat, b_flat.T)  # (out, rank)
    return norm_from_cross(cross, a, b_flat, w_norm_sq)


# --- convolution ---------------------------------------------------------------------


@cached_rule
def _conv_with_dora_kernel(x, kernel: DoraConvKernel, **params):
    w = kernel.frozen_weight()
    out_feature = params["dimension_numbers"][2][1]

    def conv(x, w, a, b, m, w_norm_sq):
        base = lax.conv_general_dilated_p.bind(x, w, **params)
        low = _conv_low_rank(x, a, b, kernel.out_axis, params)
        total = lax.add(base, low.astype(base.dtype))
        norm = dora_conv_norm(w, a, b, w_norm_sq, kernel.out_axis)
        scale = (m.astype(norm.dtype) / norm).astype(total.dtype)
        shape = [1] * total.ndim
        shape[out_feature] = -1
        return total * scale.reshape(shape)

    norm_sq = kernel.weight_norm_squared()
    return quaxlike.quaxify(conv)(x, w, kernel.a, kernel.b, kernel.m, norm_sq)


@quaxlike.register(lax.conv_general_dilated_p)
def conv_general_dilated_p_any_dorakernel(
    x: ArrayLike | quaxlike.ArrayValue, kernel: DoraConvKernel, **params
):
    _, rhs_spec, _ = params["dimension_numbers"]
    if rhs_spec[0] != kernel.out_axis:
        if kernel.allow_materialise:
            return NotImplemented
        raise ValueError(
            _CONV_AXIS_MSG.format(shape=kernel.shape, axis=kernel.out_axis, rhs_spec=rhs_spec)
        )
    return _conv_with_dora_kernel(x, kernel, **params)
