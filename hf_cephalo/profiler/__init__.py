"""Torch measurement of profiles: one unit's time and memory on this device, the collectives,
and per-rank emulation of a heterogeneous cluster (``measure``, ``emulate``, ``live_memory``).
It uses the engine; the profile data it produces lives in ``hf_cephalo.profiles``."""
