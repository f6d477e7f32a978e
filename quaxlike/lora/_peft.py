"""Adapters in and out of the Hugging Face PEFT layout.

PEFT keeps a LoRA adapter as `adapter_model.safetensors` plus `adapter_config.json`.
For a linear layer `W` of shape `(out, in)` (PyTorch's layout, and Equinox's), the
update is `(lora_alpha / r) * lora_B @ lora_A`, with `lora_A` of shape `(r, in)`
and `lora_B` of shape `(out, r)`, stored under
`base_model.model.<module name>.lora_A.weight` and `....lora_B.weight`. A
`LoraArray` over that `W` holds `A` `(out, r)` and `B` `(r, in)` with update
`A @ B`: `lora_B` is `A` and `lora_A` is `B * r / lora_alpha`. A kernel stored
`(in, out)` (Flax's `kernel`) is the transpose: `lora_B` is `Bᵀ`, `lora_A` is
`Aᵀ * r / lora_alpha`.

A DoRA adapter (`use_dora=True`) adds one 1-D tensor per module,
`base_model.model.<module name>.lora_magnitude_vector` (no `.weight`, no adapter
name): the magnitude `m` of a `DoraArray`, one entry per output row.

Module names are our dotted paths without the weight's name (`layers.0` for
`layers.0.weight`), or whatever `name_map` makes of them. A stack of layers (a
weight with leading batch axes, as `lax.scan` over layers uses) is one PEFT module
per layer: its name in `name_map` holds one `{}` per batch axis
(`"model.layers.{}.self_attn.q_proj"`).

Needs the `safetensors` package: `pip install 'quaxlike[peft]'`.
"""

import itertools
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

import quaxlike

from ..selection import dotted_path, is_value
from ._base import LowRankValue, shape_of
from ._dora import DoraArray
from ._value import LoraArray


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."

_NO_SAFETENSORS_MSG = (
    "Reading and writing the PEFT layout needs the `safetensors` package: "
    "`pip install 'quaxlike[peft]'` (or `pip install safetensors`)."
)
_UNUSED_MSG = (
    "`load_peft`: the adapter holds modules that no weight of the model maps to: "
    "{unused}. The model's weights map to: {known}. Give `name_map` the names the "
    "adapter was saved with (the same map as for `save_peft`), or adapt the model "
    "at those weights."
)
_NO_LORA_MSG = (
    "`save_peft` found no LoraArray in the model: adapt it first with `loraify` or "
    "`qlora` (a `LoraConvKernel` or a `MultiLoraArray` has no PEFT linear layout; for a "
    "stack of adapters, save each one: `save_peft(with_adapter(model, k), ...)`)."
)
_MIXED_MSG = (
    "`save_peft`: the model holds both LoraArrays and DoraArrays, but PEFT's "
    "`use_dora` is one flag for the whole adapter. Save them apart: select each kind "
    "with `name_map` (a function returning None for the others)."
)
_DORA_KERNEL_MSG = (
    "`{function}`: `{path}` is a kernel stored `(in, out)`, and a DoRA adapter's "
    "magnitude is per output row of a weight stored `(out, in)`: DoRA on such kernels "
    "is not supported. Load or save it on a model whose weight is `(out, in)` (an "
    "`eqx.nn.Linear`), or pass `transposed=lambda path: False` if it truly is."
)
_NO_MAGNITUDE_MSG = (
    "`load_peft`: the adapter's config has `use_dora=True`, but module {name!r} has "
    "no `lora_magnitude_vector`; the file is incomplete or not a DoRA adapter."
)
_UNSUPPORTED_MSG = (
    "`load_peft`: the adapter's config has {what}, which this loader does not "
    "support; only plain LoRA on linear layers (PEFT's defaults) is read."
)


def _safetensors_numpy():
    try:
        import safetensors.numpy as st
    except ImportError as error:
        raise ImportError(_NO_SAFETENSORS_MSG) from error
    return st


def _default_name(path: str) -> str:
    for suffix in (".weight", ".kernel.value", ".kernel"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def _default_transposed(path: str) -> bool:
    return path.endswith((".kernel", ".kernel.value")) or path in ("kernel", "kernel.value")


def _namer(name_map: Mapping[str, str] | Callable[[str], str | None] | None):
    """`path -> PEFT module name or None`, from a dict (keyed by a leaf's path or its
    module's path), a function, or None (the module path itself)."""
    if name_map is None:
        return _default_name
    if callable(name_map):
        return name_map
    return lambda path: name_map.get(path, name_map.get(_default_name(path)))


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


def _as_numpy(x: Any, dtype: Any) -> np.ndarray:
    array = np.asarray(x)
    return array.astype(dtype) if dtype is not None else array


def save_peft(
    model: PyTree,
    directory: str | os.PathLike,
    *,
    lora_alpha: int | float | None = None,
    name_map: Mapping[str, str] | Callable[[str], str | None] | None = None,
    transposed: Callable[[str], bool] | None = None,
    dtype: Any = None,
    base_model_name_or_path: str | None = None,
    use_rslora: bool = False,
) -> dict[str, Any]:
    """Save the LoRA factors of `model` as a PEFT adapter (and the magnitudes of
    its `DoraArray`s as a DoRA adapter, `use_dora=True`).

    Writes `adapter_model.safetensors` (PEFT's tensor names and orientation) and
    `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, and a
    `rank_pattern` where ranks differ) to `directory`, which is created if need be.

    **Arguments:**

    - `model`: a PyTree holding `LoraArray`s, or `DoraArray`s (from `loraify`,
        `qlora`, `load_peft`; with `dora=True`), not both.
    - `directory`: where to write the two files.
    - `lora_alpha`: PEFT's `lora_alpha`; the update is scaled by `lora_alpha / r`
        when read, so `lora_A` is written divided by it. By default `r` (a scale
        of 1: the factors are written as they are).
    - `name_map`: the PEFT module name of each adapted weight: a dict keyed by our
        dotted path (of the weight, or of its layer: `"layers.0"`), or a function
        of the weight's path. By default the layer's dotted path. A weight with
        batch axes (a stack of layers) needs one `{}` per axis in its name.
    - `transposed`: `path -> bool`, whether the weight is stored `(in, out)`. By
        default, weights named `kernel` (Flax) are, `weight`s (Equinox) are not.
    - `dtype`: the dtype of the saved tensors (by default, the factors').
    - `base_model_name_or_path`: written to the config, for PEFT's loaders.
    - `use_rslora`: write an rsLoRA adapter: PEFT scales it by
        `lora_alpha / sqrt(r)`, so `lora_A` is written times `sqrt(r) / lora_alpha`.

    **Returns:**

    The config written, as a dict.

    !!! example

        ```python
        import tempfile

        mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=jr.key(0))
        model = loraify(mlp, rank=2, key=jr.key(1))
        with tempfile.TemporaryDirectory() as d:
            config = save_peft(model, d, lora_alpha=16)
            again = load_peft(mlp, d)
        assert config["r"] == 2 and config["target_modules"] == ["0", "1"]
        assert jnp.allclose(again.layers[0].weight.a, model.layers[0].weight.a)
        ```
    """
    st = _safetensors_numpy()
    namer = _namer(name_map)
    transposed = transposed or _default_transposed
    found = jtu.tree_flatten_with_path(model, is_leaf=is_value)[0]
    loras = [(dotted_path(p), x) for p, x in found if type(x) in (LoraArray, DoraArray)]
    loras = [(path, x) for path, x in loras if namer(path) is not None]
    if not loras:
        raise ValueError(_NO_LORA_MSG)
    kinds = {type(x) for _, x in loras}
    if len(kinds) > 1:
        raise ValueError(_MIXED_MSG)
    dora = kinds == {DoraArray}
    ranks = Counter(x.rank for _, x in loras)
    r = ranks.most_common(1)[0][0]
    tensors: dict[str, np.ndarray] = {}
    rank_pattern: dict[str, int] = {}
    targets: set[str] = set()
    for path, lora in loras:
        template = namer(path)
        if template is None:
            continue
        alpha = float(lora.rank if lora_alpha is None else lora_alpha)
        factor = (math.sqrt(lora.rank) if use_rslora else lora.rank) / alpha
        a, b = np.asarray(lora.a), np.asarray(lora.b)
        batch = shape_of(lora.w)[:-2]
        magnitude = None
        if isinstance(lora, DoraArray):
            if transposed(path) or lora.transposed:
                raise ValueError(_DORA_KERNEL_MSG.format(function="save_peft", path=path))
            magnitude = np.asarray(lora.m)
        for index, name in _names_for(template, batch, path):
            a_i, b_i = a[index], b[index]
            if magnitude is not None:
                out_dtype = dtype if dtype is not None else a_i.dtype
                tensors[f"{PREFIX}{name}.lora_magnitude_vector"] = np.ascontiguousarray(
                    _as_numpy(magnitude[index], out_dtype)
                )
            if transposed(path):
                lora_b, lora_a = b_i.T, a_i.T * factor
            else:
                lora_b, lora_a = a_i, b_i * factor
            out_dtype = dtype if dtype is not None else a_i.dtype
            tensors[f"{PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(
                _as_numpy(lora_a, out_dtype)
            )
            tensors[f"{PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(
                _as_numpy(lora_b, out_dtype)
            )
            targets.add(name.rsplit(".", 1)[-1])
            if lora.rank != r:
                rank_pattern[name] = lora.rank
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": r if lora_alpha is None else lora_alpha,
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": use_rslora,
        "use_dora": dora,
        "rank_pattern": rank_pattern,
        "alpha_pattern": {},
        "modules_to_save": None,
        "task_type": None,
    }
    os.makedirs(directory, exist_ok=True)
    st.save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return config


def _read_adapter(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, dict]]:
    """The config, and `{module name: {"A": lora_A, "B": lora_B}}` (with `"M"`:
    `lora_magnitude_vector` for DoRA)."""
    st = _safetensors_numpy()
    with open(os.path.join(directory, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    if config.get("fan_in_fan_out"):
        raise ValueError(_UNSUPPORTED_MSG.format(what="fan_in_fan_out=True"))
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in st.load_file(os.path.join(directory, ADAPTER_WEIGHTS)).items():
        name = key[len(PREFIX) :] if key.startswith(PREFIX) else key
        for part in ("A", "B"):
            for marker in (f".lora_{part}.weight", f".lora_{part}.default.weight"):
                if name.endswith(marker):
                    modules.setdefault(name[: -len(marker)], {})[part] = tensor
        # PEFT saves `lora_magnitude_vector` bare; in memory it is `.default.weight`.
        for marker in _MAGNITUDE_MARKERS:
            if name.endswith(marker):
                modules.setdefault(name[: -len(marker)], {})["M"] = tensor
    return config, modules


_MAGNITUDE_MARKERS = (
    ".lora_magnitude_vector",
    ".lora_magnitude_vector.weight",
    ".lora_magnitude_vector.default.weight",
)


def _scale(config: dict[str, Any], name: str, r: int) -> float:
    alpha = config.get("alpha_pattern", {}).get(name, config.get("lora_alpha", r))
    if config.get("use_rslora"):
        return float(alpha) / math.sqrt(r)
    return float(alpha) / r


def load_peft(
    model: PyTree,
    directory: str | os.PathLike,
    *,
    name_map: Mapping[str, str] | Callable[[str], str | None] | None = None,
    transposed: Callable[[str], bool] | None = None,
    allow_materialise: bool = False,
    stop_gradient: bool = True,
) -> PyTree:
    """Load a PEFT LoRA adapter onto `model` (a DoRA adapter, `use_dora=True`, as
    `DoraArray`s).

    **Arguments:**

    - `model`: the base model (or a LoRA model: its adapters' factors are replaced,
        its frozen weights kept). Each weight whose PEFT name (through `name_map`)
        is in the adapter becomes a `LoraArray` over it.
    - `directory`: holding `adapter_model.safetensors` and `adapter_config.json`.
    - `name_map`, `transposed`: as for `save_peft`.
    - `allow_materialise`, `stop_gradient`: as for `LoraArray`.

    **Returns:**

    The model with `LoraArray`s whose update is PEFT's `(lora_alpha / r) lora_B
    @ lora_A` (with `use_rslora`, `lora_alpha / sqrt(r)`); for a DoRA adapter,
    `DoraArray`s with that update and PEFT's `lora_magnitude_vector` as their
    magnitude (`‖W‖²` per row computed once from the base, block by block for a
    quantised one).

    **Raises:**

    `ValueError` if the adapter has modules no weight maps to, or a factor's shape
    does not fit its weight.

    !!! example

        ```python
        import tempfile

        linear = eqx.nn.Linear(4, 3, key=jr.key(0))
        model = loraify(linear, rank=2, key=jr.key(1), where="weight")
        with tempfile.TemporaryDirectory() as d:
            save_peft(model, d, name_map={"weight": "proj"})
            again = load_peft(linear, d, name_map={"weight": "proj"})
        x = jnp.ones(4)
        assert jnp.allclose(quaxlike.quaxify(again)(x), quaxlike.quaxify(model)(x), atol=1e-6)
        ```
    """
    config, modules = _read_adapter(directory)
    namer = _namer(name_map)
    transposed = transposed or _default_transposed
    leaves, treedef = jtu.tree_flatten_with_path(model, is_leaf=is_value)
    used: set[str] = set()
    known: list[str] = []
    out = []
    for key_path, leaf in leaves:
        path = dotted_path(key_path)
        template = namer(path) if _is_weight(leaf) else None
        base = leaf.w if isinstance(leaf, LowRankValue) else leaf
        known_norms = leaf.weight_norm_squared() if isinstance(leaf, DoraArray) else None
        if template is None:
            out.append(leaf)
            continue
        batch = shape_of(base)[:-2]
        if template.count("{}") != len(batch):
            out.append(leaf)  # a stack without a name per layer: not mapped
            continue
        names = _names_for(template, batch, path)
        known.extend(name for _, name in names)
        if not all(name in modules for _, name in names):
            out.append(leaf)
            continue
        dora = bool(config.get("use_dora"))
        if dora and transposed(path):
            raise ValueError(_DORA_KERNEL_MSG.format(function="load_peft", path=path))
        a_parts, b_parts, m_parts = [], [], []
        for _, name in names:
            if dora:
                if "M" not in modules[name]:
                    raise ValueError(_NO_MAGNITUDE_MSG.format(name=name))
                m_parts.append(modules[name]["M"])
            lora_a, lora_b = modules[name]["A"], modules[name]["B"]
            r = lora_a.shape[0]
            scale = _scale(config, name, r)
            if transposed(path):
                a, b = lora_a.T * scale, lora_b.T
            else:
                a, b = lora_b, lora_a * scale
            a_parts.append(a)
            b_parts.append(b)
            used.add(name)
        dtype = base.dtype
        a = jnp.asarray(np.stack(a_parts).reshape(*batch, *a_parts[0].shape), dtype)
        b = jnp.asarray(np.stack(b_parts).reshape(*batch, *b_parts[0].shape), dtype)
        flags = dict(allow_materialise=allow_materialise, stop_gradient=stop_gradient)
        try:
            if dora:
                m = jnp.asarray(np.stack(m_parts).reshape(*batch, *m_parts[0].shape), dtype)
                new = DoraArray.from_factors(base, a, b, m, w_norm_sq=known_norms, **flags)
            else:
                new = LoraArray.from_factors(base, a, b, **flags)
        except ValueError as error:
            raise ValueError(f"`load_peft`: the adapter of `{path}` ({template}): {error}")
        out.append(new)
    unused = sorted(set(modules) - used)
    if unused:
        raise ValueError(_UNUSED_MSG.format(unused=unused[:8], known=known[:8]))
    return jtu.tree_unflatten(treedef, [x for x in out])


def _is_weight(leaf: Any) -> bool:
    if isinstance(leaf, LowRankValue):
        return type(leaf) in (LoraArray, DoraArray)
    if isinstance(leaf, quaxlike.ArrayValue) or hasattr(leaf, "shape"):
        return len(shape_of(leaf)) >= 2
    return False
