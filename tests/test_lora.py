"""LoRA (peft) through the engine: parity with single-process PEFT training on the full batch.

Per architecture (Llama with LoRA on q/v; BERT classification with LoRA on query/value and the
classifier in ``modules_to_save``), a ``get_peft_model`` model of the same seed is trained 3
AdamW steps on 2 and 3 ranks with uneven plans (a rank without state, a rank without samples)
and on one process (the PeftModel's own forward, full batch). Checked: the losses and the
adapter weights (rtol 1e-5 / atol 1e-6), every frozen base weight bit-identical to the start,
optimizer state only for adapter elements (its element count = the trainable count), the
training-state bytes per rank counted from the shards, and a checkpoint of the frozen-base
model resumed onto another plan (other cut points inside the trainable prefix) and another
world size with the optimizer state bit-identical; ``export_merged_lora`` of that checkpoint
(given the adapter config) writes exactly the tensors of PEFT's ``merge_and_unload()`` of the
trained model, and ``from_pretrained`` of the base class gives its logits.

Two run_ranks calls: 3 ranks (train, save, resume on another plan) and 2 ranks (train, resume
the 3-rank checkpoint).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("peft")

from tests.dist_utils import budget_s, portable, run_ranks, test_timeout  # noqa: E402
from tests.models_fixtures import build, make_batch  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
JOB_S = 45.0  # seconds per process group (3 archs x 2 plans + a resume)
pytestmark = test_timeout(JOB_S, JOB_S)
ARCHS = ("llama", "bert", "llama_bf16")
TARGETS = {"llama": ["q_proj", "v_proj"], "bert": ["query", "value"],
           "llama_bf16": ["q_proj", "v_proj"]}
TASK = {"llama": "CAUSAL_LM", "bert": "SEQ_CLS", "llama_bf16": "CAUSAL_LM"}
# llama_bf16: the base stored in bf16 (as loaded with torch_dtype=torch.bfloat16), fp32 adapters
BASE_DTYPE = {"llama_bf16": torch.bfloat16}
NO_DROPOUT = {"bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)}
GLOBAL_BATCH, STEPS = 6, 3
PLANS = {  # name: (batch sizes, microbatch sizes, state ratios)
    "three": ([4, 0, 2], [2, 0, 1], [0.0, 0.7, 0.3]),   # rank 0 no state, rank 1 no samples
    "three_other": ([2, 2, 2], [1, 2, 1], [0.02, 0.03, 0.95]),  # cuts inside the adapters
    "two": ([5, 1], [2, 1], [0.8, 0.2]),
    "two_idle": ([6, 0], [3, 0], [0.0, 1.0]),             # rank 0 no state, rank 1 no samples
}
LR = 1e-2


def peft_model(arch: str):
    """The same LoRA model on every process: base of seed 0, adapters of seed 1 (both random,
    ``init_lora_weights=False``, so lora_A and lora_B both get gradients at step 1)."""
    from peft import LoraConfig, get_peft_model

    base = build(arch.removesuffix("_bf16"), seed=0, **NO_DROPOUT.get(arch, {}))
    base = base.to(BASE_DTYPE.get(arch, torch.float32))
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[arch],
                        task_type=TASK[arch], init_lora_weights=False)
    return get_peft_model(base, config).train()


def _batch(arch, step):
    arch = arch.removesuffix("_bf16")
    return make_batch(arch, GLOBAL_BATCH, seed=100 + step, padding=arch == "llama")


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, eps=1e-4)


def reference(arch: str) -> dict:
    """One process, the PeftModel's own forward on the full batch, 3 AdamW steps."""
    model = peft_model(arch)
    opt = _optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(STEPS):
        loss = model(**_batch(arch, step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    inner = model.base_model.model
    return dict(losses=losses, params={k: v.detach().clone() for k, v in inner.state_dict().items()},
                trainable={n for n, p in inner.named_parameters() if p.requires_grad})


def _setup(arch, plan):
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model

    sizes, micro, ratios = PLANS[plan]
    model = peft_model(arch)
    engine = CephaloEngine(stage_model(model), ratios)  # the PeftModel itself
    return engine, _optimizer(engine.parameters()), sizes, micro


def _microbatches(arch, step, rank, sizes, micro):
    batch = _batch(arch, step)
    lo = sum(sizes[:rank])
    mine = {k: v[lo:lo + sizes[rank]] for k, v in batch.items()}
    m = micro[rank]
    return [{k: v[i:i + m] for k, v in mine.items()} for i in range(0, sizes[rank], m)] if m else []


def _train(engine, opt, sizes, micro, arch, steps):
    losses = []
    for step in steps:
        out = engine.train_step(_microbatches(arch, step, engine.rank, sizes, micro))
        opt.step()
        engine.zero_grad()
        losses.append(out.loss)
    return losses


def _state_counts(engine, opt) -> dict:
    """This rank's element counts: shard, trainable part, optimizer-state elements, and the
    training-state bytes counted from the tensors (shards in their dtypes, the shard gradients,
    the optimizer state)."""
    units = engine.all_units()
    shard = sum(u.local_numel for u in units)
    trainable = sum(u.local_trainable_numel for u in units)
    moments = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in opt.state.values())
    shard_bytes = sum(p.local.numel() * p.element_size for u in units for p in u.parts)
    grad_bytes = sum(p.numel() * 4 for p in engine.parameters())  # the fp32 shard gradients
    moment_bytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                       for t in (s["exp_avg"], s["exp_avg_sq"]))
    return dict(shard_numel=shard, trainable_numel=trainable, moment_numel=moments,
                state_bytes=shard_bytes + grad_bytes + moment_bytes)


def _gathered_optimizer(engine, opt):
    import torch.distributed as dist

    local = [{k: v.detach().clone() for k, v in opt.state.get(p, {}).items()}
             for p in engine.parameters()]
    everyone = [None] * engine.world_size
    dist.all_gather_object(everyone, local)
    out = []
    for u in range(len(local)):
        keys = sorted(set().union(*(ranks[u].keys() for ranks in everyone)))
        out.append({k: (everyone[0][u].get(k) if k == "step" else
                        torch.cat([r[u][k] for r in everyone if k in r[u]])) for k in keys})
    return out


def _counts_everywhere(engine, opt):
    import torch.distributed as dist

    counts = [None] * engine.world_size
    dist.all_gather_object(counts, _state_counts(engine, opt))
    return counts


def _run(rank, arch, plan, steps=range(STEPS)):
    engine, opt, sizes, micro = _setup(arch, plan)
    losses = _train(engine, opt, sizes, micro, arch, steps)
    return engine, opt, losses


def _three_ranks(rank, world_size, root):
    from hf_cephalo.engine import checkpoint as ckpt

    results = {}
    for arch in ARCHS:
        engine, opt, losses = _run(rank, arch, "three")
        directory = os.path.join(root, arch)
        ckpt.save_checkpoint(engine, directory, opt)
        results[arch] = dict(losses=losses, params=engine.full_state_dict(),
                             counts=_counts_everywhere(engine, opt),
                             optim=_gathered_optimizer(engine, opt),
                             ratios=PLANS["three"][2], directory=directory)
        # resume onto a plan whose cut points fall inside the trainable prefix
        e2, o2, _, _ = _setup(arch, "three_other")
        ckpt.load_sharded(e2, directory)
        ckpt.load_sharded_optimizer(e2, o2, directory)
        results[arch]["resumed"] = dict(params=e2.full_state_dict(),
                                        optim=_gathered_optimizer(e2, o2))
    return results if rank == 0 else None


def _two_ranks(rank, world_size, root, directories):
    from hf_cephalo.engine import checkpoint as ckpt

    results = {}
    for arch in ARCHS:
        for plan in ("two", "two_idle"):
            engine, opt, losses = _run(rank, arch, plan)
            results[f"{arch}/{plan}"] = dict(losses=losses, params=engine.full_state_dict(),
                                             counts=_counts_everywhere(engine, opt),
                                             ratios=PLANS[plan][2])
        e2, o2, _, _ = _setup(arch, "two")
        ckpt.load_sharded(e2, directories[arch])
        ckpt.load_sharded_optimizer(e2, o2, directories[arch])
        results[f"{arch}/resumed"] = dict(params=e2.full_state_dict(),
                                          optim=_gathered_optimizer(e2, o2))
    return results if rank == 0 else None


def _three_worker(rank, world_size, root):
    return portable(_three_ranks(rank, world_size, root), True)


def _two_worker(rank, world_size, root, directories):
    return portable(_two_ranks(rank, world_size, root, directories), True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    three = run_ranks(_three_worker, 3, root, timeout_s=budget_s(JOB_S))[0]
    directories = {arch: three[arch]["directory"] for arch in ARCHS}
    two = run_ranks(_two_worker, 2, root, directories, timeout_s=budget_s(JOB_S))[0]
    results = {f"{arch}/three": three[arch] for arch in ARCHS}
    results.update(two)
    return portable(results, False)


@pytest.fixture(scope="module")
def references():
    return {arch: reference(arch) for arch in ARCHS}


RUNS = [f"{arch}/{plan}" for arch in ARCHS for plan in ("three", "two", "two_idle")]


@pytest.mark.parametrize("run", RUNS)
def test_lora_matches_single_process_peft(runs, references, run):
    arch = run.split("/")[0]
    got, want = runs[run], references[arch]
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(want["losses"], dtype=torch.float64),
                               rtol=RTOL, atol=ATOL)
    start = peft_model(arch).base_model.model.state_dict()
    assert got["params"].keys() == want["params"].keys()
    for key, value in want["params"].items():
        name = key  # state-dict key == parameter name for these models (no tied LoRA weights)
        if name in want["trainable"]:
            torch.testing.assert_close(got["params"][key], value, rtol=RTOL, atol=ATOL, msg=key)
            assert not torch.equal(value, start[key]), f"{key} did not train"
        else:  # frozen base: bit-identical to the start, in the engine as in the reference
            assert torch.equal(got["params"][key], start[key]), key
            assert torch.equal(value, start[key]), key


@pytest.mark.parametrize("run", RUNS)
def test_optimizer_state_only_for_adapter_elements(runs, references, run):
    arch = run.split("/")[0]
    counts = runs[run]["counts"]
    inner = peft_model(arch).base_model.model
    trainable = sum(p.numel() for p in inner.parameters() if p.requires_grad)
    total = sum(p.numel() for p in inner.parameters())
    assert sum(c["trainable_numel"] for c in counts) == trainable
    assert sum(c["shard_numel"] for c in counts) == total
    frozen_bytes = 2 if arch in BASE_DTYPE else 4  # per frozen element, as stored
    units = 2 + inner.config.num_hidden_layers
    for c, ratio in zip(counts, runs[run]["ratios"]):
        assert c["moment_numel"] == 2 * c["trainable_numel"]  # exp_avg + exp_avg_sq, adapters only
        # 16 B per trainable element (param, grad, 2 moments) + 4 or 2 B per frozen one
        assert c["state_bytes"] == 16 * c["trainable_numel"] + \
            frozen_bytes * (c["shard_numel"] - c["trainable_numel"])
        # r_i of the adapters AND r_i of the frozen base, within rounding (each part of each
        # unit is within 2 elements of r_i of it: [Note: two parts per unit])
        want = ratio * (16 * trainable + frozen_bytes * (total - trainable))
        assert abs(c["state_bytes"] - want) <= units * 2 * (16 + frozen_bytes), (c, want)
        if ratio == 0.0:
            assert c["state_bytes"] == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("where", ["resumed", "two_ranks"])
def test_frozen_base_checkpoint_resumes_onto_other_plans(runs, arch, where):
    saved = runs[f"{arch}/three"]
    got = saved["resumed"] if where == "resumed" else runs[f"{arch}/resumed"]
    for key, value in saved["params"].items():
        assert torch.equal(got["params"][key], value), key
    assert len(got["optim"]) == len(saved["optim"])
    for g, w in zip(got["optim"], saved["optim"]):
        assert g.keys() == w.keys()
        for key in w:
            assert torch.equal(torch.as_tensor(g[key]), torch.as_tensor(w[key])), key


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_export_equals_peft_merge_and_unload(runs, arch, tmp_path):
    import transformers
    from safetensors.torch import load_file

    from hf_cephalo.engine.peft_merge import export_merged_lora

    saved = runs[f"{arch}/three"]
    model = peft_model(arch)
    model.peft_config["default"].save_pretrained(str(tmp_path / "adapter"))
    model.base_model.model.load_state_dict(saved["params"])
    merged = model.merge_and_unload().eval()  # the single-process reference
    out = export_merged_lora(saved["directory"], str(tmp_path / "merged"),
                             adapter_config=str(tmp_path / "adapter"))
    got = load_file(os.path.join(out, "model.safetensors"))
    want = merged.state_dict()
    assert set(got) <= set(want)  # tied aliases once; from_pretrained below misses nothing
    for key in got:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    loaded, info = getattr(transformers, type(merged).__name__).from_pretrained(
        out, output_loading_info=True)
    assert not any(info.values()), info
    assert loaded.dtype == merged.dtype, (loaded.dtype, merged.dtype)
    # non-saved buffers as the reference has them: the bf16 fixture casts its whole model,
    # rotary inv_freq included, which from_pretrained recomputes in fp32
    for name, buf in merged.named_buffers():
        module, _, attr = name.rpartition(".")
        setattr(loaded.get_submodule(module), attr, buf.clone())
    batch = {k: v for k, v in _batch(arch, 0).items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(**batch).logits, merged(**batch).logits,
                                   rtol=RTOL, atol=ATOL)
