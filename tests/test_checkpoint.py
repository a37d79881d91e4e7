"""Sharded engine checkpoints: resume equals the uninterrupted run, also re-laid onto another
plan (other state ratios, a rank without state) and another world size (3 ranks -> 2); AdamW
step / exp_avg / exp_avg_sq (gathered) and the LR scheduler position are restored exactly;
offline export loads with ``from_pretrained``; bad checkpoints give errors naming the file.

Two run_ranks calls: 3 ranks (uninterrupted run, save at step 3, resume on the same plan and on
another plan) and 2 ranks (resume onto another world size, the other-model error).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import get_linear_schedule_with_warmup

from hf_cephalo.engine import checkpoint as ckpt
from tests.dist_utils import budget_s, portable, run_ranks, test_timeout
from tests.models_fixtures import build, make_batch

RTOL, ATOL = 1e-5, 1e-6
# seconds per process group, measured (2 jobs in 55 s on 2 cores under load 7): the module
# fixture gets both jobs' budgets ([Note: test time budgets] in tests/dist_utils.py)
JOB_S = 30.0
pytestmark = test_timeout(JOB_S, JOB_S)
ARCHS = ("llama", "gpt2")  # gpt2: tied embeddings (one flat element, two state-dict keys)
# dropout off: the runs compared draw different random numbers (other ranks, other layouts)
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}
GLOBAL_BATCH, STEPS, SAVE_AT = 6, 6, 3
PLANS = {  # name: (batch sizes, microbatch sizes, state ratios)
    "A": ([3, 2, 1], [1, 2, 1], [0.5, 0.3, 0.2]),
    "A_other_ratios": ([1, 2, 3], [1, 1, 2], [0.0, 0.4, 0.6]),  # rank 0 holds no state
    "B_two_ranks": ([4, 2], [2, 1], [0.35, 0.65]),
}


def _global_batch(arch: str, step: int) -> dict[str, torch.Tensor]:
    return make_batch(arch, GLOBAL_BATCH, seed=100 + step, padding=True)


def _microbatches(arch, step, rank, sizes, micro):
    batch = _global_batch(arch, step)
    lo = sum(sizes[:rank])
    mine = {k: v[lo:lo + sizes[rank]] for k, v in batch.items()}
    m = micro[rank]
    return [{k: v[i:i + m] for k, v in mine.items()} for i in range(0, sizes[rank], m)]


def _setup(arch, plan, seed):
    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.models import stage_model

    sizes, micro, ratios = PLANS[plan]
    engine = CephaloEngine(stage_model(build(arch, seed=seed, **NO_DROPOUT.get(arch, {})).train()),
                           ratios)
    # eps 1e-4 (not 1e-8): attention's key bias has a zero true gradient, so its fp32 gradient is
    # rounding noise (~1e-9) that Adam with a tiny eps turns into full-lr steps of random sign;
    # runs that reduce in another order would then differ by ~lr, not by rounding
    opt = torch.optim.AdamW(engine.parameters(), lr=3e-3, weight_decay=0.01, eps=1e-4)
    sched = get_linear_schedule_with_warmup(opt, 2, STEPS)
    return engine, opt, sched, sizes, micro


def _train(engine, opt, sched, sizes, micro, arch, steps):
    losses = []
    for step in steps:
        out = engine.train_step(_microbatches(arch, step, engine.rank, sizes, micro))
        engine.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        engine.zero_grad()
        losses.append(out.loss)
    return losses


def _gathered_optimizer(engine, opt):
    """Rank 0: per unit {key: full tensor over the unit's trainable elements or scalar}."""
    import torch.distributed as dist

    local = []
    for p in engine.parameters():
        local.append({k: v.detach().clone() for k, v in opt.state.get(p, {}).items()})
    everyone = [None] * engine.world_size
    dist.all_gather_object(everyone, local)
    if engine.rank != 0:
        return None
    out = []
    for u in range(len(local)):
        keys = set().union(*(ranks[u].keys() for ranks in everyone))
        merged = {}
        for key in sorted(keys):
            parts = [ranks[u][key] for ranks in everyone if key in ranks[u]]
            if key == "step":
                assert all(torch.equal(p, parts[0]) for p in parts), "step differs across ranks"
                merged[key] = parts[0]
            else:
                merged[key] = torch.cat(parts)
        out.append(merged)
    return out


def _snapshot(engine, opt, sched):
    return dict(params=engine.full_state_dict(), optim=_gathered_optimizer(engine, opt),
                sched=sched.state_dict(), lr=[g["lr"] for g in opt.param_groups])


def _assert_snapshot_equal(got, want):
    assert got["sched"] == want["sched"] and got["lr"] == want["lr"]
    assert got["params"].keys() == want["params"].keys()
    for key, value in want["params"].items():
        assert torch.equal(got["params"][key], value), key
    assert len(got["optim"]) == len(want["optim"])
    for g, w in zip(got["optim"], want["optim"]):
        assert g.keys() == w.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in w:
            assert torch.equal(g[key], w[key]), key


def _resume(arch, plan, directory, sched_state):
    engine, opt, sched, sizes, micro = _setup(arch, plan, seed=7)  # other init: load must matter
    ckpt.load_sharded(engine, directory)
    ckpt.load_sharded_optimizer(engine, opt, directory)
    sched.load_state_dict(sched_state)
    return engine, opt, sched, sizes, micro


def _three_ranks(rank, world_size, root):
    results = {}
    for arch in ARCHS:
        directory = os.path.join(root, arch, f"step-{SAVE_AT}")
        engine, opt, sched, sizes, micro = _setup(arch, "A", seed=0)
        losses = _train(engine, opt, sched, sizes, micro, arch, range(SAVE_AT))
        ckpt.save_checkpoint(engine, directory, opt)
        at_save = _snapshot(engine, opt, sched)
        losses += _train(engine, opt, sched, sizes, micro, arch, range(SAVE_AT, STEPS))
        final = engine.full_state_dict()
        sched_state = at_save["sched"] if rank == 0 else None
        import torch.distributed as dist

        box = [sched_state]
        dist.broadcast_object_list(box, src=0)
        resumed = {}
        for plan in ("A", "A_other_ratios"):
            e2, o2, s2, sz2, mi2 = _resume(arch, plan, directory, box[0])
            snap = _snapshot(e2, o2, s2)
            more = _train(e2, o2, s2, sz2, mi2, arch, range(SAVE_AT, STEPS))
            resumed[plan] = dict(at_load=snap, losses=more, final=e2.full_state_dict())
        results[arch] = dict(losses=losses, at_save=at_save, final=final, resumed=resumed,
                             directory=directory)
    return results if rank == 0 else None


def _two_ranks(rank, world_size, root, reference):
    import torch.distributed as dist

    results = {}
    for arch in ARCHS:
        directory = reference[arch]["directory"]
        engine, opt, sched, sizes, micro = _resume(arch, "B_two_ranks", directory,
                                                   reference[arch]["at_save"]["sched"])
        snap = _snapshot(engine, opt, sched)
        losses = _train(engine, opt, sched, sizes, micro, arch, range(SAVE_AT, STEPS))
        results[arch] = dict(at_load=snap, losses=losses, final=engine.full_state_dict())
    # a checkpoint of another model (gpt2's into a llama engine) is refused, naming the file
    engine, *_ = _setup("llama", "B_two_ranks", seed=0)
    try:
        ckpt.load_sharded(engine, reference["gpt2"]["directory"])
        results["other_model_error"] = None
    except ckpt.CheckpointError as e:
        results["other_model_error"] = str(e)
    # optimizer state of another optimizer class is refused, naming the file
    sgd = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    try:
        ckpt.load_sharded_optimizer(engine, sgd, reference["llama"]["directory"])
        results["other_optimizer_error"] = None
    except ckpt.CheckpointError as e:
        results["other_optimizer_error"] = str(e)
    # a shard only rank 1 reads is corrupt: BOTH ranks raise (no rank runs ahead and hangs)
    own = os.path.join(root, "two_rank_ckpt")
    ckpt.save_checkpoint(engine, own)
    if rank == 0:
        path = os.path.join(own, ckpt.FILES.shard(1))
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"\x00\x01\x02")
    dist.barrier()
    try:
        ckpt.load_checkpoint(engine, own)
        results[f"one_rank_corrupt_error_{rank}"] = None
    except ckpt.CheckpointError as e:
        results[f"one_rank_corrupt_error_{rank}"] = str(e)
    gathered = [None, None]
    dist.all_gather_object(gathered, results[f"one_rank_corrupt_error_{rank}"])
    results["one_rank_corrupt_errors"] = gathered
    return results if rank == 0 else None


def _portable_result(fn):
    def wrapped(rank, world_size, *args):
        args = [portable(a, to_numpy=False) for a in args]
        return portable(fn(rank, world_size, *args), to_numpy=True)
    return wrapped


def _three_ranks_worker(rank, world_size, root):
    return _portable_result(_three_ranks)(rank, world_size, root)


def _two_ranks_worker(rank, world_size, root, reference):
    return _portable_result(_two_ranks)(rank, world_size, root, reference)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    three = run_ranks(_three_ranks_worker, 3, root, timeout_s=budget_s(JOB_S))[0]
    two = run_ranks(_two_ranks_worker, 2, root, three, timeout_s=budget_s(JOB_S))[0]
    return portable(three, to_numpy=False), portable(two, to_numpy=False)


def _close(got, want, exact):
    if exact:
        assert got == want
    else:
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.tensor(want, dtype=torch.float64), rtol=RTOL, atol=ATOL)


def _params_close(got, want, exact):
    assert got.keys() == want.keys()
    for key, value in want.items():
        if exact:
            assert torch.equal(got[key], value), key
        else:
            torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.parametrize("arch", ARCHS)
def test_resume_same_plan_is_bitwise_identical(runs, arch):
    ref = runs[0][arch]
    got = ref["resumed"]["A"]
    _assert_snapshot_equal(got["at_load"], ref["at_save"])
    _close(got["losses"], ref["losses"][SAVE_AT:], exact=True)
    _params_close(got["final"], ref["final"], exact=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("where", ["other_ratios_3_ranks", "two_ranks"])
def test_resume_relaid_onto_other_plan(runs, arch, where):
    ref = runs[0][arch]
    got = ref["resumed"]["A_other_ratios"] if where == "other_ratios_3_ranks" else runs[1][arch]
    # re-layout copies elements: the gathered state at load is EXACTLY the saved one
    _assert_snapshot_equal(got["at_load"], ref["at_save"])
    assert int(got["at_load"]["optim"][0]["step"]) == SAVE_AT
    assert got["at_load"]["sched"]["last_epoch"] == SAVE_AT
    # the following steps reduce in another order (other ranks / microbatches): rounding only
    _close(got["losses"], ref["losses"][SAVE_AT:], exact=False)
    _params_close(got["final"], ref["final"], exact=False)


def test_checkpoint_files_and_marker(runs):
    directory = runs[0]["llama"]["directory"]
    names = set(os.listdir(directory))
    assert names == {ckpt.FILES.LAYOUT, ckpt.FILES.BUFFERS, ckpt.FILES.COMPLETE,
                     *(ckpt.FILES.shard(r) for r in range(3))}
    assert not os.path.exists(ckpt.staging_path(directory))  # renamed into place


@pytest.mark.parametrize("arch", ARCHS)
def test_export_loads_with_from_pretrained(runs, arch, tmp_path):
    ref = runs[0][arch]
    with pytest.raises(ckpt.CheckpointError, match="inside the checkpoint directory"):
        ckpt.check_export_target(ref["directory"], os.path.join(ref["directory"], "sub", "hf"))
    out = ckpt.export_hf(ref["directory"], str(tmp_path / "hf"))
    want = ref["at_save"]["params"]
    model = type(build(arch)).from_pretrained(out)
    want_config = build(arch, **NO_DROPOUT.get(arch, {})).config
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings",
                "model_type"):
        assert getattr(model.config, key) == getattr(want_config, key), key
    got = model.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    merged = ckpt.read_full_state_dict(ref["directory"])
    assert merged.keys() == want.keys()
    assert all(torch.equal(merged[k], v) for k, v in want.items())
    if arch == "gpt2":
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_export_cli(runs, tmp_path):
    from hf_cephalo.cli import main

    assert main(["export", runs[0]["gpt2"]["directory"], "--out", str(tmp_path / "hf")]) == 0
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors")
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2


def test_export_refuses_unsafe_targets(runs, tmp_path, capsys):
    from hf_cephalo.cli import main

    src = runs[0]["gpt2"]["directory"]
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert main(["export", src, "--out", str(afile)]) == 2
    assert "an existing file" in capsys.readouterr().err
    assert afile.read_text() == "keep me"
    before = sorted(os.listdir(src))
    assert main(["export", src, "--out", src, "--overwrite"]) == 2
    assert "checkpoint directory itself" in capsys.readouterr().err
    assert sorted(os.listdir(src)) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    assert main(["export", src, "--out", str(other)]) == 2
    err = capsys.readouterr().err
    assert "not a previous export" in err and "notes.txt" in err and "--overwrite" in err
    assert not (other / "model.safetensors").exists()
    assert main(["export", src, "--out", str(other), "--overwrite"]) == 0
    assert (other / "model.safetensors").is_file() and (other / "notes.txt").is_file()
    # A previous export is replaced without --overwrite.
    again = tmp_path / "again"
    assert main(["export", src, "--out", str(again)]) == 0
    assert main(["export", src, "--out", str(again)]) == 0
    assert (again / "config.json").is_file()


def _flip_last_bytes(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_damaged_checkpoint_names_the_newest_complete_one_before_it(runs, tmp_path):
    """A corrupt checkpoint-N (what resume_from_checkpoint=True picks: the newest with the
    marker) is refused naming the newest complete checkpoint-M < N beside it and the flag that
    takes it (issue 33); one without the marker or with a file at another size than the marker
    recorded is passed over, as is anything newer than N."""
    src = runs[0]["llama"]["directory"]
    run = tmp_path / "run"
    for step in (1, 2, 3, 4, 5):
        shutil.copytree(src, run / f"checkpoint-{step}")
    with open(run / "checkpoint-2" / ckpt.FILES.shard(0), "r+b") as f:
        f.truncate(10)  # complete marker, wrong size: not a checkpoint to point to
    os.remove(run / "checkpoint-3" / ckpt.FILES.COMPLETE)  # a save that did not finish
    _flip_last_bytes(str(run / "checkpoint-4" / ckpt.FILES.shard(0)))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.read_full_state_dict(str(run / "checkpoint-4"))
    earlier = str(run / "checkpoint-1")
    assert str(e.value) == (
        f"{run / 'checkpoint-4' / ckpt.FILES.shard(0)}: corrupt — CRC-32 does not match the one "
        "recorded at save; the checkpoint is damaged: copy the directory again, or resume from "
        f"the newest complete checkpoint before it, {earlier}: --resume_from_checkpoint "
        f"{earlier} (in Python train(resume_from_checkpoint={earlier!r}); `hf-cephalo export "
        f"{earlier}` exports it)")
    assert ckpt.earlier_complete_checkpoint(str(run / "checkpoint-5")) == str(run / "checkpoint-4")
    assert ckpt.earlier_complete_checkpoint(str(run / "checkpoint-4") + "/") == earlier
    assert ckpt.earlier_complete_checkpoint(str(run / "checkpoint-1")) is None
    assert ckpt.earlier_complete_checkpoint(src) is None  # not named checkpoint-N
    # nothing complete before it: say so instead of pointing to an earlier one
    _flip_last_bytes(str(run / "checkpoint-1" / ckpt.FILES.shard(1)))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.read_full_state_dict(str(run / "checkpoint-1"))
    assert str(e.value).endswith(f"; the checkpoint is damaged: copy the directory again ({run} "
                                 "holds no complete checkpoint-N before it)")


def test_bad_checkpoints_name_the_file(runs, tmp_path):
    src = runs[0]["llama"]["directory"]

    def copy(name):
        dst = str(tmp_path / name)
        shutil.copytree(src, dst)
        return dst

    d = copy("missing")
    os.remove(os.path.join(d, ckpt.FILES.shard(1)))
    with pytest.raises(ckpt.CheckpointError, match=r"cephalo_shard_rank1\.safetensors: missing"):
        ckpt.read_full_state_dict(d)

    d = copy("truncated")
    path = os.path.join(d, ckpt.FILES.shard(2))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(ckpt.CheckpointError, match=r"rank2\.safetensors: corrupt .*bytes"):
        ckpt.export_hf(d, str(tmp_path / "out"))

    d = copy("flipped")
    path = os.path.join(d, ckpt.FILES.shard(0))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ckpt.CheckpointError, match=r"rank0\.safetensors: corrupt .*CRC-32") as e:
        ckpt.read_full_state_dict(d)
    assert str(e.value).endswith("; the checkpoint is damaged: copy the directory again, or "
                                 "resume from (or export) an earlier checkpoint (a Trainer's "
                                 "checkpoint-N, a save_state folder)")

    d = copy("header")  # a corrupt header with the size and CRC recorded to match
    path = os.path.join(d, ckpt.FILES.shard(1))
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)
    import json
    import zlib

    marker = os.path.join(d, ckpt.FILES.COMPLETE)
    data = json.load(open(marker))
    data["files"][ckpt.FILES.shard(1)]["crc32"] = zlib.crc32(open(path, "rb").read())
    json.dump(data, open(marker, "w"))
    with pytest.raises(ckpt.CheckpointError, match=r"rank1\.safetensors: corrupt safetensors"):
        ckpt.read_full_state_dict(d)

    d = copy("incomplete")
    os.remove(os.path.join(d, ckpt.FILES.COMPLETE))
    with pytest.raises(ckpt.CheckpointError, match="cephalo_complete.json: missing .*incomplete"):
        ckpt.read_full_state_dict(d)

    d = copy("swapped")  # a shard from another model's checkpoint of the same size is not enough
    gpt2_shard = os.path.join(runs[0]["gpt2"]["directory"], ckpt.FILES.shard(1))
    shutil.copy(gpt2_shard, os.path.join(d, ckpt.FILES.shard(1)))
    with pytest.raises(ckpt.CheckpointError, match=r"rank1\.safetensors: corrupt"):
        ckpt.read_full_state_dict(d, verify=True)

    d = copy("format1")  # written before the root split: resume refuses, export still reads
    for name in (ckpt.FILES.LAYOUT, ckpt.FILES.COMPLETE):
        data = json.load(open(os.path.join(d, name)))
        data["format"] = "hf_cephalo.sharded/1"
        json.dump(data, open(os.path.join(d, name), "w"))
    with pytest.raises(ckpt.CheckpointError, match=r"cephalo_layout.json: format "
                       r"hf_cephalo.sharded/1 keeps the root .* Export the model"):
        ckpt.load_sharded(None, d)  # refused before the engine is touched
    merged = ckpt.read_full_state_dict(d)
    assert all(torch.equal(merged[k], v) for k, v in runs[0]["llama"]["at_save"]["params"].items())

    os.makedirs(tmp_path / "plain")
    with pytest.raises(ckpt.CheckpointError, match="plain: not a Cephalo sharded checkpoint"):
        ckpt.read_full_state_dict(str(tmp_path / "plain"))

    # the same message on both ranks, naming the rank that found the problem: the launcher
    # shows it once (rank_errors.py)
    on_rank0, on_rank1 = runs[1]["one_rank_corrupt_errors"]
    assert on_rank0 is not None and on_rank0 == on_rank1
    assert on_rank0.startswith("rank 1 could not load the checkpoint: CheckpointError: ")
    assert "rank1.safetensors: corrupt" in on_rank0

    err = runs[1]["other_optimizer_error"]
    assert err is not None and "rank0.safetensors: optimizer state of AdamW, but the " \
        "optimizer is SGD" in err

    err = runs[1]["other_model_error"]
    assert err is not None and "cephalo_layout.json: checkpoint of another model" in err
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err
