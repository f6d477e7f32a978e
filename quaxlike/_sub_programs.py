"""The speed layer of the trace: running a call's sub-program in place.

Most `jax.numpy` functions are `jit`s that JAX inlines where they are traced,
so a quaxified function meets a `jit` equation around almost every operation.
The built-in rule for such a call (`_higher_order/_jit.py`) runs its
sub-program under a nested `quaxify`. Two shortcuts give the same result for
less work, and this module is where both live; `QuaxTrace` only asks
`SubPrograms.run` and otherwise dispatches as usual.

1. **Inlining in place** (benchmarks/README.md, "Where the time goes", items 2
   and 5: nested traces were the largest cost of tracing a model): the trace
   evaluates the sub-program's equations itself, each one going through
   `process_primitive` exactly as it would inside the nested trace. Only where
   the chosen rule is marked with `sub_program_rule` and JAX itself would
   inline the call at trace time.

2. **Materialising at the call** (items 6 and 9: a dense model through the
   interpreter went from 1.40 to about 1.1 of plain JAX): when every operation
   on a Value in the sub-program would only materialise it (no rule, and no
   type's own `default`), the sub-program computes what `Value.default` gives
   when applied to the call as a whole: the Values materialised, the call bound
   on the dense arrays. That is what it does, for the plain "allow" policy.
   Eagerly (no transformation around the call) this also runs the call as JAX
   runs it on dense arrays, one compiled call, instead of op by op.

Whether a sub-program only materialises (its *verdict*) depends on the
sub-program, the registered rules, the kinds of the arguments and the kind of
array the parent trace produces. Eagerly, it is worked out from the equations
without running them (every intermediate array is then a concrete array), so
that no call is ever run op by op once and compiled the next time. Under a
transformation, the first call is inlined and observed. Verdicts are cached per
sub-program and dropped whenever a rule is registered.
"""

import contextlib
import weakref
from typing import Any

import jax

from . import _jax_compat as jc, _policy
from ._rules import on_rules_changed, plan_for
from ._values import is_value, materialise_value


# ClosedJaxpr (weakly) -> {(parent trace type or "eager", argument kinds): verdict}
_verdicts: "weakref.WeakKeyDictionary[Any, dict[tuple, bool]]" = weakref.WeakKeyDictionary()
on_rules_changed(_verdicts.clear)


class SubPrograms:
    """One trace's view of the shortcuts above."""

    def __init__(self, trace):
        self.trace = trace

    def run(self, primitive, plan, tracers, values, kinds, params):
        """Apply `primitive` (whose plan's chosen rule only runs a sub-program)
        to `values` (of `dispatch_kind`s `kinds`) by one of the shortcuts, or
        return `NotImplemented` to let the rule run."""
        closed_jaxpr, inlines = plan.sub_program(params)
        if closed_jaxpr is None:
            return NotImplemented
        trace = self.trace
        if trace.eager:
            if (
                self._eager_verdict(closed_jaxpr, values, kinds)
                and _policy.current_mode() == "allow"
            ):
                out = _materialise_at_call(trace, primitive, tracers, values, params)
                if out is not NotImplemented:
                    return out
            if inlines and not _opts_in_to_compiling(values):
                return inline(trace, closed_jaxpr, tracers)
            return NotImplemented
        if not inlines:
            return NotImplemented
        known = _verdicts.setdefault(closed_jaxpr, {})
        key = (type(trace.parent_trace), kinds)
        verdict = known.get(key)
        if verdict is None:
            outputs, known[key] = inline(trace, closed_jaxpr, tracers, judge=True)
            return outputs
        if verdict and _policy.current_mode() == "allow":
            out = _materialise_at_call(trace, primitive, tracers, values, params)
            if out is not NotImplemented:
                return out
        return inline(trace, closed_jaxpr, tracers)

    def _eager_verdict(self, closed_jaxpr, values, kinds) -> bool:
        known = _verdicts.setdefault(closed_jaxpr, {})
        key = ("eager", kinds)
        verdict = known.get(key)
        if verdict is None:
            verdict = known[key] = only_materialises(closed_jaxpr, values, self.trace.parent_trace)
        return verdict


def _opts_in_to_compiling(values) -> bool:
    # `Value.compile_eagerly` on every type: the rule runs the call compiled.
    return all(type(v).compile_eagerly for v in values if is_value(v))


def only_materialises(closed_jaxpr, values, eager_trace) -> bool:
    """Without running anything: whether every equation of `closed_jaxpr` that
    reads a Value among `values` would only materialise it when run eagerly,
    and every Value is read. Eagerly, every array an equation produces is a
    concrete array, so one concrete array stands for all of them when asking
    for a plan (matching depends on the kinds of the arguments only).
    `eager_trace` is the eager trace the call would run under."""
    jaxpr = closed_jaxpr.jaxpr
    concrete = _a_concrete_array(eager_trace)
    env: dict = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
    env.update(zip(jaxpr.invars, values))
    holds_value = {var for var, value in zip(jaxpr.invars, values) if is_value(value)}
    unread = set(holds_value)
    for eqn in jaxpr.eqns:
        reads = [v for v in eqn.invars if type(v) is not jc.Literal and v in holds_value]
        if reads:
            args = [v.val if type(v) is jc.Literal else env[v] for v in eqn.invars]
            if not _eqn_only_materialises(eqn, args, eager_trace):
                return False
            unread.difference_update(reads)
        for out in eqn.outvars:
            env[out] = concrete
    # An output may be a `Literal` (a `jit` returning a constant), never a Value.
    return not unread and not any(
        type(v) is not jc.Literal and v in holds_value for v in jaxpr.outvars
    )


def _eqn_only_materialises(eqn, args, eager_trace) -> bool:
    plan = plan_for(eqn.primitive, args)
    plain = _is_plain_primitive(eqn.primitive)
    if plan.only_materialises:
        return plain
    if plan.sub_program is None:
        return False
    # A nested call: the trace materialises at that call exactly when its own
    # sub-program only materialises (see `SubPrograms.run`). A custom
    # derivative's built-in rule computes its primal jaxpr (eagerly no
    # derivative is taken), held in the equation's own params.
    params = jc.bind_params(eqn.primitive, eqn.params)[1] if plain else eqn.params
    inner, _ = plan.sub_program(params)
    return inner is not None and only_materialises(inner, args, eager_trace)


_concrete_example: list = []


def _a_concrete_array(eager_trace):
    if not _concrete_example:
        with jc.set_current_trace(eager_trace):
            _concrete_example.append(jax.numpy.zeros((), "float32"))
    return _concrete_example[0]


def _materialise_at_call(trace, primitive, tracers, values, params):
    """`Value.default` applied to the call (under the parent trace, as rules
    run), each Value checked against its tracer's aval. Only reached under the
    "allow" policy with nothing observing the trace, so there is nothing to
    warn about or record: the Values are materialised plainly. If a type
    refuses to materialise, `NotImplemented`: running the sub-program op by
    op then raises at the operation that needed it, naming that operation."""
    parent = trace.parent_trace
    with jc.set_current_trace(parent):
        try:
            arrays = [
                t if t is v else materialise_value(v, primitive, aval=t.aval)
                for t, v in zip(tracers, values)
            ]
        except Exception:
            return NotImplemented
        for a in arrays:
            if not _is_canonical_tracer_of(parent, a):
                return primitive.bind(*arrays, **params)
    # Every array is a live tracer of the parent with the aval the call was
    # bound with: `bind` would check nothing new (the checks passed on the way
    # here, for the same params and avals) and hand them to the parent's
    # `process_primitive`, with the current trace as it is now (outside the
    # block above). Going there directly, materialising plainly and computing
    # dispatch kinds once took the dense depth-32 trace from 1.139 to 1.106 of
    # plain JAX's instructions (benchmarks/README.md, "Where the time goes",
    # item 16).
    return parent.process_primitive(primitive, arrays, params)


def _is_canonical_tracer_of(parent, x) -> bool:
    # A tracer of `parent` with no mesh in its type: nothing `bind` would
    # canonicalise or reshard.
    return isinstance(x, jc.Tracer) and x._trace is parent and jc.without_mesh(x.aval)


def inline(trace, closed_jaxpr, tracers, judge: bool = False):
    """Evaluate `closed_jaxpr`'s equations in `trace`.

    Leaner than `jax.core.eval_jaxpr`: equations go straight to the trace
    (their inputs are already canonical JAX values), the equation's context is
    entered only when it differs from the current one, and the source
    traceback is the live one (the user's call site, as JAX's own inlining of
    `jit` records), with the equation's name stack appended.

    With `judge`, returns `(outputs, verdict)`: whether every equation that read
    a Value of `trace` only materialised it, every such Value was read, and no
    output is one (see the module docstring).
    """
    jaxpr = closed_jaxpr.jaxpr
    env = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
    env.update(zip(jaxpr.invars, tracers))
    here = jc.current_eqn_context()
    literal = jc.Literal
    owns = trace.owns
    only_materialised = judge
    unread = {v for v, t in zip(jaxpr.invars, tracers) if owns(t)} if judge else set()
    for eqn in jaxpr.eqns:
        args = [v.val if type(v) is literal else env[v] for v in eqn.invars]
        if only_materialised and any(map(owns, args)):
            only_materialised = (
                _is_plain_primitive(eqn.primitive)
                and plan_for(eqn.primitive, [trace.unwrap(a) for a in args]).only_materialises
            )
            unread.difference_update(v for v in eqn.invars if type(v) is not literal)
        subfuns, params = jc.bind_params(eqn.primitive, eqn.params)
        if subfuns or eqn.ctx is not here or eqn.source_info.name_stack:
            out = _bind_in_context(trace, eqn, [*subfuns, *args], params, here)
        else:
            out = jc.bind_with_trace(eqn.primitive, trace, args, params)
        if eqn.primitive.multiple_results:
            env.update(zip(eqn.outvars, out))
        else:
            env[eqn.outvars[0]] = out
    outputs = [v.val if type(v) is literal else env[v] for v in jaxpr.outvars]
    if judge:
        verdict = only_materialised and not unread and not any(map(owns, outputs))
        return outputs, verdict
    return outputs


def _bind_in_context(trace, eqn, args, params, here):
    """`inline`'s path for an equation recorded under another context (compute
    type, mesh, ...) or inside a name scope."""
    with contextlib.ExitStack() as stack:
        if eqn.ctx is not here:
            stack.enter_context(eqn.ctx.manager)
        if eqn.source_info.name_stack and jc.set_name_stack is not None:
            stack.enter_context(
                jc.set_name_stack(jc.current_name_stack() + eqn.source_info.name_stack)  # pyright: ignore
            )
        stack.enter_context(jc.set_current_trace(trace))
        return eqn.primitive.bind(*args, **params)


def _is_plain_primitive(primitive) -> bool:
    """Whether binding `primitive` is an ordinary `process_primitive` (not a call,
    custom-derivative or mapped primitive with its own trace hook)."""
    return type(primitive).bind_with_trace is jc.Primitive.bind_with_trace
