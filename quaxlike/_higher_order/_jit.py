"""`jit` (a `jax.jit` inside the quaxified function, and every `jax.numpy`
function) and `closed_call`."""

from .. import _jax_compat as jc
from .._quaxify import lifted_call
from .._rules import register, sub_program_rule
from .._staging import compiled_calls_apply, CompiledCalls, split_arrays, StagedCall
from .._values import Value
from ._common import AnyValue


# One compiled body per (sub-program, name, structure and non-array leaves of
# the arguments, avals of their array leaves), so that calling a jitted
# function on Values again goes through JAX's dispatch of one compiled program
# instead of tracing the rules again. JAX hands out the same jaxpr object for
# the same function and argument types.
_bodies = CompiledCalls()


def compiles_eagerly(values) -> bool:
    """Whether every Value type among `values` opts in to running `jax.numpy`
    functions compiled in eager code (`Value.compile_eagerly`)."""
    return all(type(v).compile_eagerly for v in values if isinstance(v, Value))


def _compiled_body(jaxpr, name: str, args) -> "tuple[StagedCall, list] | None":
    if not compiled_calls_apply():
        return None
    split = split_arrays(list(args))
    try:
        key = (jaxpr, name, *split.key())
        body = _bodies.get(key, lambda: StagedCall(_body_of(jaxpr), name, split))
    except TypeError:  # unhashable non-array leaves: no caching
        return None
    return body, split.arrays


def _body_of(jaxpr):
    def body(*args):
        return lifted_call(jc.jaxpr_as_fun(jaxpr), *args)

    return body


def _runs_in_place(args, params) -> bool:
    return jc.jit_inlines_at_trace(params.get("inline", False)) and not (
        compiles_eagerly(args) and jc.is_eager(jc.current_trace())
    )


def _jit_sub_program(params) -> tuple:
    return params["jaxpr"], jc.jit_inlines_at_trace(params.get("inline", False))


@register(jc.jit_p)
@sub_program_rule(_jit_sub_program)
def jit_p_values(*args: AnyValue, jaxpr, name: str = "jit", **params):
    """The built-in rule for `jit`. A `jit` that JAX inlines where it is traced
    (`jax.numpy`'s functions) runs its body in place, operation by operation
    (eagerly, the rules then see concrete arrays, as in Quax), unless every
    Value type opts in to compiling eagerly (`Value.compile_eagerly`). Any other
    `jit` keeps its boundary: the body runs under `quaxify` inside a `jax.jit`
    over the array leaves of the arguments, compiled once per argument types."""
    if _runs_in_place(args, params):
        return lifted_call(jc.jaxpr_as_fun(jaxpr), *args)
    compiled = _compiled_body(jaxpr, name, args)
    if compiled is not None:
        body, arrays = compiled
        return body(arrays)
    split = split_arrays(list(args))
    return StagedCall(_body_of(jaxpr), name, split)(split.arrays)


@register(jc.closed_call_p)
@sub_program_rule(lambda params: (params["call_jaxpr"], True))
def closed_call_p_values(*args: AnyValue, call_jaxpr, **params):
    return lifted_call(jc.jaxpr_as_fun(call_jaxpr), *args)
