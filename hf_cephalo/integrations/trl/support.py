"""TRL on the Cephalo runtime: which TRL trainers run, and every ``SFTConfig`` and ``DPOConfig``
field classified.

The same contract as ``support.py`` ([Note: no silent no-op] there): each field a TRL config adds
to ``TrainingArguments`` works as stock (with a test against stock TRL), runs stock TRL code the
engine does not replace, has no meaning here, or is refused at construction — in the one
numbered refusal message, before any collective. ``tests/test_trl_support.py`` fails when an
installed TRL adds a field this table does not classify; docs/trl.md holds the rendered tables
(``render_markdown``). The TRL trainer table and its check (``TRL_TRAINER_SUPPORT``,
``trainer_class_problems``) live in ``integrations/shared.py``, where the trainer door reads
them; they are re-exported here.
"""

from __future__ import annotations

from hf_cephalo.integrations.shared import TRL_TRAINER_SUPPORT, Support, markdown_table
from hf_cephalo.integrations.shared import inherited as _inherited
from hf_cephalo.integrations.shared import not_applicable as _na
from hf_cephalo.integrations.shared import refused as _refused
from hf_cephalo.integrations.shared import stock as _stock
from hf_cephalo.integrations.shared import trainer_class_problems

__all__ = ["SFT_FIELD_SUPPORT", "DPO_FIELD_SUPPORT", "GRPO_FIELD_SUPPORT", "RLOO_FIELD_SUPPORT",
           "REWARD_FIELD_SUPPORT", "KTO_FIELD_SUPPORT", "TRL_TRAINER_SUPPORT",
           "trainer_class_problems", "render_markdown"]

_S = "tests/test_trl_sft.py::"
_PREP = "SFTTrainer's own dataset preparation (tokenize, mask, pack) before planning"


SFT_FIELD_SUPPORT: dict[str, Support] = {
    "model_init_kwargs": _stock(
        "with a model given by name (TRL's scripts pass model_args.model_name_or_path): loaded "
        "as stock TRL loads it (AutoModelForCausalLM, float32 unless dtype is given; hub "
        "options, attn_implementation, dtype 'auto' on a float32 checkpoint and config "
        "overrides as from_pretrained), but on the meta device, each rank reading only its "
        "shards (pretrained.load_named_model; with a peft_config whole on every rank, as "
        "stock: PEFT draws the new adapter weights from the whole model's random stream); a "
        "dtype other than float32, a hand device_map and loading options "
        "(quantization_config, ...) are refused before any collective; with a model object "
        "SFTTrainer warns it is ignored, as stock",
        "tests/test_generic_doors.py::test_trl_sft_equals_stock_one_process"),
    "trust_remote_code": _inherited("forwarded by SFTTrainer to AutoProcessor when no "
                                    "processing_class is given"),
    "router_aux_loss_coef": _stock(
        "a mixture of experts trains with the router load-balancing loss as stock SFT does "
        "(SFTTrainer switches the config's output_router_logits on unless the coefficient is "
        "0): the engine adds coef x the router loss of the WHOLE global batch once per step, "
        "with its gradient, and TRL's logged aux_loss is that batch's (sft.py, [Note: router "
        "loss in the SFT door])",
        "tests/test_generic_doors.py::test_trl_sft_equals_stock_one_process"),
    "chat_template_path": _inherited("SFTTrainer sets the template (and resizes the embeddings "
                                     "for added tokens) before the engine shards the model"),
    "dataset_text_field": _inherited(_PREP),
    "dataset_kwargs": _inherited(_PREP + "; skip_prepare_dataset as stock"),
    "dataset_num_proc": _inherited(_PREP),
    "eos_token": _inherited(_PREP),
    "max_length": _stock("truncation or the packed row length, as stock; the planner profiles "
                         "rows of the prepared dataset's length", _S + "test_sft_matches_stock"),
    "truncation_mode": _inherited(_PREP),
    "shuffle_dataset": _inherited(_PREP + " (seeded by seed, as stock)"),
    "packing": _stock("a packed row is one sample of the weighted split (b_i rows per rank)",
                      _S + "test_sft_matches_stock"),
    "packing_strategy": _stock(
        "wrapped: rows padded as one process with the global batch pads them (attention "
        "crosses documents inside a row, as stock without padding-free); bfd / bfd_split: "
        "padding-free, see padding_free", _S + "test_sft_matches_stock"),
    "padding_free": _stock(
        "TRL's flattening collator is applied per microbatch (its one row of every sample "
        "cannot be cut into samples); each document's position_ids restart at 0, so every "
        "unit attends block-diagonally (transformers' packed-sequence mask) and no token sees "
        "another document; tokens, loss and metrics as the single-process global batch",
        _S + "test_sft_matches_stock"),
    "pad_to_multiple_of": _inherited(
        "the data collator pads each global batch as stock; refused with padding-free, whose "
        "per-microbatch rows would each be padded (num_tokens would count that padding)"),
    "eval_packing": _inherited(_PREP),
    "completion_only_loss": _stock("the labels SFTTrainer builds; loss and item count over "
                                   "the global batch", _S + "test_sft_matches_stock"),
    "assistant_only_loss": _stock("the labels SFTTrainer builds from the chat template's "
                                  "generation markers", _S + "test_sft_matches_stock"),
    "loss_type": _stock(
        "SFTTrainer.compute_loss runs in the engine's head per microbatch; nll and chunked_nll "
        "(an alias of nll in TRL 1.16) use TRL's fused LM head (per-token log-probabilities, "
        "entropy and top-1 in tiles: the (m, S, V) logits are never built), computed from the "
        "head's final hidden states (integrations/trl/fused.py); dft is the same per-token sum (not "
        "separately tested)", _S + "test_sft_matches_stock"),
    "activation_offloading": _refused(
        "TRL's activation offloading hooks the model's forward, which the engine never "
        "calls; the engine offloads each unit's boundary activation itself: drop "
        "activation_offloading and set --cephalo_activation_offload on"),
    "pad_token": _inherited("deprecated by TRL; SFTTrainer sets the tokenizer's pad token"),
}
"""``SFTConfig`` field (beyond ``TrainingArguments``) -> support."""


_D = "tests/test_trl_dpo.py::"
_DPO_PREP = "DPOTrainer's own dataset preparation (tokenize prompt / chosen / rejected) before planning"
_PER_PAIR = ("DPOTrainer.compute_loss per microbatch in the engine's head, its mean over the "
             "microbatch's pairs weighted by m / N (integrations/trl/dpo.py, [Note: a preference pair is one "
             "sample])")

DPO_FIELD_SUPPORT: dict[str, Support] = {
    "model_init_kwargs": _inherited("with a model given by name: loaded as for SFT "
                                    "(pretrained.load_named_model: the meta device, each rank "
                                    "its shards, or whole with a peft_config; refusals before "
                                    "any collective); DPOTrainer also reads it to load its "
                                    "reference copy when no ref_model is given"),
    "trust_remote_code": _inherited("forwarded by DPOTrainer to AutoProcessor / the reference "
                                    "copy it loads"),
    "router_aux_loss_coef": _na("used only for a mixture of experts (a config with "
                                "output_router_logits), whose router loss DPOTrainer adds per "
                                "call unless this is 0.0: the DPO door refuses such a model at "
                                "construction, naming router_aux_loss_coef=0.0 (the engine's "
                                "router loss covers the global batch, apart from DPO's loss); "
                                "unused otherwise, as on stock"),
    "disable_dropout": _inherited("DPOTrainer turns dropout off in the policy and the reference "
                                  "before the engine shards them (default True, as the tests "
                                  "run)"),
    "dataset_num_proc": _inherited(_DPO_PREP),
    "max_length": _stock("DataCollatorForPreference truncates each sequence, as stock; a pair "
                         "is one sample padded to its global batch's width",
                         _D + "test_dpo_matches_stock"),
    "truncation_mode": _inherited("DataCollatorForPreference's truncation, per sequence"),
    "padding_free": _inherited("TRL 1.16 disables it with a warning (standard padding)"),
    "pad_to_multiple_of": _inherited("DataCollatorForPreference pads each global batch as stock "
                                     "(the width exchange rounds as the collator does)"),
    "precompute_ref_log_probs": _stock(
        "TRL's own precompute over the dataset with the whole model before planning (as stock "
        "DDP), read from the batch by the loss; refused for a meta model",
        _D + "test_dpo_matches_stock"),
    "precompute_ref_batch_size": _inherited("the batch size of TRL's precompute pass"),
    "loss_type": _stock(
        _PER_PAIR + "; several types with loss_weights as stock; aot, aot_unpaired and sft "
        "(not means of per-pair terms) are refused", _D + "test_dpo_matches_stock"),
    "loss_weights": _inherited("the weights of several loss types, inside compute_loss"),
    "ld_alpha": _inherited("inside compute_loss; with a reference computed each step (no "
                           "precompute) it is refused: that pass sums whole completions"),
    "f_divergence_type": _inherited("inside compute_loss, per pair (not separately tested)"),
    "f_alpha_divergence_coef": _inherited("inside compute_loss, per pair"),
    "label_smoothing": _inherited("inside compute_loss, per pair (robust / exo_pair)"),
    "beta": _stock("inside compute_loss and the rewards metrics", _D + "test_dpo_matches_stock"),
    "use_weighting": _inherited("WPO weights per pair from the fused head's log_sum_sq_probs "
                                "(not separately tested)"),
    "discopop_tau": _inherited("inside compute_loss, per pair"),
    "activation_offloading": _refused(
        "TRL's activation offloading hooks the model's forward, which the engine never "
        "calls; the engine offloads each unit's boundary activation itself: drop "
        "activation_offloading and set --cephalo_activation_offload on"),
    "sync_ref_model": _refused(
        "the reference runs as its own sharded engine (or as precomputed log-probabilities): "
        "mixing the policy's weights into it every ref_model_sync_steps is not built; drop "
        "sync_ref_model"),
    "ref_model_mixup_alpha": _na("read only with sync_ref_model, which is refused"),
    "ref_model_sync_steps": _na("read only with sync_ref_model, which is refused"),
    "pad_token": _inherited("DPOTrainer sets the tokenizer's pad token"),
}
"""``DPOConfig`` field (beyond ``TrainingArguments``) -> support."""


_G = "tests/test_trl_grpo.py::"
_GRPO_LOSS = ("GRPOTrainer.compute_loss per microbatch in the engine's head, rescaled to its "
              "share of the one-process loss (grpo.py, [Note: each loss type's normalizer])")
_BUILTIN_GENERATION = ("configures TRL's own generation backend, which the door does not run: "
                       "built-in generation decodes on the sharded engine (transformers' "
                       "generate, dynamic KV cache; docs/generation.md) and refuses a value "
                       "other than the default; a rollout_func ignores it, as stock")
_KEYED = ("built-in generation (no rollout_func) samples with it, keyed by the global row "
          "(docs/generation.md); a rollout_func ignores it, as stock")
_VLLM = "read only with use_vllm, which is refused"

GRPO_FIELD_SUPPORT: dict[str, Support] = {
    "model_init_kwargs": _inherited("with a model given by name: loaded as for SFT "
                                    "(pretrained.load_named_model); GRPOTrainer also reads it to "
                                    "load its reference copy when beta != 0"),
    "trust_remote_code": _inherited("forwarded by GRPOTrainer to AutoProcessor / the reference "
                                    "copy it loads"),
    "router_aux_loss_coef": _inherited(
        "0.0 turns TRL's router load-balancing loss off for a mixture of experts (tested); a "
        "non-zero coefficient (the model config's when None) on a mixture of experts is "
        "refused: TRL adds that loss per microbatch, not as a sum over the global batch"),
    "disable_dropout": _inherited("GRPOTrainer turns dropout off in the policy and the "
                                  "reference before the engine shards them"),
    "cast_lm_head_to_fp32": _inherited("passed to TRL's fused head on the engine (the hidden "
                                       "states and head in fp32; not separately tested)"),
    "num_generations": _stock("G rows per prompt, consecutive in the generation batch; a group "
                              "may span ranks (rewards and advantages over the global batch); "
                              "a global batch it does not divide is refused",
                              _G + "test_grpo_matches_stock"),
    "num_generations_eval": _na("evaluation is refused (not built on the engine)"),
    "max_completion_length": _stock("dr_grpo's constant normalizer, as stock; the completion "
                                    "limit of built-in generation (required); a rollout_func's "
                                    "lengths are its own", _G + "test_grpo_matches_stock"),
    "ds3_gather_for_generation": _na("DeepSpeed ZeRO-3 only; the engine is not DeepSpeed"),
    "shuffle_dataset": _stock("TRL's RepeatSampler order (seeded by seed), split by the plan; a "
                              "shuffled dataset read for more than one epoch is refused (the "
                              "next epoch's order is not replayed yet)",
                              _G + "test_grpo_matches_stock"),
    "pad_to_multiple_of": _inherited("prompts and completions padded to the generation batch's "
                                     "width rounded up to it, as one process pads the batch"),
    "generation_batch_size": _inherited("set by the door to the plan's global batch B (one "
                                        "generation batch per optimizer step); a value giving "
                                        "steps_per_generation > 1 is refused"),
    "steps_per_generation": _refused(
        "one process shuffles the rows of a generation batch across its optimizer steps, which "
        "would move completions between ranks (not built); leave it unset (1)",
        refuse_if=lambda v: v not in (None, 1)),
    "temperature": _stock("TRL's fused head divides the logits by it for the old, reference "
                          "and training log-probabilities, as stock; " + _KEYED,
                          _G + "test_grpo_matches_stock"),
    "top_p": _stock(_KEYED, _G + "test_grpo_matches_stock"),
    "top_k": _stock(_KEYED, _G + "test_grpo_matches_stock"),
    "min_p": _stock(_KEYED, _G + "test_grpo_matches_stock"),
    "generation_kwargs": _na(_BUILTIN_GENERATION),
    "chat_template_kwargs": _inherited("read by GRPOTrainer's reward-model path and a "
                                       "rollout_func, as stock"),
    "repetition_penalty": _na(_BUILTIN_GENERATION),
    "cache_implementation": _na(_BUILTIN_GENERATION),
    "use_vllm": _refused(
        "vLLM generation (colocate or server) is not built on the engine: the server would "
        "take the weights unit by unit from the shards (docs/generation.md); use built-in "
        "generation or a rollout_func"),
    **{name: _na(_VLLM) for name in (
        "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
        "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
        "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
        "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_cap")},
    "beta": _stock("the KL term against TRL's ref_model as a second engine sharded by the plan "
                   "(or the LoRA policy with its adapter off), per token in compute_loss",
                   _G + "test_grpo_matches_stock"),
    "num_iterations": _stock("each generation batch trained num_iterations times, with the old "
                             "policy's log-probabilities from a forward-only pass",
                             _G + "test_grpo_matches_stock"),
    "epsilon": _inherited("the clipping range, per token in compute_loss"),
    "delta": _inherited("two-sided clipping, per token in compute_loss (not separately tested)"),
    "epsilon_high": _inherited("the upper clipping bound, per token in compute_loss"),
    "sapo_temperature_neg": _na("loss_type sapo only, which is refused"),
    "sapo_temperature_pos": _na("loss_type sapo only, which is refused"),
    "vespo_k_pos": _na("loss_type vespo only, which is refused"),
    "vespo_lambda_pos": _na("loss_type vespo only, which is refused"),
    "vespo_k_neg": _na("loss_type vespo only, which is refused"),
    "vespo_lambda_neg": _na("loss_type vespo only, which is refused"),
    "importance_sampling_level": _inherited("token or sequence ratios per row in compute_loss "
                                            "(not separately tested)"),
    "reward_weights": _stock("the weighted sum of the reward functions over the global batch "
                             "(rollout.group_advantages)", _G + "test_grpo_matches_stock"),
    "multi_objective_aggregation": _inherited("sum_then_normalize (tested) or "
                                              "normalize_then_sum over the global batch "
                                              "(rollout.group_advantages)"),
    "scale_rewards": _stock("group, batch or none over the global batch "
                            "(rollout.group_advantages)", _G + "test_grpo_matches_stock"),
    "loss_type": _stock(_GRPO_LOSS + "; dapo, bnpo, grpo and dr_grpo; the others are refused "
                        "(not validated)", _G + "test_grpo_matches_stock"),
    "mask_truncated_completions": _stock("a completion not ending in EOS / pad is masked, as "
                                         "stock", _G + "test_grpo_matches_stock"),
    "sync_ref_model": _refused(
        "the reference runs as its own sharded engine: mixing the policy's weights into it "
        "every ref_model_sync_steps is not built; drop sync_ref_model"),
    "ref_model_mixup_alpha": _na("read only with sync_ref_model, which is refused"),
    "ref_model_sync_steps": _na("read only with sync_ref_model, which is refused"),
    "top_entropy_quantile": _stock(
        "the threshold is TRL's quantile of every loss token's entropy in the step's global "
        "batch, from a forward-only pass at each step (rollout_door.py, [Note: the entropy "
        "threshold]); one extra layered forward per step", _G + "test_grpo_matches_stock"),
    "entropy_coef": _refused(
        "the entropy bonus is a per-microbatch token mean beside the policy loss's own "
        "normalizer (not one sum over the global batch); leave it at 0.0",
        refuse_if=lambda v: v != 0.0),
    "use_adaptive_entropy": _refused("the adaptive entropy bonus (see entropy_coef) is not "
                                     "built; leave it off"),
    "entropy_coef_min": _na("read only with use_adaptive_entropy, which is refused"),
    "entropy_coef_max": _na("read only with use_adaptive_entropy, which is refused"),
    "entropy_coef_delta": _na("read only with use_adaptive_entropy, which is refused"),
    "entropy_target": _na("read only with use_adaptive_entropy, which is refused"),
    "max_tool_calling_iterations": _na("tools are refused (multi-turn tool calling is not "
                                       "built on the engine)"),
    "off_policy_mask_threshold": _inherited("per row, from the rollout's sampling "
                                            "log-probabilities, in compute_loss (not "
                                            "separately tested)"),
    "use_bias_correction_kl": _inherited("per token in compute_loss"),
    "log_completions": _inherited("GRPOTrainer.log prints / reports the gathered rows of the "
                                  "global batch on rank 0"),
    "log_multimodal": _na("multimodal prompts are refused"),
    "num_completions_to_print": _inherited("with log_completions"),
    "log_unique_prompts": _inherited("with log_completions"),
    "log_completions_hub_repo": _inherited("with log_completions (not separately tested)"),
    "use_transformers_continuous_batching": _na(_BUILTIN_GENERATION),
    "transformers_continuous_batching_config": _na(_BUILTIN_GENERATION),
    "use_transformers_paged": _na(_BUILTIN_GENERATION),
}
"""``GRPOConfig`` field (beyond ``TrainingArguments``) -> support."""


_R = "tests/test_trl_grpo.py::"
_RLOO_SHARED = ("model_init_kwargs", "trust_remote_code", "router_aux_loss_coef", "disable_dropout",
                "num_generations_eval", "ds3_gather_for_generation", "shuffle_dataset",
                "pad_to_multiple_of", "generation_batch_size", "steps_per_generation",
                "temperature", "top_p", "top_k", "min_p", "generation_kwargs",
                "chat_template_kwargs", "repetition_penalty", "cache_implementation", "use_vllm",
                "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
                "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
                "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
                "vllm_gpu_memory_utilization", "vllm_max_model_length",
                "vllm_tensor_parallel_size", "epsilon", "epsilon_high", "sync_ref_model",
                "ref_model_mixup_alpha", "ref_model_sync_steps", "log_completions",
                "log_multimodal", "num_completions_to_print", "log_unique_prompts",
                "use_transformers_continuous_batching", "transformers_continuous_batching_config",
                "use_transformers_paged")
RLOO_FIELD_SUPPORT: dict[str, Support] = {
    **{name: GRPO_FIELD_SUPPORT[name] for name in _RLOO_SHARED},
    "num_generations": _stock("G rows per prompt; a group may span ranks (the leave-one-out "
                              "baseline over the global batch)", _R + "test_rloo_matches_stock"),
    "max_completion_length": _stock("the completion limit of built-in generation (required); a "
                                    "rollout_func's lengths are its own",
                                    _R + "test_rloo_matches_stock"),
    "beta": _stock("the reference's KL summed per row and subtracted from its reward (a second "
                   "engine over TRL's ref_model, or the LoRA policy with its adapter off)",
                   _R + "test_rloo_matches_stock"),
    "num_iterations": _stock("each generation batch trained num_iterations times against "
                             "the old log-probabilities", _R + "test_rloo_matches_stock"),
    "reward_weights": _inherited("the weighted sum of the reward functions over the global "
                                 "batch (rloo.rloo_advantages)"),
    "normalize_advantages": _stock("over the global batch (rloo.rloo_advantages)",
                                   _R + "test_rloo_matches_stock"),
    "reward_clip_range": _stock("per row before the baseline (rloo.rloo_advantages)",
                                _R + "test_rloo_matches_stock"),
    "mask_truncated_completions": _inherited("a completion not ending in EOS / pad is masked, "
                                             "as stock (the same code as GRPO's)"),
}
"""``RLOOConfig`` field (beyond ``TrainingArguments``) -> support."""


_R = "tests/test_trl_reward.py::"
_REWARD_PREP = "RewardTrainer's own dataset preparation (EOS, tokenize, filter) before planning"
_OFFLOAD = _refused(
    "TRL's activation offloading hooks the model's forward, which the engine never calls; the "
    "engine offloads each unit's boundary activation itself: drop activation_offloading and set "
    "--cephalo_activation_offload on")

REWARD_FIELD_SUPPORT: dict[str, Support] = {
    "model_init_kwargs": _inherited(
        "with a model given by name (TRL's reward.py passes model_args.model_name_or_path): "
        "loaded as stock RewardTrainer loads it (AutoModelForSequenceClassification, "
        "num_labels=1, float32 unless dtype is given, after set_seed(seed): the new score head "
        "is drawn from the whole model's random stream), whole on every rank, then sharded"),
    "trust_remote_code": _inherited("forwarded by RewardTrainer to the model / tokenizer it "
                                    "loads"),
    "chat_template_path": _inherited("RewardTrainer sets the template (and resizes the "
                                     "embeddings for added tokens) before the engine shards the "
                                     "model"),
    "disable_dropout": _inherited("RewardTrainer turns dropout off before the engine shards the "
                                  "model (default True, as the tests run)"),
    "dataset_num_proc": _inherited(_REWARD_PREP),
    "eos_token": _inherited(_REWARD_PREP),
    "max_length": _stock("RewardTrainer filters pairs longer than max_length, as stock; a pair "
                         "is one sample padded to its global batch's width",
                         _R + "test_reward_matches_stock"),
    "pad_to_multiple_of": _inherited("DataCollatorForPreference pads each global batch as stock "
                                     "(the width exchange rounds as the collator does)"),
    "center_rewards_coefficient": _stock(
        "inside RewardTrainer.compute_loss per microbatch: a mean over its pairs, weighted by "
        "m / N, so the term is the mean over the global batch's pairs",
        _R + "test_reward_matches_stock"),
    "activation_offloading": _OFFLOAD,
    "pad_token": _inherited("deprecated by TRL; RewardTrainer sets the tokenizer's and the "
                            "config's pad token"),
}
"""``RewardConfig`` field (beyond ``TrainingArguments``) -> support."""


_K = "tests/test_trl_kto.py::"
_KTO_PREP = ("KTOTrainer's own dataset preparation (extract the prompt, unpair, tokenize) "
             "before planning")

KTO_FIELD_SUPPORT: dict[str, Support] = {
    "model_init_kwargs": _inherited("with a model given by name: loaded as for SFT "
                                    "(pretrained.load_named_model: the meta device, each rank "
                                    "its shards, or whole with a peft_config); KTOTrainer also "
                                    "reads it to load its reference copy when no ref_model is "
                                    "given"),
    "trust_remote_code": _inherited("forwarded by KTOTrainer to AutoProcessor / the reference "
                                    "copy it loads"),
    "router_aux_loss_coef": _na("used only for a mixture of experts whose config sets "
                                "output_router_logits, which the TRL doors refuse (see SFT); "
                                "unused otherwise, as on stock"),
    "disable_dropout": _inherited("KTOTrainer turns dropout off in the policy and the reference "
                                  "before the engine shards them"),
    "dataset_num_proc": _inherited(_KTO_PREP),
    "max_length": _stock("DataCollatorForUnpairedPreference truncates each row, as stock; a row "
                         "is one sample padded to its global batch's width",
                         _K + "test_kto_matches_stock"),
    "pad_to_multiple_of": _inherited("the collator pads each global batch as stock (the width "
                                     "exchange rounds as the collator does)"),
    "precompute_ref_log_probs": _refused(
        "reading KTO's precomputed reference columns (and the KL exchange over them) is not "
        "built or tested on the runtime; drop precompute_ref_log_probs: the reference then "
        "runs as a sharded frozen engine (or the PEFT policy with its adapters off) each step"),
    "precompute_ref_batch_size": _na("read only with precompute_ref_log_probs, which is "
                                     "refused"),
    "loss_type": _stock(
        "KTOTrainer's loss per microbatch in the engine's head (kto, apo_zero_unpaired: a mean "
        "of per-row terms), weighted by m / N; kto's KL estimate is that of the global batch "
        "(kto.py, [Note: the KL estimate of the global batch])", _K + "test_kto_matches_stock"),
    "beta": _stock("inside the loss and the rewards metrics", _K + "test_kto_matches_stock"),
    "desirable_weight": _stock("weights the desirable rows' losses inside the loss",
                               _K + "test_kto_matches_stock"),
    "undesirable_weight": _stock("weights the undesirable rows' losses inside the loss",
                                 _K + "test_kto_matches_stock"),
    "activation_offloading": _OFFLOAD,
    "sync_ref_model": _refused(
        "the reference runs as its own sharded engine: mixing the policy's weights into it "
        "every ref_model_sync_steps is not built; drop sync_ref_model"),
    "ref_model_mixup_alpha": _na("read only with sync_ref_model, which is refused"),
    "ref_model_sync_steps": _na("read only with sync_ref_model, which is refused"),
}
"""``KTOConfig`` field (beyond ``TrainingArguments``) -> support."""


def render_markdown() -> str:
    """The tables of docs/trl.md (TRL trainers, then the SFTConfig, DPOConfig, GRPOConfig and
    RLOOConfig fields)."""
    return "\n".join(markdown_table("TRL trainers", TRL_TRAINER_SUPPORT, 3)
                     + markdown_table("SFTConfig fields (beyond TrainingArguments)",
                                      SFT_FIELD_SUPPORT, 3)
                     + markdown_table("DPOConfig fields (beyond TrainingArguments)",
                                      DPO_FIELD_SUPPORT, 3)
                     + markdown_table("RewardConfig fields (beyond TrainingArguments)",
                                      REWARD_FIELD_SUPPORT, 3)
                     + markdown_table("KTOConfig fields (beyond TrainingArguments)",
                                      KTO_FIELD_SUPPORT, 3)
                     + markdown_table("GRPOConfig fields (beyond TrainingArguments)",
                                      GRPO_FIELD_SUPPORT, 3)
                     + markdown_table("RLOOConfig fields (beyond TrainingArguments)",
                                      RLOO_FIELD_SUPPORT, 3))
