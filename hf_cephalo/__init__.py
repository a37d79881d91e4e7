"""hf_cephalo: heterogeneous-GPU training for Hugging Face models (Cephalo, ICS'25).

Stages (imports point right-to-left): profiler -> planner -> engine -> integrations.
Heavy submodules are imported lazily so ``hf-cephalo plan`` starts without torch.distributed.
"""

from hf_cephalo.parent_death import install_parent_death_guard as _install_parent_death_guard
from hf_cephalo.rank_errors import install_rank_error_hook as _install_rank_error_hook

__version__ = "0.1.0"

# Under a launcher with several ranks, an uncaught error is printed once, not once per rank, and
# named in the launcher's report (hf_cephalo/rank_errors.py). Installed at import so errors in
# argument parsing are covered and any script importing hf_cephalo gets it; stdlib only, cheap.
_install_rank_error_hook()
# Under torchrun / accelerate launch, a worker ends within about a second of its launcher's death
# (SIGKILL of the launcher would otherwise leave it training and checkpointing as an orphan;
# hf_cephalo/parent_death.py, [Note: parent death]). Stdlib only, cheap.
_install_parent_death_guard()


def __getattr__(name: str):
    """Lazy top-level entries (importing them pulls in torch and transformers)."""
    if name == "from_pretrained_sharded":
        from hf_cephalo.integrations.pretrained import from_pretrained_sharded
        return from_pretrained_sharded
    raise AttributeError(f"module 'hf_cephalo' has no attribute {name!r}")
