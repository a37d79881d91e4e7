"""hf_cephalo: heterogeneous-GPU training for Hugging Face models (Cephalo, ICS'25).

The doors (each a drop-in for its stock class; imported lazily, the TRL ones need the ``trl``
extra)::

    from hf_cephalo import CephaloTrainer, CephaloTrainingArguments      # transformers' Trainer
    from hf_cephalo import CephaloSeq2SeqTrainer, CephaloSeq2SeqTrainingArguments  # Seq2SeqTrainer
    from hf_cephalo import CephaloAccelerator, CephaloPlugin             # an Accelerate loop
    from hf_cephalo import CephaloSFTTrainer, CephaloSFTConfig           # TRL
    from hf_cephalo import CephaloDPOTrainer, CephaloDPOConfig
    from hf_cephalo import CephaloRewardTrainer, CephaloRewardConfig
    from hf_cephalo import CephaloKTOTrainer, CephaloKTOConfig
    from hf_cephalo import CephaloGRPOTrainer, CephaloGRPOConfig
    from hf_cephalo import CephaloRLOOTrainer, CephaloRLOOConfig
    from hf_cephalo import reproducible_rollout, SamplingParams, CompletionsCallback  # generation

Layers, each importing only the ones below it: ``units`` / ``profiles`` -> ``planner``,
``models``, ``engine`` -> ``profiler`` -> ``runtime`` -> ``integrations`` (the doors:
``integrations/trainer``, ``integrations/loop``, ``integrations/trl``). Nothing heavy is imported
here, so ``hf-cephalo plan`` starts without torch.distributed.
"""

from hf_cephalo.lazy import lazy_exports
from hf_cephalo.parent_death import install_parent_death_guard as _install_parent_death_guard
from hf_cephalo.rank_errors import install_rank_error_hook as _install_rank_error_hook

__version__ = "0.1.0"

# Under a launcher with several ranks, an uncaught error is printed once, not once per rank, and
# named in the launcher's report (hf_cephalo/rank_errors.py). Installed at import so errors in
# argument parsing are covered and any script importing hf_cephalo gets it; stdlib only, cheap.
_install_rank_error_hook()
# Under torchrun / accelerate launch, a worker ends within about a second of its launcher's death
# (hf_cephalo/parent_death.py, [Note: parent death]). Stdlib only, cheap.
_install_parent_death_guard()

_EXPORTS = {
    "CephaloTrainer": "hf_cephalo.integrations.trainer",
    "CephaloTrainingArguments": "hf_cephalo.integrations.trainer",
    "CephaloSeq2SeqTrainer": "hf_cephalo.integrations.trainer",
    "CephaloSeq2SeqTrainingArguments": "hf_cephalo.integrations.trainer",
    "CompletionsCallback": "hf_cephalo.integrations.trainer",
    "CephaloAccelerator": "hf_cephalo.integrations.loop",
    "CephaloPlugin": "hf_cephalo.integrations.loop",
    "CephaloSFTTrainer": "hf_cephalo.integrations.trl",
    "CephaloSFTConfig": "hf_cephalo.integrations.trl",
    "CephaloDPOTrainer": "hf_cephalo.integrations.trl",
    "CephaloDPOConfig": "hf_cephalo.integrations.trl",
    "CephaloGRPOTrainer": "hf_cephalo.integrations.trl",
    "CephaloGRPOConfig": "hf_cephalo.integrations.trl",
    "CephaloRLOOTrainer": "hf_cephalo.integrations.trl",
    "CephaloRLOOConfig": "hf_cephalo.integrations.trl",
    "CephaloRewardTrainer": "hf_cephalo.integrations.trl",
    "CephaloRewardConfig": "hf_cephalo.integrations.trl",
    "CephaloKTOTrainer": "hf_cephalo.integrations.trl",
    "CephaloKTOConfig": "hf_cephalo.integrations.trl",
    "reproducible_rollout": "hf_cephalo.integrations.trl",
    "SamplingParams": "hf_cephalo.runtime.generation",
    "from_pretrained_sharded": "hf_cephalo.runtime.pretrained",
    "latest_checkpoint": "hf_cephalo.runtime.elastic",
}

__all__ = ["__version__", *_EXPORTS]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
