"""One exception hierarchy for everything fp4forge reports to a user.

Every error carries enough context (file, tensor) to act on; the CLI turns any
``Fp4forgeError`` into a one-line message and a non-zero exit code, never a traceback.
"""

from __future__ import annotations


class Fp4forgeError(Exception):
    """Base class: an error fp4forge understands and can explain."""

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None, option: str | None = None):
        self.message = message
        self.file = file
        self.tensor = tensor
        self.option = option  # the library option the error is about ("tokenizer"); the CLI spells it as its flag
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


class ServeError(Fp4forgeError):
    """A model server could not be started, did not become ready, or died."""


class EndpointError(Fp4forgeError):
    """An OpenAI-compatible server could not be reached or did not answer as one.

    ``kind`` names what went wrong, the same word bench samples and quality transcripts record:
    ``connect``, ``timeout``, ``disconnect``, ``http`` (a status >= 400) or ``protocol`` (a body
    that is not the JSON asked for). ``fp4forge.endpoint`` is the only place that raises these.
    """

    kind = "endpoint"

    def __init__(self, message: str, *, url: str, status: int | None = None, body: str | None = None,
                 cause: BaseException | None = None, option: str | None = None):
        self.url = url
        self.status = status
        self.body = body
        self.cause = cause
        super().__init__(message, option=option)


class EndpointUnreachable(EndpointError):
    """Nothing accepted the connection (refused, unknown host): no server there, or it is gone."""

    kind = "connect"


class EndpointTimeout(EndpointError):
    """The server did not answer (or finish answering) within the time allowed."""

    kind = "timeout"


class EndpointDisconnected(EndpointError):
    """The connection broke after it was made (mid-request or mid-stream)."""

    kind = "disconnect"


class EndpointStatusError(EndpointError):
    """The server answered with an HTTP status >= 400; ``status`` and ``body`` say what it said."""

    kind = "http"


class EndpointProtocolError(EndpointError):
    """A 2xx answer whose body is not the JSON asked for."""

    kind = "protocol"
