"""fp4forge.model: running a causal LM one decoder layer at a time from a checkpoint, and the text
it runs on; shared by calibration and fidelity measurement.

:mod:`.streaming`: the layer-streamed model (materialise a layer, run every batch through it,
spill activations past a RAM budget). :mod:`.samples`: the built-in corpus, the user's files and
the token samples packed from them.
"""
