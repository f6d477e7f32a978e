#!/usr/bin/env python3
"""Regenerate the golden files of int8 dynamic activations x int8 weights (W8A8)
under ``tests/golden/w8a8/``, computed by torchao.

Not part of the test suite (pytest never collects it): it needs torch and
torchao, which the test environment does not have. Run it with the reference
venv of ``make_golden.py`` plus torchao (0.18.0 for the committed files):

    /tmp/refvenv/bin/python tests/golden/make_w8a8.py

What torchao computes, and what each file holds:

- ``quantize_(linear, Int8DynamicActivationInt8WeightConfig())`` (version 2,
  per-row granularity, symmetric activations) turns the weight into an
  ``Int8Tensor``: ``qdata`` (int8 codes, ``[out, in]``) and ``scale`` (float32,
  ``[out, 1]``), from ``choose_qparams_affine`` (``absmax / 127.5`` in the
  weight's dtype, clamped below at float32's eps) and ``quantize_affine``
  (``clamp(round(w * (1 / scale)), -128, 127)``).
- Its forward quantises each row of the input the same way (one scale per
  token), multiplies the int8 codes with ``torch._int_mm`` (int32), scales by
  the activations' scales (float32), casts to the input's dtype, scales by the
  weight's scales and adds the bias.

Each case ``<case>.safetensors`` holds ``weight`` (the float weight, as float32:
exact for bf16), ``bias``, ``qdata`` (torchao's weight codes), ``w_scale``
(float32 ``[out]``), ``x`` (float32, exact for bf16), ``x_qdata``, ``x_scale``
(torchao's own quantisation of ``x``: ``Int8Tensor.from_hp(x, PerRow())``),
and ``y`` (the quantised ``Linear``'s output, as float32). Everything is seeded
and single-threaded; ``MANIFEST.json`` lists the versions and sha256 sums.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
from torchao.quantization.granularity import PerRow
from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor


torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

OUT = Path(__file__).resolve().parent / "w8a8"


def _inputs(in_features: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Rows of very different magnitudes (per-token scales matter), a row of
    zeros (the eps clamp), and a row whose largest entry is negative."""
    x = torch.randn(6, in_features, generator=generator)
    x = x * torch.tensor([0.01, 0.5, 1.0, 3.0, 40.0, 1.0])[:, None]
    x[1] = 0.0
    x[5, 7] = -10.0
    return x.to(dtype)


def case(name: str, dtype: torch.dtype, out_features: int, in_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) * 0.2)
        linear.weight[3] = 0.0  # an all-zero output row
        linear.bias.copy_(torch.randn(out_features, generator=generator) * 0.1)
    linear = linear.to(dtype)
    weight = linear.weight.detach().clone()
    bias = linear.bias.detach().clone()
    x = _inputs(in_features, dtype, generator)
    x3 = x.reshape(2, 3, in_features)  # leading token axes, flattened by torchao

    quantize_(linear, Int8DynamicActivationInt8WeightConfig())
    w = linear.weight
    assert isinstance(w, Int8Tensor) and w.act_quant_kwargs is not None
    with torch.no_grad():
        y = linear(x)
        y3 = linear(x3)
    assert torch.equal(y3.reshape(y.shape), y)
    act = Int8Tensor.from_hp(x, PerRow())  # the activations' quantisation alone
    assert act.scale.dtype == torch.float32
    tensors = {
        "weight": weight.float(),
        "bias": bias.float(),
        "qdata": w.qdata.contiguous(),
        "w_scale": w.scale.reshape(-1).float().contiguous(),
        "x": x.float(),
        "x_qdata": act.qdata.contiguous(),
        "x_scale": act.scale.reshape(-1).contiguous(),
        "y": y.float(),
    }
    save_file(tensors, OUT / f"{name}.safetensors", metadata={"dtype": str(dtype)})
    return {"dtype": str(dtype), "out": out_features, "in": in_features}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    cases = {
        "w8a8_f32": case("w8a8_f32", torch.float32, 48, 64, 0),
        "w8a8_bf16": case("w8a8_bf16", torch.bfloat16, 48, 64, 1),
        "w8a8_f32_wide": case("w8a8_f32_wide", torch.float32, 16, 256, 2),
    }
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(OUT.glob("*.safetensors"))
    }
    manifest = {
        "versions": {k: metadata.version(k) for k in ("torch", "torchao", "safetensors")},
        "config": "Int8DynamicActivationInt8WeightConfig() (version 2, PerRow, symmetric)",
        "cases": cases,
        "sha256": files,
    }
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
