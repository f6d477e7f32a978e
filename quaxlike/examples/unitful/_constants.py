"""Plain numbers that fit every unit: 0, +-inf and NaN, when their value is known.

As in astropy, a quantity may be added to, compared with, or selected alongside
a plain number that is 0, +-inf or NaN in every element: those values are the same
in every unit. JAX's own `jax.numpy` code relies on it (`jnp.var` fills with NaN
where there are too few elements, `jnp.hypot` compares with inf, `jnp.median`
puts NaN where the input has one), so without it such functions refuse
quantities. Any other plain number counts as dimensionless, and a plain number
whose value is not known while tracing is refused next to a dimensioned quantity:
it could be anything.

A plain operand's value is known when it is concrete (a Python or NumPy number,
a literal of a jaxpr, a `jax.Array` outside any trace), or when it was computed
inside the body of a `jit` (every `jax.numpy` function is one) from that body's
literals and constants alone. The second case is what `jit_p_unitful` (in
`_functions`) arranges: it runs the body equation by equation, and for each
equation whose inputs are all known it remembers how to compute the outputs'
values. Nothing
is computed unless a rule asks (`known_value`), and the program itself is
unchanged: the traced outputs are what they would have been.
"""

import contextvars
import functools as ft
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.extend.core
import numpy as np


# id(traced plain value) -> (a weak reference to the value, a function computing
# its concrete value). The reference tells whether the id is still that value's;
# the entry goes when the value does, so that the table never keeps a tracer of
# a trace that has ended (a loop's body, a branch) alive. Set for the duration
# of the outermost `jit_p_unitful`.
_known: contextvars.ContextVar[dict[int, tuple[weakref.ref, Callable[[], Any]]] | None] = (
    contextvars.ContextVar("unitful_known_constants", default=None)
)


def _entry(x: Any) -> tuple[weakref.ref, Callable[[], Any]] | None:
    known = _known.get()
    entry = None if known is None else known.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry


def known_value(x: Any) -> np.ndarray | None:
    """The value of the plain operand `x` if it is known while tracing, else None."""
    if not isinstance(x, jax.core.Tracer):
        try:
            return np.asarray(x)
        except Exception:  # an object NumPy cannot read: unknown
            return None
    entry = _entry(x)
    return None if entry is None else np.asarray(entry[1]())


def fits_every_unit(x: Any) -> bool:
    """Whether the plain operand `x` is known to be 0, +-inf or NaN everywhere.

    The dtype's smallest normal number (`+-finfo.tiny`) counts as 0: it is what
    floating point puts in place of the number next to 0 (Equinox's `nextafter`
    and `prevbefore`, which diffrax uses to step just past a time, flush the
    denormal next to 0 to it), not an amount measured in some unit."""
    value = known_value(x)
    if value is None:
        return False
    if value.dtype == object:
        return False
    if np.issubdtype(value.dtype, np.inexact):
        tiny = np.finfo(value.dtype).tiny
        nearly_zero = (value == 0) | (np.abs(value) == tiny)
        return bool(np.all(nearly_zero | np.isinf(value) | np.isnan(value)))
    return bool(np.all(value == 0))


def is_known(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer) or _entry(x) is not None


def _computing(x: Any) -> Callable[[], Any]:
    """How to compute the known `x`'s value, holding no tracer."""
    if not isinstance(x, jax.core.Tracer):
        return lambda: x
    entry = _entry(x)
    assert entry is not None
    return entry[1]


def _bind_params(primitive, params: dict) -> tuple[list, dict]:
    # JAX 0.10 returns the params; earlier releases return (subfuns, params).
    bind_params = primitive.get_bind_params(params)
    if isinstance(bind_params, (tuple, list)):
        subfuns, bind_params = bind_params
        return list(subfuns), bind_params
    return [], bind_params


def _remember(eqn, subfuns, params, inputs, outputs) -> None:
    """Record, for each traced output of `eqn`, how to compute its value from the
    known values of `inputs`."""
    known = _known.get()
    assert known is not None
    computing = [_computing(x) for x in inputs]

    @ft.cache
    def evaluate():
        with jax.ensure_compile_time_eval(), eqn.ctx.manager:
            values = [compute() for compute in computing]
            out = eqn.primitive.bind(*subfuns, *values, **params)
        return out if eqn.primitive.multiple_results else [out]

    for i, out in enumerate(outputs):
        if isinstance(out, jax.core.Tracer):
            key = id(out)

            def forget(ref, key=key, known=known):
                if key in known and known[key][0] is ref:
                    del known[key]

            known[key] = (weakref.ref(out, forget), lambda i=i: evaluate()[i])


def evaluate(closed_jaxpr, *args):
    """Evaluate `closed_jaxpr` on `args` equation by equation (as
    `jax.core.eval_jaxpr` does), remembering the outputs whose values are known."""
    jaxpr = closed_jaxpr.jaxpr
    env: dict = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        inputs = [read(v) for v in eqn.invars]
        subfuns, params = _bind_params(eqn.primitive, eqn.params)
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*subfuns, *inputs, **params)
        outputs = out if eqn.primitive.multiple_results else [out]
        if not eqn.effects and all(map(is_known, inputs)):
            _remember(eqn, subfuns, params, inputs, outputs)
        env.update(zip(eqn.outvars, outputs))
    return [read(v) for v in jaxpr.outvars]


def tracking(fn: Callable) -> Callable:
    """`fn` with a table of known values open while it runs (the enclosing one if
    there is one, so that values known outside a nested body stay known in it)."""

    @ft.wraps(fn)
    def wrapper(*args, **kwargs):
        if _known.get() is not None:
            return fn(*args, **kwargs)
        token = _known.set({})
        try:
            return fn(*args, **kwargs)
        finally:
            _known.reset(token)

    return wrapper
