"""The pipeline's content hashes: files hashed in parallel give the digests a plain sequential
read gives (hashlib over each file; a tree digest recorded by the sequential implementation), a
cache in the established format is read, and a step key hashed beside its step is the key taken
before it, with the same records when the step fails, the hash fails or Ctrl-C comes.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fp4forge.bench.host import usable_cores
from fp4forge.errors import PipelineFailed, PipelineStepError
from fp4forge.pipeline.run import _run_step, step_key
from fp4forge.pipeline.state import FAILED, Hasher, HashStopped, Manifest, StepRecord
from fp4forge.pipeline.steps import Context, PipelineOptions, Step
from fp4forge.quantize.job import QuantizeJob

OPTIONS = PipelineOptions(quantize=QuantizeJob(recipe="nvfp4-experts-fp8-attn"))
# The tree below, hashed by the sequential implementation (8 MiB reads, one file after another):
# Hasher.tree(root, ("reports",)) and Hasher.tree(root).
RECORDED_TREE = "8e2b0b7d0149f6bcc98bdbdc790f59eab42dcbbad88fc4b02e8c15b398bcf762"
RECORDED_TREE_ALL = "edeccdb6a239d59bdf4edd0c94cf91afba575abd13147976194dc591a3fad033"
KEY_THREAD = "fp4forge-step-key"


def build_tree(root: Path) -> Path:
    """Three shards (one over two read chunks), an empty file, a nested file, a reports entry."""
    (root / "sub").mkdir(parents=True)
    (root / "reports").mkdir()
    pattern = bytes(range(251))
    for i, size in enumerate((17 * 2**20 + 3, 5 * 2**20, 123_457)):
        (root / f"model-0000{i + 1}-of-00003.safetensors").write_bytes((pattern * (size // 251 + 1))[i:size + i])
    (root / "empty").write_bytes(b"")
    (root / "sub" / "notes.txt").write_text("tokenizer and friends\n")
    (root / "reports" / "left-out.json").write_text("{}\n")
    return root


def oracle_tree(root: Path, exclude: tuple[str, ...] = ()) -> str:
    """The tree digest by its definition: relative name NUL sha256 of the bytes, one line per file in sorted order."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).parts[0] not in exclude]
    lines = [f"{p.relative_to(root).as_posix()}\0{hashlib.sha256(p.read_bytes()).hexdigest()}" for p in files]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def hash_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("fp4forge-hash", KEY_THREAD))]


def test_the_parallel_tree_hash_is_the_sequential_one(tmp_path: Path) -> None:
    root = build_tree(tmp_path / "tree")
    hasher = Hasher(tmp_path / "cache.json")
    assert hasher.tree(root, ("reports",)) == oracle_tree(root, ("reports",)) == RECORDED_TREE
    assert hasher.tree(root) == oracle_tree(root) == RECORDED_TREE_ALL
    assert hasher.file(root / "empty") == hashlib.sha256(b"").hexdigest()
    assert not hash_threads()


@pytest.mark.skipif((usable_cores() or 1) < 2, reason="one core: one thread at a time")
def test_uncached_files_are_read_on_several_threads_at_once(tmp_path: Path) -> None:
    root = build_tree(tmp_path / "tree")
    hasher = Hasher(None)
    together = threading.Barrier(2, timeout=10)  # broken (an error) unless two reads overlap
    read = hasher._read_sha256

    def meeting(path: Path, *halt: Any) -> str:
        if path.name.startswith("model-0000") and path.name[10] in "12":
            together.wait()
        return read(path, *halt)

    hasher._read_sha256 = meeting  # type: ignore[method-assign]
    assert hasher.tree(root, ("reports",)) == RECORDED_TREE


def test_a_cache_in_the_established_format_is_read_and_written(tmp_path: Path) -> None:
    """The cache: {resolved path: [size, mtime_ns, inode, sha256]}. An entry whose stamp matches is
    trusted without reading (a planted digest shows it), one whose stamp differs is read again."""
    root = build_tree(tmp_path / "tree")
    shard, notes = root / "model-00001-of-00003.safetensors", root / "sub" / "notes.txt"
    planted = "ab" * 32
    st = shard.stat()
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({str(shard.resolve()): [st.st_size, st.st_mtime_ns, st.st_ino, planted],
                                 str(notes.resolve()): [1, 2, 3, planted]}))
    hasher = Hasher(cache)
    assert hasher.file(shard) == planted
    assert hasher.file(notes) == hashlib.sha256(notes.read_bytes()).hexdigest()
    hasher.save()
    saved = json.loads(cache.read_text())
    stamp = notes.stat()
    assert saved[str(notes.resolve())] == [stamp.st_size, stamp.st_mtime_ns, stamp.st_ino, hasher.file(notes)]
    assert saved[str(shard.resolve())][3] == planted


def test_the_last_save_writes_the_latest_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two saves at once: the one that snapshots later writes last. Here the first save's write is
    held until the second thread has hashed a tree and called save; the file must then hold that
    tree (a stale snapshot written last would drop it)."""
    from fp4forge.pipeline import state

    hasher, tree = Hasher(tmp_path / "cache.json"), build_tree(tmp_path / "tree")
    writing, release = threading.Event(), threading.Event()
    write_json = state.write_json

    def first_write_held(path: Path, doc: Any) -> None:
        if not writing.is_set():
            writing.set()
            assert release.wait(10)
        write_json(path, doc)

    monkeypatch.setattr(state, "write_json", first_write_held)
    empty = threading.Thread(target=hasher.save)
    empty.start()
    assert writing.wait(10)
    full = threading.Thread(target=lambda: (hasher.tree(tree, ("reports",)), hasher.save()))
    full.start()
    deadline = time.monotonic() + 10
    while len(hasher._cache) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the second save has begun (and, unserialised, written) by now
    release.set()
    empty.join(10), full.join(10)
    assert len(json.loads((tmp_path / "cache.json").read_text())) == 5


def test_threads_share_one_cache_safely(tmp_path: Path) -> None:
    trees = [build_tree(tmp_path / f"tree{i}") for i in range(3)]
    hasher = Hasher(tmp_path / "cache.json")
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = hasher.tree(trees[i], ("reports",))
            hasher.save()
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == {0: RECORDED_TREE, 1: RECORDED_TREE, 2: RECORDED_TREE}
    assert len(json.loads((tmp_path / "cache.json").read_text())) == 3 * 5


def test_the_first_failing_file_in_order_is_raised_and_the_others_are_cached(tmp_path: Path) -> None:
    root = build_tree(tmp_path / "tree")
    hasher = Hasher(None)
    read = hasher._read_sha256

    def failing(path: Path, *halt: Any) -> str:
        if path.name in ("model-00002-of-00003.safetensors", "notes.txt"):
            raise PermissionError(f"denied: {path.name}")
        return read(path, *halt)

    hasher._read_sha256 = failing  # type: ignore[method-assign]
    with pytest.raises(PermissionError, match="model-00002"):
        hasher.tree(root)
    hasher._read_sha256 = lambda path, *halt: pytest.fail(f"{path} read twice")  # type: ignore[method-assign]
    assert hasher.file(root / "model-00003-of-00003.safetensors") == hashlib.sha256(
        (root / "model-00003-of-00003.safetensors").read_bytes()).hexdigest()


def test_a_stopped_hash_raises_and_a_resumed_one_works(tmp_path: Path) -> None:
    root = build_tree(tmp_path / "tree")
    hasher = Hasher(None)
    hasher.stop()
    with pytest.raises(HashStopped):
        hasher.file(root / "sub" / "notes.txt")
    hasher.resume()
    assert hasher.tree(root, ("reports",)) == RECORDED_TREE


def interrupt_main_when(ready: threading.Event) -> threading.Thread:
    """A thread that sends the main thread a real SIGINT (a terminal's Ctrl-C) once ``ready`` is set
    and the main thread had time to block in its wait."""
    import signal

    main = threading.main_thread().ident

    def send() -> None:
        assert ready.wait(20)
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGINT)

    return threading.Thread(target=send)


def test_ctrl_c_while_the_main_thread_hashes_in_parallel_stops_the_reads(tmp_path: Path) -> None:
    import signal

    root = build_tree(tmp_path / "tree")
    hasher = Hasher(None, threads=2)
    read, reading, told_to_stop = hasher._read_sha256, threading.Event(), []

    def held(path: Path, halt: threading.Event | None = None) -> str:
        reading.set()
        told_to_stop.append(halt is not None and halt.wait(10))
        return read(path, halt)

    hasher._read_sha256 = held  # type: ignore[method-assign]
    sender = interrupt_main_when(reading)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            hasher.tree(root)
    finally:
        sender.join()
        signal.signal(signal.SIGINT, previous)
    # The two reads under way were told to stop (a worker may take one more file before the queue is
    # cancelled); the rest were never opened.
    assert all(told_to_stop) and 2 <= len(told_to_stop) < 7
    assert not hash_threads()


# -- a step key hashed beside its step ------------------------------------------------------------

class Gate:
    """Holds every file read of a Hasher until ``open``; records that a read was waiting."""

    def __init__(self, hasher: Hasher, wait_for_stop: bool = False, linger: float = 0.0) -> None:
        self.waiting, self.opened = threading.Event(), threading.Event()
        self.linger = linger  # seconds each read takes after the gate opened
        self._read = hasher._read_sha256
        self._hasher = hasher
        self._wait_for_stop = wait_for_stop
        hasher._read_sha256 = self.read  # type: ignore[method-assign]

    def read(self, path: Path, *halt: Any) -> str:
        self.waiting.set()
        # Until Ctrl-C asked the hash to stop, or the test opens the gate.
        assert (self._hasher._stopped if self._wait_for_stop else self.opened).wait(20), "the gate never opened"
        time.sleep(self.linger)
        return self._read(path, *halt)


def fake_pipeline(tmp_path: Path, run: Callable[[Context], dict[str, Any]]) -> tuple[Step, Context, Manifest]:
    src = build_tree(tmp_path / "src")
    (tmp_path / "out" / "reports").mkdir(parents=True)
    step = Step("fake", "a step", run, ("reports/fake.json",), ("src",))
    manifest = Manifest(tmp_path / "out" / "reports" / "pipeline.json", str(src), str(tmp_path / "out"), {},
                        {"fake": StepRecord("fake", "a step")})
    return step, Context(src, tmp_path / "out", OPTIONS), manifest


def key_taken_first(step: Step, ctx: Context, manifest: Manifest) -> str:
    return step_key(step, ctx, Hasher(None), manifest)


def test_the_key_hashed_beside_the_step_is_the_key_taken_first(tmp_path: Path) -> None:
    seen: dict[str, bool] = {}

    def run(ctx: Context) -> dict[str, Any]:
        assert gate.waiting.wait(20)  # the key is hashing while the step runs
        seen["key hashing"] = any(t.name == KEY_THREAD for t in threading.enumerate())
        (ctx.reports / "fake.json").write_text("{}\n")
        gate.opened.set()
        return {"n": 1}

    step, ctx, manifest = fake_pipeline(tmp_path, run)
    hasher = Hasher(tmp_path / "out" / "reports" / ".hashes.json")
    gate = Gate(hasher)
    _run_step(step, ctx, manifest, None, hasher, lambda event: None)
    record = manifest.steps["fake"]
    assert seen == {"key hashing": True}
    assert record.status == "done" and record.summary == {"n": 1}
    assert record.key == key_taken_first(step, ctx, manifest)
    assert record.artifacts == {"reports/fake.json": hashlib.sha256(b"{}\n").hexdigest()}
    assert not hash_threads()


def failing_step(gates: list[Gate]) -> Callable[[Context], dict[str, Any]]:
    def run(ctx: Context) -> dict[str, Any]:
        time.sleep(0.05)  # file times are coarser than time.time(): written clearly after the step started
        (ctx.reports / "fake.json").write_text('{"errors": 1}\n')
        for gate in gates:
            assert gate.waiting.wait(20)
            gate.opened.set()  # the key is still hashing when the step fails
        raise PipelineStepError("the data is bad")

    return run


def test_a_step_failing_while_its_key_hashes_records_what_it_recorded_with_the_key_first(tmp_path: Path) -> None:
    gates: list[Gate] = []
    runs = {}
    for mode in ("key first", "beside"):
        step, ctx, manifest = fake_pipeline(tmp_path / mode, failing_step(gates))
        (ctx.reports / "fake.json").write_text("{}\n")
        hasher = Hasher(None)
        # A finished record whose artifact is there could be valid: the key is taken first, as ever.
        old = StepRecord("fake", "a step", "done", "stale", {"reports/fake.json": "0" * 64}) if mode == "key first" else None
        if mode == "beside":
            gates.append(Gate(hasher, linger=0.2))  # the key ends well after the step failed
        with pytest.raises(PipelineFailed) as failure:
            _run_step(step, ctx, manifest, old, hasher, lambda event: None)
        runs[mode] = (str(failure.value), manifest.status, manifest.steps["fake"], key_taken_first(step, ctx, manifest))
    for message, status, record, key in runs.values():
        assert message == "step fake failed: the data is bad" and status == FAILED
        assert record.status == FAILED and record.message == "the data is bad" and record.key == key
        # What it wrote before failing is recorded (the wait for the key does not hide it).
        assert record.artifacts == {"reports/fake.json": hashlib.sha256(b'{"errors": 1}\n').hexdigest()}
        assert record.seconds is not None
    assert not hash_threads()


def test_a_failed_key_hash_raises_its_error_and_records_no_run(tmp_path: Path) -> None:
    ran = []
    step, ctx, manifest = fake_pipeline(tmp_path, lambda ctx: ran.append(1) or {"n": 1})
    hasher = Hasher(None)

    def denied(path: Path, *halt: Any) -> str:
        raise PermissionError(f"denied: {path.name}")

    hasher._read_sha256 = denied  # type: ignore[method-assign]
    with pytest.raises(PermissionError, match="denied"):
        _run_step(step, ctx, manifest, None, hasher, lambda event: None)
    record = manifest.steps["fake"]
    # As when the key came first and failed: no key, seconds or summary; "running" becomes pending
    # when the run closes (run_pipeline's _close_run), the manifest is not marked failed.
    assert ran == [1] and (record.key, record.seconds, record.summary, record.artifacts) == (None, None, {}, {})
    assert record.status == "running" and manifest.status == "pending"
    assert not hash_threads()


def test_ctrl_c_during_the_step_stops_the_key_hash(tmp_path: Path) -> None:
    def run(ctx: Context) -> dict[str, Any]:
        assert gate.waiting.wait(20)
        raise KeyboardInterrupt

    step, ctx, manifest = fake_pipeline(tmp_path, run)
    hasher = Hasher(None)
    gate = Gate(hasher, wait_for_stop=True)
    with pytest.raises(KeyboardInterrupt):
        _run_step(step, ctx, manifest, None, hasher, lambda event: None)
    record = manifest.steps["fake"]
    assert record.status == "interrupted" and record.message == "interrupted (Ctrl-C); a re-run resumes here"
    assert manifest.status == "interrupted" and record.key is None
    assert not hash_threads()
    hasher._read_sha256 = gate._read  # type: ignore[method-assign]
    assert hasher.tree(ctx.src, ("reports",)) == RECORDED_TREE  # the hasher works again afterwards


def test_ctrl_c_while_waiting_for_the_key_stops_it(tmp_path: Path) -> None:
    """The step is done and the key still hashes: a real SIGINT to the waiting main thread stops
    the hash at its next read, and the step is recorded interrupted, no thread left behind."""
    import signal

    step_done = threading.Event()

    def run(ctx: Context) -> dict[str, Any]:
        assert gate.waiting.wait(20)
        (ctx.reports / "fake.json").write_text("{}\n")
        step_done.set()  # the main thread then waits in settle() for the key
        return {}

    step, ctx, manifest = fake_pipeline(tmp_path, run)
    hasher = Hasher(None)
    gate = Gate(hasher, wait_for_stop=True)
    sender = interrupt_main_when(step_done)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            _run_step(step, ctx, manifest, None, hasher, lambda event: None)
    finally:
        sender.join()
        signal.signal(signal.SIGINT, previous)
    record = manifest.steps["fake"]
    assert record.status == "interrupted" and record.key is None and manifest.status == "interrupted"
    assert not hash_threads()


def test_a_source_changed_while_the_step_ran_records_no_key(tmp_path: Path) -> None:
    def run(ctx: Context) -> dict[str, Any]:
        (ctx.src / "sub" / "notes.txt").write_text("edited while the step read it\n")
        (ctx.reports / "fake.json").write_text("{}\n")
        return {}

    step, ctx, manifest = fake_pipeline(tmp_path, run)
    _run_step(step, ctx, manifest, None, Hasher(None), lambda event: None)
    record = manifest.steps["fake"]
    # Done, but with no key: the next run redoes it whatever the source holds then.
    assert record.status == "done" and record.key is None
