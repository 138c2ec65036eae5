"""PLACEHOLDER (minimal reverse-scan kernels) until the advantage-kernel work lands."""

import jax
import jax.numpy as jnp


def gae(rewards, values, dones, *, gamma, lam, method="auto"):
    not_done = 1.0 - dones[1:].astype(rewards.dtype)
    delta = rewards + gamma * values[1:] * not_done - values[:-1]

    def body(a, x):
        d, nd = x
        a = d + gamma * lam * nd * a
        return a, a

    _, adv = jax.lax.scan(body, jnp.zeros_like(delta[0]), (delta, not_done), reverse=True)
    return adv, adv + values[:-1]


def discounted_returns(rewards, dones, *, gamma):
    not_done = 1.0 - dones[1:].astype(rewards.dtype)

    def body(g, x):
        r, nd = x
        g = r + gamma * nd * g
        return g, g

    return jax.lax.scan(body, jnp.zeros_like(rewards[0]), (rewards, not_done), reverse=True)[1]


def normalize_advantages(adv, mask, *, eps=1e-8, axis_name=None):
    m = mask.astype(adv.dtype)
    n = m.sum()
    mean = (adv * m).sum() / n
    var = (((adv - mean) * m) ** 2).sum() / n
    return (adv - mean) / (jnp.sqrt(var) + eps)
