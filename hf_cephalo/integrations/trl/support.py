"""TRL on the Cephalo runtime: which TRL trainers run, and every ``SFTConfig`` and ``DPOConfig``
field classified.

The same contract as ``support.py`` ([Note: no silent no-op] there): each field a TRL config adds
to ``TrainingArguments`` works as stock (with a test against stock TRL), runs stock TRL code the
engine does not replace, has no meaning here, or is refused at construction — in the one
numbered refusal message, before any collective. ``tests/test_trl_support.py`` fails when an
installed TRL adds a field this table does not classify; docs/trl.md holds the rendered tables
(``render_markdown``). Imports no TRL: the trainer check reads class names only.
"""

from __future__ import annotations

from hf_cephalo.integrations.trainer.support import Status, Support, markdown_table
from hf_cephalo.integrations.trainer.support import inherited as _inherited
from hf_cephalo.integrations.trainer.support import not_applicable as _na
from hf_cephalo.integrations.trainer.support import refused as _refused
from hf_cephalo.integrations.trainer.support import stock as _stock

__all__ = ["SFT_FIELD_SUPPORT", "DPO_FIELD_SUPPORT", "TRL_TRAINER_SUPPORT", "trainer_class_problems",
           "render_markdown"]

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
        "head's final hidden states (trl_fused.py); dft is the same per-token sum (not "
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
             "microbatch's pairs weighted by m / N (trl_dpo.py, [Note: a preference pair is one "
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


_GENERATES = (
    "generates completions while it trains (model.generate or a vLLM server); the engine holds "
    "the model as per-rank shards and has no generation path. Missing: sampling over the "
    "sharded layers with a KV cache (or syncing the gathered weights to vLLM each step), and a "
    "planner that prices generation. Train the policy with CephaloSFTTrainer, or run this "
    "trainer with stock Accelerate / FSDP2")
_PAIRS = (
    "scores a chosen and a rejected sequence per example: the two rows must stay on one rank "
    "and in one microbatch, and its loss is a per-rank mean; built for DPOTrainer only "
    "(CephaloDPOTrainer), not validated for this trainer's loss and collator")
TRL_TRAINER_SUPPORT: dict[str, Support] = {
    "SFTTrainer": _stock("CephaloSFTTrainer (CephaloTrainerMixin + SFTTrainer)",
                         _S + "test_sft_matches_stock"),
    "DPOTrainer": _stock("CephaloDPOTrainer (CephaloTrainerMixin + DPOTrainer): a pair is one "
                         "sample; reference precomputed, a sharded frozen engine, or the PEFT "
                         "policy with its adapters off", _D + "test_dpo_matches_stock"),
    "RewardTrainer": _refused(_PAIRS),
    "CPOTrainer": _refused(_PAIRS),
    "ORPOTrainer": _refused(_PAIRS),
    "TPOTrainer": _refused(_PAIRS),
    "KTOTrainer": _refused("needs a KL batch of mismatched prompt / completion pairs and a "
                           "reference model beside the policy; not built on the runtime"),
    **{name: _refused(_GENERATES) for name in (
        "GRPOTrainer", "RLOOTrainer", "OnlineDPOTrainer", "XPOTrainer", "NashMDTrainer",
        "PPOTrainer", "GKDTrainer", "GOLDTrainer", "GMPOTrainer", "A2POTrainer",
        "AsyncGRPOTrainer", "DistillationTrainer", "AsyncDistillationTrainer",
        "ServerDistillationTrainer", "IWOPDTrainer", "SDFTTrainer", "SDPOTrainer")},
}
"""TRL trainer class -> support (the first TRL class in a trainer's MRO decides)."""


def trainer_class_problems(cls: type) -> list[str]:
    """One message when ``cls`` (a ``CephaloTrainerMixin`` subclass) sits on a TRL trainer
    the engine cannot run (``TRL_TRAINER_SUPPORT``; an unlisted one is refused as not
    validated); empty otherwise. Reads class names only (no TRL import)."""
    trl = next((c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"
                and c.__name__ != "_BaseTrainer" and c.__name__ != "Trainer"), None)
    if trl is None:
        return []
    support = TRL_TRAINER_SUPPORT.get(trl.__name__)
    if support is None:
        return [f"TRL's {trl.__name__} is not validated on the Cephalo runtime: its training "
                "step, loss and collator are not classified (hf_cephalo/integrations/"
                "trl_support.py); use CephaloSFTTrainer or stock TRL"]
    if support.status is Status.REFUSED:
        return [f"TRL's {trl.__name__} is not supported on the Cephalo runtime: it "
                f"{support.note}"]
    return []


def render_markdown() -> str:
    """The tables of docs/trl.md (TRL trainers, then the SFTConfig and DPOConfig fields)."""
    return "\n".join(markdown_table("TRL trainers", TRL_TRAINER_SUPPORT, 3)
                     + markdown_table("SFTConfig fields (beyond TrainingArguments)",
                                      SFT_FIELD_SUPPORT, 3)
                     + markdown_table("DPOConfig fields (beyond TrainingArguments)",
                                      DPO_FIELD_SUPPORT, 3))
