"""fp4forge.lab.trained: the tiny Laguna trained from scratch (docs/trained-testbed.md).

:mod:`.training_corpus`: the agentic transcripts and plain text fp4forge generates to train on.
:mod:`.training`: deterministic training and what it measures (perplexity, heavy tails).
:mod:`.build`: corpus + training in one call, cached by content.
:mod:`.tables`: the training report's tables; :mod:`.cli`: ``fp4forge testbed trained-laguna``.
"""
