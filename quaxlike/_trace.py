"""The tracer and trace that carry Values through a JAX program.

`QuaxTracer` wraps one `Value` and presents its `aval()` to JAX, so user code
sees an ordinary array. `QuaxTrace.process_primitive` unwraps its own tracers,
asks the rule registry what to do (running the rule under the parent trace), and
wraps any Values in the result again. Plain arrays leave the interpreter at once:
only Values ever become tracers of this trace.
"""

import contextlib
import weakref
from typing import Any

import jax
import jax.numpy as jnp

from . import _instrument, _jax_compat as jc, _policy
from ._diagnostics import messages, QuaxlikeError
from ._rules import (
    chosen_rule,
    default_description,
    dispatch,
    dispatch_kind,
    falls_back_to_materialising,
    rules_generation,
)
from ._values import checked_aval, is_value, materialise_unreported, Value


# Rules that only say "run this sub-program here" (`jit(inline=True)`, which most
# `jax.numpy` functions are, and `closed_call`): when such a rule is the one
# dispatch would choose, the trace evaluates the sub-program's equations itself,
# without opening a nested trace. Not in eager mode: there the rule runs the
# sub-program compiled, as one call, which beats binding its equations one by
# one. Maps the rule's implementation to a function of the primitive's params
# giving the `ClosedJaxpr` to inline, or `None`.
_inlining_rules: dict[Any, Any] = {}
_inlinable_primitives: set = set()


# Sub-programs in which every operation on a Value would only materialise it (no
# rule matches; `Value.default`): found out while inlining one, and from then on
# the Values are materialised once at the call and the call goes whole to the
# parent trace, which inlines its cached program far more cheaply than binding
# its equations one by one. Keyed on the `ClosedJaxpr` (weakly), then on what
# the verdict depends on: the parent trace's type (the type of intermediate
# results), the registered rules, and the kinds of the arguments.
_materialise_at_call: "weakref.WeakKeyDictionary[Any, dict[tuple, bool]]" = (
    weakref.WeakKeyDictionary()
)


def inlines(primitive, jaxpr_of):
    """Mark a rule for `primitive` as one the trace may inline (see above)."""

    def mark(rule):
        _inlining_rules[rule] = jaxpr_of
        _inlinable_primitives.add(primitive)
        return rule

    return mark


class QuaxTracer(jc.Tracer):
    __slots__ = ("value",)

    def __init__(self, trace: "QuaxTrace", value: Value):
        # Every Value lifted or returned by a rule passes here, so the helpers
        # are inlined: `checked_aval` and (see `jc.TRACER_INIT_ONLY_STORES`)
        # `Tracer.__init__`.
        aval = value.aval()
        if not isinstance(aval, jc.AbstractValue):
            aval = checked_aval(value)  # raises, naming the type
        if jc.tracking_varying_axes():
            aval = jc.with_varying_axes_of(aval, jax.tree_util.tree_leaves(value))
        if jc.TRACER_INIT_ONLY_STORES:
            self._trace = trace
            self.aval = aval
        else:
            super().__init__(trace, aval)
        self.value = value

    def full_lower(self):
        return self

    def __repr__(self):
        return f"QuaxTracer<{type(self.value).__qualname__}: {self.aval.str_short()}>"


jc.register_tracer_class(QuaxTracer)


class QuaxTrace(jc.Trace):
    """One `quaxify` call's trace. Its parent is whatever trace was current when
    the call began (another `QuaxTrace`, a jit/grad/vmap trace, or eager).

    `adopts` lists enclosing QuaxTraces whose tracers this one takes over as its
    own when they reach it. Only the body of a `shard_map` needs that: the body
    runs under JAX's own trace, between this trace and the one that lifted a
    Value the body closes over.
    """

    def __init__(self, parent_trace, adopts: tuple["QuaxTrace", ...] = ()):
        super().__init__()
        self.parent_trace = parent_trace
        self.adopts = adopts
        # `explain` or checked mode: take the slower, observed path.
        self.instrumented = _instrument.active()
        # Directly under eager execution, sub-programs are better run compiled
        # than inlined op by op (see `inlines`).
        self.eager = jc.is_eager(parent_trace)
        # What this trace has worked out for call-like primitives, valid for the
        # rules generation `_generation`: (primitive, argument kinds) -> the
        # chosen rule's `jaxpr_of` (or None), and a dict from the id of each
        # sub-program seen to (the sub-program, its `_materialise_at_call`
        # verdict). See `_sub_program`.
        self._generation = rules_generation()
        self._plans: dict[tuple, tuple] = {}

    def _adopt(self, tracers):
        return [
            QuaxTracer(self, t.value)
            if type(t) is QuaxTracer and any(t._trace is outer for outer in self.adopts)
            else t
            for t in tracers
        ]

    # --- moving between Values and tracers -----------------------------------

    def lift(self, value: Value) -> QuaxTracer:
        return QuaxTracer(self, value)

    def owns(self, x: Any) -> bool:
        return type(x) is QuaxTracer and x._trace is self

    def unwrap(self, x: Any) -> Any:
        return x.value if type(x) is QuaxTracer and x._trace is self else x

    def _wrap_output(self, x: Any, primitive, rule) -> Any:
        if is_value(x):
            return QuaxTracer(self, x)
        if isinstance(x, (jax.Array, jc.Tracer, jc.Ref)):
            return x
        try:
            with jc.set_current_trace(self.parent_trace):
                return jnp.asarray(x)
        except TypeError:
            raise QuaxlikeError(
                messages.RULE_RETURNED_NON_ARRAY.format(
                    rule=_rule_name(rule), primitive=primitive.name, got=type(x).__qualname__
                )
            ) from None

    # --- the hooks JAX calls -------------------------------------------------

    # Handing an operation to the parent trace calls its `process_primitive`
    # directly. `Primitive.bind_with_trace(trace, args, avals, params)` would
    # first lower a "high" primitive (`primitive.is_high(*avals, **params)`)
    # for a trace that `requires_low`, as every trace does; but JAX made that
    # check, with these same avals and params, on its way to this trace (the
    # only caller of `process_primitive`), so it would find nothing to lower.
    def process_primitive(self, primitive, tracers, params):
        if self.adopts:
            tracers = self._adopt(tracers)
        for t in tracers:
            if type(t) is QuaxTracer and t._trace is self:
                break
        else:
            # No Value involved: hand the operation straight to the parent trace
            # (see above).
            return self.parent_trace.process_primitive(primitive, tracers, params)
        values = [t.value if type(t) is QuaxTracer and t._trace is self else t for t in tracers]
        if self.instrumented:
            return self._process_observed(primitive, tracers, values, params)
        if primitive in _inlinable_primitives and not self.eager:
            out = self._call_sub_program(primitive, tracers, values, params)
            if out is not NotImplemented:
                return out
        with jc.set_current_trace(self.parent_trace):
            out, rule = dispatch(primitive, values, params)
        return self._wrap_outputs(out, primitive, rule)

    def _sub_program(self, primitive, values, params) -> tuple:
        """For a call-like `primitive` applied to `values`: the `ClosedJaxpr`
        that the rule dispatch would choose would inline (`None` if that rule
        does not inline), the values' dispatch kinds, and the verdicts this
        trace has found so far for that rule, by id of the sub-program (see
        `_call_sub_program`)."""
        if self._generation != rules_generation():
            # A rule was registered while this trace ran.
            self._generation = rules_generation()
            self._plans.clear()
        kinds = tuple(map(dispatch_kind, values))
        key = (primitive, kinds)
        plan = self._plans.get(key)
        if plan is None:
            jaxpr_of = _inlining_rules.get(chosen_rule(primitive, values, kinds))
            plan = self._plans[key] = (jaxpr_of, {})
        jaxpr_of, known_verdicts = plan
        closed_jaxpr = None if jaxpr_of is None else jaxpr_of(params)
        return closed_jaxpr, kinds, known_verdicts

    def _call_sub_program(self, primitive, tracers, values, params):
        """Apply a call-like `primitive` whose chosen rule would inline its
        sub-program (else `NotImplemented`): inline it, or, when every operation
        on a Value in it would only materialise that Value, materialise at the
        call and hand the call to the parent trace (see `_materialise_at_call`)."""
        closed_jaxpr, kinds, known_verdicts = self._sub_program(primitive, values, params)
        if closed_jaxpr is None:
            return NotImplemented
        # Verdicts already looked up by this trace: one dict hit per call. The
        # entry holds the jaxpr so that its id is not reused while the trace
        # lives (which is short: nothing is kept alive for long).
        known = known_verdicts.get(id(closed_jaxpr))
        if known is not None:
            verdict = known[1]
        else:
            verdicts = _materialise_at_call.setdefault(closed_jaxpr, {})
            key = (type(self.parent_trace), self._generation, kinds)
            verdict = verdicts.get(key)
            outputs = None
            if verdict is None:
                outputs, verdict = self._inline(closed_jaxpr, tracers, judge=True)
                verdicts[key] = verdict
            known_verdicts[id(closed_jaxpr)] = (closed_jaxpr, verdict)
            if outputs is not None:
                return outputs
        if verdict and _policy.current_mode() == "allow":
            # Exactly the default rule (`Value.default`), applied to the call
            # as a whole; the Values' avals are the tracers' own.
            return self._materialise_and_bind(primitive, tracers, values, params)
        return self._inline(closed_jaxpr, tracers)

    def _materialise_and_bind(self, primitive, tracers, values, params):
        """`Value.default(primitive, values, params)` under the parent trace, for
        the uninstrumented "allow" policy (nothing to record or warn about):
        each Value is materialised and checked against its tracer's aval, and
        when the results are the parent's own canonical tracers the primitive
        is bound on the parent trace directly."""
        parent = self.parent_trace
        arrays = []
        direct = True
        # `materialise()` may itself compute (`factor * array`): under the
        # parent trace, as rules run. (`set_current_trace`, without the cost of
        # a context manager on this path.)
        trace_ctx = jc.trace_ctx
        previous = trace_ctx.trace
        trace_ctx.set_trace(parent)
        try:
            for i, (t, v) in enumerate(zip(tracers, values)):
                if t is v:
                    arrays.append(t)
                    continue
                array = materialise_unreported(primitive, values, i, t.aval)
                arrays.append(array)
                # Bound directly only if every array is a live tracer of the
                # parent with no mesh in its type: what `Primitive.bind` would
                # pass on unchanged (already canonical, nothing to reshard).
                if direct and not (
                    isinstance(array, jc.Tracer)
                    and array._trace is parent
                    and jc.without_mesh(array.aval)
                ):
                    direct = False
            if not direct:
                return primitive.bind(*arrays, **params)
        finally:
            trace_ctx.set_trace(previous)
        # As `primitive.bind_with_trace(parent, arrays, <the tracers' avals>,
        # params)`: see the comment on `process_primitive`.
        return parent.process_primitive(primitive, arrays, params)

    def _inline(self, closed_jaxpr, tracers, judge=False):
        """Evaluate `closed_jaxpr`'s equations in this trace.

        Leaner than `jax.core.eval_jaxpr`: equations go straight to
        `process_primitive` (their inputs are already canonical JAX values), the
        equation's context manager is entered only when it differs from the
        current one, and the source traceback is the live one (the user's call
        site, as JAX's own inlining of `jit(inline=True)` records), with the
        equation's name stack appended."""
        jaxpr = closed_jaxpr.jaxpr
        env = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
        env.update(zip(jaxpr.invars, tracers))
        here = jc.current_eqn_context()
        literal = jc.Literal
        # With `judge`, also work out whether every equation that reads a Value
        # falls back to materialising it, and whether each Value is read.
        only_materialised = judge
        unread = {v for v, t in zip(jaxpr.invars, tracers) if self.owns(t)} if judge else set()
        for eqn in jaxpr.eqns:
            args = [v.val if type(v) is literal else env[v] for v in eqn.invars]
            if only_materialised and any(self.owns(a) for a in args):
                only_materialised = _is_plain_primitive(
                    eqn.primitive
                ) and falls_back_to_materialising(eqn.primitive, [self.unwrap(a) for a in args])
                unread.difference_update(v for v in eqn.invars if type(v) is not literal)
            params = eqn.primitive.get_bind_params(eqn.params)
            if eqn.ctx is not here or eqn.source_info.name_stack:
                out = self._bind_in_context(eqn, args, params, here)
            else:
                avals = [jax.typeof(a) for a in args]
                out = eqn.primitive.bind_with_trace(self, args, avals, params)
            if eqn.primitive.multiple_results:
                env.update(zip(eqn.outvars, out))
            else:
                env[eqn.outvars[0]] = out
        outputs = [v.val if type(v) is literal else env[v] for v in jaxpr.outvars]
        if judge:
            verdict = only_materialised and not unread and not any(map(self.owns, outputs))
            return outputs, verdict
        return outputs

    def _bind_in_context(self, eqn, args, params, here):
        """`_inline`'s path for an equation recorded under another context
        (compute type, mesh, ...) or inside a name scope."""
        with contextlib.ExitStack() as stack:
            if eqn.ctx is not here:
                stack.enter_context(eqn.ctx.manager)
            if eqn.source_info.name_stack:
                stack.enter_context(
                    jc.set_name_stack(jc.current_name_stack() + eqn.source_info.name_stack)
                )
            stack.enter_context(jc.set_current_trace(self))
            return eqn.primitive.bind(*args, **params)

    def _wrap_outputs(self, out, primitive, rule):
        if primitive.multiple_results:
            if not isinstance(out, (list, tuple)):
                raise QuaxlikeError(
                    messages.RULE_RETURNED_SINGLE.format(
                        rule=_rule_name(rule), primitive=primitive.name, got=type(out).__qualname__
                    )
                )
            return [self._wrap_output(x, primitive, rule) for x in out]
        if isinstance(out, (list, tuple)):
            raise QuaxlikeError(
                messages.RULE_RETURNED_SEQUENCE.format(
                    rule=_rule_name(rule), primitive=primitive.name, got=type(out).__qualname__
                )
            )
        return self._wrap_output(out, primitive, rule)

    def _process_observed(self, primitive, tracers, values, params):
        """`process_primitive` under `explain` (record what ran, and name the
        equations each rule emits) or checked mode (compare each rule's outputs
        with the primitive's abstract evaluation). A call-like primitive whose
        chosen rule inlines its sub-program is evaluated in this trace."""
        jaxpr = None
        if primitive in _inlinable_primitives and not self.eager:
            jaxpr = self._sub_program(primitive, values, params)[0]
        recorder = _instrument.recorder.get()
        record = recorder.open(primitive, values) if recorder is not None else None
        try:
            if jaxpr is not None:
                rule = chosen_rule(primitive, values)
                outputs = self._inline(jaxpr, tracers)
            else:
                with jc.set_current_trace(self.parent_trace):
                    out, rule = dispatch(primitive, values, params, name_scopes=record is not None)
                outputs = self._wrap_outputs(out, primitive, rule)
        finally:
            if recorder is not None and record is not None:
                recorder.close(record)
        if record is not None:
            if rule is not None:
                record.rule = _instrument.rule_name(rule)
                record.location = _instrument.rule_location(rule)
            else:
                record.default_owner = default_description(primitive, values)
        if _instrument.checking.get():
            out_list = outputs if primitive.multiple_results else [outputs]
            _instrument.check_outputs(
                primitive,
                [jax.typeof(t) for t in tracers],
                params,
                [jax.typeof(o) for o in out_list],
                rule,
            )
        return outputs

    def process_call(self, call_primitive, f, tracers, params):
        if self.adopts:
            tracers = self._adopt(tracers)
        if not any(self.owns(t) for t in tracers):
            with jc.set_current_trace(self.parent_trace):
                return call_primitive.bind(f, *tracers, **params)
        # Inline the call: its body runs under this trace.
        with jc.set_current_trace(self):
            return f.call_wrapped(*tracers)

    def process_custom_jvp_call(self, primitive, fun, jvp, tracers, *, symbolic_zeros):
        if self.adopts:
            tracers = self._adopt(tracers)
        if not any(self.owns(t) for t in tracers):
            return self.parent_trace.process_custom_jvp_call(
                primitive, fun, jvp, tracers, symbolic_zeros=symbolic_zeros
            )
        from ._higher_order._custom_ad import custom_jvp_with_values

        return custom_jvp_with_values(self, primitive, fun, jvp, tracers, symbolic_zeros)

    def process_custom_vjp_call(
        self, primitive, fun, fwd, bwd, tracers, *, out_trees, symbolic_zeros
    ):
        if self.adopts:
            tracers = self._adopt(tracers)
        if not any(self.owns(t) for t in tracers):
            return self.parent_trace.process_custom_vjp_call(
                primitive,
                fun,
                fwd,
                bwd,
                tracers,
                out_trees=out_trees,
                symbolic_zeros=symbolic_zeros,
            )
        from ._higher_order._custom_ad import custom_vjp_with_values

        return custom_vjp_with_values(
            self, primitive, fun, fwd, bwd, tracers, out_trees, symbolic_zeros
        )

    def process_shard_map(self, primitive, fun, args, **params):
        if self.adopts:
            args = self._adopt(args)
        values = [self.unwrap(t) for t in args]
        with jc.set_current_trace(self.parent_trace):
            if not any(self.owns(t) for t in args):
                # Handled here even with no Value among the arguments: the mapped
                # function may close over Values of this trace.
                from ._higher_order._sharding import shard_map_p_values

                out, rule = shard_map_p_values(*values, fun=fun, outer_trace=self, **params), None
            else:
                # Dispatched like any primitive, so a type may register its own
                # rule for `shard_map_p`; the mapped function is the `fun` param.
                out, rule = dispatch(primitive, values, dict(params, fun=fun, outer_trace=self))
        return out.map(lambda x: self._wrap_output(x, primitive, rule))

    def stage_value(self, val):
        if self.owns(val):
            return val
        return self.parent_trace.stage_value(val)


def _is_plain_primitive(primitive) -> bool:
    """Whether binding `primitive` is an ordinary `process_primitive` (not a call,
    custom-derivative or mapped primitive with its own trace hook)."""
    return type(primitive).bind_with_trace is jc.Primitive.bind_with_trace


def _rule_name(rule) -> str:
    if rule is None:
        return "default"
    implementation = getattr(rule, "implementation", rule)
    return getattr(implementation, "__qualname__", repr(implementation))
