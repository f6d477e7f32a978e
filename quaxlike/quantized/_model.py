"""Quantising a whole model: `quantize` (round to nearest, or calibrated by
GPTQ or AWQ) and `dequantize`, its inverse. The types live in `_value.py`,
`_nf4.py` and `_awq.py`; the calibrated methods in `_calibrated.py`."""

import functools as ft
from collections.abc import Callable, Iterable
from typing import Any

import jax.tree_util as jtu
from jaxtyping import PyTree

from ..selection import replace_selected
from ._awq import InputScaled
from ._base import DEFAULT_BLOCK_BYTES, QuantizedArray
from ._calibrated import calibrated_quantize
from ._microscaling import MX_BLOCK, NVFP4_BLOCK
from ._microscaling_quantize import quantize_mx, quantize_nvfp4
from ._nf4 import quantize_nf4
from ._qat import convert_fake_quantized, holds_fake_quantized
from ._value import (
    _BAD_BITS_MSG,
    _DOUBLE_QUANT_MSG,
    default_where,
    quantize_int4,
    quantize_int8,
)
from ._w8a8 import quantize_activations_model


_MICROSCALED_GROUP_MSG = (
    "`quantize`: `bits={bits!r}` has blocks of {block} inputs fixed by the format; "
    "got `group_size={got!r}`. Leave `group_size` out."
)


def quantize(
    model: PyTree,
    *,
    bits: int | str = 8,
    group_size: int | None = None,
    double_quant: bool = False,
    where: Any = None,
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    matmul: str | None = None,
    method: Any = "rtn",
    calibration: Iterable[Any] | None = None,
    run: Callable[[Any, Any], Any] | None = None,
    activations: int | None = None,
) -> PyTree:
    """Replace the weight of every `eqx.nn.Linear` in `model` by a quantised one.

    Biases and every other leaf stay as they are. Call the result with
    `quaxlike.quaxify(model)(x)`. The integer codes are not differentiable; the
    scales are floating-point leaves, so `eqx.filter_grad` gives gradients for them
    (and for the biases) and `None` for the codes, while `jax.grad` refuses the
    model because of its integer leaves.

    A model holding `FakeQuantized` weights (quantisation-aware training, from
    `fake_quantize`, inside LoRA weights too) is converted instead: each becomes
    the stored type with the settings it was trained with, computing what its
    forward pass computed; pass no other settings than `allow_materialise`,
    `block_bytes` and `matmul`.

    **Arguments:**

    - `model`: any PyTree holding Equinox layers.
    - `bits`: 8 for `Int8Array` (per output channel), 4 for `Int4Array` (per
        group) or `"nf4"` for `NF4Array` (4-bit NormalFloat codes, per group);
        3 or 2 for codes in `[-3, 3]` or `[-1, 1]` stored in an `Int4Array`
        (the accuracy of 3 or 2 bits, the memory of 4); `"mxfp8"` or `"mxfp4"`
        for an `MXArray` (OCP Microscaling: blocks of 32 inputs with an E8M0
        scale, float8 e4m3 or fp4 e2m1 elements) or `"nvfp4"` for an
        `NVFP4Array` (blocks of 16, e4m3 scales, a float32 per-tensor scale),
        as torchao's `to_mx` and `NVFP4Tensor` quantise.
    - `group_size`: the group size for `bits=4`, 3 and 2 (default 32) and
        `"nf4"` (default 64); ignored for 8.
    - `double_quant`: for `bits="nf4"` only: quantise the groups' scales to 8 bits
        too (see `quantize_nf4`).
    - `where`: instead of every `Linear` weight, the weights to quantise: any
        selection of `quaxlike.selection`, as `loraify` takes it (check
        one with `select(model, where)`): a path pattern (`"layers.*.weight"`,
        `"**.query_proj"`), a module type or `module(eqx.nn.Linear,
        out_features=10)`, a predicate `(path, leaf) -> bool`, a getter returning
        the arrays (as for `eqx.tree_at`: one array, or a list or tuple of them),
        or a list of these.
    - `allow_materialise`, `matmul`: as for `Int8Array`, `Int4Array` and `NF4Array`.
    - `block_bytes`: the most bytes of dequantised weight a matrix product builds
        at a time (default 512 KiB). A matrix product dequantises its weight in
        blocks of whole rows, one after another inside a loop, and at least two
        blocks, so that no dense copy of a weight is ever alive; a larger block
        means fewer, larger steps (faster, up to the size of the cache) and more
        memory. See benchmarks/README.md for the trade-off measured.
    - `method`: how the codes are chosen. `"rtn"` (the default) rounds each
        weight to the nearest code. `"gptq"` (or `GPTQ(...)` for its options)
        rounds column by column, spreading each column's error over the columns
        not yet rounded so that the layer's output on the calibration data
        changes least (Frantar et al., 2022). `"awq"` (or `AWQ(...)`) scales the
        weight's input channels by the calibration inputs' magnitudes before
        rounding (Lin et al., 2023); the weight becomes an `InputScaled` over the
        quantised array, which divides its inputs by the scales again. Both
        give the codes and scales of the same types as `"rtn"`.
    - `calibration`: for `"gptq"` and `"awq"`, an iterable of batches the model
        is run on to record each selected weight's inputs (see the
        calibration section of `quaxlike.quantized`'s README).
    - `run`: `run(model, batch)` runs the model on one calibration batch;
        by default `jax.vmap(model)(batch)`, Equinox's convention.
    - `activations`: `8` (with `bits=8`, `method="rtn"`) quantises the inputs
        of each selected weight's matrix products too, dynamically per token:
        each weight becomes a `W8A8Array` (int8 x int8 products accumulated in
        int32, as torchao's `Int8DynamicActivationInt8WeightConfig`). `None`
        (the default) quantises the weights only.

    **Returns:**

    The model with quantised weights.

    **Raises:**

    `ValueError` if `where` is not given and the model has no `eqx.nn.Linear`, or
    `where` selects nothing (rather than returning the model unchanged);
    `CalibrationError` (a `ValueError`) if calibration cannot run or a weight
    cannot be calibrated as the model uses it (the message says why).

    !!! example

        ```python
        mlp = eqx.nn.MLP(64, 8, 64, depth=2, key=jax.random.key(0))
        qmlp = quantize(mlp, bits=4, group_size=32)
        y = eqx.filter_jit(quaxlike.quaxify(qmlp))(jnp.ones(64))
        ```
    """
    options = dict(allow_materialise=allow_materialise, block_bytes=block_bytes, matmul=matmul)
    if holds_fake_quantized(model):
        # Quantisation-aware training's model: each `FakeQuantized` becomes its
        # stored type with the settings it was trained with.
        return convert_fake_quantized(
            model,
            bits=bits,
            group_size=group_size,
            double_quant=double_quant,
            where=where,
            method=method,
            calibration=calibration,
            run=run,
            activations=activations,
            options=options,
        )
    if double_quant and bits != "nf4":
        raise ValueError(_DOUBLE_QUANT_MSG.format(bits=bits))
    if activations is not None:
        return quantize_activations_model(
            model, bits, activations, method, calibration, run, where, options
        )
    if method != "rtn" or calibration is not None or run is not None or bits in (3, 2):
        return calibrated_quantize(
            model, method, calibration, run, bits, group_size, double_quant, where, options
        )
    if bits == 8:
        make = ft.partial(quantize_int8, **options)
    elif bits == 4:
        make = ft.partial(quantize_int4, group_size=group_size or 32, **options)
    elif bits == "nf4":
        make = ft.partial(
            quantize_nf4, group_size=group_size or 64, double_quant=double_quant, **options
        )
    elif bits in ("mxfp8", "mxfp4", "nvfp4"):
        block = NVFP4_BLOCK if bits == "nvfp4" else MX_BLOCK
        if group_size not in (None, block):
            raise ValueError(_MICROSCALED_GROUP_MSG.format(bits=bits, block=block, got=group_size))
        if bits == "nvfp4":
            make = ft.partial(quantize_nvfp4, **options)
        else:
            make = ft.partial(quantize_mx, format=bits, **options)
    else:
        raise ValueError(_BAD_BITS_MSG.format(bits=bits))
    if where is None:
        where = default_where(model)
    return replace_selected(model, where, make, "quantize")


def dequantize(model: PyTree) -> PyTree:
    """Replace every quantised array in `model` by its dense weight
    (`QuantizedArray.dequantize`): the plain-JAX model the quantised one computes.

    **Arguments:**

    - `model`: any PyTree holding `QuantizedArray`s, such as the output of
        `quantize`.

    **Returns:**

    The same PyTree with every `Int8Array` and `Int4Array` replaced by the dense
    array `codes * scale` it stands for (and every `InputScaled` of `method="awq"`
    by `codes * scale / input_scale`); it runs without `quaxify`.

    !!! example

        ```python
        mlp = eqx.nn.MLP(8, 2, 16, depth=1, key=jr.key(0))
        qmlp = quantize(mlp, bits=8)
        x = jnp.ones(8)
        assert jnp.allclose(quaxlike.quaxify(qmlp)(x), dequantize(qmlp)(x), atol=1e-5)
        ```
    """
    is_quantized = lambda x: isinstance(x, (QuantizedArray, InputScaled))  # noqa: E731
    return jtu.tree_map(
        lambda x: x.dequantize() if is_quantized(x) else x, model, is_leaf=is_quantized
    )
