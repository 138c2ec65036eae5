"""Host simulators as runner environments: adapters to the
:class:`~jaxtraj.runners.service.Env` protocol.

- :class:`GymnasiumEnv`: a gymnasium (>= 1.1) ``VectorEnv`` (``SyncVectorEnv``,
  ``AsyncVectorEnv``), any autoreset mode (the ``gymnasium`` extra);
- :class:`EnvPoolEnv`: an EnvPool pool, host API (the ``envpool`` extra);
- :class:`EnvPoolXla`: an EnvPool pool stepped through its XLA interface inside the
  synchronous runner's jitted ``lax.scan`` (:mod:`jaxtraj.runners.sync`; needs
  ``jax_enable_x64``).

The host adapters execute an action chunk ``[B, K, A]`` as up to ``K`` steps, cast at
the boundary, and describe themselves with :meth:`~GymnasiumEnv.spec` (an
:class:`EnvSpec`), from which :func:`example_parts` builds the collector's example
halves. :meth:`~GymnasiumEnv.check_against` checks an adapter against the collector's
examples.

What follows an episode end inside a chunk is each adapter's ``chunk_end``:

- ``"cut"``: the environment executes nothing more in the chunk (its later slots are
  padding: ``EnvTransition.valid_actions`` false, reward 0, flags false) and is reset
  at the chunk's end, so the next chunk's policy sees the reset observation. The
  default of :class:`GymnasiumEnv` over a ``SyncVectorEnv``, of :class:`EnvPoolEnv`
  (EnvPool's partial steps) and of the synchronous runner over gymnax environments.
- ``"continue"``: the environment is reset and the chunk's remaining actions run in the
  new episode. The default (and only mode) of :class:`GymnasiumEnv` over an
  ``AsyncVectorEnv`` or a wrapped vector env; the only mode of :class:`EnvPoolXla`,
  where the step after a done is EnvPool's reset step (its action is not executed):
  ``valid_actions`` is false there.

Either way a chunk's decision owns its actions up to and including its first episode
end (``EnvTransition.owned_actions``), and ``final_obs`` is the observation that end left.

A collector for an adapter, without running anything::

    vec = gymnasium.make_vec("Hopper-v5", num_envs=8, vectorization_mode="sync")
    env = jaxtraj.envs.GymnasiumEnv(vec, actions_per_chunk=4, seed=0)
    out = jax.eval_shape(policy_fn, params, env.spec().obs, jax.random.PRNGKey(0))
    collector = jaxtraj.TrajectoryCollector(plan, *jaxtraj.envs.example_parts(env, plan, out))
    env.check_against(collector)  # observation / action / reward shapes and dtypes

Importing this package needs neither gymnasium nor EnvPool: each adapter imports its
library when constructed, and says which extra to install when it is missing.
"""

from jaxtraj.envs.base import EnvSpec, check_spec, example_parts
from jaxtraj.envs.envpool import EnvPoolEnv
from jaxtraj.envs.envpool_xla import EnvPoolXla
from jaxtraj.envs.gymnasium import GymnasiumEnv

__all__ = ["EnvPoolEnv", "EnvPoolXla", "EnvSpec", "GymnasiumEnv", "check_spec", "example_parts"]
