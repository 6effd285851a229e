"""GraniteMoeShared: Granite 3.x MoE beside an always-on shared MLP (shared_intermediate_size)."""

from __future__ import annotations

from r3srv.models.families import Family, granitemoe

FAMILY = Family("granitemoeshared", ("GraniteMoeSharedForCausalLM",), granitemoe.configure, granitemoe.weight_targets)
