"""fp4forge.lab: the research wing (docs/architecture.md).

The quantization study (:mod:`.study`), the trained testbed (:mod:`.trained`) and the research
diagnostics (:mod:`.diagnostics`), with their tables and commands. The lab may import any package
of fp4forge; nothing outside it imports the lab. Its commands reach the CLI only through the
command table (``fp4forge.cli.commands``), which names their modules as data and loads them when
such a command is typed.
"""
