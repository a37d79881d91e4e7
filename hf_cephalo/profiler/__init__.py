"""Torch measurement of profiles: one unit's time and memory on this device (``compute``), the
collectives (``comm``), what they measure with (``inputs``, ``hardware``, ``model_facts``), the
whole cluster and its cache (``measure``, the public front), refusing foreign profiles
(``profile_checks``), and per-rank emulation of a heterogeneous cluster (``emulate``,
``live_memory``). It uses the engine; the profile data it produces lives in
``hf_cephalo.profiles``."""
