"""hf_cephalo: heterogeneous-GPU training for Hugging Face models (Cephalo, ICS'25).

Stages (imports point right-to-left): profiler -> planner -> engine -> integrations.
Heavy submodules are imported lazily so ``hf-cephalo plan`` starts without torch.distributed.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """Lazy top-level entries (importing them pulls in torch and transformers)."""
    if name == "from_pretrained_sharded":
        from hf_cephalo.integrations.pretrained import from_pretrained_sharded
        return from_pretrained_sharded
    raise AttributeError(f"module 'hf_cephalo' has no attribute {name!r}")
