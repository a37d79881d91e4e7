"""The profile cache does not learn load ([Note: the cache does not learn load] in
profiles/cache.py): a run's measurements go back over its device entries unless it ran markedly
slower than the fastest credible run recorded for that device. Pure: a cache in tmp_path, runs
given as numbers, no process group."""

from __future__ import annotations

import dataclasses

import pytest

from hf_cephalo.planner import cost
from hf_cephalo.planner.predict import (MeasuredStep, measured_speeds, predict,
                                        predicted_unit_compute_s, refit_to_measured)
from hf_cephalo.profiles.cache import (LOAD_TOLERANCE, MIN_CREDIBLE_STEPS, EntryRecord,
                                       ProfileCache, judge_write_back, write_back_devices,
                                       write_back_measured)
from hf_cephalo.profiles.types import ClusterProfile
from tests.test_step_terms import _cluster, _plan


class _Machine:
    """A 2-rank job whose device entries live in ``root``: each run starts from the cache and
    writes back at its end, as ``runtime.report.AccuracyReport._write_back`` does."""

    def __init__(self, root):
        self.store = ProfileCache(root)
        profile = _cluster()
        self.keys = [f"device-{d.name}" for d in profile.devices]
        for key, d in zip(self.keys, profile.devices):
            self.store.put_device(key, d)  # a fresh profile, no run written over it yet
        self.extra = {"profile_cache": {"root": str(root), "device_keys": self.keys}}
        self.profile = profile
        self.plan = _plan([3, 6], [2, 4], [0.25, 0.75])
        # the truth: the profile's compute, plus as much host time per step (the training
        # loop, data) that the profiler does not measure
        host_s = predict(self.plan, profile).iteration_s
        self.quiet = dataclasses.replace(profile, devices=[
            dataclasses.replace(d, step_overhead_s=d.step_overhead_s + host_s)
            for d in profile.devices])

    def start(self) -> ClusterProfile:
        return dataclasses.replace(self.profile, extra=self.extra, devices=[
            self.store.get_device(k) for k in self.keys])

    def measure(self, load: float) -> list[MeasuredStep]:
        """What a run measures with every time ``load`` x the quiet machine's (a co-tenant
        slows compute and host alike)."""
        step = predict(self.plan, self.quiet).iteration_s
        return [MeasuredStep(load * step,
                             load * predicted_unit_compute_s(self.plan, self.quiet, i),
                             load * float(cost.root_compute_s(d, r.batch_size,
                                                              r.microbatch_size)))
                for i, (d, r) in enumerate(zip(self.quiet.devices, self.plan.ranks))]

    def run(self, load: float, steps: int = 100, *, unconditional: bool = False):
        """One run: start, measure, write back (``unconditional``: as before the note)."""
        cluster = self.start()
        predicted = predict(self.plan, cluster).iteration_s
        measured = self.measure(load)
        refit = refit_to_measured(self.plan, cluster, measured)
        if unconditional:
            write_back_devices(cluster.extra, refit.devices)
            done = None
        else:
            done = write_back_measured(cluster.extra, refit.devices,
                                       measured_speeds(self.plan, cluster, measured), steps)
        return predicted / measured[0].step_s, done


def test_a_loaded_run_does_not_teach_the_quiet_run_after_it(tmp_path):
    """quiet run (the first over the fresh profile: learns the host time) -> a run 2.2x slower
    (a busy machine) -> a quiet run: its prediction is the measured step (within 15%; it was
    0.43x when the loaded run's figures were written back: the contrast below)."""
    machine = _Machine(tmp_path / "cache")
    first, done = machine.run(1.0)
    assert len(done.written) == 2 and not done.kept
    assert first < 0.6  # the fresh profile knows no host time: predicted too fast
    loaded, done = machine.run(2.2)
    assert done.written == [] and [rank for rank, _, _ in done.kept] == [0, 1]
    assert "unit compute ran 2.20x slower and step ran 2.20x slower than the fastest run " \
        "recorded" in done.line, done.line
    assert "transient load" in done.line and done.line.count("\n") == 0
    quiet, done = machine.run(1.0)
    assert quiet == pytest.approx(1.0, abs=0.15) and len(done.written) == 2, quiet
    # the contrast: the loaded run written back as it was, the quiet run after it is far off
    before = _Machine(tmp_path / "before")
    before.run(1.0, unconditional=True)
    before.run(2.2, unconditional=True)
    off, _ = before.run(1.0, unconditional=True)
    assert off > 1.15 and off == pytest.approx(2.2, rel=0.05), off


def test_faster_runs_are_learned_and_a_slow_device_is_relearned_from_a_fresh_entry(tmp_path):
    """A run faster than the recorded ones is written (a profile taken under load gets
    corrected); a run within the tolerance too; a profile measured anew (another run
    profiling: ``put_device`` without a record) starts the record afresh."""
    machine = _Machine(tmp_path)
    machine.run(1.5)  # the first run: written, whatever its speed
    fast, done = machine.run(1.0)
    assert len(done.written) == 2
    record = machine.store.get_record(machine.keys[0])
    assert record.runs == 2 and record.fastest["unit compute"] == pytest.approx(1.0)
    assert record.scales["unit compute"] == pytest.approx(1.0)
    _, done = machine.run(1.0 + LOAD_TOLERANCE - 0.01)
    assert len(done.written) == 2  # within the tolerance: an ordinary run
    _, done = machine.run(1.6)
    assert done.written == []
    machine.store.put_device(machine.keys[0], machine.profile.devices[0])  # measured anew
    assert machine.store.get_record(machine.keys[0]) is None
    _, done = machine.run(1.6)
    assert done.written == [tmp_path / f"{machine.keys[0]}.json"]  # rank 0's: fresh


def test_judge_write_back():
    unit = "unit compute"
    # the first run over a profile is written; it sets the fastest figures if long enough
    first = judge_write_back(None, {unit: 1.3, "step": 2.0}, MIN_CREDIBLE_STEPS)
    assert first.write and first.record == EntryRecord({unit: 1.3, "step": 2.0},
                                                       {unit: 1.3, "step": 2.0}, 1)
    short = judge_write_back(None, {unit: 0.2}, MIN_CREDIBLE_STEPS - 1)
    assert short.write and short.record.fastest == {}  # one step's median: no figure
    # chained: the entry holds the last run's figures; the next run is measured against them
    slow = judge_write_back(first.record, {unit: 1.3, "step": 1.0}, 50)
    assert not slow.write and slow.reason.startswith("unit compute ran 1.30x slower")
    assert slow.record == first.record
    # a co-tenant that slows the collectives and the host more than the compute: the step
    host = judge_write_back(first.record, {unit: 1.0, "step": 1.4}, 50)
    assert not host.write and host.reason.startswith("step ran 1.40x slower"), host.reason
    ok = judge_write_back(first.record, {unit: 0.9, "step": 1.1}, 50)
    assert ok.write and ok.record.scales == pytest.approx({unit: 1.17, "step": 2.2})
    assert ok.record.fastest == pytest.approx({unit: 1.17, "step": 2.0})
    faster = judge_write_back(ok.record, {unit: 0.5}, 50)
    assert faster.record.fastest[unit] == pytest.approx(0.585) and faster.record.runs == 3
    # a meter the record has no figure for starts its chain; no meter at all: written as is
    other = judge_write_back(short.record, {"step": 3.0}, 50)
    assert other.write and other.record.fastest == {"step": 3.0}
    assert judge_write_back(first.record, {}, 50) == (True, first.record, None)
    assert judge_write_back(first.record, {unit: float("nan")}, 50).write


def test_measured_speeds_pick_the_meters():
    cluster = _cluster()
    plan = _plan([3, 6], [2, 4], [0.25, 0.75])
    unit = predicted_unit_compute_s(plan, cluster, 0)
    step = predict(plan, cluster).iteration_s
    speeds = measured_speeds(plan, cluster, [MeasuredStep(3 * step, 2 * unit, None),
                                             MeasuredStep(3 * step, None, None)])
    assert speeds[0] == pytest.approx({"unit compute": 2.0, "step": 3.0})
    assert speeds[1] == pytest.approx({"step": 3.0})
    assert measured_speeds(plan, cluster, [MeasuredStep(None, None, None)] * 2) == [{}, {}]
    with pytest.raises(ValueError, match="1 measurements for world size 2"):
        measured_speeds(plan, cluster, [MeasuredStep(None, None, None)])
