"""fp4forge.lab.study: the quantization study (docs/study.md).

:mod:`.frontier`: bits per parameter against relative weight error, per component and arm.
:mod:`.arms`: whole-model arms (fake-quantized or exported checkpoints) measured by fidelity.
:mod:`.run`: ``fp4forge study``, the resumable run of both with its arm tables and verdicts.
:mod:`.tables`: its tables, Markdown and plots; :mod:`.cli`: ``fp4forge frontier`` and ``fp4forge study``.
"""
