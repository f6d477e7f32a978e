"""JAX's high-level types (`jax.experimental.hijax`), found by probing.

`quaxlike.experimental.hijax` builds on JAX's hijax API, which is experimental
and has been renamed and extended in most releases. Everything it needs is
looked up here, by feature rather than by version, and nothing here runs more
than attribute lookups at `import quaxlike` (this module is imported only by
`quaxlike.experimental.hijax` and by the output handling of `quaxify`).

What each release offers (read from the released sources):

| JAX | hijax |
|---|---|
| 0.7.2 - 0.8.1 | `jax._src.hijax` only (no public module); no cotangent types, no `vmap` hooks |
| 0.8.2 - 0.9.1 | public `jax.experimental.hijax`, `VJPHiPrimitive`; a `HiType` has no `to_ct_aval`, `dec_rank` or `leading_axis_spec` |
| 0.9.2 - 0.10.x | all of it: `to_ct_aval` (a cotangent type of its own), `dec_rank`/`inc_rank`/`leading_axis_spec` (`vmap`, `scan`), `MappingSpec` (in `jax._src.hijax`), `instantiate_zeros` |
| 0.11 - 0.12 | the same, `MappingSpec` public; the primitive base is also `HiPrim` |

Inventory (what, what for, where, fallback):

| name | used for | found in | fallback |
|---|---|---|---|
| `HiType` | the base of a high-level type | `jax.experimental.hijax`, `jax._src.hijax` | unavailable |
| `HiPrim` / `VJPHiPrimitive` | the base of a high-level primitive | either name, either module | unavailable |
| `MappingSpec` | how `vmap` maps a high-level type | `jax.experimental.hijax` (0.11+), `jax._src.hijax` (0.9.2+) | unavailable |
| `instantiate_zeros` | dense tangents from symbolic zeros | `jax.experimental.hijax` (0.9.2+), `jax._src.interpreters.ad` | unavailable |
| `register_hitype` | the type of a value class | `jax.experimental.hijax`, `jax._src.hijax` | unavailable |
| `HiType.to_ct_aval`, `.leading_axis_spec` | a cotangent type, `scan` | 0.9.2+ | unavailable |

Where anything is missing, `require_hijax()` raises `HijaxUnavailableError`
(an `ImportError` and a `quaxlike.JaxCompatibilityError`), naming the installed
JAX and the releases that have it; `import quaxlike` never fails for it.
"""

import importlib
from typing import Any

import jax

from ._diagnostics import JaxCompatibilityError
from ._jax_compat import JAX_VERSION


HIJAX_RELEASES = "0.9.2 and later (tested on 0.10.2)"


class HijaxUnavailableError(JaxCompatibilityError, ImportError):
    """The installed JAX lacks the part of `jax.experimental.hijax` needed.

    An `ImportError` (so `pytest.importorskip` and `try: import` treat it as a
    missing optional feature) and a `quaxlike.JaxCompatibilityError`.

    !!! example

        ```python
        try:
            import quaxlike.experimental.hijax
        except HijaxUnavailableError as error:
            print(error)  # names the installed JAX and the releases that work
        ```
    """


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_PUBLIC = _module("jax.experimental.hijax")
_PRIVATE = _module("jax._src.hijax")
_AD = _module("jax._src.interpreters.ad")


def _find(*names: str, modules=(_PUBLIC, _PRIVATE)) -> Any:
    for module in modules:
        if module is None:
            continue
        for name in names:
            found = getattr(module, name, None)
            if found is not None:
                return found
    return None


HiType: Any = _find("HiType")
HiPrim: Any = _find("HiPrim", "VJPHiPrimitive")
MappingSpec: Any = _find("MappingSpec")
register_hitype: Any = _find("register_hitype")
instantiate_zeros: Any = _find("instantiate_zeros", modules=(_PUBLIC, _AD))

_NEEDED = {
    "HiType": HiType,
    "HiPrim (VJPHiPrimitive)": HiPrim,
    "MappingSpec": MappingSpec,
    "register_hitype": register_hitype,
    "instantiate_zeros": instantiate_zeros,
    "HiType.to_ct_aval": getattr(HiType, "to_ct_aval", None),
    "HiType.leading_axis_spec": getattr(HiType, "leading_axis_spec", None),
}
MISSING: tuple[str, ...] = tuple(name for name, found in _NEEDED.items() if found is None)
AVAILABLE = not MISSING


def require_hijax(needed_for: str = "quaxlike.experimental.hijax") -> None:
    """Raise `HijaxUnavailableError` unless the installed JAX has the hijax API.

    **Arguments:**

    - `needed_for`: what needs it, for the message.

    **Returns:**

    Nothing.
    """
    if AVAILABLE:
        return
    raise HijaxUnavailableError(
        f"{needed_for} needs JAX's high-level types (jax.experimental.hijax) with "
        f"cotangent types and vmap/scan hooks, which JAX {HIJAX_RELEASES} has; the "
        f"installed jax {JAX_VERSION} lacks {', '.join(MISSING)}. Upgrade JAX "
        "(pip install -U jax), or use an ordinary quaxlike.ArrayValue, which works "
        "on every supported JAX."
    )


def hi_type(x: Any) -> Any:
    """The high-level (hijax) type of `x`, or `None` if it has none.

    **Arguments:**

    - `x`: anything; only a value JAX types with a `HiType` counts.

    **Returns:**

    The `HiType`, or `None`.
    """
    if HiType is None or x is None or isinstance(x, (int, float, complex, bool)):
        return None
    try:
        ty = jax.typeof(x)
    except TypeError:
        return None
    return ty if isinstance(ty, HiType) else None
