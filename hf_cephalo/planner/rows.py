"""Samples of several sequence rows (docs/planner.md, "Samples of several rows").

A profile is measured per sequence ROW: ``fwd_s[m]``, ``compute_memory_bytes[m]`` ... are one
unit's time and memory for a microbatch of m rows, and ``boundary_bytes_per_sample`` is one row's
hidden state. Some doors train samples of k rows that always share a microbatch: a preference
pair of DPO or the reward trainer is its chosen and its rejected row (k = 2), so a microbatch of
m samples runs k·m rows. ``per_sample_cluster`` marks a per-row profile with k
(``DeviceProfile.rows_per_sample``) and scales the boundary bytes, so that the whole planner
(optimizer, memory model, predictions, brute force, refits) prices a microbatch of m samples as
k·m rows:

    F'(m) = F(k·m), B'(m) = B(k·m), E'(m) = E(k·m), H'(m) = H(k·m)   (cost.py, the curves)
    A'(m) = α·k·m + β  for each least-squares line A(r) = α·r + β     (memory.memory_line:
                                                   compute, head and kept-graph memory)
    a' = k·a, s' = k·s                    (boundary and side-input bytes per sample)

Every other term of the model is per rank, per microbatch or per unit, not per row, and stays.
So for any (b, m) the per-sample cluster's M_i(m, b), F_i, B_i and root compute equal the
per-row cluster's at (k·m, k·b) (tests/test_planner_rows.py, which also proves the optimizer's
plan against a brute force over samples priced with the per-row functions at k rows).
"""

from __future__ import annotations

import dataclasses

from hf_cephalo.profiles.types import ClusterProfile, DeviceProfile

__all__ = ["ROWS_PER_SAMPLE_KEY", "per_sample_cluster", "rows_per_sample_of", "sample_words"]

ROWS_PER_SAMPLE_KEY = "rows_per_sample"
"""``ClusterProfile.extra`` key of a per-sample cluster: k, the rows of one sample."""


def rows_per_sample_of(cluster: ClusterProfile) -> int:
    """k of a cluster made by ``per_sample_cluster`` (1 for a per-row profile)."""
    return int(cluster.extra.get(ROWS_PER_SAMPLE_KEY, 1))


def sample_words(cluster: ClusterProfile) -> str:
    """How error messages name one sample of ``cluster``: "" for a per-row profile, else e.g.
    " (one sample = 2 sequence rows of 64 tokens that share a microbatch)"."""
    k = rows_per_sample_of(cluster)
    if k == 1:
        return ""
    width = cluster.extra.get("sequence_length")
    of = f" of {width} tokens" if width else ""
    return f" (one sample = {k} sequence rows{of} that share a microbatch)"


def per_sample_cluster(cluster: ClusterProfile, rows_per_sample: int) -> ClusterProfile:
    """``cluster`` (measured per sequence row) priced per sample of ``rows_per_sample`` rows
    that share a microbatch (module docstring: the formulas).

    Args:
        cluster: a per-row profile (as measured, cached or estimated).
        rows_per_sample: k >= 1; 1 returns ``cluster`` itself.

    Returns a new ClusterProfile (the input is not changed): every device with
    ``rows_per_sample = k``, the model's ``boundary_bytes_per_sample`` and
    ``side_bytes_per_sample`` times k, ``extra`` recording k (``ROWS_PER_SAMPLE_KEY``) and
    without ``profile_cache``: a refit of it is not a per-row measurement, so it is never
    written back over the per-row cache entries.

    Raises:
        ValueError: k not an int >= 1, or ``cluster`` already per sample (k applied twice).
    """
    k = rows_per_sample
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"per_sample_cluster: rows_per_sample must be an int >= 1 (the "
                         f"sequence rows of one sample), got {k!r}")
    if ROWS_PER_SAMPLE_KEY in cluster.extra or any(d.rows_per_sample != 1
                                                   for d in cluster.devices):
        raise ValueError(f"per_sample_cluster: the profile is already priced per sample of "
                         f"{rows_per_sample_of(cluster)} rows; pass the per-row profile")
    if k == 1:
        return cluster
    made: dict[int, DeviceProfile] = {}  # ranks that share a profile object keep sharing one
    for d in cluster.devices:
        made.setdefault(id(d), dataclasses.replace(d, rows_per_sample=k))
    model = dataclasses.replace(
        cluster.model, boundary_bytes_per_sample=k * cluster.model.boundary_bytes_per_sample,
        side_bytes_per_sample=k * cluster.model.side_bytes_per_sample)
    extra = {key: v for key, v in cluster.extra.items() if key != "profile_cache"}
    extra[ROWS_PER_SAMPLE_KEY] = k
    return dataclasses.replace(cluster, model=model, devices=[made[id(d)] for d in cluster.devices],
                               extra=extra)
