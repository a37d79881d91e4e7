"""On-disk cache of measured profiles, so a second start skips profiling.

A device profile is keyed by (measurement version, model fingerprint, device name, dtype,
sequence length, profiled microbatch sizes); the collective profile by (measurement version,
model fingerprint, dtype, world size, backend, every rank's device name). The measurement
version (``MEASUREMENT_VERSION``) changes whenever ``measure.py`` measures differently, so
entries written by older code are measured anew instead of being reused. The model fingerprint (``model_fingerprint``) hashes the model class
and its config (or, without a config, every parameter's name and shape), so another model never
hits. Emulated devices have their own names (``emulate.emulated_device_name``), so they never
share entries with the real device.

Location: ``$HF_CEPHALO_PROFILE_CACHE`` if set, else ``~/.cache/hf_cephalo/profiles``. One JSON
file per entry, written atomically (temp file + rename) so ranks writing the same key at once
cannot leave a torn file. Delete the directory to re-profile.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from hf_cephalo.file_modes import apply_default_mode
from hf_cephalo.profiles.types import CommProfile, DeviceProfile

__all__ = ["ProfileCache", "default_cache_dir", "model_description", "model_fingerprint",
           "device_key", "comm_key", "write_back_devices"]

# 2: non-decreasing fit of the per-m medians, parameters as views of one flat buffer (frozen ones
# included), bf16-autocast profiles keyed by their dtype tag. 3: compute memory is the activation
# memory alone (the planner prices the engine's buffers), measured on CPU as the peak of live
# tensors; comm entries carry the measured uneven factor u. 4: the step terms outside the units
# (embedding / head per microbatch, bookkeeping, optimizer step, the root's collectives and the
# small all-reduce: planner/cost.py [Note: step terms]). 5: the kept forward graph of one
# microbatch (``kept_graph_bytes``), so plans without activation checkpointing can be made.
MEASUREMENT_VERSION = 5

_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "use_cache",
                         "return_dict", "output_hidden_states", "output_attentions")


def default_cache_dir() -> Path:
    """``$HF_CEPHALO_PROFILE_CACHE`` or ``~/.cache/hf_cephalo/profiles``."""
    env = os.environ.get("HF_CEPHALO_PROFILE_CACHE")
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

    def put_device(self, key: str, profile: DeviceProfile) -> None:
        self._write(key, profile.to_json())

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
