"""How the layer probes: the installed version against the tested range, the
JAX modules it reads from, looking names up among candidates, the error and
stand-ins for what is missing, and the record of speed-only shortcuts a
failed probe switched off."""

import importlib
from collections.abc import Callable
from typing import Any

import jax

from .._diagnostics import JaxCompatibilityError, messages


TESTED_RANGE = ("0.7.2", "0.12.0.1")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


JAX_VERSION = jax.__version__
_JAX_VERSION_TUPLE = _version_tuple(JAX_VERSION)


def beyond_tested_range() -> bool:
    """Whether the installed JAX is newer than the newest release tested."""
    return _JAX_VERSION_TUPLE > _version_tuple(TESTED_RANGE[1])


def _module(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # moved or broken in this release: probed for below
        return None


def _first(*candidates: tuple[Any, str]) -> Any:
    """The first `getattr(module, name)` that exists among `candidates`."""
    for module, name in candidates:
        if module is not None:
            value = getattr(module, name, None)
            if value is not None:
                return value
    return None


def missing(what: str, needed_for: str) -> JaxCompatibilityError:
    """The error for a JAX internal this release does not provide."""
    return JaxCompatibilityError(
        messages.JAX_INTERNAL_MISSING.format(
            what=what,
            needed_for=needed_for,
            version=JAX_VERSION,
            low=TESTED_RANGE[0],
            high=TESTED_RANGE[1],
        )
    )


def _unavailable(what: str, needed_for: str) -> Callable[..., Any]:
    def unavailable(*args, **kwargs):
        raise missing(what, needed_for)

    unavailable.__name__ = what.rsplit(".", 1)[-1]
    return unavailable


_disabled: list[str] = []


def disabled_shortcuts() -> list[str]:
    """Speed-only shortcuts that a failed probe turned off on this JAX."""
    return list(_disabled)


def switch_off(shortcut: str) -> None:
    """Record that a failed probe switched `shortcut` off."""
    _disabled.append(shortcut)


jex_core = _module("jax.extend.core")
_core = _module("jax._src.core")
_config = _module("jax._src.config")
_array = _module("jax._src.array")
_pjit = _module("jax._src.pjit")
_api = _module("jax._src.api")
_lu = _module("jax._src.linear_util")
_api_util = _module("jax._src.api_util")
_source_info_util = _module("jax._src.source_info_util")
_traceback_util = _module("jax._src.traceback_util")
_shard_map = _module("jax._src.shard_map")
_ad_checkpoint = _module("jax._src.ad_checkpoint")
_custom_derivatives = _module("jax._src.custom_derivatives")
_literals = _module("jax._src.literals")
_prims = getattr(jex_core, "primitives", None)
