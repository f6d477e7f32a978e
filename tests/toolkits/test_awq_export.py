"""AWQ's `InputScaled` (as `quantize(..., method="awq")` makes it; test_calibration.py
tests that) with the tools over models: logical sharding specs
(`quaxlike.leaf_specs`), and the checkpoint writers. compressed-tensors' format
(like AutoAWQ's and llm-compressor's) has no per-input-channel scale; those tools
fold `1 / s` into the operation before the layer, and so does
`save_compressed_tensors(..., fold=...)`, read back by our reader (tested
against the libraries' own files in test_checkpoints_golden.py) to the same
outputs. W8A8 weights are written with compressed-tensors' W8A8 activations."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn
from jax.sharding import PartitionSpec as P

import quaxlike
from quaxlike.checkpoints import load_safetensors, save_bnb_4bit, save_compressed_tensors
from quaxlike.lora import loraify
from quaxlike.quantized import (
    GroupedIntArray,
    InputScaled,
    quantize_int4,
    quantize_nf4,
    quantize_w8a8,
)


def input_scaled(transposed=False):
    s = jnp.linspace(0.5, 2.0, 64)
    q = InputScaled(quantize_int4(randn(0, (16, 64)) * s, group_size=32), s)
    return quaxlike.quaxify(lambda w: w.T)(q) if transposed else q


def test_leaf_specs_of_input_scaled():
    q = input_scaled()
    specs = quaxlike.leaf_specs(q, P("data", "model"))
    assert (specs.base.packed, specs.base.scale, specs.scale) == (
        P("data", "model"),
        P("data", "model"),
        P("model"),
    )
    rows = quaxlike.leaf_specs(q, P("data"))
    assert (rows.base.packed, rows.scale) == (P("data"), P())
    # Transposed `(in, out)`: the input axis comes first.
    t = input_scaled(transposed=True)
    assert isinstance(t, InputScaled) and t.transposed
    specs = quaxlike.leaf_specs(t, P("model", "data"))
    assert (specs.base.packed, specs.scale) == (P("data", "model"), P("model"))
    # QLoRA over it: the LoRA's base follows its own declaration.
    lora = loraify({"w": q}, rank=2, key=jr.key(0), where=lambda m: [m["w"]])["w"]
    specs = quaxlike.leaf_specs(lora, P(None, "model"))
    assert (specs.w.scale, specs.a, specs.b) == (P("model"), P(), P(None, "model"))


class NormThenLinear(eqx.Module):
    norm: eqx.nn.LayerNorm
    proj: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(jax.nn.relu(self.proj(self.norm(x))))


NAMES = {
    "norm.weight": "model.norm.weight",
    "norm.bias": "model.norm.bias",
    "proj.weight": "model.proj.weight",
    "proj.bias": "model.proj.bias",
    "head.weight": "model.head.weight",
    "head.bias": "model.head.bias",
}


def awq(w, seed):
    """`w` as `quantize(..., method="awq")` leaves it: an `InputScaled` over the
    4-bit `w diag(s)` (here with scales drawn at random, far from 1)."""
    s = jnp.exp(0.5 * randn(seed, (w.shape[-1],)))
    return InputScaled(quantize_int4(w * s, group_size=32), s)


@pytest.fixture(scope="module")
def awq_model():
    k1, k2, k3 = jr.split(jr.key(0), 3)
    model = NormThenLinear(
        eqx.nn.LayerNorm(64), eqx.nn.Linear(64, 32, key=k2), eqx.nn.Linear(32, 16, key=k3)
    )
    # A norm whose scale and shift are not the identity.
    model = eqx.tree_at(
        lambda m: (m.norm.weight, m.norm.bias),
        model,
        (1.0 + 0.3 * randn(1, (64,)), 0.1 * randn(2, (64,))),
    )
    q = eqx.tree_at(
        lambda m: (m.proj.weight, m.head.weight),
        model,
        (awq(model.proj.weight, 3), awq(model.head.weight, 4)),
    )
    return model, q, randn(5, (8, 64))


def test_awq_model_written_with_its_scales_folded(tmp_path, awq_model):
    model, q, x = awq_model
    file = os.path.join(tmp_path, "model.safetensors")
    fold = {
        "proj.weight": ["norm.weight", "norm.bias"],
        "head.weight": ["proj.weight", "proj.bias"],
    }
    config = save_compressed_tensors(q, file, NAMES, fold=fold)
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    back = load_safetensors(model, tmp_path, NAMES)
    assert isinstance(back.proj.weight, GroupedIntArray)
    # The checkpoint's model computes what the AWQ model does: the head's `1 / s`
    # in the rows of `proj` (through the relu, positively homogeneous), `proj`'s
    # in the norm.
    run = eqx.filter_jit(lambda m, x: jax.vmap(quaxlike.quaxify(m))(x))
    np.testing.assert_allclose(run(back, x), run(q, x), rtol=1e-5, atol=1e-5)
    s1, s2 = q.proj.weight.scale, q.head.weight.scale
    np.testing.assert_allclose(back.norm.weight, model.norm.weight / s1, rtol=1e-6)
    np.testing.assert_allclose(back.norm.bias, model.norm.bias / s1, rtol=1e-6)
    np.testing.assert_allclose(
        back.proj.weight.dequantize(), q.proj.weight.base.dequantize() / s2[:, None], rtol=1e-6
    )
    np.testing.assert_array_equal(back.head.weight.dequantize(), q.head.weight.base.dequantize())


def test_awq_refusals_say_how_to_save(tmp_path, awq_model):
    _, q, _ = awq_model
    file = os.path.join(tmp_path, "model.safetensors")
    with pytest.raises(ValueError, match="InputScaled.*no place for `s`.*fold=.*dequantize"):
        save_compressed_tensors(q, file, NAMES)
    with pytest.raises(ValueError, match="scales differ"):
        save_compressed_tensors(
            q, file, NAMES, fold={"proj.weight": "norm.weight", "head.weight": "norm.weight"}
        )
    with pytest.raises(ValueError, match="does not write"):
        names = {k: v for k, v in NAMES.items() if k != "norm.bias"}
        save_compressed_tensors(
            q, file, names, fold={"proj.weight": ["norm.bias"], "head.weight": "proj.bias"}
        )
    with pytest.raises(ValueError, match="axis 0 does not have that size"):
        save_compressed_tensors(
            q, file, NAMES, fold={"proj.weight": "head.bias", "head.weight": "proj.bias"}
        )
    nf4 = {"w": InputScaled(quantize_nf4(randn(4, (16, 64))), jnp.ones(64))}
    with pytest.raises(ValueError, match="InputScaled.*bitsandbytes' 4-bit layout"):
        save_bnb_4bit(nf4, file, {"w": "proj.weight"})


def test_w8a8_written_with_its_activations(tmp_path):
    model = {"w": quantize_w8a8(randn(5, (16, 64))), "b": jnp.zeros(16)}
    names = {"w": "proj.weight", "b": "proj.bias"}
    config = save_compressed_tensors(model, os.path.join(tmp_path, "model.safetensors"), names)
    group = config["config_groups"]["group_0"]
    assert group["weights"]["num_bits"] == 8 and group["weights"]["strategy"] == "channel"
    assert group["input_activations"] == {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "token",
        "dynamic": True,
    }
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["quantization_config"] == config
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in model.items()}
    back = load_safetensors(shapes, tmp_path, names)  # the weights, read as weight-only
    np.testing.assert_array_equal(back["w"].dequantize(), model["w"].dequantize())
