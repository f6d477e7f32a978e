"""`materialise_policy`, `explain`, checked mode, environment variables and
tracebacks."""

import os
import subprocess
import sys
import traceback
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import PassThrough, randn, tree_allclose

import quaxlike
from quaxlike.lora import LoraArray


HERE = os.path.dirname(os.path.abspath(__file__))


class Dense(quaxlike.ArrayValue):
    """Materialises to its array; no rules at all, so everything falls back."""

    array: jax.Array

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        return self.array


class QuietDense(Dense):
    warn_on_materialise = False


def _lora(seed=0, allow_materialise=False):
    lora = LoraArray(
        randn(seed, (6, 4)), rank=2, key=jax.random.key(seed), allow_materialise=allow_materialise
    )
    return eqx.tree_at(lambda v: v.b, lora, randn(seed + 1, (2, 4)))


# --- materialise_policy -------------------------------------------------------------


def test_policy_allow_is_silent_and_default():
    x = randn(0, (3,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = quaxlike.quaxify(jnp.exp)(Dense(x))
    assert tree_allclose(out, jnp.exp(x))


def test_policy_warn_names_type_primitive_and_user_line():
    x = randn(0, (3,))

    def user_function(v):
        return jnp.exp(v)  # the line the warning must point at

    line = user_function.__code__.co_firstlineno + 1
    with quaxlike.materialise_policy("warn"):
        with pytest.warns(UserWarning) as caught:
            out = quaxlike.quaxify(user_function)(Dense(x))
    assert tree_allclose(out, jnp.exp(x))
    (warning,) = caught.list
    message = str(warning.message)
    assert "Dense" in message and "`exp`" in message
    assert f"{__file__}:{line}" in message
    assert warning.filename == __file__ and warning.lineno == line


def test_policy_error_raises_and_restores():
    x = randn(0, (3,))
    with quaxlike.materialise_policy("error"):
        with pytest.raises(quaxlike.MaterialisationError, match=r"(?s)`exp`.*Dense.*register"):
            quaxlike.quaxify(jnp.exp)(Dense(x))
        # Rules that keep the structure are unaffected.
        lora = _lora()
        y = quaxlike.quaxify(lambda w, v: w @ v)(lora, randn(3, (4,)))
        assert tree_allclose(y, (lora.w + lora.a @ lora.b) @ randn(3, (4,)), rtol=1e-5)
    # Back to "allow" after the block.
    assert tree_allclose(quaxlike.quaxify(jnp.exp)(Dense(x)), jnp.exp(x))


def test_policy_applies_inside_higher_order_rules():
    # A cond whose branches return different types materialises one of them.
    def f(p, v):
        return jax.lax.cond(p, lambda: v, lambda: jnp.zeros(3))

    with quaxlike.materialise_policy("error"):
        with pytest.raises(quaxlike.MaterialisationError, match="cond"):
            quaxlike.quaxify(f)(True, Dense(randn(0, (3,))))


def test_type_can_opt_out_of_warnings():
    with quaxlike.materialise_policy("error"):
        out = quaxlike.quaxify(jnp.exp)(QuietDense(randn(0, (3,))))
        out2 = quaxlike.quaxify(jnp.exp)(quaxlike.DenseArrayValue(randn(0, (3,))))
    assert tree_allclose(out, out2)


def test_policy_rejects_unknown_mode():
    with pytest.raises(ValueError, match="'allow', 'warn', 'error'"):
        with quaxlike.materialise_policy("sometimes"):
            pass


def _import_with_env(**env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import quaxlike, quaxlike._policy as p; print(p.current_mode())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=os.path.dirname(HERE),
        timeout=300,
    )


def test_environment_variables_read_and_validated_at_import():
    ok = _import_with_env(QUAXLIKE_MATERIALISE="warn")
    assert ok.returncode == 0 and ok.stdout.strip() == "warn", ok.stderr
    bad = _import_with_env(QUAXLIKE_MATERIALISE="loud")
    assert bad.returncode != 0 and "QUAXLIKE_MATERIALISE='loud'" in bad.stderr
    bad = _import_with_env(QUAXLIKE_CHECK="maybe")
    assert bad.returncode != 0 and "QUAXLIKE_CHECK='maybe'" in bad.stderr


def test_model_runs_with_nothing_materialised():
    # What a user test looks like: the LoRA forward pass under "error".
    lora, x = _lora(), randn(3, (5, 4))
    with quaxlike.materialise_policy("error"):
        out = jax.jit(quaxlike.quaxify(lambda w, v: jax.nn.relu(v @ w.T)))(lora, x)
    assert tree_allclose(out, jax.nn.relu(x @ (lora.w + lora.a @ lora.b).T), rtol=1e-5)


# --- explain ----------------------------------------------------------------------


def _model(w, x):
    h = jnp.tanh(w @ x)

    def body(carry, _):
        return jnp.sin(carry) * 2.0, carry.sum()

    carry, ys = jax.lax.scan(body, h, None, length=3)
    return jax.jit(lambda w, c: w.T @ c)(w, carry) + ys.sum()


def test_explain_lists_rules_and_nests_bodies():
    lora, x = _lora(), randn(3, (4,))
    report = quaxlike.explain(_model)(lora, x)
    # `w @ x` is `jnp.matmul`, itself a jitted function: its dot_general is
    # reported inside that jit.
    assert [r.primitive for r in report.records] == ["jit", "jit"]
    matmul, jit = report.records
    (dot,) = matmul.children
    assert dot.primitive == "dot_general" and dot.inside == "jit"
    assert dot.handler.endswith("dot_general_p_lora_any")
    assert dot.arg_types[0].startswith("LoraArray[")
    assert dot.location is not None and dot.location.split(":")[0].endswith("_rules.py")
    # The user's jit body: its records, marked as inside it and reported once.
    assert [c.primitive for c in jit.children] == ["transpose", "dot_general"]
    assert all(c.inside == "jit" for c in jit.children)
    assert report.primitive_counts["dot_general"] == 2
    assert sum(report.rule_counts.values()) == 5
    assert not report.materialised
    text = str(report)
    assert "[inside jit] transpose(LoraArray[" in text and "rules:" in text


def test_explain_reports_default_materialisation():
    report = quaxlike.explain(lambda v: jax.lax.exp(v) + 1.0)(Dense(randn(0, (3,))))
    (record,) = report.records
    assert record.handler == "default: materialised Dense"
    assert report.materialised == [record]


def test_explain_scan_body_reported_once_inside_scan():
    report = quaxlike.explain(
        lambda v: jax.lax.scan(lambda c, _: (jnp.sin(c) * 2.0, None), v, None, length=5)[0]
    )(PassThrough(randn(0, (3,))))
    (scan,) = report.records
    assert scan.primitive == "scan"
    assert [(c.primitive, c.inside) for c in scan.children] == [("sin", "scan"), ("mul", "scan")]
    assert all(c.handler == "default of PassThrough" for c in scan.children)


def test_explain_program_is_annotated_and_computes_the_same():
    lora, x = _lora(), randn(3, (4,))
    report = quaxlike.explain(_model)(lora, x)
    program = report.program()
    assert program.startswith("def _model(")
    assert "def scan_jaxpr_" in program and "def jit_jaxpr_" in program
    assert "<- dot_general_p_lora" in program and "<- transpose_p_lora" in program
    # The traced program is the quaxified computation, unchanged.
    leaves = jax.tree_util.tree_leaves((lora, x))
    (out,) = jax.core.eval_jaxpr(report.jaxpr.jaxpr, report.jaxpr.consts, *leaves)
    assert tree_allclose(out, quaxlike.quaxify(_model)(lora, x))
    assert tree_allclose(out, _model(lora.w + lora.a @ lora.b, x), rtol=1e-4, atol=1e-5)


def test_explain_does_not_leave_recording_on():
    quaxlike.explain(jnp.sin)(PassThrough(randn(0, (2,))))
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(jnp.sin))(PassThrough(randn(0, (2,))))
    assert "quaxlike:" not in str(jaxpr.jaxpr.eqns[0].source_info.name_stack)


# --- checked mode ------------------------------------------------------------------


class Sloppy(quaxlike.ArrayValue):
    array: jax.Array

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        return self.array


@quaxlike.register(jax.lax.reduce_sum_p)
def reduce_sum_p_sloppy(x: Sloppy, *, axes, **params):
    # Wrong: forgets to drop the reduced axes.
    return jnp.sum(x.array, axis=axes, keepdims=True)


@quaxlike.register(jax.lax.neg_p)
def neg_p_sloppy(x: Sloppy, **params):
    return (-x.array).astype(jnp.float16)  # wrong dtype


def test_checked_mode_names_rule_location_primitive_and_avals():
    x = randn(0, (3, 4))
    with pytest.raises(quaxlike.QuaxlikeError) as info:
        quaxlike.quaxify(lambda v: v.sum(0), check=True)(Sloppy(x))
    message = str(info.value)
    assert "reduce_sum_p_sloppy" in message and f"{__file__}:" in message
    assert "`reduce_sum`" in message
    assert "expected: float32[4]" in message and "got:      float32[1,4]" in message
    with pytest.raises(
        quaxlike.QuaxlikeError, match=r"(?s)neg_p_sloppy.*float16\[3,4\].*float32\[3,4\]"
    ):
        quaxlike.quaxify(jnp.negative, check=True)(Sloppy(x))


def test_checked_mode_off_lets_a_wrong_rule_through():
    out = quaxlike.quaxify(lambda v: v.sum(0), check=False)(Sloppy(randn(0, (3, 4))))
    assert out.shape == (1, 4)


def test_checked_mode_reaches_nested_bodies_and_passes_good_rules():
    lora, x = _lora(), randn(3, (4,))
    out = quaxlike.quaxify(_model, check=True)(lora, x)
    assert tree_allclose(out, _model(lora.w + lora.a @ lora.b, x), rtol=1e-4, atol=1e-5)
    with pytest.raises(quaxlike.QuaxlikeError, match="reduce_sum_p_sloppy"):
        quaxlike.quaxify(lambda v: jax.jit(lambda u: u.sum(0))(v), check=True)(
            Sloppy(randn(0, (3, 4)))
        )


def test_checked_mode_wrong_number_of_outputs():
    class Pair(Sloppy):
        pass

    @quaxlike.register(jax.lax.sort_p)
    def sort_p_pair(*xs: Pair, **params):
        return [xs[0].array]  # sort of two operands has two outputs

    a, b = randn(0, (5,)), randn(1, (5,))
    with pytest.raises(quaxlike.QuaxlikeError, match="1 outputs where `sort` gives 2"):
        quaxlike.quaxify(lambda u, v: jax.lax.sort((u, v), num_keys=1), check=True)(
            Pair(a), Pair(b)
        )


def test_checked_mode_follows_the_environment():
    # The suite runs unchecked, as users do; .ci/run runs the core and
    # conformance tests again with QUAXLIKE_CHECK=1. Either way, a sloppy rule
    # is caught exactly when checked mode is on.
    checking = os.environ.get("QUAXLIKE_CHECK", "0") == "1"
    run = quaxlike.quaxify(lambda v: v.sum(0))
    if checking:
        with pytest.raises(quaxlike.QuaxlikeError, match="reduce_sum_p_sloppy"):
            run(Sloppy(randn(0, (3, 4))))
    else:
        run(Sloppy(randn(0, (3, 4))))


# --- tracebacks ---------------------------------------------------------------------


class Fragile(Sloppy):
    pass


@quaxlike.register(jax.lax.sin_p)
def sin_p_fragile(x: Fragile, **params):
    raise ValueError("this rule is broken")


def test_traceback_shows_user_code_not_trace_internals():
    def user_function(v):
        return jnp.sin(v) + 1

    for run in (quaxlike.quaxify(user_function), jax.jit(quaxlike.quaxify(user_function))):
        with pytest.raises(ValueError) as info:
            run(Fragile(randn(0, (3,))))
        frames = traceback.extract_tb(info.value.__traceback__)
        names = [f.name for f in frames]
        assert "user_function" in names and "sin_p_fragile" in names
        package = os.path.dirname(quaxlike.__file__)
        assert not [f for f in frames if f.filename.startswith(package)], frames
