"""`quaxlike.checkpoints.load_safetensors` on the 4-bit layouts of PyTorch's
libraries: bitsandbytes (NF4/FP4, nested or not), GPTQ (v1/v2, 4/8 bits,
act-order), AWQ GEMM and compressed-tensors `pack-quantized`, each packed here
from its description (`checkpoint_layouts.py`) and read to exactly the weight it
stands for, as a Value, never a dense array; and the errors for layouts that
are not read or do not fit."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from checkpoint_layouts import awq, bnb, compressed, gptq
from safetensors.numpy import save_file

import quaxlike
import quaxlike.lora
from quaxlike.checkpoints import load_safetensors
from quaxlike.quantized import Bnb4bitArray, GroupedIntArray, QuantizedArray


OUT, IN = 16, 64
dequantized = eqx.filter_jit(lambda q: q.dequantize())


def linear(out=OUT, columns=IN, dtype=jnp.float32):
    """A model skeleton: the shapes and dtypes `load_safetensors` fills."""
    model = eqx.filter_eval_shape(lambda: eqx.nn.Linear(columns, out, key=jr.key(0)))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), model)


def write(tmp_path, tensors, config=None, name="model.safetensors"):
    file = os.path.join(tmp_path, name)
    save_file(tensors, file)
    if config is not None:
        with open(os.path.join(tmp_path, "config.json"), "w") as f:
            json.dump({"quantization_config": config}, f)
    return file


def load_weight(path, dtype=jnp.float32, name="proj.weight", **kwargs):
    model = load_safetensors(linear(dtype=dtype), path, {"weight": name}, **kwargs)
    return model.weight


@pytest.mark.parametrize("nested", [False, True])
def test_bnb_4bit(tmp_path, nested):
    rng = np.random.default_rng(1)
    tensors, dense = bnb(rng, OUT, IN, nested=nested)
    weight = load_weight(write(tmp_path, tensors))
    assert isinstance(weight, Bnb4bitArray) and weight.double_quantized == nested
    assert weight.shape == (OUT, IN) and weight.dtype == jnp.float32
    np.testing.assert_array_equal(dequantized(weight), dense)
    if nested:  # rows meet second-level blocks of 6 absmaxes at every offset
        assert weight.nested.shape == (OUT, 2)
    # The codes stay packed as stored: 4 bits a weight.
    assert weight.packed.dtype == jnp.uint8 and weight.packed.shape == (OUT, IN // 2)


def test_bnb_4bit_quant_storage_and_dtype(tmp_path):
    # `bnb_4bit_quant_storage=bfloat16` keeps the same bytes in another dtype;
    # the state's dtype is what bitsandbytes casts to.
    rng = np.random.default_rng(2)
    tensors, dense = bnb(rng, OUT, IN)
    tensors["proj.weight"] = tensors["proj.weight"].reshape(-1).view(np.float16)[:, None]
    state = json.loads(bytes(tensors["proj.weight.quant_state.bitsandbytes__nf4"]))
    state["dtype"] = "float16"
    blob = np.frombuffer(json.dumps(state).encode(), np.uint8).copy()
    tensors["proj.weight.quant_state.bitsandbytes__nf4"] = blob
    weight = load_weight(write(tmp_path, tensors), dtype=jnp.float32)
    assert weight.dtype == jnp.float32 and weight.library_dtype == "float16"
    expected = dense.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(dequantized(weight), expected)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq(tmp_path, version, bits, act_order):
    rng = np.random.default_rng(3)
    tensors, dense = gptq(rng, OUT, IN, bits=bits, act_order=act_order, version=version)
    config = {"quant_method": "gptq", "bits": bits, "checkpoint_format": f"gptq_{version}"}
    config["checkpoint_format"] = "gptq" if version == "v1" else "gptq_v2"
    write(tmp_path, tensors, config)
    weight = load_weight(tmp_path, dtype=jnp.float16)  # the directory: config.json
    assert isinstance(weight, GroupedIntArray) and weight.bits == bits
    assert (weight.g_idx is not None) == act_order  # a trivial g_idx is dropped
    np.testing.assert_array_equal(dequantized(weight), dense)
    # One file alone: v1, as every GPTQ writer saves by default.
    alone = load_weight(os.path.join(tmp_path, "model.safetensors"), dtype=jnp.float16)
    same = np.array_equal(dequantized(alone), dense)
    assert same == (version == "v1")
    v2 = {"quant_method": "gptq", "checkpoint_format": "gptq_v2"}
    told = load_weight(
        os.path.join(tmp_path, "model.safetensors"), dtype=jnp.float16, quantization_config=v2
    )
    assert np.array_equal(dequantized(told), dense) == (version == "v2")


def test_gptq_into_a_float32_leaf_follows_the_library(tmp_path):
    # Dequantised in float16 as GPTQ does, then cast to the leaf's float32.
    tensors, dense = gptq(np.random.default_rng(4), OUT, IN)
    weight = load_weight(write(tmp_path, tensors))
    assert weight.dtype == jnp.float32 and weight.scale.dtype == jnp.float16
    np.testing.assert_array_equal(dequantized(weight), dense.astype(np.float32))


def test_awq_gemm(tmp_path):
    tensors, dense = awq(np.random.default_rng(5), OUT, IN)
    weight = load_weight(write(tmp_path, tensors), dtype=jnp.float16)
    assert isinstance(weight, GroupedIntArray) and weight.zero is not None
    np.testing.assert_array_equal(dequantized(weight), dense)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("channel", [False, True])
def test_compressed_tensors(tmp_path, bits, symmetric, channel):
    rng = np.random.default_rng(6)
    tensors, dense, config = compressed(
        rng, OUT, IN, bits=bits, symmetric=symmetric, channel=channel
    )
    file = write(tmp_path, tensors)
    weight = load_weight(file, dtype=jnp.float16)
    assert isinstance(weight, GroupedIntArray) and (weight.zero is None) == symmetric
    assert weight.scale.shape == (OUT, 1 if channel else IN // 16)
    np.testing.assert_array_equal(dequantized(weight), dense)
    with_config = load_weight(file, dtype=jnp.float16, quantization_config=config)
    np.testing.assert_array_equal(dequantized(with_config), dense)


def test_stacked_layers_and_a_dense_bias(tmp_path):
    # A stack of layers, `{}` in the name: one Value with a leading layer axis.
    rng = np.random.default_rng(7)
    tensors, denses = {}, []
    for i in range(3):
        t, d = gptq(rng, OUT, IN, act_order=True)
        tensors.update({k.replace("proj", f"layers.{i}.proj"): v for k, v in t.items()})
        denses.append(d)
    write(tmp_path, tensors)
    params = {
        "w": jax.ShapeDtypeStruct((3, OUT, IN), jnp.float16),
        "b": jax.ShapeDtypeStruct((3, OUT), jnp.float32),
    }
    names = {"w": "layers.{}.proj.weight", "b": "layers.{}.proj.bias"}
    got = load_safetensors(params, tmp_path, names)
    assert isinstance(got["w"], GroupedIntArray) and got["w"].g_idx.shape == (3, IN)
    assert got["w"].shape == (3, OUT, IN) and isinstance(got["b"], jax.Array)
    np.testing.assert_array_equal(dequantized(got["w"]), np.stack(denses))

    # A scan over the layers slices every leaf alike, act-order map included.
    x = jnp.asarray(rng.standard_normal(IN), jnp.float32)

    def apply(w, x):  # in float32: the weights' float16 values, summed in float32
        return jax.lax.scan(lambda c, w: (c, w.astype(jnp.float32) @ x), None, w)[1]

    ours = jax.jit(quaxlike.quaxify(apply))(got["w"], x)
    theirs = jax.jit(apply)(jnp.asarray(np.stack(denses)), x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    # Indexing one layer out would leave the per-matrix act-order map behind.
    with pytest.raises(ValueError, match="act-order `g_idx`.*`lax.scan`"):
        quaxlike.quaxify(lambda w: w[1] @ x)(got["w"])


def test_a_transposed_kernel(tmp_path):
    tensors, dense = awq(np.random.default_rng(8), OUT, IN)
    write(tmp_path, tensors)
    params = {"kernel": jax.ShapeDtypeStruct((IN, OUT), jnp.float16)}
    got = load_safetensors(params, tmp_path, {"kernel": ("proj.weight", np.transpose)})
    assert got["kernel"].transposed and got["kernel"].shape == (IN, OUT)
    np.testing.assert_array_equal(dequantized(got["kernel"]), dense.T)


def test_errors_name_the_layout(tmp_path):
    rng = np.random.default_rng(9)
    tensors, _ = gptq(rng, OUT, IN)
    write(tmp_path, tensors)
    with pytest.raises(KeyError, match="GPTQ/AWQ `nope.qweight`"):
        load_weight(tmp_path, name="nope.weight")
    assert isinstance(load_weight(tmp_path, name="nope.weight", strict=False), jax.ShapeDtypeStruct)
    marlin = {"quant_method": "gptq", "checkpoint_format": "marlin"}
    with pytest.raises(ValueError, match="'marlin'"):
        load_weight(tmp_path, quantization_config=marlin)
    with pytest.raises(ValueError, match="quant_method 'awq'.*GPTQ layout"):
        load_weight(tmp_path, quantization_config={"quant_method": "awq"})
    with pytest.raises(ValueError, match="fits neither GPTQ"):
        load_safetensors(linear(OUT, 48), tmp_path, {"weight": "proj.weight"})
    with pytest.raises(ValueError, match="Only `np.transpose`"):
        load_safetensors(linear(), tmp_path, {"weight": ("proj.weight", np.negative)})
    # 3-bit GPTQ: codes straddle the words.
    three = dict(tensors, **{"proj.qweight": np.zeros((IN * 3 // 32, OUT), np.int32)})
    write(tmp_path, three, name="model.safetensors")
    with pytest.raises(ValueError, match="3 bits per code"):
        load_weight(tmp_path)


@pytest.mark.parametrize("nested", [False, True])
def test_bnb_4bit_blocks_that_straddle_rows(tmp_path, nested):
    # Rows of 24 inputs in blocks of 16: rows share blocks; nested blocks of 6.
    tensors, dense = bnb(np.random.default_rng(10), OUT, 24, blocksize=16, nested=nested)
    weight = load_safetensors(linear(OUT, 24), write(tmp_path, tensors), {"weight": "proj.weight"})
    weight = weight.weight
    assert weight.block_start is not None and weight.group_size == 16
    np.testing.assert_array_equal(dequantized(weight), dense)
    # Products and row slices still go a block of rows at a time.
    x = jnp.asarray(np.random.default_rng(0).standard_normal(24), jnp.float32)
    y = jax.jit(quaxlike.quaxify(lambda w, x: (w @ x, w[3:7])))(weight, x)
    np.testing.assert_allclose(y[0], dense @ np.asarray(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[1], dense[3:7])


def test_bnb_errors(tmp_path):
    tensors, _ = bnb(np.random.default_rng(10), 4, 15, blocksize=4)  # odd rows
    write(tmp_path, tensors)
    with pytest.raises(ValueError, match="odd number"):
        load_safetensors(linear(4, 15), tmp_path, {"weight": "proj.weight"})
    with pytest.raises(ValueError, match=r"shape \(4, 15\).*has shape \(16, 64\)"):
        load_weight(tmp_path)
    eight = {"proj.weight": np.zeros((OUT, IN), np.int8), "proj.weight.SCB": np.ones(OUT)}
    write(tmp_path, eight)
    with pytest.raises(ValueError, match="8-bit"):
        load_weight(tmp_path)


def test_compressed_tensors_errors(tmp_path):
    rng = np.random.default_rng(11)
    tensors, _, config = compressed(rng, OUT, IN, symmetric=False)
    file = write(tmp_path, tensors)
    with pytest.raises(ValueError, match="'float-quantized'.*FP8"):
        load_weight(file, quantization_config={**config, "format": "float-quantized"})
    no_zero = {k: v for k, v in tensors.items() if k != "proj.weight_zero_point"}
    write(tmp_path, no_zero)
    with pytest.raises(ValueError, match="asymmetric and it has no"):
        load_weight(file, quantization_config=config)
    with pytest.raises(ValueError, match="weight_shape"):
        load_safetensors(linear(OUT * 2, IN // 2), file, {"weight": "proj.weight"})


def test_the_lora_name_is_the_same_function():
    assert quaxlike.lora.load_safetensors is load_safetensors


def test_loaded_values_refuse_to_materialise(tmp_path):
    tensors, _ = gptq(np.random.default_rng(12), OUT, IN)
    weight = load_weight(write(tmp_path, tensors))
    assert isinstance(weight, QuantizedArray) and not weight.allow_materialise
    with pytest.raises(RuntimeError, match="Refusing to materialise an GroupedIntArray"):
        quaxlike.quaxify(jnp.sin)(weight)
    allowed = load_weight(tmp_path, allow_materialise=True, matmul="fused")
    assert allowed.allow_materialise and allowed.matmul == "fused"


def test_reading_is_lazy_and_layer_by_layer(tmp_path, monkeypatch):
    # Only the named leaves' tensors are copied out of the mapped files, one at a
    # time: a large tensor nobody names is never read.
    from quaxlike.checkpoints import _source

    tensors, dense = gptq(np.random.default_rng(13), OUT, IN)
    tensors["lm_head.weight"] = np.zeros((4096, 1024), np.float32)  # 16 MiB, unnamed
    write(tmp_path, tensors)
    read = []
    original = _source.Source.get
    monkeypatch.setattr(_source.Source, "get", lambda self, k: read.append(k) or original(self, k))
    weight = load_weight(tmp_path, dtype=jnp.float16)
    np.testing.assert_array_equal(dequantized(weight), dense)
    assert sorted(read) == ["proj.g_idx", "proj.qweight", "proj.qzeros", "proj.scales"]
