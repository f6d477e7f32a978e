"""Working with whole models: `loraify`, `trainable_filter`, `partition`, `merge`."""

from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jaxtyping import PRNGKeyArray, PyTree

import quaxlike

from ..selection import dotted_path, selected as selected_leaves
from ._base import LowRankValue
from ._conv import LoraConvKernel
from ._dora import DoraArray, row_norms
from ._dora_conv import channel_norms_squared, DoraConvKernel
from ._value import LoraArray


_NO_MATCH_MSG = (
    "`loraify(..., where={where!r})` selected no leaf of the model, so nothing would "
    "be adapted. Patterns are matched against dotted paths built from attribute "
    "names, sequence indices and dict keys; `*` stands for one component and `**` "
    "for any number of them. Check a selection with "
    "`quaxlike.selection.select(model, where)`. Some paths in this model: "
    "{paths}."
)
_NOT_A_MATRIX_MSG = (
    "`loraify(..., where={where!r})` selected the leaf `{path}`, which is {what}; "
    "only floating-point arrays with at least two dimensions `(*batch, m, n)` can "
    "get a low-rank update. Make the pattern or predicate more specific (for "
    "example end it with `.weight`)."
)
_NO_LINEAR_MSG = (
    "`loraify(model, ...)` found no `eqx.nn.Linear`, `eqx.nn.Conv` or "
    "`eqx.nn.ConvTranspose` in the model, so nothing would be adapted. To adapt other "
    "weights (attention projections or embedding tables stored as arrays, ...), select "
    "them with `where=`: a dotted path pattern such as 'blocks.*.proj', or a predicate "
    "`(path, leaf) -> bool`."
)
_STACKED_CONV_MSG = (
    "`loraify` selected `{path}`, the kernel of an `eqx.nn.{kind}` with "
    "{spatial} spatial dimension(s) but of shape {shape}: a stack of kernels, as "
    "`eqx.filter_vmap` builds. LoraConvKernel has no batch axes, so stacked "
    "convolutions cannot be adapted yet. Leave them out with `where=`, or build the "
    "layers one by one."
)
_DORA_KERNEL_MSG = (
    "`loraify(..., dora=True)` selected `{path}`, a kernel stored `(in, out)` (Flax's "
    "`kernel`, used as `x @ kernel`): DoRA's norm is per output row of a weight stored "
    "`(out, in)`, so over this leaf's last axis it would be taken per input instead. "
    "Adapt an `(out, in)` weight (an `eqx.nn.Linear`'s), or store the kernel transposed."
)
_MAGNITUDE_FROM_MSG = (
    "`loraify(..., magnitude_from=...)` has no weight at `{path}` (or one of another "
    "shape: {what}); it must be a tree like the model with the unquantised weight "
    "at every adapted path (the model before `quantize`, say)."
)
_BAD_KEY_SCHEME_MSG = (
    "`loraify(..., key_scheme=...)` takes 'quax' (Quax's chain of splits, the default) "
    "or 'split' (one `jr.split(key, n)` over the adapted weights in tree order); got "
    "{got!r}."
)


def _is_lora(x: Any) -> bool:
    return isinstance(x, LowRankValue)


def _is_value(x: Any) -> bool:
    # Values are selected whole, as one weight: the codes and scales of a
    # quantised weight, say, are not weights of their own.
    return isinstance(x, quaxlike.Value)


_CONVOLUTIONS = (eqx.nn.Conv, eqx.nn.ConvTranspose)


def _layer_weights(model: PyTree) -> dict[str, Any]:
    """The dotted path of the `weight` of every `eqx.nn.Linear`, `eqx.nn.Conv` and
    `eqx.nn.ConvTranspose` in `model`, with the layer it belongs to."""
    is_layer = lambda x: isinstance(x, (eqx.nn.Linear, *_CONVOLUTIONS))  # noqa: E731
    found = jtu.tree_flatten_with_path(model, is_leaf=is_layer)[0]
    return {
        dotted_path((*path, jtu.GetAttrKey("weight"))): layer
        for path, layer in found
        if is_layer(layer)
    }


def _is_matrix(leaf: Any) -> bool:
    if isinstance(leaf, quaxlike.ArrayValue):  # a quantised weight, say
        return leaf.ndim >= 2 and bool(jnp.issubdtype(leaf.dtype, jnp.inexact))
    if not eqx.is_inexact_array(leaf):
        return False
    return leaf.ndim >= 2


def loraify(
    model: PyTree,
    *,
    rank: int,
    key: PRNGKeyArray,
    where: Any = None,
    scale: float = 0.01,
    allow_materialise: bool = False,
    stop_gradient: bool = True,
    key_scheme: Literal["quax", "split"] = "quax",
    dora: bool = False,
    magnitude_from: PyTree | None = None,
) -> PyTree:
    """Replace weights in `model` by `LoraArray`s (and convolution kernels by
    `LoraConvKernel`s), or with `dora=True` by `DoraArray`s.

    By default the weight of every `eqx.nn.Linear` is replaced (in a transformer:
    the attention projections of `eqx.nn.MultiheadAttention`, the feed-forward
    layers and the output head; including the stacked weights of Linears built
    with `eqx.filter_vmap`, which become `LoraArray`s with batch dimensions), and
    so is the kernel of every `eqx.nn.Conv` and `eqx.nn.ConvTranspose` (1-, 2- or
    3-D). Embedding tables, norms and biases are left alone. `where` selects other
    leaves instead, by the dotted path of each leaf: attribute names, sequence
    indices and dict keys joined by `.`, such as `layers.0.weight` in an
    `eqx.nn.MLP`. Leaves that are already LoRA are left alone. A Value (a
    quantised weight from `quaxlike.quantized.quantize`, say) is one
    leaf, selected whole: the result is a LoRA over it (QLoRA; see also
    `qlora`). `adapted_paths(model)` lists what was replaced.

    A kernel of an `eqx.nn.Conv` or `eqx.nn.ConvTranspose` becomes a
    `LoraConvKernel` (output channels along axis 0); any other selected leaf, a
    `LoraArray`.

    The keys follow Quax: `key, subkey = jr.split(key)` once per replaced weight,
    `A` drawn from `subkey`. `eqx.nn.Linear` weights come first, in tree order, so
    each gets the `A` that `quax.examples.lora.loraify` draws for it from the same
    key; the other replaced weights continue the chain in tree order.

    **Arguments:**

    - `model`: any PyTree, usually an Equinox model.
    - `rank`, `scale`, `allow_materialise`, `stop_gradient`: as for `LoraArray`.
    - `key`: a PRNG key, from which every replaced weight's key is derived.
    - `key_scheme`: `"quax"` (the default): the chain above. `"split"`:
        `jr.split(key, n)` over the replaced weights in tree order, as quaxlike did
        before it matched Quax.
    - `dora`: make DoRA weights (`DoraArray`: a trainable magnitude per output
        row times the row-normalised `W + A @ B`), PEFT's `use_dora=True`. The
        magnitude starts at the row norms of `W` (dequantised, for a quantised
        base, as PEFT does). The kernel of an `eqx.nn.Conv` or
        `eqx.nn.ConvTranspose` becomes a `DoraConvKernel` (a magnitude per output
        channel, the norm over every other axis: PEFT's DoRA `Conv1d/2d/3d`).
    - `magnitude_from`: with `dora=True`, a tree like `model` (the model before
        `quantize`, say) whose weights at the adapted paths give the initial
        magnitudes instead: Answer.AI's QDoRA takes them from the weight before
        quantisation.
    - `where`: which leaves to replace. `None`: the weight of every
        `eqx.nn.Linear`, `eqx.nn.Conv` and `eqx.nn.ConvTranspose`. Otherwise any
        selection of `quaxlike.selection` (check one with
        `select(model, where)`):
        - a pattern string, matched against dotted paths, where `*` matches one
          component (or part of one, as in `lin*`), and `**` matches any number
          of components: `"layers.*.weight"`, `"**.weight"`, or a layer's path
          (`"layers.0"`, for its weight);
        - a module type (`eqx.nn.Linear`, `flax.nnx.Linear`), or
          `module(eqx.nn.Linear, out_features=10)` with attribute tests;
        - a predicate `where(path: str, leaf) -> bool` on the dotted path and
          the leaf, or a getter `model -> leaves` as for `eqx.tree_at`;
        - a list of these (a leaf matching any is selected), or a combination
          with `|`, `&`, `~` and `.within(...)`.

    **Returns:**

    The model with LoRA weights. Call it as `quaxlike.quaxify(model)(x)`.

    **Raises:**

    `ValueError` if `where` selects nothing (or, without `where`, the model has no
    `eqx.nn.Linear`, `eqx.nn.Conv` or `eqx.nn.ConvTranspose`), or selects a leaf that
    is not a floating-point array with at least two dimensions, or the kernel of a
    stack of convolutions.

    !!! example

        ```python
        mlp = eqx.nn.MLP(16, 4, 64, depth=2, key=jr.key(0))
        model = loraify(mlp, rank=4, key=jr.key(1))  # every Linear weight
        first = loraify(mlp, rank=4, key=jr.key(1), where="layers.0.weight")
        y = quaxlike.quaxify(model)(jnp.ones(16))
        ```
    """
    if key_scheme not in ("quax", "split"):
        raise ValueError(_BAD_KEY_SCHEME_MSG.format(got=key_scheme))
    leaves_with_paths, treedef = jtu.tree_flatten_with_path(model, is_leaf=_is_value)
    paths = [dotted_path(path) for path, _ in leaves_with_paths]
    leaves = [leaf for _, leaf in leaves_with_paths]
    layers = _layer_weights(model)
    if where is None:
        if not layers:
            raise ValueError(_NO_LINEAR_MSG)
        chosen = [p in layers and not _is_lora(leaf) for p, leaf in zip(paths, leaves)]
    else:
        picked = set(selected_leaves(model, where, "loraify"))
        chosen = [i in picked and not _is_lora(leaf) for i, leaf in enumerate(leaves)]
        if not any(chosen):
            shown = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
            raise ValueError(_NO_MATCH_MSG.format(where=where, paths=shown or "(none)"))
        for path, leaf, selected in zip(paths, leaves, chosen):
            if selected and not _is_matrix(leaf):
                what = (
                    f"an array of dtype {leaf.dtype} and shape {tuple(leaf.shape)}"
                    if eqx.is_array(leaf)
                    else f"a {type(leaf).__qualname__}"
                )
                raise ValueError(_NOT_A_MATRIX_MSG.format(where=where, path=path, what=what))
    if not any(chosen):
        return model  # every layer weight is LoRA already
    selected = [i for i, c in enumerate(chosen) if c]
    keys = _weight_keys(
        key,
        selected,
        [isinstance(layers.get(paths[i]), eqx.nn.Linear) for i in selected],
        key_scheme,
    )
    magnitudes = _magnitude_source(magnitude_from) if dora else None
    new_leaves = list(leaves)
    for i in selected:
        new_leaves[i] = _adapted(
            leaves[i],
            paths[i],
            layers.get(paths[i]),
            keys[i],
            rank=rank,
            scale=scale,
            allow_materialise=allow_materialise,
            stop_gradient=stop_gradient,
            dora=dora,
            magnitudes=magnitudes,
        )
    return jtu.tree_unflatten(treedef, new_leaves)


def _magnitude_source(tree: PyTree | None) -> dict[str, Any] | None:
    """`{dotted path: leaf}` of `magnitude_from`, or None."""
    if tree is None:
        return None
    found = jtu.tree_flatten_with_path(tree, is_leaf=_is_value)[0]
    return {dotted_path(path): leaf for path, leaf in found}


def _weight_keys(key, selected: list[int], is_linear: list[bool], scheme: str) -> dict[int, Any]:
    """A key for each selected leaf: Quax's chain (Linear weights first) or one split."""
    if scheme == "split":
        return dict(zip(selected, jr.split(key, len(selected))))
    order = [i for i, linear in zip(selected, is_linear) if linear]
    order += [i for i, linear in zip(selected, is_linear) if not linear]
    keys = {}
    for i in order:
        # As quax.examples.lora.loraify does for each Linear, in tree order.
        key, keys[i] = jr.split(key)
    return keys


def _adapted(
    leaf,
    path: str,
    layer: Any,
    key,
    *,
    rank,
    scale,
    allow_materialise,
    stop_gradient,
    dora=False,
    magnitudes=None,
):
    """`leaf` as a LoraConvKernel (the kernel of a convolution), a LoraArray or a
    DoraArray, with `A = scale * jr.normal(key, ...)` drawn exactly as Quax draws it."""
    flags = dict(allow_materialise=allow_materialise, stop_gradient=stop_gradient)
    if dora and path.rsplit(".", 1)[-1] in ("kernel", "value") and "kernel" in path:
        raise ValueError(_DORA_KERNEL_MSG.format(path=path))
    conv = isinstance(layer, _CONVOLUTIONS)
    if conv and leaf.ndim != layer.num_spatial_dims + 2:
        raise ValueError(
            _STACKED_CONV_MSG.format(
                path=path,
                kind=type(layer).__name__,
                spatial=layer.num_spatial_dims,
                shape=tuple(leaf.shape),
            )
        )
    if dora:
        magnitude = None
        if magnitudes is not None:
            source = magnitudes.get(path)
            if source is None or tuple(getattr(source, "shape", ())) != tuple(leaf.shape):
                what = "none" if source is None else f"shape {tuple(source.shape)}"
                raise ValueError(_MAGNITUDE_FROM_MSG.format(path=path, what=what))
            magnitude = (
                jnp.sqrt(channel_norms_squared(source, 0)).astype(leaf.dtype)
                if conv
                else row_norms(source)
            )
        if conv:
            return DoraConvKernel(
                leaf, rank=rank, scale=scale, key=key, out_axis=0, magnitude=magnitude, **flags
            )
        return DoraArray(leaf, rank=rank, scale=scale, key=key, magnitude=magnitude, **flags)
    if conv:
        return LoraConvKernel(leaf, rank=rank, scale=scale, key=key, out_axis=0, **flags)
    return LoraArray(leaf, rank=rank, scale=scale, key=key, **flags)


def adapted_paths(model: PyTree) -> list[str]:
    """The dotted paths of the LoRA weights in `model`: what `loraify` replaced.

    **Arguments:**

    - `model`: any PyTree.

    **Returns:**

    The dotted path (as `loraify`'s `where` patterns spell it) of every
    `LoraArray` and `LoraConvKernel` in `model`, in tree order.

    !!! example

        ```python
        mlp = eqx.nn.MLP(3, 2, 8, depth=1, key=jr.key(0))
        model = loraify(mlp, rank=2, key=jr.key(1))
        assert adapted_paths(model) == ["layers.0.weight", "layers.1.weight"]
        ```
    """
    found = jtu.tree_flatten_with_path(model, is_leaf=_is_lora)[0]
    return [dotted_path(path) for path, leaf in found if _is_lora(leaf)]


def trainable_filter(model: PyTree) -> PyTree[bool]:
    """A filter spec selecting only the LoRA factors `a` and `b` of `model` (and
    the magnitude `m` of a `DoraArray`, which trains with them).

    **Arguments:**

    - `model`: a PyTree holding `LoraArray`s (the output of `loraify`).

    **Returns:**

    A PyTree of bools with the structure of `model`, for
    `eqx.partition(model, trainable_filter(model))`: `True` at the `a` and `b` of
    every `LoraArray`, `False` everywhere else (frozen weights, biases, ...).

    !!! example

        ```python
        model = loraify(eqx.nn.Linear(3, 2, key=jr.key(0)), rank=1, key=jr.key(1))
        spec = trainable_filter(model)
        assert spec.weight.a and spec.weight.b
        assert not spec.weight.w and not spec.bias
        ```
    """

    def mark(x):
        if isinstance(x, (DoraArray, DoraConvKernel)):
            spec = jtu.tree_map(lambda _: False, x)
            return eqx.tree_at(lambda s: (s.a, s.b, s.m), spec, (True, True, True))
        if _is_lora(x):
            spec = jtu.tree_map(lambda _: False, x)
            return eqx.tree_at(lambda s: (s.a, s.b), spec, (True, True))
        return False

    return jtu.tree_map(mark, model, is_leaf=_is_lora)


def partition(model: PyTree) -> tuple[PyTree, PyTree]:
    """Split a LoRA model into its trainable factors and the frozen rest.

    **Arguments:**

    - `model`: a PyTree holding `LoraArray`s (the output of `loraify`).

    **Returns:**

    A pair `(trainable, frozen)` as from `eqx.partition`: `trainable` holds the
    `a` and `b` of every `LoraArray` (with `None` elsewhere), `frozen` holds
    everything else. `eqx.combine(trainable, frozen)` gives `model` back.

    !!! example

        ```python
        import optax

        model = loraify(eqx.nn.MLP(3, 2, 8, depth=1, key=jr.key(0)), rank=2, key=jr.key(1))
        x, y = jnp.ones(3), jnp.zeros(2)
        optimiser = optax.sgd(1e-2)
        trainable, frozen = partition(model)
        opt_state = optimiser.init(trainable)

        @eqx.filter_jit
        def step(trainable, opt_state, x, y):
            def loss(trainable):
                out = quaxlike.quaxify(eqx.combine(trainable, frozen))(x)
                return jnp.mean((out - y) ** 2)

            grads = eqx.filter_grad(loss)(trainable)
            updates, opt_state = optimiser.update(grads, opt_state, trainable)
            return eqx.apply_updates(trainable, updates), opt_state

        trainable, opt_state = step(trainable, opt_state, x, y)
        model = eqx.combine(trainable, frozen)
        ```
    """
    return eqx.partition(model, trainable_filter(model))


def merge(model: PyTree) -> PyTree:
    """Bake every `LoraArray` (and `LoraConvKernel`) in `model` into a dense weight
    `W + A @ B`, and every `DoraArray` into `(m / ‖W + A @ B‖) ⊙ (W + A @ B)`.

    **Arguments:**

    - `model`: a PyTree holding `LoraArray`s.

    **Returns:**

    The same PyTree with each `LoraArray` replaced by the ordinary array it stands
    for, so the model runs without `quaxify` and at the cost of the original. No
    `stop_gradient` is applied to `W` here: the merged weight is an ordinary array.

    !!! example

        ```python
        mlp = eqx.nn.MLP(3, 2, 8, depth=1, key=jr.key(0))
        model = loraify(mlp, rank=2, key=jr.key(1))
        dense = merge(model)  # an ordinary eqx.nn.MLP again
        x = jnp.ones(3)
        assert jnp.allclose(dense(x), quaxlike.quaxify(model)(x))
        ```
    """
    return jtu.tree_map(_merged, model, is_leaf=_is_lora)


def _merged(x: Any) -> Any:
    return x.merged() if isinstance(x, LowRankValue) else x
