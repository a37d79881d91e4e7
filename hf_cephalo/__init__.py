"""hf_cephalo: heterogeneous-GPU training for Hugging Face models (Cephalo, ICS'25).

Stages (imports point right-to-left): profiler -> planner -> engine -> integrations.
Heavy submodules are imported lazily so ``hf-cephalo plan`` starts without torch.distributed.
"""

__version__ = "0.1.0"
