"""Engine construction: meta-device start from a sharded checkpoint, seeded per-unit init of a
meta model, rank 0's weights for in-memory models, no full model kept (engine/loading.py).

One ``run_ranks`` per world size; every sub-case runs inside it.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import weakref

import pytest
import torch
import torch.distributed as dist
import transformers

from tests.dist_utils import run_ranks
from tests.models_fixtures import build
from tests.zoo_fixtures import SIDE_INPUTS, ZOO, build_zoo

ZOO_LOADED = ("qwen3", "gemma3", "gpt_oss")  # generic-path classes loaded sharded
SIDE_LOADED = ("gemma3n", "gemma4_e")  # many scalar buffers (scales) beside rotary ones

TIMEOUT_S = 600.0


def _save(tmp_path, tied: bool) -> str:
    """A tiny Llama saved as a sharded checkpoint (several files, index json)."""
    path = str(tmp_path / f"ckpt_tied{int(tied)}")
    build("llama", seed=0, tie_word_embeddings=tied).save_pretrained(path, max_shard_size="100KB")
    return path


def _unit_numels(model) -> list[int]:
    from hf_cephalo.models import stage_model

    staged = stage_model(model)
    numels = [sum(p.numel() for p in u.parameters()) for u in staged.units()]
    embed = {id(p): p.numel() for m in staged.embed_modules() for p in m.parameters()}
    # the head unit holds what the embedding unit does not (a tied weight lives in the latter)
    head = {id(p): p.numel() for m in staged.head_modules() for p in m.parameters()
            if id(p) not in embed}
    return numels + [sum(embed.values()), sum(head.values())]


def _layouts(numels: list[int], world_size: int) -> dict[str, list[list[int]] | None]:
    """Even (planner), uneven ratios (planner), and a hand layout whose ranges cut parameters
    mid-row, with a zero shard on one rank of the first unit."""
    out = {"even": None}
    if world_size == 2:
        out["ratios 0.8/0.2"] = [0.8, 0.2]
    else:
        out["ratios 0.5/0.3/0.2"] = [0.5, 0.3, 0.2]
    rows = []
    for i, n in enumerate(numels):
        cuts = [n // world_size + 37 * (r + 1) for r in range(world_size - 1)]
        if i == 0:
            cuts[0] = 0  # rank 0 holds nothing of unit 0
        if sum(cuts) > n:  # a small unit (a tied model's head: the final norm alone)
            cuts = [n // world_size] * (world_size - 1)
        rows.append(cuts + [n - sum(cuts)])
    out["hand, mid-row cuts"] = rows
    return out


def _engine(model, spec, **kw):
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model

    if spec is None or isinstance(spec[0], float):
        return CephaloEngine(stage_model(model), spec, **kw)
    return CephaloEngine(stage_model(model), shard_layout=spec, **kw)


def _shards(engine) -> list[torch.Tensor]:
    return [part.local.clone() for u in engine.all_units() for part in u.parts]


def _check_meta_equals_cpu(rank, world_size, ckpts) -> list[str]:
    """Meta start (checkpoint) == CPU start (from_pretrained), every rank's shards, exactly."""
    import hf_cephalo
    from hf_cephalo.engine.loading import StartKind

    done = []
    for tied, path in ckpts.items():
        cpu_model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        numels = _unit_numels(cpu_model)
        del cpu_model
        for name, spec in _layouts(numels, world_size).items():
            cpu_engine = _engine(transformers.LlamaForCausalLM.from_pretrained(path), spec)
            meta_model = hf_cephalo.from_pretrained_sharded(path)
            assert all(p.is_meta for p in meta_model.parameters())
            meta_engine = _engine(meta_model, spec)
            assert (cpu_engine.start_kind, meta_engine.start_kind) == \
                (StartKind.IN_MEMORY, StartKind.CHECKPOINT)
            for a, b in zip(_shards(cpu_engine), _shards(meta_engine)):
                assert torch.equal(a, b), f"tied={tied} layout {name}: shards differ"
            sd_meta, sd_cpu = meta_engine.full_state_dict(), cpu_engine.full_state_dict()
            if rank == 0:
                assert sd_meta.keys() == sd_cpu.keys()
                assert all(torch.equal(sd_meta[k], sd_cpu[k]) for k in sd_cpu)
                inv = meta_model.model.rotary_emb.inv_freq
                assert inv.device.type == "cpu" and not inv.is_meta
            done.append(f"tied={tied} {name}")
    return done


def _check_rank0_weights(rank, world_size) -> None:
    """Ranks build their model with DIFFERENT seeds: the engine holds rank 0's weights."""
    for tied in (False, True):
        model = build("llama", seed=100 + rank, tie_word_embeddings=tied)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        engine = _engine(model, [0.7] + [0.3 / (world_size - 1)] * (world_size - 1))
        full = engine.full_state_dict()
        gathered = [None] * world_size
        dist.all_gather_object(gathered, initial["lm_head.weight"][0, :4])
        assert not torch.equal(gathered[0], gathered[1]), "the ranks' inits should differ"
        if rank == 0:
            assert full.keys() == initial.keys()
            for key in initial:
                assert torch.equal(full[key], initial[key]), f"{key} is not rank 0's"


def _check_no_full_model_kept(rank, world_size) -> None:
    """After construction no original parameter is alive (weakrefs dead, model entries empty)."""
    model = build("llama", seed=0)
    refs = [weakref.ref(p) for p in model.parameters()]
    engine = _engine(model, [0.8] + [0.2 / (world_size - 1)] * (world_size - 1))
    gc.collect()
    alive = [i for i, r in enumerate(refs) if r() is not None]
    assert not alive, f"{len(alive)} original parameters are still referenced"
    assert all(p.numel() == 0 for p in model.parameters())
    assert engine.full_state_dict() is not None or rank != 0


def _meta_init(rank, world_size, spec, seed) -> dict | None:
    from hf_cephalo.engine.loading import StartKind

    config = build("llama").config
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    engine = _engine(model, spec, init_seed=seed)
    assert engine.start_kind is StartKind.INIT
    full = engine.full_state_dict()
    # numpy: pickled by value (torch tensors would travel as shared-memory handles of a
    # process that may have exited when the parent reads them)
    return None if full is None else {k: v.numpy() for k, v in full.items()}


def _expect_error(fn, *patterns) -> None:
    try:
        fn()
    except ValueError as exc:
        msg = str(exc)
        assert all(p in msg for p in patterns), f"message {msg!r} lacks {patterns}"
        return
    raise AssertionError(f"no ValueError (expected {patterns})")


def _check_bad_inputs(rank, world_size, bad) -> None:
    """Every rank raises the same ValueError before any collective (a barrier then passes)."""
    import hf_cephalo

    _expect_error(lambda: _engine(hf_cephalo.from_pretrained_sharded(bad["missing"]), None),
                  "model.layers.1.mlp.up_proj.weight", "model.safetensors.index.json")
    wider = build("llama").config
    wider.intermediate_size = 96
    _expect_error(lambda: _engine(hf_cephalo.from_pretrained_sharded(bad["shape"], config=wider),
                                  None),
        "model.layers.0.mlp.gate_proj.weight", "(96, 64)", ".safetensors")
    _expect_error(lambda: _engine(hf_cephalo.from_pretrained_sharded(bad["truncated"]), None),
                  "truncated", bad["truncated_file"])
    _expect_error(lambda: hf_cephalo.from_pretrained_sharded(bad["empty"]),
                  "model.safetensors")
    mixed = build("llama")
    with torch.device("meta"):
        mixed.lm_head = torch.nn.Linear(64, mixed.config.vocab_size, bias=False)
    _expect_error(lambda: _engine(mixed, None), "lm_head.weight", "meta device")
    dist.barrier()


def _check_trainer_meta_start(rank, world_size, path, out_dir) -> None:
    """CephaloTrainer on a ``from_pretrained_sharded`` model: the engine holds the checkpoint,
    stock Trainer did not move the model, a step trains; without a plan it is profiled through
    a copy (embedding, head and first layer built with the model's own init) and planned."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import hf_cephalo
    from hf_cephalo.engine.loading import StartKind
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    args = CephaloTrainingArguments(output_dir=out_dir, report_to="none", optim="sgd",
                                    max_steps=1, save_strategy="no", disable_tqdm=True)
    assert args.place_model_on_device is False
    # no plan: the meta model is profiled through a copy (embedding, head, first layer built
    # with the model's own init) and planned; the engine then reads the shards
    os.environ["HF_CEPHALO_PROFILE_CACHE"] = os.path.join(out_dir, "profile-cache")
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(1, 97, (4, 12), generator=gen)]
    auto = CephaloTrainer(model=hf_cephalo.from_pretrained_sharded(path), args=args,
                          train_dataset=rows)
    assert len(auto.plan.batch_sizes) == 2 and sum(auto.plan.batch_sizes) > 0, auto.plan
    trainer = CephaloTrainer(model=hf_cephalo.from_pretrained_sharded(path), args=args,
                             plan=Plan.from_ratios([1, 1], [1, 1], [0.7, 0.3]),
                             train_dataset=rows,
                             data_collator=lambda b: {k: torch.stack([r[k] for r in b])
                                                      for k in b[0]})
    assert trainer.engine.start_kind is StartKind.CHECKPOINT
    full = trainer.engine.full_state_dict()
    if rank == 0:
        reference = transformers.LlamaForCausalLM.from_pretrained(path).state_dict()
        assert full.keys() == reference.keys()
        assert all(torch.equal(full[k], reference[k]) for k in reference)
    trainer.train()
    assert trainer.state.global_step == 1


# ---- checkpoint keys through transformers' own mapping (every supported model class) --------
def _rewrite_keys(src: str, dst: str, rename, extra: dict | None = None) -> str:
    """A copy of the single-file checkpoint ``src`` with every key passed through ``rename``
    (plus ``extra`` tensors), its config alongside."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    tensors = {rename(k): v for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    save_file({**tensors, **(extra or {})}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    return dst


def _key_variant_folders(tmp_path) -> list[tuple[str, str, str, dict]]:
    """(arch, variant, folder, from_pretrained kwargs): for every supported model class the
    folder ``save_pretrained`` writes (GPT-NeoX stores ``embed_out.weight``; ViT stores
    ``encoder.layer.N.attention.attention.query``, both renamed by transformers on load) and a
    variant ``from_pretrained`` also accepts: causal LMs a checkpoint of the base model (no
    ``base_model_prefix``; tied head); BERT legacy ``LayerNorm.gamma`` / ``beta`` names plus a
    pretraining-head key the classifier does not use; ViT the model's current names; Llama also
    the user's ``key_mapping``; Qwen3, Gemma 3 and GPT-OSS (generic path) as sharded
    ``save_pretrained`` folders (the meta model holds nothing, each rank only its shards)."""
    from tests.models_fixtures import BUILDERS, CAUSAL

    out = []
    for arch in BUILDERS:
        saved = str(tmp_path / f"{arch}-save_pretrained")
        build(arch).save_pretrained(saved)
        out.append((arch, "save_pretrained", saved, {}))
        if arch in CAUSAL:
            model = build(arch, tie_word_embeddings=True)
            base = str(tmp_path / f"{arch}-base_model")
            getattr(model, model.base_model_prefix).save_pretrained(base)
            model.config.save_pretrained(base)  # the head model's config (tied)
            out.append((arch, "base model, unprefixed", base, {}))
    legacy = _rewrite_keys(
        str(tmp_path / "bert-save_pretrained"), str(tmp_path / "bert-legacy"),
        lambda k: k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                           "LayerNorm.beta"),
        extra={"cls.predictions.bias": torch.zeros(97)})
    out.append(("bert", "legacy gamma/beta + unused head key", legacy, {}))
    current = str(tmp_path / "vit-current_names")
    os.makedirs(current)
    from safetensors.torch import save_file

    vit = build("vit")
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()},
              os.path.join(current, "model.safetensors"), metadata={"format": "pt"})
    vit.config.save_pretrained(current)
    out.append(("vit", "current names", current, {}))
    for name in ZOO_LOADED + SIDE_LOADED:  # generic path: the model's own keys, conversions
        saved = str(tmp_path / f"{name}-save_pretrained")
        build_zoo(name).save_pretrained(saved, max_shard_size="100KB")
        out.append((name, "save_pretrained, sharded", saved, {}))
    mapped = _rewrite_keys(str(tmp_path / "llama-save_pretrained"), str(tmp_path / "llama-mapped"),
                           lambda k: k.replace("model.", "decoder.", 1))
    out.append(("llama", "key_mapping", mapped, {"key_mapping": {r"^decoder\.": "model."}}))
    return out


def _assert_same_buffers(model, reference, what: str) -> None:
    """Every buffer (each name, shared ones too) has the reference's shape, dtype and value."""
    got = dict(model.named_buffers(remove_duplicate=False))
    expected = dict(reference.named_buffers(remove_duplicate=False))
    assert got.keys() == expected.keys(), (what, set(got) ^ set(expected))
    for key, value in expected.items():
        b = got[key]
        assert (b.shape, b.dtype) == (value.shape, value.dtype), (what, key, b.shape, value.shape)
        assert torch.equal(b.cpu(), value), f"{what}: buffer {key} differs"


def _assert_same_outputs(engine, reference, what: str) -> None:
    """The engine's eval logits and loss on one batch (the same on every rank) equal the
    reference's forward."""
    from tests.models_fixtures import make_batch

    batch = make_batch("llama", 2, seed=3)
    out = engine.evaluate([batch])
    with torch.no_grad():
        ref = reference.eval()(**batch)
    diff = (out.logits[0].float().cpu() - ref.logits).abs().max().item()
    assert diff < 1e-5, (what, diff)
    assert abs(out.loss - ref.loss.item()) < 1e-5, (what, out.loss, ref.loss.item())


def _check_key_variants(rank, world_size, variants) -> list[str]:
    """Every folder: ``from_pretrained_sharded`` + the engine (uneven 0.7/0.3) holds, tensor by
    tensor, what ``from_pretrained`` loads (which loads every key: nothing newly initialized),
    and keeps the same weight conversions for saving; its buffers and, for ``SIDE_LOADED``,
    its logits and loss are those of ``from_pretrained`` too."""
    import hf_cephalo
    from tests.models_fixtures import BUILDERS

    done = []
    for arch, variant, path, kwargs in variants:
        cls = type(BUILDERS[arch]()) if arch in BUILDERS else \
            getattr(transformers, {**ZOO, **SIDE_INPUTS}[arch][0])
        reference, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
        assert not info["missing_keys"] and not info["mismatched_keys"], (arch, variant, info)
        model = hf_cephalo.from_pretrained_sharded(path, model_class=cls, **kwargs)
        assert all(p.is_meta for p in model.parameters()), (arch, variant)  # nothing read yet
        engine = _engine(model, [0.7, 0.3])
        held = sum(part.local.numel() for u in engine.all_units() for part in u.parts)
        total = sum(p.numel() for p in reference.parameters())
        assert held < 0.75 * total, (arch, variant, held, total)  # this rank's shards only
        conversions = [c.source_patterns for c in model._weight_conversions]
        assert conversions == [c.source_patterns for c in reference._weight_conversions], \
            (arch, variant, conversions)
        full = engine.full_state_dict()
        if rank == 0:
            expected = reference.state_dict()
            assert full.keys() == expected.keys(), (arch, variant)
            for key, value in expected.items():
                assert torch.equal(full[key], value), f"{arch} {variant}: {key} differs"
        _assert_same_buffers(model, reference, f"{arch} {variant}")
        if arch in SIDE_LOADED:
            _assert_same_outputs(engine, reference, f"{arch} {variant}")
        done.append(f"{arch}: {variant}")
    return done


def _ranks_main(rank, world_size, ckpts, bad, out_dir, variants):
    out = {"cases": _check_meta_equals_cpu(rank, world_size, ckpts)}
    _check_rank0_weights(rank, world_size)
    _check_no_full_model_kept(rank, world_size)
    if world_size == 2:
        out["init"] = [_meta_init(rank, world_size, None, seed=5),
                       _meta_init(rank, world_size, [0.9, 0.1], seed=5)]
        out["key_variants"] = _check_key_variants(rank, world_size, variants)
        _check_bad_inputs(rank, world_size, bad)
        _check_trainer_meta_start(rank, world_size, ckpts[True], out_dir)
    else:
        out["init"] = [_meta_init(rank, world_size, [0.2, 0.5, 0.3], seed=5)]
    return out


def _bad_checkpoints(tmp_path, good: str) -> dict[str, str]:
    bad = {}
    missing = str(tmp_path / "missing_entry")
    shutil.copytree(good, missing)
    index_path = os.path.join(missing, "model.safetensors.index.json")
    index = json.load(open(index_path))
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    json.dump(index, open(index_path, "w"))
    bad["missing"] = missing
    bad["shape"] = good
    truncated = str(tmp_path / "truncated")
    shutil.copytree(good, truncated)
    victim = sorted(f for f in os.listdir(truncated) if f.endswith(".safetensors"))[-1]
    victim_path = os.path.join(truncated, victim)
    size = os.path.getsize(victim_path)
    with open(victim_path, "r+b") as f:
        f.truncate(size - 100)
    bad["truncated"], bad["truncated_file"] = truncated, victim
    empty = tmp_path / "no_weights"
    empty.mkdir()
    shutil.copy(os.path.join(good, "config.json"), empty / "config.json")
    bad["empty"] = str(empty)
    return bad


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("loading")
    ckpts = {tied: _save(tmp_path, tied) for tied in (False, True)}
    bad = _bad_checkpoints(tmp_path, ckpts[False])
    out_dir = str(tmp_path / "trainer")
    variants = _key_variant_folders(tmp_path)
    return {w: run_ranks(_ranks_main, w, ckpts, bad, out_dir, variants, timeout_s=TIMEOUT_S)
            for w in (2, 3)}


def test_meta_start_equals_cpu_start(runs):
    for world_size, results in runs.items():
        cases = results[0]["cases"]
        assert len(cases) == 6, cases  # tied/untied x even / ratio / hand layouts
        assert all(r["cases"] == cases for r in results)


def test_checkpoint_keys_through_transformers_mapping(runs):
    """Every supported model class loads sharded, tensor by tensor equal to ``from_pretrained``,
    from the folder ``save_pretrained`` writes and from a variant ``from_pretrained`` accepts
    (hand-matched keys failed GPT-NeoX's ``embed_out`` and ViT's pre-rename names)."""
    from tests.models_fixtures import BUILDERS

    done = runs[2][0]["key_variants"]
    assert runs[2][1]["key_variants"] == done
    loaded = ZOO_LOADED + SIDE_LOADED
    assert {case.split(":")[0] for case in done} == set(BUILDERS) | set(loaded)
    assert len(done) == 2 * len(BUILDERS) + 1 + len(loaded), done


def test_meta_init_same_for_every_plan_and_world_size(runs):
    """Seeded per-unit init: the same weights for 2 ranks even, 2 ranks 0.9/0.1, 3 ranks."""
    dicts = [{k: torch.from_numpy(v) for k, v in d.items()}
             for d in runs[2][0]["init"] + runs[3][0]["init"]]
    for other in dicts[1:]:
        assert other.keys() == dicts[0].keys()
        for key in dicts[0]:
            assert torch.equal(other[key], dicts[0][key]), key


def test_meta_init_statistics_match_model_init(runs):
    """Per parameter kind, the seeded per-unit init has the model's own init distribution.

    Tolerances: a weight of n >= 2048 elements drawn N(0, 0.02) has a sample std within
    about 1/sqrt(2n) <= 1.6% of 0.02 (one sigma) and a mean within 0.02/sqrt(n) <= 4.4e-4;
    we allow 10% on the std (6 sigma) and 5 sigma on the mean, while a wrong scheme (e.g.
    torch's default kaiming-uniform, std 1/sqrt(3 * fan_in) = 0.072 here) is far outside.
    Deterministic kinds (norm weights = 1) must be equal exactly.
    """
    ours = {k: torch.from_numpy(v) for k, v in runs[2][0]["init"][0].items()}
    reference = build("llama", seed=0).state_dict()
    for key, ref in reference.items():
        got = ours[key]
        assert got.shape == ref.shape
        if ref.std() == 0:
            assert torch.equal(got, ref), key
            continue
        n, std = ref.numel(), float(ref.std())
        assert abs(float(got.std()) - std) <= 0.1 * std, key
        assert abs(float(got.mean())) <= 5 * std / n ** 0.5, key
        assert not torch.equal(got, ref)  # a different RNG stream, the same distribution


def test_from_pretrained_sharded_offline_hub_id(tmp_path, monkeypatch):
    """A Hub id resolves through the Hugging Face cache, offline (no network)."""
    from hf_cephalo.engine.checkpoint_files import resolve_checkpoint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: without this the lookup would try
    # the network (and wait for its time-outs) where transformers was imported before
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor"):
        resolve_checkpoint("hf-cephalo-test/not-a-cached-model",
                           cache_dir=str(tmp_path / "cache"))


def test_hub_id_resolves_from_cache_offline(tmp_path, monkeypatch):
    """A Hub id found in the Hugging Face cache (snapshot layout) is read offline."""
    import hf_cephalo

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "cache"
    commit = "0" * 40
    snapshot = cache / "models--hf-cephalo-test--tiny-llama" / "snapshots" / commit
    build("llama").save_pretrained(str(snapshot), max_shard_size="100KB")
    (cache / "models--hf-cephalo-test--tiny-llama" / "refs").mkdir()
    (cache / "models--hf-cephalo-test--tiny-llama" / "refs" / "main").write_text(commit)
    model = hf_cephalo.from_pretrained_sharded("hf-cephalo-test/tiny-llama",
                                               cache_dir=str(cache))
    files = model.cephalo_checkpoint
    assert files.index_path is not None and len(files.files) > 1
    assert all(str(snapshot) in f for f in files.files)


@pytest.mark.parametrize("tied", [False, True])
def test_profiling_copy_of_a_meta_model_keeps_its_facts(tmp_path, tied):
    """The copy profiling at start runs for a meta-device model has the model's facts (units,
    parameters per unit, embedding / head split, a tied weight once: to_empty gives each use
    its own tensor, the copy ties them again), materializes only what the profiler runs, and
    leaves the user's model on the meta device."""
    import hf_cephalo
    from hf_cephalo.models import stage_model
    from hf_cephalo.profiler.model_facts import model_profile, profiling_stand_in

    model = hf_cephalo.from_pretrained_sharded(_save(tmp_path, tied))
    staged = stage_model(model)
    copy = profiling_stand_in(staged)
    assert model_profile(copy) == model_profile(staged)
    run = {id(p) for m in [*copy.root_modules(), copy.units()[0]] for p in m.parameters()}
    assert all(not p.is_meta for m in [*copy.root_modules(), copy.units()[0]]
               for p in m.parameters())
    assert all(p.is_meta for p in copy.model.parameters() if id(p) not in run)
    assert all(p.is_meta for p in model.parameters())


def test_meta_init_seeds_the_cpu_generator_only(monkeypatch):
    """run_init draws each module's init from its own seed on the CPU generator and gives the
    caller's state back; a CUDA device's generators are not touched (torch.manual_seed
    reseeded them, and fork_rng(devices=[]) gives back the CPU's only)."""
    from hf_cephalo.engine.loading import run_init

    cuda_seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", cuda_seeds.append)  # a GPU's generators
    layer = torch.nn.Linear(4, 3)
    init = {id(layer): lambda m: torch.nn.init.normal_(m.weight)}
    state = torch.get_rng_state()
    run_init(init, [layer], seed=3)
    first = layer.weight.detach().clone()
    run_init(init, [layer], seed=3)
    assert torch.equal(layer.weight, first) and torch.equal(torch.get_rng_state(), state)
    run_init(init, [layer], seed=4)
    assert not torch.equal(layer.weight, first)
    assert cuda_seeds == []


@pytest.mark.parametrize("arch", SIDE_LOADED)
def test_buffers_moved_to_another_device_keep_their_names(tmp_path, arch):
    """Every buffer moved to a device other than the host is a new tensor: the ids of the
    host tensors it replaced were reused by buffers materialized later, which then took an
    earlier buffer's place (Gemma 3n's last ``embed_scale`` became a rotary ``inv_freq``).
    The meta device stands for a GPU here: each buffer keeps its shape and dtype."""
    import hf_cephalo
    from hf_cephalo.engine.loading import choose_source, place_buffers

    path = str(tmp_path / arch)
    build_zoo(arch).save_pretrained(path)
    reference = getattr(transformers, SIDE_INPUTS[arch][0]).from_pretrained(path)
    model = hf_cephalo.from_pretrained_sharded(path)
    meta = torch.device("meta")
    place_buffers(model, meta, choose_source(model, model.cephalo_checkpoint, seed=0,
                                             device=meta, rank=0, world_size=1, group=None))
    got = {k: (b.shape, b.dtype) for k, b in model.named_buffers(remove_duplicate=False)}
    assert got == {k: (b.shape, b.dtype)
                   for k, b in reference.named_buffers(remove_duplicate=False)}


def test_a_checkpoint_without_a_causal_lm_names_model_class(tmp_path):
    """from_pretrained_sharded's default class is AutoModelForCausalLM: an image classifier's
    checkpoint loaded without ``model_class=`` is refused with the argument to pass (it was
    transformers' bare "Unrecognized configuration class"), and loads with it."""
    import transformers

    from hf_cephalo import from_pretrained_sharded

    config = transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=8, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=16, num_labels=2)
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'vit' checkpoint \(ViTForImageClassification\) has no "
                                         r"causal LM; .*model_class=transformers\.ViTFor"):
        from_pretrained_sharded(tmp_path)
    model = from_pretrained_sharded(tmp_path, model_class=transformers.ViTForImageClassification)
    assert type(model).__name__ == "ViTForImageClassification"
