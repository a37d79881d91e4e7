"""The self-check builds and runs its tiny copy on the CPU whatever the caller's default device
([Note: the self-check] in hf_cephalo/models/self_check.py).

A model built inside ``with torch.device("meta")`` and staged there (sharded loading's way, and
``benchmarks/bench_memory.py``'s) must be staged exactly as one staged outside it: before, the
tiny copy and its batch were made on the meta device too, and the class was refused as "not a
causal LM's".
"""

from __future__ import annotations

import torch
import transformers

from hf_cephalo.models import stage_model
from hf_cephalo.models.self_check import _CACHE
from tests.dist_utils import test_timeout

pytestmark = test_timeout(30.0)


def _config(**kw) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, **kw)


def test_staging_under_a_meta_default_device_proves_on_the_cpu():
    config = _config(max_position_embeddings=77)  # a (class, config) no other test proved
    _CACHE.clear()
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
        staged = stage_model(model)
        assert torch.empty(1).device.type == "meta"  # the caller's default is left as it was
    assert all(p.is_meta for p in model.parameters())  # the user's model is not touched
    reference = stage_model(transformers.Qwen3ForCausalLM(config))  # from the cache now
    assert staged.layout == reference.layout
    assert len(staged.units()) == 3
