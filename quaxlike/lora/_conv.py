"""LoRA for convolution kernels: `LoraConvKernel` and its rules.

A kernel `W` (any layout, output channels along `out_axis`) gets the update
`A · B`: `A` is an `(out_channels, rank)` matrix, a 1x1 convolution; `B` is a kernel
like `W` with `rank` output channels. A convolution with the kernel is computed as
`conv(x, W) + conv1x1(conv(x, B), A)`, so `W + A · B` is never formed. This is the
low-rank factorisation of the kernel seen as the matrix a convolution multiplies its
input patches by: `out_channels x (in_channels / groups * prod(kernel_size))`.
"""

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
from quaxlike.internal import cached_rule, follow_axes, logical_entries, with_leaf_specs

from ._base import check_rank, check_weight, LowRankValue, shape_of
from ._value import LoraArray


_REFUSE_MSG = (
    "Refusing to materialise a LoraConvKernel of shape {shape}: a primitive with no "
    "LoraConvKernel rule needed the dense kernel `W + A · B`. LoraConvKernel supports "
    "`lax.conv_general_dilated` with the kernel as its right-hand side (any strides, "
    "padding, dilations, groups and dimension numbers whose output- or input-feature "
    "axis is the kernel's `out_axis`), flips, transposes, scaling by a scalar, "
    "negation and dtype conversion (see quaxlike/lora/README.md). Ways out: "
    "(1) register a rule for that primitive; (2) bake the update in with "
    "`quaxlike.lora.merge(model)`; or (3) construct the kernel with "
    "`allow_materialise=True` if a dense copy is acceptable."
)
_BAD_WEIGHT_MSG = (
    "LoraConvKernel needs a floating-point convolution kernel with at least three "
    "dimensions (output channels, input channels, one or more spatial axes); got "
    "{what}. For a matrix, use LoraArray."
)
_BAD_AXIS_MSG = (
    "LoraConvKernel's `out_axis` must be an axis of the kernel of shape {shape}; got "
    "{axis!r}. It is the output-channel axis: 0 for `eqx.nn.Conv` and "
    "`eqx.nn.ConvTranspose` kernels `(out, in / groups, *kernel_size)`, -1 for the "
    "`(*kernel_size, in / groups, out)` kernels of Flax."
)
_RESHAPE_MSG = (
    "Refusing to reshape a LoraConvKernel from {shape} to {new_shape}: the low-rank "
    "update would not stay low-rank in a form the convolution rule can use, and the "
    "dense kernel `W + A · B` is not built. JAX reshapes a kernel when `jax.grad` or "
    "`jax.vjp` runs inside `quaxify` through a grouped convolution "
    "(`feature_group_count > 1` or `batch_group_count > 1`), and when `jax.vmap` "
    "inside `quaxify` maps over kernels. Ways out: differentiate outside `quaxify` "
    "(`jax.grad(quaxify(f))`, the usual way, which gives the same gradients); map "
    "outside it (`jax.vmap(quaxify(f))`); bake the update in with "
    "`quaxlike.lora.merge`; or build the kernel with "
    "`allow_materialise=True`."
)
_LORA_ARRAY_KERNEL_MSG = (
    "`conv_general_dilated` got a LoraArray of shape {shape} as its kernel. A LoraArray "
    "factors its last two axes as a matrix, which for a convolution kernel is not the "
    "kernel's low-rank structure (and has no convolution rule). Wrap kernels in "
    "`quaxlike.lora.LoraConvKernel(weight, rank=..., out_axis=..., key=...)` "
    "instead (`loraify` does so for the weights of `eqx.nn.Conv` and "
    "`eqx.nn.ConvTranspose`), or build the LoraArray with `allow_materialise=True`."
)


class LoraConvKernel(LowRankValue):
    """A convolution kernel `W` plus a trainable low-rank update `A · B`, as one array
    value.

    `W` has any layout, with its output channels along `out_axis` (`O` of them). `A`
    has shape `(O, rank)`: a 1x1 convolution from `rank` channels to `O`. `B` has
    the shape of `W` with `rank` in place of `O`: a kernel with `rank` output
    channels and `W`'s spatial extent, input channels and layout. The array stood
    for is `W + A · B`, the product contracting `A`'s second axis with `B`'s
    `out_axis`: the kernel, seen as the `O x (in_channels * prod(kernel_size))`
    matrix a convolution multiplies its input patches by, plus a rank-`rank`
    update of that matrix. `A` starts random (scaled by `scale`) and `B` at zero,
    so at first the kernel equals `W`; for a 2-D kernel the draw is the one
    `LoraArray` makes.

    Inside `quaxlike.quaxify`, `lax.conv_general_dilated` with it as the kernel is
    computed as `conv(x, W) + conv1x1(conv(x, B), A)`: the low-rank part runs `x`
    through a convolution with `rank` output channels (with the original strides,
    padding, dilations and groups), then mixes those channels with `A`. The kernel
    `W + A · B` is never formed. Flips, transposes, scaling by a scalar and dtype
    conversion give another `LoraConvKernel`; any other primitive raises an error
    rather than building the dense kernel, unless `allow_materialise=True`.

    **Arguments:**

    - `weight`: the frozen kernel `W`, a floating-point array (or an `ArrayValue`)
        with at least three dimensions.
    - `rank`: the rank of the update.
    - `key`: a JAX PRNG key for the initial `A`.
    - `out_axis`: the output-channel axis of `weight`: 0 (the default) for
        `eqx.nn.Conv` and `eqx.nn.ConvTranspose`, whose kernels are
        `(out, in / groups, *kernel_size)`; -1 for Flax's `(*kernel_size, in, out)`.
    - `scale`: standard deviation of the initial `A`.
    - `allow_materialise`: whether a primitive with no rule may build the dense
        kernel (by default that raises an error instead).
    - `stop_gradient`: whether gradients stop at `W` (it is frozen).

    !!! example

        ```python
        conv = eqx.nn.Conv2d(3, 8, kernel_size=3, padding=1, key=jax.random.key(0))
        kernel = LoraConvKernel(conv.weight, rank=2, key=jax.random.key(1))
        lora_conv = eqx.tree_at(lambda c: c.weight, conv, kernel)
        y = quaxlike.quaxify(lora_conv)(jnp.ones((3, 16, 16)))  # W and B convolved
        assert y.shape == (8, 16, 16)
        ```
    """

    refuse_message: ClassVar[str] = _REFUSE_MSG

    out_axis: int = eqx.field(static=True)

    def __init__(
        self,
        weight: ArrayLike | quaxlike.ArrayValue,
        *,
        rank: int,
        key: PRNGKeyArray,
        out_axis: int = 0,
        scale: float = 0.01,
        allow_materialise: bool = False,
        stop_gradient: bool = True,
    ):
        rank = check_rank(LoraConvKernel, rank)
        weight = check_weight(weight, 3, _BAD_WEIGHT_MSG)
        shape = shape_of(weight)
        axis = _normalise_axis(out_axis, shape)
        self.w = weight
        self.a, self.b = _initial_factors(
            key, scale, shape, axis, int(rank), np.dtype(weight.dtype)
        )
        self.out_axis = axis
        self.allow_materialise = allow_materialise
        self.stop_gradient = stop_gradient

    @classmethod
    def from_factors(
        cls,
        w: Any,
        a: Any,
        b: Any,
        *,
        out_axis: int = 0,
        allow_materialise: bool = False,
        stop_gradient: bool = True,
    ) -> "LoraConvKernel":
        """A `LoraConvKernel` with the given arrays, drawing nothing.

        **Arguments:**

        - `w`: the kernel `W`, with its output channels along `out_axis`.
        - `a`: `(out_channels, rank)`.
        - `b`: the shape of `w` with `rank` at `out_axis`.
        - `out_axis`, `allow_materialise`, `stop_gradient`: as for the constructor.

        **Returns:**

        A new `LoraConvKernel`.

        !!! example

            ```python
            w, a, b = jnp.ones((4, 2, 3)), jnp.ones((4, 1)), jnp.ones((1, 2, 3))
            kernel = LoraConvKernel.from_factors(w, a, b)
            assert kernel.rank == 1 and kernel.shape == (4, 2, 3)
            ```
        """
        shape = shape_of(w)
        axis = _normalise_axis(out_axis, shape)
        rank = shape_of(a)[-1]
        expected_b = shape[:axis] + (rank,) + shape[axis + 1 :]
        if shape_of(a) != (shape[axis], rank) or shape_of(b) != expected_b:
            raise ValueError(
                f"LoraConvKernel.from_factors: for a kernel of shape {shape} with "
                f"out_axis={axis}, `a` must have shape ({shape[axis]}, rank) and `b` "
                f"the kernel's shape with rank at axis {axis} ({expected_b} for "
                f"rank {rank}); got `a` {shape_of(a)} and `b` {shape_of(b)}."
            )
        return cls._from_fields(
            w=w,
            a=a,
            b=b,
            out_axis=axis,
            allow_materialise=allow_materialise,
            stop_gradient=stop_gradient,
        )

    def logical_leaf_specs(self, spec: Any) -> "LoraConvKernel":
        """How `W`, `A` and `B` follow a sharding of the kernel (see
        `quaxlike.leaf_specs`): `W` like the kernel, `A` along the output
        channels, `B` along every axis but the output channels (where it holds the
        rank, never split).

        **Arguments:**

        - `spec`: a `PartitionSpec` of the kernel.

        **Returns:**

        This value with a `PartitionSpec` in place of each leaf.
        """
        ndim = self.logical_ndim()
        entries = logical_entries(spec, ndim)
        axis = self.out_axis
        return with_leaf_specs(
            self,
            w=self.weight_leaf_specs(spec),
            a=follow_axes(entries, [axis, None]),
            b=follow_axes(entries, [None if i == axis else i for i in range(ndim)]),
        )

    def _ndim_from_factors(self) -> int:
        return len(shape_of(self.b if self.b is not None else self.a))

    def dense_from(self, w: Any, a: Any, b: Any) -> Any:
        """`w + A · B` for this kernel's `out_axis`."""
        return dense_kernel(w, a, b, self.out_axis)

    def with_factors(self, w: Any, a: Any, b: Any, out_axis: int | None = None) -> "LoraConvKernel":
        """A copy with `w`, `a` and `b` (and optionally `out_axis`) replaced; the flags
        are kept.

        **Arguments:**

        - `w`, `a`, `b`: the new kernel and factors.
        - `out_axis`: the new output-channel axis (by default, the current one).

        **Returns:**

        A new `LoraConvKernel`.
        """
        return LoraConvKernel.from_factors(
            w,
            a,
            b,
            out_axis=self.out_axis if out_axis is None else out_axis,
            allow_materialise=self.allow_materialise,
            stop_gradient=self.stop_gradient,
        )


def _normalise_axis(axis: Any, shape: tuple[int, ...]) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise ValueError(_BAD_AXIS_MSG.format(shape=shape, axis=axis))
    if not -len(shape) <= axis < len(shape):
        raise ValueError(_BAD_AXIS_MSG.format(shape=shape, axis=axis))
    return int(axis) % len(shape)


def _initial_factors(key, scale, shape, axis, rank, dtype):
    a = scaled_normal(key, (shape[axis], rank), scale, dtype)
    b = jnp.zeros(shape[:axis] + (rank,) + shape[axis + 1 :], dtype=dtype)
    return a, b


@ft.partial(jax.jit, static_argnums=(1, 2, 3))
def scaled_normal(key: PRNGKeyArray, shape: tuple[int, ...], scale: float, dtype: Any) -> Array:
    """`jr.normal(key, shape, dtype) * scale`, bit for bit as computed op by op (as
    Quax draws `A`), in one compiled program per shape."""
    # The barrier keeps XLA from folding `scale` into the constants of the normal
    # draw, which changes the last bit of most entries.
    draw = lax.optimization_barrier(jr.normal(key, shape, dtype=dtype))
    return draw * jnp.asarray(scale, dtype)


def dense_kernel(w: Any, a: Any, b: Any, out_axis: int) -> Any:
    """`w + A · B` for a kernel whose output channels are along `out_axis`."""

    def build(w, a, b):
        update = jnp.moveaxis(jnp.tensordot(a, b, axes=((1,), (out_axis,))), 0, out_axis)
        return w + update.astype(w.dtype)

    return quaxlike.quaxify(build)(w, a, b)


# --- convolution ---------------------------------------------------------------------


def _one_by_one(matrix, n_spatial: int):
    # An (out, in) matrix as an (out, in, 1, ..., 1) kernel.
    return lax.broadcast_in_dim(
        matrix, (*jnp.shape(matrix), *(1,) * n_spatial), broadcast_dimensions=(0, 1)
    )


def _conv1x1(x, matrix, spec, groups, params):
    """A 1x1 convolution of `x` (laid out as `spec`) with an (out, in) matrix."""
    n_spatial = len(spec) - 2
    kernel = _one_by_one(matrix, n_spatial)
    if kernel.dtype != x.dtype:
        kernel = kernel.astype(x.dtype)
    return lax.conv_general_dilated(
        x,
        kernel,
        window_strides=(1,) * n_spatial,
        padding=((0, 0),) * n_spatial,
        dimension_numbers=lax.ConvDimensionNumbers(spec, tuple(range(n_spatial + 2)), spec),
        feature_group_count=groups,
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
    )


def _tile(x, copies: int, axis: int):
    return x if copies == 1 else lax.concatenate([x] * copies, axis)


def _conv_low_rank(x, a, b, out_axis, params):
    """`conv(x, A · B)` through the factors, for a kernel whose `out_axis` is the
    convolution's output- or input-feature axis (checked by the caller)."""
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    feature_groups = params["feature_group_count"]
    batch_groups = params["batch_group_count"]
    groups = feature_groups * batch_groups  # one of the two is 1
    if rhs_spec[0] == out_axis:
        # conv(x, A · B) = conv1x1(conv(x, B), A). With G groups, each group of
        # output channels sees its own group of inputs (or of the batch), so `B`
        # runs once per group (G * rank channels) and `A` is a grouped 1x1.
        z = lax.conv_general_dilated_p.bind(x, _tile(b, groups, out_axis), **params)
        return _conv1x1(z, a, out_spec, groups, params)
    # The kernel's `out_axis` is the convolution's input-feature axis (a
    # transposed convolution, or the gradient with respect to a convolution's
    # input): conv(x, A · B) = conv(conv1x1(x, Aᵀ), B), the 1x1 grouped as the
    # input channels are.
    u = _conv1x1(x, _tile(a.T, feature_groups, 0), lhs_spec, feature_groups, params)
    if u.dtype != b.dtype:
        b = b.astype(u.dtype)
    return lax.conv_general_dilated_p.bind(u, b, **params)


@cached_rule
def _conv_with_lora_kernel(x, kernel: LoraConvKernel, **params):
    w = kernel.frozen_weight()

    def conv(x, w, a, b):
        base = lax.conv_general_dilated_p.bind(x, w, **params)
        low = _conv_low_rank(x, a, b, kernel.out_axis, params)
        return lax.add(base, low.astype(base.dtype))

    return quaxlike.quaxify(conv)(x, w, kernel.a, kernel.b)


@quaxlike.register(lax.conv_general_dilated_p)
def conv_general_dilated_p_any_lorakernel(
    x: ArrayLike | quaxlike.ArrayValue, kernel: LoraConvKernel, **params
):
    _, rhs_spec, _ = params["dimension_numbers"]
    if kernel.out_axis not in rhs_spec[:2]:
        return NotImplemented  # the rank axis is a spatial axis of this convolution
    return _conv_with_lora_kernel(x, kernel, **params)


@quaxlike.register(lax.conv_general_dilated_p)
def conv_general_dilated_p_any_lora(
    x: ArrayLike | quaxlike.ArrayValue, kernel: LoraArray, **params
):
    # A LoraArray's factor layout does not fit a kernel: say what to use instead.
    if kernel.allow_materialise:
        return NotImplemented
    raise ValueError(_LORA_ARRAY_KERNEL_MSG.format(shape=kernel.shape))


# --- structural and elementwise ------------------------------------------------------


def _apply(kernel: LoraConvKernel, fw, fa, fb, out_axis=None) -> LoraConvKernel:
    """A LoraConvKernel of `fw(w)`, `fa(a)`, `fb(b)`, each under `quaxify` in case the
    array is itself a Value."""
    w, a, b = (quaxlike.quaxify(f)(v) for f, v in ((fw, kernel.w), (fa, kernel.a), (fb, kernel.b)))
    return kernel.with_factors(w, a, b, out_axis)


def _same(v):
    return v


@quaxlike.register(lax.rev_p)
def rev_p_lorakernel(kernel: LoraConvKernel, *, dimensions, **params):
    # Flipping other axes flips W and B alike; flipping the output channels flips W
    # and the rows of A (B's axis there holds the rank).
    others = tuple(d for d in dimensions if d != kernel.out_axis)
    flip = lambda v: lax.rev(v, dimensions)  # noqa: E731
    flip_a = (lambda v: lax.rev(v, (0,))) if kernel.out_axis in dimensions else _same
    flip_b = (lambda v: lax.rev(v, others)) if others else _same
    return _apply(kernel, flip, flip_a, flip_b)


@quaxlike.register(lax.transpose_p)
def transpose_p_lorakernel(kernel: LoraConvKernel, *, permutation, **params):
    # W and B are permuted alike; A keeps its (out, rank) layout.
    permute = lambda v: lax.transpose(v, permutation)  # noqa: E731
    return _apply(kernel, permute, _same, permute, tuple(permutation).index(kernel.out_axis))


@quaxlike.register(lax.reshape_p)
def reshape_p_lorakernel(kernel: LoraConvKernel, *, new_sizes, **params):
    if tuple(new_sizes) == kernel.shape and params.get("dimensions") is None:
        return kernel
    if kernel.allow_materialise:
        return NotImplemented
    raise ValueError(_RESHAPE_MSG.format(shape=kernel.shape, new_shape=tuple(new_sizes)))


# Scaling, negation, dtype conversion, copies and stop_gradient act on the
# factors alike for both LoRA types: their rules are in _rules.py.
