"""The doors: Hugging Face front ends over the Cephalo runtime (``hf_cephalo.runtime``), a
folder each: ``trainer/`` (transformers' Trainer and Seq2SeqTrainer), ``loop/`` (an Accelerate
loop), ``trl/`` (TRL's SFT, DPO, Reward, KTO, GRPO and RLOO trainers); ``quiet`` holds the
scripts' output switches (progress bars, load reports). A door only translates its front end's
settings into the runtime's ``Job`` and calls the runtime. Every door name is re-exported here
and at ``hf_cephalo`` (lazily)."""

from hf_cephalo.lazy import lazy_exports

_EXPORTS = {
    **{n: "trainer" for n in ("CephaloTrainer", "CephaloTrainerMixin", "CephaloTrainingArguments",
                              "CephaloArguments", "job_from_training_args", "format_plan_table",
                              "format_loss_trend", "CompletionsCallback",
                              "CephaloSeq2SeqTrainer", "CephaloSeq2SeqTrainingArguments")},
    **{n: "loop" for n in ("CephaloAccelerator", "CephaloPlugin", "CephaloDistributedType",
                           "ACTIVATION_OFFLOAD_CHOICES", "ADAPTIVE_CHOICES")},
    **{n: "trl" for n in ("CephaloSFTTrainer", "CephaloSFTConfig", "CephaloDPOTrainer",
                          "CephaloDPOConfig", "CephaloGRPOTrainer", "CephaloGRPOConfig",
                          "CephaloRLOOTrainer", "CephaloRLOOConfig")},
    **{n: "trl" for n in ("CephaloRewardTrainer", "CephaloRewardConfig", "CephaloKTOTrainer",
                          "CephaloKTOConfig", "reproducible_rollout")},
    **{n: "quiet" for n in ("disable_progress_bars", "progress_bars_from_rank_zero", "print_line",
                            "quiet_load_report", "LOAD_REPORT_LOGGER")},
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
