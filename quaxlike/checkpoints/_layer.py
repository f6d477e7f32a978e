"""One weight as a layout reader gives it: the quantised Value's class and its
fields in NumPy, on the host, so that a stack of layers is gathered into one
buffer per field before anything reaches the device (one copy of the codes,
never one per layer and another for the stack)."""

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..quantized import QuantizedArray


@dataclasses.dataclass
class Layer:
    """A quantised weight read from a checkpoint, not yet a Value.

    **Arguments:**

    - `cls`: the Value's class (`GroupedIntArray`, `Bnb4bitArray`).
    - `arrays`: its array fields, NumPy arrays or `None`.
    - `static`: its other fields.
    """

    cls: type[QuantizedArray]
    arrays: dict[str, np.ndarray | None]
    static: dict[str, Any]

    def build(self) -> QuantizedArray:
        """The Value, its arrays copied to the device."""
        arrays = {k: None if v is None else jnp.asarray(v) for k, v in self.arrays.items()}
        return self.cls(**arrays, **self.static)  # pyright: ignore[reportCallIssue]
