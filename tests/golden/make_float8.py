#!/usr/bin/env python3
"""Regenerate the golden float8-training files under ``tests/golden/float8/``.

This script is NOT part of the test suite and is never imported by it. It needs
PyTorch, torchao and peft, which the test environment does not have; it was run
with the reference virtual environment of ``make_golden.py`` plus torchao:

    /tmp/refvenv/bin/pip install "torch==2.13.0" torchao==0.18.0 peft==0.21.2

Run:

    /tmp/refvenv/bin/python tests/golden/make_float8.py

What it writes, every tensor computed by the libraries themselves on CPU:

- ``{recipe}_{dtype}.npz`` for recipe ``tensorwise`` and ``rowwise``
  (``Float8LinearConfig.from_recipe_name(recipe)`` with ``emulate=True``, through
  ``convert_to_float8_training``) and dtype ``float32`` and ``bfloat16``: a
  ``Linear(32, 32)`` layer's weight and bias, an input ``x`` ``(3, 7, 32)``, a
  cotangent ``g`` of the output, the output, and the gradients of ``x``, the
  weight and the bias after ``out.backward(g)``. Also the float8 casts torchao
  makes of the input and of the transposed weight for the forward matmul
  (``hp_tensor_to_float8_dynamic`` with the recipe's cast configs): their bits
  (``uint8``) and their scales.
- ``lora_tensorwise_float32.npz``: PEFT's LoRA (rank 4, alpha 8, ``B`` not zero)
  over that float8 layer (PEFT wraps ``Float8Linear``, an ``nn.Linear``
  subclass, as any Linear): ``lora_A``, ``lora_B``, the scaling, the output and
  the gradients of ``x``, ``lora_A`` and ``lora_B`` (the base weight frozen).

bfloat16 tensors are stored as float32 (exact). Inputs have rows and columns of
very different magnitudes so that rowwise and tensorwise scales differ, and a few
large entries so that the casts saturate nothing but use the whole range.
Everything is seeded and single-threaded; ``MANIFEST.json`` lists the versions
and a sha256 per file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib import metadata
from pathlib import Path

import numpy as np
import torch


torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

OUT = Path(__file__).resolve().parent / "float8"
IN_FEATURES, OUT_FEATURES, BATCH = 32, 32, (3, 7)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _inputs(dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) * 0.1)
        # rows of the weight (output channels) on different scales
        layer.weight.mul_(torch.logspace(-1, 1, OUT_FEATURES)[:, None])
        layer.bias.copy_(torch.randn(OUT_FEATURES, generator=gen))
    x = torch.randn(*BATCH, IN_FEATURES, generator=gen)
    x = x * torch.logspace(-2, 2, BATCH[1])[None, :, None]  # tokens on different scales
    x[0, 0, 5] = 300.0  # one outlier
    g = torch.randn(*BATCH, OUT_FEATURES, generator=gen)
    g = g * torch.logspace(-3, 1, OUT_FEATURES)  # output channels on different scales
    return layer.to(dtype), x.to(dtype), g.to(dtype)


def _config(recipe: str):
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def _casts(recipe: str, x: torch.Tensor, weight: torch.Tensor) -> dict[str, np.ndarray]:
    """torchao's float8 casts of the forward matmul's operands, as
    `matmul_with_hp_or_float8_args.forward` makes them."""
    from torchao.float8.float8_scaling_utils import (
        get_maybe_axiswise_dim,
        hp_tensor_to_float8_dynamic,
    )
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    c = _config(recipe)
    out = {}
    for name, tensor, cc, dim, role in (
        ("x", x, c.cast_config_input, -1, GemmInputRole.INPUT),
        ("weight_t", weight.t(), c.cast_config_weight, 0, GemmInputRole.WEIGHT),
    ):
        f8 = hp_tensor_to_float8_dynamic(
            tensor,
            cc.target_dtype,
            LinearMMConfig(),
            gemm_input_role=role,
            scaling_granularity=cc.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(dim, cc.scaling_granularity),
            round_scales_to_power_of_2=c.round_scales_to_power_of_2,
        )
        out[f"cast_{name}_bits"] = f8._data.view(torch.uint8).numpy().copy()
        out[f"cast_{name}_scale"] = _np(f8._scale)
    return out


def float8_case(recipe: str, dtype: torch.dtype) -> dict[str, np.ndarray]:
    from torchao.float8 import convert_to_float8_training

    layer, x, g = _inputs(dtype, seed=0)
    model = torch.nn.Sequential(layer)
    convert_to_float8_training(model, config=_config(recipe))
    assert type(model[0]).__name__ == "Float8Linear"
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward(g)
    case = {
        "weight": _np(model[0].weight),
        "bias": _np(model[0].bias),
        "x": _np(x),
        "g": _np(g),
        "out": _np(out),
        "grad_x": _np(x.grad),
        "grad_weight": _np(model[0].weight.grad),
        "grad_bias": _np(model[0].bias.grad),
    }
    case.update(_casts(recipe, x.detach(), model[0].weight.detach()))
    return case


def lora_case() -> dict[str, np.ndarray]:
    from peft import get_peft_model, LoraConfig
    from torchao.float8 import convert_to_float8_training

    layer, x, g = _inputs(torch.float32, seed=1)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = layer

        def forward(self, x):
            return self.proj(x)

    net = Net()
    convert_to_float8_training(net, config=_config("tensorwise"))
    assert type(net.proj).__name__ == "Float8Linear"
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], init_lora_weights=False)
    peft_model = get_peft_model(net, config)
    lora = peft_model.base_model.model.proj
    assert type(lora.base_layer).__name__ == "Float8Linear"
    x = x.clone().requires_grad_(True)
    out = peft_model(x)
    out.backward(g)
    return {
        "weight": _np(lora.base_layer.weight),
        "bias": _np(lora.base_layer.bias),
        "lora_A": _np(lora.lora_A["default"].weight),
        "lora_B": _np(lora.lora_B["default"].weight),
        "scaling": np.asarray(lora.scaling["default"], np.float32),
        "x": _np(x),
        "g": _np(g),
        "out": _np(out),
        "grad_x": _np(x.grad),
        "grad_lora_A": _np(lora.lora_A["default"].weight.grad),
        "grad_lora_B": _np(lora.lora_B["default"].weight.grad),
    }


def main() -> None:
    OUT.mkdir(exist_ok=True)
    files = {}
    for recipe in ("tensorwise", "rowwise"):
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            files[f"{recipe}_{name}.npz"] = float8_case(recipe, dtype)
    files["lora_tensorwise_float32.npz"] = lora_case()
    manifest = {
        "versions": {p: metadata.version(p) for p in ("torch", "torchao", "peft", "numpy")},
        "files": {},
    }
    for name, arrays in files.items():
        path = OUT / name
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        manifest["files"][name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    print("wrote", ", ".join(sorted(files)))


if __name__ == "__main__":
    main()
