#!/usr/bin/env python3
"""Regenerate the golden files of quantisation-aware training (QAT) under
``tests/golden/qat/``, computed by torchao's fake quantisation code.

Not part of the test suite (pytest never collects it): it needs torch and
torchao, which the test environment does not have. Run it with the reference
venv of ``make_golden.py`` plus torchao (0.18.0 for the committed files):

    /tmp/refvenv/bin/python tests/golden/make_qat.py

What torchao computes, and what each file holds (all float32, forward values
and the gradients autograd gives for a fixed cotangent ``ct``):

- ``weights.safetensors``: ``w`` ``[8, 128]`` (one all-zero group, one all-zero
  row), ``ct``, and for each grid of ``quantize`` (``int8``: codes in
  ``[-127, 127]``, a scale per row; ``int4_g32``, ``int4_g64``, ``int3_g32``,
  ``int2_g32``: codes in ``[-7, 7]``, ``[-3, 3]``, ``[-1, 1]``, a scale per
  group), ``<grid>.fq`` and ``<grid>.grad``. torchao chooses the scales with
  ``choose_qparams_affine(MappingType.SYMMETRIC_NO_CLIPPING_ERR, quant_min=-m,
  quant_max=m)`` (``absmax / m``, under ``torch.no_grad``) and fake-quantises
  with ``_fake_quantize_affine`` (``clamp(_Round(w * (1 / scale)) + 0, -m, m)
  * scale``; ``_Round`` is the straight-through rounding, the clamp's gradient
  is zero outside the range): the QAT primitives of
  ``IntxFakeQuantizer``, on quaxlike's symmetric grids (torchao's own int4
  grid is ``[-8, 7]`` with ``absmax / 7.5``).
- ``activations.safetensors``: ``x`` ``[8, 64]`` (rows of very different
  magnitudes, a zero row, an all-positive and an all-negative row, and one
  whose largest entry's code is clamped, where the STE is zero), ``ct``, and
  for 8 and 4 bits ``int<b>.fq`` and ``int<b>.grad`` from
  ``IntxFakeQuantizer(IntxFakeQuantizeConfig(int<b>, "per_token",
  is_symmetric=False, scale_precision=float32, zero_point_precision=float32,
  eps=finfo(float32).eps))``, the activation config of torchao's
  ``Int8DynActInt4WeightQATQuantizer`` (torchtune's QAT recipe) for 8 bits.
- ``linear.safetensors``: torchao's ``FakeQuantizedLinear(64, 16, bias=True)``
  with the 8-bit per-token activation config above and, as its weight fake
  quantiser, the ``int4_g32`` grid above: ``weight``, ``bias``, ``x`` ``[5,
  64]``, ``ct``, ``y``, and the gradients ``grad_weight``, ``grad_bias``,
  ``grad_x``.

Everything is seeded and single-threaded; ``MANIFEST.json`` lists the versions
and sha256 sums.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchao.quantization.qat import FakeQuantizedLinear, IntxFakeQuantizeConfig
from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer
from torchao.quantization.quant_primitives import (
    _fake_quantize_affine,
    choose_qparams_affine,
    MappingType,
)


torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

OUT = Path(__file__).resolve().parent / "qat"
GRIDS = {  # name: (code_max, group size or None for a row)
    "int8": (127, None),
    "int4_g32": (7, 32),
    "int4_g64": (7, 64),
    "int3_g32": (3, 32),
    "int2_g32": (1, 32),
}


class GridFakeQuantizer(torch.nn.Module):
    """quaxlike's symmetric grid through torchao's QAT primitives."""

    def __init__(self, code_max: int, group_size: int | None):
        super().__init__()
        self.code_max, self.group_size = code_max, group_size

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        block = (1, self.group_size or w.shape[-1])
        scale, zero = choose_qparams_affine(
            w,
            MappingType.SYMMETRIC_NO_CLIPPING_ERR,
            block,
            torch.int8,
            quant_min=-self.code_max,
            quant_max=self.code_max,
        )
        assert not scale.requires_grad  # chosen under torch.no_grad
        return _fake_quantize_affine(
            w, block, scale, zero, torch.int8, -self.code_max, self.code_max
        )


def activation_config(bits: int) -> IntxFakeQuantizeConfig:
    return IntxFakeQuantizeConfig(
        {8: torch.int8, 4: torch.int4}[bits],
        "per_token",
        is_symmetric=False,
        scale_precision=torch.float32,
        zero_point_precision=torch.float32,
        eps=torch.finfo(torch.float32).eps,
    )


def forward_and_grad(fn, x: torch.Tensor, ct: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    (grad,) = torch.autograd.grad(y, x, ct)
    return y.detach(), grad


def weights(generator: torch.Generator) -> dict:
    w = torch.randn(8, 128, generator=generator) * 0.1
    w[2, 32:64] = 0.0  # an all-zero group
    w[5] = 0.0  # an all-zero row
    w[6, 3] = 1.5  # an outlier
    ct = torch.randn(8, 128, generator=generator)
    tensors = {"w": w, "ct": ct}
    for name, (code_max, group_size) in GRIDS.items():
        fq, grad = forward_and_grad(GridFakeQuantizer(code_max, group_size), w, ct)
        tensors[f"{name}.fq"], tensors[f"{name}.grad"] = fq, grad
    return tensors


def _tokens(n: int, features: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, features, generator=generator)
    x = x * torch.tensor([0.01, 0.5, 1.0, 3.0, 40.0, 1.0, 1.0, 1.0][:n])[:, None]
    x[1] = 0.0
    if n > 6:
        x[5] = x[5].abs() + 0.5  # all positive: the zero point at qmin
        x[6] = -x[6].abs() - 0.5  # all negative
    if n > 7:
        # min -1.5 and max 253.5: the 8-bit scale is exactly 1, the zero point
        # -128 - round(-1.5) = -126, and the max's code round(253.5) - 126 = 128
        # is clamped to 127: torchao's STE is zero there.
        x[7] = torch.linspace(-1.5, 253.5, features)
    return x


def activations(generator: torch.Generator) -> dict:
    x = _tokens(8, 64, generator)
    ct = torch.randn(8, 64, generator=generator)
    tensors = {"x": x, "ct": ct}
    for bits in (8, 4):
        quantizer = IntxFakeQuantizer(activation_config(bits))
        fq, grad = forward_and_grad(quantizer, x, ct)
        tensors[f"int{bits}.fq"], tensors[f"int{bits}.grad"] = fq, grad
    return tensors


def linear(generator: torch.Generator) -> dict:
    layer = FakeQuantizedLinear(
        64,
        16,
        bias=True,
        activation_config=activation_config(8),
        weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=32),
    )
    layer.weight_fake_quantizer = GridFakeQuantizer(*GRIDS["int4_g32"])
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 64, generator=generator) * 0.2)
        layer.bias.copy_(torch.randn(16, generator=generator) * 0.1)
    x = _tokens(5, 64, generator).requires_grad_(True)
    ct = torch.randn(5, 16, generator=generator)
    y = layer(x)
    grad_weight, grad_bias, grad_x = torch.autograd.grad(y, (layer.weight, layer.bias, x), ct)
    return {
        "weight": layer.weight.detach().clone(),
        "bias": layer.bias.detach().clone(),
        "x": x.detach(),
        "ct": ct,
        "y": y.detach(),
        "grad_weight": grad_weight,
        "grad_bias": grad_bias,
        "grad_x": grad_x,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, make, seed in (
        ("weights", weights, 0),
        ("activations", activations, 1),
        ("linear", linear, 2),
    ):
        tensors = make(torch.Generator().manual_seed(seed))
        save_file({k: v.contiguous() for k, v in tensors.items()}, OUT / f"{name}.safetensors")
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(OUT.glob("*.safetensors"))
    }
    manifest = {
        "versions": {k: metadata.version(k) for k in ("torch", "torchao", "safetensors")},
        "grids": {k: {"code_max": m, "group_size": g} for k, (m, g) in GRIDS.items()},
        "activations": "IntxFakeQuantizeConfig(int8 | int4, 'per_token', is_symmetric=False, "
        "scale_precision=float32, zero_point_precision=float32, eps=finfo(float32).eps)",
        "sha256": files,
    }
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
