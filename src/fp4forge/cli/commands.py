"""The command table of ``fp4forge``: command name -> the module whose ``register(app)`` adds it,
in the order --help lists them. (Its own module so that both the typer application and the fast
paths read it without importing each other.)

The lab's commands (``fp4forge.lab``, the top rank: docs/architecture.md) are named here as data,
module paths the CLI imports by name when such a command is typed; nothing in the product imports
the lab (``tests/test_architecture.py``). This table is the one place outside the lab that names it.
"""

COMMAND_MODULES = {
    "testbed": "fp4forge.cli.testbed",
    "bytes": "fp4forge.cli.bytes",
    "quantize": "fp4forge.cli.quantize",
    "audit": "fp4forge.cli.audit",
    "diff": "fp4forge.cli.audit",
    "calibrate": "fp4forge.cli.calibrate",
    "kv": "fp4forge.cli.calibrate",
    "fidelity": "fp4forge.cli.calibrate",
    "pipeline": "fp4forge.cli.pipeline",
    "card": "fp4forge.cli.pipeline",
    "serve": "fp4forge.cli.serve",
    "bench": "fp4forge.cli.bench",
    "quality": "fp4forge.cli.quality",
    "frontier": "fp4forge.lab.study.cli",
    "study": "fp4forge.lab.study.cli",
}

# Commands a group's module does not define itself: group name -> the modules whose
# ``register(group_app)`` add theirs (``fp4forge testbed trained-laguna`` is the lab's).
GROUP_EXTENSIONS = {
    "testbed": ("fp4forge.lab.trained.cli",),
}
