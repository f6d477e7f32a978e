"""Why each refusal in the table: a sentence per type and function or primitive.

`reason_for(column, function, primitive, error)` looks up the function first,
then the primitive, then the type's default (for the types whose point is to
refuse to materialise, when the error is that refusal). A refusal without a
reason fails the test: each must be either fixed by a rule or explained here.
"""

from _columns import COLUMNS_BY_NAME


# (column, function) -> why the cell is unclear: core bugs, described for the
# core, each with a strict xfail reproduction in test_jnp_table.py. (None now.)
KNOWN_CORE_BUGS: dict[tuple[str, str], str] = {}


# --- unitful --------------------------------------------------------------------------

_NEEDS_NUMBER = (
    "needs a pure number: the exponential, logarithm, trigonometric and hyperbolic "
    "functions of a length have no unit (divide by a reference length first)."
)
_ACTIVATION = (
    "an activation function: it combines its argument with plain constants (1, 3, "
    "6, ...) or takes its exponential, so it needs a pure number (divide by a "
    "reference first)."
)
_TOP_LEVEL_CONSTANT = (
    "JAX builds the plain {what} outside any `jit` body, so under `jax.jit` its "
    "value is not known while tracing and it cannot be checked for 0, inf or NaN "
    "(see the unitful README); without `jax.jit` it works. A core hook that tracks "
    "constants outside `jit` bodies too would make it work."
)

_UNITFUL = {
    "jnp.minmax": (
        "new in jax 0.12: it finds both extremes with one variadic `reduce` whose "
        "combining function is an arbitrary program, which a unit rule cannot read "
        "(there are rules for `reduce_min` and `reduce_max`: use `jnp.min` and "
        "`jnp.max`)."
    ),
    # Reached only from jax 0.11, where the table is checked but not committed.
    **dict.fromkeys(
        ["jnp.searchsorted", "jnp.digitize"],
        (
            "from jax 0.11 `jnp.searchsorted` binds a high-level primitive that JAX "
            "lowers where it is traced, so the unitful rule for it never sees the "
            "call and the lowered loop's `select_n` refuses the quantity (with a "
            "`UnitError` naming it). Up to jax 0.10 it works."
        ),
    ),
    "jnp.polyval": (
        "its loop starts the running value as a plain zero array and adds the "
        "coefficients (in m) to it inside the loop, where its value is no longer "
        "known to be 0: refused at that `add`, naming the way out (a quantity "
        "holds a plain zero only where the zero is known)."
    ),
    **dict.fromkeys(
        [
            f"primitive:{p}"
            for p in [
                "exp", "exp2", "log", "log2", "log1p", "expm1", "sin", "cos", "tan", "asin",
                "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
                "logistic",
            ]
        ],
        _NEEDS_NUMBER,
    ),
    "primitive:cumprod": (
        "a running product of lengths is in m, m^2, m^3, ...: one unit cannot "
        "describe it."
    ),
    **dict.fromkeys(
        [
            f"jax.nn.{name}"
            for name in [
                "celu", "elu", "selu", "gelu", "glu", "hard_sigmoid", "hard_silu",
                "hard_swish", "hard_tanh", "log1mexp", "log_sigmoid", "log_softmax",
                "logmeanexp", "logsumexp", "mish", "relu6", "sigmoid", "silu",
                "soft_sign", "softmax", "softplus", "sparse_plus", "sparse_sigmoid",
                "squareplus", "swish", "dot_product_attention",
            ]
        ],
        _ACTIVATION,
    ),
    "jax.nn.standardize": (
        "adds a plain `epsilon` to the variance (in m^2): pass `epsilon` as a "
        "quantity in m^2, which works."
    ),
    "jnp.allclose": (
        "compares `|a - b|` with `atol + rtol * |b|`, and the default `atol` is a "
        "plain number: pass `atol` as a quantity, which works."
    ),
    "jnp.isclose": (
        "compares `|a - b|` with `atol + rtol * |b|`, and the default `atol` is a "
        "plain number: pass `atol` as a quantity, which works."
    ),
    "jnp.unwrap": "unwraps by the plain period 2 pi: needs a pure number (an angle).",
    "jnp.sinc": "`sin(pi x) / (pi x)` needs a pure number.",
    "jnp.i0": "a Bessel function: needs a pure number.",
    "jnp.logaddexp": _NEEDS_NUMBER,
    "jnp.logaddexp2": _NEEDS_NUMBER,
    "jnp.heaviside": (
        "its result is a plain 0 or 1, or `h0`: with `h0` in metres, no single unit."
    ),
    "jnp.nanprod": (
        "replaces NaN by a plain 1 before multiplying; `jnp.prod` of lengths works."
    ),
    "jnp.nancumprod": (
        "replaces NaN by a plain 1 before multiplying, and a running product of "
        "lengths is in m, m^2, ...: one unit cannot describe it."
    ),
    "jnp.roots": (
        "builds a companion matrix from plain ones and the coefficients; the roots of a "
        "polynomial whose coefficients share a unit are pure numbers, which a "
        "whole-function rule could give."
    ),
    "jnp.poly": (
        "the coefficients of a polynomial with roots in m are in m^0, m^1, ...: one "
        "unit cannot describe them."
    ),
    "jnp.vander": (
        "the columns are x^0, x^1, ...: in m^0, m^1, ...; one unit cannot describe them."
    ),
    "jnp.polyfit": (
        "fits with a Vandermonde matrix of `x` (columns in m^0, m^1, ...): one unit "
        "cannot describe it."
    ),
    "jnp.float_power": "the exponent is a quantity: an exponent must be a pure number.",
    "jnp.pow": "the exponent is a quantity: an exponent must be a pure number.",
    "jnp.power": "the exponent is a quantity: an exponent must be a pure number.",
    "jnp.frexp": (
        "splits a float's bits into mantissa and exponent, which depends on the unit "
        "the number is in: astropy refuses it too."
    ),
    "jnp.spacing": (
        "the distance to the next float depends on the unit the number is in; no rule."
    ),
    "jnp.linalg.slogdet": "`log |det|` of a matrix in metres has no unit.",
    "jnp.histogram": (
        "the bin `range` is plain numbers beside quantities: pass `bins` as quantities."
    ),
    "jnp.histogram2d": (
        "the bin `range` is plain numbers beside quantities: pass `bins` as quantities."
    ),
    "jnp.histogramdd": (
        "the bin `range` is plain numbers beside quantities: pass `bins` as quantities."
    ),
    "jnp.isposinf": _TOP_LEVEL_CONSTANT.format(what="infinity it compares with"),
    "jnp.isneginf": _TOP_LEVEL_CONSTANT.format(what="infinity it compares with"),
    "jnp.extract": _TOP_LEVEL_CONSTANT.format(what="zero it fills unused slots with"),
    "jnp.compress": _TOP_LEVEL_CONSTANT.format(what="zero it fills unused slots with"),
    "jnp.setdiff1d": _TOP_LEVEL_CONSTANT.format(what="zero it fills unused slots with"),
    "jnp.diagflat": _TOP_LEVEL_CONSTANT.format(what="zeros it writes the diagonal into"),
    "jnp.insert": _TOP_LEVEL_CONSTANT.format(what="zeros it writes into"),
}  # fmt: skip

_NAMED = {
    "jnp.cov": (
        "computes `x @ x.T`, whose two axes would both be named `a`: a result with a "
        "repeated name is refused; rename one side first."
    ),
    "jnp.corrcoef": (
        "computes `x @ x.T`, whose two axes would both be named `a`: a result with a "
        "repeated name is refused; rename one side first."
    ),
    "jnp.linalg.matrix_power": (
        "multiplies `x @ x`, contracting axis `b` with axis `a`: contracted axes must "
        "have the same name; square matrices with two names cannot be multiplied "
        "by themselves."
    ),
}

# column -> {function name or "primitive:<name>" -> sentence}
REASONS: dict[str, dict[str, str]] = {"unitful": _UNITFUL, "named": _NAMED}


def reason_for(column: str, function: str, primitive: str, error: str = "") -> str | None:
    reasons = REASONS.get(column, {})
    found = reasons.get(function) or reasons.get(f"primitive:{primitive}")
    if found is not None:
        return found
    by_design = COLUMNS_BY_NAME[column].by_design
    if by_design is not None and error == "MaterialisationError":
        return by_design
    return None
