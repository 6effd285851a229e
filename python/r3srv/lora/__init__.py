"""LoRA adapters over the served MoE model (docs/lora.md).

- `adapter.py`: an adapter's tensors from a PEFT save (directory or in-memory tensors), in every
  layout trainers export (dense modules, per-expert modules, PEFT's 3-D parameter wrappers,
  SGLang's stacked and shared-outer expert tensors), normalized to one low-rank pair per base
  checkpoint tensor: delta W = B @ A, the scaling folded into B;
- `sites.py`: where each pair lands in the model (the loader's own checkpoint targets, so every
  family's names and every rank's slice come from one place), checked against it;
- `slots.py`: the layers' adapter slots and the grouped low-rank passes a step runs (linear
  layers and the expert pass), each token's slot given by the step's `LoraBatch`;
- `manager.py`: the registry (names, versions, sources), the host cache bounded by
  `max_cpu_loras`, the device slots bounded by `max_loras`, swapped in and out by use.
"""
