"""`hf-cephalo plan` end to end (in-process `main`, plus one console-script run)."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_cephalo.cli import SUBCOMMANDS, main
from hf_cephalo.planner.types import Plan
from hf_cephalo.units import GIB


def test_plan_from_cluster_yaml(tmp_path, capsys):
    out, png, prof = tmp_path / "plan.json", tmp_path / "plan.png", tmp_path / "profile.json"
    rc = main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "llama-3b",
               "--global-batch-size", "256", "--out", str(out), "--plot", str(png),
               "--save-profile", str(prof)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted iteration time" in text and "samples/s" in text
    assert "spec-sheet estimates" in text
    assert "hf-cephalo profile --max-microbatch-size" not in text  # no GPU at hand to profile
    for dev in ("L4", "A6000", "P40", "P100"):
        assert dev in text
    plan = Plan.load(out)
    assert plan.global_batch_size == 256 and plan.world_size == 8
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the saved profile plans to the same result
    out2 = tmp_path / "plan2.json"
    assert main(["plan", "--profile", str(prof), "-B", "256", "--out", str(out2)]) == 0
    assert Plan.load(out2).batch_sizes == plan.batch_sizes


def test_plan_errors_exit_2(tmp_path, capsys):
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "-B", "8"]) == 2
    assert "--cluster needs --model" in capsys.readouterr().err
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "llama-3b",
                 "-B", "0"]) == 2
    assert "global batch size must be an integer >= 1" in capsys.readouterr().err
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "gpt-99b",
                 "-B", "8"]) == 2
    assert "unknown model 'gpt-99b'" in capsys.readouterr().err
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"model": {}, "comm": {}, "devices": []}))
    assert main(["plan", "--profile", str(bad), "-B", "8"]) == 2
    err = capsys.readouterr().err
    assert f"cluster profile '{bad}': model profile: missing field" in err
    # infeasible: aggregate memory names the binding constraint and the flags that relax it
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "vit-e",
                 "-B", "64", "--memory-fraction", "0.2"]) == 2
    err = capsys.readouterr().err
    # 56.7 GiB of state alone exceed 0.2 x 200 GiB: no batch size fits, so a smaller -B is not
    # offered; cluster_a's P40s have no bf16 (nor an fp16 rate), so no precision flag either
    assert "aggregate memory" in err and "at any global batch size" in err
    assert ("; to fit: a --memory-fraction closer to 1 (now 0.2), less memory per GPU "
            "(--lora-rank R), or more GPUs") in err
    # a cluster with half-precision GPUs is offered a --precision flag ...
    assert main(["plan", "--cluster", "examples/clusters/cluster_b.yaml", "--model", "vit-e",
                 "-B", "64", "--memory-fraction", "0.05"]) == 2
    err = capsys.readouterr().err
    # ... fp16 where some GPU has no bf16 (cluster_b's V100s and T4s); 64 ranks that cannot take
    # one sample are named as three runs of equal devices, not 64 entries
    assert "less memory per GPU (--precision fp16 or --lora-rank R)" in err, err
    assert "fits: ranks 0-15 (A10G): microbatch size 1 needs 2.1 GiB, cap 1.2 GiB; ranks 16-31 " \
           "(V100-16GB): " in err and err.count("microbatch size 1 needs") == 3, err
    # fewer samples than ranks with --no-idle: the two ways out, as flags
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "llama-3b",
                 "-B", "3", "--no-idle"]) == 2
    assert "smaller than the world size 8; allow idle ranks or raise the batch size (drop " \
           "--no-idle, or -B >= 8)" in capsys.readouterr().err


def test_registry_holds_plan():
    assert "plan" in SUBCOMMANDS
    with pytest.raises(SystemExit):
        main(["--help"])


def test_console_script():
    exe = shutil.which("hf-cephalo", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("console script not installed")
    r = subprocess.run([exe, "plan", "--cluster", "examples/clusters/cluster_b.yaml", "--model",
                        "llama-7b", "-B", "512"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("A10G") == 16 and r.stdout.count("T4") == 32


def _cluster_yaml(tmp_path, name="c.yaml"):
    src = Path("examples/clusters/cluster_a.yaml").read_text()
    path = tmp_path / name
    path.write_text(src)
    return path


def test_plan_option_validation(tmp_path, capsys, monkeypatch):
    prof = tmp_path / "profile.json"
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "llama-3b",
                 "-B", "16", "--save-profile", str(prof)]) == 0
    capsys.readouterr()
    # --model with --profile is an error, not silently ignored
    assert main(["plan", "--profile", str(prof), "--model", "llama-7b", "-B", "16"]) == 2
    err = capsys.readouterr().err
    assert "--model llama-7b applies only to --cluster" in err
    # absurd B: a clear refusal (the largest B within the limit), nothing printed on stdout
    assert main(["plan", "--profile", str(prof), "-B", "1000000"]) == 2
    out, err = capsys.readouterr()
    assert "global batch size 1000000 is too large" in err and out == ""
    # --plot without matplotlib: the install hint, before any solving
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plan", "--profile", str(prof), "-B", "16", "--plot",
                 str(tmp_path / "p.png")]) == 2
    out, err = capsys.readouterr()
    assert "pip install 'hf-cephalo[plot]'" in err and out == ""
    assert main(["simulate", "--profile", str(prof), "-B", "16", "--plot",
                 str(tmp_path / "s.png")]) == 2
    assert "pip install 'hf-cephalo[plot]'" in capsys.readouterr().err


def test_simulate_validates_every_batch_size_first(tmp_path, capsys):
    assert main(["simulate", "--cluster", "examples/clusters/cluster_a.yaml", "--model",
                 "llama-3b", "-B", "512", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "global batch size must be an integer >= 1, got 0" in err
    assert main(["simulate", "--cluster", "examples/clusters/cluster_a.yaml", "--model",
                 "llama-3b", "-B", "64", "100000000"]) == 2
    out, err = capsys.readouterr()
    assert "global batch size 100000000 is too large" in err and "global batch size 64" not in out


def test_plan_table_aligns_long_device_names():
    from hf_cephalo.cli import format_plan_table
    from hf_cephalo.planner.optimize import optimize
    from hf_cephalo.planner.simulate import predict
    from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile

    def dev(name):
        return DeviceProfile(name=name, memory_capacity_bytes=2**20, microbatch_sizes=[1],
                             fwd_s=[0.01], bwd_s=[0.02], compute_memory_bytes=[1000.0])

    cluster = ClusterProfile(
        model=ModelProfile(name="t", num_units=2, params_per_unit=100, params_other=0),
        devices=[dev("NVIDIA H100 80GB HBM3 (SXM5)"), dev("T4")],
        comm=CommProfile(allgather_s=0.001, reducescatter_s=0.001))
    plan = optimize(cluster, 4)
    table = format_plan_table(plan, predict(plan, cluster))
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1, table  # every row as wide as the header
    col = lines[0].index("b_i")
    for line in lines[2:]:
        assert line[col + len("b_i") - 1] != " ", table  # b_i right-aligned under its header
    # tiny memory in readable units, not 0.00 (state, activations and the engine buffers)
    assert "3.9 KiB / 819.2 KiB" in table


def test_profile_unsupported_config_names_only_supported_adapters(tmp_path, capsys):
    from transformers import T5Config

    from hf_cephalo.models import supported_model_classes

    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8,
             vocab_size=64).save_pretrained(tmp_path / "t5")
    assert main(["profile", "--model-config", str(tmp_path / "t5"), "--out",
                 str(tmp_path / "p.json"), "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "T5Config" in err and "causal-LM and sequence-classification heads" in err
    assert len(err) < 1200, err  # not transformers' list of every causal-LM config
    assert err.count("Config") <= len(supported_model_classes()) + 2


CLUSTER_A = "examples/clusters/cluster_a.yaml"
PLAN_A = ["plan", "--cluster", CLUSTER_A, "--model", "llama-3b", "-B", "16"]


def test_plan_output_paths_are_checked_before_solving(tmp_path, capsys):
    missing = tmp_path / "nonexistent" / "plan.json"
    for flag, path, says in (("--out", tmp_path, "is a directory"),
                             ("--save-profile", tmp_path, "is a directory"),
                             ("--plot", tmp_path, "is a directory"),
                             ("--out", missing, f"directory '{missing.parent}' does not exist"),
                             ("--save-profile", f"{tmp_path}/", "is a directory")):
        assert main(PLAN_A + [flag, str(path)]) == 2, (flag, path)
        out, err = capsys.readouterr()
        assert out == "" and f"error: {flag} '{path}" in err and says in err, err
        assert "Traceback" not in err
    # an input that is a directory, or missing: named, not an OSError
    assert main(["plan", "--profile", str(tmp_path), "-B", "16"]) == 2
    assert "--profile '%s' is a directory" % tmp_path in capsys.readouterr().err
    assert main(["plan", "--cluster", str(tmp_path / "nope.yaml"), "--model", "llama-3b",
                 "-B", "16"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # an output that would overwrite the input, or two outputs at one path
    prof = tmp_path / "profile.json"
    assert main(PLAN_A + ["--save-profile", str(prof)]) == 0
    capsys.readouterr()
    assert main(["plan", "--profile", str(prof), "-B", "16", "--out", str(prof)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "is the same file as --profile" in err
    assert prof.read_text().startswith("{") and "devices" in prof.read_text()  # untouched
    same = tmp_path / "x.json"
    assert main(PLAN_A + ["--out", str(same), "--save-profile", str(same)]) == 2
    assert "is the same file as --out" in capsys.readouterr().err


def test_plan_os_error_is_a_message_not_a_traceback(tmp_path, capsys, monkeypatch):
    def refuse(self, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Plan, "save", refuse)
    assert main(PLAN_A + ["--out", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Permission denied: '") and "plan.json" in err
    assert "check the path" in err


def test_plan_stops_quietly_when_stdout_closes(capsys, monkeypatch):
    import hf_cephalo.cli.plan as plan_command  # where run_plan looks the table up

    def closed(*args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(plan_command, "format_plan_table", closed)
    assert main(PLAN_A) == 1
    assert "error" not in capsys.readouterr().err


def test_plot_needs_an_image_file_name(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for argv in (PLAN_A, ["simulate", "--cluster", CLUSTER_A, "--model", "llama-3b", "-B", "16"]):
        bare = tmp_path / "plot_without_extension"
        assert main(argv + ["--plot", str(bare)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and "must end in an image format matplotlib writes" in err
        assert ".png" in err and ".pdf" in err and f"'{bare}.png'" in err
        assert not list(tmp_path.iterdir())
    svg = tmp_path / "plan.svg"
    assert main(PLAN_A + ["--plot", str(svg)]) == 0
    assert f"plot written to {svg}\n" in capsys.readouterr().out
    assert svg.read_text().lstrip().startswith("<?xml") and list(tmp_path.iterdir()) == [svg]


def test_cluster_yaml_of_wrong_types_names_file_and_field(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    for text, says in (("machines: 5\ninterconnect_gbps: 10\n", "'machines' must be a list"),
                       ("machines:\n  - 5\ninterconnect_gbps: 10\n",
                        "machines[0]: 'gpus' must be a list"),
                       ("machines:\n  - gpu: [T4]\ninterconnect_gbps: 10\n",
                        "machines[0]: a machine needs 'gpus'"),
                       ("machines:\n  - gpus: {T4: two}\ninterconnect_gbps: 10\n",
                        "GPU count for 'T4' must be an integer >= 0, got 'two'"),
                       ("machines:\n  - gpus: [[T4]]\ninterconnect_gbps: 10\n",
                        "GPU types must be names"),
                       ("machines:\n  - gpus: [T4]\ninterconnect_gbps: fast\n",
                        "interconnect_gbps must be a positive number (Gbit/s), got 'fast'"),
                       ("machines:\n  - gpus: [T4, Z80]\ninterconnect_gbps: 10\n",
                        "machines[0]: unknown GPU type 'Z80'")):
        bad.write_text(text)
        assert main(["plan", "--cluster", str(bad), "--model", "llama-3b", "-B", "8"]) == 2, text
        err = capsys.readouterr().err
        assert f"error: cluster file '{bad}'" in err and says in err, err


def test_spec_sheet_flags_are_refused_with_a_profile(tmp_path, capsys):
    prof = tmp_path / "profile.json"
    assert main(PLAN_A + ["--save-profile", str(prof)]) == 0
    capsys.readouterr()
    assert main(["plan", "--profile", str(prof), "-B", "16", "--precision", "bf16",
                 "--efficiency", "0.1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and ("--efficiency 0.1 and --precision bf16 apply only to --cluster "
                          "spec-sheet estimates") in err
    assert main(["plan", "--profile", str(prof), "-B", "16", "--precision", "fp32"]) == 2
    assert "--precision fp32 applies only to --cluster" in capsys.readouterr().err
    # simulate uses --precision for the batch-proportional baseline, but not --efficiency
    assert main(["simulate", "--profile", str(prof), "-B", "16", "--efficiency", "0.3"]) == 2
    assert "--efficiency 0.3 applies only to --cluster" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(prof), "-B", "16", "--precision", "fp32"]) == 0
    capsys.readouterr()
    # with --cluster they still apply; defaults unchanged
    assert main(PLAN_A + ["--efficiency", "0"]) == 2
    assert "--efficiency 0.0: efficiency must be in (0, 1]" in capsys.readouterr().err
    assert main(PLAN_A + ["--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "P40 has no bf16 support" in err and "--precision fp32" in err


def test_memory_fraction_is_checked_before_printing(capsys):
    for sub in (PLAN_A, ["simulate", "--cluster", CLUSTER_A, "--model", "llama-3b", "-B", "16"]):
        for c in ("2", "0", "nan"):
            assert main(sub + ["--memory-fraction", c]) == 2
            out, err = capsys.readouterr()
            assert out == "" and f"--memory-fraction {float(c)}: memory fraction must be" in err


def test_export_refuses_an_output_inside_the_checkpoint(tmp_path, capsys):
    ck = tmp_path / "checkpoint-1"
    ck.mkdir()
    (ck / "layout.json").write_text("{}")
    for out in (ck / "sub", ck, ck / "a" / ".." / "b"):
        assert main(["export", str(ck), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out '{out}' is " in err and "checkpoint directory" in err, err
        assert "give a directory outside it" in err
    assert sorted(p.name for p in ck.iterdir()) == ["layout.json"]


def test_export_of_a_run_folder_lists_its_checkpoints(tmp_path, capsys):
    """The run's output_dir instead of a checkpoint-N: the error lists the checkpoints inside
    (newest first, incomplete ones marked) and names the newest complete one."""
    from hf_cephalo.engine.checkpoint import FILES

    for step, complete in ((2, True), (10, True), (12, False)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / FILES.COMPLETE).write_text("{}")
    (tmp_path / "runs").mkdir()
    assert main(["export", str(tmp_path), "--out", str(tmp_path.parent / "merged")]) == 2
    err = capsys.readouterr().err
    assert (f"{tmp_path}: a run folder, not a checkpoint; it holds checkpoint-12 (incomplete), "
            f"checkpoint-10, checkpoint-2; give a checkpoint, e.g. the newest complete one: "
            f"{tmp_path / 'checkpoint-10'}") in err, err


def test_spec_sheet_what_if_in_fp16_and_bf16(capsys):
    """``--precision fp16`` prices each GPU at its fp16 rate with the default job's element
    sizes (bf16 / fp16 gathered units and all-gathers, 2 B boundaries); ``--precision bf16`` on
    a GPU without bf16 (compute capability < 8.0) is refused proposing fp16, as the trainer's
    check_bf16_support refuses ``--bf16`` there."""
    from hf_cephalo.profiles.specs import estimate_cluster_profile, load_cluster_yaml

    cluster_b = CLUSTER_A.replace("cluster_a", "cluster_b")
    assert main(["plan", "--cluster", cluster_b, "--model", "llama-3b", "-B", "64",
                 "--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "V100-16GB has no bf16 support (compute capability < 8.0" in err and \
        "--precision fp16" in err
    spec = load_cluster_yaml(cluster_b)
    fp32 = estimate_cluster_profile(spec, "llama-3b")
    fp16 = estimate_cluster_profile(spec, "llama-3b", precision="fp16")
    assert fp16.extra["dtype"] == "float32+autocast-fp16+gather-fp16"
    assert (fp16.model.param_gather_bytes, fp16.model.param_bytes) == (2.0, 4.0)
    assert fp16.model.boundary_bytes_per_sample == fp32.model.boundary_bytes_per_sample / 2
    v100 = next(i for i, d in enumerate(fp16.devices) if d.name == "V100-16GB")
    assert fp16.devices[v100].fwd_s[-1] < fp32.devices[v100].fwd_s[-1] / 4  # 125 vs 15.7 TFLOP/s
    assert main(["plan", "--cluster", cluster_b, "--model", "llama-3b", "-B", "64",
                 "--precision", "fp16"]) == 0
    capsys.readouterr()


def _bars(ax, label):
    """Heights and face colours of the bar container of ``ax`` labelled ``label``."""
    (bars,) = [c for c in ax.containers if c.get_label() == label]
    return [p.get_height() for p in bars.patches], [p.get_facecolor() for p in bars.patches]


def test_plan_figure_draws_the_memory_model_against_each_cap():
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgba

    from hf_cephalo.cli import plan_figure
    from hf_cephalo.planner.optimize import optimize
    from hf_cephalo.planner.simulate import predict
    from hf_cephalo.profiles.specs import estimate_cluster_profile, load_cluster_yaml

    cluster = estimate_cluster_profile(load_cluster_yaml("examples/clusters/cluster_a.yaml"),
                                       "llama-3b", efficiency=0.5, precision="fp32")
    S = cluster.model.state_bytes
    even = dataclasses.replace(Plan.even(8, 256, microbatch_size=32), memory_fraction=0.7)
    for plan in (optimize(cluster, 256, 0.7), even):
        pred = predict(plan, cluster)
        fig = plan_figure(plan, pred)
        share, mem = fig.axes
        assert share.get_ylabel() == "fraction" and mem.get_ylabel() == "GiB"
        state, state_colors = _bars(mem, "state r_i·S")
        compute, _ = _bars(mem, "compute M_i")
        (caps,) = [ln for ln in mem.get_lines() if ln.get_label() == "usable cap c·C_i"]
        # the bars stack to the memory model's peak (the `plan` table's "memory used" column)
        assert state == pytest.approx([r.state_ratio * S / GIB for r in plan.ranks], rel=1e-12)
        assert [s + c for s, c in zip(state, compute)] == pytest.approx(
            [p.memory_bytes / GIB for p in pred.ranks], rel=1e-12)
        assert list(caps.get_ydata()) == pytest.approx(
            [0.7 * d.memory_capacity_bytes / GIB for d in cluster.devices], rel=1e-12)
        assert [t.get_text() for t in mem.get_xticklabels()] == \
            [f"{r.rank}\n{r.device}" for r in plan.ranks]
        # a rank over its cap is drawn red, the others not
        assert [c == to_rgba("C3") for c in state_colors] == [not p.fits for p in pred.ranks]
        # the share of each cap in use is printed above its rank (readable where bars are flat)
        assert [t.get_text() for t in mem.texts] == \
            [f"{p.memory_bytes / p.cap_bytes:.0%}" for p in pred.ranks]
        # ... clear of its cap marker: each label's bottom is above the marker line's top edge
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        half_line_px = caps.get_markeredgewidth() / 2 * fig.dpi / 72
        for text, p in zip(mem.texts, pred.ranks):
            y_px = mem.transData.transform((0, max(p.memory_bytes, p.cap_bytes) / GIB))[1]
            assert text.get_window_extent(renderer).y0 > y_px + half_line_px, text.get_text()
    # the even plan with m = 32 overflows some GPUs, not all: both colours were checked
    assert {p.fits for p in pred.ranks} == {True, False}
    with pytest.raises(ValueError, match="prediction has 7 ranks, the plan 8"):
        plan_figure(plan, pred._replace(ranks=pred.ranks[:7]))


def test_plan_activation_checkpointing_auto_false_and_a_profile_without_kept_graphs(
        tmp_path, capsys):
    """--activation-checkpointing auto plans both and records the faster one that fits; false
    needs the profile's kept_graph_bytes (a spec-sheet profile has none: exit 2, the reason)."""
    from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile, ModelProfile

    ms = [1, 2, 4, 8]
    dev = DeviceProfile(name="gpu", memory_capacity_bytes=16 * GIB, microbatch_sizes=ms,
                        fwd_s=[0.01 * m for m in ms], bwd_s=[0.02 * m for m in ms],
                        compute_memory_bytes=[0.1 * GIB * m for m in ms],
                        kept_graph_bytes=[0.05 * GIB * m for m in ms])
    cluster = ClusterProfile(model=ModelProfile(name="m", num_units=2, params_per_unit=1000,
                                                params_other=0),
                             devices=[dev, dataclasses.replace(dev)],
                             comm=CommProfile(allgather_s=0.0, reducescatter_s=0.0))
    prof, out = tmp_path / "profile.json", tmp_path / "plan.json"
    cluster.save(prof)
    assert main(["plan", "--profile", str(prof), "-B", "16", "--activation-checkpointing",
                 "auto", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "activation checkpointing: off (forward graphs kept) [auto: faster than on, " \
        "predicted" in text
    assert Plan.load(out).activation_checkpointing is False
    assert main(["plan", "--profile", str(prof), "-B", "16", "--out", str(out)]) == 0
    assert "activation checkpointing: on (recompute in backward)\n" in capsys.readouterr().out
    assert Plan.load(out).activation_checkpointing is True
    spec = ["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "llama-3b",
            "-B", "64", "--activation-checkpointing"]
    assert main(spec + ["false"]) == 2
    assert "kept_graph_bytes" in capsys.readouterr().err
    assert main(spec + ["auto"]) == 0
    assert "only on was planned" in capsys.readouterr().out
    # HF style "True" / "AUTO" parse as the env and Python do; a bad word says the choices
    assert main(["plan", "--profile", str(prof), "-B", "16", "--activation-checkpointing",
                 "False", "--out", str(out)]) == 0
    assert Plan.load(out).activation_checkpointing is False
    assert main(["plan", "--profile", str(prof), "-B", "16", "--activation-checkpointing",
                 "True", "--out", str(out)]) == 0
    assert Plan.load(out).activation_checkpointing is True
    assert "[auto: " not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(prof), "-B", "16", "--activation-checkpointing", "maybe"])
    assert "give true, false or auto (any case)" in capsys.readouterr().err
    # kept graphs that grow past the caps with b (m = 1 fits: 2 units x 0.5 GiB per sample,
    # cap 12.8 GiB: at most 12 samples per rank): false says why, with numbers, and suggests
    # true / auto; auto falls back to on and says that off did not fit
    big = dataclasses.replace(cluster, devices=[
        dataclasses.replace(d, kept_graph_bytes=[0.5 * GIB * m for m in ms])
        for d in cluster.devices])
    big.save(prof)
    plan64 = ["plan", "--profile", str(prof), "-B", "64", "--activation-checkpointing"]
    assert main(plan64 + ["false"]) == 2
    err = capsys.readouterr().err
    assert ": ;" not in err and "no rank can take a microbatch" not in err, err
    assert "kept forward graphs of all microbatches, L·b_i·K(m_i)" in err, err
    assert "b_i <= 12" in err and "together at most 24 samples" in err, err
    assert "to fit: --activation-checkpointing true or auto, a smaller -B" in err, err
    assert main(plan64 + ["AUTO"]) == 0
    text = capsys.readouterr().out
    assert "activation checkpointing: on (recompute in backward) [auto: off does not fit: " \
        "without activation checkpointing the kept forward graphs" in text, text


def test_scoring_passes_move_the_plan_and_are_printed(tmp_path, capsys):
    """``--scoring-passes K``: the plan minimizes the training step plus K forward-only passes
    (the pair of tests/planner_fixtures.py whose rank 0 has a slow forward: b = 5 / 7 for
    training alone, 4 / 8 with one pass), and the output gives that sum; a negative K and
    K with --precision auto are refused before anything is solved."""
    from tests.planner_fixtures import forward_heavy_pair

    profile = tmp_path / "pair.json"
    forward_heavy_pair().save(str(profile))
    plans = {}
    for k in ("0", "1"):
        out = tmp_path / f"plan{k}.json"
        assert main(["plan", "--profile", str(profile), "-B", "12", "--scoring-passes", k,
                     "--out", str(out)]) == 0
        plans[k] = Plan.load(out).batch_sizes
        text = capsys.readouterr().out
        assert ("scoring pass" in text) == (k != "0"), text
    assert plans == {"0": [5, 7], "1": [4, 8]}
    assert ("with 1 forward-only scoring pass(es) per step (0.480 s each): 1.824 s predicted "
            "per step") in text, text
    assert main(["plan", "--profile", str(profile), "-B", "12", "--scoring-passes", "-1"]) == 2
    assert "--scoring-passes -1.0: must be a finite number >= 0" in capsys.readouterr().err
    assert main(["plan", "--cluster", "examples/clusters/cluster_a.yaml", "--model", "llama-3b",
                 "-B", "8", "--precision", "auto", "--scoring-passes", "1"]) == 2
    assert "--scoring-passes with --precision auto" in capsys.readouterr().err
