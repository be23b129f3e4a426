"""fp4forge.study: the quantization study's measurements (docs/study.md).

:mod:`.frontier`: bits per parameter against relative weight error, per component and arm.
:mod:`.arms`: whole-model arms (fake-quantized or exported checkpoints) measured by fidelity.
"""
