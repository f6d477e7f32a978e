#!/usr/bin/env python3
"""Regenerate the golden files of the MX and NVFP4 storage types under
``tests/golden/microscaling/``.

Not a test module: it needs torch, torchao and compressed-tensors, which the
test environment does not have. Run it with the reference venv (see the top of
``make_golden.py`` for how it was made; torchao 0.18.0 was added to it):

    /tmp/refvenv/bin/python tests/golden/make_microscaling.py

Every tensor written here was computed by the library itself:

- ``torchao_mx.safetensors``: ``torchao.prototype.mx_formats.mx_tensor.to_mx``
  (codes and E8M0 scales) and ``to_dtype`` (the dequantised weight), for
  mxfp8 (``float8_e4m3fn`` elements) and mxfp4 (``float4_e2m1fn_x2``), in the
  scale calculation modes FLOOR (``to_mx``'s default), RCEIL (the default of
  torchao's ``MXDynamicActivationMXWeightConfig``) and EVEN, on float32 and
  bfloat16 weights;
- ``torchao_nvfp4.safetensors``: ``NVFP4Tensor.to_nvfp4`` with and without the
  per-tensor scale ``per_tensor_amax_to_scale(amax)`` (what
  ``NVFP4WeightOnlyConfig`` passes), and ``.dequantize``;
- ``ct_nvfp4/``, ``ct_mxfp4/`` and ``ct_mxfp8/``: compressed-tensors checkpoints
  (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``, ``mxfp8-quantized``) written by
  ``ModelCompressor.compress_model`` after the weights were calibrated as
  llm-compressor's min-max observer does (``generate_gparam`` for NVFP4's global
  scale, ``calculate_qparams`` per group); the reference is the compressor's own
  ``decompress`` and the decompressed model's forward.

Everything is seeded and single-threaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file


torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

HERE = Path(__file__).resolve().parent
OUT = HERE / "microscaling"


def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path), metadata=metadata)


def dump_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def special_weight() -> torch.Tensor:
    """A float32 weight `(16, 64)` (two blocks of 32 per row, four of 16) with
    blocks that exercise the edge cases: an all-zero block, ties between
    neighbouring e4m3 and e2m1 values, block maxima just under a power of two
    (where FLOOR, RCEIL and EVEN differ), tiny and huge magnitudes, negative
    zeros; the other rows normal draws at several magnitudes."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(16, 64, generator=g)
    w[0, :32] = 0.0
    w[0, 40] = -0.0
    # e2m1 ties (scale 1 under FLOOR with a block maximum of 4) and e4m3 ties.
    ties4 = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75])
    w[1, : ties4.numel()] = ties4
    w[1, 31] = 5.5
    e4m3 = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = e4m3[torch.isfinite(e4m3)]
    pos = torch.unique(finite[finite > 0])
    mids = (pos[:-1] + pos[1:]) / 2  # exact in float32
    w[2, :] = mids[torch.linspace(0, mids.numel() - 1, 64).long()] / 2**8 * 1.0
    w[2, 0] = 448.0 / 2**8  # block maximum 1.75: FLOOR scale 2^-8
    w[2, 32] = 448.0 / 2**8
    w[3, :32] *= 1e-3
    w[3, 5] = 7.5  # FLOOR vs EVEN differ
    w[3, 32:] *= 1e3
    w[3, 40] = 1.9 * 2**12
    w[4, :32] *= 1e-30
    w[4, 32:] *= 2.0**-100
    w[5] *= 0.02
    w[5, 3] = 1.97  # EVEN rounds an e4m3 block maximum of 1.97 up to 2
    w[6] = w[6].abs() * -1
    w[7, 16:32] = 6.0 * 2.0**-3  # NVFP4 block with an exact maximum
    return w


def make_torchao() -> dict:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        NVFP4Tensor,
        per_tensor_amax_to_scale,
    )

    w32 = special_weight()
    g = torch.Generator().manual_seed(99)
    w16 = (torch.randn(8, 64, generator=g) * 0.05).to(torch.bfloat16)
    ref: dict[str, torch.Tensor] = {"w_f32": w32, "w_bf16": w16}
    modes = {
        "floor": ScaleCalculationMode.FLOOR,
        "rceil": ScaleCalculationMode.RCEIL,
        "even": ScaleCalculationMode.EVEN,
    }
    elems = {"mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}
    for wname, w in (("f32", w32), ("bf16", w16)):
        for ename, elem in elems.items():
            for mname, mode in modes.items():
                scale, data = to_mx(w, elem, 32, mode)
                deq = to_dtype(data, scale, elem, 32, w.dtype)
                key = f"{ename}.{mname}.{wname}"
                ref[f"{key}.codes"] = data.view(torch.uint8)
                ref[f"{key}.scale"] = scale.view(torch.uint8)
                ref[f"{key}.dequant"] = deq
    for wname, w in (("f32", w32), ("bf16", w16)):
        for tname, pts in (
            ("tensor", per_tensor_amax_to_scale(torch.max(torch.abs(w)))),
            ("block", None),
        ):
            t = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=pts)
            key = f"nvfp4.{tname}.{wname}"
            ref[f"{key}.codes"] = t.qdata.view(torch.uint8)
            ref[f"{key}.scale"] = t.scale.view(torch.uint8)
            if pts is not None:
                ref[f"{key}.per_tensor_scale"] = pts.reshape(1)
            ref[f"{key}.dequant"] = t.dequantize(w.dtype)
            ref[f"{key}.dequant_f32"] = t.dequantize(torch.float32)
    save(OUT / "torchao.safetensors", ref)
    return ref


class _OneProj(nn.Module):
    def __init__(self, in_f, out_f):
        super().__init__()
        self.proj = nn.Linear(in_f, out_f)

    def forward(self, x):
        return self.proj(x)


def make_compressed_tensors() -> list[str]:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import (
        apply_quantization_config,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    IN, OUT_F = 64, 48
    written = []
    cases = [
        ("ct_nvfp4", "NVFP4A16", NVFP4PackedCompressor, torch.bfloat16),
        ("ct_mxfp4", "MXFP4A16", MXFP4PackedCompressor, torch.bfloat16),
        ("ct_mxfp8", "MXFP8A16", MXFP8QuantizationCompressor, torch.bfloat16),
    ]
    for i, (name, preset, compressor, dtype) in enumerate(cases):
        g = torch.Generator().manual_seed(5000 + i)
        m = _OneProj(IN, OUT_F)
        with torch.no_grad():
            m.proj.weight.copy_(torch.randn(OUT_F, IN, generator=g) * 0.05)
            m.proj.weight[3, :] *= 20.0  # rows of very different magnitudes
            m.proj.bias.copy_(torch.randn(OUT_F, generator=g) * 0.1)
        x = torch.randn(3, IN, generator=g)
        m = m.to(dtype)
        w_original = m.proj.weight.detach().clone()
        scheme = preset_name_to_scheme(preset, ["Linear"])
        qconfig = QuantizationConfig(
            config_groups={"group_0": QuantizationScheme(**scheme.model_dump())}
        )
        apply_quantization_config(m, qconfig)
        args = m.proj.quantization_scheme.weights
        w = m.proj.weight.data
        gs = args.group_size
        wg = w.unflatten(-1, (IN // gs, gs))
        mn, mx = wg.amin(-1), wg.amax(-1)
        global_scale = None
        if hasattr(m.proj, "weight_global_scale"):
            global_scale = generate_gparam(w.amin(), w.amax())
            with torch.no_grad():
                m.proj.weight_global_scale.copy_(global_scale)
        s, z = calculate_qparams(mn, mx, args, global_scale=global_scale)
        with torch.no_grad():
            m.proj.weight_scale.copy_(s)
            m.proj.weight_zero_point.copy_(z)
        mc = ModelCompressor.from_pretrained_model(m)
        mc.compress_model(m)
        case_dir = OUT / name
        if case_dir.exists():
            shutil.rmtree(case_dir)
        case_dir.mkdir(parents=True)
        sd = dict(m.state_dict())
        save(case_dir / "model.safetensors", sd, metadata={"format": "pt"})
        dump_json(
            case_dir / "config.json", {"architectures": ["_OneProj"], "model_type": "golden_tiny"}
        )
        mc.update_config(str(case_dir))
        with open(case_dir / "config.json") as f:
            dump_json(case_dir / "config.json", json.load(f))
        sd_file = load_file(str(case_dir / "model.safetensors"))
        local = {k[len("proj.") :]: v for k, v in sd_file.items() if k.startswith("proj.")}
        dec = compressor.decompress(dict(local), m.proj.quantization_scheme)
        with torch.no_grad():
            y = m(x.to(dtype))
        if not torch.equal(m.proj.weight.data, dec["weight"].to(m.proj.weight.dtype)):
            raise AssertionError(f"{name}: decompress_model and decompress differ")
        ref = {"weight": dec["weight"], "x": x, "y": y.float(), "w_original": w_original}
        save(OUT / f"{name}.reference.safetensors", ref)
        written.append(name)
    return written


def main() -> None:
    from importlib import metadata

    OUT.mkdir(parents=True, exist_ok=True)
    make_torchao()
    cases = make_compressed_tensors()
    versions = {name: metadata.version(name) for name in ("torch", "torchao", "compressed-tensors")}
    dump_json(OUT / "MANIFEST.json", {"versions": versions, "compressed_tensors": cases})
    print("written", sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
