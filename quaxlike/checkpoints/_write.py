"""Writers: a model's weights into the layouts PyTorch's tools serve, bitsandbytes
4-bit (transformers with `load_in_4bit`) and compressed-tensors `pack-quantized`
(vLLM, transformers), so that a model quantised and fine-tuned here runs there."""

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

import quaxlike

from ..quantized import (
    Bnb4bitArray,
    GroupedIntArray,
    InputScaled,
    Int4Array,
    Int8Array,
    NF4_LEVELS,
    NF4Array,
    pack_words,
    QuantizedArray,
    W8A8Array,
)
from ..selection import dotted_path, is_value
from ._bnb import STATE_KEYS
from ._source import safetensors_module


#: The block sizes bitsandbytes' 4-bit kernels take.
BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)

_WRONG_TYPE_MSG = "`{function}`: `{path}` is a {type_name}, which has no {layout} layout. {hint}"
_HINTS = {
    "bnb": "Write it with `save_compressed_tensors`, or quantise it with "
    '`quantize(..., bits="nf4")` (an `NF4Array`).',
    "ct": "Write it with `save_bnb_4bit` (NF4 and bitsandbytes' own), or quantise it "
    "with `quantize(..., bits=4)` (an `Int4Array`) or `bits=8`.",
}
_BLOCKSIZE_MSG = (
    "`save_bnb_4bit`: `{path}` has groups of {size} inputs; bitsandbytes' kernels "
    "take blocks of {sizes}. Quantise it with one of those `group_size`s."
)
_TRANSPOSED_MSG = (
    "`{function}`: `{path}` stands for a transposed weight (`transposed=True`); both "
    "layouts store `(out, in)`. Name the weight itself, or write a model whose "
    "kernels are stored `(out, in)`."
)
_STACK_MSG = (
    "`{function}`: `{path}` has shape {shape}, a stack of matrices; each layer is a "
    "tensor of its own in these layouts. Give its name one `{{}}` per leading axis "
    '(`"model.layers.{{}}.mlp.up_proj.weight"`).'
)
_G_IDX_MSG = (
    "`save_compressed_tensors`: `{path}` has an act-order `g_idx`; compressed-tensors "
    "0.20 no longer reads `weight_g_idx` (act-order GROUP was removed), so it cannot "
    "be written faithfully. Write it with the GPTQ tools instead, or keep it here."
)
_INPUT_SCALED_MSG = (
    "`{function}`: `{path}` is an `InputScaled` (AWQ's weight: the quantised "
    "`W diag(s)` and the per-input-channel scales `s` its inputs are divided by). "
    "{layout} has no place for `s`: AutoAWQ and llm-compressor fold `1 / s` into the "
    "operation before the layer (a norm's weight and bias, or the previous Linear's "
    "rows) and save the quantised weight alone. Ways out: {fold}`dequantize` the model "
    'and quantise it without AWQ (`method="rtn"` or `"gptq"`), or keep it here.'
)
_FOLD_HINT = (
    "name the leaves of that operation with `fold={{{path!r}: [...]}}` (their axis 0 "
    "is divided by `s`; the weights folded into one leaf need equal scales), or "
)
_FOLD_MSG = "`save_compressed_tensors`: `fold` {what}"
_NOT_WEIGHT_MSG = (
    "`save_compressed_tensors`: `{path}` is quantised, so its name must end in "
    "`weight` (compressed-tensors writes `<module>.weight_packed` beside it); got "
    "{name!r}."
)


def _named_leaves(model: PyTree, name_map) -> list[tuple[str, str, Any]]:
    """`(path, name, leaf)` for each leaf the map names, a stack of layers split
    into one entry per layer (`{}` in the name)."""
    from ..lora._base import LowRankValue  # the LoRA base is what these layouts hold

    lookup = name_map if callable(name_map) else name_map.get
    out = []
    for key_path, leaf in jtu.tree_flatten_with_path(model, is_leaf=is_value)[0]:
        path = dotted_path(key_path)
        name: str | None = lookup(path)  # pyright: ignore[reportAssignmentType]
        if name is None:
            continue
        if isinstance(leaf, LowRankValue):
            leaf = leaf.w
        stacked = name.count("{}")
        shape = tuple(leaf.shape)
        if not stacked:
            out.append((path, name, leaf))
            continue
        for index in np.ndindex(*shape[:stacked]):
            # One layer of the stack (a Value's leaves indexed by its own rules).
            layer = (
                quaxlike.quaxify(_take)(leaf, index) if is_value(leaf) else np.asarray(leaf)[index]
            )
            out.append((f"{path}[{','.join(map(str, index))}]", name.format(*index), layer))
    return out


def _take(x: Any, index: tuple[int, ...]) -> Any:
    return x[index]


def _host(x: Any) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _save(tensors: dict[str, np.ndarray], file: str | os.PathLike) -> None:
    st = safetensors_module()
    directory = os.path.dirname(os.fspath(file))
    if directory:
        os.makedirs(directory, exist_ok=True)
    contiguous = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    st.numpy.save_file(contiguous, os.fspath(file), metadata={"format": "pt"})


def _write_config(file: str | os.PathLike, config: dict[str, Any]) -> None:
    """Merge `quantization_config` into `config.json` beside `file`."""
    path = os.path.join(os.path.dirname(os.fspath(file)) or ".", "config.json")
    whole = {}
    if os.path.exists(path):
        with open(path) as f:
            whole = json.load(f)
    whole["quantization_config"] = config
    with open(path, "w") as f:
        json.dump(whole, f, indent=2, sort_keys=True)


# --- bitsandbytes 4-bit ------------------------------------------------------------


def _bnb_tensors(path: str, name: str, w: QuantizedArray) -> tuple[dict, str, bool, str]:
    """bitsandbytes' tensors for one weight, its quant type, nestedness and dtype."""
    if w.transposed:
        raise ValueError(_TRANSPOSED_MSG.format(function="save_bnb_4bit", path=path))
    if len(w.stored_shape) != 2:
        raise ValueError(_STACK_MSG.format(function="save_bnb_4bit", path=path, shape=w.shape))
    out, columns = w.stored_shape
    state: dict[str, Any] = {"blocksize": w.group_size, "shape": [out, columns]}
    if w.group_size not in BNB_BLOCKSIZES:
        raise ValueError(_BLOCKSIZE_MSG.format(path=path, size=w.group_size, sizes=BNB_BLOCKSIZES))
    if isinstance(w, NF4Array):
        codes = _host(w.codes())
        absmax = _host(w.group_absmax(*w.row_leaves()[1:])).astype(np.float32)
        code = NF4_LEVELS.astype(np.float32)
        quant_type, nested, dtype = "nf4", False, np.dtype(w.dtype).name
        tensors = {}
    else:
        assert isinstance(w, Bnb4bitArray)
        codes = _host(w.codes())
        code = _host(w.code)
        quant_type, nested, dtype = w.quant_type, w.double_quantized, w.library_dtype
        tensors = {}
        blocks = -(-out * columns // w.group_size)
        first_block = np.arange(out) * columns // w.group_size
        absmax = _unwindow(_host(w.absmax), first_block, blocks)
        if nested:
            assert w.nested is not None
            size = w.nested_blocksize
            nested_absmax = _unwindow(_host(w.nested), first_block // size, -(-blocks // size))
            tensors[f"{name}.nested_absmax"] = nested_absmax
            tensors[f"{name}.nested_quant_map"] = _host(w.nested_code).astype(np.float32)
            state.update(
                nested_blocksize=w.nested_blocksize,
                nested_dtype="float32",
                nested_offset=float(_host(w.offset)),
            )
    flat = codes.reshape(-1).astype(np.uint8)
    tensors[name] = ((flat[0::2] << 4) | flat[1::2]).astype(np.uint8)[:, None]
    tensors[f"{name}.absmax"] = absmax.reshape(-1)
    tensors[f"{name}.quant_map"] = code
    state.update(quant_type=quant_type, dtype=dtype)
    blob = json.dumps(state).encode("utf-8")
    key = STATE_KEYS[0] if quant_type == "nf4" else STATE_KEYS[1]
    tensors[f"{name}.{key}"] = np.frombuffer(blob, np.uint8).copy()
    return tensors, quant_type, nested, dtype


def _unwindow(rows: np.ndarray, first: np.ndarray, total: int) -> np.ndarray:
    """bitsandbytes' flat array of `total` values from per-row windows `(rows, m)`
    whose entry `j` of row `r` is value `first[r] + j` (the inverse of the
    reader's `windows`)."""
    flat = np.zeros(total, rows.dtype)
    for j in range(rows.shape[1]):
        index = first + j
        keep = index < total
        flat[index[keep]] = rows[keep, j]
    return flat


def save_bnb_4bit(
    model: PyTree,
    file: str | os.PathLike,
    name_map: Mapping[str, str] | Callable[[str], str | None],
    *,
    write_config: bool = True,
) -> dict[str, Any]:
    """Write a model's weights as a safetensors file in bitsandbytes' 4-bit layout, as
    transformers' `save_pretrained` writes a model loaded with `load_in_4bit`.

    Each `NF4Array` (from `quantize(..., bits="nf4")` or `qlora`) and each
    `Bnb4bitArray` (read from such a checkpoint) named by the map is written as
    bitsandbytes' packed codes, absmaxes, code table and quant state; every
    other named array as it is (biases, norms, embeddings). A `LoraArray` is
    written as its base: write its adapter with `save_peft`.

    bitsandbytes then dequantises each weight to the values it has here: an
    `NF4Array` in `float32` exactly, a `Bnb4bitArray` exactly (its nested
    statistics kept). A double-quantised `NF4Array` is written with its
    absmaxes dequantised to `float32` (quaxlike's double quantisation is not
    bitsandbytes' nested one), which keeps its values.

    **Arguments:**

    - `model`: a PyTree holding the weights.
    - `file`: the `.safetensors` file to write (its directory is created).
    - `name_map`: our dotted paths to the checkpoint's names (`"layers.0.weight"`
        to `"model.layers.0.mlp.up_proj.weight"`), a dict or a function; a
        stack of layers takes one `{}` per batch axis, as `load_safetensors`.
    - `write_config`: also write the `quantization_config` into `config.json`
        beside `file` (merged into one already there).

    **Returns:**

    The `quantization_config` for transformers (`BitsAndBytesConfig`'s fields).

    **Raises:**

    `ValueError` for a quantised weight bitsandbytes has no layout for (an
    `Int4Array`: see `save_compressed_tensors`), or groups bitsandbytes'
    kernels do not take.

    !!! example

        ```python
        import os, tempfile
        from quaxlike.quantized import quantize

        linear = eqx.nn.Linear(128, 8, key=jr.key(0))
        model = quantize(linear, bits="nf4", group_size=64)
        names = {"weight": "proj.weight", "bias": "proj.bias"}
        with tempfile.TemporaryDirectory() as d:
            config = save_bnb_4bit(model, os.path.join(d, "model.safetensors"), names)
            back = load_safetensors(linear, d, names)  # a Bnb4bitArray
        assert config["bnb_4bit_quant_type"] == "nf4"
        assert jnp.array_equal(back.weight.dequantize(), model.weight.dequantize())
        ```
    """
    tensors: dict[str, np.ndarray] = {}
    kinds = set()
    for path, name, leaf in _named_leaves(model, name_map):
        if isinstance(leaf, (NF4Array, Bnb4bitArray)):
            written, quant_type, nested, dtype = _bnb_tensors(path, name, leaf)
            tensors.update(written)
            kinds.add((quant_type, nested, dtype))
        elif isinstance(leaf, InputScaled):
            hint = "with an int4 or int8 base, `save_compressed_tensors(..., fold=...)`; or "
            raise ValueError(
                _INPUT_SCALED_MSG.format(
                    function="save_bnb_4bit",
                    path=path,
                    layout="bitsandbytes' 4-bit layout",
                    fold=hint,
                )
            )
        elif isinstance(leaf, quaxlike.Value):
            raise ValueError(
                _WRONG_TYPE_MSG.format(
                    function="save_bnb_4bit",
                    path=path,
                    type_name=type(leaf).__name__,
                    layout="bitsandbytes 4-bit",
                    hint=_HINTS["bnb"],
                )
            )
        else:
            tensors[name] = _host(leaf)
    quant_type, nested, dtype = sorted(kinds)[0] if kinds else ("nf4", False, "float32")
    config = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": quant_type,
        "bnb_4bit_use_double_quant": nested,
        "bnb_4bit_compute_dtype": dtype,
        "bnb_4bit_quant_storage": "uint8",
    }
    _save(tensors, file)
    if write_config:
        _write_config(file, config)
    return config


# --- compressed-tensors pack-quantized ----------------------------------------------


def _ct_tensors(path: str, name: str, w: QuantizedArray) -> tuple[dict, dict[str, Any]]:
    """compressed-tensors' tensors for one weight, and its `weights` arguments."""
    if w.transposed:
        raise ValueError(_TRANSPOSED_MSG.format(function="save_compressed_tensors", path=path))
    if not name.endswith("weight"):
        raise ValueError(_NOT_WEIGHT_MSG.format(path=path, name=name))
    if len(w.stored_shape) != 2:
        raise ValueError(
            _STACK_MSG.format(function="save_compressed_tensors", path=path, shape=w.shape)
        )
    out, columns = w.stored_shape
    zeros = None
    if isinstance(w, Int4Array):
        bits, codes, scale = 4, _host(w.codes()).astype(np.int32) + 8, _host(w.scale)
    elif isinstance(w, Int8Array):
        bits, codes, scale = 8, _host(w.values).astype(np.int32) + 128, _host(w.scale)[:, None]
    else:
        assert isinstance(w, GroupedIntArray)
        if w.g_idx is not None:
            raise ValueError(_G_IDX_MSG.format(path=path))
        bits, codes, scale = w.bits, _host(w.codes()), _host(w.scale)
        zeros = None if w.zero is None else _host(w.zero)
    groups = scale.shape[-1]
    tensors = {
        f"{name}_packed": pack_words(codes, bits),
        f"{name}_scale": scale,
        f"{name}_shape": np.array([out, columns], np.int64),
    }
    if zeros is not None:
        # Signed zero points plus the same offset as the codes: the unsigned
        # zero points themselves, packed along the outputs.
        tensors[f"{name}_zero_point"] = pack_words(zeros.T, bits).T.copy()
    args = {
        "num_bits": bits,
        "type": "int",
        "symmetric": zeros is None,
        "strategy": "channel" if groups == 1 else "group",
        "group_size": None if groups == 1 else columns // groups,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }
    if isinstance(w, W8A8Array):
        # Its products quantise their inputs too: compressed-tensors' W8A8 scheme.
        args["input_activations"] = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        }
    return tensors, args


def save_compressed_tensors(
    model: PyTree,
    file: str | os.PathLike,
    name_map: Mapping[str, str] | Callable[[str], str | None],
    *,
    write_config: bool = True,
    fold: Mapping[str, str | Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Write a model's weights as a safetensors file in compressed-tensors'
    `pack-quantized` layout, which vLLM and transformers serve.

    Each `Int4Array` (symmetric 4-bit groups), `Int8Array` (symmetric 8-bit
    channels) and `GroupedIntArray` (any bits, symmetric or not, groups or
    channels) named by the map is written as `weight_packed`, `weight_scale`,
    `weight_shape` and, asymmetric, `weight_zero_point`; every other named array
    as it is. A `LoraArray` is written as its base (its adapter: `save_peft`).
    compressed-tensors' `decompress` then gives exactly the values the weight
    has here (in the scales' dtype). A `W8A8Array` is written as an `Int8Array`,
    its config group with compressed-tensors' W8A8 `input_activations` (8-bit,
    symmetric, dynamic, per token).

    An `InputScaled` (`quantize(..., method="awq")`) is written as AutoAWQ and
    llm-compressor write AWQ: its quantised base as the weight, and `1 / s`
    folded into the operation before the layer, whose leaves `fold` names (a
    norm's weight and bias, or the previous Linear's weight and bias): axis 0
    of each is divided by `s`. The written model then computes what this one
    does, provided that operation is what feeds the layer (through nothing but
    channelwise-linear steps).

    **Arguments:**

    - `model`: a PyTree holding the weights.
    - `file`: the `.safetensors` file to write.
    - `name_map`: our dotted paths to the checkpoint's names; a quantised weight's
        name ends in `weight` (`"model.layers.0.mlp.up_proj.weight"`).
    - `write_config`: also write the `quantization_config` into `config.json`
        beside `file`.
    - `fold`: for each `InputScaled` weight (by our dotted path), the dotted
        path of the leaf, or a list of the leaves, that its `1 / s` is folded
        into (`{"blocks.0.attn.q.weight": ["blocks.0.norm.weight",
        "blocks.0.norm.bias"]}`). Those leaves must be written too (named by
        `name_map`), and every weight folded into one leaf must have the same
        scales (AWQ's layers that share an input share them).

    **Returns:**

    The `quantization_config`: one config group per scheme, its `targets` the
    modules that use it.

    **Raises:**

    `ValueError` for a quantised weight compressed-tensors has no layout for (an
    `NF4Array`: see `save_bnb_4bit`), an act-order `GroupedIntArray`, or an
    `InputScaled` that `fold` does not fold (or cannot: unequal scales, a leaf
    not written or of another size).

    !!! example

        ```python
        import os, tempfile
        from quaxlike.quantized import quantize

        linear = eqx.nn.Linear(128, 8, key=jr.key(0))
        model = quantize(linear, bits=4, group_size=32)
        names = {"weight": "proj.weight", "bias": "proj.bias"}
        with tempfile.TemporaryDirectory() as d:
            config = save_compressed_tensors(model, os.path.join(d, "model.safetensors"), names)
            back = load_safetensors(linear, d, names)  # a GroupedIntArray
        assert config["format"] == "pack-quantized"
        assert jnp.array_equal(back.weight.dequantize(), model.weight.dequantize())
        ```
    """
    tensors: dict[str, np.ndarray] = {}
    schemes: dict[str, tuple[dict, list[str]]] = {}
    named = _named_leaves(model, name_map)
    named, divisors = _unfolded(named, fold or {})
    for path, name, leaf in named:
        if path in divisors:
            leaf = _divided(path, leaf, divisors.pop(path))
        if isinstance(leaf, (Int4Array, Int8Array, GroupedIntArray)):
            written, args = _ct_tensors(path, name, leaf)
            tensors.update(written)
            key = json.dumps(args, sort_keys=True)
            schemes.setdefault(key, (args, []))[1].append(name[: -len(".weight")])
        elif isinstance(leaf, quaxlike.Value):
            raise ValueError(
                _WRONG_TYPE_MSG.format(
                    function="save_compressed_tensors",
                    path=path,
                    type_name=type(leaf).__name__,
                    layout="compressed-tensors pack-quantized",
                    hint=_HINTS["ct"],
                )
            )
        else:
            tensors[name] = _host(leaf)
    if divisors:
        what = f"names {sorted(divisors)}, which `name_map` does not write: name them there."
        raise ValueError(_FOLD_MSG.format(what=what))
    groups = {}
    for i, (args, targets) in enumerate(schemes.values()):
        weights = {k: v for k, v in args.items() if k != "input_activations"}
        groups[f"group_{i}"] = {"targets": sorted(targets), "weights": weights}
        if "input_activations" in args:
            groups[f"group_{i}"]["input_activations"] = args["input_activations"]
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": [],
    }
    _save(tensors, file)
    if write_config:
        _write_config(file, config)
    return config


# --- AWQ's input scales, folded into the operation before the layer ---------------


def _unfolded(named: list, fold: Mapping[str, Any]) -> tuple[list, dict[str, np.ndarray]]:
    """`named` with each `InputScaled` replaced by its quantised base, and the
    scales `s` each leaf that `fold` names is to be divided by (one array per
    leaf, the same for every weight folded into it)."""
    out, divisors, sources = [], {}, {}
    for path, name, leaf in named:
        if isinstance(leaf, InputScaled):
            if path not in fold:
                hint = _FOLD_HINT.format(path=path)
                raise ValueError(
                    _INPUT_SCALED_MSG.format(
                        function="save_compressed_tensors",
                        path=path,
                        layout="compressed-tensors' format",
                        fold=hint,
                    )
                )
            if leaf.transposed or len(leaf.shape) != 2:
                raise ValueError(
                    _TRANSPOSED_MSG.format(function="save_compressed_tensors", path=path)
                    if leaf.transposed
                    else _STACK_MSG.format(
                        function="save_compressed_tensors", path=path, shape=leaf.shape
                    )
                )
            scale = _host(leaf.scale).astype(np.float32)
            targets = fold[path]
            for target in [targets] if isinstance(targets, str) else list(targets):
                if target in divisors and not np.array_equal(divisors[target], scale):
                    what = (
                        f"folds `{path}` and `{sources[target]}` into `{target}`, but their "
                        "AWQ scales differ, and one leaf can be divided by one set only. "
                        "Calibrate the weights that share an input together, or fold "
                        "into separate leaves."
                    )
                    raise ValueError(_FOLD_MSG.format(what=what))
                divisors[target], sources[target] = scale, path
            leaf = leaf.base
        out.append((path, name, leaf))
    unused = sorted(set(fold) - {path for path, _, leaf in named if isinstance(leaf, InputScaled)})
    if unused:
        what = f"names {unused}, which are not `InputScaled` weights the map writes."
        raise ValueError(_FOLD_MSG.format(what=what))
    return out, divisors


def _divided(path: str, leaf: Any, scale: np.ndarray) -> Any:
    """`leaf` with its axis 0 divided by `scale`, in its own dtype: a plain
    array, or a quantised weight `(out, in)` whose rows' scales are divided (its
    codes unchanged: exact, as AutoAWQ's folding into a previous Linear is
    before that Linear is quantised)."""
    rows = isinstance(leaf, (Int4Array, Int8Array, GroupedIntArray)) and not leaf.transposed
    if isinstance(leaf, quaxlike.Value) and not rows:
        what = (
            f"folds into `{path}`, a {type(leaf).__name__}: name a plain array there, "
            "or a weight quantised by rows (`Int4Array`, `Int8Array`, `GroupedIntArray`)."
        )
        raise ValueError(_FOLD_MSG.format(what=what))
    array = _host(leaf.scale if rows else leaf)
    if array.ndim < 1 or array.shape[0] != scale.shape[0]:
        what = (
            f"folds scales of {scale.shape[0]} input channels into `{path}` of shape "
            f"{tuple(leaf.shape)}, whose axis 0 does not have that size."
        )
        raise ValueError(_FOLD_MSG.format(what=what))
    divisor = scale.reshape(-1, *[1] * (array.ndim - 1))
    divided = (array.astype(np.float32) / divisor).astype(array.dtype)
    return leaf.with_scale(jnp.asarray(divided)) if rows else divided
