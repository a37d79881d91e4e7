"""`hf-cephalo plan / simulate --model <config>`: the planner prices any transformers model from
the facts of a meta-device build (docs/planner.md, "Any model by its config").

Reference for the facts: Llama 3.2 1B's released config priced through the config path equals
the hand-written table shape ``llama-3.2-1b`` (itself checked against the published parameter
count) in every number the estimate uses; the other four configs (Qwen3 1.7B, Gemma 3 1B,
GPT-OSS 20B, Qwen3-30B-A3B, as released on the Hub, written to a temp folder: nothing is
downloaded) against their published total and active parameter counts and their configs'
layer patterns. Then `hf-cephalo plan` on one H100 and three T4s for each.
"""

from __future__ import annotations

import json
import re

import pytest

from hf_cephalo.cli import main
from tests.dist_utils import test_timeout

pytestmark = test_timeout(60.0)

_SLIDING_FULL = ["sliding_attention", "full_attention"] * 12
CONFIGS = {
    # meta-llama/Llama-3.2-1B config.json (the fields that shape the model)
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu", rope_theta=500000.0,
        rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3")),
    # Qwen/Qwen3-1.7B
    "qwen3-1.7b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        max_window_layers=28, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6,
        use_sliding_window=False, sliding_window=None, attention_bias=False),
    # google/gemma-3-1b-pt
    "gemma-3-1b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
        intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
        rope_local_base_freq=10000.0, rope_theta=1e6, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        attn_logit_softcapping=None),
    # openai/gpt-oss-20b (without its mxfp4 quantization_config: the weights' storage)
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, vocab_size=201088, max_position_embeddings=131072,
        num_local_experts=32, num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
        layer_types=_SLIDING_FULL, attention_bias=True, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_theta=150000.0, swiglu_limit=7.0, initial_context_length=4096,
        rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0, rope_type="yarn",
                          original_max_position_embeddings=4096, truncate=False)),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_window_layers=48,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False,
        sliding_window=None),
}
# published parameter counts (model cards), total and active per token, billions; GPT-OSS's
# card counts the active parameters without the token embedding (a lookup, 201088 x 2880)
PUBLISHED = {"qwen3-1.7b": (1.72, 1.72), "gemma-3-1b": (1.0, 1.0),
             "gpt-oss-20b": (20.91, 3.61 + 201088 * 2880 / 1e9), "qwen3-30b-a3b": (30.5, 3.3)}
# one H100 machine and one machine of three T4s, 50 Gbit/s between
CLUSTER = ("name: h100-3t4\ninterconnect_gbps: 50\nmachines:\n  - gpus: [H100]\n"
           "  - gpus: [T4, T4, T4]\n")
# how each model is trained on that cluster: full fp32 fine-tuning where the training state
# fits (16 B per parameter), LoRA on a bf16 base where it does not (the MoE models)
PLAN_FLAGS = {"qwen3-1.7b": [], "gemma-3-1b": [],
              "gpt-oss-20b": ["--lora-rank", "16", "--frozen-dtype", "bf16"],
              "qwen3-30b-a3b": ["--lora-rank", "16", "--frozen-dtype", "bf16"]}


def write_config(root, name: str) -> str:
    folder = root / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))
    return str(folder)


def _shape(folder: str, seq_len: int = 512, **overrides):
    from hf_cephalo.profiler.config_shape import config_shape, resolve_model_config

    config, source = resolve_model_config(folder, overrides)
    return config_shape(config, name="m", seq_len=seq_len, source=source)


def test_llama_config_prices_as_its_table_shape(tmp_path):
    """The config path reads what the hand-written table shape states, number for number."""
    from dataclasses import replace

    from hf_cephalo.profiles.specs import (estimate_cluster_profile, get_model_shape,
                                           load_cluster_yaml)

    table = get_model_shape("llama-3.2-1b")
    shape = _shape(write_config(tmp_path, "llama-3.2-1b"))
    assert replace(shape.model_profile(), name=table.name) == table.model_profile()
    assert shape.num_params == table.num_params == 1_235_814_400  # the safetensors' count
    assert shape.layer_fwd_flops() == table.layer_fwd_flops()
    assert shape.activation_bytes_per_sample() == table.activation_bytes_per_sample()
    assert shape.lora_dims() == table.lora_dims()
    (tmp_path / "c.yaml").write_text(CLUSTER)
    spec = load_cluster_yaml(tmp_path / "c.yaml")
    for precision in ("fp32", "fp16"):
        ours = estimate_cluster_profile(spec, shape, precision=precision)
        theirs = estimate_cluster_profile(spec, table, precision=precision)
        assert ours.devices == theirs.devices and ours.comm == theirs.comm


def test_dense_layers_of_a_moe_model_are_priced_per_layer(tmp_path):
    """Qwen3-MoE with its first two layers dense (mlp_only_layers): those layers hold another
    number of elements, recorded per layer, and their tokens run through all of their MLP."""
    shape = _shape(write_config(tmp_path, "qwen3-30b-a3b"), mlp_only_layers=[0, 1])
    sizes = shape.unit_params
    assert sizes[0] == sizes[1] != sizes[2] and len(set(sizes[2:])) == 1
    assert shape.layer_kinds[:3] == ("full_attention", "full_attention", "full_attention+moe")
    dense_mlp = 3 * 2048 * 6144
    routed_mlp = 8 * 3 * 2048 * 768 + 128 * 2048  # top-8 experts + the router
    assert shape.unit_matmul_params[0] - shape.unit_matmul_params[2] == dense_mlp - routed_mlp


def _check_facts(shape, name: str) -> None:
    """The facts read from the meta-device build against the model card and the config."""
    total, active = PUBLISHED[name]
    assert shape.num_params / 1e9 == pytest.approx(total, rel=0.02)
    assert shape.active_params / 1e9 == pytest.approx(active, rel=0.05)
    kinds = shape.layer_kinds
    if name == "gemma-3-1b":  # every 6th layer global, the others a 512-token window
        assert [i for i, k in enumerate(kinds) if k == "full_attention"] == [5, 11, 17, 23]
        assert set(shape.unit_attention_span) == {512}  # s = 512: the window is the sequence
    elif name == "gpt-oss-20b":  # alternating 128-token window / full attention, all MoE
        assert kinds == tuple(k + "+moe" for k in _SLIDING_FULL)
        assert shape.unit_attention_span[:2] == (128, 512)
        assert (shape.num_experts, shape.experts_per_token) == (32, 4)
    elif name == "qwen3-30b-a3b":
        assert kinds == ("full_attention+moe",) * 48
        assert (shape.num_experts, shape.experts_per_token) == (128, 8)
    else:
        assert kinds == ("full_attention",) * 28


def _plan_numbers(text: str) -> tuple[float, float]:
    speed = re.search(r"predicted speed-up over an even split: ([\d.]+)x", text)
    rate = re.search(r"predicted iteration time: [\d.]+ s, ([\d.]+) samples/s", text)
    assert rate, text
    return float(rate.group(1)), float(speed.group(1)) if speed else float("nan")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_plan_a_config_on_one_h100_and_three_t4s(tmp_path, capsys, name):
    """The model's facts, then `hf-cephalo plan --model <folder>` on one H100 + three T4s."""
    from hf_cephalo.planner.types import Plan

    folder = write_config(tmp_path, name)
    _check_facts(_shape(folder), name)
    if name == "gemma-3-1b":  # at 2048 tokens a sliding layer sees its 512, a global one all
        assert _shape(folder, seq_len=2048).unit_attention_span[:6] == (512,) * 5 + (2048,)
    (tmp_path / "c.yaml").write_text(CLUSTER)
    out = tmp_path / "plan.json"
    rc = main(["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", folder, "-B", "32",
               "--precision", "fp16", "--out", str(out), *PLAN_FLAGS[name]])
    text = capsys.readouterr().out
    assert rc == 0, text
    print(text)  # the numbers docs/planner.md quotes (pytest -s)
    plan = Plan.load(out)
    assert plan.world_size == 4 and sum(plan.batch_sizes) == 32
    assert f"model {name}" in text
    samples_per_s, speedup = _plan_numbers(text)
    assert samples_per_s > 0
    # the exact optimizer's plan is never predicted slower than the even split it may choose
    assert speedup != speedup or speedup >= 1.0  # nan: the even split does not fit
    if speedup != speedup:
        assert "even split (b_i = B/N, r_i = 1/N): does not fit" in text


def test_three_forms_of_a_config_price_the_same_model(tmp_path, capsys, monkeypatch):
    """A config folder, a Hub id in the local Hub cache and --model <model_type> with
    --model-override build the same model; nothing is downloaded."""
    import huggingface_hub.constants

    (tmp_path / "c.yaml").write_text(CLUSTER)
    fields = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                  tie_word_embeddings=False)
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", **fields}))
    repo = tmp_path / "hub" / "models--acme--small-qwen3"  # the Hub cache's layout
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text((folder / "config.json")
                                                                 .read_text())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    outs = []
    for model in (["--model", str(folder)], ["--model", "acme/small-qwen3"],
                  ["--model", "qwen3", "--model-override",
                   *(f"{k}={json.dumps(v)}" for k, v in fields.items())]):
        out = tmp_path / f"p{len(outs)}.json"
        assert main(["plan", "--cluster", str(tmp_path / "c.yaml"), *model, "-B", "8",
                     "--save-profile", str(out)]) == 0
        outs.append(json.loads(out.read_text()))
    capsys.readouterr()
    for o in outs:
        o["model"].pop("name")
        o["extra"].pop("model_shape")
    assert outs[0] == outs[1] == outs[2]
    # simulate prices the same config against the baselines
    assert main(["simulate", "--cluster", str(tmp_path / "c.yaml"), "--model", str(folder),
                 "-B", "8"]) == 0
    text = capsys.readouterr().out
    assert "model small" in text and "even FSDP split" in text


@pytest.mark.parametrize("argv, message", [
    (["--model", "qwen3", "--model-override", "hiden_size=64"],
     "has no field 'hiden_size'"),
    (["--model", "qwen3", "--model-override", "hidden_size"], "give KEY=VALUE"),
    (["--model", "llama-3b", "--model-override", "hidden_size=64"],
     "llama-3b is a table shape (fixed)"),
    (["--model", "no-such-org/no-such-model"], "is not in the local Hub cache"),
    (["--model", "gpt-99b"], "unknown model 'gpt-99b'"),
    (["--model", "vit-e", "--sequence-length", "64"], "tokens are fixed by its image patches"),
    (["--model", "qwen3", "--sequence-length", "100000"], "exceeds the 32768 positions"),
])
def test_config_model_refusals(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache miss must not try the network
    (tmp_path / "c.yaml").write_text(CLUSTER)
    assert main(["plan", "--cluster", str(tmp_path / "c.yaml"), "-B", "8", *argv]) == 2
    assert message in capsys.readouterr().err


def test_config_flags_refused_with_a_profile(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    prof = tmp_path / "p.json"
    assert main(["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", "llama-3b", "-B", "8",
                 "--save-profile", str(prof)]) == 0
    for flag in (["--model-override", "hidden_size=64"], ["--sequence-length", "128"]):
        assert main(["plan", "--profile", str(prof), "-B", "8", *flag]) == 2
        assert f"{flag[0]} " in capsys.readouterr().err
