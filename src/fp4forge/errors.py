"""One exception hierarchy, and one exit-code table, for everything fp4forge reports to a user.

Every error carries enough context (file, tensor, the option it is about) to act on; the CLI
turns any ``Fp4forgeError`` into a one-line message and its class's exit code, never a traceback.
Library messages name options by their library (keyword) name in ``option``, never by a command
line flag: the same error reaches users of ``fp4forge quantize``, of ``fp4forge pipeline`` (whose
flags differ) and of the Python API, and each front end spells ``option`` its own way.

Exit codes (docs/exit-codes.md is this table in prose; a test keeps the two in step):

====  =======================  ==========================================================
code  name                     meaning
====  =======================  ==========================================================
0     ExitCode.OK              success: no error findings, every request answered
1     ExitCode.FINDINGS        the command ran and its answer is "no": audit / doctor /
                               kv show error findings, diff differences, a pipeline step
                               failed, some benchmark or quality requests failed
2     ExitCode.UNUSABLE        input or options fp4forge cannot use (every Fp4forgeError
                               unless its class says otherwise; also click's usage errors)
3     ExitCode.ABORTED         a long run stopped before its end (server gone, suite run
                               incomplete); everything finished is kept on disk
130   ExitCode.INTERRUPTED     Ctrl-C; nothing half-written is left in place
====  =======================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FINDINGS = 1
    UNUSABLE = 2
    ABORTED = 3
    INTERRUPTED = 130


class Fp4forgeError(Exception):
    """Base class: an error fp4forge understands and can explain."""

    exit_code: int = ExitCode.UNUSABLE

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None, option: str | None = None):
        self.message = message
        self.file = file
        self.tensor = tensor
        self.option = option  # the library (keyword) name of the option the error is about
        super().__init__(self.__str__())

    def describe(self, spell_option=None) -> str:  # type: ignore[no-untyped-def]
        """The one-line message; ``spell_option(name)`` renders ``option`` (a CLI passes its
        flag spelling, e.g. ``stats`` -> ``--stats``; default: ``option 'stats'``)."""
        where = []
        if self.option:
            where.append(spell_option(self.option) if spell_option else f"option {self.option!r}")
        if self.file:
            where.append(f"file {self.file}")
        if self.tensor:
            where.append(f"tensor {self.tensor!r}")
        return f"{self.message}" + (f" ({', '.join(where)})" if where else "")

    def __str__(self) -> str:
        return self.describe()


# -- reading checkpoints ---------------------------------------------------------------------------
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


# -- options, data, outputs ------------------------------------------------------------------------
class ConfigError(Fp4forgeError):
    """A config, preset or option that cannot be honoured."""


class DataFileError(Fp4forgeError):
    """A data file fp4forge ships or generates (rule table, a generated doc block) is malformed."""


class ShippedTestbedError(DataFileError):
    """A testbed fp4forge ships whose files do not match its manifest's sha256 hashes (a file
    missing, added or changed since it was shipped), or whose manifest is missing or malformed."""


class WriteError(Fp4forgeError):
    """An output could not be written; nothing half-written is left in place."""


class NumericsError(Fp4forgeError):
    """A tensor that cannot be quantized as asked (shape, non-finite values, bad option)."""


class DistributedError(Fp4forgeError):
    """Several processes (``torchrun``) could not work together: a launcher environment that is
    incomplete, a process group that did not form, a rank that failed while the others waited, or
    ranks that disagree about what they computed (model/distributed.py)."""


# -- serving and measuring -------------------------------------------------------------------------
class StatsFileError(ConfigError):
    """A calibration-statistics file that cannot be read or does not follow its schema
    (checkpoint/stats.py), or that lacks an entry the model needs."""


class ServeError(Fp4forgeError):
    """A model server could not be started, did not become ready, or died."""


class NotAVllmLogError(Fp4forgeError):
    """A file given to ``serve doctor`` that is not a vLLM log: empty, binary, or with no line vLLM
    writes. ``kind`` names which (``empty``, ``binary``, ``not-vllm``)."""

    def __init__(self, message: str, *, kind: str, file: str | None = None):
        self.kind = kind
        super().__init__(message, file=file)


class BenchAborted(Fp4forgeError):
    """The run stopped before its end (the server went away); finished samples are on disk."""

    exit_code = ExitCode.ABORTED


class SuiteError(ConfigError):
    """A scenario file that does not describe a valid scenario."""


class QualityRunError(Fp4forgeError):
    """The run could not start: no server, or the model is not served."""


class IncompleteRunError(Fp4forgeError):
    """A run wrote fewer scenarios than the suite holds (its footer says so)."""

    exit_code = ExitCode.ABORTED


class UnreadableAnswersError(Fp4forgeError):
    """An arm whose answers the suite cannot read: most of its turns ended at ``max_tokens`` or
    held reasoning only (no content, no tool call). Its score would measure the serving format
    (template, parser, token budget), not the model, so it is not scored."""

    exit_code = ExitCode.FINDINGS


class TextRequiredError(ConfigError):
    """A job that scores a model on text was given none the model reads: no text files, and the
    built-in corpus is not the model's own (docs/fidelity.md#text). ``option`` names what to pass."""


class UnreadableTextError(Fp4forgeError):
    """Text the teacher cannot read: its perplexity on it is at or above the stated share of the
    vocabulary-uniform level (docs/fidelity.md#unreadable-text). KL and top-1 agreement on such
    text would measure noise, so fidelity is not scored."""

    exit_code = ExitCode.FINDINGS


class ProbeError(Fp4forgeError):
    """A probe request failed, or the arms cannot be compared (different tokenizers)."""


class ReportError(Fp4forgeError):
    """Runs that cannot be compared (incomplete, different scenarios, an arm without runs)."""


# -- the pipeline ----------------------------------------------------------------------------------
class PipelineStepError(Fp4forgeError):
    """A step ran and its result says stop (audit errors, KV findings, failed requests)."""


class PipelineFailed(Fp4forgeError):
    """A step failed; the manifest says which, and a re-run resumes there."""

    exit_code = ExitCode.FINDINGS


def require_choice(value: object, choices: tuple, option: str) -> None:
    """Options are validated once, in the library: ``value`` must be one of ``choices`` (the
    ``typing.get_args`` of the option's ``Literal``)."""
    if value not in choices:
        raise ConfigError(f"unknown value {value!r}: choose one of {', '.join(map(str, choices))}", option=option)


def given_options(**values: object) -> dict[str, object]:
    """The options a caller set, by name: ``None`` means left out (the option's default stands), so
    a command line's absent flag and a pipeline's unset option reach one options class alike."""
    return {name: value for name, value in values.items() if value is not None}


@contextmanager
def option_path(prefix: str, options: type | Iterable[str]) -> Iterator[None]:
    """Errors raised inside about one of ``options`` (a dataclass, or field names) name it by its
    dotted path under ``prefix`` (``numerics`` -> ``fidelity.numerics``): how a job nested in
    another's options (the pipeline's, the quantize job's GPTQ) says which option it means."""
    names = {f.name for f in fields(options)} if isinstance(options, type) else set(options)
    try:
        yield
    except Fp4forgeError as error:
        if error.option and error.option.split(".")[0] in names:
            error.option = f"{prefix}.{error.option}"
        raise


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
