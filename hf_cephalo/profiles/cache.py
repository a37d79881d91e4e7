"""On-disk cache of measured profiles, so a second start skips profiling.

A device profile is keyed by (measurement version, model fingerprint, device name, dtype,
sequence length, profiled microbatch sizes); the collective profile by (measurement version,
model fingerprint, dtype, world size, backend, every rank's device name). The measurement
version (``MEASUREMENT_VERSION``) changes whenever the profiler (``hf_cephalo.profiler``) measures differently, so
entries written by older code are measured anew instead of being reused. The model fingerprint (``model_fingerprint``) hashes the model class
and its config (or, without a config, every parameter's name and shape), so another model never
hits. Emulated devices have their own names (``emulate.emulated_device_name``), so they never
share entries with the real device.

Location: ``$HF_CEPHALO_PROFILE_CACHE`` if set, else ``~/.cache/hf_cephalo/profiles``. One JSON
file per entry, written atomically (temp file + rename) so ranks writing the same key at once
cannot leave a torn file. Delete the directory to re-profile.

A training run writes what it measured back over the device entries at its end
(``write_back_measured``), unless it ran markedly slower than the fastest run recorded for
that device ([Note: the cache does not learn load]).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from hf_cephalo.file_modes import apply_default_mode
from hf_cephalo.profiles.types import CommProfile, DeviceProfile

__all__ = ["ProfileCache", "default_cache_dir", "model_description", "model_fingerprint",
           "device_key", "comm_key", "write_back_devices", "EntryRecord", "WriteBackVerdict",
           "judge_write_back", "WriteBack", "write_back_measured", "LOAD_TOLERANCE",
           "MIN_CREDIBLE_STEPS"]

# 2: non-decreasing fit of the per-m medians, parameters as views of one flat buffer (frozen ones
# included), bf16-autocast profiles keyed by their dtype tag. 3: compute memory is the activation
# memory alone (the planner prices the engine's buffers), measured on CPU as the peak of live
# tensors; comm entries carry the measured uneven factor u. 4: the step terms outside the units
# (embedding / head per microbatch, bookkeeping, optimizer step, the root's collectives and the
# small all-reduce: planner/cost.py [Note: step terms]). 5: the kept forward graph of one
# microbatch (``kept_graph_bytes``), so plans without activation checkpointing can be made.
MEASUREMENT_VERSION = 5

LOAD_TOLERANCE = 0.25  # a run this much slower than the device's fastest recorded run: load
MIN_CREDIBLE_STEPS = 10  # timed steps a run needs before its speed can be the device's fastest
RECORD_KEY = "measured_in_training"  # the entry's EntryRecord, beside the DeviceProfile fields

_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "use_cache",
                         "return_dict", "output_hidden_states", "output_attentions")


def default_cache_dir() -> Path:
    """``$HF_CEPHALO_PROFILE_CACHE`` or ``~/.cache/hf_cephalo/profiles``."""
    from hf_cephalo.environment import env_text

    env = env_text("HF_CEPHALO_PROFILE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hf_cephalo" / "profiles"


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def model_description(model: Any) -> dict[str, Any]:
    """What ``model_fingerprint`` hashes, JSON-ready: ``{"class": ..., "desc": {...}}``.

    ``desc`` is ``model.config.to_dict()`` without volatile keys (checkpoint path, library
    version, output switches) when the model has a config; else the parameter names and shapes.
    Profiles record it so a mismatch can name the differing fields.
    """
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        desc = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    else:
        desc = {name: list(p.shape) for name, p in model.named_parameters()}
    # Through JSON and back, so a description read from a profile compares equal.
    return json.loads(json.dumps({"class": type(model).__name__, "desc": desc}, sort_keys=True,
                                 default=str))


def model_fingerprint(model: Any) -> str:
    """A short hash (hex string) of ``model_description``: the model class and its
    shape-defining config."""
    return _digest(model_description(model))


def device_key(fingerprint: str, device_name: str, dtype: str, sequence_length: int,
               microbatch_sizes: list[int]) -> str:
    return "device-" + _digest([MEASUREMENT_VERSION, fingerprint, device_name, dtype,
                                sequence_length, microbatch_sizes])


def comm_key(fingerprint: str, dtype: str, device_names: list[str], backend: str) -> str:
    return "comm-" + _digest([MEASUREMENT_VERSION, fingerprint, dtype, device_names, backend])


class ProfileCache:
    """Reads and writes cached ``DeviceProfile`` / ``CommProfile`` entries under ``root``.

    Args:
        root: cache directory (created on first write); default ``default_cache_dir()``.
    """

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def _read(self, key: str) -> Mapping[str, Any] | None:
        path = self._path(key)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):
            return None  # a damaged entry is re-measured and overwritten

    def _write(self, key: str, data: Mapping[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        apply_default_mode(tmp)  # mkstemp creates 0o600: [Note: file modes]
        os.replace(tmp, self._path(key))

    def _get(self, key: str, cls):
        """The entry parsed as ``cls`` (None if missing or invalid: it is measured anew)."""
        data = self._read(key)
        try:
            return None if data is None else cls.from_json(data)
        except ValueError:
            return None

    def get_device(self, key: str) -> DeviceProfile | None:
        return self._get(key, DeviceProfile)

    def put_device(self, key: str, profile: DeviceProfile,
                   record: "EntryRecord | None" = None) -> None:
        """Write ``profile`` (with the training-run ``record`` beside it, if given: a profile
        measured anew is written without one, so its record starts afresh)."""
        data = profile.to_json()
        if record is not None:
            data[RECORD_KEY] = record._asdict()
        self._write(key, data)

    def get_record(self, key: str) -> "EntryRecord | None":
        """The entry's ``EntryRecord`` (None: none, or unreadable)."""
        data = self._read(key)
        try:
            return None if data is None or RECORD_KEY not in data else \
                EntryRecord(**data[RECORD_KEY])
        except TypeError:
            return None

    def get_comm(self, key: str) -> CommProfile | None:
        return self._get(key, CommProfile)

    def put_comm(self, key: str, profile: CommProfile) -> None:
        self._write(key, profile.to_json())


def write_back_devices(cluster_extra: Mapping[str, Any],
                       devices: list[DeviceProfile]) -> list[Path]:
    """Write ``devices`` (rank order, e.g. refit to what a training run measured:
    ``planner.predict.refit_to_measured``) over the cache entries their profile was read from
    or measured into, so the next run of the same job starts from the measured numbers.

    ``cluster_extra``: ``ClusterProfile.extra`` of a profile made by ``profile_cluster`` with a
    cache (its ``"profile_cache"`` record: the cache directory and each rank's device key);
    nothing is written without it (a profile file, a profile measured without a cache). Each
    entry is written atomically (temp file + rename), once: ranks that share an entry (the same
    device kind) write the lowest rank's refit. Returns the paths written. Call it on one rank
    (rank 0): it holds every rank's entry.
    """
    record = cluster_extra.get("profile_cache")
    if not record or len(record.get("device_keys", [])) != len(devices):
        return []
    store = ProfileCache(record["root"])
    written = {}
    for key, device in zip(record["device_keys"], devices):
        if key not in written:  # ranks of one device kind share an entry: the lowest rank's
            store.put_device(key, device)
            written[key] = store._path(key)
    return list(written.values())


# [Note: the cache does not learn load]
# A run's measurements go back into the cache so the next run predicts from them; a run on a
# busy machine (co-tenants, a noisy neighbour) measures the load, and the quiet run after it
# predicted 0.453 s against 0.196 s measured. So each device entry records the speed of the
# runs written over it (``EntryRecord``: measured / the profiler's figures, chained run to
# run, by its unit compute and by its step), and a run that ran more than ``LOAD_TOLERANCE``
# slower on either than the fastest credible run recorded (at least ``MIN_CREDIBLE_STEPS``
# timed steps: a short run's median is one step) is not written: load comes and goes, the
# fastest credible figure is the device's own. The first
# run over a fresh profile is written (nothing to compare with: training and the profiler's
# lockstep rounds differ by tens of percent on one idle machine). A device that really got
# slower is re-learned by deleting its entry (or running live re-balancing: docs/adaptive.md).


class EntryRecord(NamedTuple):
    """What a device entry remembers of the training runs written over it, per load meter
    ("unit compute", "step": ``planner.predict.measured_speeds``).

    Attributes:
        scales: meter -> the entry's figures / the profiler's (1.0: as profiled), i.e. the
            speed of the run written last, dimensionless.
        fastest: meter -> the lowest scale of a credible run written.
        runs: training runs written over the entry.
    """

    scales: dict[str, float]
    fastest: dict[str, float]
    runs: int


class WriteBackVerdict(NamedTuple):
    """``judge_write_back``'s answer: write the run over the entry (with ``record``), or keep
    the entry (``reason``: why)."""

    write: bool
    record: EntryRecord | None
    reason: str | None


def judge_write_back(record: EntryRecord | None, speeds: Mapping[str, float], steps: int, *,
                     tolerance: float = LOAD_TOLERANCE,
                     min_steps: int = MIN_CREDIBLE_STEPS) -> WriteBackVerdict:
    """Whether a run's refit goes over a device entry ([Note: the cache does not learn load]).

    Args:
        record: the entry's record (None: a profile no run was written over).
        speeds: the run's meter -> measured / the entry's prediction on this device
            (``planner.predict.measured_speeds``; none: written, the record unchanged).
        steps: steps the run timed (after the first).
        tolerance: how much slower than the fastest credible run a run may be, relative, on
            any meter.
        min_steps: timed steps a run needs to set a fastest figure.
    """
    speeds = {k: v for k, v in speeds.items() if math.isfinite(v) and v > 0}
    if not speeds:
        return WriteBackVerdict(True, record, None)
    record = record or EntryRecord({}, {}, 0)
    scales = {k: record.scales.get(k, 1.0) * v for k, v in speeds.items()}
    slow = [(k, scales[k] / record.fastest[k]) for k in scales if k in record.fastest
            and scales[k] > (1.0 + tolerance) * record.fastest[k]]
    if slow:
        return WriteBackVerdict(False, record, " and ".join(
            f"{k} ran {x:.2f}x slower" for k, x in slow) + " than the fastest run recorded "
            f"for this device (more than {1 + tolerance:.2f}x)")
    fastest = dict(record.fastest)
    if steps >= min_steps:
        fastest.update({k: min(fastest.get(k, math.inf), v) for k, v in scales.items()})
    return WriteBackVerdict(True, EntryRecord({**record.scales, **scales}, fastest,
                                              record.runs + 1), None)


class WriteBack(NamedTuple):
    """``write_back_measured``'s result: the entries written, those kept (rank, path, why) and
    the one line that says so."""

    written: list[Path]
    kept: list[tuple[int, Path, str]]
    line: str


def write_back_measured(cluster_extra: Mapping[str, Any], devices: list[DeviceProfile],
                        speeds: Sequence[Mapping[str, float]], steps: int) -> WriteBack:
    """``write_back_devices`` with [Note: the cache does not learn load]: each entry (once, the
    lowest rank that uses it) gets ``devices[rank]`` and the updated ``EntryRecord`` if
    ``judge_write_back`` lets the run's ``speeds[rank]`` through, else stays as it is. Call
    it on one rank (rank 0). Nothing is written without a cache record (a profile file)."""
    record = cluster_extra.get("profile_cache")
    if not record or len(record.get("device_keys", [])) != len(devices) or \
            len(speeds) != len(devices):
        return WriteBack([], [], "")
    store = ProfileCache(record["root"])
    written, kept, seen = [], [], set()
    for rank, (key, device, speed) in enumerate(zip(record["device_keys"], devices, speeds)):
        if key in seen:  # ranks of one device kind share an entry: the lowest rank's
            continue
        seen.add(key)
        verdict = judge_write_back(store.get_record(key), speed, steps)
        if verdict.write:
            store.put_device(key, device, verdict.record)
            written.append(store._path(key))
        else:
            kept.append((rank, store._path(key), verdict.reason))
    return WriteBack(written, kept, _write_back_line(written, kept))


def _write_back_line(written: list[Path], kept: list[tuple[int, Path, str]]) -> str:
    head = ("measured step terms written back to the profile cache (" +
            ", ".join(str(p) for p in written) + ")") if written else \
        "the profile cache was not updated"
    if not kept:
        return head + ": the next run plans from them"
    why = "; ".join(f"{p} kept: rank {rank}'s {reason}" for rank, p, reason in kept)
    return (f"{head}; {why}: taken as transient load, not learned (delete the entry if the "
            "device really got slower)")
