"""fp4forge.fidelity: how close a quantized checkpoint computes to what it should.

:mod:`.evaluate`: KL, top-1 agreement, perplexity and per-layer error of a quantized student
against its BF16 teacher, layer-streamed, with the numerics a W4A4 deployment runs.
:mod:`.reference`: fp4forge's own forward pass of a quantized checkpoint, the oracle a served
continuation is held against.
"""
