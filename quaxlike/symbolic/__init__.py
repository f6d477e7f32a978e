"""Symbolic values: arrays known by a description rather than their elements.

`quaxlike.symbolic.zero` holds `Zero`, an array of zeros that stays symbolic
through the operations that keep it zero; `quaxlike.symbolic.constant` holds
`Constant`, an array with one value everywhere. Each is imported on first use.
"""

import importlib


def __getattr__(name: str):
    if name in ("zero", "constant"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
