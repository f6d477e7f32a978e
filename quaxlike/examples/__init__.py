"""Ready-made Value types. Each lives in its own subpackage with a README
describing it: `lora`, `zero`, `constant`, `hijax` (needs JAX's hijax API),
`interval`, `quantized`, `sparse`, `structured`, `structured_matrices`, `named`,
`unitful` and `prng` (for example `quaxlike.examples.lora`), and `selection`, the
language that picks the weights an adapter or quantiser replaces, and `sharding`,
which shards a whole model of Values by rules in that language. Each is
imported on first use, as in Quax."""

import importlib


_NAMES = (
    "constant",
    "hijax",
    "interval",
    "lora",
    "named",
    "prng",
    "quantized",
    "selection",
    "sharding",
    "sparse",
    "structured",
    "structured_matrices",
    "unitful",
    "zero",
)


def __getattr__(name: str):
    if name in _NAMES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
