"""`load_safetensors` on checkpoints the reference libraries wrote themselves
(tests/golden/checkpoints, made by tests/golden/make_golden.py with bitsandbytes,
GPTQModel, AutoAWQ and compressed-tensors): every layout reads, from its files
alone, to exactly the library's own dequantised weight, bit for bit; and the
layer's product matches the library's forward output (`y`) within the
tolerance of the library's own arithmetic (README there). Needs only
safetensors and NumPy."""

import glob
import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import quaxlike
from quaxlike.checkpoints import load_safetensors
from quaxlike.quantized import Bnb4bitArray, GroupedIntArray


GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "checkpoints")
pytestmark = pytest.mark.skipif(not os.path.isdir(GOLDEN), reason="no golden files")


def reference(path: str) -> dict[str, np.ndarray]:
    with safe_open(path, framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def cases(family: str, pattern: str) -> list[str]:
    found = sorted(glob.glob(os.path.join(GOLDEN, family, pattern)))
    return [os.path.basename(p).split(".")[0] for p in found]


def read(files, ref, config=None, dtype=None):
    """The layer `proj` as our Value (weight in the reference's dtype) and bias."""
    out, columns = ref["weight"].shape
    dtype = ref["weight"].dtype if dtype is None else dtype
    skeleton = {
        "weight": jax.ShapeDtypeStruct((out, columns), dtype),
        "bias": jax.ShapeDtypeStruct((out,), jnp.float32),
    }
    names = {"weight": "proj.weight", "bias": "proj.bias"}
    return load_safetensors(skeleton, files, names, quantization_config=config)


dequantized = eqx.filter_jit(lambda w: w.dequantize())


def assert_exact(weight, ref):
    got = np.asarray(dequantized(weight))
    assert got.dtype == ref["weight"].dtype
    np.testing.assert_array_equal(got.astype(np.float32), ref["weight"].astype(np.float32))


def assert_forward(layer, ref, atol):
    """Our product `x @ w.T + b`, in float32, against the library's forward `y`."""
    f32 = eqx.filter_jit(quaxlike.quaxify(lambda w, b, x: x @ w.astype(jnp.float32).T + b))
    y = f32(layer["weight"], layer["bias"], jnp.asarray(ref["x"]))
    np.testing.assert_allclose(y, ref["y"], rtol=0, atol=atol)


@pytest.mark.parametrize("case", cases("bnb", "*.reference.safetensors"))
def test_bitsandbytes(case):
    ref = reference(os.path.join(GOLDEN, "bnb", f"{case}.reference.safetensors"))
    layer = read(os.path.join(GOLDEN, "bnb", case), ref)  # the directory: config.json
    assert isinstance(layer["weight"], Bnb4bitArray)
    assert_exact(layer["weight"], ref)
    # One file alone is enough.
    alone = read(os.path.join(GOLDEN, "bnb", case, "model.safetensors"), ref)
    assert_exact(alone["weight"], ref)
    # float32: the library's forward is the float32 product; bf16/fp16 compute
    # in the low precision (README: within 4e-3 and 2e-3).
    atol = 1e-6 if ref["weight"].dtype == np.float32 else 1e-2
    assert_forward(layer, ref, atol)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("case", cases("gptq", "*.reference.safetensors"))
def test_gptq(case, version):
    ref = reference(os.path.join(GOLDEN, "gptq", f"{case}.reference.safetensors"))
    file = os.path.join(GOLDEN, "gptq", f"{case}.{version}.safetensors")
    with open(os.path.join(GOLDEN, "gptq", f"{case}.{version}.quantize_config.json")) as f:
        config = json.load(f)
    layer = read(file, ref, config)
    assert isinstance(layer["weight"], GroupedIntArray)
    assert (layer["weight"].g_idx is not None) == ("actorder" in case)
    assert_exact(layer["weight"], ref)
    # GPTQModel's forward: the float16 weight upcast, a float32 matmul.
    assert_forward(read(file, ref, config, jnp.float32), ref, atol=1e-5)
    if version == "v1":  # a v1 file alone is read as v1, the writers' default
        assert_exact(read(file, ref)["weight"], ref)


@pytest.mark.parametrize("case", cases("awq", "*.reference.safetensors"))
def test_awq_gemm(case):
    ref = reference(os.path.join(GOLDEN, "awq", f"{case}.reference.safetensors"))
    file = os.path.join(GOLDEN, "awq", f"{case}.safetensors")
    with open(os.path.join(GOLDEN, "awq", f"{case}.quantization_config.json")) as f:
        config = json.load(f)
    layer = read(file, ref, config)
    assert_exact(layer["weight"], ref)
    assert_exact(read(file, ref)["weight"], ref)
    # AutoAWQ's forward is a float16 matmul (README: within about 1.1e-3).
    assert_forward(layer, ref, atol=5e-3)


@pytest.mark.parametrize("case", cases("compressed_tensors", "*.reference.safetensors"))
def test_compressed_tensors(case):
    ref = reference(os.path.join(GOLDEN, "compressed_tensors", f"{case}.reference.safetensors"))
    directory = os.path.join(GOLDEN, "compressed_tensors", case)
    layer = read(directory, ref)
    assert isinstance(layer["weight"], GroupedIntArray)
    assert (layer["weight"].zero is None) == ("_sym_" in case)
    assert_exact(layer["weight"], ref)
    assert_exact(read(os.path.join(directory, "model.safetensors"), ref)["weight"], ref)
    # bf16 cases: the library's bf16 matmul (README: within about 5e-3).
    assert_forward(layer, ref, atol=1e-2)
