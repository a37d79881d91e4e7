"""Refusing a profile measured for another model, precision, sequence length or devices.

``check_profile_matches`` (world size, model shape and fingerprint, dtype, sequence length,
each rank's device name) and ``check_profile_precision`` (the job's precision tag); both raise
a ValueError saying what differs and how to re-profile. No collective, no measuring.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hf_cephalo.profiles.precision import Precision
from hf_cephalo.profiles.types import ClusterProfile, ModelProfile

__all__ = ["check_profile_matches", "check_profile_precision"]


def check_profile_precision(cluster: ClusterProfile, dtype: str | None,
                            source: str = "the profile") -> None:
    """Refuse a profile measured in another precision than the job's (no collective).

    ``dtype``: the job's [Note: precision tags] string (None: not checked); a profile that
    records none (spec-sheet estimates, old files) is not checked. Raises ValueError naming
    both tags and the ``hf-cephalo profile`` flags that measure the job's precision.
    """
    recorded = cluster.extra.get("dtype")
    if dtype is None or recorded in (None, dtype):
        return
    _, p = Precision.parse(dtype)
    raise ValueError(
        f"{source} was measured in {recorded} but this job computes in {dtype} (master dtype "
        "+ autocast under --bf16 / --fp16 + gathered-parameter / reduce-scatter dtypes, "
        "cephalo_param_dtype / cephalo_reduce_dtype); re-profile in this job's precision "
        f"(`hf-cephalo profile --precision {p.compute} --param-dtype {p.param} --reduce-dtype "
        f"{p.reduce}`, or leave cephalo_profile_file unset so the trainer profiles at start), "
        "train in the profile's precision, or give a plan file")


def _same_device(profiled: str, local: str) -> bool:
    """Same name (case-insensitive), or one contains the other ("A10G" vs "NVIDIA A10G") when
    neither is emulated (an emulated device never matches the real one)."""
    a, b = profiled.strip().lower(), local.strip().lower()
    if a == b:
        return True
    return "[emulated" not in a + b and (a in b or b in a)


def _description_diff(theirs: Any, mine: Mapping[str, Any] | None, limit: int = 12) -> list[str]:
    """``"field: profile X, this job Y"`` for each differing model class / config field."""
    if not isinstance(theirs, Mapping) or mine is None:
        return []
    out = []
    if theirs.get("class") != mine.get("class"):
        out.append(f"model class: profile {theirs.get('class')}, this job {mine.get('class')}")
    a, b = theirs.get("desc") or {}, mine.get("desc") or {}
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"{k}: profile {a.get(k, '(absent)')}, this job {b.get(k, '(absent)')}")
    if len(out) > limit:
        out = out[:limit] + [f"... {len(out) - limit} more fields"]
    return out


def check_profile_matches(cluster: ClusterProfile, model: ModelProfile, device_names: Sequence[str],
                          *, source: str = "the profile", dtype: str | None = None,
                          fingerprint: str | None = None,
                          description: Mapping[str, Any] | None = None,
                          sequence_length: int | None = None) -> None:
    """Refuse a profile measured for another model, dtype, sequence length or other devices.

    Args:
        cluster: the given or cached profile.
        model: this job's ``ModelProfile`` (``model_profile(staged)``).
        device_names: this job's device name per rank (rank order, emulation included).
        source: how to name the profile in messages (e.g. the file path).
        dtype / fingerprint: this job's parameter dtype and ``model_fingerprint``; checked
            when the profile records them (measured profiles do).
        description: this job's ``cache.model_description``; with it a fingerprint mismatch
            names the differing model class and config fields (profiles record theirs).
        sequence_length: tokens per sample this job trains with; refused when the profile
            recorded another one (compute times and activation memory scale with it).
    Raises:
        ValueError: world size, model shape, model fingerprint, dtype, sequence length or a
            rank's device name differ; the message says what differs and how to re-profile.
    """
    redo = ("re-profile this cluster (`hf-cephalo profile`, or leave cephalo_profile_file unset so "
            "the trainer profiles at start) or give a plan file")
    if cluster.world_size != len(device_names):
        raise ValueError(f"{source} describes {cluster.world_size} ranks but the job has world "
                         f"size {len(device_names)}; {redo}")
    mine = {k: getattr(cluster.model, k) for k in ("num_units", "params_per_unit", "params_other")}
    theirs = {k: getattr(model, k) for k in mine}
    if mine != theirs:
        raise ValueError(f"{source} was measured for model {cluster.model.name!r} {mine} but this "
                         f"job's model {model.name!r} has {theirs}; {redo}")
    recorded = cluster.extra.get("model_fingerprint")
    if fingerprint is not None and recorded not in (None, fingerprint):
        differs = _description_diff(cluster.extra.get("model_description"), description)
        if dtype is not None and cluster.extra.get("dtype") not in (None, dtype):
            differs.append(f"dtype: profile {cluster.extra['dtype']}, this job {dtype}")
        what = "; ".join(differs) if differs else (
            "the profile does not record its configuration fields (an older profile)")
        raise ValueError(f"{source} was measured for another model configuration ({what}; "
                         f"fingerprint {recorded} vs this model's {fingerprint}); {redo}")
    check_profile_precision(cluster, dtype, source)
    seq = cluster.extra.get("sequence_length")
    if sequence_length is not None and seq is not None and int(seq) != int(sequence_length):
        raise ValueError(
            f"{source} was measured at sequence length {seq} but this job trains at sequence "
            f"length {sequence_length} (compute time and activation memory scale with it); "
            f"re-profile at {sequence_length} (`hf-cephalo profile --sequence-length "
            f"{sequence_length}`, or leave cephalo_profile_file unset so the trainer profiles, "
            "measuring anew or reading the cache, whose entries are keyed by sequence length) "
            "or pass a profile measured at this sequence length")
    bad = [(i, d.name, local) for i, (d, local) in enumerate(zip(cluster.devices, device_names))
           if not _same_device(d.name, local)]
    if bad:
        detail = "; ".join(f"rank {i}: profiled {p!r}, this job {l!r}" for i, p, l in bad)
        raise ValueError(f"{source} was measured on other devices ({detail}); {redo}")
