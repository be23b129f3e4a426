"""fp4forge: make, prove and measure NVFP4 / FP8 checkpoints of MoE LLMs."""

__version__ = "0.1.0"
