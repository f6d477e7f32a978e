"""Same key, same start as Quax: `loraify` and `LoraArray` draw the `A` and `B` that
Quax 0.4.6's `quax.examples.lora` draws for the same key and model.

Quax's scheme, followed here with plain `jax.random` calls (not by importing quax):
`loraify` walks the model's `eqx.nn.Linear`s in tree order, does
`key, subkey = jr.split(key)` for each, and builds `LoraArray(linear.weight,
key=subkey)`; `LoraArray(weight, rank=r, scale=s, key=k)` with `weight` of shape
`(*batch, m, n)` sets `A = jr.normal(k, (*batch, m, r), dtype=weight.dtype) * s`
and `B = jnp.zeros((*batch, r, n), weight.dtype)`. Comparisons are bit for bit.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

from quaxlike.lora import adapted_paths, LoraArray, LoraConvKernel, loraify


def is_linear(x):
    return isinstance(x, eqx.nn.Linear)


def is_lora(x):
    return isinstance(x, (LoraArray, LoraConvKernel))


def quax_factors(model, *, rank, key, scale=0.01):
    """(A, B) for every Linear of `model`, in tree order, as Quax 0.4.6 draws them."""
    factors = []
    for linear in (x for x in jtu.tree_leaves(model, is_leaf=is_linear) if is_linear(x)):
        key, subkey = jr.split(key)
        *batch, m, n = linear.weight.shape
        dtype = linear.weight.dtype
        a = jr.normal(subkey, (*batch, m, rank), dtype=dtype) * scale
        factors.append((a, jnp.zeros((*batch, rank, n), dtype=dtype)))
    return factors, key


def identical(x, y):
    x, y = np.asarray(x), np.asarray(y)
    return x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()


def with_arrays(build, dtype=np.float32):
    """The model `build(key)` returns, with NumPy-filled arrays of `dtype` (only
    shapes and dtypes matter here; initialising would compile a program per shape)."""
    shapes = eqx.filter_eval_shape(build, jr.key(0))
    rng = np.random.default_rng(0)
    return jtu.tree_map(
        lambda s: (
            jax.device_put(rng.standard_normal(s.shape).astype(dtype))
            if isinstance(s, jax.ShapeDtypeStruct)
            else s
        ),
        shapes,
    )


class Block(eqx.Module):
    """A transformer block: attention (four Linears) and a two-layer MLP."""

    attention: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.attention = eqx.nn.MultiheadAttention(2, 8, key=k1)
        self.norm = eqx.nn.LayerNorm(8)
        self.mlp = eqx.nn.MLP(8, 8, 8, depth=1, key=k2)


MODELS = {
    "mlp": lambda k: eqx.nn.MLP(5, 3, 8, depth=2, key=k),
    "transformer_block": Block,
    "stacked_linears": lambda k: eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 8, key=k))(
        jr.split(k, 3)
    ),
}


@pytest.mark.parametrize(
    "name, dtype",
    [("mlp", np.float32), ("transformer_block", jnp.bfloat16), ("stacked_linears", np.float32)],
)
def test_loraify_draws_as_quax(name, dtype):
    model = with_arrays(MODELS[name], dtype)
    key = jr.key(42)
    lora = loraify(model, rank=2, key=key)
    expected, _ = quax_factors(model, rank=2, key=key)
    got = [(x.a, x.b) for x in jtu.tree_leaves(lora, is_leaf=is_lora) if is_lora(x)]
    assert len(got) == len(expected) > 0
    for (a, b), (a_quax, b_quax) in zip(got, expected):
        assert identical(a, a_quax) and identical(b, b_quax)


def test_loraify_draws_as_quax_with_a_raw_key_and_scale():
    # Quax's examples use `jr.PRNGKey`; and a scale other than the default.
    model = with_arrays(MODELS["mlp"])
    key = jr.PRNGKey(7)
    lora = loraify(model, rank=2, key=key, scale=0.3)
    expected, _ = quax_factors(model, rank=2, key=key, scale=0.3)
    for layer, (a_quax, b_quax) in zip(lora.layers, expected):
        assert identical(layer.weight.a, a_quax) and identical(layer.weight.b, b_quax)


def test_convolutions_continue_the_chain():
    # Linear weights take Quax's keys whatever else is adapted; the convolution
    # kernels continue the chain in tree order.
    def build(key):
        k1, k2, k3 = jr.split(key, 3)
        return {
            "conv": eqx.nn.Conv2d(3, 8, 3, key=k1),
            "head": eqx.nn.Linear(4, 8, key=k2),
            "up": eqx.nn.ConvTranspose1d(4, 8, 3, key=k3),
        }

    model = with_arrays(build)
    key = jr.key(3)
    lora = loraify(model, rank=2, key=key)
    assert adapted_paths(lora) == ["conv.weight", "head.weight", "up.weight"]
    [(a_head, _)], key = quax_factors(model, rank=2, key=key)
    assert identical(lora["head"].weight.a, a_head)
    for name in ("conv", "up"):
        key, subkey = jr.split(key)
        out_channels = model[name].weight.shape[0]
        assert identical(lora[name].weight.a, jr.normal(subkey, (out_channels, 2)) * 0.01)
        assert identical(lora[name].weight.b, jnp.zeros((2, *model[name].weight.shape[1:])))


def test_where_selected_weights_follow_the_chain_in_tree_order():
    params = with_arrays(lambda k: {"q": jr.normal(k, (8, 4)), "v": jr.normal(k, (8, 4))})
    key = jr.key(5)
    lora = loraify(params, rank=2, key=key, where=["q", "v"])
    for name in ("q", "v"):
        key, subkey = jr.split(key)
        assert identical(lora[name].a, jr.normal(subkey, (8, 2)) * 0.01)


def test_split_key_scheme():
    model = with_arrays(MODELS["mlp"])
    key = jr.key(1)
    lora = loraify(model, rank=2, key=key, key_scheme="split")
    for layer, subkey in zip(lora.layers, jr.split(key, 3)):
        rows = layer.weight.w.shape[0]
        assert identical(layer.weight.a, jr.normal(subkey, (rows, 2)) * 0.01)
    # (A TypeError when jaxtyping's import hook checks the `Literal` annotation.)
    with pytest.raises((ValueError, TypeError), match="key_scheme"):
        loraify(model, rank=2, key=key, key_scheme="fold_in")


def test_lora_conv_kernel_draw():
    # For a kernel, A is drawn as Quax draws it for an (out, rank) matrix.
    w = jnp.zeros((8, 3, 2, 2))
    kernel = LoraConvKernel(w, rank=2, key=jr.key(9))
    assert identical(kernel.a, jr.normal(jr.key(9), (8, 2)) * 0.01)


def test_lora_array_draws_as_quax():
    w = jnp.zeros((8, 5))
    lora = LoraArray(w, rank=2, key=jr.key(11))
    assert identical(lora.a, jr.normal(jr.key(11), (8, 2)) * 0.01)
    assert identical(lora.b, jnp.zeros((2, 5)))
