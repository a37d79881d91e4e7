"""An emulated slow rank decodes slower in the doors' generation (``session_generate``), not
only while its decode profile is measured: the layer hooks of ``emulated_decode`` are on while
the engine decodes, and off after (one process, a stand-in engine that records them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def _session(slowdown: float, seen: list):
    import transformers

    from hf_cephalo.engine.generation import GenerateOutput
    from hf_cephalo.models.registry import stage_model
    from hf_cephalo.profiler.emulate import EmulatedStagedModel

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=8)
    staged = EmulatedStagedModel(stage_model(transformers.Qwen3ForCausalLM(cfg)), slowdown)

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in staged.units())

    class Engine:
        def generate(self, prompts, rows, params, round_, **kwargs):
            seen.append(hooks())
            return GenerateOutput([[1] for _ in prompts], [True for _ in prompts],
                                  "gather_once", 1)

    engine = Engine()
    engine.staged = staged
    return SimpleNamespace(plan=None, job=SimpleNamespace(rank=0), engine=engine), hooks


@pytest.mark.parametrize("slowdown, expect_hooks", [(3.0, True), (1.0, False)])
def test_generation_runs_under_the_ranks_emulated_slowdown(slowdown, expect_hooks):
    from hf_cephalo.runtime.generation import SamplingParams, session_generate

    seen: list = []
    session, hooks = _session(slowdown, seen)
    before = hooks()
    params = SamplingParams(max_new_tokens=1, eos_token_ids=(), pad_token_id=0, seed=0)
    out = session_generate(session, [[1, 2]], [0], params, 0)
    assert out.completions == [[1]]
    assert (seen[0] > before) is expect_hooks  # two hooks per layer while decoding
    assert hooks() == before  # removed after
