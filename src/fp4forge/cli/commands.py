"""The command table of ``fp4forge``: command name -> the module whose ``register(app)`` adds it,
in the order --help lists them. (Its own module so that both the typer application and the fast
paths read it without importing each other.)"""

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
    "frontier": "fp4forge.cli.study",
    "study": "fp4forge.cli.study",
}
