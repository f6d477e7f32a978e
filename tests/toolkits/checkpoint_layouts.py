"""Test helpers: checkpoints in PyTorch's 4-bit layouts, packed here from random
codes with plain loops over the formats' descriptions (not with quaxlike's own
packers), and the dense weight each stands for, computed from those descriptions
in NumPy."""

import json

import numpy as np


def pack_sequential(codes: np.ndarray, bits: int) -> np.ndarray:
    """`(rows, n)` codes into `int32` words along the last axis, code `j` of a word
    at bit `j * bits` (GPTQ's and compressed-tensors' order)."""
    per = 32 // bits
    rows, n = codes.shape
    words = np.zeros((rows, -(-n // per)), np.uint32)
    for i in range(n):
        words[:, i // per] |= codes[:, i].astype(np.uint32) << np.uint32(bits * (i % per))
    return words.view(np.int32)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_awq(codes: np.ndarray) -> np.ndarray:
    """`(rows, n)` 4-bit codes into AWQ GEMM words: field `j` holds column
    `AWQ_ORDER[j]` of each eight."""
    rows, n = codes.shape
    words = np.zeros((rows, n // 8), np.uint32)
    for c in range(n // 8):
        for j in range(8):
            words[:, c] |= codes[:, 8 * c + AWQ_ORDER[j]].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


def gptq(rng, out, columns, *, bits=4, group_size=16, act_order=False, version="v1"):
    """GPTQ tensors for module "proj", and the dense weight `(out, in)` (float16)."""
    groups = -(-columns // group_size)
    codes = rng.integers(0, 2**bits, (columns, out))  # (in, out), as GPTQ stores
    zeros = rng.integers(1, 2**bits - 1, (groups, out))  # no v1 overflow
    scales = (rng.random((groups, out)) * 0.1 + 0.01).astype(np.float16)
    if act_order:
        g_idx = rng.permutation(np.arange(columns) // group_size).astype(np.int32)
    else:
        g_idx = (np.arange(columns) // group_size).astype(np.int32)
    dense = (codes - zeros[g_idx]).astype(np.float16) * scales[g_idx]
    stored_zeros = zeros - 1 if version == "v1" else zeros
    tensors = {
        "proj.qweight": pack_sequential(codes.T, bits).T.copy(),
        "proj.qzeros": pack_sequential(stored_zeros, bits),
        "proj.scales": scales,
        "proj.g_idx": g_idx,
        "proj.bias": np.zeros(out, np.float16),
    }
    return tensors, dense.T.copy()


def awq(rng, out, columns, *, group_size=16):
    """AWQ GEMM tensors for module "proj", and the dense weight (float16)."""
    groups = columns // group_size
    codes = rng.integers(0, 16, (columns, out))
    zeros = rng.integers(0, 16, (groups, out))
    scales = (rng.random((groups, out)) * 0.1 + 0.01).astype(np.float16)
    g = np.arange(columns) // group_size
    dense = (codes - zeros[g]).astype(np.float16) * scales[g]
    tensors = {
        "proj.qweight": pack_awq(codes),
        "proj.qzeros": pack_awq(zeros),
        "proj.scales": scales,
    }
    return tensors, dense.T.copy()


def compressed(rng, out, columns, *, bits=4, group_size=16, symmetric=True, channel=False):
    """compressed-tensors pack-quantized tensors for "proj.weight", the dense weight
    (bfloat16 scales are not in NumPy: float16), and the config."""
    groups = 1 if channel else columns // group_size
    half = 2 ** (bits - 1)
    q = rng.integers(-half, half, (out, columns))  # signed codes
    scale = (rng.random((out, groups)) * 0.1 + 0.01).astype(np.float16)
    zp = rng.integers(-half, half, (out, groups)) if not symmetric else np.zeros((out, groups))
    g = np.arange(columns) // (columns // groups)
    dense = (q.astype(np.float16) - zp[:, g].astype(np.float16)) * scale[:, g]
    tensors = {
        "proj.weight_packed": pack_sequential(q + half, bits),
        "proj.weight_scale": scale,
        "proj.weight_shape": np.array([out, columns], np.int64),
    }
    if not symmetric:
        tensors["proj.weight_zero_point"] = pack_sequential((zp + half).T, bits).T.copy()
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "channel" if channel else "group",
        "group_size": None if channel else group_size,
    }
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    return tensors, dense, config


def dynamic_code() -> np.ndarray:
    """A 256-level table for the nested absmaxes (any table: the reader uses the
    stored one)."""
    return np.sort(np.random.default_rng(0).uniform(-1, 1, 256)).astype(np.float32)


def bnb(rng, out, columns, *, blocksize=16, nested=False, nested_blocksize=6, levels=None):
    """bitsandbytes 4-bit tensors for "proj.weight", the dense weight (float32)."""
    levels = np.linspace(-1, 1, 16).astype(np.float32) if levels is None else levels
    n = out * columns
    blocks = n // blocksize
    q = rng.integers(0, 16, n).astype(np.uint8)
    packed = ((q[0::2] << 4) | q[1::2]).astype(np.uint8)[:, None]  # first value high
    state = {
        "quant_type": "nf4",
        "blocksize": blocksize,
        "dtype": "float32",
        "shape": [out, columns],
    }
    tensors = {"proj.weight": packed, "proj.weight.quant_map": levels}
    if nested:
        code2 = dynamic_code()
        a = rng.integers(0, 256, blocks).astype(np.uint8)
        nested_absmax = (rng.random(-(-blocks // nested_blocksize)) + 0.5).astype(np.float32)
        offset = np.float32(0.25)
        which = np.arange(blocks) // nested_blocksize
        absmax = code2[a] * nested_absmax[which] + offset
        tensors.update(
            {
                "proj.weight.absmax": a,
                "proj.weight.nested_absmax": nested_absmax,
                "proj.weight.nested_quant_map": code2,
            }
        )
        state.update(
            nested_blocksize=nested_blocksize, nested_dtype="float32", nested_offset=float(offset)
        )
    else:
        absmax = (rng.random(blocks) + 0.1).astype(np.float32)
        tensors["proj.weight.absmax"] = absmax
    blob = np.frombuffer(json.dumps(state).encode(), np.uint8).copy()
    tensors["proj.weight.quant_state.bitsandbytes__nf4"] = blob
    dense = (levels[q].reshape(-1, blocksize) * absmax[:, None]).reshape(out, columns)
    return tensors, dense.astype(np.float32)
