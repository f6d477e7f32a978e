"""Float8 training: `Float8Weight`, a high-precision (master) weight whose matrix
products run on float8 operands, as torchao's `Float8Linear` computes them, and
`float8_training`, which makes a model's weights such Values.

The rules (the float8 product and its backward pass) are in `_float8_rules.py`;
the casts and scales in `_float8_scaling.py`."""

import dataclasses
import sys
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

import quaxlike
from quaxlike.internal import follow_axes, logical_entries, ShapedArray, with_leaf_specs

from ..selection import replace_selected
from ._float8_scaling import RECIPES
from ._value import default_where


_BAD_SCALING_MSG = (
    "`{function}`: `scaling` must be one of {names} (torchao's "
    "`Float8LinearConfig.from_recipe_name` recipes); got {got!r}."
)
_BAD_WEIGHT_MSG = (
    "`{function}`: a float8-trained weight is a floating-point array with at least "
    "two dimensions `(*batch, out, in)` (the layout of an `eqx.nn.Linear` weight); "
    "`where=` selected {got}. Select weights only."
)
_NO_LINEAR_MSG = (
    "`float8_training(model)` found no `eqx.nn.Linear` in the model ({type_name}), so "
    "it would change nothing. Say which weights to train in float8 with `where=` "
    "(a path pattern such as 'layers.*.weight', a module type, or a getter)."
)


def check_scaling(scaling: Any, function: str) -> str:
    if scaling not in RECIPES:
        raise ValueError(
            _BAD_SCALING_MSG.format(function=function, names=tuple(RECIPES), got=scaling)
        )
    return scaling


class Float8Weight(quaxlike.ArrayValue):
    """A weight trained in float8: it stands for its high-precision (master) weight,
    and its matrix products cast both operands to float8 with dynamic scales,
    as torchao's `Float8Linear` does.

    Inside `quaxlike.quaxify`, a product `weight @ x` (any `lax.dot_general`
    with a dense array) computes, as torchao's `Float8LinearConfig` recipes do:

    - forward: the input and the weight cast to `float8_e4m3fn`, each with the
        scale `448 / amax`, one `dot_general` on the float8 operands
        accumulating in `float32` (`preferred_element_type=float32`), then the
        scales divided out and the result rounded to the output's dtype;
    - backward (a `jax.custom_vjp`): the gradient of the input `g @ weight` and
        of the weight `g @ x` as two more float8 products, the cotangent `g` in
        `float8_e5m2` (`"tensorwise"`) or `float8_e4m3fn` (`"rowwise"`), the
        master weight and the input saved in high precision and cast again.

    `scaling="tensorwise"` takes one scale per tensor (torchao's default recipe);
    `"rowwise"` one per row along each product's contracted axes (per token of
    the input, per output channel of the weight in the forward pass), rounded
    down to a power of 2 (torchao's `rowwise` recipe). Each of the three
    products scales its operands along its own contracted axes, as torchao does.
    The scales are of what the rule sees: under `jax.vmap(quaxify(model))` one
    example's input, under `quaxify(jax.vmap(model))` (or a model called on a
    batch) the batch's, as torchao scales the whole `(tokens, features)` input.

    On XLA:CPU of the JAX releases tested the float8 `dot_general` runs as it is;
    where a backend cannot compile one (probed once per backend), the float8
    operands are converted to `float32` first: the same numbers (products of
    float8 values are exact in `float32`), without float8 speed.

    Any other primitive sees the master weight (it materialises, which costs
    nothing: the master weight is what is stored; `quaxlike.explain` lists it,
    and `materialise_policy("warn")` warns). Transposing the last two axes,
    converting to another floating dtype, and indexing the leading (stacking)
    axes (`w[i]` on a stack of layers) keep a `Float8Weight`.
    Forward-mode derivatives (`jax.jvp`, `jax.linearize`) outside `quaxify` are refused: the
    backward pass quantises the cotangent, which is not the transpose of any
    linear map; `unwrap_float8(model)` gives the high-precision model for them.
    (A product traced by `jax.jit` before `jax.jvp` reaches it gets JAX's own
    refusal of a `custom_vjp` instead of this type's.)

    Differentiate outside `quaxify` (`jax.grad(quaxify(f))`, or
    `eqx.filter_grad` of a loss that calls `quaxify`) for torchao's backward.
    Inside it (`quaxify(jax.grad(f))`), JAX differentiates `dot_general` before
    the rule sees it: the forward is float8, the input's gradient is JAX's
    transposed product, a float8 product of the cotangent and the weight with
    the forward's e4m3 casts, and the weight's gradient is in high precision
    (straight through the casts; tested against that computation). Forward mode
    inside it (`quaxify(jax.jvp(...))`) likewise forms the tangent as JAX's product
    of the tangent with the weight, which is evaluated in float8 as every product
    with a `Float8Weight` is (as `precision=` lowers a `dot_general`'s tangent
    product with it): the dense tangent to float8 precision (tested).

    **Arguments:**

    - `weight`: the master weight `(*batch, out, in)`, `float32` or `bfloat16`.
    - `scaling`: `"tensorwise"` (default) or `"rowwise"`.
    - `transposed`: whether it stands for `weight` with its last two axes
        swapped (as `weight.T` gives).

    !!! example

        ```python
        w = jr.normal(jr.key(0), (16, 32))
        f8 = Float8Weight(w)
        x = jr.normal(jr.key(1), (4, 32))
        y = quaxlike.quaxify(lambda w, x: x @ w.T)(f8, x)  # a float8 dot_general
        error = jnp.linalg.norm(y - x @ w.T) / jnp.linalg.norm(x @ w.T)
        assert 0 < error < 0.05  # e4m3 keeps 3 bits of mantissa
        ```
    """

    weight: Array
    scaling: str = eqx.field(static=True, default="tensorwise")
    transposed: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        check_scaling(self.scaling, "Float8Weight")
        shape = jnp.shape(self.weight)
        if len(shape) < 2 or not jnp.issubdtype(jnp.result_type(self.weight), jnp.floating):
            got = f"an array of dtype {jnp.result_type(self.weight)} and shape {shape}"
            raise ValueError(_BAD_WEIGHT_MSG.format(function="Float8Weight", got=got))

    def aval(self) -> ShapedArray:
        shape = tuple(jnp.shape(self.weight))
        if self.transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return ShapedArray(shape, jnp.result_type(self.weight))

    def logical(self) -> Array:
        """The master weight as the array this stands for (swapped where
        `transposed`)."""
        return jnp.swapaxes(self.weight, -1, -2) if self.transposed else self.weight

    def materialise(self) -> Array:
        return self.logical()

    def logical_leaf_specs(self, spec: Any) -> "Float8Weight":
        """How the master weight follows a sharding of the array (see
        `quaxlike.leaf_specs`): axis by axis, read in stored order where the
        array is transposed.

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array (its `aval()`'s shape).

        **Returns:**

        This Value with a `PartitionSpec` in place of `weight`.
        """
        ndim = jnp.ndim(self.weight)
        entries = list(logical_entries(spec, ndim))
        axes = list(range(ndim))
        if self.transposed:
            axes[-2], axes[-1] = axes[-1], axes[-2]
        return with_leaf_specs(self, weight=follow_axes(entries, axes))

    def swapped(self) -> "Float8Weight":
        """A copy standing for the transpose of the last two axes."""
        return dataclasses.replace(self, transposed=not self.transposed)


def _as_float8(leaf: Any, scaling: str) -> Any:
    if isinstance(leaf, Float8Weight):
        return dataclasses.replace(leaf, scaling=scaling)
    # A LoRA's base trains in float8. `quaxlike.lora` imports this package (for
    # QLoRA), so it is looked up rather than imported: a LoRA weight exists only
    # once `quaxlike.lora` has been imported.
    lora = sys.modules.get("quaxlike.lora")
    if lora is not None and isinstance(leaf, lora.LowRankValue):
        return eqx.tree_at(lambda v: v.w, leaf, _as_float8(leaf.w, scaling))
    if isinstance(leaf, quaxlike.Value) or not eqx.is_inexact_array(leaf) or jnp.ndim(leaf) < 2:
        got = (
            f"a {type(leaf).__qualname__}"
            if isinstance(leaf, quaxlike.Value)
            else f"an array of dtype {jnp.result_type(leaf)} and shape {jnp.shape(leaf)}"
            if eqx.is_array_like(leaf)
            else repr(leaf)
        )
        raise ValueError(_BAD_WEIGHT_MSG.format(function="float8_training", got=got))
    return Float8Weight(leaf, scaling=scaling)


def float8_training(model: PyTree, *, scaling: str = "tensorwise", where: Any = None) -> PyTree:
    """Train the weights of `model` in float8: every selected weight becomes a
    `Float8Weight` over it, whose matrix products run on float8 operands with
    dynamic scales, forward and backward, as torchao's
    `convert_to_float8_training` does.

    The weights stay the high-precision master weights (`float32` or
    `bfloat16`): gradients and optimiser updates reach them as before
    (`eqx.filter_grad`, optax). Call the model with `quaxlike.quaxify(model)`.
    A LoRA weight (`loraify` before or after) gets its base `W` in float8 and
    its adapters in high precision, as PEFT's LoRA over torchao's
    `Float8Linear` computes them.

    **Arguments:**

    - `model`: any PyTree holding Equinox layers.
    - `scaling`: `"tensorwise"` (one scale per tensor; the gradient of the
        output in `float8_e5m2`) or `"rowwise"` (one scale per row along each
        product's contracted axes, rounded down to a power of 2; everything in
        `float8_e4m3fn`): torchao's two recipes of those names.
    - `where`: the weights to train in float8, any selection of
        `quaxlike.selection` (as `quantize` and `loraify` take it); by default
        every `eqx.nn.Linear` weight. torchao's `_auto_filter_for_recipe` leaves
        out layers too small to gain on an H100 (and dimensions not multiples of
        16, which its kernels need); select by shape with
        `module(eqx.nn.Linear, in_features=lambda n: n >= 4096)` and the like.

    **Returns:**

    The model with `Float8Weight`s in place of the selected weights.

    !!! example

        ```python
        mlp = eqx.nn.MLP(32, 16, 64, depth=2, key=jr.key(0))
        f8 = float8_training(mlp, scaling="rowwise")
        loss = lambda m, x: jnp.sum(quaxlike.quaxify(m)(x) ** 2)
        grads = eqx.filter_grad(loss)(f8, jnp.ones(32))  # float8 backward pass
        assert grads.layers[0].weight.weight.shape == (64, 32)
        ```
    """
    check_scaling(scaling, "float8_training")
    if where is None:
        try:
            where = default_where(model)
        except ValueError:
            raise ValueError(_NO_LINEAR_MSG.format(type_name=type(model).__qualname__)) from None
    return replace_selected(model, where, lambda w: _as_float8(w, scaling), "float8_training")


def _is_float8(x: Any) -> bool:
    return isinstance(x, Float8Weight)


def unwrap_float8(model: PyTree) -> PyTree:
    """`model` with every `Float8Weight` replaced by the array it stands for (its
    master weight): the high-precision model, for evaluation, forward-mode
    derivatives or saving.

    **Arguments:**

    - `model`: any PyTree, such as the output of `float8_training` (a LoRA's
        float8 base included).

    **Returns:**

    The same PyTree with plain arrays in place of the `Float8Weight`s.

    !!! example

        ```python
        mlp = eqx.nn.MLP(8, 2, 16, depth=1, key=jr.key(0))
        assert eqx.tree_equal(unwrap_float8(float8_training(mlp)), mlp)
        ```
    """
    return jtu.tree_map(lambda x: x.logical() if _is_float8(x) else x, model, is_leaf=_is_float8)
