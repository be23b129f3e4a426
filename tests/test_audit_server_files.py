"""The files a server reads, audited as transformers reads them: each defect planted in a synth
testbed (its tokenizer, chat template and generation config are what `testbed synth` writes) and
checked against transformers' own loaders, which must fail or misbehave on the same file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp4forge.audit.engine import audit_checkpoint
from fp4forge.audit.findings import AuditReport
from fp4forge.testbed.synth import synth_checkpoint

SERVER_RULES = {"server-file-absent", "tokenizer-unloadable", "tokenizer-vocab-exceeds-embedding", "chat-template-absent",
                "chat-template-invalid", "special-token-id-out-of-range", "generation-config-invalid",
                "processor-config-invalid", "config-dtype-mismatch", "tied-embeddings-mismatch"}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_checkpoint("qwen3-235b-like", 1, tmp_path_factory.mktemp("server-files") / "clean", shrink=16)


@pytest.fixture()
def model(clean: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(clean, tmp_path / "model"))


def found(report: AuditReport, severity: str | None = None) -> set[str]:
    return {f.rule for f in report.findings if severity is None or f.severity == severity}


def server_findings(path: Path) -> dict[str, str]:
    report = audit_checkpoint(str(path))
    return {f.rule: f.severity for f in report.findings if f.rule in SERVER_RULES}


def edit_json(path: Path, **changes: object) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_clean_testbed_has_no_server_file_finding(clean: Path) -> None:
    assert server_findings(clean) == {}
    assert audit_checkpoint(str(clean)).exit_code == 0


def test_absent_files_are_said_once_as_not_checked(model: Path) -> None:
    for name in ("tokenizer.json", "generation_config.json"):
        (model / name).unlink()
    report = audit_checkpoint(str(model))
    absent = [f for f in report.findings if f.rule == "server-file-absent"]
    assert len(absent) == 1 and absent[0].severity == "info" and absent[0].count == 2
    assert "tokenizer" in absent[0].message and "generation_config.json" in absent[0].message
    assert report.exit_code == 0


def test_truncated_tokenizer_is_an_error_as_transformers_fails(model: Path) -> None:
    from transformers import AutoTokenizer

    text = (model / "tokenizer.json").read_text()
    (model / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(Exception):  # noqa: B017 - the oracle: transformers' own loader refuses it
        AutoTokenizer.from_pretrained(model)
    assert server_findings(model) == {"tokenizer-unloadable": "error"}


def test_lfs_pointer_tokenizer_config_is_an_error(model: Path) -> None:
    (model / "tokenizer_config.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n")
    report = audit_checkpoint(str(model))
    assert found(report, "error") == {"tokenizer-unloadable"} and "git-LFS" in report.findings[0].message


def test_token_ids_past_the_embedding(model: Path) -> None:
    from transformers import AutoTokenizer

    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    doc = json.loads((model / "tokenizer.json").read_text())
    doc["added_tokens"].append({"id": vocab_size, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(doc))
    assert len(AutoTokenizer.from_pretrained(model)) > vocab_size  # transformers loads it: ids past the embedding
    assert server_findings(model) == {"tokenizer-vocab-exceeds-embedding": "error"}


def test_missing_chat_template_is_a_warning(model: Path) -> None:
    from transformers import AutoTokenizer

    (model / "chat_template.jinja").unlink()
    edit_json(model / "tokenizer_config.json", chat_template=None)
    assert AutoTokenizer.from_pretrained(model).chat_template is None
    assert server_findings(model) == {"chat-template-absent": "warning"}


def test_broken_chat_template_is_an_error_as_transformers_fails(model: Path) -> None:
    from transformers import AutoTokenizer

    (model / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }")
    with pytest.raises(Exception):  # noqa: B017 - jinja2's TemplateSyntaxError, through transformers
        AutoTokenizer.from_pretrained(model).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert server_findings(model) == {"chat-template-invalid": "error"}


@pytest.mark.parametrize("template", [
    "{{ raise_exception('System role required') }}",  # the template's own refusal of a one-message chat
    "{{ bos_token + messages[0].content + nonexistent_token }}",  # a special token the tokenizer does not name
])
def test_a_template_that_fails_a_one_message_chat_is_an_error_as_transformers_fails(model: Path, template: str) -> None:
    from transformers import AutoTokenizer

    (model / "chat_template.jinja").write_text(template)
    with pytest.raises(Exception):  # noqa: B017 - jinja2's TemplateError / UndefinedError, through transformers
        AutoTokenizer.from_pretrained(model).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert server_findings(model) == {"chat-template-invalid": "error"}
    detail = next(f for f in audit_checkpoint(str(model)).findings if f.rule == "chat-template-invalid")
    assert "Error" in json.dumps(detail.to_json())


def test_a_template_that_reads_content_parts_is_no_finding(model: Path) -> None:
    # vLLM passes content as OpenAI parts to a template that reads them; the string form fails here
    from transformers import AutoTokenizer

    template = "{% for m in messages %}{{ m.content[0].text + '\\n' }}{% endfor %}"
    (model / "chat_template.jinja").write_text(template)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert AutoTokenizer.from_pretrained(model).apply_chat_template(parts, tokenize=False) == "hi\n"
    with pytest.raises(Exception):  # noqa: B017 - jinja2's UndefinedError on the string form
        AutoTokenizer.from_pretrained(model).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert server_findings(model) == {}


def test_eos_outside_the_vocabulary(model: Path) -> None:
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    edit_json(model / "generation_config.json", eos_token_id=[0, vocab_size])
    report = audit_checkpoint(str(model))
    assert server_findings(model) == {"special-token-id-out-of-range": "error"}
    assert f"eos_token_id = {vocab_size}" in next(f.message for f in report.findings if f.rule == "special-token-id-out-of-range")


def test_unreadable_generation_config_is_a_warning(model: Path) -> None:
    from transformers import GenerationConfig

    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(OSError):  # what vLLM's try_get_generation_config catches, then falls back silently
        GenerationConfig.from_pretrained(model)
    assert server_findings(model) == {"generation-config-invalid": "warning"}


def test_unreadable_processor_file_is_an_error(model: Path) -> None:
    (model / "preprocessor_config.json").write_text("[1, 2]")
    assert server_findings(model) == {"processor-config-invalid": "error"}


def test_config_dtype_other_than_the_stored_one(model: Path) -> None:
    with safe_open(str(model / "model.safetensors"), "pt") as handle:
        assert handle.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"  # the oracle: the header itself
    edit_json(model / "config.json", dtype="float16")
    assert server_findings(model) == {"config-dtype-mismatch": "warning"}


def test_tied_config_with_a_stored_head(model: Path) -> None:
    edit_json(model / "config.json", tie_word_embeddings=True)
    report = audit_checkpoint(str(model))
    assert found(report, "error") == {"tied-embeddings-mismatch"}  # the generic unexpected-tensor finding is its knock-on
    assert next(f for f in report.findings if f.rule == "tied-embeddings-mismatch").tensors == ["lm_head.weight"]


def test_untied_config_without_a_head(model: Path) -> None:
    tensors = load_file(model / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    report = audit_checkpoint(str(model))
    assert found(report, "error") == {"tied-embeddings-mismatch"}
