"""Chunk returns against a plain per-action loop written here (not the library's kernels).

Random episode ends at any action of any chunk, several in one environment's step,
terminations and truncations (with ``V(final obs)`` in any chunk), ``K`` in {1, 2, 3, 4},
both reward forms (``action_gamma = g`` with ``gamma = g**K``, and the sum), chunks that
continue in the next episode after an end and chunks an environment cut at the end
(``valid_actions``). Checked through the facade (rollout mode), the pure functions under
``jit`` and pipeline mode; episode statistics against a loop too.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jaxtraj
from jaxtraj import EnvPart, EnvTransition, PolicyPart, TrajectoryPlan

E, T, B = 2, 4, 3
G = 0.8  # the per-action discount


def make_run(K: int, cut: bool, seed: int):
    """Random per-action events of one source's training step, as an environment of
    either kind reports them. Returns the halves and the raw per-action arrays."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(E, T, B, K)).astype(np.float32)
    ends = rng.random((E, T, B, K)) < 0.3  # an episode ends at this action
    trunc = ends & (rng.random((E, T, B, K)) < 0.5)
    term = ends & ~trunc
    valid = np.ones((E, T, B, K), bool)
    if cut:  # nothing runs after the first end of a chunk
        first = np.cumsum(ends, axis=-1) - ends > 0
        valid = ~first
        for x in (rewards, term, trunc):
            x[~valid] = 0
    values = rng.normal(size=(E, T, B)).astype(np.float32)  # V(s_t) at chunk starts
    final = rng.normal(size=(E, T, B)).astype(np.float32)  # V(final obs) per chunk
    boot = rng.normal(size=(E, B)).astype(np.float32)  # V(s_T) after an epoch
    # The last chunk's final_values is V(s_T) where it did not end (its next state).
    last_ended = (term | trunc)[:, -1].any(-1)
    final[:, -1] = np.where(last_ended, final[:, -1], boot)
    no = np.zeros((B, K), bool)
    policies, envs = [], []
    for e in range(E):
        for t in range(T):
            obs = np.stack([np.full(B, e), np.full(B, t), np.arange(B)], -1).astype(np.float32)
            policies.append(PolicyPart.at(
                chunk_id=t, epoch_id=e, obs=obs, actions=np.zeros((B, K, 1), np.float32),
                prev_values=values[e, t],
            ))
            envs.append(EnvPart.at(
                chunk_id=t, epoch_id=e, rewards=rewards[e, t], terminations=term[e, t],
                truncations=trunc[e, t], valid_actions=valid[e, t] if cut else None,
                initial_transition=EnvTransition(terminations=no, truncations=no)
                if t == 0 else None,
                final_values=final[e, t],
            ))
    raw = dict(rewards=rewards, term=term, trunc=trunc, valid=valid, values=values,
               final=final, boot=boot)
    return policies, envs, raw


def reference_returns(raw, K, sum_form):
    """Per chunk start, the decision's return by walking its actions one at a time.

    The decision at chunk t owns the actions from (t, 0) until its episode ends; each
    executed action n steps later is weighted ``g**n`` (the sum form: ``gamma**c`` for an
    action of the c-th chunk after t); a truncation bootstraps ``V(final obs)`` one action
    later, a termination stops, and the epoch's end bootstraps ``V(s_T)``."""
    gamma = G**K
    out = np.zeros((E, T, B))
    for e in range(E):
        for b in range(B):
            for t in range(T):
                total, stop = 0.0, False
                for c in range(t, T):
                    for j in range(K):
                        if not raw["valid"][e, c, b, j]:
                            continue
                        n = (c - t) * K + j
                        w = gamma ** (c - t) if sum_form else G**n
                        total += w * raw["rewards"][e, c, b, j]
                        if raw["term"][e, c, b, j]:
                            stop = True
                        elif raw["trunc"][e, c, b, j]:
                            wv = gamma ** (c - t + 1) if sum_form else G ** (n + 1)
                            total += wv * raw["final"][e, c, b]
                            stop = True
                        if stop:
                            break
                    if stop:
                        break
                if not stop:
                    total += gamma ** (T - t) * raw["boot"][e, b]
                out[e, t, b] = total
    return out


def reference_chunk_rewards(raw, K, sum_form):
    """Each chunk's own reward by the same walk over its actions alone (the chunk's part
    of its decision's return), and whether an episode ended in it."""
    gamma = G**K
    r = np.zeros((E, T, B))
    done = np.zeros((E, T, B), bool)
    for e, t, b in np.ndindex(E, T, B):
        for j in range(K):
            if not raw["valid"][e, t, b, j]:
                continue
            r[e, t, b] += (1.0 if sum_form else G**j) * raw["rewards"][e, t, b, j]
            if raw["term"][e, t, b, j] or raw["trunc"][e, t, b, j]:
                done[e, t, b] = True
                if raw["trunc"][e, t, b, j]:
                    r[e, t, b] += (gamma if sum_form else G ** (j + 1)) * raw["final"][e, t, b]
                break
    return r, done


def reference_gae(raw, K, sum_form, lam):
    """GAE over chunks (a plain loop) on the reference chunk rewards: what item 1 of the
    chunk-end rule defines for ``lambda < 1``."""
    gamma = G**K
    r, done = reference_chunk_rewards(raw, K, sum_form)
    adv = np.zeros((E, T, B))
    for e, b in np.ndindex(E, B):
        a = 0.0
        for t in reversed(range(T)):
            v_next = raw["boot"][e, b] if t == T - 1 else raw["values"][e, t + 1, b]
            live = 0.0 if done[e, t, b] else 1.0
            delta = r[e, t, b] + gamma * v_next * live - raw["values"][e, t, b]
            a = delta + gamma * lam * live * a
            adv[e, t, b] = a
    return adv


def reference_episodes(raw, K):
    """Every episode that ended, by a loop over the actions that ran, with sums carried
    from ``carried`` (per env) and the sums still running after the step."""
    out = []
    run_r = np.zeros(B)
    run_n = np.zeros(B, int)
    for b in range(B):
        for e, t, j in np.ndindex(E, T, K):
            if not raw["valid"][e, t, b, j]:
                continue
            run_r[b] += raw["rewards"][e, t, b, j]
            run_n[b] += 1
            if raw["term"][e, t, b, j] or raw["trunc"][e, t, b, j]:
                out.append((b, e, t, j, run_r[b], run_n[b], bool(raw["term"][e, t, b, j])))
                run_r[b], run_n[b] = 0.0, 0
    return out, run_r, run_n


def plan_for(K, sum_form, lam=1.0, **kw):
    return TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B, gamma=G**K,
                          action_gamma=1.0 if sum_form else G, gae_lambda=lam, **kw)


CASES = [(K, s, cut) for K in (1, 2, 3, 4) for s in (False, True) for cut in (False, True)]


@pytest.mark.parametrize("K,sum_form,cut", CASES)
def test_facade_returns_equal_the_per_action_loop(K, sum_form, cut):
    seed = 100 * K + 10 * sum_form + cut
    policies, envs, raw = make_run(K, cut, seed)
    plan = plan_for(K, sum_form)
    c = jaxtraj.TrajectoryCollector(plan, policies[0], envs[0])
    out = []
    for p, v in zip(policies, envs):
        out += c.add(p) + c.add(v)
    (_, traj), = out
    targets = jaxtraj.trajectory_targets(plan, traj)
    np.testing.assert_allclose(targets.returns, reference_returns(raw, K, sum_form),
                               rtol=1e-5, atol=1e-5)
    # The per-action mask: the actions each decision owns and that ran.
    first_end = np.cumsum(raw["term"] | raw["trunc"], -1) - (raw["term"] | raw["trunc"]) > 0
    owned = raw["valid"] & ~first_end
    if K > 1:
        np.testing.assert_array_equal(targets.action_mask, owned)
    # The environment's rewards, as given, are in the trajectory (no bootstrap).
    np.testing.assert_array_equal(np.asarray(traj.rewards).reshape(raw["rewards"].shape),
                                  raw["rewards"])
    # Episode statistics: every episode that ended, from the rewards that ran.
    want, _, _ = reference_episodes(raw, K)
    got = traj.episodes.to_list()
    assert len(got) == len(want)
    for g, (b, e, t, j, ret, n, terminated) in zip(got, sorted(want)):
        assert (g["row"], g["epoch"], g["chunk"], g["action"]) == (b, e, t, j if K > 1 else 0)
        assert g["length"] == n and g["terminated"] == terminated
        np.testing.assert_allclose(g["return"], ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K,sum_form", [(2, False), (3, True), (4, False)])
def test_gae_with_lambda_below_one_is_gae_over_the_chunk_rewards(K, sum_form):
    policies, envs, raw = make_run(K, True, 7 + K)
    plan = plan_for(K, sum_form, lam=0.7)
    c = jaxtraj.TrajectoryCollector(plan, policies[0], envs[0])
    (_, traj), = c.add_many(policies + envs)
    targets = jaxtraj.trajectory_targets(plan, traj)
    np.testing.assert_allclose(targets.advantages, reference_gae(raw, K, sum_form, 0.7),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K,sum_form,cut", [(2, False, True), (3, True, False)])
def test_pure_functions_under_jit_give_the_loops_returns(K, sum_form, cut):
    policies, envs, raw = make_run(K, cut, 55 + K)
    plan = plan_for(K, sum_form, lam=0.9)
    state = jaxtraj.init(plan, policies[0], envs[0])
    stack = lambda ps: jax.tree.map(lambda *xs: np.stack(xs), *ps)

    @functools.partial(jax.jit, static_argnums=0)
    def run(plan, state, ps, vs):
        state = jaxtraj.add_policies(plan, state, ps)
        state = jaxtraj.add_envs(plan, state, vs)
        traj, state = jaxtraj.rollout.flush(plan, state)
        return jaxtraj.trajectory_targets(plan, traj), traj.episodes, state

    chunk0 = [v for v in envs if v.initial_transition is not None]
    rest = [v for v in envs if v.initial_transition is None]
    state = jaxtraj.add_envs(plan, state, stack(chunk0))  # two structures: two stacks
    targets, episodes, state = run(plan, state, stack(policies), stack(rest))
    jaxtraj.raise_if_error(state)
    adv = reference_gae(raw, K, sum_form, 0.9)
    np.testing.assert_allclose(targets.advantages, adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(targets.returns, adv + raw["values"], rtol=1e-5, atol=1e-5)
    want, run_r, run_n = reference_episodes(raw, K)
    assert int(episodes.count()) == len(want)
    # The running sums left in the state continue into the next step.
    np.testing.assert_allclose(state.episodes.returns, run_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state.episodes.lengths, run_n)


def test_pipeline_micro_batches_carry_the_loops_returns_and_the_action_mask():
    K, sum_form = 3, False
    policies, envs, raw = make_run(K, True, 3)
    plan = plan_for(K, sum_form, mode="pipeline", normalize_advantages=False, actor_ranks=2)
    c = jaxtraj.TrajectoryCollector(plan, policies[0], envs[0])
    batches = [b for _, b in c.add_many(policies + envs)]
    want = reference_returns(raw, K, sum_form)
    first_end = np.cumsum(raw["term"] | raw["trunc"], -1) - (raw["term"] | raw["trunc"]) > 0
    owned = raw["valid"] & ~first_end
    seen = 0
    for mb in batches:
        obs = np.asarray(mb.obs).reshape(-1, 3)
        mask = np.asarray(mb.loss_mask).reshape(-1)
        ret = np.asarray(mb.returns).reshape(-1)
        am = np.asarray(mb.action_mask).reshape(-1, K)
        for (e, t, b), m, r, a in zip(obs.astype(int), mask, ret, am):
            if not m:
                assert not a.any()  # padding carries no valid action
                continue
            seen += 1
            np.testing.assert_allclose(r, want[e, t, b], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(a, owned[e, t, b])
    assert seen == E * T * B
    # Each epoch's flush reports the episodes that ended in that epoch.
    episodes, _, _ = reference_episodes(raw, K)
    counts = {int(mb.epoch_id): int(np.asarray(mb.episodes.ended).sum()) for mb in batches}
    assert counts == {e: sum(1 for x in episodes if x[1] == e) for e in range(E)}


def test_the_docs_example_numbers():
    """K = 2, g = 0.5, rewards 1 and 2, V(final obs) = 10: a time limit at action 1 gives
    1 + 0.5 * 2 + 0.25 * 10 = 4.5; at action 0, 1 + 0.5 * 10 = 6.0 (action 1 ran in the
    next episode and is not this decision's)."""
    K, g = 2, 0.5
    plan = TrajectoryPlan(num_chunks=1, gamma=g**K, action_gamma=g, gae_lambda=1.0)
    no = np.zeros((1, K), bool)
    for trunc, want in (([[False, True]], 4.5), ([[True, False]], 6.0)):
        p = PolicyPart.at(chunk_id=0, obs=np.zeros((1, 1), np.float32),
                          actions=np.zeros((1, K, 1), np.float32),
                          prev_values=np.zeros((1,), np.float32))
        v = EnvPart.at(chunk_id=0, rewards=np.array([[1.0, 2.0]], np.float32), terminations=no,
                       truncations=np.array(trunc),
                       initial_transition=EnvTransition(terminations=no, truncations=no),
                       final_values=np.array([10.0], np.float32))
        c = jaxtraj.TrajectoryCollector(plan, p, v)
        c.add(p)
        (_, traj), = c.add(v)
        np.testing.assert_allclose(jaxtraj.trajectory_targets(plan, traj).returns[0, 0], [want])
