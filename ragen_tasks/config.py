"""Typed, frozen configuration: one pydantic model per concern, every field described.

Bad values fail at load with the field's dotted name and the allowed values. Derived values are
properties, never mutations. Pure functions (``algos/``) never take a config object: the caller
unpacks the fields it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

KlMode = Literal["none", "in_reward", "in_loss"]
FilterMode = Literal["highest_std", "lowest_std", "nonzero_std"]
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"  # a Kubernetes name (RFC 1123 label)
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$"  # a Kubernetes resource quantity: 8, 500m, 64Gi


class ConfigError(ValueError):
    """A preset, file or override that cannot become a valid TrainConfig. The message is one line."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EnvSpec(_Frozen):
    """One game in the training mixture (env mixtures are part of task diversity)."""

    name: str = Field(description="registry name: bandit, sokoban or frozen_lake")
    weight: float = Field(1.0, gt=0, description="share of the initial-state groups drawn from this game")
    config: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for ragen_tasks.envs.make")

    @model_validator(mode="after")
    def _known_game(self) -> EnvSpec:
        # Checked at load, so a typo fails before any work (warm start, run id) and not deep in a rollout.
        from ragen_tasks.envs._common import load_config
        from ragen_tasks.envs.registry import ENV_NAMES, config_model

        if self.name not in ENV_NAMES:
            raise ValueError(f"envs.name={self.name!r} is not a game; valid names: {', '.join(ENV_NAMES)}")
        load_config(config_model(self.name), self.name, self.config)  # raises naming game.option=value
        return self


class ModelConfig(_Frozen):
    name_or_path: str = Field(
        "tiny",
        description="a preset ('tiny', 'tiny-cells', 'tiny-rows', 'tiny-wide', 'tiny-deep', 'tiny-deep-rows', "
        "'tiny-rows-composed', 'tiny-rows-words', 'base', 'small': built from a config, "
        "tokenizer trained locally), a HF hub id or a local folder",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights / compute dtype")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:0 ...")


class AgentConfig(_Frozen):
    """The agent turn: prompt, answer format, limits (interaction granularity lives here)."""

    think: bool = Field(True, description="answer <think>..</think><answer>..</answer>; False: <answer> only")
    max_turns: int = Field(5, ge=1, description="turns per episode before truncation")
    max_actions_per_turn: int = Field(5, ge=1, description="interaction granularity: actions executed per turn")
    max_actions_per_episode: int = Field(10, ge=1, description="actions per episode before truncation")
    format_penalty: float = Field(
        -0.1, le=0, description="reward of a turn whose answer can't be parsed or holds an invalid action"
    )
    max_tokens_per_turn: int = Field(64, ge=1, description="generation cap of one response")
    max_context_tokens: int = Field(
        2048, ge=16, description="episode stops cleanly (status 'context') before exceeding this"
    )
    loss_on_observations: bool = Field(
        False,
        description="also train on observation tokens with the trajectory's advantage (the paper's original "
        "runs); needs algo.advantage grpo or batch_norm (GAE's critic only values policy tokens)",
    )
    loss_on_reasoning: bool = Field(
        True,
        description="RL also trains each turn's reasoning (<think>..</think>); false: only what follows it (the "
        "answer), so the reasoning stays what the warm start taught. A turn that never closes </think>, or ends "
        "with it, is trained whole. The warm start always trains on its demonstrations' reasoning",
    )

    @model_validator(mode="after")
    def _reasoning_to_leave(self) -> AgentConfig:
        if not self.loss_on_reasoning and not self.think:
            raise ValueError(
                "agent.loss_on_reasoning=false needs agent.think=true (without <think> there is no reasoning to "
                "leave out of the loss); set agent.loss_on_reasoning=true"
            )
        return self


class RolloutConfig(_Frozen):
    """How trajectories are sampled: the engine, task diversity, sampling, and where rollouts run.

    Sharding (one way per engine kind): a local engine (hf, vllm, a dotted path) splits each
    batch over ``shards`` spawned processes; the ``openai`` engine splits it over the servers listed
    in ``engine_options.base_urls``, one shard each. Whole groups stay on one shard and the merged
    batch is in task order, equal to one engine's for the same seeds (``rollout/shards.py``)."""

    engine: str = Field("hf", description="hf, vllm, openai, or a dotted path 'module:Class'")
    groups: int = Field(8, ge=1, description="task diversity: initial states per iteration")
    group_size: int = Field(8, ge=1, description="rollouts per initial state (GRPO / filter group size)")
    min_plan_length: int = Field(
        0,
        ge=0,
        description="curriculum over difficulty: train only on initial states whose shortest solution takes at "
        "least this many actions and no more than the game's max_actions_per_episode (games with a solver: "
        "sokoban); 0 = the game's own distribution. Held-out "
        "evaluation always plays the game's own distribution",
    )
    long_plan_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="with rollout.min_plan_length: the share of each iteration's groups drawn from the long plans "
        "(the first round(share * groups)); the rest keep the game's own distribution",
    )
    temperature: float = Field(
        1.0,
        ge=0,
        description="sampling temperature of the training rollouts; 0 = greedy. The update trains the "
        "temperature-1 policy (engines report temperature-1 log-probs), so another value samples off that policy "
        "without correction (verl trains the tempered policy instead)",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="top-k sampling; 0 = off")
    engine_options: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the engine: hf {reuse_cache, fast}; vllm {gpu_memory_utilization, "
        "max_model_len, ...}; openai {model: the name the server serves (required), base_url: one server, OR "
        "base_urls: [url, ...] to split each batch over several servers (one shard per URL, run concurrently), "
        "timeout_s, max_concurrency}",
    )
    shards: int = Field(
        1,
        ge=1,
        description="split each rollout batch (whole groups together) over N local rollout processes (spawned), "
        "each building its own engine from the checkpoint; the merged batch equals one process's for the same "
        "seeds. 1 = in the stage's own process. The openai engine shards by engine_options.base_urls instead",
    )
    mode: Literal["inprocess", "deployment", "async"] = Field(
        "inprocess",
        description="inprocess: every stage in the train flow; deployment: rollout and update run as "
        "separate Prefect deployments (run_deployment, store URIs only); async: rollout workers commit batches "
        "continuously and the trainer consumes fresh ones (freshness.max_staleness)",
    )
    rollout_deployment: str = Field(
        "ragen-rollout-stage/rollout-stage",
        description="mode=deployment: '<flow>/<deployment>' that runs the rollout stage",
    )
    update_deployment: str = Field(
        "ragen-update-stage/update-stage",
        description="mode=deployment: '<flow>/<deployment>' that runs the update stage",
    )
    stage_timeout_s: float = Field(3600.0, gt=0, description="mode=deployment: seconds to wait for one stage run")
    async_poll_s: float = Field(
        1.0, gt=0, description="mode=async: seconds between polls of the store (workers and trainer)"
    )
    async_wait_timeout_s: float = Field(
        900.0,
        gt=0,
        description="mode=async: the trainer fails (naming max_staleness) after waiting this long for a fresh batch",
    )
    async_warn_after_s: float = Field(
        60.0, gt=0, description="mode=async: warn once after waiting this long for a fresh batch"
    )
    async_batches_per_version: int = Field(
        1,
        ge=1,
        description="mode=async: batches one worker commits per policy version before waiting for a newer checkpoint",
    )

    @model_validator(mode="after")
    def _sharding(self) -> RolloutConfig:
        opts = self.engine_options
        if "base_urls" in opts:
            urls = opts["base_urls"]
            if self.engine != "openai":
                raise ValueError(
                    f"rollout.engine_options.base_urls is for rollout.engine 'openai' (got {self.engine!r}); "
                    "remove it, and use rollout.shards for local rollout processes"
                )
            if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
                raise ValueError(
                    f"rollout.engine_options.base_urls={urls!r} must be a non-empty list of server URLs, "
                    "e.g. ['http://10.0.0.5:8000', 'http://10.0.0.6:8000']"
                )
            for i, url in enumerate(urls):
                if not url.startswith(("http://", "https://")):
                    raise ValueError(
                        f"rollout.engine_options.base_urls[{i}]={url!r} must start with http:// or https:// "
                        "(e.g. http://127.0.0.1:8000)"
                    )
            seen = [u.rstrip("/").removesuffix("/v1") for u in urls]
            if len(set(seen)) != len(seen):
                raise ValueError(
                    f"rollout.engine_options.base_urls={urls!r} names one server twice; list each server once "
                    "(one server already batches all the requests it gets)"
                )
            if "base_url" in opts:
                raise ValueError(
                    "rollout.engine_options has both base_url and base_urls; give base_url for one server or "
                    "base_urls for several"
                )
        if self.engine == "openai":
            if self.shards != 1:
                raise ValueError(
                    f"rollout.shards={self.shards} with rollout.engine 'openai': shard over servers with "
                    "rollout.engine_options.base_urls=[url, ...] (one shard per server) and keep rollout.shards=1"
                )
            if "base_url" not in opts and "base_urls" not in opts:
                raise ValueError(
                    "rollout.engine 'openai' needs rollout.engine_options.base_url (one server) or base_urls "
                    "(several), e.g. base_url: http://127.0.0.1:8000"
                )
            if not isinstance(opts.get("model"), str) or not opts["model"]:
                raise ValueError(
                    f"rollout.engine 'openai' needs rollout.engine_options.model (got {opts.get('model')!r}): the "
                    "model name the server serves (vllm serve's --served-model-name, or its model path)"
                )
        return self

    @property
    def shard_engine_options(self) -> list[dict[str, Any]]:
        """The engine options of each rollout shard: one per URL of ``engine_options.base_urls`` (each
        with that ``base_url``), else ``shards`` copies of ``engine_options``."""
        opts = {k: v for k, v in self.engine_options.items() if k != "base_urls"}
        if "base_urls" in self.engine_options:
            return [{**opts, "base_url": url} for url in self.engine_options["base_urls"]]
        return [dict(opts) for _ in range(self.shards)]


#: The advantage estimators that credit each turn by the game's optimal values (``training.turn_values``).
TURN_ADVANTAGES: tuple[str, ...] = ("turn_td", "turn_q")


class AlgoConfig(_Frozen):
    """StarPO / StarPO-S knobs (see ragen_tasks.algos for the math)."""

    advantage: Literal["gae", "grpo", "batch_norm", "turn_td", "turn_q"] = Field(
        "gae",
        description="advantage estimator: 'gae' (a critic), 'grpo' (the group's z-score), 'batch_norm' (the batch's "
        "z-score), 'turn_td' (each turn's TD(lam) error against the game's exact optimal value of its state, "
        "whitened over the batch's turns; FrozenLake only: potential-based shaping by the slip-aware planner's "
        "success probability, which leaves the best policy unchanged), 'turn_q' (each turn's exact advantage "
        "Q*(s, a) - V*(s) under that value, the slips averaged out; FrozenLake only)",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount over policy tokens")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (and turn_td's, over turns)")
    grpo_scale_by_std: bool = Field(True, description="GRPO divides by the group std; False = Dr. GRPO")
    clip_low: float = Field(0.2, gt=0, lt=1, description="PPO eps_low: ratio clipped below at 1 - clip_low")
    clip_high: float = Field(
        0.28, gt=0, description="PPO eps_high: ratio clipped above at 1 + clip_high (StarPO-S 0.28)"
    )
    dual_clip_c: float | None = Field(None, gt=1, description="dual-clip constant for negative advantages; None = off")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="how token losses are aggregated"
    )
    kl_mode: KlMode = Field("none", description="KL to the reference policy")
    kl_coef: float = Field(0.001, ge=0, description="KL coefficient")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="KL estimator")
    value_clip: float = Field(0.5, gt=0, description="critic value clipping range")
    filter_keep_ratio: float = Field(
        0.25, gt=0, le=1, description="fraction of groups kept by in-group reward std; 1 = off"
    )
    filter_mode: FilterMode = Field("highest_std", description="which groups the uncertainty filter keeps")
    drop_zero_advantage: bool = Field(
        False,
        description="StarPO-S speed-up (model-free estimators: grpo, batch_norm, turn_td, turn_q): drop "
        "trajectories whose advantage is 0 on every token before the update. It changes the token-mean "
        "denominator (fewer tokens), so it is not vanilla: False keeps every row, as verl / RAGEN do",
    )
    demo_loss_coef: float = Field(
        0.0,
        ge=0,
        description="supervised term kept through RL: every optimizer step adds this times the warm start's loss "
        "(mean negative log-likelihood per demonstrated token) on algo.demo_episodes fresh demonstration episodes "
        "(the warm start's demonstrator and reasoning, training seeds of their own). 0 = off, the paper's loss",
    )
    demo_episodes: int = Field(
        8, ge=1, description="demonstration episodes per optimizer step for the supervised term (algo.demo_loss_coef)"
    )
    demo_noise: float | None = Field(
        None,
        ge=0,
        le=1,
        description="the supervised term's demonstrator noise (the share of its actions replaced by random ones); "
        "None = warm_start.demo_noise",
    )


LrSchedule = Literal["constant", "linear"]


def scheduled_lr(base: float, step: int, steps: int, schedule: LrSchedule, *, end_fraction: float = 0.0) -> float:
    """The rate of step ``step`` (0-based, clamped to 0..``steps``) of ``steps`` under ``schedule``:
    ``base``, or under ``linear`` ``base * (1 - (1 - end_fraction) * step / steps)``, so the first step
    is at ``base`` and the rate after the last would be ``base * end_fraction``. Shared by the RL
    optimizers (``OptimConfig.lr_at``, over iterations) and the warm start (over supervised steps)."""
    if schedule == "constant":
        return base
    done = min(max(step, 0), steps) / steps
    return base * (1.0 - (1.0 - end_fraction) * done)


class OptimConfig(_Frozen):
    backend: Literal["torch", "deepspeed"] = Field("torch", description="update backend")
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage")
    lr: float = Field(1e-5, gt=0, description="actor learning rate")
    critic_lr: float = Field(1e-5, gt=0, description="critic learning rate")
    lr_schedule: LrSchedule = Field(
        "constant",
        description="learning rates over the run's iterations: constant, or linear decay from optim.lr / critic_lr "
        "at the first iteration towards lr_end_fraction of them after the last (a function of the iteration and "
        "`iterations`: a run resumed with more iterations continues on the longer schedule, from a higher rate)",
    )
    lr_end_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="linear lr_schedule: the fraction of the learning rates reached after the last iteration",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch")
    minibatch_size: int = Field(32, ge=1, description="trajectories per optimizer step")
    micro_batch_size: int = Field(8, ge=1, description="trajectories per forward/backward (gradient accumulation)")
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="packed micro-batches: at most this many padded tokens (rows x longest row) per forward/backward, "
        "rows sorted by length so each micro-batch pads only to its own longest; None = micro_batch_size rows only",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    max_consecutive_skips: int = Field(3, ge=1, description="abort after this many non-finite steps in a row")
    max_weight_abs: float = Field(
        1e4,
        gt=0,
        description="an update that leaves a weight with |w| above this (or non-finite) has diverged: its "
        "checkpoint is never committed and the run stops, naming the cause",
    )
    seed: int = Field(0, description="minibatch shuffling / init seed")
    amp_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="update compute dtype: bfloat16 = torch.autocast (weights and optimizer stay float32)"
    )

    def lr_at(self, name: str, iteration: int, iterations: int) -> float:
        """Learning rate of the ``name`` optimizer for the update of ``iteration`` (0-based) in a run of
        ``iterations``: under the linear schedule the update of iteration i steps at
        ``base * (1 - (1 - lr_end_fraction) * i / iterations)``, so the first update steps at the base rate
        and the rate after the last one would be ``base * lr_end_fraction``."""
        if name not in ("actor", "critic"):
            raise ValueError(f"no learning rate for an optimizer called {name!r}: expected 'actor' or 'critic'")
        base = self.lr if name == "actor" else self.critic_lr
        return scheduled_lr(base, iteration, iterations, self.lr_schedule, end_fraction=self.lr_end_fraction)


class UpdateConfig(_Frozen):
    """Where the update stage runs: how many data-parallel ranks share one update (see
    ``ragen_tasks.training.distributed``). Each rank takes a token-balanced shard of every minibatch;
    the backend (torch DDP, or DeepSpeed ZeRO with ``optim.backend: deepspeed``) averages gradients."""

    world_size: int = Field(
        1,
        ge=0,
        description="data-parallel ranks per node: 1 = in the stage's own process (no launcher); N > 1 = "
        "torchrun --nproc-per-node N; 0 = one rank per visible GPU (a pod's gpu_count)",
    )
    nnodes: int = Field(
        1,
        ge=1,
        description="nodes (pods) of one update: > 1 runs the ranks as a Kubernetes Indexed Job with torchrun's "
        "c10d rendezvous (see k8s/README.md)",
    )
    # The fields below place a multi-node update (nnodes > 1) on the cluster; a single-node update ignores them.
    gpus_per_node: int = Field(
        0,
        ge=0,
        description="nnodes > 1: GPUs each update pod requests (nvidia.com/gpu) and its ranks (--nproc-per-node); "
        "0 = update.world_size",
    )
    job_timeout_s: float = Field(
        7200.0,
        gt=0,
        description="nnodes > 1: seconds the stage waits for the Indexed Job (scheduling included) before deleting it "
        "and failing; also the Job's activeDeadlineSeconds",
    )
    rendezvous_timeout_s: float = Field(
        900.0,
        gt=0,
        description="nnodes > 1: seconds torchrun's c10d rendezvous waits for every pod to join (GPU nodes can take "
        "minutes to scale up)",
    )
    namespace: str = Field(
        "ragen", pattern=_DNS_LABEL, description="nnodes > 1: namespace of the Indexed Job and its headless Service"
    )
    image: str | None = Field(
        None,
        min_length=1,
        description="nnodes > 1: image of the update pods; None = $RAGEN_UPDATE_IMAGE, which the GPU work-pool "
        "template sets to its own image (the GPU training image)",
    )
    cpu_per_node: str = Field("8", pattern=_QUANTITY, description="nnodes > 1: CPU request of each update pod")
    memory_per_node: str = Field(
        "64Gi",
        pattern=_QUANTITY,
        description="nnodes > 1: memory request and limit of each update pod (the /dev/shm volume counts against it)",
    )
    shm_size: str = Field(
        "16Gi",
        pattern=_QUANTITY,
        description="nnodes > 1: size of the memory-backed /dev/shm of each update pod (NCCL)",
    )
    scratch_pvc: str = Field(
        "ragen-update-scratch",
        pattern=_DNS_SUBDOMAIN,
        description="nnodes > 1: ReadWriteMany PersistentVolumeClaim mounted at /scratch ($RAGEN_SCRATCH) in every "
        "update pod: every rank writes its checkpoint parts into one folder there",
    )
    node_selector: dict[str, str] = Field(
        default_factory=lambda: {"nvidia.com/gpu.present": "true"},
        description="nnodes > 1: nodeSelector of the update pods (the GPU work-pool template's default)",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="nnodes > 1: tolerations of the update pods (the GPU work-pool template's default)",
    )

    @property
    def ranks_per_node(self) -> int:
        """``--nproc-per-node`` of a multi-node update (0 when neither world_size nor gpus_per_node is set)."""
        return self.world_size or self.gpus_per_node

    @model_validator(mode="after")
    def _placement(self) -> UpdateConfig:
        if self.nnodes > 1 and self.ranks_per_node == 0:
            raise ValueError(
                f"update.nnodes={self.nnodes} needs the GPUs of each pod: set update.gpus_per_node (or "
                "update.world_size) to a whole number > 0 (0 = one rank per visible GPU works on one node only)"
            )
        if self.nnodes > 1 and self.world_size and self.gpus_per_node and self.world_size != self.gpus_per_node:
            raise ValueError(
                f"update.world_size={self.world_size} and update.gpus_per_node={self.gpus_per_node} disagree: "
                f"each rank needs one GPU of its pod; set update.world_size to 0 (one rank per GPU) or to "
                f"{self.gpus_per_node}"
            )
        return self


class FreshnessConfig(_Frozen):
    max_staleness: int = Field(
        0, ge=0, description="rollout freshness: policy-version lag allowed; 0 = strictly on-policy"
    )


class StoreConfig(_Frozen):
    """Where run data lives, and the reward bounds the batch validation (GX) enforces."""

    root: str = Field("runs", description="store root: a local folder, file://... or s3://bucket/prefix")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="extra fsspec/s3fs options; endpoint and credentials come from AWS_* env vars, never put secrets here",
    )
    reward_min: float = Field(-50.0, description="batch validation: lowest allowed trajectory reward")
    reward_max: float = Field(50.0, description="batch validation: highest allowed trajectory reward")
    lease_stale_s: float = Field(
        300.0,
        gt=0,
        description="a run's writer lease whose heartbeat is older than this is stale and may be taken over "
        "(a holder on this host whose process is gone is stale at once)",
    )


class CheckpointConfig(_Frozen):
    keep_last: int = Field(2, ge=1, description="committed checkpoints kept")


class EvalConfig(_Frozen):
    every: int = Field(5, ge=1, description="evaluate every N iterations (and after the last)")
    seeds: int = Field(32, ge=1, le=100_000, description="held-out seeds per env (evaluation.MAX_EVAL_SEEDS at most)")
    seed_offset: int = Field(1_000_000, ge=0, description="first held-out seed (training seeds stay below it)")
    temperature: float = Field(0.0, ge=0, description="evaluation sampling temperature; 0 = greedy (deterministic)")


class WarmStartConfig(_Frozen):
    """A short supervised stage that teaches the answer FORMAT before RL (a tiny model built from
    scratch cannot know it). Bandit demonstrations pick an arm uniformly at random (arm-neutral:
    the warm start must not teach the answer); FrozenLake/Sokoban demonstrations come from the
    solvers, so RL has to improve on them."""

    enabled: bool = Field(
        True,
        description="run the warm start before RL; presets only (another model starts RL as it is, with a warning)",
    )
    episodes_per_env: int = Field(256, ge=1, description="demonstration episodes per env in the mixture")
    steps: int = Field(150, ge=0, description="supervised optimizer steps on whole demonstration episodes")
    turn_steps: int = Field(
        0,
        ge=0,
        description="supervised optimizer steps before `steps`, on the demonstrations cut into turns: each turn "
        "with only its own observation (one board in context, no earlier turns), about a third of an "
        "episode's tokens. On the lake the tiny model then learns to read the board from a few hundred "
        "episode steps instead of as a late transition or never; 0 = none",
    )
    batch_size: int = Field(32, ge=1, description="sequences per supervised step")
    lr: float = Field(3e-3, gt=0, description="supervised learning rate")
    lr_schedule: LrSchedule = Field(
        "constant", description="supervised learning rate over the steps: constant, or linear decay from lr to 0"
    )
    demo_noise: float = Field(
        0.3,
        ge=0,
        le=1,
        description="FrozenLake/Sokoban demonstrations: fraction of solver actions replaced by random ones",
    )
    demo_actions_per_turn: int | None = Field(
        None,
        ge=1,
        description="FrozenLake/Sokoban demonstrations: at most this many actions per turn (FrozenLake's "
        "slip-aware planner plans under that limit; Sokoban's solver plan is cut to it), while the agent may "
        "still answer up to agent.max_actions_per_turn. None = agent.max_actions_per_turn",
    )
    reasoning: Literal[
        "relative",
        "neighbours",
        "neighbours-turns",
        "neighbours-diagonals",
        "neighbours-diagonals-turns",
        "rows-neighbours-diagonals-turns",
        "cells-neighbours-diagonals-turns",
        "fixed",
    ] = Field(
        "relative",
        description="the demonstrations' <think> text: 'relative' states where the things that matter lie, in "
        "action names (Sokoban: the box from the player, the target from the box; FrozenLake: the goal), read "
        "from the board; 'neighbours' adds what lies one step from the player on each side (FrozenLake: hole, "
        "frozen, goal, wall; Sokoban: wall, box, target, floor); 'neighbours-diagonals' then adds the four cells "
        "one step away diagonally ('Up Left hole.'); a '-turns' suffix then restates the prompt's turns left "
        "('Turns left: 3.'); a 'rows-' prefix copies the board's rows above and below the player after the "
        "relative text ('Above: _O__. Below: wall.'), a 'cells-' prefix copies them cell by cell ('Above: _ O _ _.'); "
        "'fixed' is one sentence per game. Bandit reasoning never names an arm",
    )
    seed: int | None = Field(
        None,
        description="seed of the demonstrations and the supervised steps; None = the run's seed. Set it to "
        "vary only RL across runs that share one (cached) warm start",
    )

    def seed_for(self, run_seed: int) -> int:
        """The seed the warm start uses in a run whose root seed is ``run_seed``."""
        return run_seed if self.seed is None else self.seed


class GuardConfig(_Frozen):
    """The Echo-Trap guard: what to do when the detector fires (see ragen_tasks.algos.echo_trap)."""

    action: Literal["off", "warn", "stop", "rollback"] = Field("warn", description="reaction to a fired signal")
    max_rollbacks: int = Field(2, ge=0, description="rollbacks allowed per run before stopping")
    mitigation: Literal["lower_lr", "stronger_filter", "starpo_s"] = Field(
        "lower_lr",
        description="applied after a rollback: halve the LR, halve filter_keep_ratio, or switch to StarPO-S settings",
    )
    rules: dict[str, Any] = Field(
        default_factory=dict,
        description="detector thresholds overriding EchoTrapRules defaults, e.g. {std_collapse_fraction: 0.3}",
    )


class TrainConfig(_Frozen):
    """A whole training run. Presets in ragen_tasks/presets/*.yaml are instances of this."""

    preset: str = Field("custom", description="name of the preset (or file) this config came from; reports only")
    run_id: str | None = Field(None, description="run folder name; None = derived from the preset and time")
    iterations: int = Field(
        20,
        ge=1,
        le=999_998,
        description="StarPO iterations (at most 999,998: the task seed streams from 999,999 on are the demonstrations')",
    )
    seed: int = Field(0, description="root seed of the run")
    envs: list[EnvSpec] = Field(
        default_factory=lambda: [EnvSpec(name="bandit")], min_length=1, description="training mixture"
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="policy model")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="agent turn")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="algorithm")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer / backend")
    update: UpdateConfig = Field(default_factory=UpdateConfig, description="data-parallel ranks of the update")
    freshness: FreshnessConfig = Field(default_factory=FreshnessConfig, description="freshness")
    store: StoreConfig = Field(default_factory=StoreConfig, description="store")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig, description="supervised format warm start")
    guard: GuardConfig = Field(default_factory=GuardConfig, description="Echo-Trap guard")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.agent.loss_on_observations and self.algo.advantage in ("gae", *TURN_ADVANTAGES):
            raise ValueError(
                f"agent.loss_on_observations=true needs algo.advantage 'grpo' or 'batch_norm' "
                f"({self.algo.advantage!r} gives observation tokens no advantage); set one of them differently"
            )
        if self.algo.advantage in TURN_ADVANTAGES:
            self._games_have_values()
        if self.rollout.min_plan_length:
            self._curriculum_fits()
        demo_limit = self.warm_start.demo_actions_per_turn
        if demo_limit is not None and demo_limit > self.agent.max_actions_per_turn:
            raise ValueError(
                f"warm_start.demo_actions_per_turn={demo_limit} is more than agent.max_actions_per_turn="
                f"{self.agent.max_actions_per_turn}: demonstrations would answer what the agent may not; "
                f"lower it or leave it unset (None)"
            )
        if self.guard.action in ("stop", "rollback") and self.checkpoint.keep_last < 2:
            raise ValueError(
                f"guard.action={self.guard.action!r} needs checkpoint.keep_last >= 2 (the healthy "
                f"checkpoint must survive pruning); got {self.checkpoint.keep_last}"
            )
        return self

    def _games_have_values(self) -> None:
        """algo.advantage=turn_td / turn_q replay each episode in its game's one config and value its states."""
        from ragen_tasks.training.turn_values import GAMES_WITH_VALUES

        names = [spec.name for spec in self.envs]
        for name in names:
            if name not in GAMES_WITH_VALUES:
                raise ValueError(
                    f"algo.advantage={self.algo.advantage!r} needs each game's optimal state values, and envs "
                    f"holds {name!r}, which has none (games with values: {', '.join(GAMES_WITH_VALUES)}); "
                    "use 'grpo' or 'gae'"
                )
            if names.count(name) > 1:
                raise ValueError(
                    f"algo.advantage={self.algo.advantage!r} replays each episode in its game's config, and "
                    f"envs lists {name!r} {names.count(name)} times; keep one entry per game"
                )

    def _curriculum_fits(self) -> None:
        """``rollout.min_plan_length`` can be met: games with a solver, plans within the episode's
        action budget, and at least one group of each iteration drawn from the long plans."""
        from ragen_tasks.envs._common import load_config
        from ragen_tasks.envs.registry import config_model, has_solver

        length = self.rollout.min_plan_length
        unsolvable = [spec.name for spec in self.envs if not has_solver(spec.name)]
        if unsolvable:
            raise ValueError(
                f"rollout.min_plan_length={length} needs games with a solver (sokoban); "
                f"{', '.join(unsolvable)} has none: set rollout.min_plan_length to 0"
            )
        if length > self.agent.max_actions_per_episode:
            raise ValueError(
                f"rollout.min_plan_length={length} is more than agent.max_actions_per_episode="
                f"{self.agent.max_actions_per_episode}: no room that long can be solved; lower it"
            )
        for spec in self.envs:
            budget = load_config(config_model(spec.name), spec.name, spec.config).max_actions_per_episode
            if length > budget:
                raise ValueError(
                    f"rollout.min_plan_length={length} is more than {spec.name}.max_actions_per_episode={budget}: "
                    "no room that long can be solved; lower it"
                )
        long_groups = round(self.rollout.long_plan_share * self.rollout.groups)
        if long_groups == 0:
            raise ValueError(
                f"rollout.long_plan_share={self.rollout.long_plan_share} of rollout.groups={self.rollout.groups} "
                f"rounds to no group, so rollout.min_plan_length={length} would change nothing: raise "
                f"long_plan_share to at least {1 / self.rollout.groups:.3g} or set min_plan_length to 0"
            )


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``top`` wins. Lists and scalars are replaced, not merged."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def set_dotted(data: Mapping[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``data`` (a TrainConfig as a dict) with the field at dotted ``key`` (``"optim.lr"``) set to
    ``value`` (merged into a dict-valued field). A key that names no field raises ConfigError listing
    the valid keys at its level; values are checked when the result is validated."""
    path = key.split(".")
    model: type[BaseModel] | None = TrainConfig
    for depth, part in enumerate(path):
        if model is None:
            break  # inside a free-form dict (e.g. an env's config): its consumer validates it
        if part not in model.model_fields:
            where = ".".join(path[:depth]) or "top level"
            raise ConfigError(f"unknown key {part!r} at {where}; valid keys: {', '.join(sorted(model.model_fields))}")
        annotation = model.model_fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    patch: Any = value
    for part in reversed(path):
        patch = {part: patch}
    return deep_merge(data, patch)


def with_overrides(config: TrainConfig, overrides: Mapping[str, Any]) -> TrainConfig:
    """``config`` with dotted-key ``overrides`` (``{"optim.lr": 1e-4}``) applied, validated again."""
    data = config.model_dump(mode="json")
    for key, value in overrides.items():
        data = set_dotted(data, key, value)
    return TrainConfig.model_validate(data)
