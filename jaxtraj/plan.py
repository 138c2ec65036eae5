"""The static configuration of a collector."""

from __future__ import annotations

import dataclasses

MODES = ("rollout", "pipeline", "lerobot")
NONFINITE = ("reject", "allow")
ADVANTAGES = ("gae", "returns")
FRAMES = ("action", "chunk")
OVERFLOW = ("error", "truncate")
BOOTSTRAP = ("truncated", "done", "none")
NORMALIZE = {True: "global", "global": "global", "per_rank": "per_rank", False: "none", "none": "none"}


@dataclasses.dataclass(frozen=True)
class TrajectoryPlan:
    """Sizes, mode and retention settings; static and hashable (a ``jit`` static argument).

    Chunk semantics. The unit of time of the advantage computation is the chunk of ``K``
    actions, not the action: ``gamma`` discounts one chunk, so a per-action discount
    ``g`` is ``gamma = g ** K``. Action-level rewards ``[B, K]`` are combined into the
    chunk's reward by summing them (``action_gamma = 1.0``), or discounted inside the
    chunk (``action_gamma = g``). A chunk's decision owns its actions up to and including
    the first episode end in it; actions after it are not part of its return. With the
    first end at action ``k``: ``r_chunk = sum_{j <= k} action_gamma**j r_j + cut * gamma *
    action_gamma**(k + 1 - K) * V(final obs)`` (``EnvTransition.chunk_rewards``), so with
    ``action_gamma = g`` and ``gamma = g**K`` a truncation at action ``k`` bootstraps
    ``g**(k + 1) V(final obs)`` and a chunk-start return equals the per-action discounted
    return. A chunk is done if any of its actions is. ``Trajectory.rewards`` are the
    environment's rewards (weighted, with the reward model); the training targets
    (``trajectory_targets``) add the bootstrap.

    Attributes:
      num_chunks: ``T``, action chunks per rollout epoch.
      num_epochs: ``E``, rollout epochs per training step.
      batch_size: ``B``, environments per logical source.
      num_env_ranks: environment workers; with ``num_stages`` this names the sources
        ``(env_rank, stage_id)`` a collector owns by default.
      num_stages: pipeline stages per environment worker.
      mode: ``"rollout"`` (one ``Trajectory`` per source and training step),
        ``"pipeline"`` or ``"lerobot"``.
      collect_transitions: retain the resolved next observation of every step.
        Off, it costs no memory.
      enable_rlt: retain RLT's compact features, ``z_rl``, ``proprio`` and
        ``ref_chunk`` from the forward inputs, for the current and the next state
        (never the whole next forward-input dictionary).
      nonfinite: ``"reject"`` parts whose rewards or values are not finite, or
        ``"allow"`` them. Under ``"reject"`` the host runners also refuse a
        ``policy_fn`` output with non-finite actions, before any env steps them.
      env_reward_weight: weight of the environment reward where a reward model scored
        the chunk: with ``EnvTransition.reward_model_output`` given, the rewards are
        ``env_reward_weight * rewards + reward_model_weight * reward_model_output``;
        without one the environment's reward passes unchanged (the original system's
        rule, ``EnvTransition.compute_rewards``). The default ``1.0`` adds the model's
        score to the environment's reward; the original system's default is ``0.0``
        (with a reward model, only the model's score counts): set it to ``0.0`` for that.
      reward_model_weight: weight of ``EnvTransition.reward_model_output``, also of a
        delayed score assigned back to earlier chunks (``reward_assign_lengths``).
      queue_key: the queue key flushed rollout items are routed to.
      resend: a half received again (a worker restarted and re-sent it) is a
        duplicate and ``"reject"``-ed, or, with ``"accept_identical"``, accepted once
        more as a no-op when its data equals what was received (the facade compares;
        different data is still rejected).
      gamma: discount per chunk (``g ** K`` for a per-action discount ``g``).
      action_gamma: discount of the actions inside a chunk when action-level rewards
        are combined into the chunk's reward: ``sum_k action_gamma**k r_k``; ``1.0``
        sums them.
      truncation_bootstrap: which episode ends bootstrap ``V(final obs)``
        (``EnvPart.final_values``) in the chunk's training reward: ``"truncated"`` ones
        (default), any ``"done"``, or ``"none"``.
      gae_lambda: GAE's lambda.
      advantage: ``"gae"`` (needs values) or ``"returns"`` (critic-free: discounted
        reward sums cut at dones).
      normalize_advantages: pipeline mode's advantage normalisation (masked: padding,
        post-done and stale rows excluded): ``"global"`` (or ``True``, the default)
        over all valid samples of the epoch, every source and device; ``"per_rank"``
        over each Actor rank's own micro-batches (what the original system does: its
        "normalization operate[s] on Actor-specific batches"); ``"none"`` (or
        ``False``).
      auto_reset: environments reset themselves on done; without it, rows after an
        environment's first done in an epoch are padding (masked out of the loss and
        of the normalisation).
      max_staleness: mask samples produced by a policy version more than this many
        versions older than the current one (``-1``: never). ``trajectory_targets``
        and the pipeline flush take the current version.
      actor_ranks: pipeline mode packs micro-batches for this many Actor ranks.
      micro_batch_size: samples per micro-batch (pipeline mode); ``0`` means the
        whole epoch's samples in one micro-batch per rank.
      max_episode_length: lerobot mode's per-environment episode capacity, in frames.
      lerobot_frame: a dataset frame is one executed ``"action"`` (``K`` per chunk)
        or one ``"chunk"``.
      lerobot_state_key: the observation leaf exported as ``observation.state``.
      episode_overflow: an episode longer than ``max_episode_length`` is an
        ``"error"``, or is cut there and marked truncated (``"truncate"``).
      step_type, trajectory_type: subclasses of ``TrajectoryStep`` and ``Trajectory``
        that resolve and lay out fields a new algorithm adds (see
        ``docs/adding-a-field.md``); ``None`` for the built-in types.
    """

    num_chunks: int
    num_epochs: int = 1
    batch_size: int = 1
    num_env_ranks: int = 1
    num_stages: int = 1
    mode: str = "rollout"
    collect_transitions: bool = False
    enable_rlt: bool = False
    nonfinite: str = "reject"
    env_reward_weight: float = 1.0
    reward_model_weight: float = 1.0
    queue_key: str = "default"
    resend: str = "reject"
    gamma: float = 0.99
    action_gamma: float = 1.0
    truncation_bootstrap: str = "truncated"
    gae_lambda: float = 0.95
    advantage: str = "gae"
    normalize_advantages: bool | str = True
    auto_reset: bool = True
    max_staleness: int = -1
    actor_ranks: int = 1
    micro_batch_size: int = 0
    max_episode_length: int = 1000
    lerobot_frame: str = "action"
    lerobot_state_key: str = "state"
    episode_overflow: str = "error"
    step_type: type | None = None
    trajectory_type: type | None = None

    def __post_init__(self):
        for name in ("num_chunks", "num_epochs", "batch_size", "num_env_ranks", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrajectoryPlan.{name} must be a positive int, got {value!r}")
        if self.mode not in MODES:
            raise ValueError(f"TrajectoryPlan.mode must be one of {MODES}, got {self.mode!r}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(
                f"TrajectoryPlan.advantage must be one of {ADVANTAGES}, got {self.advantage!r}"
            )
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.gae_lambda <= 1.0:
            raise ValueError(
                f"TrajectoryPlan.gamma and gae_lambda must lie in [0, 1], got "
                f"{self.gamma!r} and {self.gae_lambda!r}"
            )
        if not 0.0 < self.action_gamma <= 1.0:
            raise ValueError(
                f"TrajectoryPlan.action_gamma must lie in (0, 1], got {self.action_gamma!r}"
            )
        if self.actor_ranks < 1 or self.micro_batch_size < 0:
            raise ValueError(
                f"TrajectoryPlan.actor_ranks must be >= 1 and micro_batch_size >= 0, got "
                f"{self.actor_ranks!r} and {self.micro_batch_size!r}"
            )
        if self.resend not in ("reject", "accept_identical"):
            raise ValueError(
                f"TrajectoryPlan.resend must be 'reject' or 'accept_identical', got {self.resend!r}"
            )
        if self.truncation_bootstrap not in BOOTSTRAP:
            raise ValueError(
                f"TrajectoryPlan.truncation_bootstrap must be one of {BOOTSTRAP}, "
                f"got {self.truncation_bootstrap!r}"
            )
        if self.lerobot_frame not in FRAMES or self.episode_overflow not in OVERFLOW:
            raise ValueError(
                f"TrajectoryPlan.lerobot_frame must be one of {FRAMES} and episode_overflow one "
                f"of {OVERFLOW}, got {self.lerobot_frame!r} and {self.episode_overflow!r}"
            )
        if self.max_episode_length < 1:
            raise ValueError(
                f"TrajectoryPlan.max_episode_length must be >= 1, got {self.max_episode_length!r}"
            )
        norm = self.normalize_advantages
        if not isinstance(norm, bool | str) or norm not in NORMALIZE:
            raise ValueError(
                "TrajectoryPlan.normalize_advantages must be 'global' (True), 'per_rank' or "
                f"'none' (False), got {self.normalize_advantages!r}"
            )
        if self.nonfinite not in NONFINITE:
            raise ValueError(
                f"TrajectoryPlan.nonfinite must be one of {NONFINITE}, got {self.nonfinite!r}"
            )

    @property
    def advantage_normalization(self) -> str:
        """``normalize_advantages`` by name: ``"global"``, ``"per_rank"`` or ``"none"``."""
        return NORMALIZE[self.normalize_advantages]

    @property
    def num_sources(self) -> int:
        """Sources owned by default: ``num_env_ranks * num_stages``."""
        return self.num_env_ranks * self.num_stages

    def default_sources(self) -> list[tuple[int, int]]:
        """``(env_rank, stage_id)`` of every default source, in source-index order."""
        return [(r, s) for r in range(self.num_env_ranks) for s in range(self.num_stages)]
