"""Adapters in and out of the Hugging Face PEFT layout (`save_peft`, `load_peft`)
and base checkpoints in (`load_safetensors`).

The files are read back with `safetensors` itself and checked against PEFT's
convention written out by hand: `lora_A` is `(r, in)`, `lora_B` is `(out, r)`, and
the update of a `(out, in)` weight is `(lora_alpha / r) lora_B @ lora_A`. Where
`torch` and `peft` are installed, the exported adapter is also loaded into PEFT on
a tiny Llama built from a config, and compared there.
"""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn

import quaxlike
from quaxlike.lora import (
    load_peft,
    load_safetensors,
    LoraArray,
    loraify,
    merge,
    qlora,
    save_peft,
)
from quaxlike.quantized import dequantize, Int4Array


st = pytest.importorskip("safetensors.numpy")

R = 2


def trained(model, seed=0):
    """`model` with non-zero `B`s, so that the update matters."""
    is_lora = lambda x: isinstance(x, LoraArray)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(model, is_leaf=is_lora)
    out = [
        x.with_factors(x.w, x.a, randn(seed + i, x.b.shape, 0.5)) if is_lora(x) else x
        for i, x in enumerate(leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(6, 3, 8, depth=2, key=jr.key(0))


@pytest.mark.parametrize("alpha", [None, 16])
def test_save_writes_peft_names_orientation_and_scale(mlp, tmp_path, alpha):
    model = trained(loraify(mlp, rank=R, key=jr.key(1), where=["layers.0", "layers.2"]))
    config = save_peft(model, tmp_path, lora_alpha=alpha)
    on_disk = json.loads((tmp_path / "adapter_config.json").read_text())
    assert on_disk == config
    assert config["peft_type"] == "LORA" and config["r"] == R
    assert config["lora_alpha"] == (R if alpha is None else alpha)
    assert config["target_modules"] == ["0", "2"]
    tensors = st.load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    assert sorted(tensors) == [
        f"base_model.model.layers.{i}.lora_{p}.weight" for i in (0, 2) for p in "AB"
    ]
    scale = config["lora_alpha"] / config["r"]
    for i in (0, 2):
        lora = model.layers[i].weight
        lora_a = tensors[f"base_model.model.layers.{i}.lora_A.weight"]
        lora_b = tensors[f"base_model.model.layers.{i}.lora_B.weight"]
        out, inp = lora.shape
        assert lora_a.shape == (R, inp) and lora_b.shape == (out, R)
        np.testing.assert_allclose(scale * lora_b @ lora_a, lora.a @ lora.b, rtol=1e-5, atol=1e-6)


def test_round_trip_onto_the_base(mlp, tmp_path):
    model = trained(loraify(mlp, rank=R, key=jr.key(1)))
    save_peft(model, tmp_path, lora_alpha=8)
    loaded = load_peft(mlp, tmp_path)
    assert all(isinstance(layer.weight, LoraArray) for layer in loaded.layers)
    x = randn(3, (6,))
    np.testing.assert_allclose(
        quaxlike.quaxify(loaded)(x), quaxlike.quaxify(model)(x), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(merge(loaded)(x), merge(model)(x), rtol=1e-5, atol=1e-6)
    # Onto a LoRA model: the factors are replaced, the frozen weight kept.
    fresh = loraify(mlp, rank=R, key=jr.key(7))
    again = load_peft(fresh, tmp_path)
    assert again.layers[1].weight.w is fresh.layers[1].weight.w
    np.testing.assert_allclose(quaxlike.quaxify(again)(x), quaxlike.quaxify(model)(x), rtol=1e-5)


def test_round_trip_over_a_quantised_base(mlp, tmp_path):
    model = trained(qlora(mlp, rank=R, key=jr.key(1), group_size=2))
    save_peft(model, tmp_path)
    base = jax.tree_util.tree_map(
        lambda x: x.w if isinstance(x, LoraArray) else x,
        model,
        is_leaf=lambda x: isinstance(x, LoraArray),
    )
    loaded = load_peft(base, tmp_path)
    assert isinstance(loaded.layers[0].weight.w, Int4Array)
    x = randn(4, (6,))
    got = quaxlike.quaxify(loaded)(x)
    np.testing.assert_allclose(got, merge(dequantize(model))(x), rtol=1e-5, atol=1e-5)


def test_flax_kernels_are_transposed(tmp_path):
    # A linen-style kernel is stored (in, out): PEFT's (out, in) update is its transpose.
    params = {"dense": {"kernel": randn(0, (5, 3)), "bias": randn(1, (3,))}}
    model = trained(loraify(params, rank=R, key=jr.key(1), where="**.kernel"))
    save_peft(model, tmp_path, lora_alpha=4)
    tensors = st.load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    lora_a = tensors["base_model.model.dense.lora_A.weight"]
    lora_b = tensors["base_model.model.dense.lora_B.weight"]
    assert lora_a.shape == (R, 5) and lora_b.shape == (3, R)
    lora = model["dense"]["kernel"]
    np.testing.assert_allclose(2 * lora_b @ lora_a, (lora.a @ lora.b).T, rtol=1e-5, atol=1e-6)
    loaded = load_peft(params, tmp_path)
    np.testing.assert_allclose(
        merge(loaded)["dense"]["kernel"], merge(model)["dense"]["kernel"], rtol=1e-5, atol=1e-6
    )


def test_stacked_layers_and_name_maps(tmp_path):
    # A stack of layers (scanned) is one PEFT module per layer.
    layers, width = 3, 4
    params = {"q": randn(0, (layers, width, width)), "v": randn(1, (layers, width, width))}
    names = {
        "q": "model.layers.{}.self_attn.q_proj",
        "v": "model.layers.{}.self_attn.v_proj",
    }
    model = trained(loraify(params, rank=R, key=jr.key(1), where=["q", "v"]))
    config = save_peft(model, tmp_path, lora_alpha=16, name_map=names)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    tensors = st.load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    assert len(tensors) == 2 * 2 * layers
    assert "base_model.model.model.layers.2.self_attn.v_proj.lora_B.weight" in tensors
    loaded = load_peft(params, tmp_path, name_map=names)
    assert loaded["q"].a.shape == (layers, width, R)
    for key in "qv":
        np.testing.assert_allclose(merge(loaded)[key], merge(model)[key], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="placeholder"):
        save_peft(model, tmp_path, name_map={"q": "q_proj", "v": "v_proj"})
    with pytest.raises(ValueError, match="no weight of the model maps to"):
        load_peft(params, tmp_path)  # saved under other names


def test_load_safetensors_through_a_name_map(mlp, tmp_path):
    # A Hugging Face-style checkpoint: torch layout, its own names, one tensor per layer.
    checkpoint = {
        f"model.layers.{i}.proj.weight": np.asarray(randn(10 + i, mlp.layers[i].weight.shape))
        for i in range(3)
    }
    checkpoint["model.layers.0.proj.bias"] = np.arange(8, dtype=np.float32)
    stacked = np.stack([np.asarray(randn(20 + i, (4, 5))) for i in range(2)])
    for i in range(2):
        checkpoint[f"model.blocks.{i}.up.weight"] = stacked[i]
        checkpoint[f"model.blocks.{i}.down.weight"] = stacked[i].T.copy()
    file = os.path.join(tmp_path, "model.safetensors")
    st.save_file(checkpoint, file)
    names = {f"layers.{i}.weight": f"model.layers.{i}.proj.weight" for i in range(3)}
    names["layers.0.bias"] = "model.layers.0.proj.bias"
    loaded = load_safetensors(mlp, file, names)
    for i in range(3):
        np.testing.assert_array_equal(
            loaded.layers[i].weight, checkpoint[names[f"layers.{i}.weight"]]
        )
    np.testing.assert_array_equal(loaded.layers[0].bias, np.arange(8))
    np.testing.assert_array_equal(loaded.layers[1].bias, mlp.layers[1].bias)  # not named
    # Stacks, by `{}`, and transforms, as a pair.
    params = {"up": jnp.zeros((2, 4, 5)), "down": jnp.zeros((2, 4, 5), jnp.bfloat16)}
    stack_names = {
        "up": "model.blocks.{}.up.weight",
        "down": ("model.blocks.{}.down.weight", np.transpose),
    }
    got = load_safetensors(params, [file], stack_names)
    np.testing.assert_array_equal(got["up"], stacked)
    assert got["down"].dtype == jnp.bfloat16
    np.testing.assert_allclose(got["down"].astype(jnp.float32), stacked, rtol=1e-2)
    with pytest.raises(KeyError, match="model.layers.9"):
        load_safetensors(mlp, file, {"layers.0.weight": "model.layers.9.proj.weight"})
    assert load_safetensors(mlp, file, {"layers.0.weight": "nope"}, strict=False) is not None
    with pytest.raises(ValueError, match="np.transpose"):
        load_safetensors(params, file, {"up": "model.blocks.{}.down.weight"})


# transformers and peft warn about their own deprecations.
@pytest.mark.filterwarnings(
    "ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning"
)
def test_peft_reads_our_adapter(tmp_path):
    # Only where torch, transformers and peft are installed (not in CI).
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    base_file = os.path.join(tmp_path, "base.safetensors")
    import safetensors.torch

    safetensors.torch.save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, base_file)
    # Our side: the q and v projections of every layer, stacked, read from the checkpoint.
    layers = config.num_hidden_layers
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    params = {"q": jnp.zeros((layers, 16, 16)), "v": jnp.zeros((layers, kv, 16))}
    weights = {k: f"model.layers.{{}}.self_attn.{k}_proj.weight" for k in "qv"}
    params = load_safetensors(params, base_file, weights)
    model = trained(loraify(params, rank=R, key=jr.key(1), where=["q", "v"]))
    modules = {k: f"model.layers.{{}}.self_attn.{k}_proj" for k in "qv"}
    adapter = os.path.join(tmp_path, "adapter")
    save_peft(model, adapter, lora_alpha=8, name_map=modules)
    peft_model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    x = np.asarray(randn(5, (3, 16)))
    for i in range(layers):
        for k in "qv":
            layer = peft_model.base_model.model.model.layers[i].self_attn
            with torch.no_grad():
                theirs = getattr(layer, f"{k}_proj")(torch.from_numpy(x)).numpy()
            ours = quaxlike.quaxify(lambda w, x: x @ w[i].T)(model[k], jnp.asarray(x))
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    tokens = torch.tensor([[1, 5, 7, 2]])
    with torch.no_grad():
        adapted = peft_model(tokens).logits
        merged = peft_model.merge_and_unload()
        np.testing.assert_allclose(merged(tokens).logits.numpy(), adapted.numpy(), atol=1e-4)
        q = merged.model.layers[1].self_attn.q_proj.weight.numpy()
    np.testing.assert_allclose(q, merge(model)["q"][1], rtol=1e-4, atol=1e-5)
