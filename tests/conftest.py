"""Strict numerics for every test: no implicit rank promotion, warnings are errors."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
