"""Agentic tool-use quality (`fp4forge quality`).

Modules: ``suite`` (the scenario suite as data: loader and typed model), ``scorer`` (deterministic
scoring), ``simulated_tools`` (stateful tools for multi-step scenarios), ``runner`` (any
OpenAI-compatible endpoint, transcripts as JSONL), ``evaluate`` (run + score, the one function the
CLI and the pipeline call), ``stats`` (noise floor, paired tests, power), ``probes`` (KL over the
API, determinism), ``report`` (score and compare documents). Tables, Markdown and plots are in
``fp4forge.report``.
"""
