"""Mirror a JAX namespace (`jax.numpy`, `jax.lax`, their submodules) with each
function quaxified on first access.

Nothing is listed by hand: the names are those of the source module. A name is
looked up there on first access, wrapped by `quaxified` and cached on the mirror
module, so later lookups are ordinary attribute reads. Submodules (`linalg`,
`fft`) become mirror modules of their own, registered in `sys.modules` so that
`import quaxlike.numpy.linalg` works.
"""

import functools as ft
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from .. import _jax_compat as jc
from .._quaxify import quaxify


MSG_NO_ATTRIBUTE = (
    "module {module!r} has no attribute {name!r}: it mirrors `{source}`, which has "
    "no public attribute of that name either."
)


class QuaxifiedUfunc:
    """A `jax.numpy.ufunc` whose call and methods (`reduce`, `accumulate`,
    `reduceat`, `outer`, `at`) accept Values; its other attributes (`nin`, `nout`,
    `identity`, ...) are those of the wrapped ufunc."""

    _methods = ("reduce", "accumulate", "reduceat", "outer", "at")

    def __init__(self, ufunc: jnp.ufunc):
        ft.update_wrapper(self, ufunc, updated=())
        self._call = quaxify(ufunc)
        for name in self._methods:
            setattr(self, name, quaxify(getattr(ufunc, name)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not set in `__init__`.
        if name == "__wrapped__":
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return f"<quaxified {self.__wrapped__!r}>"


def _quaxify_result(factory: Callable[..., Any]) -> Callable[..., Any]:
    """For functions that build functions (`vectorize`, `frompyfunc`): the
    function they build is quaxified too."""

    @ft.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return quaxified(factory(*args, **kwargs))

    return wrapper


# The only exceptions to "wrap each function": these return functions, and a
# user of `qnp.vectorize(f)` expects the result to accept Values as well.
_FACTORIES = (jnp.vectorize, jnp.frompyfunc)


def quaxified(obj: Any) -> Any:
    """`obj` as a mirror exposes it: functions quaxified, ufuncs wrapped as
    `QuaxifiedUfunc`, everything else (classes and dtypes, constants, primitives,
    typing aliases, index helpers like `r_`) unchanged."""
    if isinstance(obj, jnp.ufunc):
        return QuaxifiedUfunc(obj)
    if any(obj is factory for factory in _FACTORIES):
        return _quaxify_result(obj)
    if (
        not callable(obj)
        or isinstance(obj, type)
        or jc.is_primitive(obj)
        or typing.get_origin(obj) is not None
    ):
        return obj
    return quaxify(obj)


class Mirror:
    """The lookup behind one mirror module: `module` shows the public names of
    `source`, quaxified on first access."""

    def __init__(self, module: types.ModuleType, source: types.ModuleType):
        self.module = module
        self.source = source
        self.names = sorted(n for n in dir(source) if not n.startswith("_"))
        for name in self.names:
            obj = getattr(source, name)
            if isinstance(obj, types.ModuleType):
                setattr(module, name, mirror_module(f"{module.__name__}.{name}", obj))

    def getattr(self, name: str) -> Any:
        try:
            if name.startswith("_"):
                raise AttributeError(name)
            obj = getattr(self.source, name)
        except AttributeError:
            raise AttributeError(
                MSG_NO_ATTRIBUTE.format(
                    module=self.module.__name__, name=name, source=self.source.__name__
                )
            ) from None
        out = quaxified(obj)
        setattr(self.module, name, out)  # later lookups skip `__getattr__`
        return out

    def dir(self) -> list[str]:
        own = (n for n in vars(self.module) if not n.startswith("_"))
        return sorted({*self.names, *own})


def mirror_module(name: str, source: types.ModuleType) -> types.ModuleType:
    """A new module called `name` mirroring `source`, registered in `sys.modules`."""
    module = types.ModuleType(
        name, f"`{source.__name__}`, with every function accepting Values (quaxified)."
    )
    mirror = Mirror(module, source)
    module.__getattr__ = mirror.getattr  # pyright: ignore[reportAttributeAccessIssue]
    module.__dir__ = mirror.dir  # pyright: ignore[reportAttributeAccessIssue]
    module.__all__ = list(mirror.names)  # pyright: ignore[reportAttributeAccessIssue]
    sys.modules[name] = module
    return module
