"""Print, as JSON, every JAX primitive defined anywhere in `jax.lax`, `jax.extend`
and `jax._src`: one entry per primitive object, with its name and every
`module.attribute` it can be found under.

Run as a script (`python _enumerate.py`) by the coverage test, in a subprocess:
walking `jax._src` imports every JAX module (Pallas, Mosaic, cuDNN, test
harnesses, ...), which must not happen inside the test session.
"""

import importlib
import json
import pkgutil
import sys
import warnings


def _modules():
    import jax
    import jax._src
    import jax.extend

    names = ["jax.lax", "jax.lax.linalg"]
    for package in (jax.extend, jax._src):
        names.append(package.__name__)
        names.extend(
            m.name
            for m in pkgutil.walk_packages(
                package.__path__, package.__name__ + ".", onerror=lambda name: None
            )
        )
    del jax
    return names


def primitive_locations(module_names, *, import_modules: bool):
    """`{id(primitive): (primitive, {"module.attr", ...})}` over `module_names`."""
    from jax.extend.core import Primitive

    found: dict[int, tuple] = {}
    for name in module_names:
        if import_modules:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    module = importlib.import_module(name)
            except Exception:  # optional dependencies (Mosaic GPU, serialisation)
                continue
        else:
            module = sys.modules.get(name)
            if module is None:
                continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, Primitive):
                found.setdefault(id(value), (value, set()))[1].add(f"{name}.{attr}")
    return found


def main():
    found = primitive_locations(_modules(), import_modules=True)
    entries = [
        {"name": prim.name, "locations": sorted(locations)} for prim, locations in found.values()
    ]
    json.dump(sorted(entries, key=lambda e: (e["name"], e["locations"])), sys.stdout)


if __name__ == "__main__":
    main()
