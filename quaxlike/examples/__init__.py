"""Quax-compatible names for quaxlike's toolkits.

Quax keeps its types under `quax.examples`, and a Quax user's
`quax.examples.lora` maps to `quaxlike.examples.lora`. Those names are aliases:
`quaxlike.examples.lora` *is* the module `quaxlike.lora` (the same object, so
`isinstance` checks, rule registrations and module state are shared), and so are
its submodules (`quaxlike.examples.lora._peft is quaxlike.lora._peft`). No code
lives here. A module that code written for Quax registers by hand under an
alias's name (`sys.modules["quaxlike.examples.prng._core"] = ...`, as Quax's
test shims do) is an attribute of the home too, so that `import
quax.examples.prng._core` finds it as it did when the alias was the module's own
name.

| Quax-compatible name | home |
|---|---|
| `quaxlike.examples.lora` | `quaxlike.lora` |
| `quaxlike.examples.quantized` | `quaxlike.quantized` |
| `quaxlike.examples.sparse` | `quaxlike.sparse` |
| `quaxlike.examples.structured` | `quaxlike.structured` |
| `quaxlike.examples.structured_matrices` | `quaxlike.structured.quax_names` |
| `quaxlike.examples.named` | `quaxlike.named` |
| `quaxlike.examples.unitful` | `quaxlike.units` |
| `quaxlike.examples.zero` | `quaxlike.symbolic.zero` |
| `quaxlike.examples.constant` | `quaxlike.symbolic.constant` |
| `quaxlike.examples.interval` | `quaxlike.interval` |
| `quaxlike.examples.prng` | `quaxlike.prng` |
| `quaxlike.examples.hijax` | `quaxlike.experimental.hijax_units` |
| `quaxlike.examples.selection` | `quaxlike.selection` |
| `quaxlike.examples.sharding` | `quaxlike.sharding` |

Each is imported on first use, as in Quax.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types


# Quax-compatible name -> the toolkit's home.
HOMES = {
    "constant": "quaxlike.symbolic.constant",
    "hijax": "quaxlike.experimental.hijax_units",
    "interval": "quaxlike.interval",
    "lora": "quaxlike.lora",
    "named": "quaxlike.named",
    "prng": "quaxlike.prng",
    "quantized": "quaxlike.quantized",
    "selection": "quaxlike.selection",
    "sharding": "quaxlike.sharding",
    "sparse": "quaxlike.sparse",
    "structured": "quaxlike.structured",
    "structured_matrices": "quaxlike.structured.quax_names",
    "unitful": "quaxlike.units",
    "zero": "quaxlike.symbolic.zero",
}
_NAMES = tuple(HOMES)


def home_of(alias: str) -> str | None:
    """The module that the Quax-compatible name `alias` stands for.

    **Arguments:**

    - `alias`: a full module name, such as `"quaxlike.examples.lora._peft"`.

    **Returns:**

    The home's full module name (`"quaxlike.lora._peft"`), or `None` where
    `alias` is not under one of the names in `HOMES`.
    """
    prefix = __name__ + "."
    if not alias.startswith(prefix):
        return None
    head, dot, rest = alias[len(prefix) :].partition(".")
    if head not in HOMES:
        return None
    return HOMES[head] + dot + rest


def _register_loaded_submodules(alias: str, home: str) -> None:
    # Submodules of the home already loaded are put under the alias's names too,
    # so that code looking in `sys.modules` (as Quax's test shims do) finds them.
    for name in [n for n in sys.modules if n.startswith(home + ".")]:
        sys.modules.setdefault(alias + name[len(home) :], sys.modules[name])


def _answer_alias_names(alias: str, home: types.ModuleType) -> None:
    # `import a.b.c as m` looks `c` up as an attribute of `a.b`, and then as
    # `sys.modules[a.b.__name__ + ".c"]`. The module's `__name__` is the home's,
    # so a submodule registered by hand under the alias's name only (a Quax test
    # shim's `quaxlike.examples.prng._core`) would be found by neither: the home
    # answers such a name from `sys.modules` under the alias, after its own
    # attributes and its own `__getattr__` (if it has one) have not.
    previous = home.__dict__.get("__getattr__")
    if getattr(previous, "_alias_of", None) == alias:
        return

    def __getattr__(name: str):
        if previous is not None:
            try:
                return previous(name)
            except AttributeError:
                pass
        registered = sys.modules.get(f"{alias}.{name}")
        if registered is None:
            raise AttributeError(f"module {home.__name__!r} has no attribute {name!r}")
        return registered

    __getattr__._alias_of = alias  # type: ignore[attr-defined]
    home.__getattr__ = __getattr__  # type: ignore[method-assign]


class _AliasLoader(importlib.abc.Loader):
    """Gives the home module itself for an alias. The home keeps its name and
    contents; it only learns to answer the names registered under the alias."""

    def __init__(self, alias: str, home: str):
        self.alias = alias
        self.home = home
        self.home_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.home)
        self.home_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system has set `__spec__` to the alias's spec: give the home
        # module back its own, so that it reads as the module it is.
        module.__spec__ = self.home_spec
        _register_loaded_submodules(self.alias, self.home)
        _answer_alias_names(self.alias, module)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds `quaxlike.examples.<name>[.<sub>]` as its home module. First on
    `sys.meta_path`, so that a submodule of an alias is never found again by path
    and executed a second time as a copy."""

    def find_spec(self, fullname, path, target=None):
        home = home_of(fullname)
        if home is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, home))


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())


def __getattr__(name: str):
    if name in HOMES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
