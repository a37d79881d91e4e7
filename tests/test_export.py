"""Streamed sharded save (``save_pretrained_streamed``, ``export_hf``) == ``save_pretrained``.

For a tiny Llama (untied and tied), GPT-2 (tied) and, on the generic path, Qwen3, Gemma 3 and
GPT-OSS (issue 36), with ``max_shard_size`` small enough to
force several files: the engine's streamed save (2 and 3 gloo ranks, uneven layouts, a rank
without state) and the offline export of its sharded checkpoint write the same files, keys per
file, index and tensors as the reference model's ``save_pretrained``; its unsharded
``save_pretrained`` has the same tensors; ``from_pretrained`` loads the result with no missing
or unexpected keys, tied once, and gives the reference's logits. One all-gather per unit visit.
Also: bad input and a failing rank 0 raise on every rank; the writer drops each unit before
drawing the next (the "one file + one unit" bound).

One run_ranks call per world size; the comparisons run in the test process.
"""

from __future__ import annotations

import gc
import json
import os
import weakref

import pytest
import torch
from safetensors.torch import load_file

from hf_cephalo.engine import checkpoint as ckpt
from hf_cephalo.engine import export
from tests.dist_utils import run_ranks
from tests.models_fixtures import build, make_batch
from tests.zoo_fixtures import build_zoo

MAX_SHARD = "100KB"  # the tiny models are 320-440 KB: 4-6 files
CASES = {"llama": ("llama", {}), "llama_tied": ("llama", dict(tie_word_embeddings=True)),
         "gpt2": ("gpt2", {}), "qwen3": ("zoo", {}), "gemma3": ("zoo", {}), "gpt_oss": ("zoo", {})}
"""name -> (arch, build kwargs); arch "zoo": ``tests/zoo_fixtures.py``'s model of that name (the
generic path; GPT-OSS's experts go through transformers' weight conversions on save)."""


def _build(name: str, seed: int):
    arch, kw = CASES[name]
    return build_zoo(name, seed=seed) if arch == "zoo" else build(arch, seed=seed, **kw)
RATIOS = {2: [0.7, 0.3], 3: [0.5, 0.0, 0.5]}
TRAINED_SEED, BUILT_SEED = 4, 3  # the engine's model is built from one seed, loaded with another


def _ranks(rank, world_size, root):
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model

    out = {}
    for name in CASES:
        engine = CephaloEngine(stage_model(_build(name, BUILT_SEED)), RATIOS[world_size])
        engine.load_full_state_dict(_build(name, TRAINED_SEED).state_dict())
        base = os.path.join(root, f"{name}-w{world_size}")
        before = engine.stats.all_gather_count
        result = export.save_pretrained_streamed(engine, os.path.join(base, "streamed"),
                                                 max_shard_size=MAX_SHARD)
        gathers = engine.stats.all_gather_count - before
        sources, total = export.engine_sources(engine)
        plan = export.plan_hf_files(engine.staged.model, sources, max_shard_size=MAX_SHARD,
                                    total_parameters=total)
        ckpt.save_checkpoint(engine, os.path.join(base, "ckpt"))
        out[name] = dict(base=base, result=result, gathers=gathers, unit_order=plan.unit_order,
                         num_units=len(engine.shard_metadata()))
    out["errors"] = _error_cases(rank, engine, root)
    return out


def _error_cases(rank, engine, root):
    errors = {}
    with pytest.raises(ValueError, match="max_shard_size"):
        export.save_pretrained_streamed(engine, os.path.join(root, "x"), max_shard_size="10 apples")
    afile = os.path.join(root, "afile")
    if rank == 0:
        with open(afile, "w") as f:
            f.write("x")
    torch.distributed.barrier()
    with pytest.raises(ValueError, match="existing file"):
        export.save_pretrained_streamed(engine, afile)
    # only rank 0 writes: a target under a file fails there, mid-save; every rank raises
    with pytest.raises((ckpt.CheckpointError, OSError)) as info:
        export.save_pretrained_streamed(engine, os.path.join(afile, "sub"),
                                        max_shard_size=MAX_SHARD)
    errors["failed_save"] = str(info.value)
    # the engine is still usable afterwards: the collectives stayed in step
    errors["after"] = engine.full_state_dict() is not None
    return errors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return {w: run_ranks(_ranks, w, str(root / f"w{w}"), timeout_s=300) for w in (2, 3)}


def _weights(directory):
    """{file name: {key: tensor}} of the safetensors files in ``directory``."""
    return {n: load_file(os.path.join(directory, n)) for n in sorted(os.listdir(directory))
            if n.endswith(".safetensors")}


def _json(path):
    with open(path) as f:
        return json.load(f)


def _reference(name, tmp_path):
    model = _build(name, TRAINED_SEED)
    sharded, single = tmp_path / "ref_sharded", tmp_path / "ref_single"
    model.save_pretrained(sharded, max_shard_size=MAX_SHARD)
    model.save_pretrained(single)
    return model, str(sharded), str(single)


def _assert_same_as_save_pretrained(got_dir, name, tmp_path):
    model, ref_sharded, ref_single = _reference(name, tmp_path)
    got, want = _weights(got_dir), _weights(ref_sharded)
    assert len(got) > 2 and got.keys() == want.keys()  # same split, several files
    for file_name, tensors in want.items():
        assert list(got[file_name]) == list(tensors), file_name  # same keys, same order
        for key, value in tensors.items():
            assert torch.equal(got[file_name][key], value), key
    assert _json(os.path.join(got_dir, export.INDEX_NAME)) == \
        _json(os.path.join(ref_sharded, export.INDEX_NAME))
    # == the unsharded save_pretrained, tensor by tensor, same keys (tied weights once)
    merged = {k: v for tensors in got.values() for k, v in tensors.items()}
    single = load_file(os.path.join(ref_single, export.WEIGHTS_NAME))
    assert merged.keys() == single.keys()
    assert all(torch.equal(merged[k], v) for k, v in single.items())
    got_config = _json(os.path.join(got_dir, "config.json"))
    want_config = _json(os.path.join(ref_sharded, "config.json"))
    # the engine's adapters switch the KV cache off for training (models/hf_common.py)
    assert {k: v for k, v in got_config.items() if k != "use_cache"} == \
        {k: v for k, v in want_config.items() if k != "use_cache"}
    assert os.path.isfile(os.path.join(got_dir, "generation_config.json"))
    _assert_loads(got_dir, model)


def _assert_loads(directory, ref_model):
    loaded, info = type(ref_model).from_pretrained(  # the reference's attention kernel
        directory, output_loading_info=True,
        attn_implementation=ref_model.config._attn_implementation)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    batch = {k: v for k, v in make_batch("llama", 3, seed=9).items() if k != "labels"}
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**batch).logits, ref_model.eval()(**batch).logits)
    if ref_model.config.tie_word_embeddings:
        embed = loaded.get_input_embeddings().weight
        assert loaded.get_output_embeddings().weight.data_ptr() == embed.data_ptr()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_streamed_save_equals_save_pretrained(runs, world_size, name, tmp_path):
    got = runs[world_size][0][name]
    _assert_same_as_save_pretrained(os.path.join(got["base"], "streamed"), name, tmp_path)
    assert all(r[name]["result"] is None for r in runs[world_size][1:])  # rank 0 writes
    result = got["result"]
    assert result.files == sorted(result.files) and len(result.files) > 2
    # a file holds at most max_shard_size, or one tensor larger than that alone (GPT-OSS's
    # experts), as save_pretrained does
    largest = max(t.numel() * t.element_size()
                  for t in _build(name, TRAINED_SEED).state_dict().values())
    assert result.peak_file_bytes <= max(export.parse_max_shard_size(MAX_SHARD), largest)
    # one all-gather per unit visit; every unit gathered, none more than twice (a root unit
    # holding the embedding, saved first, and the head, saved last)
    order = got["unit_order"]
    assert got["gathers"] == len(order)
    assert sorted(set(order)) == list(range(got["num_units"]))
    assert max(order.count(u) for u in set(order)) <= 2


@pytest.mark.parametrize("name", list(CASES))
def test_export_of_checkpoint_equals_save_pretrained(runs, name, tmp_path):
    base = runs[3][0][name]["base"]
    with open(os.path.join(base, "ckpt", "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0"}')
    out = ckpt.export_hf(os.path.join(base, "ckpt"), str(tmp_path / "hf"), max_shard_size=MAX_SHARD)
    _assert_same_as_save_pretrained(out, name, tmp_path)
    with open(os.path.join(out, "tokenizer.json")) as f:
        assert f.read() == '{"version": "1.0"}'  # processor files travel with the weights
    # exporting again as one file replaces the previous export's shards and index
    ckpt.export_hf(os.path.join(base, "ckpt"), out)
    names = set(os.listdir(out))
    assert export.WEIGHTS_NAME in names and export.INDEX_NAME not in names
    assert not any(n.startswith("model-") for n in names)
    _assert_loads(out, _reference(name, tmp_path / "again")[0])


def test_export_cli_max_shard_size(runs, tmp_path, capsys):
    from hf_cephalo.cli import main

    src = os.path.join(runs[2][0]["gpt2"]["base"], "ckpt")
    assert main(["export", src, "--out", str(tmp_path / "hf"), "--max-shard-size", "100000"]) == 0
    assert "6 weight file(s)" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "hf" / export.INDEX_NAME)
    assert main(["export", src, "--out", str(tmp_path / "bad"), "--max-shard-size", "5XB"]) == 2
    assert "max_shard_size" in capsys.readouterr().err


def test_errors_raise_on_every_rank(runs):
    for world_size in (2, 3):
        # one message on every rank, naming rank 0 (which found the problem): shown once
        assert {r["errors"]["failed_save"] for r in runs[world_size]} == {
            runs[world_size][0]["errors"]["failed_save"]}
        for rank_result in runs[world_size]:
            errors = rank_result["errors"]
            assert "afile" in errors["failed_save"]
            assert errors["failed_save"].startswith("rank 0 could not save the model to")
            assert errors["after"] is (rank_result is runs[world_size][0])


def test_writer_drops_each_unit_before_the_next(tmp_path):
    """The writer holds at most one unit: when it draws unit k+1, unit k is no longer
    referenced (checked with weak references), whatever the file split."""
    from hf_cephalo.engine import FullUnit

    model = build("llama")
    sources = {k: export.SavedTensor(0 if k.startswith("model.layers.0.") else
                                     1 if k.startswith("model.layers.1.") else 2, k,
                                     tuple(v.shape), v.dtype)
               for k, v in model.state_dict().items()}
    state = model.state_dict()
    for limit in ("1KB", "30KB", MAX_SHARD, "50GB"):
        plan = export.plan_hf_files(model, sources, max_shard_size=limit,
                                    total_parameters=model.num_parameters())
        alive: list[weakref.ref] = []

        def stream():
            for u in plan.unit_order:
                gc.collect()
                assert all(ref() is None for ref in alive), "two units alive at once"
                payload = torch.ones(1)  # stands for the gathered flat buffer
                tensors = {k: state[k].clone() for k, s in sources.items() if s.unit == u}
                alive.append(weakref.ref(payload))
                tensors["__payload"] = payload
                yield FullUnit(u, tensors)
                del payload, tensors

        directory = tmp_path / limit
        directory.mkdir()
        result = export.write_hf_files(str(directory), plan, stream(), buffers={})
        merged = {k: v for t in _weights(str(directory)).values() for k, v in t.items()}
        assert set(merged) == set(state) and all(torch.equal(merged[k], v) for k, v in state.items())
        assert len(result.files) == len(plan.files)


def test_bad_max_shard_size():
    for bad in (0, -5, "12", "5XB", 1.5, True, None):
        with pytest.raises(ValueError, match="max_shard_size"):
            export.parse_max_shard_size(bad)
    assert export.parse_max_shard_size("5GB") == 5 * 10**9
    assert export.parse_max_shard_size(1234) == 1234


def test_merge_lora_refuses_a_checkpoint_without_lora(runs, tmp_path):
    pytest.importorskip("peft")
    from hf_cephalo.cli import main
    from hf_cephalo.engine.peft_merge import export_merged_lora

    src = os.path.join(runs[2][0]["gpt2"]["base"], "ckpt")
    with pytest.raises(ckpt.CheckpointError, match=r"no LoRA matrices .*without --merge-lora"):
        export_merged_lora(src, str(tmp_path / "hf"))
    assert main(["export", src, "--out", str(tmp_path / "hf"), "--adapter-config", src]) == 2
    assert not os.path.exists(tmp_path / "hf")
