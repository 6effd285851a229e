"""r3srv: an OpenAI-compatible MoE server that returns the routed experts of every token."""

__version__ = "0.1.0"
