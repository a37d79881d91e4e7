"""Profiler: measured profiles are valid and grow with m, the cache skips measurement, foreign
profiles are refused, and ``hf-cephalo profile`` writes a loadable ClusterProfile.

Single process (no process group): the collective part is covered by tests/test_emulate.py's
2-rank trainer run.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch
import transformers

from hf_cephalo.models import stage_model
from hf_cephalo.profiler import compute, measure
from hf_cephalo.profiles.cache import ProfileCache, model_description, model_fingerprint
from hf_cephalo.profiler.emulate import EmulationConfig
from hf_cephalo.profiler.measure import (MeasureConfig, check_profile_matches, model_profile,
                                         profile_cluster)
from hf_cephalo.profiles.types import ClusterProfile
from tests.models_fixtures import build


def _llama(hidden=128, layers=2):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# without re-measures a load spike leaves an implausible backward, warned about (checked below)
@pytest.mark.filterwarnings("ignore:.*backward time still implausible:RuntimeWarning")
def test_measured_profile_is_valid_and_grows_with_microbatch_size(capsys, monkeypatch):
    model = _llama()
    staged = stage_model(model)
    # What the timed loop ran (its microbatches) and measured, recorded around the real loop;
    # one measuring pass (no re-measures) so the profile follows from it exactly.
    timed = []

    def recording_rounds(staged, config, inputs, views, device, rank, name, before_each, f, fb):
        real_rounds(staged, config, inputs, views, device, rank, name, before_each, f, fb)
        timed.append(({m: tuple(inputs[m][1].shape) for m in inputs},
                      {m: list(v) for m, v in f.items()}, {m: list(v) for m, v in fb.items()}))

    real_rounds = compute._time_rounds
    monkeypatch.setattr(compute, "_time_rounds", recording_rounds)
    monkeypatch.setattr(compute, "MAX_REMEASURES", 0)
    cluster = profile_cluster(staged, MeasureConfig(max_microbatch_size=8, sequence_length=64,
                                                    repeats=3), cache=False)
    again = ClusterProfile.from_json(json.loads(json.dumps(cluster.to_json())))  # validates
    assert again.to_json() == cluster.to_json()
    (dev,) = cluster.devices
    assert dev.name == "cpu" and dev.microbatch_sizes == list(range(1, 9))
    assert all(t > 0 for t in dev.fwd_s + dev.bwd_s)
    # The CPU peak of live tensors is exact bookkeeping, deterministic: it grows with m, and
    # linearly once the activations outweigh the fixed-size gradient temporaries of the
    # weights (the parameter-sized gradient each backward adds into the persistent one).
    mem = dev.compute_memory_bytes
    steps = [b - a for a, b in zip(mem, mem[1:])]
    assert all(s > 0 for s in steps) and max(steps[3:]) == min(steps[3:]), mem
    # The kept forward graph (saved tensors + output, no parameter-sized temporaries): exactly
    # proportional to m, at least the output (one boundary tensor) and below what the
    # recompute + backward peaks at.
    kept = dev.kept_graph_bytes
    assert all(k == kept[0] * m for k, m in zip(kept, dev.microbatch_sizes)), kept
    assert 64 * model.config.hidden_size * 4 < kept[0] and kept[-1] < mem[-1], (kept, mem)
    assert cluster.model.boundary_bytes_per_sample == 64 * model.config.hidden_size * 4
    assert cluster.offload_activations is False and cluster.machine_of_rank == [0]
    # Times: no wall-clock comparison (a loaded machine can make m=8 look as fast as m=1;
    # benchmarks/bench_hetero.py prints the measured ratio). What holds on any machine: the
    # timed unit ran microbatches of m = 1..8 samples of 64 tokens, `repeats` times each, and
    # the profile is the non-decreasing fit of those runs' per-m medians.
    ((shapes, f_times, fb_times),) = timed
    assert shapes == {m: (m, 64, model.config.hidden_size) for m in range(1, 9)}
    assert all(len(f_times[m]) == len(fb_times[m]) == 3 for m in range(1, 9))
    fwd = [statistics.median(f_times[m]) for m in range(1, 9)]
    bwd = [statistics.median([fb - f for f, fb in zip(f_times[m], fb_times[m])])
           for m in range(1, 9)]
    bwd = [b if b > 0 and b >= compute.MIN_BWD_TO_FWD * f else compute.MIN_BWD_TO_FWD * f
           for f, b in zip(fwd, bwd)]  # [Note: implausible backward times]
    assert dev.fwd_s == compute._non_decreasing(fwd)
    assert dev.bwd_s == compute._non_decreasing(bwd)
    assert all(a <= b for a, b in zip(dev.fwd_s, dev.fwd_s[1:]))
    assert all(a <= b for a, b in zip(dev.bwd_s, dev.bwd_s[1:]))
    # The model profile covers every parameter; fp32 Adam state is 16 bytes per parameter.
    mp = cluster.model
    assert mp.num_units == 2 and mp.state_bytes_per_param == 16.0
    assert mp.num_params == sum(p.numel() for p in model.parameters())
    assert cluster.extra["model_fingerprint"] == model_fingerprint(model)
    assert cluster.extra["sequence_length"] == 64 and cluster.extra["dtype"] == "float32"
    out = capsys.readouterr().out
    # quiet by default: a summary line, a time-left line at most every QUIET_INTERVAL_S, no
    # per-microbatch lines (those are for --verbose / HF_CEPHALO_VERBOSE=1)
    assert "rank 0 (cpu): done; m=8" in out and "microbatch size 1/8" not in out, out


def test_non_decreasing_fit_pools_adjacent_violators():
    """The fit the profiler applies to per-m medians: least squares, non-decreasing."""
    assert compute._non_decreasing([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]  # unchanged
    assert compute._non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert compute._non_decreasing([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert compute._non_decreasing([1.0, 4.0, 2.0, 0.0, 6.0]) == [1.0, 2.0, 2.0, 2.0, 6.0]


def test_profiles_every_supported_architecture():
    """Synthetic microbatches fit each adapter's inputs (text, classification, vision)."""
    config = MeasureConfig(max_microbatch_size=2, sequence_length=12, repeats=1, warmup=0,
                           progress=False)
    for arch in ("gpt2", "gpt_neox", "vit", "bert", "mistral"):
        cluster = profile_cluster(stage_model(build(arch)), config, cache=False)
        assert cluster.devices[0].microbatch_sizes == [1, 2], arch
    # the generic path's encoder heads: each task's targets (token tags in [0, num_labels),
    # answer spans, masked-LM ids); token-id labels made a 7-tag NER model fail at the start
    text = dict(vocab_size=90, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=24)
    for cls, labels in ((transformers.BertForTokenClassification, 7),
                        (transformers.BertForQuestionAnswering, 2),
                        (transformers.BertForMaskedLM, 2)):
        model = cls(transformers.BertConfig(num_labels=labels, **text))
        cluster = profile_cluster(stage_model(model), config, cache=False)
        assert cluster.devices[0].microbatch_sizes == [1, 2], cls.__name__
    # a unit that makes a side input of the same width (T5's token classifier: its layer 0's
    # position bias, which every layer reads): made from the embedding's output before timing
    t5 = transformers.T5ForTokenClassification(transformers.T5Config(
        vocab_size=90, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2, num_labels=3))
    cluster = profile_cluster(stage_model(t5), config, cache=False)
    assert cluster.devices[0].microbatch_sizes == [1, 2]


def test_cache_hit_skips_measurement(tmp_path, monkeypatch):
    staged = stage_model(_llama(hidden=64))
    cache = ProfileCache(tmp_path)
    config = MeasureConfig(max_microbatch_size=3, sequence_length=16, repeats=1, progress=False)
    first = profile_cluster(staged, config, cache=cache)
    assert len(list(tmp_path.glob("device-*.json"))) == 1

    calls = []
    real = measure.measure_device

    def counting(*args, **kwargs):
        calls.append(kwargs.get("name"))
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "measure_device", counting)
    second = profile_cluster(staged, config, cache=cache)
    assert calls == [] and second.devices[0].to_json() == first.devices[0].to_json()
    # Any key component changing is a miss: sequence length, microbatch sizes, emulated device,
    # another model configuration.
    profile_cluster(staged, MeasureConfig(max_microbatch_size=3, sequence_length=17, repeats=1,
                                          progress=False), cache=cache)
    profile_cluster(staged, MeasureConfig(max_microbatch_size=2, sequence_length=16, repeats=1,
                                          progress=False), cache=cache)
    profile_cluster(staged, config, cache=cache, emulation=EmulationConfig(slowdown=[2.0]))
    profile_cluster(stage_model(_llama(hidden=64, layers=3)), config, cache=cache)
    assert calls == ["cpu", "cpu", "cpu [emulated 2x slower]", "cpu"]
    # An emulated capacity is not a new measurement but is recorded in the name and profile.
    capped = profile_cluster(staged, config, cache=cache,
                             emulation=EmulationConfig(memory_cap_bytes=[10**9]))
    assert capped.devices[0].memory_capacity_bytes == 1e9
    assert capped.devices[0].name == "cpu [emulated cap 0.931 GiB]"


def test_bf16_profile_times_under_autocast_and_is_kept_apart(tmp_path, monkeypatch):
    """precision="bf16" runs the timed forward calls under bf16 autocast (as --bf16 training
    does), is cached under its own key, records "float32+autocast-bf16", and such a profile is
    refused for an fp32 job (and the other way round)."""
    staged = stage_model(_llama(hidden=64))
    cache = ProfileCache(tmp_path)
    seen = []
    real_run_unit = type(staged).run_unit

    def spy(self, index, hidden, ctx):
        seen.append(torch.is_autocast_enabled("cpu") and
                    torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return real_run_unit(self, index, hidden, ctx)

    monkeypatch.setattr(type(staged), "run_unit", spy)
    fp32 = MeasureConfig(max_microbatch_size=2, sequence_length=8, repeats=1, progress=False)
    bf16 = MeasureConfig(max_microbatch_size=2, sequence_length=8, repeats=1, progress=False,
                         precision="bf16")
    plain = profile_cluster(staged, fp32, cache=cache)
    assert seen and not any(seen)
    seen.clear()
    mixed = profile_cluster(staged, bf16, cache=cache)
    assert seen and all(seen)
    assert len(list(tmp_path.glob("device-*.json"))) == 2  # not a cache hit of the fp32 entry
    assert (plain.extra["dtype"], mixed.extra["dtype"]) == ("float32", "float32+autocast-bf16")
    mine = model_profile(staged)
    check_profile_matches(mixed, mine, ["cpu"], dtype="float32+autocast-bf16")
    with pytest.raises(ValueError, match="measured in float32\\+autocast-bf16 but this job "
                                         "computes in float32 .*--precision fp32"):
        check_profile_matches(mixed, mine, ["cpu"], dtype="float32")
    with pytest.raises(ValueError, match="measured in float32 but .*--precision bf16"):
        check_profile_matches(plain, mine, ["cpu"], dtype="float32+autocast-bf16")
    with pytest.raises(ValueError, match="measured in float32\\+autocast-bf16 but .*"
                                         "float32\\+autocast-fp16.*--precision fp16"):
        check_profile_matches(mixed, mine, ["cpu"], dtype="float32+autocast-fp16")
    with pytest.raises(ValueError, match="precision = 'fp8'"):
        MeasureConfig(precision="fp8")


def test_refuses_profiles_of_other_models_and_devices(tmp_path, monkeypatch):
    llama = stage_model(_llama(hidden=64))
    config = MeasureConfig(max_microbatch_size=2, sequence_length=8, repeats=1, progress=False)
    cluster = profile_cluster(llama, config, cache=False)
    mine = model_profile(llama)
    fp = model_fingerprint(llama.model)
    check_profile_matches(cluster, mine, ["cpu"], dtype="float32", fingerprint=fp)  # accepted
    gpt2 = stage_model(build("gpt2"))
    with pytest.raises(ValueError, match=r"measured for model .* but this job's model .*re-profile"):
        check_profile_matches(cluster, model_profile(gpt2), ["cpu"])
    with pytest.raises(ValueError, match="another model configuration"):
        check_profile_matches(cluster, mine, ["cpu"], fingerprint="0" * 20)
    # The message names the differing fields, not only the hashes.
    other = _llama(hidden=64)
    other.config.rms_norm_eps = 0.5  # same shapes, other configuration
    with pytest.raises(ValueError, match=r"rms_norm_eps: profile 1e-06, this job 0\.5.*"
                                         r"fingerprint [0-9a-f]+ vs"):
        check_profile_matches(cluster, mine, ["cpu"], fingerprint=model_fingerprint(other),
                              description=model_description(other))
    # Sequence length: compute time and memory scale with it, so another length is refused.
    check_profile_matches(cluster, mine, ["cpu"], sequence_length=8)
    with pytest.raises(ValueError, match=r"measured at sequence length 8 but this job trains at "
                                         r"sequence length 16.*re-profile at 16"):
        check_profile_matches(cluster, mine, ["cpu"], sequence_length=16)
    with pytest.raises(ValueError, match="measured in float32 but this job computes in bfloat16"):
        check_profile_matches(cluster, mine, ["cpu"], dtype="bfloat16")
    # The gathered-parameter / reduce dtypes are part of the precision ([Note: precision tags]):
    # a profile measured with fp32 all-gathers under bf16 autocast is refused for a job that
    # gathers bf16 (its activation memory holds cast weight copies, its all-gathers 4 B).
    cluster.extra["dtype"] = "float32+autocast-bf16"
    check_profile_matches(cluster, mine, ["cpu"], dtype="float32+autocast-bf16")
    with pytest.raises(ValueError, match=r"measured in float32\+autocast-bf16 but this job "
                                         r"computes in float32\+autocast-bf16\+gather-bf16.*"
                                         r"--precision bf16 --param-dtype bf16 --reduce-dtype fp32"):
        check_profile_matches(cluster, mine, ["cpu"], dtype="float32+autocast-bf16+gather-bf16")
    cluster.extra["dtype"] = "float32"
    with pytest.raises(ValueError, match=r"other devices \(rank 0: profiled 'cpu', this job 'NVIDIA A10G'\)"):
        check_profile_matches(cluster, mine, ["NVIDIA A10G"])
    with pytest.raises(ValueError, match="other devices"):  # emulated never matches the real one
        check_profile_matches(cluster, mine, ["cpu [emulated 3x slower]"])
    with pytest.raises(ValueError, match="describes 1 ranks but the job has world size 2"):
        check_profile_matches(cluster, mine, ["cpu", "cpu"])
    cluster.devices[0].name = "A10G"
    check_profile_matches(cluster, mine, ["NVIDIA A10G"])  # spec-sheet style names match

    # Through the trainer: a profile file of another model is refused before training.
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

    for name in ("PLAN_FILE", "PROFILE_FILE", "GLOBAL_BATCH_SIZE"):
        monkeypatch.delenv("HF_CEPHALO_" + name, raising=False)
    path = tmp_path / "gpt2_profile.json"
    profile_cluster(gpt2, config, cache=False).save(path)
    args = CephaloTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none",
                                    cephalo_profile_file=str(path))
    with pytest.raises(ValueError, match=f"cephalo_profile_file '{path}' was measured for model"):
        CephaloTrainer(model=llama.model, args=args)
    # A profile of this model at sequence length 8 is refused for a dataset of 16-token blocks.
    path = tmp_path / "llama_seq8.json"
    cluster.devices[0].name = "cpu"  # this machine's device: the file is a pool looked up by name
    cluster.save(path)
    args = CephaloTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none",
                                    cephalo_profile_file=str(path), per_device_train_batch_size=2)
    blocks = [{"input_ids": list(range(16)), "labels": list(range(16))} for _ in range(4)]
    with pytest.raises(ValueError, match="measured at sequence length 8 but this job trains at "
                                         "sequence length 16"):
        CephaloTrainer(model=llama.model, args=args, train_dataset=blocks)
    assert not torch.distributed.is_initialized()


def test_cli_profile_writes_a_cluster_profile(tmp_path, capsys):
    from hf_cephalo.cli import main

    cfg_dir = tmp_path / "model"
    _llama(hidden=64).config.save_pretrained(cfg_dir)
    out = tmp_path / "profile.json"
    argv = ["profile", "--model-config", str(cfg_dir), "--out", str(out), "--sequence-length", "16",
            "--max-microbatch-size", "3", "--repeats", "1", "--cache-dir", str(tmp_path / "cache"),
            "--emulate-slowdown", "2"]
    assert main(argv) == 0
    cluster = ClusterProfile.load(out)
    assert cluster.devices[0].name == "cpu [emulated 2x slower]"
    assert cluster.devices[0].microbatch_sizes == [1, 2, 3]
    assert "cluster profile written to" in capsys.readouterr().out
    # The plan subcommand accepts it.
    assert main(["plan", "--profile", str(out), "-B", "4"]) == 0
    # --precision bf16 (an emulated slow device under bf16 autocast) is recorded as such, with
    # the gathered-parameter dtype (bf16 by default, as the trainer's --bf16) and the bytes the
    # memory model prices (profiles/precision.py [Note: precision tags]).
    assert main(argv + ["--precision", "bf16"]) == 0
    cluster = ClusterProfile.load(out)
    assert cluster.extra["dtype"] == "float32+autocast-bf16+gather-bf16"
    assert (cluster.model.param_gather_bytes, cluster.model.grad_reduce_bytes) == (2.0, 4.0)
    assert main(argv + ["--precision", "bf16", "--param-dtype", "fp32"]) == 0
    cluster = ClusterProfile.load(out)
    assert cluster.extra["dtype"] == "float32+autocast-bf16"  # the tag older profiles have
    assert (cluster.model.param_gather_bytes, cluster.model.grad_reduce_bytes) == (4.0, 4.0)
    assert main(argv + ["--precision", "fp16", "--reduce-dtype", "fp16"]) == 0
    cluster = ClusterProfile.load(out)
    assert cluster.extra["dtype"] == "float32+autocast-fp16+gather-fp16+reduce-fp16"
    assert (cluster.model.param_gather_bytes, cluster.model.grad_reduce_bytes) == (2.0, 2.0)
    assert main(["profile", "--model-config", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_implausible_backward_times_are_remeasured_then_warned(monkeypatch, recwarn):
    """A load spike can make (recompute + backward) - forward tiny or negative: re-measure,
    and if it persists warn with rank, m and the times instead of recording ~0 s."""
    staged = stage_model(_llama(hidden=64))
    config = MeasureConfig(max_microbatch_size=2, sequence_length=8, repeats=1, warmup=0,
                           progress=False)
    attempts = []

    def fake_rounds(plan):
        def rounds(staged, config, inputs, views, device, rank, name, before_each, f, fb):
            k = len(attempts)
            attempts.append(k)
            for m in config.microbatch_sizes:
                f[m].append(0.010 * m)
                fb[m].append(plan(k, m))
        return rounds

    # m=2's backward is negative on the first try, plausible (0.05 s) on the second.
    monkeypatch.setattr(compute, "_time_rounds", fake_rounds(
        lambda k, m: 0.010 * m + (0.03 if m == 1 or k else -0.005)))
    dev = measure.measure_device(staged, config, device="cpu", name="cpu", capacity_bytes=1e9)
    assert len(attempts) == 2 and not recwarn.list
    assert dev.bwd_s == pytest.approx([0.03, 0.03])  # m=1 first try; m=2 second; fitted

    # Always implausible (1 us vs 20 ms forward): bounded re-measures, then a loud warning.
    attempts.clear()
    monkeypatch.setattr(compute, "_time_rounds", fake_rounds(
        lambda k, m: 0.010 * m + (0.03 if m == 1 else 1e-6)))
    with pytest.warns(RuntimeWarning, match=r"rank 3 \(cpu\).*m=2: fwd 20\.0000 ms, bwd 0\.0010 ms"):
        dev = measure.measure_device(staged, config, device="cpu", name="cpu",
                                     capacity_bytes=1e9, rank=3)
    assert len(attempts) == 1 + compute.MAX_REMEASURES
    assert dev.bwd_s[1] >= compute.MIN_BWD_TO_FWD * dev.fwd_s[1] > 1e-3  # never ~0 s


def test_cli_profile_checks_out_path_before_measuring(tmp_path, capsys, monkeypatch):
    from hf_cephalo.cli import main

    def must_not_run(*args, **kwargs):
        raise AssertionError("profiled before checking --out")

    monkeypatch.setattr(measure, "profile_cluster", must_not_run)
    monkeypatch.delenv("RANK", raising=False)
    cfg_dir = tmp_path / "model"
    _llama(hidden=64).config.save_pretrained(cfg_dir)
    base = ["profile", "--model-config", str(cfg_dir), "--no-cache"]
    missing = tmp_path / "nonexistent" / "dir" / "p.json"
    assert main(base + ["--out", str(missing)]) == 2
    assert f"directory '{missing.parent}' does not exist" in capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_cli_profile_says_in_one_line_that_it_reused_a_cached_measurement(tmp_path, capsys,
                                                                         monkeypatch):
    """The second ``hf-cephalo profile`` of the same model reuses the first's measurement and
    says so in one line: whose, from which file, and how to measure again; ``--no-cache``
    measures again and says nothing of the cache."""
    from hf_cephalo.cli import main

    monkeypatch.delenv("RANK", raising=False)
    cfg_dir = tmp_path / "model"
    _llama(hidden=64).config.save_pretrained(cfg_dir)
    base = ["profile", "--model-config", str(cfg_dir), "--sequence-length", "8",
            "--max-microbatch-size", "1", "--repeats", "1", "--cache-dir", str(tmp_path / "c")]
    lines = []
    for extra in ([], [], ["--no-cache"]):
        assert main(base + ["--out", str(tmp_path / "p.json"), *extra]) == 0
        lines.append([ln for ln in capsys.readouterr().out.splitlines() if "cached" in ln])
    [entry] = tmp_path.joinpath("c").glob("device-*.json")
    assert lines[0] == [] and lines[2] == []
    [reused] = lines[1]
    assert reused.startswith("[hf-cephalo profile] rank 0 (cpu): reused the cached measurement "
                             f"{entry}, measured ")
    assert reused.endswith("(nothing timed); to measure again: pass --no-cache (or delete that "
                           "file)")


def test_cli_profile_takes_a_model_type_with_overrides(tmp_path, capsys, monkeypatch):
    """--model-config qwen3 --model-override ... profiles the model a config folder with those
    fields builds (the same units and parameters)."""
    import json

    from hf_cephalo.cli import main

    monkeypatch.delenv("RANK", raising=False)
    fields = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=97)
    folder = tmp_path / "qwen3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3",
                                                    "architectures": ["Qwen3ForCausalLM"],
                                                    **fields}))
    common = ["--sequence-length", "8", "--max-microbatch-size", "1", "--repeats", "1",
              "--cache-dir", str(tmp_path / "c")]
    assert main(["profile", "--model-config", str(folder), "--out", str(tmp_path / "a.json"),
                 *common]) == 0
    assert main(["profile", "--model-config", "qwen3", "--model-override",
                 *(f"{k}={v}" for k, v in fields.items()), "--out", str(tmp_path / "b.json"),
                 *common]) == 0
    a, b = (json.loads((tmp_path / f).read_text())["model"] for f in ("a.json", "b.json"))
    a.pop("name"), b.pop("name")
    assert a == b and a["num_units"] == 2
    assert main(["profile", "--model-config", "qwen3", "--model-override", "hiden_size=8",
                 "--out", str(tmp_path / "c.json")]) == 2
    assert "has no field 'hiden_size'" in capsys.readouterr().err


def test_cpu_capacity_is_the_host_ram_divided_between_its_ranks(monkeypatch):
    whole = measure.device_capacity_bytes("cpu")
    assert whole > 0 and measure.device_capacity_bytes("cpu", 4) == whole / 4
    with pytest.raises(ValueError, match="local_world_size = 0"):
        measure.device_capacity_bytes("cpu", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert measure.local_world_size() == 3
    config = MeasureConfig(max_microbatch_size=1, sequence_length=8, repeats=1, progress=False)
    cluster = profile_cluster(stage_model(_llama(hidden=64)), config, cache=False)
    assert cluster.devices[0].memory_capacity_bytes == whole / 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two'"):
        measure.local_world_size()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert measure.local_world_size() == 1  # no process group: this rank alone


def _refuses_before_building(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("built or profiled the model before checking the options")

    monkeypatch.setattr(measure, "profile_cluster", must_not_run)
    monkeypatch.setattr(measure, "build_model_from_config", must_not_run)
    monkeypatch.delenv("RANK", raising=False)


def test_cli_profile_refuses_dtypes_no_job_trains_with(tmp_path, capsys, monkeypatch):
    from hf_cephalo.cli import main

    _refuses_before_building(monkeypatch)
    cfg_dir = tmp_path / "model"
    _llama(hidden=64).config.save_pretrained(cfg_dir)
    base = ["profile", "--model-config", str(cfg_dir), "--out", str(tmp_path / "p.json")]
    for extra, says in ((["--precision", "bf16", "--dtype", "bfloat16"],
                         "--dtype bfloat16 with --precision bf16: bf16 autocast runs over float32"),
                        (["--dtype", "float16"], "--dtype float16: Cephalo does not train in "
                                                 "float16"),
                        (["--dtype", "float16", "--precision", "bf16"], "--dtype float16")):
        assert main(base + extra) == 2
        out, err = capsys.readouterr()
        assert out == "" and says in err and "--dtype float32" in err, err


def test_cli_profile_refuses_a_model_class_that_does_not_fit_the_config(tmp_path, capsys,
                                                                        monkeypatch):
    from hf_cephalo.cli import main

    _refuses_before_building(monkeypatch)
    cfg_dir = tmp_path / "model"
    _llama(hidden=64).config.save_pretrained(cfg_dir)
    base = ["profile", "--model-config", str(cfg_dir), "--out", str(tmp_path / "p.json")]
    assert main(base + ["--model-class", "GPT2LMHeadModel"]) == 2
    err = capsys.readouterr().err
    assert ("--model-class GPT2LMHeadModel builds from a 'gpt2' config but "
            f"'{cfg_dir / 'config.json'}' has model_type 'llama'") in err
    assert "such as LlamaForCausalLM" in err
    assert main(base + ["--model-class", "LlamaConfig"]) == 2
    assert "LlamaConfig is not a concrete transformers model class" in capsys.readouterr().err


def test_cli_profile_build_errors_name_the_class_and_config(tmp_path, capsys, monkeypatch):
    """A class whose config check passes but which still cannot be built from the config."""
    from hf_cephalo.cli import main

    def broken(*args, **kwargs):
        raise AttributeError("'LlamaConfig' object has no attribute 'embd_pdrop'")

    monkeypatch.setattr(measure, "build_model_from_config", broken)
    cfg_dir = tmp_path / "model"
    _llama(hidden=64).config.save_pretrained(cfg_dir)
    assert main(["profile", "--model-config", str(cfg_dir), "--out",
                 str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot build AutoModelForCausalLM from model config" in err and "'llama'" in err
    assert "embd_pdrop" in err and "pass a --model-class that fits this config" in err


def test_cli_profile_sequence_length_longer_than_the_model_names_the_flag(tmp_path, capsys,
                                                                          monkeypatch):
    """Refused before the process group and any measuring, naming --sequence-length and the
    model's limit (GPT-2's n_positions, Llama's max_position_embeddings)."""
    from hf_cephalo.cli import main

    monkeypatch.setattr(measure, "profile_cluster", lambda *a, **k: pytest.fail("profiled"))
    cfg_dir = tmp_path / "model"
    _llama(hidden=64).config.save_pretrained(cfg_dir)  # 128 positions
    assert main(["profile", "--model-config", str(cfg_dir), "--out", str(tmp_path / "p.json"),
                 "--sequence-length", "129"]) == 2
    assert capsys.readouterr().err == (
        f"error: --sequence-length 129 exceeds the model's 128 positions (model config "
        f"{str(cfg_dir / 'config.json')!r}); give --sequence-length 128 or less\n")
    gpt2_dir = tmp_path / "gpt2"
    transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(gpt2_dir)
    assert main(["profile", "--model-config", str(gpt2_dir), "--out", str(tmp_path / "p.json")]) == 2
    assert "error: --sequence-length 128 exceeds the model's 64 positions" in capsys.readouterr().err


def test_cli_profile_config_errors_name_the_file(tmp_path, capsys, monkeypatch):
    from hf_cephalo.cli import main

    monkeypatch.setattr(measure, "profile_cluster", lambda *a, **k: pytest.fail("profiled"))
    out = ["--out", str(tmp_path / "p.json")]
    bad = tmp_path / "config.json"
    bad.write_text("not json\n")
    assert main(["profile", "--model-config", str(bad)] + out) == 2
    err = capsys.readouterr().err
    assert f"model config '{bad}' is not valid JSON (Expecting value" in err
    assert main(["profile", "--model-config", str(tmp_path)] + out) == 2  # holds bad config.json
    assert f"model config '{bad}' is not valid JSON" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["profile", "--model-config", str(empty)] + out) == 2
    assert f"model config directory '{empty}' holds no config.json" in capsys.readouterr().err
    bad.write_text("[1, 2]")
    assert main(["profile", "--model-config", str(bad)] + out) == 2
    assert f"model config '{bad}' has no 'model_type'" in capsys.readouterr().err
    # the adapter list follows the reason after a separator
    cfg_dir = tmp_path / "model"
    _llama(hidden=64).config.save_pretrained(cfg_dir)
    assert main(["profile", "--model-config", str(cfg_dir), "--model-class", "NoSuchModel"]
                + out) == 2
    err = capsys.readouterr().err
    assert "(e.g. LlamaForCausalLM); hf_cephalo trains the causal-LM and " in err


def test_only_rank_0_prints_unless_verbose(capsys, monkeypatch):
    """58 progress lines per start came from every rank printing every second; now rank 0 prints
    a summary (and a time-left line every QUIET_INTERVAL_S), other ranks nothing; verbose
    restores every rank's per-second lines with per-microbatch times."""
    from hf_cephalo.profiler import measure as measure_module

    monkeypatch.setattr(compute, "QUIET_INTERVAL_S", 0.0)  # a time-left line every time
    staged = stage_model(_llama())
    quiet = MeasureConfig(max_microbatch_size=2, sequence_length=8, repeats=1)
    measure_module.measure_device(staged, quiet, device="cpu", name="cpu", capacity_bytes=1e9, rank=1)
    # no progress line; a load spike can make a backward time implausible, and then every rank
    # warns (tested above): on a loaded machine rank 1 printed that warning, and only that
    out = capsys.readouterr().out
    assert all("backward time still implausible" in line for line in out.splitlines()), out
    measure_module.measure_device(staged, quiet, device="cpu", name="cpu", capacity_bytes=1e9, rank=0)
    out = capsys.readouterr().out
    assert "rank 0 (cpu): done" in out and "s left" in out and "microbatch size 1/2" not in out
    loud = MeasureConfig(max_microbatch_size=2, sequence_length=8, repeats=1, verbose=True)
    monkeypatch.setattr(compute, "QUIET_INTERVAL_S", 1e9)  # verbose uses its own 1 s
    measure_module.measure_device(staged, loud, device="cpu", name="cpu", capacity_bytes=1e9, rank=1)
    assert "rank 1 (cpu): done" in capsys.readouterr().out


def test_profiling_leaves_the_random_streams_as_they_were():
    """Profiling runs the units in train mode (GPT-2: dropout) and draws synthetic batches; a
    seeded run must train the same whether or not it profiled at start (a fresh profile and a
    cached one gave two different losses from one seed)."""
    import random

    import numpy as np

    def draws():
        return torch.rand(4), random.random(), float(np.random.rand())

    def seed():
        torch.manual_seed(123)
        random.seed(5)
        np.random.seed(7)

    staged = stage_model(build("gpt2"))  # built first: initialising it draws too
    config = MeasureConfig(max_microbatch_size=2, sequence_length=12, repeats=1, warmup=0,
                           progress=False)
    seed()
    expected = draws()
    seed()
    profile_cluster(staged, config, cache=False)
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
