#!/usr/bin/env python3
"""Regenerate the golden checkpoint files under ``tests/golden/checkpoints/``.

This script is NOT part of the test suite and is never imported by it.  It
needs PyTorch and the reference libraries, which the test environment does
not have.  It was run in a throw-away virtual environment made like this
(Python 3.11, CPU-only torch; pin torch in *every* pip command so that pip
never swaps in a multi-GB CUDA build):

    python3.11 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install "torch==2.13.0"
    /tmp/refvenv/bin/pip install "torch==2.13.0" bitsandbytes peft \
        compressed-tensors safetensors transformers
    /tmp/refvenv/bin/pip install "torch==2.13.0" gptqmodel autoawq optimum

(``optimum`` is only there because peft refuses to dispatch any LoRA layer
when gptqmodel is installed without it.)  Versions used for the committed
files are recorded in ``checkpoints/MANIFEST.json`` and in ``README.md``.

Run:

    /tmp/refvenv/bin/python tests/golden/make_golden.py

Everything is seeded and single-threaded; two runs on the same library
versions produce byte-identical files (MANIFEST.json lists sha256 sums).

Every reference tensor saved here was computed by the library itself
(bitsandbytes ``dequantize_4bit``, GPTQModel ``TorchLinear.dequantize_weight``,
AutoAWQ ``dequantize_gemm``, compressed-tensors ``decompress``, PEFT
forward/backward/merge).  The layout files are written by the library's own
packing / saving code.  Where this script has to glue pieces together (e.g.
calling a quantiser on a single layer instead of a whole model), the README
says exactly which library function was called.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path


# PEFT stores target_modules as a set, so adapter_config.json's list order depends on
# string hashing: re-run ourselves with a fixed hash seed to make the output reproducible.
if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, *sys.argv])

# Must be set before gptqmodel is imported: use the pure-python block packer
# (no JIT-compiled C++ extension) so that regeneration needs no compiler.
os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")
os.environ.setdefault("GPTQ_TORCH_TRITON_DEQUANT", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

HERE = Path(__file__).resolve().parent
OUT = HERE / "checkpoints"

VERSIONS: dict[str, str] = {}


def _version(mod_name: str, dist_name: str | None = None) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist_name or mod_name)
    except Exception as exc:  # pragma: no cover
        return f"unavailable ({exc})"


def seed(n: int) -> torch.Generator:
    torch.manual_seed(n)
    g = torch.Generator().manual_seed(n)
    return g


def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path), metadata=metadata)


def dump_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def assert_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
        diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
        raise AssertionError(
            f"{what}: mismatch ({a.shape}/{a.dtype} vs {b.shape}/{b.dtype}, max diff {diff})"
        )


# ---------------------------------------------------------------------------
# A tiny transformers model with a single Linear called ``proj``.
# Used so that bitsandbytes files are written by transformers' own
# ``from_pretrained(quantization_config=BitsAndBytesConfig(...))`` +
# ``save_pretrained`` path, with state-dict keys ``proj.*``.
# ---------------------------------------------------------------------------


def _tiny_transformers_classes():
    from transformers import PretrainedConfig, PreTrainedModel

    class GoldenTinyConfig(PretrainedConfig):
        model_type = "golden_tiny"

        def __init__(self, in_features=64, out_features=48, **kw):
            self.in_features = in_features
            self.out_features = out_features
            super().__init__(**kw)

    class GoldenTiny(PreTrainedModel):
        config_class = GoldenTinyConfig
        base_model_prefix = ""

        def __init__(self, config):
            super().__init__(config)
            self.proj = nn.Linear(config.in_features, config.out_features)
            self.post_init()

        def _init_weights(self, module):  # weights are set explicitly
            pass

        def forward(self, x):
            return self.proj(x)

    return GoldenTinyConfig, GoldenTiny


def bnb_quantized_tiny(
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    quant_type: str,
    double_quant: bool,
    dtype: torch.dtype,
    tmp: Path,
):
    """Quantise ``proj`` through transformers + bitsandbytes; return the loaded quantised model."""
    from transformers import BitsAndBytesConfig

    Cfg, Tiny = _tiny_transformers_classes()
    out_f, in_f = weight.shape
    m = Tiny(Cfg(in_features=in_f, out_features=out_f))
    with torch.no_grad():
        m.proj.weight.copy_(weight)
        m.proj.bias.copy_(bias)
    m = m.to(dtype)
    fdir = tmp / "float"
    if fdir.exists():
        shutil.rmtree(fdir)
    m.save_pretrained(fdir)
    qcfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
    )
    q = Tiny.from_pretrained(fdir, quantization_config=qcfg, device_map="cpu", dtype=dtype)
    q.eval()
    return q


# ---------------------------------------------------------------------------
# bitsandbytes 4-bit
# ---------------------------------------------------------------------------


def make_bnb(tmp: Path) -> list[str]:
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from bitsandbytes.backends.default import ops as default_ops
    from bitsandbytes.backends.utils import _get_4bit_code

    cases = [
        # name, quant_type, double_quant, dtype, (out, in)
        ("bnb_nf4", "nf4", False, torch.float32, (48, 64)),
        ("bnb_fp4", "fp4", False, torch.float32, (48, 64)),
        ("bnb_nf4_dq", "nf4", True, torch.float32, (48, 64)),
        ("bnb_fp4_dq", "fp4", True, torch.float32, (48, 64)),
        ("bnb_nf4_dq_bf16", "nf4", True, torch.bfloat16, (48, 64)),
        # 260 absmax blocks -> 2 nested blocks of 256 (second one partial)
        # (float16 weights: also covers quant_state dtype "float16", and halves the reference size)
        ("bnb_nf4_dq_2nested_fp16", "nf4", True, torch.float16, (20, 832)),
        # 45*70 = 3150 elements: 49 full 64-blocks + a partial block of 14
        ("bnb_nf4_dq_ragged", "nf4", True, torch.float32, (45, 70)),
    ]
    written = []
    for i, (name, qt, dq, dtype, (out_f, in_f)) in enumerate(cases):
        g = seed(1000 + i)
        w = torch.randn(out_f, in_f, generator=g) * 0.05
        # a few large outliers so absmax varies a lot between blocks
        w[torch.rand(out_f, in_f, generator=g) < 0.01] *= 8.0
        b = torch.randn(out_f, generator=g) * 0.1
        x = torch.randn(3, in_f, generator=g)

        q = bnb_quantized_tiny(w, b, quant_type=qt, double_quant=dq, dtype=dtype, tmp=tmp)
        assert isinstance(q.proj, bnb.nn.Linear4bit), type(q.proj)
        case_dir = OUT / "bnb" / name
        if case_dir.exists():
            shutil.rmtree(case_dir)
        q.save_pretrained(case_dir)
        # the saved layout file, re-read from disk
        sd = load_file(str(case_dir / "model.safetensors"))

        # Reference: rebuild QuantState from the saved tensors with the library's
        # own QuantState.from_dict and call bitsandbytes.functional.dequantize_4bit.
        qs_dict = {
            k[len("proj.weight.") :]: v for k, v in sd.items() if k.startswith("proj.weight.")
        }
        qs = F.QuantState.from_dict(qs_dict, device=torch.device("cpu"))
        deq = F.dequantize_4bit(sd["proj.weight"], qs)
        assert deq.shape == (out_f, in_f) and deq.dtype == dtype
        # ... equal to dequantising the live module's quant state
        assert_equal(
            F.dequantize_4bit(q.proj.weight.data, q.proj.weight.quant_state), deq, name + " live"
        )
        # ... and equal to bitsandbytes' pure-torch "default" backend kernel
        absmax = qs.absmax
        if qs.nested:
            absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
            absmax = absmax.float()
        default_fn = getattr(
            default_ops._dequantize_4bit_compute,
            "__wrapped__",
            default_ops._dequantize_4bit_compute,
        )
        deq_default = default_fn(
            sd["proj.weight"].reshape(-1),
            absmax,
            _get_4bit_code(qt, torch.device("cpu")),
            qs.blocksize,
            qs.shape,
            qs.dtype,
        )
        assert_equal(deq_default, deq, name + " default-backend")
        with torch.no_grad():
            y = q(x.to(dtype))
        ref = {
            "weight": deq,  # [out, in] in quant_state.dtype, exactly as the library returns it
            "x": x,
            "y": y.float(),  # Linear4bit forward (x cast to the compute dtype first)
            "bias": q.proj.bias.detach().float(),
            "absmax_dequant": absmax.float(),  # per-64-block absmax as the library uses it
            "code": _get_4bit_code(qt, torch.device("cpu")),  # the kernel's 16-entry table
        }
        save(OUT / "bnb" / f"{name}.reference.safetensors", ref)
        written.append(name)
    return written


# ---------------------------------------------------------------------------
# GPTQ (GPTQModel)
# ---------------------------------------------------------------------------


def make_gptq() -> list[str]:
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.quantization.gptq import GPTQ
    from gptqmodel.utils.model import (
        convert_gptq_v1_to_v2_format_module,
        convert_gptq_v2_to_v1_format_module,
    )

    IN, OUT_F = 128, 64  # GPTQModel's block packer needs in % 32 == 0 and out % 32 == 0
    cases = [
        # name, bits, group, desc_act, sym, zero0 (force some groups to zero point 0)
        ("gptq_4bit_g32_sym", 4, 32, False, True, False),
        ("gptq_4bit_g32_asym_actorder", 4, 32, True, False, False),
        ("gptq_4bit_g64_sym_actorder", 4, 64, True, True, False),
        ("gptq_8bit_g64_asym", 8, 64, False, False, False),
        ("gptq_8bit_g32_sym_actorder", 8, 32, True, True, False),
        ("gptq_4bit_g32_asym_zero0", 4, 32, False, False, True),
    ]
    written = []
    for i, (name, bits, gs, desc, sym, zero0) in enumerate(cases):
        g = seed(2000 + i)
        lin = nn.Linear(IN, OUT_F)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(OUT_F, IN, generator=g) * 0.05)
            lin.bias.copy_(torch.randn(OUT_F, generator=g) * 0.1)
            if zero0:
                # all-positive first group for even output rows -> xmin = 0 -> zero point 0
                lin.weight[0::2, :gs] = lin.weight[0::2, :gs].abs()
        # calibration activations with very different per-channel scales so that
        # act-order produces a non-trivial permutation
        chan = torch.exp(torch.randn(IN, generator=g))
        calib = torch.randn(8, 16, IN, generator=g) * chan
        x = torch.randn(3, IN, generator=g)

        qcfg = QuantizeConfig(
            bits=bits,
            group_size=gs,
            desc_act=desc,
            sym=sym,
            act_group_aware=False,
            offload_to_disk=False,
        )
        gq = GPTQ(lin, qcfg)
        gq.quantizer.configure(perchannel=True)  # what GPTQModel's GPTQProcessor does
        with torch.no_grad():
            gq.add_batch(calib, lin(calib))
        scale, zero, g_idx, *_ = gq.hf_quantize(group_size=gs, actorder=desc, act_group_aware=False)
        # lin.weight now holds GPTQ's fake-quantised weight Q
        if zero0:
            assert (zero == 0).any(), "zero0 case did not produce a zero point of 0"

        def new_module():
            return TorchLinear(
                bits=bits,
                group_size=gs,
                sym=sym,
                desc_act=desc,
                in_features=IN,
                out_features=OUT_F,
                bias=True,
                pack_dtype=torch.int32,
                register_buffers=True,
            )

        ql = new_module()
        ql.pack_block(lin, scale, zero, g_idx)  # packs raw zero points (GPTQModel's internal "v2")
        # cross-check against GPTQModel's other (numpy) packer
        ql2 = new_module()
        ql2.pack_original(lin, scale, zero, g_idx.clone())
        for k in ("qweight", "qzeros", "scales", "g_idx", "bias"):
            assert_equal(getattr(ql, k), getattr(ql2, k), f"{name} pack_block vs pack_original {k}")
        keys = ("qweight", "qzeros", "scales", "g_idx", "bias")
        v2 = {f"proj.{k}": getattr(ql, k).clone() for k in keys}
        # v1 ("gptq") checkpoint format: exactly what GPTQModel's pack_module does before saving
        ql.qzero_format(2)
        convert_gptq_v2_to_v1_format_module(ql, QuantizeConfig(bits=bits, offload_to_disk=False))
        v1 = {f"proj.{k}": getattr(ql, k).clone() for k in keys}

        save(OUT / "gptq" / f"{name}.v1.safetensors", v1)
        save(OUT / "gptq" / f"{name}.v2.safetensors", v2)
        for fmt in ("gptq", "gptq_v2"):
            c = QuantizeConfig(
                bits=bits,
                group_size=gs,
                desc_act=desc,
                sym=sym,
                act_group_aware=False,
                offload_to_disk=False,
                format=fmt,
            ).to_dict()
            c.get("meta", {}).pop("offload_to_disk_path", None)
            dump_json(
                OUT / "gptq" / f"{name}.{'v1' if fmt == 'gptq' else 'v2'}.quantize_config.json", c
            )

        # Reference: load each file into a fresh GPTQModel TorchLinear the way GPTQModel
        # loads checkpoints (v1 -> convert_gptq_v1_to_v2_format_module), then dequantize_weight().
        deqs, ys = {}, {}
        for tag in ("v1", "v2"):
            sd = load_file(str(OUT / "gptq" / f"{name}.{tag}.safetensors"))
            m = new_module()
            for k in keys:
                getattr(m, k).data = sd[f"proj.{k}"].clone()
            if tag == "v1":
                convert_gptq_v1_to_v2_format_module(m, bits=bits, pack_dtype=torch.int32)
            else:
                m.qzero_format(2)
            m.eval()
            with torch.no_grad():
                deqs[tag] = m.dequantize_weight()  # [in, out] float16
                ys[tag] = m(x)  # float32 input -> float32 output
        assert_equal(deqs["v1"], deqs["v2"], name + " v1 vs v2 dequant")
        assert_equal(ys["v1"], ys["v2"], name + " v1 vs v2 forward")
        # the dequantised weight is GPTQ's fake-quantised weight up to fp16 rounding of the scale
        err = (deqs["v2"].float().T - lin.weight.float()).abs().max().item()
        assert err < 5e-3, (name, err)
        ref = {
            "weight": deqs[
                "v2"
            ].T.contiguous(),  # [out, in] float16, exactly as the library returns it
            "x": x,
            "y": ys["v2"],
            "zeros": zero.T.contiguous().to(
                torch.int32
            ),  # [groups, out] true zero points (before any -1)
        }
        save(OUT / "gptq" / f"{name}.reference.safetensors", ref)
        written.append(name)
    return written


# ---------------------------------------------------------------------------
# AWQ GEMM (AutoAWQ)
# ---------------------------------------------------------------------------


def make_awq() -> list[str]:
    from awq.models._config import AwqConfig
    from awq.modules.linear import gemm as awq_gemm
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm

    # AutoAWQ's WQLinearMMFunction prefers triton if importable; there is no GPU here,
    # so force its documented pure-torch fallback (dequantize_gemm + matmul).
    awq_gemm.TRITON_AVAILABLE = False
    awq_gemm.awq_ext = None

    # WQLinear_GEMM.from_linear sizes qweight as out // 32 * w_bit columns, so out must be a multiple of 32
    IN, OUT_F = 128, 64
    cases = [("awq_gemm_4bit_g32", 32), ("awq_gemm_4bit_g64", 64)]
    written = []
    for i, (name, gs) in enumerate(cases):
        g = seed(3000 + i)
        lin = nn.Linear(IN, OUT_F)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(OUT_F, IN, generator=g) * 0.05)
            lin.bias.copy_(torch.randn(OUT_F, generator=g) * 0.1)
        x = torch.randn(3, IN, generator=g)
        lin = lin.half()  # AwqQuantizer._apply_quant does linear_layer.half()
        # AwqQuantizer.pseudo_quantize_tensor only reads these three attributes
        qself = types.SimpleNamespace(group_size=gs, zero_point=True, w_bit=4)
        wq, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(qself, lin.weight.data)
        lin.weight.data = wq
        scales = scales.t().contiguous()  # as _apply_quant does for version "gemm"
        zeros = zeros.t().contiguous()
        ql = awq_gemm.WQLinear_GEMM.from_linear(
            lin, 4, gs, init_only=False, scales=scales, zeros=zeros
        )
        tensors = {f"proj.{k}": getattr(ql, k) for k in ("qweight", "qzeros", "scales", "bias")}
        save(OUT / "awq" / f"{name}.safetensors", tensors)
        cfg = AwqConfig(
            zero_point=True, q_group_size=gs, w_bit=4, version="gemm"
        ).to_transformers_dict()
        dump_json(OUT / "awq" / f"{name}.quantization_config.json", cfg)

        sd = load_file(str(OUT / "awq" / f"{name}.safetensors"))
        deq = dequantize_gemm(
            sd["proj.qweight"], sd["proj.qzeros"], sd["proj.scales"], 4, gs
        )  # [in, out] fp16
        m = awq_gemm.WQLinear_GEMM(4, gs, IN, OUT_F, True, "cpu")
        for k in ("qweight", "qzeros", "scales", "bias"):
            getattr(m, k).data = sd[f"proj.{k}"].clone()
        m.eval()
        with torch.no_grad():
            y = m(x)  # input cast to fp16, fp16 matmul, cast back to float32
        assert (deq.float().T - wq.float()).abs().max().item() < 2e-3
        ref = {
            "weight": deq.T.contiguous(),  # [out, in] float16, exactly as the library returns it
            "x": x,
            "y": y.float().reshape(3, OUT_F),
            "zeros": zeros.to(torch.int32),  # [groups, out] integer zero points
        }
        save(OUT / "awq" / f"{name}.reference.safetensors", ref)
        written.append(name)
    return written


# ---------------------------------------------------------------------------
# compressed-tensors pack-quantized
# ---------------------------------------------------------------------------


class _OneProj(nn.Module):
    def __init__(self, in_f, out_f):
        super().__init__()
        self.proj = nn.Linear(in_f, out_f)

    def forward(self, x):
        return self.proj(x)


def make_compressed_tensors() -> list[str]:
    from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        apply_quantization_config,
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    IN, OUT_F = 128, 48
    cases = [
        # name, bits, symmetric, strategy, group_size, dtype
        ("ct_w4_sym_group32", 4, True, "group", 32, torch.bfloat16),
        ("ct_w4_asym_group32", 4, False, "group", 32, torch.bfloat16),
        ("ct_w4_sym_channel", 4, True, "channel", None, torch.float16),
        ("ct_w4_asym_channel", 4, False, "channel", None, torch.bfloat16),
        ("ct_w8_sym_channel", 8, True, "channel", None, torch.bfloat16),
        ("ct_w8_asym_group32", 8, False, "group", 32, torch.float32),
    ]
    written = []
    for i, (name, bits, sym, strat, gs, dtype) in enumerate(cases):
        g = seed(4000 + i)
        m = _OneProj(IN, OUT_F)
        with torch.no_grad():
            m.proj.weight.copy_(torch.randn(OUT_F, IN, generator=g) * 0.05 + 0.01)
            m.proj.bias.copy_(torch.randn(OUT_F, generator=g) * 0.1)
        x = torch.randn(3, IN, generator=g)
        m = m.to(dtype)
        args = QuantizationArgs(
            num_bits=bits, type="int", symmetric=sym, strategy=strat, group_size=gs
        )
        qconfig = QuantizationConfig(
            config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}
        )
        apply_quantization_config(m, qconfig)
        # Calibrate the weight the way llm-compressor's min-max observer does:
        # per-group / per-channel min & max, then compressed-tensors' calculate_qparams.
        w = m.proj.weight.data
        if strat == "group":
            wg = w.unflatten(-1, (IN // gs, gs))
            mn, mx = wg.amin(-1), wg.amax(-1)
        else:
            mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        s, z = calculate_qparams(mn, mx, args)
        with torch.no_grad():
            m.proj.weight_scale.copy_(s)
            m.proj.weight_zero_point.copy_(z)
        true_zp = m.proj.weight_zero_point.detach().clone()
        scheme = m.proj.quantization_scheme

        mc = ModelCompressor.from_pretrained_model(m)
        mc.compress_model(m)
        case_dir = OUT / "compressed_tensors" / name
        if case_dir.exists():
            shutil.rmtree(case_dir)
        case_dir.mkdir(parents=True)
        sd = {k: v for k, v in m.state_dict().items()}
        save(case_dir / "model.safetensors", sd, metadata={"format": "pt"})
        dump_json(
            case_dir / "config.json", {"architectures": ["_OneProj"], "model_type": "golden_tiny"}
        )
        mc.update_config(
            str(case_dir)
        )  # adds quantization_config exactly as compressed-tensors writes it
        with open(
            case_dir / "config.json"
        ) as f:  # normalise formatting (sorted keys, trailing newline)
            dump_json(case_dir / "config.json", json.load(f))

        # Reference 1: PackedQuantizationCompressor.decompress on the saved per-module tensors
        sd_file = load_file(str(case_dir / "model.safetensors"))
        local = {k[len("proj.") :]: v for k, v in sd_file.items() if k.startswith("proj.")}
        dec = PackedQuantizationCompressor.decompress(dict(local), scheme)
        deq = dec["weight"]
        # Reference 2: the whole-model path (forward pre-hook -> ModelCompressor.decompress_model)
        with torch.no_grad():
            y = m(x.to(dtype))
        assert_equal(m.proj.weight.data, deq, name + " decompress_model vs decompress")
        ref = {
            "weight": deq,  # [out, in] in the scale dtype, exactly as the library returns it
            "x": x,
            "y": y.float(),
            "zero_point": true_zp,  # unpacked signed zero point (int8), [out, groups] / [out, 1]
        }
        if "weight_zero_point" in dec:
            ref["zero_point_unpacked_by_decompress"] = dec["weight_zero_point"]
        save(OUT / "compressed_tensors" / f"{name}.reference.safetensors", ref)
        written.append(name)
    return written


# ---------------------------------------------------------------------------
# PEFT DoRA / rsLoRA DoRA / QDoRA
# ---------------------------------------------------------------------------


class _TwoLayer(nn.Module):
    """proj: 64 -> 48, ReLU, out_proj: 48 -> 32."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 48)
        self.act = nn.ReLU()
        self.out_proj = nn.Linear(48, 32)

    def forward(self, x):
        return self.out_proj(self.act(self.proj(x)))


def _randomise_adapter(pm, g: torch.Generator):
    with torch.no_grad():
        for n, p in sorted(pm.named_parameters()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "lora_A" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "lora_magnitude_vector" in n:
                p.mul_(1.0 + 0.2 * torch.randn(p.shape, generator=g))


def _peft_reference(pm, x, layer_names, grad_key, quantized_base=False):
    """Forward, per-layer IO, DoRA internals and grads of sum(y**2)."""
    from peft.tuners.lora import LoraLayer

    ref = {"x": x}
    io = {}
    hooks = []
    for ln in layer_names:
        mod = pm.base_model.model.get_submodule(ln)
        assert isinstance(mod, LoraLayer)

        def hook(module, inp, out, ln=ln):
            io[ln] = (inp[0].detach().clone(), out.detach().clone())

        hooks.append(mod.register_forward_hook(hook))
    pm.train()  # dropout is 0, so train/eval give the same forward; grads need train mode
    pm.zero_grad(set_to_none=True)
    y = pm(x)
    (y**2).sum().backward()
    for h in hooks:
        h.remove()
    ref["y"] = y.detach()
    for ln in layer_names:
        ref[f"{ln}.input"], ref[f"{ln}.output"] = io[ln]
        mod = pm.base_model.model.get_submodule(ln)
        dora = mod.lora_magnitude_vector["default"]
        scaling = mod.scaling["default"]
        with torch.no_grad():
            lora_w = dora.get_lora_weight(
                lora_A=mod.lora_A["default"], lora_B=mod.lora_B["default"]
            )
            from peft.utils.integrations import dequantize_module_weight

            base_w = dequantize_module_weight(mod.get_base_layer()).float()
            norm = dora.get_weight_norm(weight=base_w, lora_weight=lora_w, scaling=scaling)
        ref[f"{ln}.scaling"] = torch.tensor([scaling], dtype=torch.float32)
        ref[f"{ln}.weight_norm"] = norm.detach()  # ||W + scaling * B @ A|| per output row (dim=1)
        if quantized_base:
            ref[f"{ln}.base_weight_dequant"] = base_w.detach()
    for n, p in pm.named_parameters():
        if p.requires_grad:
            ref["grad." + grad_key(n)] = p.grad.detach().clone()
    return ref


def _adapter_key(param_name: str) -> str:
    # "base_model.model.proj.lora_A.default.weight" -> "base_model.model.proj.lora_A.weight"
    # "...lora_magnitude_vector.default.weight"     -> "...lora_magnitude_vector"
    n = param_name.replace(".default", "")
    if n.endswith("lora_magnitude_vector.weight"):
        n = n[: -len(".weight")]
    return n


def make_peft(tmp: Path) -> list[str]:
    from peft import get_peft_model, LoraConfig, PeftModel

    written = []
    for i, (name, rslora) in enumerate([("dora", False), ("dora_rslora", True)]):
        g = seed(5000 + i)
        base = _TwoLayer()
        with torch.no_grad():
            for p in base.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        base_sd = {k: v.clone() for k, v in base.state_dict().items()}
        x = torch.randn(5, 64, generator=g)
        cfg = LoraConfig(
            r=4,
            lora_alpha=8,
            use_dora=True,
            use_rslora=rslora,
            target_modules=["proj", "out_proj"],
            lora_dropout=0.0,
            bias="none",
        )
        pm = get_peft_model(base, cfg)
        _randomise_adapter(pm, g)
        case_dir = OUT / "peft" / name
        if case_dir.exists():
            shutil.rmtree(case_dir)
        pm.save_pretrained(case_dir / "adapter")
        (case_dir / "adapter" / "README.md").unlink()  # auto-generated model card, not needed
        save(case_dir / "base_model.safetensors", base_sd)

        ref = _peft_reference(pm, x, ["proj", "out_proj"], _adapter_key)

        # Round trip: a fresh base + PeftModel.from_pretrained must give the same output
        base2 = _TwoLayer()
        base2.load_state_dict(load_file(str(case_dir / "base_model.safetensors")))
        pm2 = PeftModel.from_pretrained(base2, case_dir / "adapter")
        pm2.eval()
        with torch.no_grad():
            y2 = pm2(x)
        torch.testing.assert_close(y2, ref["y"], rtol=0, atol=1e-6)
        merged = pm2.merge_and_unload()
        with torch.no_grad():
            ref["y_merged"] = merged(x)
        for k, v in merged.state_dict().items():
            ref["merged." + k] = v.detach().clone()
        save(case_dir / "reference.safetensors", ref)
        written.append(name)

    # ---- QDoRA: DoRA on a bitsandbytes NF4 (double-quant) base layer ----
    name = "qdora_nf4_dq"
    g = seed(5100)
    w = torch.randn(48, 64, generator=g) * 0.1
    b = torch.randn(48, generator=g) * 0.1
    x = torch.randn(5, 64, generator=g)
    q = bnb_quantized_tiny(w, b, quant_type="nf4", double_quant=True, dtype=torch.float32, tmp=tmp)
    case_dir = OUT / "peft" / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    q.save_pretrained(
        case_dir / "base_model"
    )  # transformers/bitsandbytes layout: proj.weight, proj.weight.absmax, ...
    cfg = LoraConfig(
        r=4, lora_alpha=8, use_dora=True, target_modules=["proj"], lora_dropout=0.0, bias="none"
    )
    pm = get_peft_model(q, cfg)
    _randomise_adapter(pm, g)
    # otherwise PEFT records the temporary float checkpoint's path (non-deterministic)
    pm.peft_config["default"].base_model_name_or_path = "../base_model"
    pm.save_pretrained(case_dir / "adapter")
    (case_dir / "adapter" / "README.md").unlink()  # auto-generated model card, not needed
    ref = _peft_reference(pm, x, ["proj"], _adapter_key, quantized_base=True)
    save(case_dir / "reference.safetensors", ref)
    written.append(name)
    return written


# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Independent re-derivation of every convention documented in README.md.
# These decoders are written from scratch (plain integer / float tensor ops, no
# library unpacking code); each asserts agreement with the library references.
# If a future library version changes a convention, regeneration fails here.
# ---------------------------------------------------------------------------


def _u32(t: torch.Tensor) -> torch.Tensor:
    """int32 words -> int64 holding the unsigned 32-bit value."""
    return t.to(torch.int64) & 0xFFFFFFFF


def _bnb_decode(sd: dict, key: str):
    """Decode a bitsandbytes 4-bit weight saved by transformers (keys key, key + '.absmax', ...)."""
    import math

    blob_key = [k for k in sd if k.startswith(key + ".quant_state.bitsandbytes__")]
    assert len(blob_key) == 1
    blob = json.loads(bytes(sd[blob_key[0]].tolist()).decode("utf-8"))
    assert blob_key[0].endswith("__" + blob["quant_type"])
    shape = blob["shape"]
    n = math.prod(shape)
    packed = sd[key].reshape(-1).to(torch.int64)
    assert sd[key].dtype == torch.uint8 and packed.numel() == (n + 1) // 2
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[
        :n
    ]  # element 2k = HIGH nibble
    qmap = sd[key + ".quant_map"]
    bs = blob["blocksize"]
    nblocks = -(-n // bs)
    if "nested_offset" in blob:
        u8 = sd[key + ".absmax"]
        assert u8.dtype == torch.uint8 and u8.numel() == nblocks
        nbs = blob["nested_blocksize"]
        na = sd[key + ".nested_absmax"]
        assert na.numel() == -(-nblocks // nbs)
        absmax = (
            sd[key + ".nested_quant_map"][u8.to(torch.int64)] * na[torch.arange(nblocks) // nbs]
        )
        absmax = absmax + torch.tensor(blob["nested_offset"], dtype=torch.float32)
    else:
        absmax = sd[key + ".absmax"]
        assert absmax.dtype == torch.float32 and absmax.numel() == nblocks
    w = (
        (qmap[codes] * absmax[torch.arange(n) // bs])
        .reshape(shape)
        .to(getattr(torch, blob["dtype"]))
    )
    return w, absmax, blob


def verify(report: list[str]) -> None:
    import math

    # ---- bitsandbytes -------------------------------------------------------
    for case_dir in sorted((OUT / "bnb").iterdir()):
        if not case_dir.is_dir():
            continue
        name = case_dir.name
        sd = load_file(str(case_dir / "model.safetensors"))
        ref = load_file(str(OUT / "bnb" / f"{name}.reference.safetensors"))
        w, absmax, blob = _bnb_decode(sd, "proj.weight")
        assert torch.equal(sd["proj.weight.quant_map"], ref["code"])
        assert torch.equal(absmax, ref["absmax_dequant"]), name
        assert torch.equal(w, ref["weight"]), name
        report.append(
            f"bnb {name}: blob={json.dumps(blob, sort_keys=True)}; independent decode bit-exact"
        )

    # ---- GPTQ ---------------------------------------------------------------
    for ref_path in sorted((OUT / "gptq").glob("*.reference.safetensors")):
        name = ref_path.name[: -len(".reference.safetensors")]
        ref = load_file(str(ref_path))
        cfg = json.load(open(OUT / "gptq" / f"{name}.v1.quantize_config.json"))
        bits = cfg["bits"]
        pf, maxq = 32 // bits, (1 << bits) - 1
        one_each = sum(
            1 << (bits * j) for j in range(pf)
        )  # 0x11111111 (4-bit) / 0x01010101 (8-bit)
        res = {}
        for tag in ("v1", "v2"):
            sd = load_file(str(OUT / "gptq" / f"{name}.{tag}.safetensors"))
            qw, qz = _u32(sd["proj.qweight"]), _u32(sd["proj.qzeros"])
            in_f, out_f = qw.shape[0] * pf, qw.shape[1]
            i = torch.arange(in_f)
            q = (qw[i // pf] >> (bits * (i % pf)).unsqueeze(1)) & maxq  # [in, out]
            if tag == "v1":
                qz_word = (qz + one_each) & 0xFFFFFFFF  # WORD-level add, carries included
                o = torch.arange(out_f)
                z_nibble = (
                    ((qz[:, o // pf] >> (bits * (o % pf))) & maxq) + 1
                ) & maxq  # per-field +1
            else:
                qz_word = qz
            o = torch.arange(out_f)
            z = (qz_word[:, o // pf] >> (bits * (o % pf))) & maxq  # [G, out]
            assert torch.equal(z.to(torch.int32), ref["zeros"]), (name, tag)
            if tag == "v1":
                n_diff = int((z_nibble != z).sum())
                res["nibble_diff"] = n_diff
            g_idx = sd["proj.g_idx"].to(torch.int64)
            s = sd["proj.scales"].float()
            w = (s[g_idx] * (q - z[g_idx]).float()).to(
                torch.float16
            )  # fp32 product, one fp16 rounding
            assert torch.equal(w.T, ref["weight"]), (name, tag)
            res["actorder"] = not torch.equal(g_idx, torch.arange(in_f) // cfg["group_size"])
        report.append(
            f"gptq {name}: v1/v2 independent decode bit-exact; g_idx permuted={res['actorder']}; "
            f"zero points a per-field '+1' v1 reader gets wrong={res['nibble_diff']}"
        )

    # ---- AWQ ----------------------------------------------------------------
    AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble j of a word holds column 8c + AWQ_ORDER[j]
    for ref_path in sorted((OUT / "awq").glob("*.reference.safetensors")):
        name = ref_path.name[: -len(".reference.safetensors")]
        ref = load_file(str(ref_path))
        sd = load_file(str(OUT / "awq" / f"{name}.safetensors"))
        gs = json.load(open(OUT / "awq" / f"{name}.quantization_config.json"))["group_size"]

        def unpack(words):
            words = _u32(words)
            out = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
            for j in range(8):
                out[:, AWQ_ORDER[j] :: 8] = (words >> (4 * j)) & 0xF
            return out

        q, z = unpack(sd["proj.qweight"]), unpack(sd["proj.qzeros"])  # [in, out], [G, out]
        assert torch.equal(z.to(torch.int32), ref["zeros"])
        g = torch.arange(q.shape[0]) // gs
        w = ((q - z[g]).float() * sd["proj.scales"].float()[g]).to(torch.float16)
        assert torch.equal(w.T, ref["weight"]), name
        report.append(f"awq {name}: independent decode bit-exact (order {AWQ_ORDER})")

    # ---- compressed-tensors ---------------------------------------------------
    for ref_path in sorted((OUT / "compressed_tensors").glob("*.reference.safetensors")):
        name = ref_path.name[: -len(".reference.safetensors")]
        ref = load_file(str(ref_path))
        sd = load_file(str(OUT / "compressed_tensors" / name / "model.safetensors"))
        qcfg = json.load(open(OUT / "compressed_tensors" / name / "config.json"))[
            "quantization_config"
        ]
        wargs = qcfg["config_groups"]["group_0"]["weights"]
        b = wargs["num_bits"]
        pf, off = 32 // b, 1 << (b - 1)
        out_f, in_f = sd["proj.weight_shape"].tolist()
        wp = _u32(sd["proj.weight_packed"])
        j = torch.arange(in_f)
        q = ((wp[:, j // pf] >> (b * (j % pf))) & ((1 << b) - 1)) - off  # signed
        scale = sd["proj.weight_scale"]
        ngroups = scale.shape[1]
        if "proj.weight_zero_point" in sd:
            zp_p = _u32(sd["proj.weight_zero_point"])  # packed along dim 0 (output rows)
            o = torch.arange(out_f)
            zp = ((zp_p[o // pf, :] >> (b * (o % pf)).unsqueeze(1)) & ((1 << b) - 1)) - off
        else:
            zp = torch.zeros(out_f, ngroups, dtype=torch.int64)
        assert torch.equal(zp.to(torch.int8), ref["zero_point"]), name
        gi = j // (in_f // ngroups)
        sdt = scale.dtype
        w = (q.to(sdt) - zp[:, gi].to(sdt)) * scale[:, gi]  # arithmetic in the scale dtype
        assert torch.equal(w, ref["weight"]), name
        report.append(
            f"compressed-tensors {name}: independent decode bit-exact ({b}-bit, "
            f"{wargs['strategy']}, symmetric={wargs['symmetric']}, dtype={sdt})"
        )

    # ---- PEFT DoRA ------------------------------------------------------------
    for case in ("dora", "dora_rslora", "qdora_nf4_dq"):
        d = OUT / "peft" / case
        ref = load_file(str(d / "reference.safetensors"))
        acfg = json.load(open(d / "adapter" / "adapter_config.json"))
        ad = load_file(str(d / "adapter" / "adapter_model.safetensors"))
        r, alpha = acfg["r"], acfg["lora_alpha"]
        s = alpha / math.sqrt(r) if acfg["use_rslora"] else alpha / r
        if case == "qdora_nf4_dq":
            layers = ["proj"]
            bsd = load_file(str(d / "base_model" / "model.safetensors"))
            wq, _, _ = _bnb_decode(bsd, "proj.weight")
            assert torch.equal(
                wq, ref["proj.base_weight_dequant"]
            )  # PEFT dequantises exactly like bnb
            base = {"proj.weight": wq, "proj.bias": bsd["proj.bias"]}
        else:
            layers = ["proj", "out_proj"]
            base = load_file(str(d / "base_model.safetensors"))
        for ln in layers:
            assert abs(ref[f"{ln}.scaling"].item() - s) < 1e-7
            W, bias = base[f"{ln}.weight"], base[f"{ln}.bias"]
            A = ad[f"base_model.model.{ln}.lora_A.weight"]
            B = ad[f"base_model.model.{ln}.lora_B.weight"]
            m = ad[f"base_model.model.{ln}.lora_magnitude_vector"]
            x = ref[f"{ln}.input"]
            V = W + s * (B @ A)
            nrm = torch.linalg.norm(V, dim=1)  # one norm per OUTPUT row
            torch.testing.assert_close(nrm, ref[f"{ln}.weight_norm"], rtol=1e-5, atol=1e-6)
            y = x @ ((m / nrm)[:, None] * V).T + bias
            torch.testing.assert_close(y, ref[f"{ln}.output"], rtol=1e-5, atol=1e-5)
            if f"merged.{ln}.weight" in ref:
                torch.testing.assert_close(
                    (m / nrm)[:, None] * V, ref[f"merged.{ln}.weight"], rtol=1e-5, atol=1e-6
                )
                assert torch.equal(ref[f"merged.{ln}.bias"], bias)
        # gradients of sum(y**2): PEFT treats the norm as a constant (detached)
        grads = {}
        for detach in (True, False):
            params = {k: v.clone().requires_grad_(True) for k, v in ad.items()}
            h = ref["x"]
            for li, ln in enumerate(layers):
                W, bias = base[f"{ln}.weight"], base[f"{ln}.bias"]
                A = params[f"base_model.model.{ln}.lora_A.weight"]
                B = params[f"base_model.model.{ln}.lora_B.weight"]
                m = params[f"base_model.model.{ln}.lora_magnitude_vector"]
                V = W + s * (B @ A)
                nrm = torch.linalg.norm(V, dim=1)
                if detach:
                    nrm = nrm.detach()
                h = h @ ((m / nrm)[:, None] * V).T + bias
                if li < len(layers) - 1:
                    h = torch.relu(h)
            torch.testing.assert_close(h.detach(), ref["y"], rtol=1e-5, atol=1e-5)
            (h**2).sum().backward()
            grads[detach] = {k: p.grad for k, p in params.items()}
        worst_nodetach = 0.0
        for k in ad:
            torch.testing.assert_close(grads[True][k], ref["grad." + k], rtol=1e-4, atol=1e-4)
            rel = ((grads[False][k] - ref["grad." + k]).norm() / ref["grad." + k].norm()).item()
            worst_nodetach = max(worst_nodetach, rel)
        report.append(
            f"peft {case}: scaling={s}; forward/merge/grad re-derived (norm detached); "
            f"not detaching the norm would change grads by up to {worst_nodetach:.3g} (relative)"
        )


def main() -> int:
    for mod, dist in [
        ("torch", None),
        ("bitsandbytes", None),
        ("peft", None),
        ("compressed_tensors", "compressed-tensors"),
        ("transformers", None),
        ("safetensors", None),
        ("gptqmodel", "GPTQModel"),
        ("awq", "autoawq"),
        ("optimum", None),
        ("accelerate", None),
        ("numpy", None),
    ]:
        VERSIONS[dist or mod] = _version(mod, dist)
    VERSIONS["python"] = sys.version.split()[0]
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    done: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        done["bnb"] = make_bnb(tmp)
        done["gptq"] = make_gptq()
        done["awq"] = make_awq()
        done["compressed_tensors"] = make_compressed_tensors()
        done["peft"] = make_peft(tmp)

    report: list[str] = []
    verify(report)
    for line in report:
        print("[verified]", line)

    files = {}
    for p in sorted(OUT.rglob("*")):
        if p.is_file() and p.name != "MANIFEST.json":
            files[str(p.relative_to(OUT))] = {
                "bytes": p.stat().st_size,
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            }
    dump_json(
        OUT / "MANIFEST.json",
        {"versions": VERSIONS, "cases": done, "verified": report, "files": files},
    )
    total = sum(v["bytes"] for v in files.values())
    print(f"wrote {len(files)} files, {total} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
