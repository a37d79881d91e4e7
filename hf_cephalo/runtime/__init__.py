"""The Cephalo runtime: one core behind every front end (docs/design.md contract 8).

Planning at start / restart / live, the weighted split of the same global batches, the engine,
the optimizer over the shards, the loss scaler, checkpoints, the adaptive controller, the
accuracy report, elastic progress and the process group live here, taking one job description
(``job.Job``); ``CephaloTrainer``, ``CephaloAccelerator.prepare`` and the TRL trainers are thin
adapters over it. It imports no ``transformers.Trainer``.

[Note: the runtime's face]
This package is the doors' one way down: every name a door (``hf_cephalo.integrations``) uses
from below it is exported here, including the models / planner / profiles names they need, and
a door imports them only as ``from hf_cephalo.runtime import Name`` (tests/test_layering.py).
Every name is imported lazily, on first use: ``hf_cephalo.runtime.settings`` is read by
``hf-cephalo plan``, which needs no engine, no torch.distributed and no model code.
"""

from hf_cephalo.lazy import lazy_exports


def _from(module: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, module)


_EXPORTS = {
    # the job a door builds and the session that runs it on one rank
    **_from("job", "Job", "resolve_global_batch_size"),
    **_from("session", "Session"),
    # every Cephalo setting, declared once (the doors' argument fields and plugin options)
    **_from("settings", "CephaloSettings", "JobPrecision", "cephalo_fields", "ENV_PREFIX",
            "ACTIVATION_OFFLOAD_CHOICES", "ADAPTIVE_CHOICES"),
    # engine types the doors name (they import no hf_cephalo.engine)
    **_from("hf_cephalo.engine.compile", "CompileOptions"),
    **_from("hf_cephalo.engine.precision", "EnginePrecision"),
    # loader options and the weighted split of the same global batches
    **_from("data", "LoaderOptions"),
    **_from("sampler", "WeightedBatchSampler", "cut_rows", "split_rows", "packs_without_padding"),
    **_from("streaming", "StreamSteps", "is_stream"),
    **_from("global_width", "collator_name"),
    **_from("exchange", "StepExchange"),
    # the optimizer over the shards
    **_from("optim", "decay_groups", "engine_names", "parameter_names", "repoint_problems"),
    # checkpoint contents, and saving / resuming onto any plan and world
    **_from("checkpoint_contents", "CheckpointContents", "LOADERS_NAME", "read_contents"),
    # (a door saves and resumes through the Session: save_checkpoint, resume, save_model_files;
    # these two only find checkpoints)
    **_from("checkpointing", "resolve_resume", "is_complete"),
    # a user's loss on the staged outputs, and stock Trainer's item counts
    **_from("head_calls", "HeadCalls", "current_head_call"),
    **_from("user_loss", "HeadView", "UserLossStagedModel", "stock_smoother_shift"),
    **_from("stock_items", "ItemCountStagedModel", "label_count", "stock_count_shifts",
            "stock_item_count"),
    # generation on the sharded engine
    **_from("generation", "SamplingParams", "generate_rows", "generate_tensor",
            "generation_budget_bytes", "resolve_generation", "ResolvedGeneration"),
    **_from("generation_plan", "measure_decode_profiles", "plan_generation_split"),
    # loading a model by name, and the plan report
    **_from("pretrained", "load_named_model"),
    **_from("report", "format_plan_table"),
    # staged models (hf_cephalo.models): staging a Hugging Face model and what a door wraps
    **_from("door_models", "stage_model", "seq2seq_user_loss_items"),  # seq2seq at the doors
    **_from("hf_cephalo.models.registry", "supported_model_classes"),
    **_from("hf_cephalo.models.base", "StagedModel", "WrappedStagedModel", "Microbatch",
            "refuse_global_loss"),
    **_from("hf_cephalo.models.hf_common", "empty_logits", "is_causal_lm"),
    **_from("hf_cephalo.models.peft_lora", "is_peft_model"),
    # the plan and the cluster it is for (hf_cephalo.planner, hf_cephalo.profiles)
    **_from("hf_cephalo.planner", "Plan"),
    **_from("hf_cephalo.profiles.types", "ClusterProfile"),
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
