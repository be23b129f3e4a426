"""One exception hierarchy for everything fp4forge reports to a user.

Every error carries enough context (file, tensor) to act on; the CLI turns any
``Fp4forgeError`` into a one-line message and a non-zero exit code, never a traceback.
"""

from __future__ import annotations


class Fp4forgeError(Exception):
    """Base class: an error fp4forge understands and can explain."""

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.message = message
        self.file = file
        self.tensor = tensor
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = []
        if self.file:
            where.append(f"file {self.file}")
        if self.tensor:
            where.append(f"tensor {self.tensor!r}")
        return f"{self.message}" + (f" ({', '.join(where)})" if where else "")


class CheckpointError(Fp4forgeError):
    """A checkpoint could not be read as what it claims to be."""


class HeaderError(CheckpointError):
    """A safetensors header is malformed: length prefix, UTF-8, JSON or schema."""


class OffsetError(CheckpointError):
    """Tensor byte ranges overlap, leave holes, or fall outside the file."""


class DtypeError(CheckpointError):
    """A dtype string that safetensors does not define."""


class LfsPointerError(CheckpointError):
    """A git-LFS pointer file stands where real data should be (what `/raw/` URLs return)."""


class IndexFileError(CheckpointError):
    """`model.safetensors.index.json` is malformed or unsafe (traversal, absolute paths)."""


class RemoteError(CheckpointError):
    """An HTTP request for a remote checkpoint failed."""


class LayoutError(Fp4forgeError):
    """A tensor name that no architecture layout recognises, or an unknown architecture."""


class WriteError(Fp4forgeError):
    """An output could not be written; nothing half-written is left in place."""


class ConfigError(Fp4forgeError):
    """A config, preset or option that cannot be honoured."""


class StatsFileError(ConfigError):
    """A calibration-statistics file that cannot be read or does not follow its schema
    (checkpoint/stats.py), or that lacks an entry the model needs."""


class ServeError(Fp4forgeError):
    """A model server could not be started, did not become ready, or died."""
