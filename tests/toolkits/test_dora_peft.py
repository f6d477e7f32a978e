"""DoRA adapters in and out of the PEFT layout (`load_peft`, `save_peft`).

Golden files made by real PEFT 0.21.2 (tests/golden/README.md, section 5): a
DoRA adapter (plain and rsLoRA) on a two-layer float32 model, and QDoRA on a
bitsandbytes NF4 base with double quantisation. Each loads here and gives PEFT's
outputs, norms and gradients; merging agrees with PEFT's `merge_and_unload`.
Where torch and peft are installed, PEFT also loads our adapter.
"""

import json
import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn

import quaxlike
from quaxlike.checkpoints import load_safetensors
from quaxlike.lora import DoraArray, load_peft, loraify, merge, save_peft
from quaxlike.quantized import largest_dequantized


st = pytest.importorskip("safetensors.numpy")

GOLDEN = Path(__file__).parent.parent / "golden" / "checkpoints" / "peft"
LAYERS = ("proj", "out_proj")


def golden(case):
    directory = GOLDEN / case
    if not (directory / "reference.safetensors").exists():
        pytest.skip(f"golden files for {case!r} not present ({directory})")
    return directory, st.load_file(str(directory / "reference.safetensors"))


def two_layer():
    return {
        "proj": eqx.nn.Linear(64, 48, key=jr.key(0)),
        "out_proj": eqx.nn.Linear(48, 32, key=jr.key(1)),
    }


def forward(model, x):
    h = jax.nn.relu(jax.vmap(model["proj"])(x))
    return jax.vmap(model["out_proj"])(h)


def base_names(layers=LAYERS):
    return {f"{n}.{p}": f"{n}.{p}" for n in layers for p in ("weight", "bias")}


def close(x, y, tol=1e-5):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def peft_grads(pairs, config):
    """Our gradients with respect to `a`, `b` and `m` as PEFT's, with respect to
    `lora_B`, `lora_A` and the magnitude (`lora_A` is `b / scaling`), from
    `{module name: (DoraArray, its gradient)}`."""
    out = {}
    for name, (d, g) in pairs.items():
        r = d.rank
        alpha = config["lora_alpha"]
        scaling = alpha / np.sqrt(r) if config.get("use_rslora") else alpha / r
        prefix = f"grad.base_model.model.{name}"
        out[f"{prefix}.lora_A.weight"] = g.b * scaling
        out[f"{prefix}.lora_B.weight"] = g.a
        out[f"{prefix}.lora_magnitude_vector"] = g.m
    return out


@pytest.mark.parametrize("case", ["dora", "dora_rslora"])
def test_peft_dora_adapter_gives_peft_outputs(case):
    directory, ref = golden(case)
    base = load_safetensors(two_layer(), directory / "base_model.safetensors", base_names())
    model = load_peft(base, directory / "adapter")
    with open(directory / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    assert config["use_dora"] and all(isinstance(model[n].weight, DoraArray) for n in LAYERS)
    for name in LAYERS:
        close(model[name].weight.norm(), ref[f"{name}.weight_norm"])
        out = quaxlike.quaxify(lambda m, x: jax.vmap(m)(x))(model[name], ref[f"{name}.input"])
        close(out, ref[f"{name}.output"])
    x = jnp.asarray(ref["x"])
    close(quaxlike.quaxify(forward)(model, x), ref["y"])
    # Gradients of sum(y**2), as PEFT's autograd gives them (norm detached).
    loss = lambda m: jnp.sum(quaxlike.quaxify(forward)(m, x) ** 2)  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
    pairs = {n: (model[n].weight, grads[n].weight) for n in LAYERS}
    for key, value in peft_grads(pairs, config).items():
        close(value, ref[key], 1e-4)
    # merge agrees with PEFT's merge_and_unload.
    merged = merge(model)
    for name in LAYERS:
        close(merged[name].weight, ref[f"merged.{name}.weight"])
    close(forward(merged, x), ref["y_merged"])


def test_qdora_over_bitsandbytes_nf4_gives_peft_outputs():
    directory, ref = golden("qdora_nf4_dq")
    linear = eqx.nn.Linear(64, 48, key=jr.key(0))
    base = load_safetensors(
        linear,
        directory / "base_model" / "model.safetensors",
        {"weight": "proj.weight", "bias": "proj.bias"},
    )
    model = load_peft(base, directory / "adapter", name_map={"weight": "proj"})
    dora = model.weight
    assert isinstance(dora, DoraArray) and isinstance(dora.w, quaxlike.Value)
    close(dora.norm(), ref["proj.weight_norm"])
    x = jnp.asarray(ref["x"])
    apply = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    close(quaxlike.quaxify(apply)(model, x), ref["y"])
    with open(directory / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    loss = lambda m: jnp.sum(quaxlike.quaxify(apply)(m, x) ** 2)  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
    for key, value in peft_grads({"proj": (dora, grads.weight)}, config).items():
        close(value, ref[key], 1e-4)
    # Nothing materialised: at most half the base is ever dense, forward or back.
    assert not quaxlike.explain(apply)(model, x).materialised
    jaxpr = jax.make_jaxpr(eqx.filter_grad(loss))(model)
    assert 0 < largest_dequantized(jaxpr) <= 48 * 64 // 2
    # The merged weight is PEFT's formula on the dequantised base.
    w = jnp.asarray(ref["proj.base_weight_dequant"])
    v = w + dora.a @ dora.b
    close(merge(model).weight, (dora.m / jnp.linalg.norm(v, axis=-1))[:, None] * v)


def trained_dora(model, seed=0):
    """`model` with non-zero `B`s and perturbed magnitudes."""
    is_dora = lambda x: isinstance(x, DoraArray)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(model, is_leaf=is_dora)
    out = [
        x._replaced(b=randn(seed + i, x.b.shape, 0.3), m=x.m * 1.1) if is_dora(x) else x
        for i, x in enumerate(leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.parametrize("rslora", [False, True])
def test_save_writes_peft_dora_and_reads_back(tmp_path, rslora):
    base = two_layer()
    model = trained_dora(loraify(base, rank=4, key=jr.key(2), dora=True))
    config = save_peft(model, tmp_path, lora_alpha=8, use_rslora=rslora)
    assert config["use_dora"] and config["use_rslora"] == rslora
    tensors = st.load_file(str(tmp_path / "adapter_model.safetensors"))
    scaling = 8 / (2.0 if rslora else 4.0)
    for name in LAYERS:
        d = model[name].weight
        magnitude = tensors[f"base_model.model.{name}.lora_magnitude_vector"]
        assert magnitude.shape == (d.shape[0],)
        close(magnitude, d.m, 0)
        close(tensors[f"base_model.model.{name}.lora_A.weight"] * scaling, d.b, 1e-6)
        close(tensors[f"base_model.model.{name}.lora_B.weight"], d.a, 0)
    again = load_peft(base, tmp_path)
    x = randn(3, (5, 64))
    close(quaxlike.quaxify(forward)(again, x), quaxlike.quaxify(forward)(model, x))


def test_peft_adapter_saved_again_is_the_same_adapter(tmp_path):
    # Loading PEFT's file and saving it gives PEFT's own tensors back.
    directory, _ = golden("dora")
    base = load_safetensors(two_layer(), directory / "base_model.safetensors", base_names())
    model = load_peft(base, directory / "adapter")
    save_peft(model, tmp_path, lora_alpha=8)
    theirs = st.load_file(str(directory / "adapter" / "adapter_model.safetensors"))
    ours = st.load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        close(ours[key], theirs[key], 1e-6)


def test_stacked_dora_round_trip(tmp_path):
    params = {"q": randn(0, (3, 8, 6))}
    model = trained_dora(loraify(params, rank=2, key=jr.key(1), where="q", dora=True))
    names = {"q": "layers.{}.q_proj"}
    save_peft(model, tmp_path, lora_alpha=4, name_map=names)
    tensors = st.load_file(str(tmp_path / "adapter_model.safetensors"))
    assert tensors["base_model.model.layers.2.q_proj.lora_magnitude_vector"].shape == (8,)
    again = load_peft(params, tmp_path, name_map=names)
    close(again["q"].merged(), model["q"].merged())


def test_dora_errors(tmp_path):
    base = two_layer()
    lora = loraify(base, rank=2, key=jr.key(1), where="proj.weight")
    mixed = loraify(lora, rank=2, key=jr.key(2), where="out_proj.weight", dora=True)
    with pytest.raises(ValueError, match="both LoraArrays and DoraArrays"):
        save_peft(mixed, tmp_path)
    model = loraify(base, rank=2, key=jr.key(1), dora=True)
    save_peft(model, tmp_path)
    tensors = st.load_file(str(tmp_path / "adapter_model.safetensors"))
    del tensors["base_model.model.proj.lora_magnitude_vector"]
    st.save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="'proj' has no `lora_magnitude_vector`"):
        load_peft(base, tmp_path)
    kernel = {"kernel": randn(0, (6, 4))}
    with pytest.raises(ValueError, match="stored `\\(in, out\\)`"):
        loraify(kernel, rank=2, key=jr.key(1), where="kernel", dora=True)
    dora = DoraArray(randn(0, (4, 6)), rank=2, key=jr.key(1))
    with pytest.raises(ValueError, match="stored `\\(in, out\\)`"):
        save_peft({"kernel": dora}, tmp_path)


# transformers and peft warn about their own deprecations.
@pytest.mark.filterwarnings(
    "ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning"
)
def test_peft_reads_our_dora_adapter(tmp_path):
    # Only where torch and peft are installed (not in CI).
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    class TwoLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 48)
            self.out_proj = torch.nn.Linear(48, 32)

        def forward(self, x):
            return self.out_proj(torch.relu(self.proj(x)))

    torch.manual_seed(0)
    theirs = TwoLayer().eval()
    state = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    base_file = os.path.join(tmp_path, "base.safetensors")
    st.save_file(state, base_file)
    base = load_safetensors(two_layer(), base_file, base_names())
    model = trained_dora(loraify(base, rank=4, key=jr.key(2), dora=True))
    adapter = os.path.join(tmp_path, "adapter")
    save_peft(model, adapter, lora_alpha=8)
    peft_model = peft.PeftModel.from_pretrained(theirs, adapter).eval()
    x = np.asarray(randn(5, (5, 64)))
    with torch.no_grad():
        y = peft_model(torch.from_numpy(x)).numpy()
        merged = peft_model.merge_and_unload()
        y_merged = merged(torch.from_numpy(x)).numpy()
    close(y, quaxlike.quaxify(forward)(model, jnp.asarray(x)), 1e-4)
    close(y_merged, forward(merge(model), jnp.asarray(x)), 1e-4)
