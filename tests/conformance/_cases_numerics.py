"""Rows for linear algebra, FFT and random numbers (typed and raw keys)."""

import jax
import jax.extend as jex
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from _inputs import c64, case, f32, idx, key, lower, pos, raw_key, spd, sym, u32
from jax import lax
from jax._src.lax import linalg as lax_linalg_internal
from jax._src.random import philox2x32, philox4x32, threefry4x32


_LINALG_TOL = {"rtol": 1e-4, "atol": 1e-4}


def _sign_fixed_eigh(a):
    # Eigenvectors are defined up to sign; fix it so results are comparable.
    w, v = jnp.linalg.eigh(a)
    return w, v * jnp.sign(v[:1, :])


def _eig_values(a):
    w = jnp.linalg.eigvals(a)
    return jnp.sort(w.real), jnp.sort(w.imag)


CASES = [
    # --- linear algebra -----------------------------------------------------------
    case("cholesky", jnp.linalg.cholesky, spd(4), prims="cholesky", tol=_LINALG_TOL),
    case(
        "cho_solve",
        lambda a, b: jsl.cho_solve(jsl.cho_factor(a), b),
        spd(4),
        f32(4, 2),
        prims=("cholesky", "triangular_solve"),
        tol=_LINALG_TOL,
    ),
    case(
        "cholesky_update",
        lax.linalg.cholesky_update,
        jnp.linalg.cholesky(spd(4)).T,
        f32(4),
        prims="cholesky_update",
        grad=False,
        vmap=False,
        tol=_LINALG_TOL,
    ),
    case("qr", jnp.linalg.qr, f32(5, 3), prims="qr", tol=_LINALG_TOL),
    case(
        "qr-complete",
        lambda a: jnp.linalg.qr(a, mode="complete"),
        f32(4, 3),
        prims="qr",
        grad=False,
        tol=_LINALG_TOL,
    ),
    case("geqrf", lax_linalg_internal.geqrf, f32(4, 3), prims="geqrf", grad=False, tol=_LINALG_TOL),
    case(
        "geqp3",
        lambda a, p: lax_linalg_internal.geqp3(a, p),
        f32(4, 3),
        jnp.zeros(3, jnp.int32),
        prims="geqp3",
        grad=False,
        vmap=False,
        tol=_LINALG_TOL,
    ),
    case(
        "householder_product",
        lax.linalg.householder_product,
        f32(4, 3),
        f32(3, low=0.0, high=1.0),
        prims="householder_product",
        grad=False,
        tol=_LINALG_TOL,
    ),
    case(
        "ormqr",
        lambda a, t, c: lax.linalg.ormqr(a, t, c),
        f32(4, 3),
        f32(3, low=0.0, high=1.0),
        f32(4, 2),
        prims="ormqr",
        grad=False,
        vmap=False,
        tol=_LINALG_TOL,
    ),
    case(
        "svd",
        lambda a: jnp.linalg.svd(a, compute_uv=False),
        f32(4, 3),
        prims="svd",
        tol=_LINALG_TOL,
    ),
    case(
        "svd-full",
        lambda a: jnp.linalg.svd(a, full_matrices=False),
        f32(4, 3),
        prims="svd",
        grad=False,
        tol=_LINALG_TOL,
    ),
    case(
        "pinv",
        jnp.linalg.pinv,
        f32(4, 3),
        prims=("svd", "custom_jvp_call"),
        tol={"rtol": 1e-3, "atol": 1e-3},
    ),
    case("eigh", _sign_fixed_eigh, sym(4), prims="eigh", tol=_LINALG_TOL),
    case("eigvalsh", jnp.linalg.eigvalsh, sym(4), prims="eigh", tol=_LINALG_TOL),
    case(
        "eig",
        _eig_values,
        spd(3) + jnp.triu(jnp.ones((3, 3), jnp.float32)),
        prims="eig",
        grad=False,
        tol=_LINALG_TOL,
    ),
    case(
        "eig-complex",
        lambda a: jnp.sort(jnp.abs(jnp.linalg.eigvals(a))),
        c64(3, 3),
        prims="eig",
        grad=False,
        tol=_LINALG_TOL,
    ),
    case(
        "hessenberg",
        lambda a: jsl.hessenberg(a)[0],
        spd(4),
        prims="hessenberg",
        grad=False,
        tol=_LINALG_TOL,
    ),
    case(
        "schur",
        lambda a: jnp.sort(jnp.diag(jsl.schur(a)[0])),
        spd(3),
        prims="schur",
        grad=False,
        vmap=False,
        tol=_LINALG_TOL,
    ),
    case(
        "tridiagonal",
        lambda a: lax.linalg.tridiagonal(a)[2],
        sym(4),
        prims="tridiagonal",
        grad=False,
        tol=_LINALG_TOL,
    ),
    case(
        "tridiagonal_solve",
        lax.linalg.tridiagonal_solve,
        jnp.array([0.0, 1.0, -1.0, 0.5], jnp.float32),
        pos(4) + 3.0,
        jnp.array([0.5, 1.0, 1.0, 0.0], jnp.float32),
        f32(4, 2),
        prims="tridiagonal_solve",
        tol=_LINALG_TOL,
    ),
    case(
        "symmetric_product",
        lambda a, c: lax.linalg.symmetric_product(a, c),
        f32(3, 2),
        sym(3),
        prims="symmetric_product",
        grad=False,
        vmap=False,
        tol=_LINALG_TOL,
    ),
    case(
        "triangular_solve",
        lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
        lower(4),
        f32(4, 2),
        prims="triangular_solve",
        tol=_LINALG_TOL,
    ),
    case(
        "solve_triangular",
        lambda a, b: jsl.solve_triangular(a, b, lower=True),
        lower(4),
        f32(4, 2),
        prims="triangular_solve",
        tol=_LINALG_TOL,
    ),
    case("lu", lax.linalg.lu, spd(3), prims="lu", grad=False, tol=_LINALG_TOL),
    case("lu_factor", jsl.lu_factor, spd(3), prims="lu", grad=False, tol=_LINALG_TOL),
    case(
        "lu_pivots_to_permutation",
        lambda p: lax.linalg.lu_pivots_to_permutation(p, 4),
        jnp.array([2, 3, 2, 3], jnp.int32),
        prims="lu_pivots_to_permutation",
    ),
    case(
        "solve",
        jnp.linalg.solve,
        spd(4),
        f32(4, 2),
        prims=("lu", "custom_linear_solve"),
        tol=_LINALG_TOL,
    ),
    case("inv", jnp.linalg.inv, spd(3), prims=("lu", "custom_linear_solve"), tol=_LINALG_TOL),
    case("det", jnp.linalg.det, spd(4), prims=("lu", "custom_jvp_call"), tol=_LINALG_TOL),
    case(
        "slogdet",
        jnp.linalg.slogdet,
        spd(3),
        prims="lu",
        tol=_LINALG_TOL,
    ),
    case(
        "lstsq",
        lambda a, b: jnp.linalg.lstsq(a, b)[0],
        f32(5, 3),
        f32(5),
        prims="svd",
        tol={"rtol": 1e-3, "atol": 1e-3},
    ),
    case(
        "expm", jsl.expm, 0.3 * f32(3, 3), prims=("lu", "cond"), tol=_LINALG_TOL, all_values=False
    ),
    # --- FFT ----------------------------------------------------------------------
    case("fft", jnp.fft.fft, c64(8), prims="fft", tol=_LINALG_TOL),
    case("ifft", jnp.fft.ifft, c64(8), prims="fft", tol=_LINALG_TOL),
    case("rfft", jnp.fft.rfft, f32(8), prims="fft", tol=_LINALG_TOL),
    case("irfft", lambda z: jnp.fft.irfft(z, n=8), c64(5), prims="fft", tol=_LINALG_TOL),
    case("fft2", jnp.fft.fft2, c64(4, 4), prims="fft", tol=_LINALG_TOL),
    case(
        "fft-lax", lambda z: lax.fft(z, lax.FftType.FFT, (8,)), c64(8), prims="fft", tol=_LINALG_TOL
    ),
    # --- random numbers -----------------------------------------------------------
    case("random_bits", lambda k: jax.random.bits(k, (3,)), key(1), prims="random_bits"),
    case(
        "random_bits-raw-key",
        lambda k: jax.random.bits(k, (3,)),
        raw_key(2),
        prims=("random_wrap", "random_bits"),
    ),
    case("random-normal", lambda k: jax.random.normal(k, (2, 3)), key(3), prims="random_bits"),
    case(
        "random-uniform-bounds",
        lambda k, lo: jax.random.uniform(k, (3,), minval=lo, maxval=lo + 1.0),
        key(4),
        jnp.float32(-2.0),
        prims="random_bits",
    ),
    case(
        "random-randint",
        lambda k: jax.random.randint(k, (3,), 0, 10),
        key(5),
        prims=("random_split", "random_bits"),
    ),
    case(
        "random-bernoulli",
        lambda k, p: jax.random.bernoulli(k, p),
        key(6),
        f32(3, low=0.1, high=0.9),
        prims="random_bits",
    ),
    case(
        "random-categorical",
        lambda k, logits: jax.random.categorical(k, logits),
        key(7),
        f32(2, 4),
        prims=("random_bits", "argmax"),
    ),
    case(
        "random-permutation",
        jax.random.permutation,
        key(8),
        jnp.arange(5.0, dtype=jnp.float32),
        prims=("random_bits", "sort"),
    ),
    case("random_split", lambda k: jax.random.split(k, 3), key(9), prims="random_split"),
    case(
        "random_fold_in",
        lambda k, d: jax.random.fold_in(k, d),
        key(10),
        jnp.uint32(7),
        prims="random_fold_in",
    ),
    case("random_seed", lambda s: jax.random.key(s), jnp.int32(11), prims="random_seed"),
    case("random_unwrap", jax.random.key_data, key(12), prims="random_unwrap"),
    case("random_wrap", jax.random.wrap_key_data, u32(2), prims="random_wrap"),
    case("random_clone", jax.random.clone, key(13), prims="random_clone"),
    case(
        "random_gamma",
        lambda k, a: jax.random.gamma(k, a),
        key(14),
        pos(3),
        prims="random_gamma",
        grad=False,
    ),
    case(
        "random-key-rbg",
        lambda k: jax.random.normal(k, (3,)),
        jax.random.key(15, impl="rbg"),
        prims="random_bits",
    ),
    case(
        "random-key-philox",
        lambda k: jax.random.uniform(k, (3,)),
        jax.random.key(16, impl="philox4x32"),
        prims="random_bits",
    ),
    case("threefry2x32", jex.random.threefry_2x32, u32(2), u32(4), prims="threefry2x32"),
    # The key-level functions of the philox implementations bind their primitives
    # directly (jax.random reaches them only below `random_bits`).
    case(
        "philox2x32",
        lambda k: philox2x32.philox2x32_random_bits(k, 32, (4,)),
        u32(1),
        prims=("philox2x32", "iota_2x32_shape"),
        valueless="iota_2x32_shape",
    ),
    case(
        "threefry4x32",
        lambda k: threefry4x32.threefry4x32_split(k, (2,)),
        u32(4),
        prims="threefry4x32",
    ),
    case(
        "philox4x32",
        lambda k: philox4x32.philox4x32_random_bits(k, 32, (4,)),
        u32(2),
        prims="philox4x32",
    ),
    case(
        "rng_bit_generator",
        lambda k: lax.rng_bit_generator(k, (3,)),
        u32(4),
        prims="rng_bit_generator",
    ),
    case(
        "rng_uniform",
        lambda a, b: lax.rng_uniform(a, b, (3,)),
        jnp.float32(0.0),
        jnp.float32(1.0),
        prims="rng_uniform",
        compare="aval",
        grad=False,
        vmap=False,
    ),
    case(
        "random-indices-gather",
        lambda k, x: x[jax.random.randint(k, (2,), 0, 4)],
        key(17),
        f32(4, 3),
        prims=("random_bits", "gather"),
    ),
    case(
        "random-choice",
        lambda k, x: jax.random.choice(k, x, (2,), replace=False),
        key(18),
        f32(5),
        prims="random_bits",
    ),
    case(
        "random-idx",
        lambda k, i: jax.random.fold_in(k, i),
        key(19),
        idx(high=9),
        prims="random_fold_in",
    ),
]
