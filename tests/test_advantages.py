"""Advantage kernels against NumPy loops, hand-worked examples and known identities.

One set of small shapes is shared by all tests so the file compiles little.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtraj import advantages as adv_lib
from jaxtraj.advantages import (
    chunk_rewards,
    discounted_returns,
    flatten_action_level,
    gae,
    gae_from_next_values,
    group_advantages,
    normalize_advantages,
    unflatten_action_level,
)

T, B = 12, 5
GAMMA, LAM = 0.9, 0.8
METHODS = adv_lib.METHODS
TOL = dict(rtol=1e-5, atol=1e-5)


def make(seed=0, T=T, batch=(B,), p=0.25):
    rng = np.random.default_rng(seed)
    r = rng.standard_normal((T,) + batch).astype(np.float32)
    v = rng.standard_normal((T + 1,) + batch).astype(np.float32)
    d = rng.random((T + 1,) + batch) < p
    return r, v, d


# ----------------------------------------------------------------------------- references


def gae_loop(r, v, d, gamma, lam):
    """RLinf's recurrence, step by step in float64."""
    r, v, nd = r.astype(np.float64), v.astype(np.float64), 1.0 - d.astype(np.float64)
    adv = np.zeros_like(r)
    a = np.zeros(r.shape[1:])
    for t in reversed(range(r.shape[0])):
        delta = r[t] + gamma * v[t + 1] * nd[t + 1] - v[t]
        a = delta + gamma * lam * nd[t + 1] * a
        adv[t] = a
    return adv, adv + v[:-1]


def returns_loop(r, d, gamma, bootstrap=None):
    """Discounted sums cut at dones; ``bootstrap`` (if any) seeds G_T."""
    nd = 1.0 - d.astype(np.float64)
    out = np.zeros(r.shape, np.float64)
    g = np.zeros(r.shape[1:]) if bootstrap is None else bootstrap.astype(np.float64)
    for t in reversed(range(r.shape[0])):
        g = r[t] + gamma * nd[t + 1] * g
        out[t] = g
    return out


def torchrl_loop(r, v, nv, term, done, gamma, lam):
    adv = np.zeros(r.shape, np.float64)
    a = np.zeros(r.shape[1:])
    for t in reversed(range(r.shape[0])):
        delta = r[t] + gamma * (1.0 - term[t]) * nv[t] - v[t]
        a = delta + gamma * lam * (1.0 - done[t]) * a
        adv[t] = a
    return adv, adv + v


@pytest.fixture(scope="module")
def data():
    return make()


# ----------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("method", METHODS + ("auto",))
def test_gae_matches_loop(data, method):
    r, v, d = data
    adv, ret = jax.jit(lambda r, v, d: gae(r, v, d, gamma=GAMMA, lam=LAM, method=method))(r, v, d)
    ref_adv, ref_ret = gae_loop(r, v, d, GAMMA, LAM)
    assert adv.shape == ret.shape == (T, B) and adv.dtype == jnp.float32
    np.testing.assert_allclose(adv, ref_adv, **TOL)
    np.testing.assert_allclose(ret, ref_ret, **TOL)


def test_gae_trailing_batch_shape_and_vmap():
    r, v, d = make(1, batch=(2, 3))
    ref = gae_loop(r, v, d, GAMMA, LAM)
    out = gae(r, v, d, gamma=GAMMA, lam=LAM)
    np.testing.assert_allclose(out[0], ref[0], **TOL)
    # vmap over a leading source axis: sources [S, T, ...]
    rs, vs, ds = (np.moveaxis(x, 1, 0) for x in (r, v, d))  # [2, T(+1), 3]
    f = jax.vmap(lambda r, v, d: gae(r, v, d, gamma=GAMMA, lam=LAM))
    adv_s, ret_s = f(rs, vs, ds)
    np.testing.assert_allclose(np.moveaxis(np.asarray(adv_s), 0, 1), ref[0], **TOL)
    np.testing.assert_allclose(np.moveaxis(np.asarray(ret_s), 0, 1), ref[1], **TOL)


def test_gae_lambda_one_is_discounted_returns_minus_values(data):
    r, v, d = data
    adv, ret = gae(r, v, d, gamma=GAMMA, lam=1.0)
    # lam = 1: R_t is the discounted return, bootstrapped by v_T unless d_T, cut at dones.
    g = returns_loop(r, d, GAMMA, bootstrap=v[-1])
    np.testing.assert_allclose(ret, g, **TOL)
    np.testing.assert_allclose(adv, g - v[:-1], **TOL)
    # ... and the critic-free kernel gives the same with the bootstrap folded into r_{T-1}
    r_boot = r.copy()
    r_boot[-1] += GAMMA * v[-1] * ~d[-1]
    np.testing.assert_allclose(discounted_returns(r_boot, d, gamma=GAMMA), g, **TOL)


def test_gae_lambda_zero_is_one_step_td(data):
    r, v, d = data
    adv, _ = gae(r, v, d, gamma=GAMMA, lam=0.0)
    np.testing.assert_allclose(adv, r + GAMMA * v[1:] * ~d[1:] - v[:-1], **TOL)


@pytest.mark.parametrize("method", METHODS)
def test_truncation_worked_example(method):
    """Three steps, gamma 0.9, lam 0.8; the episode is cut by a time limit after step 1.

    Terminal inference gives V(final obs) = 3.0, added to step 1's reward as
    gamma * 3.0; the done at d_2 stops bootstrap and trace, step 2 starts a new episode:

      r' = [1.0, 0.5 + 0.9 * 3.0, 2.0] = [1.0, 3.2, 2.0],  V = [1.0, 2.0, 0.5, 1.5]
      t=2: delta = 2.0 + 0.9 * 1.5 - 0.5 = 2.85;          A = 2.85
      t=1: delta = 3.2 + 0 - 2.0 = 1.2;                    A = 1.2 (trace cut)
      t=0: delta = 1.0 + 0.9 * 2.0 - 1.0 = 1.8;            A = 1.8 + 0.72 * 1.2 = 2.664
    """
    r = np.array([1.0, 0.5 + 0.9 * 3.0, 2.0], np.float32)
    v = np.array([1.0, 2.0, 0.5, 1.5], np.float32)
    d = np.array([False, False, True, False])
    adv, ret = gae(r, v, d, gamma=0.9, lam=0.8, method=method)
    np.testing.assert_allclose(adv, [2.664, 1.2, 2.85], rtol=1e-6)
    np.testing.assert_allclose(ret, [3.664, 3.2, 3.35], rtol=1e-6)
    # The same episode in the terminated/truncated form: bootstrap from V(final obs) = 3.0.
    adv2, ret2 = gae_from_next_values(
        np.array([1.0, 0.5, 2.0], np.float32),
        v[:-1],
        np.array([2.0, 3.0, 1.5], np.float32),
        np.array([False, False, False]),
        np.array([False, True, False]),
        gamma=0.9,
        lam=0.8,
        method=method,
    )
    np.testing.assert_allclose(adv2, adv, rtol=1e-6)
    np.testing.assert_allclose(ret2, ret, rtol=1e-6)
    # Terminated instead: no bootstrap. delta_1 = 0.5 - 2.0, A_0 = 1.8 + 0.72 * -1.5 = 0.72.
    adv3, _ = gae(np.array([1.0, 0.5, 2.0], np.float32), v, d, gamma=0.9, lam=0.8, method=method)
    np.testing.assert_allclose(adv3, [0.72, -1.5, 2.85], rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_garbage_after_a_done_does_not_leak_back(data, method):
    r, v, d = (x.copy() for x in data)
    d[:, 0] = False
    d[4, 0] = True  # env 0 ends after action 3; rows after are padding
    r[4:, 0] = np.nan
    v[4:, 0] = np.nan
    adv, ret = gae(r, v, d, gamma=GAMMA, lam=LAM, method=method)
    clean_r, clean_v = r.copy(), v.copy()
    clean_r[4:, 0] = 0.0
    clean_v[4:, 0] = 0.0
    ref = gae_loop(clean_r, clean_v, d, GAMMA, LAM)
    np.testing.assert_allclose(adv[:4], ref[0][:4], **TOL)
    np.testing.assert_allclose(ret[:4], ref[1][:4], **TOL)
    np.testing.assert_allclose(adv[:, 1:], ref[0][:, 1:], **TOL)


def test_edge_lengths_and_dtypes():
    for n in (0, 1):
        r, v, d = make(2, T=n)
        for method in METHODS:
            adv, ret = gae(r, v, d, gamma=GAMMA, lam=LAM, method=method)
            ref = gae_loop(r, v, d, GAMMA, LAM)
            assert adv.shape == (n, B)
            np.testing.assert_allclose(ret, ref[1], **TOL)
    r, v, d = make(3, T=4)
    adv, ret = gae(r.astype(np.float16), v.astype(np.float16), d, gamma=GAMMA, lam=LAM)
    assert adv.dtype == ret.dtype == jnp.float32  # low precision is computed in float32


def test_jit_does_not_retrace(data):
    r, v, d = data

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(r, v, d, gamma):
        return gae(r, v, d, gamma=gamma, lam=LAM)

    out1 = f(r, v, d, jnp.float32(0.9))
    out2 = f(r + 1.0, v, ~d, jnp.float32(0.5))  # new data and a new (traced) gamma
    jax.block_until_ready((out1, out2))
    np.testing.assert_allclose(out2[0], gae_loop(r + 1.0, v, ~d, 0.5, LAM)[0], **TOL)


@pytest.mark.parametrize(
    "backend, T, width, expected",
    [
        ("cpu", 2048, 1, "scan"),
        ("cpu", 64, 7, "scan"),
        ("cpu", 64, 8, "inplace"),
        ("cpu", 2048, 64, "inplace"),
        ("cpu", 512, 16384, "inplace"),
        ("gpu", 64, 1, "associative"),
        ("gpu", 2048, 65536, "associative"),
        ("tpu", 64, 256, "associative"),
    ],
)
def test_auto_resolution_rule(backend, T, width, expected):
    assert adv_lib.resolve_method("auto", T, width, backend=backend) == expected
    for method in adv_lib.METHODS:  # an explicit method is never overridden
        assert adv_lib.resolve_method(method, T, width, backend=backend) == method


def test_auto_resolution_default_backend_and_trace():
    assert jax.default_backend() == "cpu"
    assert adv_lib.resolve_method("auto", 100, 64) == "inplace"
    assert adv_lib.resolve_method("auto", 100, 1) == "scan"
    with pytest.raises(ValueError, match="method"):
        adv_lib.resolve_method("fast", 100, 1)

    def sweep_length(batch):  # the loop ``gae`` traces to under auto, by batch shape
        r, v, d = (jnp.zeros((n,) + batch, dt) for n, dt in ((8, float), (9, float), (9, bool)))
        jaxpr = jax.make_jaxpr(lambda r, v, d: gae(r, v, d, gamma=0.9, lam=0.9))(r, v, d)
        (loop,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        return loop.params["length"]

    # "scan" sweeps all T = 8 rows; "inplace" (a fori_loop, itself a scan) the T - 1 updates.
    assert sweep_length((7,)) == 8
    assert sweep_length((2, 4)) == 7  # width 8


# ----------------------------------------------------------------------------- other forms


@pytest.mark.parametrize("method", METHODS)
def test_discounted_returns_matches_loop(data, method):
    r, _, d = data
    out = jax.jit(lambda r, d: discounted_returns(r, d, gamma=GAMMA, method=method))(r, d)
    np.testing.assert_allclose(out, returns_loop(r, d, GAMMA), **TOL)


@pytest.mark.parametrize("method", METHODS)
def test_torchrl_form_matches_loop_and_gae(data, method):
    r, v, d = data
    rng = np.random.default_rng(7)
    nv = rng.standard_normal(r.shape).astype(np.float32)
    term = d[1:] & (rng.random(r.shape) < 0.5)  # some dones are truncations
    f = jax.jit(
        lambda *a: gae_from_next_values(*a, gamma=GAMMA, lam=LAM, method=method),
    )
    adv, ret = f(r, v[:-1], nv, term, d[1:])
    ref = torchrl_loop(r, v[:-1], nv, term, d[1:], GAMMA, LAM)
    np.testing.assert_allclose(adv, ref[0], **TOL)
    np.testing.assert_allclose(ret, ref[1], **TOL)
    # terminated == done and next values = values shifted: exactly ``gae``
    adv2, ret2 = f(r, v[:-1], v[1:], d[1:], d[1:])
    g_adv, g_ret = gae(r, v, d, gamma=GAMMA, lam=LAM, method=method)
    np.testing.assert_allclose(adv2, g_adv, **TOL)
    np.testing.assert_allclose(ret2, g_ret, **TOL)


def test_action_level_sum_and_flatten():
    Tc, K = 3, 4
    rng = np.random.default_rng(4)
    r = rng.standard_normal((Tc, B, K)).astype(np.float32)
    v = rng.standard_normal((Tc + 1, B)).astype(np.float32)
    d = rng.random((Tc + 1, B, K)) < 0.2

    np.testing.assert_allclose(chunk_rewards(r, "sum"), r.sum(-1), rtol=1e-6)
    flat = np.asarray(chunk_rewards(r, "flatten"))
    assert flat.shape == (Tc * K, B)
    np.testing.assert_array_equal(unflatten_action_level(flat, K), r)

    rf, vf, df = (np.asarray(x) for x in flatten_action_level(r, v, d))
    assert rf.shape == (Tc * K, B) and vf.shape == df.shape == (Tc * K + 1, B)
    for t in range(Tc):
        for k in range(K):
            s = t * K + k
            np.testing.assert_array_equal(rf[s], r[t, :, k])
            np.testing.assert_array_equal(vf[s], v[t])  # chunk value repeated per action
            np.testing.assert_array_equal(df[s + 1], d[t + 1, :, k])
    np.testing.assert_array_equal(vf[-1], v[-1])
    np.testing.assert_array_equal(df[0], d[0, :, -1])
    adv, _ = gae(rf, vf, df, gamma=GAMMA, lam=LAM)
    np.testing.assert_allclose(adv, gae_loop(rf, vf, df, GAMMA, LAM)[0], **TOL)

    # chunk-level dones: the done lands on the chunk's last action
    dc = d.any(-1)
    _, _, dcf = (np.asarray(x) for x in flatten_action_level(r, v, dc))
    expect = np.zeros((Tc * K + 1, B), bool)
    expect[0] = dc[0]
    expect[K::K] = dc[1:]
    np.testing.assert_array_equal(dcf, expect)


# ----------------------------------------------------------------------------- normalisation


def test_masked_normalisation(data):
    r, _, _ = data
    rng = np.random.default_rng(5)
    mask = rng.random(r.shape) < 0.6
    adv = np.where(mask, r * 3.0 + 2.0, np.nan).astype(np.float32)  # padding is garbage
    out = np.asarray(normalize_advantages(adv, mask))
    valid = out[mask]
    np.testing.assert_allclose(valid.mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(valid.std(), 1.0, atol=1e-5)
    np.testing.assert_array_equal(out[~mask], 0.0)
    x = adv[mask]
    np.testing.assert_allclose(valid, (x - x.mean()) / (x.std() + 1e-8), rtol=1e-5, atol=1e-6)
    # a mask broadcast over trailing axes, and an empty mask
    col = normalize_advantages(adv[:, :1].repeat(3, 1), mask[:, :1])
    assert col.shape == (T, 3)
    np.testing.assert_array_equal(normalize_advantages(adv, np.zeros_like(mask)), 0.0)


def test_normalisation_is_global_over_a_named_axis(data):
    r, _, _ = data
    rng = np.random.default_rng(6)
    mask = rng.random(r.shape) < 0.7
    shards = r.reshape(3, 4, B), mask.reshape(3, 4, B)  # 3 "devices"
    f = jax.vmap(lambda a, m: normalize_advantages(a, m, axis_name="dev"), axis_name="dev")
    out = np.asarray(f(*shards)).reshape(T, B)
    np.testing.assert_allclose(out, normalize_advantages(r, mask), rtol=1e-5, atol=1e-6)
    assert not np.allclose(out, np.asarray(jax.vmap(normalize_advantages)(*shards)).reshape(T, B))


def test_group_advantages():
    scores = np.array([1.0, 2.0, 6.0, 5.0, 5.0, 5.0], np.float32)
    out = np.asarray(group_advantages(scores, 3))
    g = scores.reshape(2, 3)
    ref = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(out, ref.reshape(-1), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[3:], 0.0)  # a group with equal scores
    pop = np.asarray(group_advantages(scores, 2, ddof=0))
    np.testing.assert_allclose(pop, [-1.0, 1.0, 1.0, -1.0, 0.0, 0.0], atol=1e-5)


# ----------------------------------------------------------------------------- bad input

R, V, D = make(8, T=4, batch=(3,))
BAD = [
    (
        "values_length",
        lambda: gae(R, V[:-1], D, gamma=0.9, lam=0.9),
        r"`values`.*\(5, 3\).*\(4, 3\)",
    ),
    ("dones_length", lambda: gae(R, V, D[:-1], gamma=0.9, lam=0.9), r"`dones`.*\(5, 3\).*\(4, 3\)"),
    ("dones_dtype", lambda: gae(R, V, D.astype(np.float32), gamma=0.9, lam=0.9), "`dones`.*bool"),
    ("batch_shape", lambda: gae(R, V[:, :2], D, gamma=0.9, lam=0.9), r"`values`.*\(5, 2\)"),
    ("scalar_rewards", lambda: gae(np.float32(1.0), V, D, gamma=0.9, lam=0.9), "`rewards`"),
    ("gamma_range", lambda: gae(R, V, D, gamma=1.5, lam=0.9), "`gamma`.*1.5"),
    ("lam_shape", lambda: gae(R, V, D, gamma=0.9, lam=jnp.ones(3)), r"`lam`.*\(3,\)"),
    ("method", lambda: gae(R, V, D, gamma=0.9, lam=0.9, method="fast"), "`method`.*'fast'"),
    (
        "next_values",
        lambda: gae_from_next_values(R, V[:-1], V, D[1:], D[1:], gamma=0.9, lam=0.9),
        r"`next_values`.*\(4, 3\).*\(5, 3\)",
    ),
    (
        "terminated_dtype",
        lambda: gae_from_next_values(R, V[:-1], V[1:], R, D[1:], gamma=0.9, lam=0.9),
        "`terminated`.*bool",
    ),
    ("returns_dones", lambda: discounted_returns(R, D[1:], gamma=0.9), r"`dones`.*\(4, 3\)"),
    ("chunk_mode", lambda: chunk_rewards(np.ones((2, 3, 4)), "mean"), "`mode`.*'mean'"),
    ("chunk_rank", lambda: chunk_rewards(np.ones(3), "sum"), r"`rewards_tk`.*\(3,\)"),
    (
        "flatten_values",
        lambda: flatten_action_level(np.ones((2, 3, 4)), np.ones((2, 3)), np.ones((3, 3, 4), bool)),
        r"`values`.*\(3, 3\).*\(2, 3\)",
    ),
    (
        "flatten_dones",
        lambda: flatten_action_level(np.ones((2, 3, 4)), np.ones((3, 3)), np.ones((3, 3, 2), bool)),
        r"`dones`.*\(3, 3, 2\)",
    ),
    ("unflatten", lambda: unflatten_action_level(np.ones((7, 2)), 2), r"`x`.*\(7, 2\)"),
    (
        "mask",
        lambda: normalize_advantages(np.ones((4, 3)), np.ones((4, 2), bool)),
        r"`mask`.*\(4, 2\)",
    ),
    ("group_divides", lambda: group_advantages(np.ones(6), 4), r"`group_size` 4.*\(6,\)"),
    ("group_positive", lambda: group_advantages(np.ones(6), 0), "`group_size`.*0"),
    ("group_ddof", lambda: group_advantages(np.ones(6), 1), "`group_size` 1.*`ddof` 1"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_value_error(case):
    _, call, match = case
    with pytest.raises(ValueError, match=match):
        call()


def test_bad_input_raises_under_jit_too():
    with pytest.raises(ValueError, match="`values`"):
        jax.jit(lambda r, v, d: gae(r, v, d, gamma=0.9, lam=0.9))(R, V[:-1], D)
