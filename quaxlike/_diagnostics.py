"""Error classes and every message template quaxlike raises.

Messages say what went wrong (naming the type, the primitive and the value
involved) and then how to get out of it. They live here so they read
consistently and can be reviewed in one place.

Where Quax raises a builtin exception for the same mistake, ours is also an
instance of that builtin, so code written for Quax catches it unchanged.
"""

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import jax


class QuaxlikeError(Exception):
    """Base class of the errors quaxlike raises about how it is used.

    Raised directly for mistakes such as a rule that returned a list for a
    primitive with one result, or a rule that returned the wrong abstract value
    in checked mode; the classes below are subclasses, each also an instance of
    the builtin exception Quax raises for the same mistake. Each message names the type, primitive
    and value involved, and the way out.

    !!! example

        ```python
        try:
            quaxlike.register("mull")  # a typo for "mul"
        except quaxlike.QuaxlikeError as error:
            print(error)  # ... no primitive called 'mull' ... such as: 'add', 'mul', ...
        ```
    """


class AmbiguousRuleError(QuaxlikeError, LookupError):
    """Several rules match a primitive's argument types equally well.

    The message lists the matching rules with their signatures, precedences and
    source locations, and three ways out: nest `quaxify` calls with different
    `filter_spec`s, give one rule a higher `precedence`, or register a rule for
    exactly that combination of types. Also a `LookupError`, as plum's
    ambiguity error (which Quax raises) is.

    !!! example

        ```python
        class A(quaxlike.DenseArrayValue):
            pass

        class B(quaxlike.DenseArrayValue):
            pass

        @quaxlike.register(jax.lax.add_p)
        def add_p_a_any(x: A, y: ArrayLike | quaxlike.ArrayValue, **params):
            return x.array + y

        @quaxlike.register(jax.lax.add_p)
        def add_p_any_b(x: ArrayLike | quaxlike.ArrayValue, y: B, **params):
            return x + y.array

        try:
            quaxlike.quaxify(lambda a, b: a + b)(A(jnp.ones(2)), B(jnp.ones(2)))
        except quaxlike.AmbiguousRuleError as error:
            print(error)  # lists both rules, and the ways out
        ```
    """


class MaterialisationError(QuaxlikeError, RuntimeError):
    """A Value could not be materialised where a primitive needed it.

    Raised when a primitive has no rule for a Value's type and the type refuses to
    become dense (its `materialise()` raised: the message then shows the rule to
    register), and under `materialise_policy("error")` whenever a Value would fall
    back to being dense. Also a `RuntimeError`, which Quax's types raise when they
    refuse to materialise. Not a `ValueError`: JAX's own functions catch those
    for their own purposes (`jnp.array_equiv` answers `False` for shapes that do
    not broadcast), which would turn a refusal into a wrong answer.

    !!! example

        ```python
        from quaxlike.lora import LoraArray

        weight = LoraArray(jnp.ones((3, 2)), rank=1, key=jr.key(0))  # refuses by default
        try:
            quaxlike.quaxify(jnp.exp)(weight)
        except quaxlike.MaterialisationError as error:
            print(error)  # names `exp` and LoraArray, and the rule signature to write
        ```
    """


class LogicalShardingError(QuaxlikeError, ValueError):
    """A Value's leaves cannot follow the `PartitionSpec` given for the array it
    stands for (see `quaxlike.leaf_specs`).

    The message names the type, the spec, the logical axis and the leaf that
    cannot be split, and the ways out: shard another axis, replicate this one, or
    materialise the Value first. Raised rather than replicating a leaf silently.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P
        from quaxlike.sparse import BCOO

        sparse = BCOO.fromdense(jnp.eye(4))
        try:
            quaxlike.leaf_specs(sparse, P("data"))
        except quaxlike.LogicalShardingError as error:
            print(error)  # BCOO cannot follow ... axis 0 ...
        ```
    """


class ConflictingDefaultsError(QuaxlikeError, TypeError):
    """A primitive has no rule for its argument types, and more than one of
    them overrides `Value.default`. Also a `TypeError`, as in Quax.

    The message names each type (with its module, or an id where two types share
    a name) and the ways out: register a rule for that combination, or nest
    `quaxify` calls so that each trace sees one of the types.

    !!! example

        ```python
        def bind_on_arrays(primitive, values, params):
            arrays = [v.array if isinstance(v, quaxlike.Value) else v for v in values]
            return primitive.bind(*arrays, **params)

        class Left(quaxlike.DenseArrayValue):
            default = staticmethod(bind_on_arrays)

        class Right(quaxlike.DenseArrayValue):
            default = staticmethod(lambda *args: bind_on_arrays(*args))

        try:
            quaxlike.quaxify(jnp.add)(Left(jnp.ones(2)), Right(jnp.ones(2)))
        except TypeError as error:  # a quaxlike.ConflictingDefaultsError
            print(error)  # names Left and Right, and the ways out
        else:
            raise AssertionError("two different defaults should conflict")
        ```
    """


class ValueNotLiftedError(QuaxlikeError, TypeError):
    """A Value reached a JAX operation without any `quaxify` having lifted it:
    it is not inside a quaxified function, or the `filter_spec` of the enclosing
    `quaxify` left it out.

    JAX (or Python, for an operator such as `+`) raises a `TypeError` for such
    an object, which Quax passes on; quaxlike raises this instead, also a
    `TypeError`, naming the operation, the type and its position, and the ways
    out.

    !!! example

        ```python
        from quaxlike.symbolic.zero import Zero

        zero = Zero((3,), jnp.float32)
        only_second = (False, (False, True), False)
        try:
            quaxlike.quaxify(jax.lax.mul, filter_spec=only_second)(zero, jnp.ones(3))
        except TypeError as error:  # a quaxlike.ValueNotLiftedError
            print(error)  # ... received a Zero ... that no `quaxify` has lifted ...
        ```
    """


class ValueNotConcreteError(QuaxlikeError, TypeError):
    """A Value was used where JAX needs a concrete value (a shape, an axis, an
    index, a Python `bool` or `int`) inside `quaxify`, where every Value is
    abstract. Rewritten from JAX's own error, and also an instance of its class
    (`jax.errors.ConcretizationTypeError` where JAX raised one), so code that
    catches JAX's error catches this one (see `keeping_class`)."""


# (quaxlike's class, the class of the error it replaces) -> a class of both.
# Bounded by the number of exception classes.
_classes_of_both: dict[tuple[type, type], type] = {}


def keeping_class(cls: type[QuaxlikeError], replaced: BaseException, message: str) -> Exception:
    """`cls(message)`, made also an instance of the class of the error
    `replaced` that it stands for, so that every `except` clause that caught
    `replaced` catches it (a `ConcretizationTypeError` stays one, a
    `TypeError` stays a `TypeError`).

    **Arguments:**

    - `cls`: quaxlike's error class for the mistake.
    - `replaced`: the error raised by JAX or Python.
    - `message`: the new message.

    **Returns:**

    An instance of `cls` and of `type(replaced)`.
    """
    original = type(replaced)
    if issubclass(cls, original):
        return cls(message)
    both = _classes_of_both.get((cls, original))
    if both is None:
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            # The message as given: not JAX's own constructor, which takes a
            # tracer, or appends a link to its documentation.
            "__init__": Exception.__init__,
            "__str__": Exception.__str__,
        }
        both = _classes_of_both[(cls, original)] = type(cls.__name__, (cls, original), namespace)
    return both(message)


class CarryChangedError(QuaxlikeError, TypeError):
    """A loop body (`while_loop`, `fori_loop`, `scan`) returned a carry whose type
    or static metadata differs from the carry it received, and quaxlike could not
    reconcile the two.

    A Value's static fields (a unit, axis names) are part of its PyTree
    structure, so a body that changes them changes the carry's structure, which
    JAX does not allow. quaxlike first materialises the carries that changed and
    retraces; this error is raised when that is not enough. Also a `TypeError`,
    as Quax raises for a carry that changed structure (and as JAX raises for
    plain arrays whose type changes in a loop); the message says "carry changed
    structure", names the loop primitive, the position of the carry and both
    types.

    !!! example

        ```python
        from quaxlike.units import m, Unitful

        def squares(x):
            return jax.lax.fori_loop(0, 3, lambda i, c: c * c, x)

        try:
            quaxlike.quaxify(squares)(Unitful(jnp.ones(2), m))
        except TypeError as error:  # a quaxlike.CarryChangedError
            print(error)  # ... a loop carry changed structure: carry 0 ... m ... m^2 ...
        else:
            raise AssertionError("a carry whose unit changes should be refused")
        ```
    """


class CarryMaterialisationError(CarryChangedError, MaterialisationError):
    """A loop carry changed structure in the body, and the Value could not be
    materialised to reconcile it: its `materialise()` refused (as a dimensioned
    `Unitful` does), or `materialise_policy("error")` forbade it.

    Both a `CarryChangedError` (so a `TypeError`, as in Quax) and a
    `MaterialisationError`; the message quotes the type's own refusal (or the
    policy's).

    !!! example

        ```python
        from quaxlike.units import m, Unitful

        def squares(x):
            return jax.lax.scan(lambda c, _: (c * c, None), x, length=2)[0]

        try:
            quaxlike.quaxify(squares)(Unitful(jnp.ones(2), m))
        except quaxlike.CarryMaterialisationError as error:
            print(error)  # ... `scan`, a loop carry changed structure ... silently drop its unit
        ```
    """


class BranchMaterialisationError(MaterialisationError, ValueError):
    """The branches of a `cond` (`lax.cond`, `lax.switch`) return different types
    at one output, and a Value there could not be materialised to reconcile
    them: its `materialise()` refused (as a dimensioned `Unitful` does), or
    `materialise_policy("error")` forbade it.

    Also a `ValueError`, as Quax main raises the type's refusal there; the
    message quotes that refusal, names the output and the ways out.

    !!! example

        ```python
        from quaxlike.units import m, Unitful

        def pick(x, pred):
            return jax.lax.cond(pred, lambda: x, lambda: jnp.zeros(3))

        try:
            quaxlike.quaxify(pick)(Unitful(jnp.ones(3), m), jnp.array(True))
        except ValueError as error:  # a quaxlike.BranchMaterialisationError
            print(error)  # ... output 0 ... Refusing to materialise a Unitful ...
        ```
    """


class JaxCompatibilityError(QuaxlikeError, RuntimeError):
    """The installed JAX lacks an internal that quaxlike needs for what was asked.

    Raised only when the missing piece is actually used (never at
    `import quaxlike`), naming the JAX version, the range of JAX releases
    quaxlike is tested with, and what is missing.

    !!! example

        ```python
        try:
            out = quaxlike.quaxify(jnp.sin)(quaxlike.DenseArrayValue(jnp.ones(2)))
        except quaxlike.JaxCompatibilityError as error:
            print(error)  # on an untested JAX: its version, the tested range, what is missing
        ```
    """


def type_labels(types: Iterable[type]) -> list[str]:
    """A readable label per type: its qualified name, with its module where two
    types share a name, and an id where they share that too."""
    types = list(types)
    labels = [t.__qualname__ for t in types]
    for i, t in enumerate(types):
        clashes = [u for u in types if u is not t and u.__qualname__ == t.__qualname__]
        if not clashes:
            continue
        label = f"{t.__module__}.{t.__qualname__}"
        if any(u.__module__ == t.__module__ for u in clashes):
            label += f" (class at {id(t):#x})"
        labels[i] = label
    return labels


def rule_name(rule, *, qualified: bool = True) -> str:
    """A rule's name for messages: `module.qualname` (or just the qualified
    name) of its implementation; `rule` is a plum method, a function, or `None`
    for the default."""
    if rule is None:
        return "the default"
    implementation = getattr(rule, "implementation", rule)
    name = getattr(implementation, "__qualname__", repr(implementation))
    module = getattr(implementation, "__module__", None)
    return f"{module}.{name}" if module and qualified else name


def rule_location(rule) -> str:
    """`file:line` where a rule (a plum method or a function) is defined."""
    if rule is None:
        return "quaxlike"
    implementation = inspect.unwrap(getattr(rule, "implementation", rule))
    try:
        filename = inspect.getsourcefile(implementation)
        _, line = inspect.getsourcelines(implementation)
    except (TypeError, OSError):
        return "unknown location"
    return f"{filename}:{line}"


def ambiguous_rule_error(primitive, values: Sequence[Any], candidates) -> "AmbiguousRuleError":
    """The error for `primitive` on `values` where the plum methods
    `candidates` match equally well: each candidate with its signature,
    precedence and location, and the `register` call that would settle it."""
    name = primitive.name
    expression = (
        f"jax.lax.{name}_p"
        if getattr(jax.lax, f"{name}_p", None) is primitive
        else f"<the `{name}` primitive>"
    )
    lines = [
        f"  - {rule_name(c)} {c.signature} (precedence {c.signature.precedence}), "
        f"at {rule_location(c)}"
        for c in candidates
    ]
    return AmbiguousRuleError(
        messages.AMBIGUOUS.format(
            primitive=name,
            primitive_expression=expression,
            types=value_type_names(values),
            candidates="\n".join(lines),
        )
    )


def value_type_names(values: Sequence[Any]) -> str:
    """The types of `values`, comma separated, told apart where names clash."""
    return ", ".join(type_labels([type(v) for v in values]))


class messages:
    """Namespace of message templates (formatted with `str.format`)."""

    JAX_INTERNAL_MISSING = (
        "quaxlike needs {what} for {needed_for}, and jax {version} does not provide "
        "it. quaxlike is tested with jax {low} to {high}. Install a JAX release in "
        "that range (`pip install 'jax>={low},<={high}'`), or report this JAX "
        "release to quaxlike so that it can be supported."
    )
    UNKNOWN_PRIMITIVE_NAME = (
        "`quaxlike.register({name!r})`: there is no primitive called {name!r} in "
        "`jax.lax` or `jax.extend.core.primitives`. Pass the primitive object itself "
        "(for example `jax.lax.add_p`) or one of the known names, such as: {examples}."
    )
    NOT_A_PRIMITIVE = (
        "`quaxlike.register` takes a JAX primitive, the name of one as a string, or a "
        "list/tuple of those; got {got!r} of type {type_name}. For example "
        "`@quaxlike.register(jax.lax.mul_p)` or `@quaxlike.register('mul')`."
    )
    UNANNOTATED_RULE_ARGUMENT = (
        "The rule `{rule}` registered for `{primitive}` has a positional argument "
        "`{arg}` with no type annotation, so it matches an argument of any type (as in "
        "plum and Quax). Rules are chosen by the types of their positional arguments: "
        "if the rule is meant for particular types, annotate `{arg}` with a Value "
        "subclass, `jaxtyping.ArrayLike`, or a union such as "
        "`ArrayLike | quaxlike.ArrayValue`. (This warning appears in checked mode only.)"
    )
    RULE_NOT_CALLABLE = "`quaxlike.register({primitive})` must decorate a function; got {got!r}."
    AMBIGUOUS = (
        "Ambiguous rules for primitive `{primitive}` with argument types ({types}). "
        "These rules match equally well:\n{candidates}\n"
        "Ways out:\n"
        "  1. Nest `quaxify` calls with different `filter_spec`s, so that each trace "
        "only sees one of the types: "
        "`quaxify(quaxify(fn, filter_spec=is_a), filter_spec=is_b)`; the inner one "
        "is dispatched first.\n"
        "  2. Give one rule priority: `@quaxlike.register({primitive_expression}, precedence=1)`.\n"
        "  3. Register a rule for exactly this combination of types."
    )
    CONFLICTING_DEFAULTS = (
        "Primitive `{primitive}` has no rule for argument types ({types}), and more "
        "than one of these types overrides `Value.default`: {owners}. quaxlike cannot "
        "choose between them. Register a rule for this combination: "
        "`@quaxlike.register({primitive})` with positional arguments annotated "
        "({types}), or nest `quaxify` calls so each trace sees one of the types."
    )
    BAD_AVAL = (
        "`{type_name}.aval()` returned a {got}, not an abstract value. It must return "
        "something like `jax.core.ShapedArray(shape, dtype)`."
    )
    MATERIALISE_MISMATCH = (
        "`{type_name}.materialise()` (called for primitive `{primitive}`) returned an "
        "array of type {got}, but `{type_name}.aval()` says {expected}. Make "
        "`materialise()` agree with `aval()`."
    )
    NO_RULE_AND_REFUSED = (
        "No rule for primitive `{primitive}` with argument types ({types}), so "
        "quaxlike fell back to materialising the {type_name} at position {position}, "
        "and its `materialise()` refused: {error}\n"
        "To handle `{primitive}` without materialising, register a rule:\n"
        '    @quaxlike.register("{primitive}")\n'
        "    def {rule_name}({annotations}, **params): ..."
    )
    BUILT_IN_RULE_NEEDED_DENSE = (
        "quaxlike's built-in rule for `{primitive}` needed the {type_name} as a dense "
        "array (a loop carry or branch output whose type changed between iterations "
        "or branches, a loop predicate, or a `shard_map` operand whose leaves do not "
        "follow its axes), and its `materialise()` refused: {error}\n"
        "Ways out: keep the type the same across iterations and branches (start a "
        "carry as a {type_name}, not as a plain array), or register a rule for "
        '`{primitive}` with this type: `@quaxlike.register("{primitive}")`.'
    )
    DERIVATIVE_NEEDED_DENSE = (
        "quaxlike's rule for `{primitive}` needed {what} of the array a {type_name} "
        "stands for: a custom derivative rule speaks of that array, and JAX "
        "differentiates the {type_name}'s leaves. It is the derivative of "
        "`{refusing}.dense_for_derivatives()` (by default `materialise()`), which "
        "refused: {error}\n"
        "Ways out: if `materialise()` is linear in the {type_name}'s array leaves, let "
        "it keep `structured_tangents = True` (the default), so that `custom_jvp` rules "
        "receive tangent {type_name}s, and have `custom_vjp` backward passes return "
        "cotangent {type_name}s of the same structure (their leaves are then the "
        "leaves' cotangents); override `dense_for_derivatives()` to build the array for derivatives (it is "
        "differentiated inside `jax.jit`, which never keeps it); or keep the "
        "{type_name} out of the derivative (`lax.stop_gradient`, or leave it out of "
        "what `jax.grad` differentiates)."
    )
    CUSTOM_JVP_ZEROS_CHANGED = (
        "A `custom_jvp` rule that takes symbolic zeros (as `eqx.filter_custom_jvp` "
        "rules do) was first called, on Values, with a zero tangent for an input "
        "that is perturbed now. JAX hands quaxlike such a rule once per application "
        "of the function, so it cannot be called again with the new tangents, and "
        "handing it a dense zero instead could break a rule that relies on `None` "
        "for unperturbed inputs. This happens when one traced program (a `jax.jit` "
        "of a quaxified function, say) is differentiated with respect to different "
        "arguments. Way out: trace once per derivative, with the transformation "
        "outside the `jit` (`jax.jit(jax.grad(f, argnums))`, not "
        "`jax.grad(jax.jit(f), argnums)` for several `argnums`), or quaxify inside "
        "the differentiated function."
    )
    CUSTOM_VJP_OUTPUT_COTANGENT = (
        "A `custom_vjp` function applied to Values returned a {type_name}, and a "
        "cotangent reached that output's leaves. The backward pass takes the "
        "cotangent of the array the output stands for, which cannot be rebuilt from "
        "the leaves' cotangents of a {type_name}: its array is not linear in its "
        "leaves (`structured_tangents = False`). Ways out: return the array it stands "
        "for from the function (materialise it there), or register a "
        "`custom_vjp_call` rule for {type_name}."
    )
    MATERIALISE_LOOP = (
        "`{type_name}.materialise()` kept returning Values more than 100 times; it must "
        "eventually return an ordinary array."
    )
    RULE_RETURNED_SEQUENCE = (
        "The rule `{rule}` for primitive `{primitive}` returned a {got}, but "
        "`{primitive}` has a single output. Return one array or Value, not a "
        "list/tuple."
    )
    RULE_RETURNED_SINGLE = (
        "The rule `{rule}` for primitive `{primitive}` returned a {got}, but "
        "`{primitive}` has multiple outputs. Return a list or tuple of arrays/Values."
    )
    RULE_RETURNED_NON_ARRAY = (
        "The rule `{rule}` for primitive `{primitive}` returned an object of type "
        "{got}, which is neither an array nor a `quaxlike.Value`."
    )
    FILTER_SPEC_MISMATCH = (
        "The `filter_spec` given to `quaxify({fn})` does not match the structure of "
        "`(fn, args, kwargs)`. It must be a bool, a callable `leaf -> bool`, or a "
        "PyTree prefix of `(fn, args, kwargs)` made of those; for example "
        "`filter_spec=(False, (True, False), False)` to select only the first of "
        "two positional arguments. Equinox said: {error}"
    )
    VALUE_NOT_LIFTED = (
        "Primitive `{primitive}` received a {type_name} (at position {position}) that no "
        "`quaxify` has lifted, so JAX saw an unknown object instead of an array. "
        "Either the Value is not inside any `quaxify` call, or the `filter_spec` of the "
        "enclosing `quaxify` did not select it. Wrap the function with "
        "`quaxlike.quaxify(fn)` (the default `filter_spec=True` lifts every Value), or "
        "widen the `filter_spec` to include this {type_name}."
    )
    CARRY_TYPE_CHANGED = (
        "In `{primitive}`, a loop carry changed structure: carry {index} enters as {before} "
        "but the loop body returns {after}. quaxlike materialised it to a dense array "
        "and retraced, but the types still disagree. Make the body return the same "
        "type it receives, for example by materialising the carry before the loop "
        "(`carry.materialise()`), or register a `{primitive}` rule for your type."
    )
    CARRY_REFUSED = (
        "In `{primitive}`, a loop carry changed structure: carry {index} enters as {before} "
        "but the loop body returns {after} (another type, or the same type with other "
        "static fields, such as a unit). A loop carry must keep its type, so quaxlike "
        "materialises such a carry to a plain array before the loop, and materialising "
        "the {type_name} failed: {error}\n"
        "Ways out: make the body return the carry with the type and static fields it "
        "receives (a quantity whose unit changes each iteration cannot be a carry); "
        "materialise it yourself before the loop if dropping its structure is what "
        "you want; or register a `{primitive}` rule for {type_name}."
    )
    BRANCH_REFUSED = (
        "The branches of a `cond` return different types at output {index} (a "
        "{type_name} in one, another type or the same type with other static fields "
        "in another). A `cond` needs the same type from every branch, so quaxlike "
        "materialises that output to a plain array, and materialising the "
        "{type_name} failed: {error}\n"
        "Ways out: return the same type, with the same static fields, from every "
        "branch (wrap the plain array in the branch that returns one); materialise "
        "it yourself in the branch if dropping its structure is what you want; or "
        "register a `cond` rule for {type_name}."
    )
    MATERIALISED_WARNING = (
        "quaxlike materialised a {type_name} for primitive `{primitive}` (no rule "
        "handles it), at {where}. Register a rule for `{primitive}` and "
        "{type_name} to keep it structured, or silence this for the type with "
        "`warn_on_materialise = False`."
    )
    MATERIALISED_UNDER_ERROR_POLICY = (
        "Primitive `{primitive}` has no rule for a {type_name}, and "
        "`materialise_policy('error')` forbids falling back to a dense array (at "
        "{where}). Register a rule: `@quaxlike.register('{primitive}')` with a "
        "positional argument annotated `{type_name}`, or allow it for this block with "
        "`quaxlike.materialise_policy('allow')`."
    )
    CHECK_FAILED = (
        "Checked mode: the rule `{rule}` ({location}) for primitive `{primitive}` "
        "returned the wrong abstract value: {problem}.\n"
        "  inputs:   {inputs}\n"
        "  expected: {expected}\n"
        "  got:      {got}\n"
        "A rule must return what `{primitive}` would on the materialised inputs "
        "(same shapes, dtypes, weak types and number of outputs); when it returns a "
        "Value, that Value's `aval()` must say so."
    )
    VALUE_NOT_CONCRETE = (
        "A {type_name} ({aval}) was used where JAX needs a concrete value: a shape, "
        "an axis, an index or a Python bool/int. Inside `quaxify` every Value is "
        "abstract, like a value traced by `jax.jit`, so its contents are not known "
        "while the function is traced. Pass that quantity as a plain Python number "
        "(or a static field of your type), or leave the Value out of this `quaxify` "
        "with `filter_spec`.\nJAX said: {error}"
    )
