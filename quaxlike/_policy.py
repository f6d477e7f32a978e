"""`materialise_policy`: what happens when a Value falls back to being dense."""

import contextlib
import contextvars
import warnings
from collections.abc import Iterator

from . import _config, _jax_compat as jc
from ._diagnostics import MaterialisationError, messages


_mode: contextvars.ContextVar[str] = contextvars.ContextVar(
    "quaxlike_materialise_mode", default=_config.MATERIALISE_MODE_AT_IMPORT
)


@contextlib.contextmanager
def materialise_policy(mode: str) -> Iterator[None]:
    """Choose what happens when a primitive has no rule for a Value and quaxlike
    falls back to materialising it (building the dense array it stands for).

    - `"allow"` (the default): materialise silently.
    - `"warn"`: materialise, and issue a `UserWarning` naming the Value's type, the
        primitive and the line of your code that applied it.
    - `"error"`: raise a `quaxlike.MaterialisationError` instead.

    The mode applies while tracing, so it matters where `quaxify`'d code is
    *traced* (the first call of a `jax.jit`-ed function), not where a compiled
    function runs. A type can opt out of warnings and errors (when being dense is
    expected and cheap) with the class attribute `warn_on_materialise = False`.
    The starting mode comes from the environment variable `QUAXLIKE_MATERIALISE`.
    Explicit calls to `value.materialise()` are never affected.

    **Arguments:**

    - `mode`: `"allow"`, `"warn"` or `"error"`.

    **Returns:**

    A context manager; the previous mode is restored on exit.

    !!! example

        ```python
        from quaxlike.lora import LoraArray

        weight = LoraArray(jnp.ones((3, 2)), rank=1, key=jr.key(0), allow_materialise=True)
        with quaxlike.materialise_policy("error"):
            y = quaxlike.quaxify(lambda w, x: w @ x)(weight, jnp.ones(2))  # a rule: fine
            try:
                quaxlike.quaxify(jnp.exp)(weight)  # no rule for `exp`: would go dense
            except quaxlike.MaterialisationError as error:
                print(error)  # names LoraArray, `exp` and this line
        ```
    """
    if mode not in _config.MATERIALISE_MODES:
        raise ValueError(
            f"materialise_policy({mode!r}): the mode must be one of "
            f"{', '.join(repr(m) for m in _config.MATERIALISE_MODES)}."
        )
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


# The mode now: "allow", "warn" or "error" (the context variable's own `get`,
# called on every shortcut: no Python frame of ours around it).
current_mode = _mode.get


def on_fallback(value, primitive) -> None:
    """Apply the current policy to a fallback materialisation of `value` for
    `primitive` (before it happens): nothing under "allow", a warning under
    "warn", a `MaterialisationError` under "error"."""
    mode = _mode.get()
    if mode == "allow" or not getattr(type(value), "warn_on_materialise", True):
        return
    type_name = type(value).__qualname__
    primitive_name = getattr(primitive, "name", str(primitive))
    where = jc.user_source_line()
    if mode == "error":
        raise MaterialisationError(
            messages.MATERIALISED_UNDER_ERROR_POLICY.format(
                type_name=type_name, primitive=primitive_name, where=where.text
            )
        )
    message = messages.MATERIALISED_WARNING.format(
        type_name=type_name, primitive=primitive_name, where=where.text
    )
    if where.filename is None:
        warnings.warn(message, UserWarning, stacklevel=2)
    else:
        warnings.warn_explicit(message, UserWarning, where.filename, where.lineno)
