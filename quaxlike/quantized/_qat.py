"""Quantisation-aware training (QAT): `FakeQuantized`, a float weight that
multiplies as if rounded onto the grid `quantize` would store it on, with a
straight-through gradient; `fake_quantize`, which makes one of every selected
weight of a model; and the conversion `quantize` makes of a fake-quantised
model (`convert_fake_quantized`): each `FakeQuantized` becomes the stored type
with the same settings, whose products give what the fake-quantised forward
gave.

The straight-through estimator (STE) is torchao's and torchtune's: in the
forward pass the weight is `Q(w)` (round to nearest on the grid, a scale per
group from the group's absmax), in the backward pass the rounding counts as the
identity and the scales as constants (torchao computes them under
`torch.no_grad`). torchao clips the STE where a code is clamped to the ends of
its range; on these symmetric absmax grids no code is ever clamped (`|w| /
scale <= code_max` by construction), so the gradient is exactly the identity,
`w + stop_gradient(Q(w) - w)`. Activations (`activations=8`) are fake-quantised
per token as torchao's `IntxFakeQuantizeConfig(torch.int8, "per_token",
is_symmetric=False)` does: asymmetric, a scale and zero point per token from its
min and max, and there the STE is clipped (a token's extreme value can round
one code past the range, and is clamped).
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, ArrayLike, PyTree

import quaxlike
from quaxlike.internal import (
    follow_axes,
    logical_entries,
    materialise_value,
    ShapedArray,
    with_leaf_specs,
)

from ..selection import replace_selected
from ._base import as_float_matrix, check_block_bytes, check_group_size, QuantizedArray
from ._rounding import build, CODE_MAX, fake_quantize as round_weight, Grid, grid_for, rtn_codes
from ._value import default_where


_BAD_BITS_MSG = (
    '`{function}`: `bits` must be 8, 4, 3 or 2, or "nf4", the grids `quantize` stores; got {got!r}.'
)
_BAD_ACTIVATIONS_MSG = (
    "`{function}`: `activations` must be None (weights only) or the bits of the "
    "per-token fake quantisation of each product's input, an int from 2 to 8 (8 "
    "as torchao's int8 dynamic activations); got {got!r}."
)
_NOT_A_WEIGHT_MSG = "`fake_quantize` selected a {what}: {why} Ways out: {way_out}"
_WAYS_OUT = {
    "fake": (
        "it is fake-quantised already.",
        "leave it out with `where=`, or start from the float model to change the settings.",
    ),
    "quantized": (
        "it is quantised already, and QAT trains the float weight that is rounded.",
        "fake-quantise the float model and `quantize` it after training, or fine-tune "
        "the quantised model with LoRA (`quaxlike.lora.qlora`).",
    ),
    "value": (
        "QAT rounds a float weight, and this Value is not one.",
        "fake-quantise first and adapt after (`loraify(fake_quantize(model), ...)`: "
        "LoRA over a fake-quantised base, as torchtune's QAT + LoRA), or leave it out "
        "with `where=`.",
    ),
}
_CONVERT_SETTINGS_MSG = (
    "`quantize` of a model holding `FakeQuantized` weights converts each to the "
    "stored type with the settings it was trained with (its `bits`, `group_size`, "
    "`activations`); got {what}. Call `quantize(model)` with no other settings "
    "(`allow_materialise`, `block_bytes` and `matmul` are passed on), then quantise "
    "any other weights with a second call, `quantize(converted, where=..., ...)`."
)


def check_bits(bits: Any, function: str) -> None:
    """Refuse `bits` other than those `quantize` stores."""
    if isinstance(bits, bool) or not (bits == "nf4" or bits in CODE_MAX):
        raise ValueError(_BAD_BITS_MSG.format(function=function, got=bits))


def check_activations(activations: Any, function: str) -> None:
    """Refuse `activations` other than None or an int in 2..8."""
    if activations is None:
        return
    if isinstance(activations, bool) or not isinstance(activations, int):
        raise ValueError(_BAD_ACTIVATIONS_MSG.format(function=function, got=activations))
    if not 2 <= activations <= 8:
        raise ValueError(_BAD_ACTIVATIONS_MSG.format(function=function, got=activations))


def straight_through(exact: Array, rounded: Array) -> Array:
    """`rounded` in value, with the derivative of `exact`: `rounded` bit for bit
    (`exact - exact` is 0), and the identity in `jvp` and `grad`."""
    return lax.stop_gradient(rounded) + (exact - lax.stop_gradient(exact))


def fake_quantize_tokens(x: Array, bits: int, axis: int) -> Array:
    """`x` fake-quantised per token: each slice along `axis` (the features of one
    token) rounded onto `2**bits` levels, asymmetrically, as torchao's per-token
    fake quantiser does (`IntxFakeQuantizeConfig(int8, "per_token",
    is_symmetric=False)`, with torchtune's `eps`).

    Per token: `scale = (max(x, 0) - min(x, 0)) / (qmax - qmin)` (at least
    `eps`), `zero = clip(qmin - round(min(x, 0) / scale), qmin, qmax)`, codes
    `clip(round(x * (1 / scale)) + zero, qmin, qmax)`, value `(code - zero) *
    scale`. The gradient is straight-through where the code was not clamped and
    zero where it was (torchao's `_Round` inside a `torch.clamp`); the scales and
    zero points are constants (chosen under `torch.no_grad` there).

    **Arguments:**

    - `x`: a floating-point array.
    - `bits`: 2 to 8; `qmin, qmax = -2**(bits-1), 2**(bits-1) - 1`.
    - `axis`: the features axis.

    **Returns:**

    An array of `x`'s shape and dtype.

    !!! example

        ```python
        x = jnp.array([[-1.5, 0.25, 253.5], [0.0, 0.0, 0.0]])
        y = fake_quantize_tokens(x, bits=8, axis=-1)  # one scale per row (token)
        assert jnp.allclose(y[0], jnp.array([-2.0, 0.0, 253.0]))
        assert jnp.all(y[1] == 0)
        ```
    """
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    fixed = lax.stop_gradient(x)
    # In x's dtype up to the scale, as torchao's `choose_qparams_affine`.
    low = jnp.minimum(jnp.min(fixed, axis=axis, keepdims=True), 0)
    high = jnp.maximum(jnp.max(fixed, axis=axis, keepdims=True), 0)
    scale = jnp.maximum((high - low) / (qmax - qmin), jnp.finfo(jnp.float32).eps)
    zero = jnp.clip(qmin - jnp.round(low / scale), qmin, qmax).astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    codes = jnp.round(fixed.astype(jnp.float32) * (1.0 / scale)) + zero
    inside = (codes >= qmin) & (codes <= qmax)
    rounded = ((jnp.clip(codes, qmin, qmax) - zero) * scale).astype(x.dtype)
    return rounded + jnp.where(inside, x - fixed, jnp.zeros_like(x))


class FakeQuantized(quaxlike.ArrayValue):
    """A float weight that takes part in the forward pass rounded onto a
    quantisation grid, with a straight-through gradient: quantisation-aware
    training (QAT).

    The array it stands for is `Q(weight)`, the dense weight that `quantize`
    with the same `bits` and `group_size` would store (round to nearest, a
    symmetric absmax scale per group of inputs, or NF4 levels), bit for bit. Its
    derivative with respect to `weight` is the identity (the straight-through
    estimator of torchao and torchtune: rounding counts as the identity and the
    scales as constants), so `jax.grad` trains the float weight to do well once
    rounded. The true derivative of rounding, zero almost everywhere, would
    train nothing.

    With `activations=b`, each matrix product that takes the weight's inputs
    (its input axis contracted with the other operand) first fake-quantises
    that operand per token to `b` bits (`fake_quantize_tokens`), as torchao's
    QAT does for int8 dynamic activations. Other primitives see the weight
    alone.

    Every primitive works: matrix products have a rule, transposes, slices of
    whole rows, `stop_gradient` and reshapes of leading axes give another
    `FakeQuantized`, and everything else materialises `Q(weight)` with the
    straight-through gradient (this is a training-time type: the dense weight
    exists anyway). Differentiate outside `quaxify` (`eqx.filter_grad` of a loss
    that calls `quaxify(model)`), where the rules' own operations are
    differentiated.

    **Arguments:**

    - `weight`: the float weight `(*batch, out, in)`, the layout of an
        `eqx.nn.Linear` weight (groups run along `in`).
    - `bits`: 8 (per output row), 4, 3, 2 (per group) or `"nf4"`, as for
        `quantize`.
    - `group_size`: inputs per scale for 4, 3, 2 (default 32) and `"nf4"`
        (default 64); `None` for 8.
    - `activations`: `None`, or the bits (2 to 8) of the per-token fake
        quantisation of the products' inputs.
    - `transposed`: whether the array is the weight with its last two axes
        swapped (as `weight.T` gives it).

    !!! example

        ```python
        w = jr.normal(jr.key(0), (8, 64))
        fq = FakeQuantized(w, bits=4)
        y = quaxlike.quaxify(lambda w, x: w @ x)(fq, jnp.ones(64))
        assert jnp.allclose(y, quantize_int4(w).dequantize() @ jnp.ones(64), atol=1e-5)
        ```
    """

    weight: Array
    bits: int | str = eqx.field(static=True)
    group_size: int | None = eqx.field(static=True)
    activations: int | None = eqx.field(static=True)
    transposed: bool = eqx.field(static=True)

    # `Q(weight)` is not linear in `weight`: a tangent of the weight is not a
    # FakeQuantized. A custom_jvp rule gets the array's tangent instead, the
    # derivative of `dense_for_derivatives()`: the straight-through identity.
    structured_tangents = False
    # A training type: the dense `Q(weight)` is what it is used as.
    warn_on_materialise = False

    def __init__(
        self,
        weight: ArrayLike,
        *,
        bits: int | str = 4,
        group_size: int | None = None,
        activations: int | None = None,
        transposed: bool = False,
    ):
        check_bits(bits, "FakeQuantized")
        check_activations(activations, "FakeQuantized")
        weight = as_float_matrix(weight, "FakeQuantized")
        grid = grid_for(bits, group_size)
        if grid.group_size is not None:
            check_group_size(tuple(weight.shape), grid.group_size, "FakeQuantized")
        self.weight = weight
        self.bits = bits
        self.group_size = grid.group_size
        self.activations = activations
        self.transposed = transposed

    @property
    def grid(self) -> Grid:
        """The grid the weight is rounded onto (see `quaxlike.quantized`'s
        `_rounding.py`)."""
        return grid_for(self.bits, self.group_size)

    def aval(self) -> ShapedArray:
        shape = tuple(self.weight.shape)
        if self.transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return ShapedArray(shape, self.weight.dtype)

    def _laid_out(self, stored: Array) -> Array:
        return jnp.swapaxes(stored, -1, -2) if self.transposed else stored

    def dequantize(self) -> Array:
        """The rounded weight `Q(weight)`, with no derivative (what the stored type
        `quantize` makes of it dequantises to, bit for bit).

        **Returns:**

        An array of this array's shape and dtype.
        """
        return self._laid_out(round_weight(self.grid, lax.stop_gradient(self.weight)))

    def materialise(self) -> Array:
        # `Q(weight)` in value, the identity in derivatives.
        weight = self.weight
        return self._laid_out(straight_through(weight, round_weight(self.grid, weight)))

    def with_weight(self, weight: Array, transposed: bool | None = None) -> "FakeQuantized":
        """A copy over another float weight (same settings), built without checks."""
        fields = dict(
            weight=weight,
            bits=self.bits,
            group_size=self.group_size,
            activations=self.activations,
            transposed=self.transposed if transposed is None else transposed,
        )
        out = object.__new__(FakeQuantized)
        for name, value in fields.items():
            object.__setattr__(out, name, value)
        return out

    def logical_leaf_specs(self, spec: Any) -> "FakeQuantized":
        """How the float weight follows a sharding of the array (see
        `quaxlike.leaf_specs`): axis by axis, in stored order for a transposed
        array. Splitting the inputs needs whole groups on each device only once
        converted (`quantize`); the rounding itself works on any split.

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with a `PartitionSpec` in place of `weight`.
        """
        ndim = len(self.weight.shape)
        entries = list(logical_entries(spec, ndim))
        if self.transposed:
            entries[-2], entries[-1] = entries[-1], entries[-2]
        return with_leaf_specs(self, weight=follow_axes(entries, list(range(ndim))))

    def to_quantized(self, **options: Any) -> Any:
        """The stored type with the same settings: an `Int8Array`, `Int4Array`
        or `NF4Array` of `Q(weight)`'s codes and scales (round to nearest, as
        `quantize`), inside an `ActivationFakeQuantized` when `activations` is
        set.

        **Arguments:**

        - `options`: `allow_materialise`, `block_bytes`, `matmul`, as for the
            stored types.

        **Returns:**

        The quantised array, laid out as this one.
        """
        stored = _stored(lax.stop_gradient(self.weight), self.grid, **options)
        if self.transposed:
            stored = stored.swapped()
        if self.activations is None:
            return stored
        return ActivationFakeQuantized(stored, bits=self.activations, transposed=self.transposed)


@eqx.filter_jit
def _stored(weight: Array, grid: Grid, **options: Any) -> QuantizedArray:
    # One compiled program per shape and grid, rather than one per operation.
    codes, scale = rtn_codes(grid, weight)
    return build(grid, codes, scale, weight.dtype, **options)


class ActivationFakeQuantized(quaxlike.ArrayValue):
    """A weight whose matrix products fake-quantise their inputs per token first:
    what `quantize` makes of a `FakeQuantized` trained with `activations=b`, so
    that the converted model computes what the fake-quantised one did.

    It stands for `base`. A matrix product that contracts the weight's input
    axis with the other operand rounds that operand per token
    (`fake_quantize_tokens`: asymmetric, `b` bits, torchao's dynamic
    activations) and multiplies it with `base` by `base`'s own rule (a
    quantised `base` is never dense); other primitives see `base` alone.

    **Arguments:**

    - `base`: the weight `(*batch, out, in)`: an `Int8Array`, `Int4Array` or
        `NF4Array` (any array or Value works).
    - `bits`: the bits of the inputs' fake quantisation, 2 to 8.
    - `transposed`: whether the array is the weight with its last two axes
        swapped (its inputs along axis -2); `base` is laid out the same way.

    !!! example

        ```python
        w = jr.normal(jr.key(0), (8, 64))
        a8 = ActivationFakeQuantized(quantize_int4(w), bits=8)
        y = quaxlike.quaxify(lambda w, x: w @ x)(a8, jnp.linspace(-1.0, 1.0, 64))
        ```
    """

    base: Any
    bits: int = eqx.field(static=True)
    transposed: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        check_activations(self.bits, "ActivationFakeQuantized")
        if len(tuple(self.base.shape)) < 2:
            raise ValueError(
                "ActivationFakeQuantized: `base` must be a weight `(*batch, out, in)`; "
                f"got shape {tuple(self.base.shape)}."
            )

    def aval(self) -> ShapedArray:
        return ShapedArray(tuple(self.base.shape), self.base.dtype)

    def materialise(self) -> Any:
        base = self.base
        return materialise_value(base) if isinstance(base, quaxlike.Value) else base

    def dequantize(self) -> Array:
        """`base`'s dense weight, built on purpose.

        **Returns:**

        An array of this array's shape and dtype.
        """
        base = self.base
        return base.dequantize() if hasattr(base, "dequantize") else base

    def dense_for_derivatives(self) -> Any:
        return quaxlike.internal.array_for_derivatives(self.base)

    def logical_leaf_specs(self, spec: Any) -> "ActivationFakeQuantized":
        """`base`'s leaves follow the spec as `base` declares (see
        `quaxlike.leaf_specs`).

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with `base`'s specs in its place.
        """
        return with_leaf_specs(self, base=quaxlike.leaf_specs(self.base, spec))


# --- whole models -------------------------------------------------------------------


def _kind(leaf: Any) -> str | None:
    if isinstance(leaf, FakeQuantized):
        return "fake"
    if isinstance(leaf, (QuantizedArray, ActivationFakeQuantized)):
        return "quantized"
    if isinstance(leaf, quaxlike.Value):
        return "value"
    return None


def fake_quantize(
    model: PyTree,
    *,
    bits: int | str = 4,
    group_size: int | None = None,
    where: Any = None,
    activations: int | None = None,
) -> PyTree:
    """Replace the weight of every `eqx.nn.Linear` in `model` by a
    `FakeQuantized`: quantisation-aware training.

    Train the result as the float model (every float leaf, or with LoRA over
    it: `loraify(fake_quantize(model), ...)`, torchtune's QAT + LoRA); the
    forward pass rounds each weight onto the grid `quantize(model, bits=bits,
    group_size=group_size)` would store it on, and the gradient passes the
    rounding straight through to the float weight. Then `quantize(model)` (no
    settings needed) gives the quantised model, whose outputs are those of the
    fake-quantised one.

    **Arguments:**

    - `model`: any PyTree holding Equinox layers.
    - `bits`: 8, 4, 3, 2 or `"nf4"`, as for `quantize` (default 4).
    - `group_size`: as for `quantize` (default 32 for 4, 3 and 2 bits, 64 for
        `"nf4"`; ignored for 8).
    - `where`: the weights to fake-quantise instead of every `Linear` weight: any
        selection of `quaxlike.selection`, as `quantize` and `loraify` take it.
    - `activations`: `None` (weights only, the default), or the bits of the
        per-token fake quantisation of each selected weight's inputs (8 as
        torchao's int8 dynamic activations; asymmetric, see
        `fake_quantize_tokens`).

    **Returns:**

    The model with `FakeQuantized` weights; call it as
    `quaxlike.quaxify(model)(x)`.

    **Raises:**

    `ValueError` for bad settings, a group size that does not divide a selected
    weight's inputs, a selection that picks nothing, or a selected leaf that is
    not a float weight (a quantised or LoRA weight: the message says what to do).

    !!! example

        ```python
        mlp = eqx.nn.MLP(64, 8, 64, depth=2, key=jr.key(0))
        qat = fake_quantize(mlp, bits=4, group_size=32)
        loss = lambda m, x: jnp.sum(quaxlike.quaxify(m)(x) ** 2)
        grads = eqx.filter_grad(loss)(qat, jnp.ones(64))  # straight through
        q = quantize(qat)  # Int4Array weights, the same outputs
        ```
    """
    check_bits(bits, "fake_quantize")
    check_activations(activations, "fake_quantize")

    def make(leaf):
        kind = _kind(leaf)
        if kind is not None:
            why, way_out = _WAYS_OUT[kind]
            what = f"{type(leaf).__name__} of shape {tuple(leaf.shape)}"
            raise ValueError(_NOT_A_WEIGHT_MSG.format(what=what, why=why, way_out=way_out))
        return FakeQuantized(
            as_float_matrix(leaf, "fake_quantize"),
            bits=bits,
            group_size=group_size,
            activations=activations,
        )

    if where is None:
        where = default_where(model)
    return replace_selected(model, where, make, "fake_quantize")


def _is_fake(x: Any) -> bool:
    return isinstance(x, FakeQuantized)


def holds_fake_quantized(model: PyTree) -> bool:
    """Whether `model` holds a `FakeQuantized` anywhere (inside a LoRA weight
    too)."""
    return any(_is_fake(x) for x in jtu.tree_leaves(model, is_leaf=_is_fake))


def convert_fake_quantized(
    model: PyTree,
    *,
    bits: Any,
    group_size: Any,
    double_quant: bool,
    where: Any,
    method: Any,
    calibration: Any,
    run: Any,
    activations: Any,
    options: dict,
) -> PyTree:
    """`quantize` of a model holding `FakeQuantized` weights: each becomes its
    stored type (`FakeQuantized.to_quantized`), wherever it is (the base of a
    LoRA weight too). `quantize`'s own settings must be left at their defaults
    or agree with every `FakeQuantized`'s."""
    fakes = [x for x in jtu.tree_leaves(model, is_leaf=_is_fake) if _is_fake(x)]
    wrong = []
    if bits != 8 and any(fake.bits != bits for fake in fakes):
        wrong.append(f"`bits={bits!r}` (trained with {sorted({str(f.bits) for f in fakes})})")
    if group_size is not None and any(fake.group_size != group_size for fake in fakes):
        wrong.append(f"`group_size={group_size!r}`")
    for name, value, default in (
        ("double_quant", double_quant, False),
        ("where", where, None),
        ("calibration", calibration, None),
        ("run", run, None),
        ("activations", activations, None),
    ):
        if value is not default and value != default:
            wrong.append(f"`{name}={value!r}`")
    if method != "rtn":
        wrong.append(
            f"`method={method!r}` (QAT trained the weights for round-to-nearest on "
            "their grid; other codes would undo what it learned)"
        )
    if wrong:
        raise ValueError(_CONVERT_SETTINGS_MSG.format(what=", ".join(wrong)))
    check_block_bytes(options["block_bytes"], "quantize")
    return jtu.tree_map(
        lambda x: x.to_quantized(**options) if _is_fake(x) else x, model, is_leaf=_is_fake
    )
