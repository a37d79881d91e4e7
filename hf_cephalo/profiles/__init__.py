"""Profiles as pure data (no torch): the JSON types of docs/profiles.md, GPU spec sheets, the
on-disk profile cache and the precision tables. The bottom layer of the package
(docs/design.md "Layering"): the planner, the engine and the profiler's torch measurement
(``hf_cephalo.profiler``) import it; it imports none of them."""
