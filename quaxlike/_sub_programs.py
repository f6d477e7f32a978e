"""Running a call's sub-program without a nested trace: plain functions that the
`jit`/`closed_call` rule's shortcut calls (`_higher_order/_jit.py` says when).

Most `jax.numpy` functions are `jit`s that JAX inlines where they are traced,
so a quaxified function meets a `jit` equation around almost every operation.
The rule runs the sub-program under a nested `quaxify`; these functions give
the same result for less work:

- `inline` evaluates the sub-program's equations in the trace that met the
  call, with no nested trace; with `judge`, it also works out the *verdict*:
  whether every operation on a Value only materialised it (no rule, and no
  type's own `default`).
- `only_materialises` works out the same verdict without running anything, for
  eager code, where every intermediate array is a concrete array.
- `materialise_at_call` computes what `Value.default` gives when applied to the
  call as a whole: what a sub-program whose verdict is true computes under the
  plain "allow" policy.
- `run_compiled` runs an eager `jit` on concrete arrays as plain JAX runs it,
  through one compiled call.

Verdicts depend on the sub-program, the registered rules, the kinds of the
arguments and of the parent trace: `verdicts` keeps them per sub-program
until a rule is registered. (What each shortcut saves: benchmarks/README.md,
"Where the time goes", items 2, 5, 6, 9, 16-18.)
"""

import contextlib
import operator
import weakref

import jax

from . import _jax_compat as jc
from ._rules import dispatch_kind, on_rules_changed, plan_for
from ._values import is_value, materialise_value


class _PerSubProgram(dict):
    """What is known about each sub-program (a `ClosedJaxpr`), kept as long as
    the jaxpr lives: keyed by id, with a weak reference that drops the entry
    when the jaxpr goes (not a WeakKeyDictionary, whose lookups are Python
    code: this is read on every call)."""

    def of(self, closed_jaxpr) -> dict:
        """The dict of what is known about `closed_jaxpr`, empty at first."""
        key = id(closed_jaxpr)
        entry = self.get(key)
        if entry is None or entry[0]() is not closed_jaxpr:
            forget = lambda _: self.pop(key, None)  # noqa: E731
            entry = self[key] = (weakref.ref(closed_jaxpr, forget), {})
        return entry[1]


# {(parent trace type, argument kinds): verdict} per sub-program, until a rule
# is registered: `verdicts.of(closed_jaxpr)`.
verdicts = _PerSubProgram()
on_rules_changed(verdicts.clear)
# {(name, keep_unused): `jax.jit` of the sub-program's function, "last": (the
# last params but the jaxpr, the `jax.jit` for them or None)} per sub-program:
# runs no rule, so it stays when rules change.
_compiled_calls = _PerSubProgram()


def only_materialises(closed_jaxpr, values, eager_trace) -> bool:
    """Without running anything: whether every equation of `closed_jaxpr` that
    reads a Value among `values` would only materialise it when run under
    `eager_trace`, and every Value is read. Eagerly every array an equation
    produces is concrete, so one concrete array stands for all of them when
    asking for a plan (which depends on the kinds of the arguments only)."""
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
    # A nested call: the shortcut materialises at that call exactly when its
    # own sub-program only materialises (see `_higher_order/_jit.py`). A custom
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


def materialise_at_call(trace, primitive, tracers, values, params):
    """`Value.default` applied to the call as a whole, under the parent trace,
    each Value checked against its tracer's aval. Only reached where
    `shortcuts_apply` (nothing to warn about or record). `NotImplemented` if a
    type refuses to materialise: running the sub-program op by op then raises
    at the operation that needed it, naming it."""
    parent = trace.parent_trace
    arrays = list(tracers)
    with jc.set_current_trace(parent):
        binds_plainly = True
        for i, (t, v) in enumerate(zip(tracers, values)):
            if t is v:
                continue  # not a Value: the argument `bind` handed this trace
            try:
                a = arrays[i] = materialise_value(v, primitive, aval=t.aval)
            except Exception:
                return NotImplemented
            # Not a tracer of `parent` with no mesh in its type: something
            # `bind` would canonicalise or reshard.
            binds_plainly = binds_plainly and (
                isinstance(a, jc.Tracer) and a._trace is parent and jc.without_mesh(a.aval)
            )
        if not binds_plainly:
            if trace.eager and primitive is jc.jit_p:
                return run_compiled(arrays, params)
            return primitive.bind(*arrays, **params)
    # Every array is an argument `bind` handed this trace or a live tracer of
    # the parent with the aval the call was bound with: `bind` would check
    # nothing new and hand them to the parent's `process_primitive`, with the
    # current trace as it is now (outside the block above).
    return parent.process_primitive(primitive, arrays, params)


def run_compiled(arrays, params):
    """Under the eager trace, `jit_p.bind(*arrays, **params)` through one
    `jax.jit` per sub-program, called through JAX's C++ dispatch as plain JAX
    calls a `jax.numpy` function: the same program, so bitwise the same
    results. A call on tracers, or asking for more than `keep_unused`
    (`jc.jit_needs_only_keep_unused`), is bound as it is."""
    call = _compiled_call(params)
    if call is not None:
        for a in arrays:
            if isinstance(a, jc.Tracer):
                break
        else:
            return call(*arrays)
    return jc.jit_p.bind(*arrays, **params)


def _compiled_call(params):
    """The `jax.jit` that stands for a `jit` equation with `params`, or `None`
    where it must be bound as it is. The decision for a sub-program's last
    params is reused while the same param objects come back (as JAX hands them
    out for every call of one jitted function on arguments of one type)."""
    closed_jaxpr = params["jaxpr"]
    known = _compiled_calls.of(closed_jaxpr)
    options = jc.jit_options(params)
    last = known.get("last")
    if last is not None and options is not None and all(map(operator.is_, last[0], options)):
        return last[1]
    call = None
    if jc.jit_needs_only_keep_unused(params):
        name, keep_unused = params["name"], params["keep_unused"]
        call = known.get((name, keep_unused))
        if call is None:
            jaxpr_ref = weakref.ref(closed_jaxpr)  # the entry must not keep its jaxpr alive

            def sub_program(*args):
                return jc.jaxpr_as_fun(jaxpr_ref())(*args)

            sub_program.__name__ = sub_program.__qualname__ = name
            call = known[(name, keep_unused)] = jax.jit(sub_program, keep_unused=keep_unused)
    if options is not None:
        known["last"] = (options, call)
    return call


def inline(trace, closed_jaxpr, tracers, judge: bool = False):
    """Evaluate `closed_jaxpr`'s equations in `trace`. Leaner than
    `jax.core.eval_jaxpr`: equations go straight to the trace (their inputs are
    already canonical), an equation's context is entered only when it differs
    from the current one, and the source traceback is the live one (the user's
    call site, as JAX's own inlining records) with the equation's name stack.

    With `judge`, returns `(outputs, verdict)`: whether every equation that read
    a Value of `trace` only materialised it, every such Value was read, and no
    output is one."""
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
        subfuns, params = jc.bind_params(eqn.primitive, eqn.params)
        simple = not subfuns and eqn.ctx is here and not eqn.source_info.name_stack
        judged = None  # (values, kinds, plan) of an equation judged here
        if only_materialised and any(map(owns, args)):
            unread.difference_update(v for v in eqn.invars if type(v) is not literal)
            only_materialised = False
            if _is_plain_primitive(eqn.primitive):
                values = [trace.unwrap(a) for a in args]
                kinds = tuple(map(dispatch_kind, values))
                judged = values, kinds, plan_for(eqn.primitive, values, kinds)
                only_materialised = judged[2].only_materialises
        if judged and simple and not trace.adopts and _binds_plainly(eqn.primitive, params):
            # What `bind` would reach, with the plan already in hand.
            values, kinds, plan = judged
            out = trace.apply_plan(eqn.primitive, plan, args, values, kinds, params)
        elif simple:
            out = jc.bind_with_trace(eqn.primitive, trace, args, params)
        else:
            out = _bind_in_context(trace, eqn, [*subfuns, *args], params, here)
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


def _binds_plainly(primitive, params) -> bool:
    """Whether `bind` would only hand this equation to the trace's
    `process_primitive` (no sub-program in its params that JAX would lower
    first)."""
    return getattr(type(primitive), "is_high", None) is getattr(
        jc.Primitive, "is_high", None
    ) and not any(isinstance(v, (jc.Jaxpr, jc.ClosedJaxpr)) for v in params.values())


def _is_plain_primitive(primitive) -> bool:
    """Whether binding `primitive` is an ordinary `process_primitive` (not a call,
    custom-derivative or mapped primitive with its own trace hook)."""
    return type(primitive).bind_with_trace is jc.Primitive.bind_with_trace
