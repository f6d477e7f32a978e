"""Where the loader reads from: one or more `.safetensors` files, memory-mapped and
read a tensor at a time, and the checkpoint's `quantization_config`."""

import glob
import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np


_NO_SAFETENSORS_MSG = (
    "Reading and writing safetensors checkpoints needs the `safetensors` package: "
    "`pip install 'quaxlike[peft]'` (or `pip install safetensors`)."
)
_NO_FILES_MSG = "`load_safetensors`: no `.safetensors` file in the directory {directory!r}."


def safetensors_module():
    """`safetensors` itself, or an ImportError saying how to install it."""
    try:
        import safetensors
        import safetensors.numpy  # noqa: F401
    except ImportError as error:
        raise ImportError(_NO_SAFETENSORS_MSG) from error
    return safetensors


class Source:
    """The tensors of a checkpoint, by name, read lazily: each file is opened with
    `safetensors.safe_open` (memory-mapped) and a tensor is copied out only when
    `get` asks for it, so loading holds one layer's tensors at a time.

    **Arguments:**

    - `paths`: the `.safetensors` files.
    - `quantization_config`: the checkpoint's `quantization_config` (from its
        `config.json`), or `None`.
    """

    def __init__(self, paths: list[str], quantization_config: dict[str, Any] | None):
        st = safetensors_module()
        self.paths = paths
        self.quantization_config = quantization_config
        self._handles = [st.safe_open(p, framework="numpy") for p in paths]
        self._where: dict[str, Any] = {}
        for handle in self._handles:
            for key in handle.keys():
                self._where[key] = handle

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def get(self, key: str) -> np.ndarray:
        """The tensor `key`, as a NumPy array (a copy out of the mapped file)."""
        return np.asarray(self._where[key].get_tensor(key))

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape, without reading it."""
        return tuple(self._where[key].get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The tensor's safetensors dtype name (`"I32"`, `"U8"`, `"F16"`, ...)."""
        return self._where[key].get_slice(key).get_dtype()

    def some_names(self, n: int = 8) -> list[str]:
        return sorted(self._where)[:n]


def open_source(
    files: str | os.PathLike | list[str | os.PathLike],
    quantization_config: dict[str, Any] | None,
) -> Source:
    """A `Source` over `files`: one file, a list of files, or a directory (every
    `.safetensors` file in it, and its `config.json`'s `quantization_config`
    unless one is given)."""
    if isinstance(files, (str, os.PathLike)) and os.path.isdir(files):
        directory = os.fspath(files)
        paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not paths:
            raise FileNotFoundError(_NO_FILES_MSG.format(directory=directory))
        config_file = os.path.join(directory, "config.json")
        if quantization_config is None and os.path.exists(config_file):
            with open(config_file) as f:
                quantization_config = json.load(f).get("quantization_config")
    elif isinstance(files, (str, os.PathLike)):
        paths = [os.fspath(files)]
    else:
        paths = [os.fspath(p) for p in files]
    return Source(paths, quantization_config)
