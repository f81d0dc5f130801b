"""The experiment config: one pydantic tree, extra keys forbidden, every field described.

Cross-field rules live in one validator (`ExperimentConfig._cross_checks`) that reports every problem
at once, each naming the field and the fix. The engine section is a list of entries chosen by `kind`
(a discriminated union built from the engine kinds' plug-ins, config/engines/), so vLLM/SGLang options are validated
without importing either package.

This module only describes and validates; loading YAML, overrides and imports of user code live in loader.py.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError   # RewardSection's messages, without pydantic's "Value error," prefix

from rlhf_orch.config.base import _Section
# The engine entries: one config class per kind, each in its kind's plug-in (config/engines/); re-exported here.
from rlhf_orch.config.engines import EngineConfig
from rlhf_orch.config.nodes import NodesSection
from rlhf_orch.config.run_sections import ExperimentSection, RaySection  # noqa: F401 (re-exported)
from rlhf_orch.metrics.trackers import renamed_keys_message, tracker_problems, wandb_online_problem
from rlhf_orch.models.tiny import BUILTIN_PREFIX, TinyModelSpec
from rlhf_orch.rewards import NO_FUNCTION
from rlhf_orch.rewards.model import reward_model_problem


class ModelSection(_Section):
    path: str = Field("builtin:tiny-llama", description="HF model folder, or 'builtin:tiny-llama' to build one in code.")

    @field_validator("path")
    @classmethod
    def _local_folder(cls, v: str) -> str:
        # rlhf_orch never downloads: without this, transformers reads a missing path as a hub repo id and fails
        # deep in a tokenizer call (HFValidationError) or tries the network.
        import os
        if v.startswith("builtin:"):
            return v
        if not os.path.isdir(v):
            raise PydanticCustomError("model_path", "not a local folder (rlhf_orch does not download models); give a "
                                      "Hugging Face model folder (config.json, weights, tokenizer) or builtin:tiny-llama")
        if not os.path.isfile(os.path.join(v, "config.json")):
            raise PydanticCustomError("model_path", "the folder has no config.json, so it is not a Hugging Face model "
                                      "folder; point model.path at the folder save_pretrained wrote")
        return v
    tiny: TinyModelSpec = Field(default_factory=TinyModelSpec, description="Shape of the built-in model.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Engine and sync dtype.")


class DataSection(_Section):
    """Where prompts come from. File sources: a .jsonl, .json, .parquet or .arrow file, or a folder of them (or one
    written by datasets' save_to_disk); every format but JSONL needs `pip install -e ".[data]"`. Rows keep all their
    columns; "prompt" becomes the rendered text and "answer" the value at answer_key (rlhf_orch/data/rows.py)."""
    source: str = Field("builtin:arithmetic", description="'builtin:arithmetic', 'builtin:reverse', or a file "
                        "(.jsonl, .json, .parquet, .arrow) or folder of them; relative paths are from the working directory.")
    split: str = Field("train", min_length=1, description="File sources: the split to train on (a folder's train.parquet, "
                       "test.parquet, ... or a saved DatasetDict's splits); a single file is this split.")
    prompt_key: str = Field("prompt", min_length=1, description="File sources: dotted path of the prompt in each row "
                            "(e.g. 'prompt', 'question', 'extra_info.question'): a string, or a list of chat messages "
                            "({role, content}) rendered with the tokenizer's chat template.")
    agent_key: str = Field("agent_name", min_length=1, description="rollout.agent: dotted path of the row's agent name "
                           "(verl's agent datasets: agent_name), looked up in rollout.agents.")
    answer_key: str = Field("answer", min_length=1, description="File sources: dotted path of the reference answer "
                            "(verl's GSM8K: reward_model.ground_truth); copied into the row's 'answer' as a string.")
    system_prompt: str | None = Field(None, description="File sources: a system message put before every chat prompt "
                                      "that has none of its own.")
    chat_template: bool = Field(False, description="File sources: render string prompts as one user message with the "
                                "chat template (message lists are always rendered).")
    chat_template_path: str | None = Field(None, description="File sources: a Jinja chat template file used instead of "
                                           "the tokenizer's (needed when the tokenizer has none, e.g. the built-in one).")
    max_operand: int = Field(4, ge=1, le=99, description="builtin:arithmetic: operands run 0..max_operand.")
    prompts_per_step: int = Field(16, ge=1, description="Distinct prompts per RL step.")
    max_prompt_tokens: int = Field(32, ge=1, description="Rows whose prompt is longer are rejected at load.")


class RewardSection(_Section):
    """Reward sources: reward = function_weight * function + model_weight * reward model (either may be absent).

    Checked here, before any actor starts: a model folder that is missing, not a sequence classifier or has more
    than one label; no source at all; both weights zero. Each problem is one line naming the field and the fix."""
    function: str = Field("rlhf_orch.rewards.builtin:exact_match", description="Dotted path 'package.module:function' "
                          "of fn(response: str, row: dict) -> float; null (or '') for none: the reward model alone "
                          "(stored as rlhf_orch.rewards:no_function).")
    num_workers: int = Field(1, ge=1, description="Reward actors scoring in parallel.")
    function_weight: float = Field(1.0, allow_inf_nan=False, description="Weight of the function's reward in the sum "
                                   "(with the default 1.0 and no model, rewards are the function's, bit for bit).")
    model_path: str | None = Field(None, validate_default=True, description="Learned reward model: a local Hugging Face "
                                   "folder holding an AutoModelForSequenceClassification with num_labels=1 and its "
                                   "tokenizer, or 'builtin:tiny-rm' (a random tiny Llama classifier with the built-in "
                                   "tokenizer, built under <output_dir>/models/). It scores prompt + response: the logit "
                                   "at the last non-pad token. null: no model.")
    model_weight: float = Field(1.0, allow_inf_nan=False, description="Weight of the reward model's score in the sum.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where reward workers run the reward model (cuda: each "
                                           "worker asks Ray for one GPU outside the trainer's and engines' placement).")
    batch_size: int = Field(16, ge=1, description="Sequences per reward-model forward pass.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Reward-model dtype.")
    batch: bool = Field(False, description="The function scores a whole chunk at once: fn(responses: list[str], rows: "
                        "list[dict]) -> list[float]. Same as decorating it with rlhf_orch.rewards.batched; for a "
                        "function you cannot edit. An `async def` function (either form) is detected by itself.")
    dense: bool = Field(False, description="The function returns one value per response token (it finds the token "
                        "ids in row['response_ids']): ppo and reinforce_pp_gamma use each token's value, grpo/rloo/"
                        "reinforce_pp their sum. Same as decorating it with rlhf_orch.rewards.dense.")
    # None by default: a limit would be a new way for an existing run to fail (a code-execution or LLM-judge reward
    # may legitimately take minutes), and an unbounded sync call runs in the caller's thread exactly as before.
    timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False, description="Seconds each call of the function "
                                    "may take (each sample's call, or a batch's one call); past it the step fails "
                                    "with an error naming the function and the prompt. A sync function then runs in "
                                    "a worker thread, which cannot be killed and is left running. null: no limit.")

    @field_validator("function", mode="before")
    @classmethod
    def _null_function(cls, v):
        return NO_FUNCTION if v is None or (isinstance(v, str) and not v.strip()) else v

    @field_validator("model_path")
    @classmethod
    def _check_model_path(cls, v, info):
        return checked_reward_model_path(v, info.data.get("function"))

    @field_validator("model_weight")
    @classmethod
    def _check_weights(cls, v, info):
        if v == 0 and info.data.get("function_weight") == 0:
            raise PydanticCustomError("reward_weights", "reward.function_weight and reward.model_weight are both 0, so "
                                      "every reward would be 0; set one of them to a non-zero weight")
        return v


def checked_reward_model_path(path: str | None, function: str | None) -> str | None:
    """reward.model_path as given, or raise a PydanticCustomError naming what is wrong and the fix (no weights load)."""
    if path is None or not str(path).strip():
        if function == NO_FUNCTION:
            raise PydanticCustomError("reward_source", "no reward source: reward.function is null and reward.model_path "
                                      "is not set; set reward.function to 'package.module:function' or reward.model_path "
                                      "to a reward-model folder (or builtin:tiny-rm)")
        return None
    if path.startswith(BUILTIN_PREFIX):
        if path != "builtin:tiny-rm":
            raise PydanticCustomError("reward_model_path", "unknown built-in reward model; the only one is builtin:tiny-rm")
        return path
    problem = reward_model_problem(path)
    if problem:
        raise PydanticCustomError("reward_model_path", problem)
    return path


class KLControlSection(_Section):
    """verl's algorithm.kl_ctrl: the weight of the KL penalty in the reward (use_kl_in_reward)."""
    type: Literal["fixed", "adaptive"] = Field("fixed", description="fixed: kl_coef throughout; adaptive: the "
                                               "controller of Ziegler et al. (verl's AdaptiveKLController) steers to target_kl.")
    kl_coef: float = Field(0.001, ge=0, description="The (initial) weight of the per-token KL penalty in the reward.")
    target_kl: float = Field(0.1, gt=0, description="adaptive: the KL the controller aims at.")
    horizon: float = Field(10000, gt=0, description="adaptive: how many samples the controller takes to close the gap.")


class AlgorithmSection(_Section):
    name: str = Field("grpo", description="Algorithm (rlhf_orch/algorithms/): grpo, rloo, reinforce_pp_baseline (verl's), "
                      "reinforce_pp, reinforce_pp_gamma (no critic) or ppo (a critic and GAE; see the critic section).")
    group_size: int = Field(8, ge=1, description="Samples per prompt (n).")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range (low side).")
    clip_eps_high: float | None = Field(None, gt=0, description="Upper clip range (default: clip_eps).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of KL(policy || frozen reference) in the loss; 0 disables the reference.")
    kl_estimator: str = Field("k3_clamped", description="KL estimator in the loss and metrics: k3_clamped (default: k3 "
                              "capped at 10 per token, verl's low_var_kl bound), k1, k2, k3 (unclamped: warns), or verl's "
                              "kl, abs, mse, low_var_kl; a '+' suffix (k3+) takes k2's gradient (straight-through), as verl.")
    loss_agg_mode: str = Field("token-mean", description="verl's loss_agg_mode: token-mean, seq-mean-token-sum, "
                               "seq-mean-token-mean or seq-mean-token-sum-norm (over the whole step, however it is split).")
    loss_norm_len: float | None = Field(None, gt=0, description="seq-mean-token-sum-norm: the constant length the token "
                                        "sums are divided by (Dr. GRPO; e.g. sampling.max_new_tokens).")
    clip_ratio_c: float | None = Field(None, gt=1, description="Dual-clip PPO (verl's clip_ratio_c, e.g. 3.0): bounds the loss "
                                       "of negative-advantage tokens at clip_ratio_c * |A| (null: off).")
    entropy_coeff: float = Field(0.0, ge=0, description="Entropy bonus weight (verl's entropy_coeff): the loss subtracts "
                                 "entropy_coeff x the entropy, aggregated like the loss.")
    norm_adv_by_std: bool = Field(True, description="grpo only: divide by the group std (False: Dr.GRPO-style centring).")
    off_policy: Literal["auto", "none", "tis", "mis", "decoupled"] = Field("auto", description="Correction for samples "
        "from another policy: none; tis (weights truncated at tis_cap); mis (outside [mis_low, mis_high] masked); decoupled "
        "(AReaL's, masked above decoupled_cap); auto (default): decoupled at max_staleness >= 1 (off_policy.py), else none.")
    tis_cap: float = Field(2.0, ge=1, description="tis: importance weights are truncated at this value.")
    mis_low: float = Field(0.5, ge=0, lt=1, description="mis: tokens with importance weight below this are masked.")
    mis_high: float = Field(2.0, gt=1, description="mis: tokens with importance weight above this are masked.")
    decoupled_cap: float = Field(5.0, gt=1, description="decoupled: tokens whose behaviour importance weight exceeds this are masked.")
    use_kl_in_reward: bool = Field(False, description="Subtract kl_ctrl.kl_coef x KL(policy || reference) from every "
                                   "response token's reward (verl's use_kl_in_reward; token-level algorithms: ppo, "
                                   "reinforce_pp_gamma). KL in the loss is kl_coef.")
    kl_ctrl: KLControlSection = Field(default_factory=KLControlSection, description="KL-in-reward weight and its controller.")
    gamma: float = Field(1.0, ge=0, le=1, description="ppo, reinforce_pp_gamma: discount (verl's algorithm.gamma).")
    lam: float = Field(1.0, ge=0, le=1, description="ppo: GAE lambda (verl's algorithm.lam).")


class CriticSection(_Section):
    """The value model of critic-based algorithms (ppo); ignored by the others. colocated (default): one critic rank
    lives beside each policy rank (same devices, same process group) and offloads with it (trainer.offload);
    separate: a DeepSpeed group of critic.num_ranks ranks of its own (one GPU each on cuda), which trains while the
    policy trains."""
    placement: Literal["colocated", "separate"] = Field("colocated", description="colocated: a critic rank inside "
                                                        "every policy rank; separate: critic.num_ranks ranks of their "
                                                        "own (their own GPUs on cuda, their own process group).")
    num_ranks: int = Field(1, ge=1, description="Ranks of a separate critic (data parallel, DeepSpeed ZeRO over them); "
                           "each takes trainer.num_ranks / num_ranks of the policy's shards, so it must divide "
                           "trainer.num_ranks.")
    gpus_per_rank: float = Field(1.0, gt=0, le=1, description="GPU share each separate critic rank asks Ray for "
                                 "(trainer.device cuda): 0.5 lets a critic rank and a separate reference worker share "
                                 "one GPU.")
    model_path: str | None = Field(None, description="Causal LM folder the critic starts from (its LM head is replaced "
                                   "by a value head); default: the policy's model.")
    lr: float = Field(1e-3, gt=0, description="The critic's own AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    zero_stage: Literal[0, 1, 2, 3] | None = Field(None, description="DeepSpeed ZeRO stage (default: trainer.zero_stage).")
    cliprange_value: float = Field(0.5, gt=0, description="Value clipping around the values the step started with "
                                   "(verl's critic.cliprange_value).")
    vf_coef: float = Field(1.0, gt=0, allow_inf_nan=False, description="Value loss coefficient: the critic's loss "
                           "is vf_coef x the clipped value loss. The critic has its own optimizer, so with Adam this "
                           "acts through the gradient clipping (trainer.grad_clip) and epsilon, much like a learning-"
                           "rate change; the reported critic/vf_loss is before the coefficient.")
    warmup_steps: int = Field(0, ge=0, description="Steps that train only the critic before the policy starts "
                              "(verl's trainer.critic_warmup).")
    micro_batch_size: int | None = Field(None, ge=0, description="Sequences per critic forward/backward (default: "
                                         "trainer.micro_batch_size). With trainer.max_tokens_per_micro_batch the "
                                         "critic takes that token budget (and trainer.packing) instead.")


class ReferenceSection(_Section):
    """Where the frozen KL reference lives (algorithms that need one: kl_coef > 0 or use_kl_in_reward)."""
    placement: Literal["colocated", "separate"] = Field("colocated", description="colocated: a copy inside every "
                                                        "policy rank (the policy's device holds the model twice); "
                                                        "separate: reference.num_workers workers of their own (one "
                                                        "GPU each with trainer.device cuda) compute the reference "
                                                        "logprobs, the policy ranks hold no copy.")
    num_workers: int = Field(1, ge=1, description="Workers of a separate reference (each holds a whole copy and takes "
                             "a share of the policy ranks' shards).")
    gpus_per_worker: float = Field(1.0, gt=0, le=1, description="GPU share each separate reference worker asks Ray "
                                   "for (trainer.device cuda): 0.5 lets it share one GPU with a separate critic rank.")


class TrainerSection(_Section):
    num_ranks: int = Field(2, ge=1, description="DeepSpeed data-parallel ranks, one Ray actor each.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu (gloo) or cuda (NCCL, one GPU per rank).")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    ppo_epochs: int = Field(1, ge=1, description="Optimizer passes over each rollout batch.")
    micro_batch_size: int = Field(0, ge=0, description="Sequences per forward/backward on a rank; gradients accumulate "
                                  "over a rank's micro-batches into one optimizer step (0: the whole shard at once).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (less memory, ~30% slower).")
    max_tokens_per_micro_batch: int = Field(0, ge=0, description="Token budget per forward/backward on a rank: micro-batches "
                                            "are formed by prompt + response tokens (longest first) instead of by rows, and "
                                            "a step's sequences are balanced over ranks by tokens (0: off, rows as before).")
    packing: bool = Field(False, description="Run each token-budget micro-batch as one packed row without padding "
                          "(position ids restart per sequence, block-diagonal causal attention); needs max_tokens_per_micro_batch.")
    attn: Literal["auto", "varlen", "sdpa", "flash_attention_2"] = Field(
        "auto", description="Attention for packed micro-batches: varlen (torch's flash varlen kernel on cuda, one SDPA call "
        "per sequence on cpu), flash_attention_2 (needs flash_attn), sdpa (a block-diagonal mask, O(L^2) memory), or auto "
        "(flash_attention_2 where installed, else varlen).")
    logprob_chunk_tokens: int = Field(0, ge=0, description="Run the LM head, log-softmax and gather on this many positions "
                                      "at a time under checkpointing, so a micro-batch never holds its full-vocabulary logits "
                                      "(0: the whole micro-batch at once, as before). 4096 suits a 150k vocabulary.")
    peak_tflops: float = Field(0.0, ge=0, description="The device's dense peak TFLOP/s for train/mfu (0: from a table of "
                               "known GPUs for the training dtype; no MFU on unknown devices or cpu).")
    warm_start_steps: int = Field(0, ge=0, description="Supervised steps on the task's format before RL (0: none).")
    warm_start_real_answers: bool = Field(False, description="Warm start on real answers (True) or on random answers that teach only the format (False).")
    checkpoint_every: int = Field(0, ge=0, description="Save a checkpoint every N steps (0: by time only, and at the end).")
    checkpoint_every_minutes: float = Field(10.0, ge=0, description="Also save one when this many minutes of wall time "
                                            "passed since the last (0: off). A crash then loses at most that much work.")
    keep_checkpoints: int = Field(3, ge=0, description="Keep the newest N complete checkpoints (0: keep all).")
    export_hf: bool = Field(True, description="Write an HF safetensors folder of the policy with every checkpoint.")
    bf16: bool = Field(False, description="Train in bf16 (GPU).")
    offload: Literal[False, True, "auto"] = Field(
        False, description="Colocation: move optimizer state, master weights, model partitions and gradients to CPU "
        "memory while engines generate, and back before the train step (zero_stage >= 1). auto: the first step moves as "
        "configured (offload, and engines sleep at their sleep_level) and measures the GPU; from then on only what must "
        "move to fit moves (nothing, only the engines' sleep, or all as configured). On cpu auto moves nothing.")


class MultiTurnSection(_Section):
    tool: Literal["calculator", "python"] = Field("calculator", description="The tool that answers a model turn: "
        "calculator reads the turn's last `calc(<expression>)` and answers `=<value> `; python runs the turn's last "
        "```python block in a sandboxed subprocess (rollout/sandbox.py) and answers with its output.")
    max_turns: int = Field(4, ge=1, description="Model turns per trajectory at most.")
    max_total_tokens: int | None = Field(None, ge=1, description="Response tokens per trajectory at most (model turns "
        "and observations); a trajectory that reaches it ends with finish_reason length. Default: max_turns x (the "
        "engine's sampling.max_new_tokens + max_observation_tokens), every turn's whole budget.")
    max_observation_tokens: int = Field(16, ge=1, description="Tokens of one observation at most (cut beyond).")
    tool_timeout_s: float = Field(10.0, gt=0, description="Seconds a tool call may take (multi_turn's tool and an "
                                  "agent's client.tool); then the turn gets an error observation (a hung tool never "
                                  "ends the run).")

    def total_tokens(self, max_new_tokens: int) -> int:
        """max_total_tokens, or its default for an engine whose turns have `max_new_tokens`."""
        return self.max_total_tokens or self.max_turns * (max_new_tokens + self.max_observation_tokens)


class RolloutSection(_Section):
    multi_turn: MultiTurnSection | None = Field(None, description="Multi-turn rollouts (rollout/multiturn.py): after "
        "each model turn the tool's observation joins the context (never trained) and the model goes on, token ids "
        "in, token ids out. Absent: one prompt, one response. With rollout.agent: the agent's limits.")
    agent: str | None = Field(None, description="An agent function, package.module:function or builtin:calculator / "
        "builtin:tool_chat: `async def agent(client, row) -> float | None` runs each sample's trajectory through its "
        "client (rollout/agent.py); rollout.multi_turn holds its limits (defaults when absent). A float it returns is "
        "the reward with reward.function: builtin:agent_reward.")
    agents: dict[str, str] = Field(default_factory=dict, description="rollout.agent: agent functions by name, for "
        "datasets whose rows name their agent at data.agent_key (verl's agent_name); builtin names: single_turn_agent "
        "(builtin:single_turn) and tool_agent (builtin:tool_chat). Rows that name none run rollout.agent.")
    openai_endpoint: bool = Field(False, description="rollout.agent: each engine process serves /v1/chat/completions "
        "and /v1/completions on 127.0.0.1 (a free port; the run folder's openai_endpoints.json), and each sample has "
        "its own base URL (client.base_url): agent code written for the OpenAI client runs unchanged, every call "
        "recorded into its sample's trajectory as token ids (rollout/openai_server.py).")
    max_staleness: int = Field(0, ge=0, description="Most policy versions a trained token may lag the trained "
                               "weights (with partial_rollouts, plus partial_extra_lag for the tokens a request "
                               "sampled before the syncs it ran through). 0: on-policy, the synchronous loop exactly; "
                               "k >= 1: engines generate for later steps while the trainer trains.")
    partial_rollouts: bool = Field(False, description="At a weight sync, park running requests between decode steps "
                                   "and continue them with the new weights (their later tokens carry the new version). "
                                   "Needs max_staleness >= 1 and engines that can pause mid-request.")
    partial_extra_lag: int = Field(0, ge=0, description="With partial_rollouts: a group still generating when the "
        "step it is due for comes is trained up to this many steps later instead of holding that step up (the long "
        "tail goes on across the syncs); the tokens its requests sampled before those syncs then lag up to "
        "max_staleness + partial_extra_lag versions, corrected per token like every stale token (staleness/lag_k). "
        "0 (default): every token within max_staleness, and a step waits for its longest group as without partial "
        "rollouts (bench/RESULTS.md, fifteenth session, has both on 2x H200).")
    running_requests: Literal["auto", "wait", "abort"] = Field("auto", description="Without partial rollouts, at a sync: "
        "wait (running requests finish) or abort (stopped between decode steps, re-queued); auto (default): abort at "
        "max_staleness >= 1 when the sync is on the trainer's path and engines can stop mid-request, else wait (checks.py).")
    final_outputs: bool | None = Field(None, description="Streaming vLLM engines hand back each request only when it "
        "ends (FINAL_ONLY: no per-step output on the engine's front end) instead of streaming every token. Same samples, "
        "same generation speed (async_rl on 2x H200, twelfth session), shorter pauses (35-44 ms against 50-82 ms at 512 "
        "running). None (default): on wherever no keep pause can come (partial_rollouts off); true: the same, and refused "
        "with partial_rollouts (a kept request needs each token's weight version); false: always stream.")
    deterministic: bool = Field(False, description="Make max_staleness >= 1 runs reproducible from experiment.seed "
        "(rollout/scheduler.py says how). Costs throughput: no aborts or partial rollouts; slow groups hold up others.")
    dispatch_groups: int = Field(0, ge=0, description="Prompt groups per generate call (0: prompts_per_step / number of "
                                 "engines, one call per engine per step).")
    filter_groups: bool = Field(False, description="Dynamic sampling: drop groups whose rewards are all equal (no GRPO "
                                "signal) and draw more prompts until the step's batch is full.")
    filter_max_draws: float = Field(3.0, ge=1, description="filter_groups: at most this many prompts drawn per prompt "
                                    "trained (a step that hits the cap trains on fewer groups).")

    @model_validator(mode="after")
    def _agent_limits(self):
        if self.agent is not None and self.multi_turn is None:   # an agent's trajectories get the default limits
            self.multi_turn = MultiTurnSection()
        return self

    def token_lag_bound(self) -> int:
        """The most versions a trained token may lag: max_staleness, plus partial_extra_lag with partial rollouts."""
        return self.max_staleness + (self.partial_extra_lag if self.partial_rollouts else 0)


class WeightSyncSection(_Section):
    transport: Literal["auto", "ipc", "broadcast"] = Field("auto", description="auto: ipc for engines on trainer devices, broadcast otherwise.")
    bucket_size_mb: float = Field(256, gt=0, description="Flattened bucket size in MiB.")
    verify: bool = Field(True, description="Compare trainer and engine checksums after every sync; a mismatch fails the step.")
    timeout_s: float | None = Field(None, gt=0, description="Deadline of a sync, group creation and every broadcast "
                                    "(default: 60 s + 10 s per GB of weights: slower than 0.1 GB/s is a hang).")
    mismatch_alarm: float | None = Field(None, gt=0, description="Fail if max |engine - trainer| logprob after a sync exceeds this.")
    replay_loads: bool = Field(True, description="Engines redo the copies their loader made at the first sync in one "
                               "fused copy-and-checksum pass per bucket (weight_sync/replay.py); false: load_weights.")
    overlap: bool | Literal["auto"] = Field("auto", description="Trainers stage a weight copy and train on while it "
                                            "goes to the engines; auto: at max_staleness >= 1, no GPU hand-over due.")


class FaultToleranceSection(_Section):
    max_engine_restarts: int = Field(3, ge=0, description="Dead or hung engines replaced during a run (and, as many, "
                                     "dead reward workers); once spent the run goes on with the engines left.")
    engine_stall_s: float = Field(30.0, gt=0, description="An engine with work that makes no progress (no decode step, "
                                  "no finished call) for this long, or does not answer a health check, is declared hung.")
    health_interval_s: float = Field(2.0, gt=0, description="How often the rollout manager checks the engines.")
    max_run_restarts: int = Field(2, ge=0, description="After a trainer rank or the rollout manager dies (or a reward "
                                  "worker past max_engine_restarts), restart from the latest checkpoint this often.")
    node_wait_s: float | None = Field(None, gt=0, description="How long a restart waits for the cluster to have the "
                                      "nodes and resources the run needs (a lost node's replacement joining); default: "
                                      "ray.get_timeout_s.")
    replacement_start: Literal["background", "wait"] = Field(
        "background", description="background: the run goes on with the engines left while a dedicated engine's "
        "replacement starts (vLLM: ~50 s), which joins at the first sync after; wait: the step waits for it (which "
        "steps each engine serves then does not depend on its start time). Colocated replacements always wait.")
    step_snapshots: bool = Field(False, description="Keep a checkpoint of the last step in RAM (newest only): a run "
        "restarted after a trainer rank died resumes from it, not the last periodic one. Costs its memory and write "
        "time per step (checkpoint/snapshot_gb, _s); lost with the machine, unlike the checkpoints on disk.")
    snapshot_dir: str | None = Field(None, min_length=1, description="Their folder (default: /dev/shm/rlhf_orch-"
                                     "<uid>/<run name>-<hash of the run folder>, else <run>/snapshots).")


class MetricsSection(_Section):
    """Where the per-step metrics go (rlhf_orch/metrics/sinks.py, trackers.py). wandb and mlflow are optional extras:
    a config naming one that is not installed fails before launch with the pip command."""
    trackers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"],
        description="jsonl: <run>/metrics.jsonl; tensorboard: <run>/tb; wandb: a W&B run, files in <run>/wandb "
                    "(pip install -e \".[wandb]\"); mlflow: an MLflow run (pip install -e \".[mlflow]\").")
    wandb_mode: Literal["offline", "online"] = Field("offline", description="W&B: offline writes <run>/wandb only "
                                                     "(`wandb sync` uploads it later); online needs WANDB_API_KEY.")
    wandb_project: str | None = Field(None, min_length=1, description="W&B project (default: experiment.name); "
                                      "the W&B run is named experiment.name.")
    mlflow_tracking_uri: str | None = Field(None, min_length=1, description="MLflow tracking URI (default: a local "
                                            "file store, file:<run>/mlruns); the experiment is experiment.name.")
    ray_metrics: bool = Field(True, description="Export ray.util.metrics gauges (Prometheus endpoint, dashboard).")
    plots: bool = Field(True, description="Write PNG plots at the end of the run.")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data):
        message = renamed_keys_message(data) if isinstance(data, dict) else None
        if message:
            raise PydanticCustomError("renamed_key", message)
        return data

    @field_validator("trackers")
    @classmethod
    def _installed(cls, v):
        problems = tracker_problems(v)
        if problems:
            raise PydanticCustomError("tracker", "; ".join(problems))
        return v

    @field_validator("wandb_mode")
    @classmethod
    def _online_needs_key(cls, v, info):
        problem = wandb_online_problem() if v == "online" and "wandb" in (info.data.get("trackers") or []) else None
        if problem:
            raise PydanticCustomError("wandb_online", problem)
        return v


class EvalSection(_Section):
    """Evaluation of the policy during and at the end of a run (rlhf_orch/evaluation.py, driver/evaluation.py): at a
    step boundary, after the sync, the engines answer a fixed set of held-out prompts with the just-trained weights and
    the reward workers score them. It never touches the training stream (data order, the engines' sampling RNG)."""
    every: int = Field(0, ge=0, description="Evaluate after every N steps (0: off; a run with it off is unchanged).")
    final: bool | None = Field(None, description="Also evaluate after the last step (default: true when every > 0; "
                               "true with every 0: only then).")
    source: str | None = Field(None, description="Prompts to evaluate on: 'builtin:<task>' or a file/folder like "
                               "data.source (read with data's prompt_key, answer_key and chat template); null: the "
                               "validation split of data.source (a built-in task has none and uses its rows).")
    split: str | None = Field(None, min_length=1, description="File sources: the split to evaluate on (default: the "
                              "first of validation, val, valid, test that the source has).")
    max_prompts: int = Field(0, ge=0, description="At most this many prompts, the same seeded subset every time "
                             "(0: all).")
    n: int = Field(1, ge=1, description="Samples per prompt: 1 is greedy (temperature 0, argmax); n > 1 samples at "
                   "eval.temperature with seeds of their own, and pass@k is reported for k = n.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature when n > 1.")
    pass_threshold: float = Field(1.0, allow_inf_nan=False, description="A sample passes when its reward is at least "
                                  "this (pass@1, pass@k).")

    @property
    def enabled(self) -> bool:
        return self.every > 0 or bool(self.final)


class ExperimentConfig(_Section):
    resume: bool = Field(False, description="Continue from <run>/checkpoints/latest (same next batch); fresh start if none.")
    experiment: ExperimentSection = Field(default_factory=ExperimentSection, description="Run identity and length.")
    ray: RaySection = Field(default_factory=RaySection, description="Ray cluster.")
    nodes: NodesSection = Field(default_factory=NodesSection, description="Which cluster nodes each role runs on.")
    model: ModelSection = Field(default_factory=ModelSection, description="Policy model.")
    data: DataSection = Field(default_factory=DataSection, description="Prompt dataset.")
    reward: RewardSection = Field(default_factory=RewardSection, description="Reward function.")
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection, description="RL algorithm.")
    critic: CriticSection = Field(default_factory=CriticSection, description="Value model (ppo).")
    reference: ReferenceSection = Field(default_factory=ReferenceSection, description="The frozen KL reference.")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="DeepSpeed trainer group.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Streaming rollouts and staleness.")
    engines: list[EngineConfig] = Field(min_length=1, description="Rollout engines, one entry per kind/placement.")
    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection, description="Weight sync.")
    fault_tolerance: FaultToleranceSection = Field(default_factory=FaultToleranceSection,
                                                   description="Engine replacement, hang detection and run restarts.")
    metrics: MetricsSection = Field(default_factory=MetricsSection, description="Metric outputs.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Evaluation during and at the end of the run.")

    @model_validator(mode="after")
    def _cross_checks(self):
        from rlhf_orch.config.checks import cross_field_problems   # the checks need the sections defined here
        problems = cross_field_problems(self)
        if problems:
            # Joined so pydantic reports them as one error; loader.py splits them back into lines.
            raise ValueError("\n".join(problems))
        return self


def engine_names(cfg: ExperimentConfig) -> list[str]:
    """One name per engine instance, expanding `count` (e.g. ['hf0', 'hf1'] or ['gen-0', 'gen-1'])."""
    out = []
    for i, e in enumerate(cfg.engines):
        base = e.name or f"{e.kind}{i}"
        out.extend([base] if e.count == 1 else [f"{base}-{k}" for k in range(e.count)])
    return out
