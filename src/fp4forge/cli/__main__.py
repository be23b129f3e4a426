"""``python -m fp4forge.cli``: the same entry point as the ``fp4forge`` script."""

from fp4forge.cli import main

main()
