"""`load_safetensors`: a checkpoint's tensors into a model, through a name map, with
the 4-bit layouts of PyTorch's quantisation libraries read as Values."""

import dataclasses
import itertools
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ..quantized import Bnb4bitArray, GroupedIntArray, MicroscaledArray, QuantizedArray
from ..selection import dotted_path, is_value
from ._awq import read_awq
from ._bnb import check_not_8bit, is_bnb_4bit, read_bnb_4bit
from ._compressed_tensors import is_packed, read_packed
from ._gptq import GPTQ_KEYS, read_gptq
from ._layer import Layer
from ._microscaling import LAYOUTS as MICROSCALED, microscaled_layout, read_microscaled
from ._source import open_source, Source


_MISSING_MSG = (
    "`load_safetensors`: no tensor {name!r} (for `{path}`) in {paths}, nor a quantised "
    "layout under it (bitsandbytes `{name}.quant_state.*`, GPTQ/AWQ `{module}.qweight`, "
    "compressed-tensors `{name}_packed`); some names there: {some}."
)
_SHAPE_MSG = (
    "`load_safetensors`: `{path}` has shape {shape}, but {name!r} gives {got}. A kernel "
    "stored the other way round needs `(name, np.transpose)` in the name map."
)
_TRANSFORM_MSG = (
    "`load_safetensors`: {name!r} is stored in the {layout} layout, which is read as a "
    "quantised Value, so the name map's function cannot be applied to its tensors. "
    "Only `np.transpose` is understood there (it gives the transposed Value, for a "
    "kernel stored `(in, out)`); remove the function, or load a float checkpoint."
)
_NOT_MATRIX_MSG = (
    "`load_safetensors`: {name!r} is stored in the {layout} layout, a matrix "
    "`(out, in)`, but the model's leaf `{path}` has shape {shape}."
)
_MIXED_STACK_MSG = (
    "`load_safetensors`: the layers of the stack `{path}` ({template}) are stored in "
    "different layouts or with different settings ({first} and {other}), so they "
    "cannot be held as one Value. Give the layers separate leaves."
)
_QUANT_METHOD_MSG = (
    "`load_safetensors`: the checkpoint's `quantization_config` has quant_method "
    "{got!r}, but {name!r} is stored in the {layout} layout. The layout is told by "
    "the tensors; a config that disagrees with them is not guessed around: check "
    "that `files` and `quantization_config` belong together."
)
_GPTQ_OR_AWQ_MSG = (
    "`load_safetensors`: {module}.qweight {qweight} with scales {scales} fits neither "
    "GPTQ (`[in * bits / 32, out]`) nor AWQ GEMM (`[in, out / 8]`) for the leaf "
    "`{path}` of shape {shape} `(out, in)`."
)

# The quant_method names under which each layout is written.
_METHODS = {
    "bitsandbytes 4-bit": ("bitsandbytes",),
    "GPTQ": ("gptq", "gptqmodel"),
    "AWQ GEMM": ("awq",),
    "compressed-tensors pack-quantized": ("compressed-tensors", "compressed_tensors"),
    **{layout: ("compressed-tensors", "compressed_tensors") for layout in MICROSCALED},
}
# The Values the readers give, whose dtype and options `load_safetensors` sets.
_READ_TYPES = (GroupedIntArray, Bnb4bitArray, MicroscaledArray)


def _names_for(template: str, batch: tuple[int, ...], path: str) -> list[tuple[tuple, str]]:
    """One name per layer of a stack: `template` with its `{}`s filled."""
    if template.count("{}") != len(batch):
        raise ValueError(
            f"`{path}` has {len(batch)} batch axes (shape {batch} before the matrix), so "
            f"its name needs {len(batch)} `{{}}` placeholder(s), one per axis; got "
            f"{template!r}."
        )
    indices = list(itertools.product(*(range(n) for n in batch)))
    return [(index, template.format(*index)) for index in indices]


def _shape_of(leaf: Any) -> tuple[int, ...]:
    return tuple(leaf.shape)


def _module_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _layout(name: str, source: Source) -> str | None:
    """The quantised layout stored under the weight `name`, or None (dense)."""
    if is_bnb_4bit(name, source):
        return "bitsandbytes 4-bit"
    microscaled = microscaled_layout(name, source)
    if microscaled is not None:
        return microscaled
    if is_packed(name, source):
        return "compressed-tensors pack-quantized"
    module = _module_of(name)
    if all(f"{module}.{key}" in source for key in GPTQ_KEYS):
        return "GPTQ or AWQ"
    if name in source:
        check_not_8bit(name, source)
    return None


def _gptq_or_awq(module: str, source: Source, path: str, shape: tuple[int, ...]) -> str:
    out, columns = shape
    qweight = source.shape(f"{module}.qweight")
    scales = source.shape(f"{module}.scales")
    if len(qweight) == 2 and qweight[1] == out and qweight[0] * 32 % columns == 0:
        return "GPTQ"
    if len(qweight) == 2 and qweight == (columns, out // 8):
        return "AWQ GEMM"
    raise ValueError(
        _GPTQ_OR_AWQ_MSG.format(
            module=module, qweight=qweight, scales=scales, path=path, shape=shape
        )
    )


def _check_method(layout: str, name: str, config: dict | None) -> None:
    method = (config or {}).get("quant_method")
    if method is not None and str(method).lower() not in _METHODS[layout]:
        raise ValueError(_QUANT_METHOD_MSG.format(got=method, name=name, layout=layout))


def _read_quantized(
    name: str, layout: str, source: Source, path: str, shape: tuple[int, ...]
) -> Layer:
    config = source.quantization_config
    if len(shape) != 2:
        raise ValueError(_NOT_MATRIX_MSG.format(name=name, layout=layout, path=path, shape=shape))
    if layout == "GPTQ or AWQ":
        layout = _gptq_or_awq(_module_of(name), source, path, shape)
    _check_method(layout, name, config)
    if layout == "bitsandbytes 4-bit":
        return read_bnb_4bit(name, source, path, shape)
    if layout == "compressed-tensors pack-quantized":
        return read_packed(name, source, path, shape, config)
    if layout in MICROSCALED:
        return read_microscaled(name, layout, source, path, shape)
    if layout == "GPTQ":
        return read_gptq(_module_of(name), source, path, shape, config)
    return read_awq(_module_of(name), source, path, shape, config)


# The leaves every layer of a stack shares (the code tables): kept once.
_SHARED = {"code", "nested_code", "offset"}


class _Stack:
    """The layers of a stack gathered field by field into one host buffer each, as
    they are read (one layer's tensors alive beside the buffers at a time)."""

    def __init__(self, first: Layer, count: int, path: str, template: str):
        self.first, self.path, self.template = first, path, template
        self.buffers: dict[str, np.ndarray | None] = {}
        self.g_idx: list[np.ndarray] = []
        for key, value in first.arrays.items():
            if value is None or key in _SHARED:
                self.buffers[key] = value
            elif key == "g_idx":
                self.buffers[key] = None
            else:
                self.buffers[key] = np.empty((count, *value.shape), value.dtype)
        self.put(0, first)

    def _mixed(self, what: str, other: str) -> ValueError:
        return ValueError(
            _MIXED_STACK_MSG.format(path=self.path, template=self.template, first=what, other=other)
        )

    def put(self, i: int, layer: Layer) -> None:
        if layer.cls is not self.first.cls or layer.static != self.first.static:
            raise self._mixed(
                f"{self.first.cls.__name__} {self.first.static}",
                f"{layer.cls.__name__} {layer.static}",
            )
        for key, value in layer.arrays.items():
            expected = self.first.arrays[key]
            if (value is None) != (expected is None):
                raise self._mixed(f"`{key}` {'absent' if expected is None else 'present'}", "not")
            if value is None:
                continue
            assert expected is not None
            if value.shape != expected.shape or value.dtype != expected.dtype:
                raise self._mixed(f"`{key}` {expected.shape}", f"{value.shape}")
            if key in _SHARED:
                if not np.array_equal(value, expected):
                    raise self._mixed(f"`{key}`", "another table")
            elif key == "g_idx":
                self.g_idx.append(value)
            else:
                buffer = self.buffers[key]
                assert buffer is not None
                buffer[i] = value

    def build(self, batch: tuple[int, ...]) -> QuantizedArray:
        arrays = {
            k: v if v is None or k in _SHARED else v.reshape(*batch, *v.shape[1:])
            for k, v in self.buffers.items()
        }
        if self.g_idx:
            same = all(np.array_equal(g, self.g_idx[0]) for g in self.g_idx[1:])
            stacked = np.stack(self.g_idx).reshape(*batch, -1)
            arrays["g_idx"] = self.g_idx[0] if same else stacked
        return Layer(self.first.cls, arrays, self.first.static).build()


def _as_leaf_dtype(value: QuantizedArray, leaf: Any) -> QuantizedArray:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return value
    assert isinstance(value, _READ_TYPES)
    return value.with_dtype(dtype)


def load_safetensors(
    model: PyTree,
    files: str | os.PathLike | list[str | os.PathLike],
    name_map: Mapping[str, Any] | Callable[[str], Any],
    *,
    strict: bool = True,
    quantization_config: dict[str, Any] | None = None,
    allow_materialise: bool = False,
    block_bytes: int | None = None,
    matmul: str | None = None,
) -> PyTree:
    """Load a checkpoint's weights (`*.safetensors`, as Hugging Face saves them) into
    an Equinox model, through a name map; weights stored in a 4-bit layout of
    PyTorch's libraries become quantised Values, never dense arrays.

    The tensors are memory-mapped and read one leaf at a time, so loading holds
    one layer's tensors (and, for a quantised layout, its codes) beside the
    model, never a dense copy of it.

    A name that the map gives for a weight (`"model.layers.0.mlp.up_proj.weight"`)
    is looked up as a float tensor, or as the quantised layout stored under it,
    told by the tensors' names and shapes:

    - bitsandbytes 4-bit (NF4 or FP4, nested or not; transformers'
        `save_pretrained` with `load_in_4bit`): `<name>` with
        `<name>.quant_state.bitsandbytes__nf4` beside it, read as a `Bnb4bitArray`;
    - GPTQ (`<module>.qweight` `[in * bits / 32, out]`, `qzeros`, `scales`,
        `g_idx`) and AWQ GEMM (`<module>.qweight` `[in, out / 8]`), read as a
        `GroupedIntArray` (AWQ's codes repacked once);
    - compressed-tensors `pack-quantized` (`<name>_packed`, `<name>_scale`, ...),
        read as a `GroupedIntArray`.
    - compressed-tensors `nvfp4-pack-quantized` and `mxfp4-pack-quantized`
        (`<name>_packed` in `uint8`, e2m1 codes; e4m3 scales and a global scale,
        or E8M0 scales), read as an `NVFP4Array` or an `MXArray`, and
        `mxfp8-quantized` (`<name>` in float8 e4m3, E8M0 `<name>_scale`), an
        `MXArray`.

    Each dequantises exactly as its library does, cast to the model leaf's
    dtype. Where a file alone does not settle a layout, the checkpoint's
    `config.json` does (`files` a directory, or `quantization_config` given):
    GPTQ's zero points are v1 (stored minus one) unless its
    `checkpoint_format` is `"gptq_v2"`, the default every GPTQ writer saves in.

    **Arguments:**

    - `model`: the model, whose arrays (or `jax.ShapeDtypeStruct`s, from
        `eqx.filter_eval_shape`) give the shapes and dtypes expected.
    - `files`: one `.safetensors` file, a list of them (a sharded checkpoint), or
        a directory holding them (and `config.json`).
    - `name_map`: for each of our leaves, by dotted path, the checkpoint's tensor
        name: a dict or a function of the path (None: leave the leaf alone). A
        name may be a pair `(name, function)` to transform the array first (such
        as `np.transpose` for a kernel stored `(in, out)`; for a quantised
        layout only `np.transpose`, which gives the transposed Value), and
        holds one `{}` per leading axis to stack from several tensors
        (`"model.layers.{}.mlp.up_proj.weight"` for a stack of layers whose leaf
        has the layer axis first).
    - `strict`: whether every leaf named must be found (else it is left alone).
    - `quantization_config`: the checkpoint's `quantization_config` (as in its
        `config.json`), for a file given alone; by default the directory's.
    - `allow_materialise`, `block_bytes`, `matmul`: for the quantised Values, as
        for `QuantizedArray` (`block_bytes` by default its default).

    **Returns:**

    The model with those leaves replaced by the checkpoint's arrays, cast to each
    leaf's dtype, or by quantised Values of the leaf's shape and dtype.

    **Raises:**

    `KeyError` for a name not in the checkpoint (when `strict`); `ValueError` for
    a shape that does not fit, or a quantised layout that is not read here or is
    ambiguous (each message names the layout and the way out).

    !!! example

        ```python
        import os, tempfile
        from safetensors.numpy import save_file

        linear = eqx.nn.Linear(2, 2, key=jr.key(0))
        with tempfile.TemporaryDirectory() as d:
            file = os.path.join(d, "model.safetensors")
            save_file({"proj.weight": np.eye(2, dtype=np.float32),
                       "proj.bias": np.zeros(2, np.float32)}, file)
            loaded = load_safetensors(linear, file, {"weight": "proj.weight", "bias": "proj.bias"})
        assert jnp.array_equal(loaded.weight, jnp.eye(2))
        ```
    """
    source = open_source(files, quantization_config)
    lookup = name_map if callable(name_map) else name_map.get
    leaves, treedef = jtu.tree_flatten_with_path(model, is_leaf=is_value)
    out = []
    for key_path, leaf in leaves:
        path = dotted_path(key_path)
        entry = lookup(path)
        if entry is None:
            out.append(leaf)
            continue
        name, transform = entry if isinstance(entry, tuple) else (entry, None)
        shape = _shape_of(leaf)
        stacked = name.count("{}")
        names = _names_for(name, shape[:stacked], path) if stacked else [((), name)]
        layouts = [_layout(n, source) for _, n in names]
        missing = [
            n for (_, n), layout in zip(names, layouts) if layout is None and n not in source
        ]
        if missing:
            if strict:
                raise KeyError(
                    _MISSING_MSG.format(
                        name=missing[0],
                        path=path,
                        paths=[str(p) for p in source.paths],
                        module=_module_of(missing[0]),
                        some=source.some_names(),
                    )
                )
            out.append(leaf)
            continue
        if any(layout is not None for layout in layouts):
            out.append(_quantized_leaf(leaf, path, name, names, layouts, transform, source))
            continue
        parts = [source.get(n) if transform is None else transform(source.get(n)) for _, n in names]
        array = np.stack(parts).reshape(shape[:stacked] + parts[0].shape) if stacked else parts[0]
        if tuple(array.shape) != shape:
            raise ValueError(_SHAPE_MSG.format(path=path, shape=shape, name=name, got=array.shape))
        out.append(jnp.asarray(array, dtype=leaf.dtype))
    options: dict[str, Any] = dict(allow_materialise=allow_materialise, matmul=matmul)
    if block_bytes is not None:
        options["block_bytes"] = block_bytes
    out = [dataclasses.replace(x, **options) if isinstance(x, _READ_TYPES) else x for x in out]
    return jtu.tree_unflatten(treedef, out)


def _quantized_leaf(leaf, path, template, names, layouts, transform, source) -> QuantizedArray:
    shape = _shape_of(leaf)
    batch = shape[: template.count("{}")]
    layout = next(x for x in layouts if x is not None)
    if transform is not None and transform is not np.transpose:
        raise ValueError(_TRANSFORM_MSG.format(name=names[0][1], layout=layout))
    matrix = shape[len(batch) :]
    if transform is np.transpose:
        matrix = matrix[::-1]
    for (_, name), kind in zip(names, layouts):
        if kind is None:
            raise ValueError(
                _MIXED_STACK_MSG.format(
                    path=path, template=template, first=layout, other=f"{name} stored dense"
                )
            )
    if not batch:
        value = _read_quantized(names[0][1], layouts[0], source, path, matrix).build()
    else:
        stack = None
        for i, ((_, name), kind) in enumerate(zip(names, layouts)):
            layer = _read_quantized(name, kind, source, path, matrix)
            if stack is None:
                stack = _Stack(layer, len(names), path, template)
            else:
                stack.put(i, layer)
        assert stack is not None
        value = stack.build(batch)
    if transform is np.transpose:
        value = value.swapped()
    return _as_leaf_dtype(value, leaf)
