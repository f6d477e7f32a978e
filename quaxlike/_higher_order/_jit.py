"""`jit` (a `jax.jit` inside the quaxified function, and every `jax.numpy`
function) and `closed_call` on Values: the rule, and the shortcuts it owns.

What happens to such a call, in the order it runs:

1. The trace finds this rule in the call's plan and, where `shortcuts_apply`
   (nothing observes the trace and the policy is "allow"), offers the call to
   `shortcut` first, with the tracers it met.
2. `shortcut` answers with one of three faster ways to the rule's result, or
   hands the call back (`NotImplemented`):
   - *materialise at the call* (`_sub_programs.materialise_at_call`) when the
     sub-program's verdict says every operation on a Value would only
     materialise it: the call bound once on the dense arrays (eagerly, one
     compiled call, exactly as JAX runs it on arrays);
   - *inline* (`_sub_programs.inline`) a `jit` that JAX itself inlines where it
     is traced: its equations run in the same trace, no nested trace; the first
     time under a transformation, this also works out the verdict;
   - otherwise the rule runs.
3. The rule (`jit_p_values`): a `jit` that JAX inlines runs its body in place
   under a nested `quaxify` (eagerly the rules then see concrete arrays, as in
   Quax), unless every Value type opts in to compiling eagerly
   (`Value.compile_eagerly`). Any other `jit` keeps its boundary: its body runs
   under `quaxify` inside a `jax.jit` over the array leaves of the arguments,
   compiled once per argument types and reused.
"""

import weakref

from .. import _jax_compat as jc
from .._quaxify import lifted_call
from .._rules import register, rules_generation, store_if_current, sub_program_rule
from .._staging import CompiledCalls, shortcuts_apply, split_arrays, StagedCall
from .._sub_programs import inline, materialise_at_call, only_materialises, verdicts
from .._values import is_value
from ._common import AnyValue


def compiles_eagerly(values) -> bool:
    """Whether every Value type among `values` opts in to running `jax.numpy`
    functions compiled in eager code (`Value.compile_eagerly`)."""
    return all(type(v).compile_eagerly for v in values if is_value(v))


# --- the shortcut --------------------------------------------------------------


def shortcut(trace, primitive, plan, tracers, values, kinds, params):
    """The rule's result for `primitive` on `values` (this trace's `tracers`
    unwrapped, of `dispatch_kind`s `kinds`) by a shortcut, or `NotImplemented`
    to let the rule run. Only called where `shortcuts_apply`."""
    closed_jaxpr, inlines = plan.sub_program(params)
    if closed_jaxpr is None or not (inlines or trace.eager):
        return NotImplemented
    known = verdicts.of(closed_jaxpr)
    key = (type(trace.parent_trace), kinds)
    verdict = known.get(key)
    if verdict is None:
        generation = rules_generation()
        if not trace.eager:  # the first call: inline it and observe
            outputs, verdict = inline(trace, closed_jaxpr, tracers, judge=True)
            store_if_current(known, key, verdict, generation)
            return outputs
        # Eagerly, worked out without running anything, so that no eager call
        # is ever run op by op once and compiled the next time.
        verdict = only_materialises(closed_jaxpr, values, trace.parent_trace)
        store_if_current(known, key, verdict, generation)
    if verdict:
        out = materialise_at_call(trace, primitive, tracers, values, params)
        if out is not NotImplemented:
            return out
    if inlines and not (trace.eager and compiles_eagerly(values)):
        return inline(trace, closed_jaxpr, tracers)
    return NotImplemented


# --- the rule ------------------------------------------------------------------

# One compiled body per (sub-program, name, structure and non-array leaves of
# the arguments, avals of their array leaves), so that calling a jitted
# function on Values again goes through JAX's dispatch of one compiled program
# instead of tracing the rules again. JAX hands out the same jaxpr object for
# the same function and argument types. The sub-program holds every array the
# user's function closes over: the cache holds it weakly (and each body refers
# to it weakly), so a body goes when JAX's own cache lets the jaxpr go.
_bodies = CompiledCalls()


def _jit_sub_program(params) -> tuple:
    inline = params.get("inline", False)  # a bool up to jax 0.10: no call needed
    if inline is not True and inline is not False:
        inline = jc.jit_inlines_at_trace(inline)
    return params["jaxpr"], inline


@register(jc.jit_p)
@sub_program_rule(_jit_sub_program, shortcut)
def jit_p_values(*args: AnyValue, jaxpr, name: str = "jit", **params):
    """The built-in rule for `jit` (see the module docstring, step 3)."""
    if jc.jit_inlines_at_trace(params.get("inline", False)) and not (
        compiles_eagerly(args) and jc.is_eager(jc.current_trace())
    ):
        return lifted_call(jc.jaxpr_as_fun(jaxpr), *args)
    split = split_arrays(list(args))
    jaxpr_ref = weakref.ref(jaxpr)  # a cached body must not keep its sub-program alive

    def make():
        def run_sub_program(*args):
            return lifted_call(jc.jaxpr_as_fun(jaxpr_ref()), *args)

        return StagedCall(run_sub_program, name, split)

    # A cached compiled body may stand in for tracing the rules again.
    body = _bodies.get((name, *split.key()), make, owner=jaxpr) if shortcuts_apply() else None
    return (body or make())(split.arrays)


@register(jc.closed_call_p)
@sub_program_rule(lambda params: (params["call_jaxpr"], True), shortcut)
def closed_call_p_values(*args: AnyValue, call_jaxpr, **params):
    return lifted_call(jc.jaxpr_as_fun(call_jaxpr), *args)
