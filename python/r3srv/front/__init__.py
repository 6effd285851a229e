"""The fleet's front: one URL for `r3srv serve --data-parallel-size N` (app.py), its replicas'
supervision (replicas.py), the prefix-aware choice of a replica (policy.py), forwarding
(proxy.py) and the answers about the fleet as a whole (discovery.py)."""
