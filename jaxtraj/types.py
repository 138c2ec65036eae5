"""The chunk data contract: immutable pytrees for keys, the two halves, steps and trajectories.

One action chunk is produced in two halves. :class:`PolicyPart` comes from policy
inference; :class:`EnvPart` from the environment. Both carry the same
:class:`TrajectoryKey` inside a :class:`TrajectorySource`. Field-specific behaviour
lives here, on the types (``EnvTransition.compute_rewards``,
``TrajectoryStep.from_parts``, ``TrajectoryStep.apply_interventions``,
``Trajectory.from_steps``), never in the joiner or the accumulator.

Shapes (per part): ``B`` rows of the source batch (a fragment holds fewer), ``K``
actions per chunk, ``A`` action dimensions. Every array leaf of a part's payload
(everything but ``source``) has the rows as its leading axis. The step and
trajectory functions are elementwise over any leading axes, so they apply to one
part or to a whole buffer ``[E, T, B, ...]`` alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan

Array = Any
PyTree = Any

RLT_KEYS = ("z_rl", "proprio", "ref_chunk")


def rlt_features(forward_inputs: Any, key: Any = None) -> dict:
    """RLT's compact state features of a policy's forward inputs: ``z_rl``, ``proprio``
    and ``ref_chunk``, nothing else. Raises ``CollectorError`` naming what is missing."""
    missing = [
        k for k in RLT_KEYS if not isinstance(forward_inputs, dict) or k not in forward_inputs
    ]
    if missing:
        raise CollectorError(
            key,
            ErrorCode.STRUCTURE_MISMATCH,
            f"enable_rlt needs PolicyOutput.forward_inputs to hold {list(RLT_KEYS)}; missing {missing}",
        )
    return {k: forward_inputs[k] for k in RLT_KEYS}


@struct.dataclass
class TrajectoryKey:
    """Identity of one action chunk: ``(step_id, epoch_id, env_rank, stage_id, chunk_id)``.

    Fields are integer scalars (Python ints on the host, ``int32`` arrays under
    ``jit``; a leading axis when parts are stacked for a batched insert).
    """

    step_id: Any
    epoch_id: Any
    env_rank: Any
    stage_id: Any
    chunk_id: Any

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        """The key as host ints (forces a sync if the fields are device arrays)."""
        fields = self.fields()
        if all(type(v) is int for v in fields):  # hot: a host's keys are Python ints
            return fields
        return tuple(int(np.asarray(v)) for v in fields)

    def fields(self) -> tuple:
        return (self.step_id, self.epoch_id, self.env_rank, self.stage_id, self.chunk_id)


@struct.dataclass
class TrajectorySource:
    """A key plus which rows of the logical source batch a fragment holds.

    Attributes:
      key: the chunk's :class:`TrajectoryKey`.
      batch_size: ``B``, rows of the whole logical source batch (a Python int on the
        host, an int32 array under ``jit`` or on a stacked part).
      offset: first source row this fragment holds; it holds
        ``[offset, offset + rows)`` where ``rows`` is its payload's leading size.
    """

    key: TrajectoryKey
    batch_size: int | Array
    offset: int | Array = 0


def rows_of(payload: PyTree) -> int:
    """Leading (row) size shared by every array leaf of a payload."""
    sizes = {np.shape(leaf)[0] for leaf in jax.tree.leaves(payload) if np.ndim(leaf) > 0}
    if len(sizes) != 1:
        raise ValueError(f"payload leaves disagree on their leading (row) size: {sorted(sizes)}")
    return sizes.pop()


_PER_ACTION = (
    "rewards", "terminations", "truncations", "dones", "reward_model_output", "success",
    "valid_actions",
)


def chunk_size(actions: Any, transition: Any, start: int = 1, key: Any = None) -> int:
    """``K``, actions per chunk, as the action chunk states it.

    ``actions`` per row is ``[K, A, ...]`` (``K`` is its first axis) or flat
    ``[K*A]``; then ``K`` comes from the action-level fields of ``transition``
    (rewards, flags ``[.., K]``, ``intervene_flags``), else it is 1. Every
    action-level field must agree with it.

    Args:
      actions: the actions leaf; per-row axes start at axis ``start``.
      transition: an :class:`EnvTransition` with the same leading axes, or ``None``.

    Raises:
      CollectorError: ``STRUCTURE_MISMATCH`` naming the field whose ``K`` differs.
    """
    shape = np.shape(actions)
    k = shape[start] if len(shape) >= start + 2 else None
    fields = [(n, getattr(transition, n, None)) for n in _PER_ACTION + ("intervene_flags",)]
    for name, x in fields:
        if x is None or (name != "intervene_flags" and len(np.shape(x)) <= start):
            continue
        k_x = np.shape(x)[start] if len(np.shape(x)) > start else 1
        if k is None:
            k = k_x
        elif k_x != k:
            raise CollectorError(
                key,
                ErrorCode.STRUCTURE_MISMATCH,
                f"EnvTransition.{name} has {k_x} actions per chunk, the action chunk "
                f"{tuple(shape[start:])} has {k}",
            )
    return 1 if k is None else int(k)


class _Fragmentable:
    """``split`` / ``merge`` for parts whose payload follows the batch dimension."""

    def split(self, sizes: Sequence[int]) -> list:
        """Split into fragments of ``sizes`` rows, in row order.

        Each fragment's ``source.offset`` is the original offset plus the rows
        before it; ``batch_size`` and the key are unchanged.
        """
        payload = self.replace(source=None)
        rows = rows_of(payload)
        if sum(sizes) != rows or any(s <= 0 for s in sizes):
            raise ValueError(f"split sizes {list(sizes)} must be positive and sum to {rows} rows")
        out, start = [], 0
        for size in sizes:
            piece = jax.tree.map(lambda x, a=start, b=start + size: x[a:b], payload)
            source = self.source.replace(offset=int(np.asarray(self.source.offset)) + start)
            out.append(piece.replace(source=source))
            start += size
        return out

    @classmethod
    def merge(cls, fragments: Sequence) -> Any:
        """Merge fragments of one key back into one part, whatever their order.

        Raises ``ValueError`` if the fragments belong to different keys, overlap, or
        leave a gap.
        """
        if not fragments:
            raise ValueError("cannot merge an empty list of fragments")
        keys = {f.source.key.as_tuple() for f in fragments}
        if len(keys) != 1:
            raise ValueError(f"fragments belong to different keys: {sorted(keys)}")
        ordered = sorted(fragments, key=lambda f: int(np.asarray(f.source.offset)))
        expect = int(np.asarray(ordered[0].source.offset))
        for f in ordered:
            off = int(np.asarray(f.source.offset))
            if off != expect:
                raise ValueError(
                    f"fragments are not contiguous: expected offset {expect}, got {off}"
                )
            expect = off + rows_of(f.replace(source=None))
        payloads = [f.replace(source=None) for f in ordered]
        merged = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *payloads)
        return merged.replace(source=ordered[0].source)


@struct.dataclass
class PolicyOutput:
    """What policy inference produced for one chunk.

    Attributes:
      actions: ``[B, K, A]`` (or ``[B, K*A]``) the sampled action chunk.
      prev_logprobs: behaviour-policy log-probabilities, usually shaped like ``actions``.
      prev_values: ``[B]`` (or ``[B, 1]``) value of the pre-action state ``V(s_t)``.
      versions: ``[B]`` (or per action) model version that produced the chunk.
      forward_inputs: dict of model inputs retained for the training forward pass,
        leaves ``[B, ...]``.
      bootstrap_values: optional ``[B]`` values the policy computed for a boundary
        observation alongside its actions; retained as given.
      intervene_flags: optional bool ``[B]`` or ``[B, K]``, model-side intervention
        flags: actions the policy side reports as intervened (a corrected action it
        applied itself, so ``actions`` already hold it). ``[B]`` flags every action of
        the row's chunk, ``[B, K]`` each action. They never replace actions (the
        environment's ``EnvTransition.intervene_actions`` do);
        :meth:`TrajectoryStep.from_parts` ors them, expanded to the action elements,
        into the step's ``intervene_flags``.
    """

    actions: Array
    prev_logprobs: Array | None = None
    prev_values: Array | None = None
    versions: Array | None = None
    forward_inputs: PyTree | None = None
    bootstrap_values: Array | None = None
    intervene_flags: Array | None = None  # last: positional construction keeps working


@struct.dataclass
class PolicyPart(_Fragmentable):
    """The policy half of a chunk: source, pre-action observation, ``PolicyOutput``.

    ``PolicyPart.at(chunk_id=t, obs=obs, actions=a, prev_values=v, ...)`` builds one
    without spelling out the key, source and output.
    """

    source: TrajectorySource
    obs: PyTree
    output: PolicyOutput

    def missing_outputs(self, layout: PolicyOutput) -> list[str]:
        """The ``PolicyOutput`` fields the buffers ``layout`` hold that this half lacks:
        a half that was not inferred (a human's or a scripted expert's actions) has no
        log-probabilities, values or versions.

        Model-side ``intervene_flags`` count only in such a half (an expert's gets
        ``False`` from :meth:`as_expert`): an inferred half that lacks only them is not
        an expert's, and the structure check names the missing field."""
        out = self.output
        missing = [
            f.name
            for f in dataclasses.fields(out)
            if getattr(out, f.name) is None and getattr(layout, f.name) is not None
        ]
        return [] if missing == ["intervene_flags"] else missing

    def as_expert(
        self, layout: PolicyOutput, lead: int, xp: Any = np, stacked: bool = False
    ) -> PolicyPart:
        """This half with the output fields it lacks (:meth:`missing_outputs`) filled with
        zeros shaped like ``layout``'s rows (``lead`` leading buffer axes before them;
        ``False`` for model-side ``intervene_flags``): how lerobot mode stores an expert's
        half. ``xp``: numpy or ``jax.numpy``;
        ``stacked``: a stack of halves (a leading axis on every leaf)."""
        rows = tuple(np.shape(self.output.actions)[: 2 if stacked else 1])
        zeros = lambda b: xp.zeros(rows + tuple(b.shape[lead + 1 :]), b.dtype)
        fill = {n: jax.tree.map(zeros, getattr(layout, n)) for n in self.missing_outputs(layout)}
        return self.replace(output=self.output.replace(**fill))

    @classmethod
    def at(
        cls,
        *,
        chunk_id: int,
        obs: PyTree,
        actions: Array,
        step_id: int = 0,
        epoch_id: int = 0,
        env_rank: int = 0,
        stage_id: int = 0,
        batch_size: int | None = None,
        offset: int = 0,
        **output: Any,
    ) -> PolicyPart:
        """A policy half from keyword key fields and ``PolicyOutput`` fields.

        ``batch_size`` defaults to the rows of ``actions`` (a whole source batch at
        ``offset`` 0); give it, with ``offset``, for a fragment.
        """
        key = TrajectoryKey(step_id, epoch_id, env_rank, stage_id, chunk_id)
        rows = np.shape(actions)[0] if batch_size is None else batch_size
        return cls(TrajectorySource(key, rows, offset), obs, PolicyOutput(actions, **output))


@struct.dataclass
class EnvTransition:
    """Environment outcome of one executed chunk.

    Attributes:
      rewards: ``[B]`` chunk-level or ``[B, K]`` action-level rewards.
      terminations: ``[B]`` or ``[B, K]`` bool, episode ended naturally.
      truncations: ``[B]`` or ``[B, K]`` bool, episode cut by a time limit.
      dones: ``[B]`` or ``[B, K]`` bool; when absent, ``terminations | truncations``.
      intervene_actions: ``[B, K*A]`` (or ``[B, K, A]``) actions a human executed.
      intervene_flags: ``[B, K]`` bool, which actions of the chunk were intervened.
      reward_model_output: reward-model score shaped like ``rewards``.
      success: ``[B]`` or ``[B, K]`` bool, the task was accomplished at that action (an
        info flag such as ``is_success``, or the termination of a task that ends when it
        succeeds); lerobot mode records it as ``next.success``.
      valid_actions: ``[B, K]`` bool, the actions of the chunk the environment executed
        (the original system's ``valid_action_mask``); absent: all of them. An
        environment that cuts a chunk at an episode end gives a leading run of ``True``
        ending on the action flagged done; EnvPool's reset step (the step after a done,
        whose action is not executed) is ``False``. Slots that did not run carry zero
        rewards and false flags. See :meth:`owned_actions` for the rule.
      reward_assign_lengths: ``[B]`` integer, a delayed reward-model score (the original
        system's ``reward_assign_lengths``): the chunk's ``reward_model_output``, weighted
        by the plan's ``reward_model_weight``, is also added to the rewards of the
        ``length - 1`` chunks of that env before it in the same epoch of the training
        step (a history longer than the chunks held is cut to them; ``0`` and ``1``
        assign nothing back). Needs ``reward_model_output``; see
        :meth:`assign_history_rewards`.

    The chunk-end rule. A chunk's decision owns its actions up to and including the
    first episode end in it; actions after that end are not part of its return (under
    ``chunk_end="continue"`` they ran in the next episode, under ``"cut"`` they never
    ran). :meth:`owned_actions` is that mask, :meth:`chunk_rewards` the chunk's reward.
    """

    rewards: Array | None = None
    terminations: Array | None = None
    truncations: Array | None = None
    dones: Array | None = None
    intervene_actions: Array | None = None
    intervene_flags: Array | None = None
    reward_model_output: Array | None = None
    success: Array | None = None
    valid_actions: Array | None = None
    reward_assign_lengths: Array | None = None

    def ran_actions(self, rows_ndim: int = 1, xp: Any = jnp) -> Array | None:
        """``[..., K]`` bool: the actions that ran (``valid_actions``, else every action
        of a chunk whose rewards or flags are per action); ``None`` where every field is
        chunk-level.

        Args:
          rows_ndim: the rank of a row field (``1`` for a part's ``[B]``, ``3`` for a
            buffer's ``[E, T, B]``); an action-level field has one more axis.
        """
        if self.valid_actions is not None:
            return xp.asarray(self.valid_actions, bool)
        for x in (self.resolved_dones(xp), self.rewards, self.reward_model_output):
            if x is not None and np.ndim(x) > rows_ndim:
                return xp.ones(np.shape(x), bool)
        return None

    def owned_actions(self, rows_ndim: int = 1, xp: Any = jnp) -> Array | None:
        """``[..., K]`` bool: the actions the chunk's decision owns and that ran.

        An action is owned if it ran (:meth:`ran_actions`) and no action before it in
        the chunk ended an episode: the chunk's first end is its last owned action.
        ``None`` where every field is chunk-level (every action of a chunk is owned).
        """
        ran = self.ran_actions(rows_ndim, xp)
        if ran is None:
            return None
        dones = self.resolved_dones(xp)
        if dones is None or np.ndim(dones) <= rows_ndim:
            return ran
        dones = xp.asarray(dones, bool) & ran
        before = xp.cumsum(dones, axis=-1, dtype=np.int32) - dones.astype(np.int32)
        return ran & (before == 0)

    def chunk_rewards(
        self,
        rewards: Array,
        final_values: Array | None = None,
        *,
        gamma: float = 0.99,
        action_gamma: float = 1.0,
        bootstrap: str = "truncated",
        rows_ndim: int = 1,
    ) -> Array:
        """The chunk's training reward: the one statement of the chunk-end rule.

        With ``g = action_gamma`` and the chunk's first episode end at action ``k``
        (``k = K - 1`` for a chunk that runs to its end)::

            r_chunk = sum_{j <= k, j ran} g**j r_j  +  cut * gamma * g**(k + 1 - K) * V

        where ``V = V(final obs)`` (``final_values``, terminal inference) and ``cut`` says
        the first end is one that bootstraps (``bootstrap="truncated"``: a truncation,
        ``"done"``: any end, ``"none"``: never). With ``g`` the per-action discount and
        ``gamma = g**K`` the bootstrap is ``g**(k + 1) V``: a chunk-start return equals
        the per-action discounted return. With ``g = 1`` (rewards summed) it is
        ``gamma * V``, the original system's rule without the next episode's rewards.
        A termination never bootstraps under ``"truncated"``. Rewards of actions after
        the end (run in the next episode, or not run) are never summed in.

        Args:
          rewards: composed rewards (:meth:`compute_rewards`), ``[...]`` chunk-level or
            ``[..., K]`` action-level.
          final_values: ``[...]`` (or ``[..., 1]``) ``V(final obs)``, or ``None``.
          rows_ndim: the rank of a row field (see :meth:`ran_actions`).

        Returns:
          ``[...]``, the chunk-level reward.
        """
        rewards = jnp.asarray(rewards)
        owned = self.owned_actions(rows_ndim)
        if rewards.ndim > rows_ndim:  # action-level: the owned actions, discounted
            K = rewards.shape[-1]
            disc = (action_gamma ** np.arange(K)).astype(rewards.dtype)
            disc = disc.reshape((1,) * (rewards.ndim - 1) + (K,))
            total = jnp.sum(jnp.where(owned, rewards * disc, 0), axis=-1)
        else:
            total = rewards
        if final_values is None:
            return total
        cut_first, k, K = self.first_end_cuts(bootstrap, rows_ndim)
        if cut_first is None:
            return total
        values = jnp.asarray(final_values, total.dtype)
        if values.ndim == total.ndim + 1:
            values = values[..., 0]
        weight = gamma
        if k is not None:  # per-action flags: the end at action k of K
            weight = gamma * jnp.asarray(action_gamma, total.dtype) ** (k + 1 - K).astype(
                total.dtype
            )
        return total + jnp.where(cut_first, weight * values, 0).astype(total.dtype)

    def first_end_cuts(self, bootstrap: str = "truncated", rows_ndim: int = 1) -> tuple:
        """``(cut [...], k [...], K)``: whether the chunk's first episode end is one that
        bootstraps (under ``bootstrap``, see :meth:`cut_flags`), at which action ``k`` it
        is and ``K``; ``k`` and ``K`` are ``None`` for chunk-level flags (the end is the
        chunk's last action), ``cut`` is ``None`` without flags."""
        cut = self.cut_flags(bootstrap)
        if cut is None:
            return None, None, None
        cut = jnp.asarray(cut, bool)
        if cut.ndim <= rows_ndim:
            return cut, None, None
        owned = self.owned_actions(rows_ndim)
        first = jnp.asarray(self.resolved_dones(), bool) & owned  # one-hot at most
        return jnp.any(cut & first, axis=-1), jnp.argmax(first, axis=-1), cut.shape[-1]


    def resolved_dones(self, xp: Any = jnp) -> Array | None:
        """``dones`` if given, else ``terminations | truncations`` (``None`` if neither).

        ``xp`` is the array namespace (``jax.numpy`` or ``numpy`` for host checks).
        """
        if self.dones is not None:
            return self.dones
        if self.terminations is not None and self.truncations is not None:
            return xp.logical_or(self.terminations, self.truncations)
        return self.terminations if self.terminations is not None else self.truncations

    def cut_flags(self, bootstrap: str, xp: Any = jnp) -> Array | None:
        """The flags of actions whose reward takes the bootstrap value ``gamma * V(final
        obs)``: ``truncations`` under ``"truncated"``, any done under ``"done"``, none
        under ``"none"``; ``None`` where the transition carries no such flags.

        The one statement of which flags cut an episode: the chunk's training reward
        (:meth:`chunk_rewards`) and the collector's checks both read it.
        """
        if bootstrap == "truncated":
            return self.truncations
        if bootstrap == "done":
            return self.resolved_dones(xp)
        return None

    def boundary(self) -> EnvTransition:
        """Only the boundary flags, as ``initial_transition`` stores them."""
        return EnvTransition(
            terminations=self.terminations, truncations=self.truncations, dones=self.dones
        )

    def compute_rewards(
        self,
        *,
        env_reward_weight: float = 1.0,
        reward_model_weight: float = 1.0,
    ) -> Array | None:
        """The chunk's composed rewards, per action as given.

        The original system's rule: where a reward model scored the chunk
        (``reward_model_output`` is given), ``env_reward_weight * rewards +
        reward_model_weight * reward_model_output``; without a reward-model output the
        environment's rewards pass unchanged, whatever the weights. jaxtraj's default
        ``env_reward_weight`` is ``1.0`` (the model's score is added to the
        environment's reward); the original system's is ``0.0`` (with a reward model,
        only the model's score counts): pass ``env_reward_weight=0.0`` for that.

        The truncation bootstrap is not here: it belongs to the chunk's training reward
        (:meth:`chunk_rewards`), which the training targets compute
        (:func:`jaxtraj.targets.trajectory_targets`).

        Shapes: ``rewards [B]`` or ``[B, K]``; ``reward_model_output`` alike.
        """
        if self.rewards is None:
            return None
        rewards = self.rewards
        if self.reward_model_output is None:  # no reward model: the env's reward as given
            return rewards
        if env_reward_weight != 1.0:
            rewards = env_reward_weight * rewards
        return rewards + reward_model_weight * jnp.asarray(
            self.reward_model_output, jnp.result_type(rewards)
        )

    def assign_history_rewards(
        self, rewards: Array, *, reward_model_weight: float = 1.0, time_axis: int = 1
    ) -> Array:
        """Composed rewards with the delayed reward-model scores assigned back.

        A transition of buffers (leaves ``[E, T, B(, K)]``, chunks on ``time_axis``):
        where chunk ``t`` of row ``b`` carries ``reward_assign_lengths = L``, its
        weighted score ``reward_model_weight * reward_model_output`` is added to the
        rewards of chunks ``max(t - L + 1, 0) .. t - 1`` of that row (its own rewards
        already hold it, :meth:`compute_rewards`); per action where the score is per
        action. Every chunk of the training step carries rewards, so a history reaches
        back at most to the epoch's first chunk. Actions that did not run
        (``valid_actions``) get nothing. Memory: a ``[T, T, ..., B]`` mask.

        Args:
          rewards: the composed rewards (:meth:`compute_rewards`) of the buffers.
          reward_model_weight: the plan's weight of the score.
          time_axis: the chunks' axis of ``rewards`` (``1`` for ``[E, T, B]``).

        Returns:
          ``rewards`` with the history assigned, or ``rewards`` itself without
          ``reward_assign_lengths``.
        """
        if self.reward_assign_lengths is None or rewards is None:
            return rewards
        rewards = jnp.asarray(rewards)
        a = time_axis
        lengths = jnp.moveaxis(jnp.asarray(self.reward_assign_lengths, jnp.int32), a, 0)
        score = jnp.asarray(self.reward_model_output, rewards.dtype) * reward_model_weight
        score = jnp.moveaxis(score, a, 0)  # [T, ..., B(, K)]
        T = lengths.shape[0]
        lengths = lengths.reshape(T, -1)  # [T, M]
        steps = jnp.arange(T, dtype=jnp.int32)
        src, dst = steps[:, None, None], steps[None, :, None]
        # gets[s, d, m]: chunk d gets chunk s's score (d before s, within s's length)
        gets = ((dst < src) & (src - dst < lengths[:, None])).astype(score.dtype)
        per_row = score.reshape((T, lengths.shape[1], -1))  # [T, M, K or 1]
        added = jnp.einsum("sdm,smk->dmk", gets, per_row, precision="highest")
        added = jnp.moveaxis(added.reshape((T,) + score.shape[1:]), 0, a)
        if self.valid_actions is not None and added.ndim == np.ndim(self.valid_actions):
            added = jnp.where(jnp.asarray(self.valid_actions, bool), added, 0)
        return rewards + added.astype(rewards.dtype)


@struct.dataclass
class EnvPart(_Fragmentable):
    """The environment half of a chunk.

    Attributes:
      source: the chunk's :class:`TrajectorySource`.
      transition: the :class:`EnvTransition` of the executed chunk.
      next_obs: explicit post-action observation, set only when a terminal or
        decoupled boundary overrides the next ``PolicyInput.obs``.
      initial_transition: chunk zero only: the boundary flags of the state before
        the first action (``d_before``).
      final_values: ``[B]`` value of the post-action observation from terminal
        inference. The last chunk's is the bootstrap value ``V(s_T)``.
      next_rlt_obs: optional compact RLT features of the next state.
      action_obs: optional per-action observations, leaves ``[B, K, ...]`` shaped like
        the policy half's observation with a ``K`` axis: the observation each action of
        the chunk was taken from (action 0's is the chunk's pre-action observation;
        after an episode ended at action ``k``, action ``k + 1``'s is the new episode's
        reset observation). Retained in lerobot mode only, when the plan's env example
        carries them (dataset frames show them); ignored by the other modes.
    """

    source: TrajectorySource
    transition: EnvTransition
    next_obs: PyTree | None = None
    initial_transition: EnvTransition | None = None
    final_values: Array | None = None
    next_rlt_obs: PyTree | None = None
    action_obs: PyTree | None = None

    @classmethod
    def at(
        cls,
        *,
        chunk_id: int,
        rewards: Array,
        step_id: int = 0,
        epoch_id: int = 0,
        env_rank: int = 0,
        stage_id: int = 0,
        batch_size: int | None = None,
        offset: int = 0,
        next_obs: PyTree | None = None,
        initial_transition: EnvTransition | None = None,
        final_values: Array | None = None,
        next_rlt_obs: PyTree | None = None,
        action_obs: PyTree | None = None,
        **transition: Any,
    ) -> EnvPart:
        """An env half from keyword key fields and ``EnvTransition`` fields
        (``terminations``, ``truncations``, ``dones``, ...).

        ``batch_size`` defaults to the rows of ``rewards``. Chunk zero carries
        ``initial_transition`` (with the same flag fields as the transition); the last
        chunk ``final_values``.
        """
        key = TrajectoryKey(step_id, epoch_id, env_rank, stage_id, chunk_id)
        rows = np.shape(rewards)[0] if batch_size is None else batch_size
        return cls(
            TrajectorySource(key, rows, offset),
            EnvTransition(rewards=rewards, **transition),
            next_obs=next_obs,
            initial_transition=initial_transition,
            final_values=final_values,
            next_rlt_obs=next_rlt_obs,
            action_obs=action_obs,
        )


def stack_parts(parts: Iterable[PolicyPart | EnvPart]) -> list[PolicyPart | EnvPart]:
    """Group parts by kind, structure, shapes and dtypes, and stack each group on the host
    (no dtype is widened to another part's).

    Returns one stacked part per group (a leading axis on every leaf, keys included),
    in order of first appearance: what :meth:`TrajectoryCollector.add_many` and the
    pure ``add_policies`` / ``add_envs`` take.
    """
    return [stack_group(group) for group, _ in group_parts(parts)]


class PartGroup(NamedTuple):
    """Parts of one structure, shapes and dtypes, flattened: ``leaves[i]`` is part ``i``'s."""

    treedef: Any
    leaves: list

    @property
    def nbytes(self) -> int:
        """The bytes of one part (a scalar leaf counts 8)."""
        return sum(getattr(x, "nbytes", 8) for x in self.leaves[0])


def group_parts(parts: Iterable[PolicyPart | EnvPart]) -> list[tuple[PartGroup, list[int]]]:
    """Group parts by kind, structure, shapes and dtypes (each flattened once), in order of
    first appearance, each group with the places its parts had in ``parts``."""
    by_sig: dict[Any, tuple[PartGroup, list]] = {}
    for n, part in enumerate(parts):
        if not isinstance(part, (PolicyPart, EnvPart)):
            raise CollectorError(None, ErrorCode.STRUCTURE_MISMATCH, f"not a part: {type(part)}")
        leaves, treedef = jax.tree.flatten(part)
        # Shapes and dtypes (hot: no np.shape): parts of one group share both, so stacking
        # never widens a dtype (a float16 part among float32 ones stays float16, and is
        # refused as it would be alone).
        sig = (treedef, *[(getattr(x, "shape", ()), getattr(x, "dtype", type(x))) for x in leaves])
        found = by_sig.get(sig)
        if found is None:
            found = by_sig[sig] = (PartGroup(treedef, []), [])
        found[0].leaves.append(leaves)
        found[1].append(n)
    return list(by_sig.values())


def stack_group(group: PartGroup) -> PolicyPart | EnvPart:
    """One stacked part (a leading axis on every leaf) of a :class:`PartGroup`."""
    return jax.tree.unflatten(group.treedef, [_stack(xs) for xs in zip(*group.leaves)])


def _stack(xs: tuple) -> np.ndarray:
    """``np.stack(xs)`` of arrays of one shape and dtype: by ``np.concatenate`` (~4x faster
    for many small arrays); scalars (the keys' Python ints) by ``np.array``."""
    x = xs[0]
    if not isinstance(x, np.ndarray):
        return np.array(xs)
    if not x.ndim:
        return np.stack(xs)
    return np.concatenate(xs).reshape((len(xs), *x.shape))


@struct.dataclass
class PolicyInput:
    """What Env sends to Rollout: the observation, a new key, and the previous chunk's ``EnvPart``."""

    obs: PyTree
    source: TrajectorySource
    env_part: EnvPart | None = None


@struct.dataclass
class TrajectoryStep:
    """One complete step: a joined policy/env pair resolved into training fields.

    Elementwise over any leading axes: the accumulator resolves a whole buffer of
    pairs ``[E, T, B, ...]`` in one call.
    """

    obs: PyTree
    actions: Array
    prev_logprobs: Array | None = None
    prev_values: Array | None = None
    versions: Array | None = None
    forward_inputs: PyTree | None = None
    bootstrap_values: Array | None = None
    rewards: Array | None = None
    dones: Array | None = None
    terminations: Array | None = None
    truncations: Array | None = None
    intervene_flags: Array | None = None
    final_values: Array | None = None
    next_obs: PyTree | None = None
    rlt_obs: PyTree | None = None
    next_rlt_obs: PyTree | None = None
    action_obs: PyTree | None = None
    success: Array | None = None
    valid_actions: Array | None = None

    def transition(self) -> EnvTransition:
        """The step's flags and rewards as an :class:`EnvTransition` (for its rules)."""
        return EnvTransition(
            rewards=self.rewards, terminations=self.terminations, truncations=self.truncations,
            dones=self.dones, valid_actions=self.valid_actions,
        )

    @classmethod
    def from_parts(
        cls, policy: PolicyPart, env: EnvPart, plan: TrajectoryPlan | None = None
    ) -> TrajectoryStep:
        """Resolve one joined pair (or a buffer of pairs) into a step.

        Rewards come from ``EnvTransition.compute_rewards`` with the plan's weights
        (defaults without a plan): what the environment and the reward model gave, per
        action as given, without the truncation bootstrap (the training targets add it:
        ``EnvTransition.chunk_rewards``); executed human actions replace the policy's
        through :meth:`apply_interventions`. The step's ``intervene_flags`` (shaped like
        ``actions``) are the environment's flags (with its ``intervene_actions``) or the
        policy side's ``PolicyOutput.intervene_flags`` expanded to the action elements
        (:meth:`flag_interventions`), whichever are present; ``None`` with neither. (The
        original system lets the model-side flags overwrite the environment's; jaxtraj
        ors them, so no executed human action goes unflagged.)
        """
        plan = plan if plan is not None else TrajectoryPlan(num_chunks=1)  # its defaults
        out, tr = policy.output, env.transition
        step = cls(
            obs=policy.obs,
            actions=out.actions,
            prev_logprobs=out.prev_logprobs,
            prev_values=out.prev_values,
            versions=out.versions,
            forward_inputs=out.forward_inputs,
            bootstrap_values=out.bootstrap_values,
            rewards=tr.compute_rewards(
                env_reward_weight=plan.env_reward_weight,
                reward_model_weight=plan.reward_model_weight,
            ),
            dones=tr.resolved_dones(),
            terminations=tr.terminations,
            truncations=tr.truncations,
            final_values=env.final_values,
            next_obs=env.next_obs,
            rlt_obs=rlt_features(out.forward_inputs)
            if plan.enable_rlt
            else None,
            next_rlt_obs=env.next_rlt_obs if plan.enable_rlt else None,
            action_obs=env.action_obs,
            success=tr.success,
            valid_actions=tr.valid_actions,
        )
        if tr.intervene_actions is not None:
            step = step.apply_interventions(tr.intervene_actions, tr.intervene_flags)
        if out.intervene_flags is not None:
            step = step.flag_interventions(out.intervene_flags, tr)
        return step

    def flag_interventions(
        self, intervene_flags: Array, transition: EnvTransition | None = None
    ) -> TrajectoryStep:
        """Or model-side intervention flags (``PolicyOutput.intervene_flags``) into the
        step's ``intervene_flags``, expanded to the action elements; the actions are
        not touched (the policy side applied its correction itself).

        ``intervene_flags [...]`` (per row: every action of the chunk) or ``[..., K]``
        (per action) lead the actions' shape ``[..., K, A]``, or for flat actions
        ``[..., K*A]`` split them in ``K`` actions, ``K`` being the chunk's (the
        action-level fields of ``transition``, else 1; see :func:`chunk_size`). The
        environment's flags, where :meth:`apply_interventions` recorded them, stay
        set: the result is their or.

        Raises:
          CollectorError: ``STRUCTURE_MISMATCH`` naming ``PolicyOutput.intervene_flags``
            when they are not bool or do not fit the action chunk (at trace time).
        """
        flags = model_flags(self.actions, intervene_flags, transition)
        if self.intervene_flags is not None:
            flags = flags | self.intervene_flags
        return self.replace(intervene_flags=flags)

    def apply_interventions(
        self, intervene_actions: Array, intervene_flags: Array
    ) -> TrajectoryStep:
        """Replace executed actions element-wise per action of the chunk.

        ``intervene_flags [..., K]`` selects, per action, the human action from
        ``intervene_actions`` (same size as ``actions``) over the policy's; the flags
        are recorded per action element in ``intervene_flags`` shaped like
        ``actions``. The same replacement applies to a retained forward input named
        ``"action"`` or ``"actions"`` (what the training forward pass scores, so
        log-probabilities are recomputed for what was actually done) and to RLT's
        ``ref_chunk``.
        """
        lead = intervene_flags.shape
        actions = self.actions.reshape(lead + (-1,))
        expert = jnp.asarray(intervene_actions).reshape(lead + (-1,)).astype(actions.dtype)
        flags = jnp.broadcast_to(intervene_flags[..., None], actions.shape)
        executed = jnp.where(flags, expert, actions).reshape(self.actions.shape)

        def intervened(tree, names):  # those entries of a dict, with the human actions in
            if not isinstance(tree, dict):
                return tree
            tree = dict(tree)
            for name in names:
                x = tree.get(name)
                if x is not None and x.size == executed.size:
                    x_k = jnp.asarray(x).reshape(actions.shape)
                    tree[name] = jnp.where(flags, expert.astype(x_k.dtype), x_k).reshape(x.shape)
            return tree

        return self.replace(
            actions=executed,
            intervene_flags=flags.reshape(self.actions.shape),
            forward_inputs=intervened(self.forward_inputs, ("action", "actions")),
            # RLT's reference chunk takes the executed human actions too.
            rlt_obs=intervened(self.rlt_obs, ("ref_chunk",)),
        )


def model_flags(actions: Array, flags: Array, transition: EnvTransition | None) -> Array:
    """Model-side flags ``[...]`` or ``[..., K]`` expanded to ``actions``' shape (see
    :meth:`TrajectoryStep.flag_interventions`); static shape and dtype checks."""
    s, f = tuple(np.shape(actions)), tuple(np.shape(flags))
    dtype = getattr(flags, "dtype", None)
    n = len(f)
    fits = n >= 1 and s[:n] == f  # per row, or per action of actions [..., K, A]
    if not fits and n >= 2 and len(s) == n and s[: n - 1] == f[:-1]:
        # flat actions [..., K*A]: K as the chunk states it (action-level fields of the
        # transition, which have the flags' rank; else 1)
        fields = (getattr(transition, name, None) for name in _PER_ACTION + ("intervene_flags",))
        ks = {np.shape(x)[-1] for x in fields if x is not None and len(np.shape(x)) == n}
        k = ks.pop() if len(ks) == 1 else 1
        fits = f[-1] == k and s[-1] % k == 0
    if dtype != np.bool_ or not fits:
        raise CollectorError(
            None,
            ErrorCode.STRUCTURE_MISMATCH,
            f"PolicyOutput.intervene_flags: must be bool, [rows] or [rows, K] for the "
            f"chunk's K actions; got {dtype} {f} against actions {s} (leading buffer axes "
            "included)",
        )
    flags = jnp.asarray(flags)
    per = int(np.prod(s[n:])) if s[:n] == f else s[-1] // f[-1]
    return jnp.broadcast_to(flags[..., None], f + (per,)).reshape(s)


def _with_boundary(first: Array | None, rest: Array | None, axis: int) -> Array | None:
    if first is None or rest is None:
        return None
    return jnp.concatenate([jnp.expand_dims(first, axis), rest], axis=axis)


@struct.dataclass
class Trajectory:
    """The temporal layout of one training step of one source.

    ``E`` epochs, ``T`` chunks, ``B`` environments::

        obs, actions, prev_logprobs, versions, forward_inputs: [E, T, B, ...]
        rewards:        [E, T, B] or [E, T, B, K]
        dones, terminations, truncations: [E, T+1, B(, K)]  index 0: d_before
        prev_values:    [E, T+1, B(, 1)]                   index T: V(s_final)
        next_obs:       [E, T, B, ...] (collect_transitions only)
        rlt_obs, next_rlt_obs: {z_rl, proprio, ref_chunk} [E, T, B, ...] (enable_rlt only)
        action_obs:     [E, T, B, K, ...] (lerobot mode, when env halves carry them)
        success:        [E, T, B(, K)] (when env halves carry it)
        final_values:   [E, T, B(, 1)] V(final obs) where it is used (when values are used)
        valid_actions:  [E, T, B, K] the actions that ran (when env halves carry it)
        action_mask:    [E, T, B, K] the actions each chunk's decision owns and that ran
                        (None when every field is chunk-level: all of them)
        episodes:       the episodes that ended in the step (an EpisodeStats)

    ``rewards`` record what the environment (and a reward model) gave, composed with the
    plan's weights: never the truncation bootstrap, which the training targets add
    (:func:`jaxtraj.targets.trajectory_targets`, the rule of
    ``EnvTransition.chunk_rewards``). Mask per-action log-probabilities with
    ``action_mask``. ``step_id``, ``env_rank`` and ``stage_id`` name the source and step.
    """

    obs: PyTree
    actions: Array
    prev_logprobs: Array | None
    prev_values: Array | None
    versions: Array | None
    forward_inputs: PyTree | None
    bootstrap_values: Array | None
    rewards: Array | None
    dones: Array | None
    terminations: Array | None
    truncations: Array | None
    intervene_flags: Array | None
    next_obs: PyTree | None
    rlt_obs: PyTree | None
    next_rlt_obs: PyTree | None
    step_id: Array
    env_rank: Array
    stage_id: Array
    action_obs: PyTree | None = None
    success: Array | None = None
    final_values: Array | None = None
    valid_actions: Array | None = None
    action_mask: Array | None = None
    episodes: Any = None

    def transition(self) -> EnvTransition:
        """The chunks' rewards and flags (boundary index dropped) as an
        :class:`EnvTransition`, leaves ``[E, T, B(, K)]``, for its rules."""
        after = lambda x: None if x is None else x[:, 1:]
        return EnvTransition(
            rewards=self.rewards, terminations=after(self.terminations),
            truncations=after(self.truncations), dones=after(self.dones),
            valid_actions=self.valid_actions,
        )

    def intervened_segments(self, mode: str = "any") -> list[tuple[int, int, int, int]]:
        """Runs of intervened chunks, for DAgger- or HIL-style training (host side).

        A chunk counts as intervened if ``"any"`` (or ``"all"``) of its executed actions
        came from the human. Returns ``(epoch, env, first_chunk, end_chunk)`` per maximal
        run, ``end_chunk`` exclusive; ``[]`` without interventions.
        """
        if mode not in ("any", "all"):
            raise ValueError(f"mode must be 'any' or 'all', got {mode!r}")
        if self.intervene_flags is None:
            return []
        flags = np.asarray(self.intervene_flags)
        flags = flags.reshape(flags.shape[:3] + (-1,))
        chunk = flags.any(-1) if mode == "any" else flags.all(-1)  # [E, T, B]
        out = []
        for e, b in np.ndindex(chunk.shape[0], chunk.shape[2]):
            run = np.diff(np.concatenate([[0], chunk[e, :, b].astype(np.int8), [0]]))
            starts, ends = np.flatnonzero(run == 1), np.flatnonzero(run == -1)
            out += [(int(e), int(b), int(s), int(t)) for s, t in zip(starts, ends)]
        return out

    def staleness(self, current_version: Any) -> Array:
        """``current_version - versions``: how many policy updates old each sample is."""
        return jnp.asarray(current_version, jnp.int32) - jnp.asarray(self.versions, jnp.int32)

    @classmethod
    def from_steps(
        cls,
        steps: TrajectoryStep,
        initial: EnvTransition,
        *,
        next_obs_given: Array | None = None,
        next_rlt_given: Array | None = None,
        step_id: Any = 0,
        env_rank: Any = 0,
        stage_id: Any = 0,
    ) -> Trajectory:
        """Materialise the temporal layout from steps ``[E, T, B, ...]``.

        Args:
          steps: resolved steps with leading axes ``[E, T]``.
          initial: chunk zero's ``initial_transition`` per epoch, leaves ``[E, B, ...]``.
          next_obs_given: ``[E, T, B]`` bool, where ``steps.next_obs`` holds an explicit
            override; elsewhere the next step's ``obs`` is the next observation. Only
            used when ``steps.next_obs`` is retained (``collect_transitions``).
          next_rlt_given: likewise for ``steps.next_rlt_obs`` against the next step's
            ``rlt_obs`` (``enable_rlt``).
        """
        prev_values = None
        if steps.prev_values is not None and steps.final_values is not None:
            prev_values = jnp.concatenate(
                [steps.prev_values, steps.final_values[:, -1:].astype(steps.prev_values.dtype)],
                axis=1,
            )

        def resolve(override, current, given):
            """The next state: the override where given, else the next step's current."""

            def one(o, c):
                following = jnp.concatenate([c[:, 1:], o[:, -1:]], axis=1)
                mask = given.reshape(given.shape + (1,) * (c.ndim - 3))
                return jnp.where(mask, o, following)

            return None if override is None else jax.tree.map(one, override, current)

        return cls(
            obs=steps.obs,
            actions=steps.actions,
            prev_logprobs=steps.prev_logprobs,
            prev_values=prev_values,
            versions=steps.versions,
            forward_inputs=steps.forward_inputs,
            bootstrap_values=steps.bootstrap_values,
            rewards=steps.rewards,
            dones=_with_boundary(initial.resolved_dones(), steps.dones, 1),
            terminations=_with_boundary(initial.terminations, steps.terminations, 1),
            truncations=_with_boundary(initial.truncations, steps.truncations, 1),
            intervene_flags=steps.intervene_flags,
            next_obs=resolve(steps.next_obs, steps.obs, next_obs_given),
            rlt_obs=steps.rlt_obs,
            next_rlt_obs=resolve(steps.next_rlt_obs, steps.rlt_obs, next_rlt_given),
            step_id=jnp.asarray(step_id, jnp.int32),
            env_rank=jnp.asarray(env_rank, jnp.int32),
            stage_id=jnp.asarray(stage_id, jnp.int32),
            action_obs=steps.action_obs,
            success=steps.success,
            final_values=steps.final_values,
            valid_actions=steps.valid_actions,
            action_mask=steps.transition().owned_actions(rows_ndim=3),
        )


def _flat_chunks(x: Array) -> Array:
    """``[E, T, B, ...]`` -> ``[E*T, B, ...]``."""
    return x.reshape((-1,) + x.shape[2:])


def _flat_actions(x: Array) -> Array:
    """``[E, T, B, K, ...]`` -> ``[E*T*K, B, ...]``, time-ordered."""
    x = jnp.moveaxis(x, 3, 2)
    return x.reshape((-1,) + x.shape[3:])


def _event_frames(x: Array, per_action: bool, k: int, reduce) -> Array:
    """Per-chunk ``[E, T, B]`` or per-action ``[E, T, B, K]`` events -> frames ``[n, B, 1]``.

    A chunk-level event (reward, done) belongs to the chunk's last action; per chunk,
    action-level events are reduced (rewards summed, flags or-ed).
    """
    if x.ndim == 3:
        if not per_action:
            return _flat_chunks(x)[..., None]
        x = jnp.zeros(x.shape + (k,), x.dtype).at[..., -1].set(x)
    return (_flat_actions(x) if per_action else _flat_chunks(reduce(x, axis=-1)))[..., None]


def trajectory_frames(
    traj: Trajectory, *, per_action: bool, actions_per_chunk: int, state_key: str = "state"
) -> tuple[dict[str, Array], Array]:
    """Dataset frames of a trajectory, in time order, and where episodes end.

    A frame is one executed action (``per_action``: ``K`` frames per chunk) or one
    chunk. Features follow LeRobot's names: ``observation.state`` (the observation
    leaf ``state_key``), other vector observations as ``observation.<key>``,
    cameras as ``observation.images.<key>``, ``action``, ``next.reward``,
    ``next.done``, ``next.truncated``, ``next.success`` when the env halves carry
    ``EnvTransition.success``, and ``intervention`` when interventions are recorded.
    Per action, frame ``k`` of a chunk shows the observation action ``k`` was taken
    from: ``traj.action_obs`` (the env halves' per-action observations), so after an
    episode ends mid-chunk the next episode starts with its own reset observation.
    Without them the chunk's pre-action observation stands for each of its frames
    (lerobot mode refuses that for ``K > 1``).

    Which observation leaves are exported, by their per-frame shape: ``[D]`` as a
    vector; ``[H, W, 3]`` ``uint8`` as a camera (the images travel with the frames,
    ``[n, B, H, W, 3]``); any other ``[H, W, C]`` leaf raises ``ValueError`` (convert
    it to ``uint8`` RGB first); scalars and other ranks are not exported.

    Per action, only actions that ran are frames: ``valid [n, B]`` is false on the
    slots of a chunk cut at an episode end (``EnvTransition.valid_actions``) and on
    EnvPool's reset steps; per chunk every chunk is a frame.

    Returns:
      ``(frames, done, valid)``: leaves ``[n, B, ...]`` (scalars as ``[n, B, 1]``),
      ``done [n, B]`` bool and ``valid [n, B]`` bool, ``n`` being ``E*T*K`` or ``E*T``.
    """
    k = actions_per_chunk
    obs = traj.obs if isinstance(traj.obs, dict) else {state_key: traj.obs}
    per_obs = None  # leaves [E, T, B, K, ...]
    if per_action and traj.action_obs is not None:
        per_obs = traj.action_obs if isinstance(traj.action_obs, dict) else {
            state_key: traj.action_obs
        }
    frames: dict[str, Array] = {}
    for name, leaf in obs.items():
        if leaf.ndim == 6:  # [E, T, B, H, W, C]: a camera
            if leaf.dtype != jnp.uint8 or leaf.shape[-1] != 3:
                raise ValueError(
                    f"observation {name!r}: an image leaf [H, W, C] is exported as a camera only"
                    f" as uint8 with C = 3, got {leaf.dtype} {list(leaf.shape[3:])}"
                )
            key = f"observation.images.{name}"
        elif leaf.ndim == 4:  # [E, T, B, D]: a vector
            key = "observation.state" if name == state_key else f"observation.{name}"
        else:
            continue
        if per_obs is not None:
            frames[key] = _flat_actions(per_obs[name])
        elif per_action:
            frames[key] = _flat_actions(jnp.repeat(leaf[:, :, :, None], k, axis=3))
        else:
            frames[key] = _flat_chunks(leaf)
    actions = traj.actions.reshape(traj.actions.shape[:3] + (k, -1))
    if per_action:
        frames["action"] = _flat_actions(actions)
    else:
        frames["action"] = _flat_chunks(actions.reshape(actions.shape[:3] + (-1,)))
    if traj.rewards is not None:
        rewards = _event_frames(traj.rewards, per_action, k, jnp.sum)
        frames["next.reward"] = rewards.astype(jnp.float32)
    frames["next.done"] = _event_frames(traj.dones[:, 1:], per_action, k, jnp.any)
    if traj.truncations is not None:
        frames["next.truncated"] = _event_frames(traj.truncations[:, 1:], per_action, k, jnp.any)
    if traj.intervene_flags is not None:
        flags = traj.intervene_flags.reshape(traj.intervene_flags.shape[:3] + (k, -1)).any(-1)
        frames["intervention"] = _event_frames(flags, per_action, k, jnp.any)
    if traj.success is not None:
        frames["next.success"] = _event_frames(traj.success, per_action, k, jnp.any)
    done = frames["next.done"][..., 0]
    if per_action and traj.valid_actions is not None:
        valid = _flat_actions(traj.valid_actions)
    else:
        valid = jnp.ones(done.shape, bool)
    return frames, done, valid
