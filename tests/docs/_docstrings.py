"""The examples in quaxlike's public docstrings, and the namespace they run in.

An example is a ```python block in the docstring of a public object: a name
exported by `quaxlike`, `quaxlike.internal` or one of the toolkits
(`quaxlike.lora`, ...), or a public method or property of such a class. Each example runs on
its own, in a fresh namespace holding `PREAMBLE`'s imports and every public
name of the package that exports the object (so an example in `LoraArray`'s
docstring may use `loraify` without importing it).

    python tests/docs/_docstrings.py      # runs them all, prints a JSON report
"""

import contextlib
import importlib
import inspect
import io
import json
import os
import sys
import traceback
import warnings

from quaxlike import _hijax_compat, examples as _examples


# Every toolkit but the hijax units, which need JAX's high-level types (below).
PACKAGES = ["quaxlike", "quaxlike.internal", "quaxlike.checkpoints"] + [
    home for name, home in _examples.HOMES.items() if name != "hijax"
]
if _hijax_compat.AVAILABLE:  # JAX's high-level types: JAX 0.9.2 and later
    PACKAGES += ["quaxlike.experimental.hijax_units", "quaxlike.experimental.hijax"]

PREAMBLE = """\
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike

import quaxlike
"""


def _public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None or module.__name__ == "quaxlike":
        names = [n for n in vars(module) if not n.startswith("_")]
    return sorted(n for n in names if not inspect.ismodule(getattr(module, n)))


def documented() -> dict[str, tuple[str, str]]:
    """`{qualified name: (package, docstring)}` for every public object quaxlike
    defines (re-exports of JAX objects are left out)."""
    out: dict[str, tuple[str, str]] = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in _public_names(module):
            obj = getattr(module, name)
            if not getattr(obj, "__module__", "").startswith("quaxlike"):
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj)):
                continue
            out[f"{package}.{name}"] = (package, inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    target = value.fget if isinstance(value, property) else value
                    target = getattr(target, "__func__", target)
                    doc = getattr(target, "__doc__", None)
                    if doc and getattr(target, "__module__", "").startswith("quaxlike"):
                        out[f"{package}.{name}.{attr}"] = (package, inspect.cleandoc(doc))
    return out


def examples() -> dict[str, tuple[str, list[str]]]:
    """`{qualified name: (package, [example code, ...])}` for docstrings with examples."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _blocks import blocks

    found = {}
    for name, (package, doc) in documented().items():
        codes = [b.code for b in blocks(doc) if b.run]
        if codes:
            found[name] = (package, codes)
    return found


def run_all() -> dict[str, str | None]:
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"optax(\..*)?")
    report: dict[str, str | None] = {}
    for name, (package, codes) in examples().items():
        namespace: dict = {"__name__": "__main__"}
        try:
            exec(PREAMBLE, namespace)
            exec(f"from {package} import *", namespace)
            module = importlib.import_module(package)
            for public in _public_names(module):
                namespace.setdefault(public, getattr(module, public))
            # Examples may print: keep stdout for the report.
            with contextlib.redirect_stdout(io.StringIO()):
                for code in codes:
                    exec(compile(code, f"<docstring of {name}>", "exec"), namespace)
        except BaseException:
            report[name] = traceback.format_exc()
        else:
            report[name] = None
    return report


if __name__ == "__main__":
    print(json.dumps(run_all()))
