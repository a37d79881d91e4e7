"""Hugging Face integrations: CephaloTrainer, CephaloTrainingArguments, CephaloAccelerator/Plugin,
the weighted batch sampler, automatic planning, the demo datasets and the scripts' output
switches (progress bars, load reports). Names are imported lazily
(transformers is heavy): every name in a submodule's ``__all__`` is listed here, so
``from hf_cephalo.integrations import CephaloTrainer`` imports only what it needs."""

from importlib import import_module

_EXPORTS = {
    # trainer
    "CephaloTrainer": "trainer",
    "format_plan_table": "trainer",
    "format_loss_trend": "trainer",
    # training_args
    "CephaloTrainingArguments": "training_args",
    "CephaloArguments": "training_args",
    # accelerate
    "CephaloDistributedType": "accelerate",
    "CephaloPlugin": "accelerate",
    "CephaloAccelerator": "accelerate",
    "ENV_PREFIX": "accelerate",
    "ACTIVATION_OFFLOAD_CHOICES": "accelerate",
    "ADAPTIVE_CHOICES": "accelerate",
    # replan (how a plan is made: start, elastic restart, live)
    "ResolvedPlan": "replan",
    "resolve_plan_for_model": "replan",
    "resolve_elastic_plan": "replan",
    "select_world_devices": "replan",
    "check_state_fits_caps": "replan",
    "replan_with_measured_u": "replan",
    "replan_live": "replan",
    "adopt_checkpoint_split": "replan",
    "adopt_checkpoint_state": "replan",
    "resume_banner": "replan",
    # adaptive (live re-balancing)
    "AdaptiveCallback": "adaptive",
    "SlowdownScheduleCallback": "adaptive",
    "REPLANS_NAME": "adaptive",
    "format_switch": "adaptive",
    # auto_plan
    "wrap_staged": "auto_plan",
    "PlanAccuracyCallback": "auto_plan",
    "format_accuracy_table": "auto_plan",
    "diagnose_step_time": "auto_plan",
    # pretrained
    "from_pretrained_sharded": "pretrained",
    # quiet
    "disable_progress_bars": "quiet",
    "progress_bars_from_rank_zero": "quiet",
    "print_line": "quiet",
    "quiet_load_report": "quiet",
    "LOAD_REPORT_LOGGER": "quiet",
    # data
    "pydoc_texts": "data",
    "pydoc_text_dataset": "data",
    "train_bpe_tokenizer": "data",
    "group_texts": "data",
    "digits_image_datasets": "data",
    "EOS_TOKEN": "data",
    "PAD_TOKEN": "data",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
