"""Write (or check) the tensor names bitsandbytes checkpoints store per quantized Linear, from
transformers' own bitsandbytes quantizers: src/fp4forge/checkpoint/layouts/_bnb_serialized.json.

    python scripts/bnb_serialized_names.py            # print the table the installed transformers gives
    python scripts/bnb_serialized_names.py --write    # and write it to the data file

Run it with the project's interpreter. transformers' `Bnb4BitHfQuantizer` / `Bnb8BitHfQuantizer`
list, under `serialized_names`, the names `save_pretrained` writes for a quantized parameter (the
4-bit QuantState's `absmax`, `quant_map`, `nested_*`, `quant_state.bitsandbytes__<type>`; 8-bit's
`SCB` and `weight_format`): the suffixes fp4forge's layouts read (`checkpoint/layout.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "src/fp4forge/checkpoint/layouts/_bnb_serialized.json"


def table() -> dict:
    import transformers
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
    from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer

    return {"transformers": transformers.__version__,
            "serialized_names": {"4bit": Bnb4BitHfQuantizer.serialized_names, "8bit": Bnb8BitHfQuantizer.serialized_names}}


def main(argv: list[str]) -> int:
    from vllm_packed_modules import emit  # the sibling script (its directory is on sys.path)

    return emit(table(), DATA, argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
