"""The writers `save_bnb_4bit` and `save_compressed_tensors`: a model quantised
here written in the layouts PyTorch's tools serve, read back equal; checkpoints
the libraries wrote (tests/golden) read and written again tensor for tensor; and,
where bitsandbytes or compressed-tensors are installed, our files read by them
to our values."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from safetensors import safe_open

from quaxlike.checkpoints import load_safetensors, save_bnb_4bit, save_compressed_tensors
from quaxlike.lora import loraify
from quaxlike.quantized import GroupedIntArray, quantize_int4, quantize_int8, quantize_nf4


GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "checkpoints")
dequantized = eqx.filter_jit(lambda w: w.dequantize())
NAMES = {"a": "layers.0.proj.weight", "b": "layers.1.proj.weight", "bias": "layers.0.proj.bias"}


def tensors_of(path):
    with safe_open(path, framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def shapes_of(model):
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in model.items()}


def model_of(make):
    w = jr.normal(jr.key(0), (48, 128))
    return {"a": make(w), "b": make(2 * w[:, ::-1]), "bias": jnp.arange(48.0)}


def assert_same_values(back, model):
    for key in "ab":
        np.testing.assert_array_equal(dequantized(back[key]), dequantized(model[key]))
    np.testing.assert_array_equal(back["bias"], model["bias"])


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_round_trip_through_bnb(tmp_path, double_quant):
    model = model_of(lambda w: quantize_nf4(w, group_size=64, double_quant=double_quant))
    config = save_bnb_4bit(model, os.path.join(tmp_path, "model.safetensors"), NAMES)
    assert config["quant_method"] == "bitsandbytes" and config["bnb_4bit_quant_type"] == "nf4"
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["quantization_config"] == config
    assert_same_values(load_safetensors(shapes_of(model), tmp_path, NAMES), model)


@pytest.mark.parametrize("make", ["int4", "int8", "grouped-asymmetric"])
def test_round_trip_through_compressed_tensors(tmp_path, make):
    if make == "int4":
        model = model_of(lambda w: quantize_int4(w, group_size=32))
    elif make == "int8":
        model = model_of(quantize_int8)
    else:  # one read from an asymmetric checkpoint
        ct = os.path.join(GOLDEN, "compressed_tensors", "ct_w4_asym_group32")
        if not os.path.isdir(ct):
            pytest.skip("no golden files")
        read = load_safetensors(
            {"w": jax.ShapeDtypeStruct((48, 128), jnp.bfloat16)}, ct, {"w": "proj.weight"}
        )["w"]
        assert isinstance(read, GroupedIntArray) and read.zero is not None
        model = {"a": read, "b": read, "bias": jnp.arange(48.0)}
    config = save_compressed_tensors(model, os.path.join(tmp_path, "model.safetensors"), NAMES)
    targets = sorted(t for g in config["config_groups"].values() for t in g["targets"])
    assert targets == ["layers.0.proj", "layers.1.proj"] or len(config["config_groups"]) == 1
    assert_same_values(load_safetensors(shapes_of(model), tmp_path, NAMES), model)


@pytest.mark.parametrize("case", ["bnb_nf4_dq_ragged", "bnb_fp4_dq", "bnb_nf4_dq_2nested_fp16"])
def test_a_bnb_checkpoint_written_again_is_the_same(tmp_path, case):
    directory = os.path.join(GOLDEN, "bnb", case)
    if not os.path.isdir(directory):
        pytest.skip("no golden files")
    theirs = tensors_of(os.path.join(directory, "model.safetensors"))
    shape = json.loads(bytes(next(v for k, v in theirs.items() if "quant_state" in k)))["shape"]
    names = {"w": "proj.weight", "b": "proj.bias"}
    model = load_safetensors(
        {
            "w": jax.ShapeDtypeStruct(tuple(shape), jnp.float32),
            "b": jax.ShapeDtypeStruct((shape[0],), theirs["proj.bias"].dtype),
        },
        directory,
        names,
    )
    save_bnb_4bit(model, os.path.join(tmp_path, "model.safetensors"), names)
    ours = tensors_of(os.path.join(tmp_path, "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if "quant_state" in key:
            assert json.loads(bytes(ours[key])) == json.loads(bytes(value))
        else:
            assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
            np.testing.assert_array_equal(ours[key], value, err_msg=key)


@pytest.mark.parametrize("case", ["ct_w4_asym_group32", "ct_w8_sym_channel", "ct_w4_asym_channel"])
def test_a_compressed_tensors_checkpoint_written_again_is_the_same(tmp_path, case):
    directory = os.path.join(GOLDEN, "compressed_tensors", case)
    if not os.path.isdir(directory):
        pytest.skip("no golden files")
    theirs = tensors_of(os.path.join(directory, "model.safetensors"))
    out, columns = (int(n) for n in theirs["proj.weight_shape"])
    dtype = theirs["proj.weight_scale"].dtype
    names = {"w": "proj.weight", "b": "proj.bias"}
    skeleton = {
        "w": jax.ShapeDtypeStruct((out, columns), dtype),
        "b": jax.ShapeDtypeStruct((out,), dtype),
    }
    model = load_safetensors(skeleton, directory, names)
    config = save_compressed_tensors(model, os.path.join(tmp_path, "model.safetensors"), names)
    ours = tensors_of(os.path.join(tmp_path, "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value.astype(ours[key].dtype), err_msg=key)
    with open(os.path.join(directory, "config.json")) as f:
        their_args = next(iter(json.load(f)["quantization_config"]["config_groups"].values()))
    our_args = next(iter(config["config_groups"].values()))["weights"]
    for key in ("num_bits", "type", "symmetric", "strategy", "group_size"):
        assert our_args[key] == their_args["weights"][key], key


def test_a_lora_model_writes_its_base_and_a_stack_writes_each_layer(tmp_path):
    stack = quantize_nf4(jr.normal(jr.key(1), (3, 16, 64)), group_size=64)
    model = loraify({"w": stack}, rank=2, key=jr.key(2), where="w")
    names = {"w": "model.layers.{}.proj.weight"}
    save_bnb_4bit(model, os.path.join(tmp_path, "model.safetensors"), names)
    written = tensors_of(os.path.join(tmp_path, "model.safetensors"))
    assert {k for k in written if k.endswith("proj.weight")} == {
        f"model.layers.{i}.proj.weight" for i in range(3)
    }
    back = load_safetensors({"w": jax.ShapeDtypeStruct(stack.shape, stack.dtype)}, tmp_path, names)
    np.testing.assert_array_equal(dequantized(back["w"]), dequantized(stack))


def test_writer_errors(tmp_path):
    file = os.path.join(tmp_path, "model.safetensors")
    int4 = {"w": quantize_int4(jnp.ones((4, 64)), group_size=32)}
    with pytest.raises(
        ValueError, match="Int4Array.*no bitsandbytes 4-bit layout.*save_compressed"
    ):
        save_bnb_4bit(int4, file, {"w": "p.weight"})
    nf4 = {"w": quantize_nf4(jnp.ones((4, 64)), group_size=64)}
    with pytest.raises(ValueError, match="NF4Array.*no compressed-tensors.*save_bnb_4bit"):
        save_compressed_tensors(nf4, file, {"w": "p.weight"})
    small = {"w": quantize_nf4(jnp.ones((4, 64)), group_size=16)}
    with pytest.raises(ValueError, match="groups of 16 inputs"):
        save_bnb_4bit(small, file, {"w": "p.weight"})
    with pytest.raises(ValueError, match="must end in `weight`"):
        save_compressed_tensors(int4, file, {"w": "p.kernel"})
    stack = {"w": quantize_int4(jnp.ones((2, 4, 64)), group_size=32)}
    with pytest.raises(ValueError, match=r"a stack of matrices.*one `\{\}` per leading axis"):
        save_compressed_tensors(stack, file, {"w": "p.weight"})
    transposed = {"w": int4["w"].swapped()}
    with pytest.raises(ValueError, match="transposed"):
        save_compressed_tensors(transposed, file, {"w": "p.weight"})


# Where the libraries are installed (not in CI): they read our files to our values.


@pytest.mark.filterwarnings("ignore")
def test_bitsandbytes_reads_our_file(tmp_path):
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    model = model_of(lambda w: quantize_nf4(w, group_size=64))
    save_bnb_4bit(model, os.path.join(tmp_path, "model.safetensors"), NAMES)
    written = tensors_of(os.path.join(tmp_path, "model.safetensors"))
    for key in "ab":
        name = NAMES[key]
        state = {
            k[len(name) + 1 :]: torch.from_numpy(v)
            for k, v in written.items()
            if k.startswith(name + ".")
        }
        quant_state = functional.QuantState.from_dict(state, torch.device("cpu"))
        theirs = functional.dequantize_4bit(torch.from_numpy(written[name]), quant_state).numpy()
        # bitsandbytes' NF4 table and ours (computed) differ in the last float32 bits.
        np.testing.assert_allclose(theirs, dequantized(model[key]), rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore")
def test_compressed_tensors_reads_our_file(tmp_path):
    torch = pytest.importorskip("torch")
    base = pytest.importorskip("compressed_tensors.compressors.pack_quantized.base")
    quantization = pytest.importorskip("compressed_tensors.quantization")
    model = model_of(lambda w: quantize_int4(w, group_size=32))
    config = save_compressed_tensors(model, os.path.join(tmp_path, "model.safetensors"), NAMES)
    parsed = quantization.QuantizationConfig.model_validate(config)
    written = tensors_of(os.path.join(tmp_path, "model.safetensors"))
    for key in "ab":
        module = NAMES[key][: -len(".weight")]
        scheme = next(g for g in parsed.config_groups.values() if module in g.targets)
        state = {
            k[len(module) + 1 :]: torch.from_numpy(v)
            for k, v in written.items()
            if k.startswith(module + ".weight")
        }
        theirs = base.PackedQuantizationCompressor.decompress(state, scheme)["weight"].numpy()
        np.testing.assert_array_equal(theirs, dequantized(model[key]))
