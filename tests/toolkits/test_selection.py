"""One selection language for `loraify`, `quantize`, `qlora` and the adapters:
`quaxlike.selection.select` lists what a `where` picks, and each adapter
changes exactly those leaves."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import pytest
from flax import nnx

import quaxlike
from quaxlike.lora import adapted_paths, LoraArray, loraify, qlora
from quaxlike.quantized import dequantize, Int4Array, Int8Array, quantize
from quaxlike.selection import module, path, predicate, select


class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.attn = eqx.nn.MultiheadAttention(2, 16, key=k1)
        self.mlp = eqx.nn.MLP(16, 16, 32, depth=1, key=k2)


@pytest.fixture(scope="module")
def blocks():
    return [Block(jr.key(i)) for i in range(2)]


PROJ = ["query_proj", "key_proj", "value_proj", "output_proj"]


def test_patterns_types_and_attributes(blocks):
    linears = select(blocks, eqx.nn.Linear)
    assert linears == [
        f"{i}.{part}.weight"
        for i in range(2)
        for part in [f"attn.{p}" for p in PROJ] + ["mlp.layers.0", "mlp.layers.1"]
    ]
    # A pattern may name leaves or layers (whose weight is taken).
    assert select(blocks, "*.attn.*_proj.weight") == select(blocks, "*.attn.*_proj")
    assert select(blocks, "**.query_proj") == [
        "0.attn.query_proj.weight",
        "1.attn.query_proj.weight",
    ]
    # Attribute tests: out_features=32 is the MLP's hidden layer only.
    assert select(blocks, module(eqx.nn.Linear, out_features=32)) == [
        "0.mlp.layers.0.weight",
        "1.mlp.layers.0.weight",
    ]
    big = module(eqx.nn.Linear, in_features=lambda n: n > 16)
    assert select(blocks, big) == ["0.mlp.layers.1.weight", "1.mlp.layers.1.weight"]
    # Combinations: within a module, intersections, complements, unions.
    in_attn = module(eqx.nn.Linear).within(eqx.nn.MultiheadAttention)
    assert select(blocks, in_attn) == [s for s in linears if ".attn." in s]
    assert select(blocks, in_attn & path("1.**")) == [f"1.attn.{p}.weight" for p in PROJ]
    assert select(blocks, module(eqx.nn.Linear) & ~in_attn) == [s for s in linears if ".mlp." in s]
    assert select(blocks, ["0.attn.query_proj", "1.mlp.layers.1"]) == [
        "0.attn.query_proj.weight",
        "1.mlp.layers.1.weight",
    ]
    assert select(blocks, module(eqx.nn.Linear, out_features=32) | "0.attn.key_proj") == [
        "0.attn.key_proj.weight",
        "0.mlp.layers.0.weight",
        "1.mlp.layers.0.weight",
    ]
    # Predicates on (path, leaf) and getters as for eqx.tree_at.
    square = predicate(lambda p, leaf: getattr(leaf, "shape", None) == (16, 16))
    assert select(blocks, square) == [s for s in linears if ".attn." in s]
    assert select(blocks, lambda p, leaf: p.endswith("layers.1.bias")) == [
        "0.mlp.layers.1.bias",
        "1.mlp.layers.1.bias",
    ]
    assert select(blocks, lambda m: [m[1].attn.value_proj.weight, m[0].mlp.layers[0]]) == [
        "0.mlp.layers.0.weight",
        "1.attn.value_proj.weight",
    ]
    assert select(blocks, "nothing.here") == []


def test_every_adapter_takes_the_same_selection(blocks):
    where = module(eqx.nn.Linear).within(eqx.nn.MultiheadAttention) & path("0.**")
    expected = select(blocks, where)
    lora = loraify(blocks, rank=2, key=jr.key(1), where=where)
    assert adapted_paths(lora) == expected
    quantised = quantize(blocks, bits=8, where=where)
    is_q = lambda x: isinstance(x, Int8Array)  # noqa: E731
    found = jtu.tree_flatten_with_path(quantised, is_leaf=is_q)[0]
    assert [jtu.keystr(p, simple=True, separator=".") for p, x in found if is_q(x)] == expected
    both = qlora(blocks, rank=2, key=jr.key(1), bits=4, group_size=16, where=where)
    assert adapted_paths(both) == expected
    assert isinstance(both[0].attn.query_proj.weight.w, Int4Array)
    assert not isinstance(both[1].attn.query_proj.weight, LoraArray)


def test_quantize_takes_patterns_and_old_getters():
    # The failure of issue 27: a list of patterns used to be called as a function.
    att = eqx.nn.MultiheadAttention(2, 8, key=jr.key(0))
    q = quantize(att, bits=8, where=["query_proj.weight"])
    assert isinstance(q.query_proj.weight, Int8Array)
    assert not isinstance(q.key_proj.weight, Int8Array)
    # The getter form is unchanged: one array, or a list or tuple of them.
    old = quantize(att, bits=8, where=lambda m: m.query_proj.weight)
    assert jtu.tree_structure(old) == jtu.tree_structure(q)
    pair = quantize(att, bits=8, where=lambda m: (m.query_proj.weight, m.key_proj.weight))
    assert isinstance(pair.key_proj.weight, Int8Array)
    x = jr.normal(jr.key(1), (3, 8))
    out = quaxlike.quaxify(q)(x, x, x)
    assert jnp.allclose(out, dequantize(q)(x, x, x), atol=1e-5)
    with pytest.raises(ValueError, match="selected no weight.*select"):
        quantize(att, bits=8, where="nothing")
    with pytest.raises(TypeError, match="predicate.*getter"):
        quantize(att, bits=8, where=3)
    with pytest.raises(TypeError, match="not a leaf of the model"):
        quantize(att, bits=8, where=lambda m: 3)


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def test_flax_nnx_modules():
    model = NNXModel(nnx.Rngs(0))
    assert select(model, nnx.Linear) == ["hidden.kernel.value", "out.kernel.value"]
    assert select(model, module(nnx.Linear, out_features=10)) == ["out.kernel.value"]
    assert select(model, "hidden") == ["hidden.kernel.value"]
    lora = loraify(model, rank=2, key=jr.key(1), where=module(nnx.Linear, out_features=10))
    assert isinstance(lora.out.kernel.get_value(), LoraArray)
    assert not isinstance(lora.hidden.kernel.get_value(), LoraArray)
    x = jnp.ones((3, 8))
    assert jnp.allclose(jax.jit(quaxlike.quaxify(lambda m, x: m(x)))(lora, x), model(x), atol=1e-6)
    quantised = quantize(model, bits=8, where=nnx.Linear)
    assert isinstance(quantised.hidden.kernel.get_value(), Int8Array)


def test_layer_predicates_and_other_attributes(blocks):
    # A predicate given to `module` is asked of layers (never of arrays).
    wide = module(lambda layer: getattr(layer, "out_features", 0) == 32)
    assert select(blocks, wide) == ["0.mlp.layers.0.weight", "1.mlp.layers.0.weight"]
    assert select(blocks[0].mlp, module(eqx.nn.Linear, attr="bias")) == [
        "layers.0.bias",
        "layers.1.bias",
    ]
    # Unions of types, and selections that pick nothing.
    assert select(blocks, eqx.nn.Linear | eqx.nn.Conv) == select(blocks, eqx.nn.Linear)
    assert select(blocks, module(eqx.nn.Conv)) == []
    with pytest.raises(TypeError, match=r"select\(\.\.\., where=\.\.\.\)"):
        select(blocks, 3)
    with pytest.raises(TypeError, match="pattern strings"):
        path()
