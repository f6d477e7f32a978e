"""State shared by the diagnostic modes: `explain`'s recorder and checked mode.

Both are context variables, so they follow the code being traced (threads,
nested `quaxify` calls inside rules) rather than a global switch. A `QuaxTrace`
reads them once when it is created; when neither is on, tracing takes its
ordinary fast path.
"""

import contextvars
import inspect
import warnings

from . import _config
from ._diagnostics import messages, QuaxlikeError, rule_location, rule_name


checking: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "quaxlike_check", default=_config.CHECK_AT_IMPORT
)
recorder: contextvars.ContextVar["Recorder | None"] = contextvars.ContextVar(
    "quaxlike_recorder", default=None
)


def active() -> bool:
    return checking.get() or recorder.get() is not None


# --- explain's recorder ---------------------------------------------------------


class Record:
    """One primitive applied to Values: what it got, and what handled it."""

    def __init__(self, primitive: str, arg_types: tuple[str, ...], inside: str | None):
        self.primitive = primitive
        self.arg_types = arg_types
        self.inside = inside
        self.rule: str | None = None
        self.location: str | None = None
        self.materialised: list[str] = []
        self.children: list[Record] = []

    @property
    def handler(self) -> str:
        """The rule's qualified name, or how the default handled it."""
        if self.rule is not None:
            return self.rule
        if self.materialised:
            return "default: materialised " + ", ".join(self.materialised)
        return self.default_owner or "default"

    default_owner: str | None = None


class Recorder:
    def __init__(self):
        self.records: list[Record] = []
        self._open: list[Record] = []

    def open(self, primitive: str, arg_types: tuple[str, ...]) -> Record:
        """Open the record of `primitive` (a name) applied to arguments described
        by `arg_types`, inside the record open now, if any."""
        inside = self._open[-1].primitive if self._open else None
        record = Record(primitive, arg_types, inside)
        (self._open[-1].children if self._open else self.records).append(record)
        self._open.append(record)
        return record

    def close(self, record: Record) -> None:
        assert self._open and self._open[-1] is record
        self._open.pop()

    def note_materialised(self, value) -> None:
        if self._open:
            self._open[-1].materialised.append(type(value).__qualname__)


def note_materialised(value) -> None:
    current = recorder.get()
    if current is not None:
        current.note_materialised(value)


# --- checked mode ------------------------------------------------------------------


def warn_unannotated(rule, primitive) -> None:
    """In checked mode, point out positional arguments with no annotation.

    They are accepted, as plum (and so Quax) accepts them: such an argument
    matches any type. The warning is guidance only, since a rule meant for one
    type that matches every type is a common slip."""
    if not checking.get():
        return
    try:
        signature = inspect.signature(rule)
    except (TypeError, ValueError):  # builtins and the like: let plum judge
        return
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    )
    for parameter in signature.parameters.values():
        if parameter.kind in positional and parameter.annotation is inspect.Parameter.empty:
            warnings.warn(
                messages.UNANNOTATED_RULE_ARGUMENT.format(
                    rule=getattr(rule, "__qualname__", rule),
                    primitive=primitive.name,
                    arg=parameter.name,
                ),
                UserWarning,
                stacklevel=4,
            )


def _aval_text(aval) -> str:
    weak = "~" if getattr(aval, "weak_type", False) else ""
    return weak + (aval.str_short() if hasattr(aval, "str_short") else str(aval))


def check_outputs(primitive, in_avals, params, out_avals, rule) -> None:
    """Raise if `out_avals` (what the rule produced) disagree with the primitive's
    own abstract evaluation on `in_avals`."""
    try:
        expected, _ = primitive.abstract_eval(*in_avals, **params)
    except Exception:
        # No abstract evaluation for these avals (some higher-order and
        # extended-dtype primitives): nothing to compare against.
        return
    expected = list(expected) if primitive.multiple_results else [expected]
    problem = None
    if len(expected) != len(out_avals):
        problem = f"{len(out_avals)} outputs where `{primitive.name}` gives {len(expected)}"
    else:
        for i, (want, got) in enumerate(zip(expected, out_avals)):
            if not hasattr(want, "shape") or not hasattr(got, "shape"):
                continue
            if (
                tuple(want.shape) != tuple(got.shape)
                or want.dtype != got.dtype
                or bool(getattr(want, "weak_type", False)) != bool(getattr(got, "weak_type", False))
            ):
                problem = f"output {i} is {_aval_text(got)} where `{primitive.name}` gives {_aval_text(want)}"
                break
    if problem is not None:
        raise QuaxlikeError(
            messages.CHECK_FAILED.format(
                rule=rule_name(rule),
                location=rule_location(rule),
                primitive=primitive.name,
                inputs=", ".join(_aval_text(a) for a in in_avals),
                problem=problem,
                expected=", ".join(_aval_text(a) for a in expected),
                got=", ".join(_aval_text(a) for a in out_avals),
            )
        )
