"""`fp4forge audit` / `fp4forge diff` on the command line: exit codes (0 / 1 / 2), the JSON
document other tools rely on, --list-rules, the generated docs/audit.md, messages instead of
tracebacks for unreadable input, and remote checkpoints through a real loopback HTTP server
that serves files the way the Hub's /resolve/ does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fp4forge.audit.findings import RULES_BEGIN, RULES_END, rule_table, rules_markdown, sync_rules_doc
from fp4forge.checkpoint.names import INDEX_JSON
from fp4forge.cli.audit import register
from tests.http_repo_server import RepoServer
from tests.test_audit_integrity import audit, copy_checkpoint, rules, shard_names

REPO_ROOT = Path(__file__).resolve().parents[1]
AUDIT_DOC = REPO_ROOT / "docs" / "audit.md"
# Runs the commands as a user would, whether or not cli.py has registered them yet.
CLI_LAUNCHER = (
    "import sys, typer\n"
    "from fp4forge import cli\n"
    "from fp4forge.cli.audit import register\n"
    "if 'audit' not in {c.name or c.callback.__name__ for c in cli.app.registered_commands}: register(cli.app)\n"
    "sys.argv[0] = 'fp4forge'\n"
    "cli.main()\n"
)


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    application = typer.Typer()

    @application.callback()
    def main() -> None:
        """fp4forge (test app)"""

    register(application)
    return application


def invoke(app: typer.Typer, *args: str):
    return CliRunner().invoke(app, list(args))


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI_LAUNCHER, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


@pytest.fixture()
def broken(lc_source_dir: Path, tmp_path: Path) -> Path:
    """The tiny Laguna with one shard deleted."""
    path = copy_checkpoint(lc_source_dir, tmp_path / "broken")
    (path / shard_names(path)[2]).unlink()
    return path


# -- rules ------------------------------------------------------------------------------------------
def test_list_rules_json_is_the_rule_table(app) -> None:
    result = invoke(app, "audit", "--list-rules", "--json")
    assert result.exit_code == 0
    listed = json.loads(result.stdout)["rules"]
    assert [r["id"] for r in listed] == list(rule_table())
    assert all(r["severity"] in ("error", "warning", "info") and r["title"] and r["rationale"] and r["fix"] for r in listed)


def test_list_rules_human_and_markdown(app) -> None:
    human = invoke(app, "audit", "--list-rules")
    assert human.exit_code == 0 and "kv-scale-absent" in human.stdout
    markdown = invoke(app, "audit", "--list-rules", "--markdown")
    assert markdown.stdout == rules_markdown()


@pytest.mark.parametrize("doc", [AUDIT_DOC, REPO_ROOT / "README.md"], ids=["docs-audit", "readme"])
def test_docs_rule_list_is_generated_from_the_table(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert RULES_BEGIN in text and RULES_END in text
    assert sync_rules_doc(text) == text, f"{doc.name} is stale: run `python -m fp4forge.audit.findings {doc.relative_to(REPO_ROOT)}`"
    for rule_id in rule_table():
        assert f"`{rule_id}`" in text


# -- exit codes and the JSON document ---------------------------------------------------------------
def test_clean_checkpoint_exits_0_with_the_documented_json(app, lc_source_dir: Path) -> None:
    result = invoke(app, "audit", str(lc_source_dir), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert {"checkpoint", "findings", "summary"} <= doc.keys()
    assert set(doc["summary"]) == {"errors", "warnings", "infos"} and doc["summary"]["errors"] == 0
    for entry in doc["findings"]:
        assert {"rule", "severity", "message", "file", "tensors"} <= entry.keys()


def test_errors_exit_1(app, broken: Path) -> None:
    result = invoke(app, "audit", str(broken), "--json")
    assert result.exit_code == 1
    assert "shard-missing" in {f["rule"] for f in json.loads(result.stdout)["findings"]}
    human = invoke(app, "audit", str(broken))
    assert human.exit_code == 1 and "shard-missing" in human.stdout and "Fix:" in human.stdout and "FAIL" in human.stdout
    markdown = invoke(app, "audit", str(broken), "--markdown")
    assert markdown.exit_code == 1 and "| error | `shard-missing` |" in markdown.stdout


def test_bad_options_exit_2(app, lc_source_dir: Path) -> None:
    assert invoke(app, "audit", str(lc_source_dir), "--format", "gguf").exit_code == 2
    assert invoke(app, "audit", str(lc_source_dir), "--vllm-version", "latest").exit_code == 2
    assert invoke(app, "audit").exit_code == 2


def _unreadable_cases(lc_source_dir: Path, tmp_path: Path) -> dict[str, Path]:
    lfs_index = copy_checkpoint(lc_source_dir, tmp_path / "lfs-index")
    (lfs_index / INDEX_JSON).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "ef" * 32 + "\nsize 17618\n")
    linked_config = copy_checkpoint(lc_source_dir, tmp_path / "linked-config")
    (tmp_path / "elsewhere.json").write_text((linked_config / "config.json").read_text())
    (linked_config / "config.json").unlink()
    os.symlink(tmp_path / "elsewhere.json", linked_config / "config.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    return {"absent": tmp_path / "does-not-exist", "lfs index": lfs_index, "config outside": linked_config, "no shards": empty}


def test_unreadable_input_exits_2_with_a_message(app, lc_source_dir: Path, tmp_path: Path) -> None:
    for case, path in _unreadable_cases(lc_source_dir, tmp_path).items():
        result = invoke(app, "audit", str(path), "--json")
        assert result.exit_code == 2, (case, result.output)
        assert result.stderr.startswith("error: could not audit"), case
        assert "error" in json.loads(result.stdout), case


def test_unreadable_input_in_a_real_process_prints_no_traceback(lc_source_dir: Path, tmp_path: Path) -> None:
    lfs_index = _unreadable_cases(lc_source_dir, tmp_path)["lfs index"]
    proc = run_cli("audit", str(lfs_index))
    assert proc.returncode == 2 and "git-LFS pointer" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


# -- remote -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hub(lc_source_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    broken = copy_checkpoint(lc_source_dir, tmp_path_factory.mktemp("hub") / "broken")
    (broken / shard_names(broken)[0]).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "12" * 32 + "\nsize 5379400\n")
    with RepoServer({"org/tiny": lc_source_dir, "org/broken": broken}) as server:
        yield server


def test_remote_audit_equals_local_audit(hub: RepoServer, lc_source_dir: Path) -> None:
    remote = audit(f"{hub.endpoint}/org/tiny/resolve/main")
    local = audit(lc_source_dir)
    assert [(f.rule, f.tensors) for f in remote.findings] == [(f.rule, f.tensors) for f in local.findings]


def test_remote_audit_reads_headers_and_scales_only(hub: RepoServer, lc_source_dir: Path) -> None:
    hub.requests.clear()
    audit(f"{hub.endpoint}/org/tiny/resolve/main")
    shard_reads = [r for r in hub.requests if r[1].endswith(".safetensors")]
    assert shard_reads and all(r[2] and r[2].startswith("bytes=") for r in shard_reads)


def test_remote_lfs_pointer_shard_is_a_finding(hub: RepoServer) -> None:
    report = audit(f"{hub.endpoint}/org/broken/resolve/main")
    assert "shard-lfs-pointer" in rules(report, "error") and report.exit_code == 1


def test_remote_raw_url_cannot_be_audited(app, hub: RepoServer) -> None:
    result = invoke(app, "audit", f"{hub.endpoint}/org/tiny/raw/main")
    assert result.exit_code == 2 and "/resolve/" in result.stderr


@pytest.mark.slow  # a fresh interpreter that imports transformers: 10-30 s on a busy 2-core machine
def test_remote_repo_id_through_hf_endpoint(hub: RepoServer) -> None:
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0"}
    proc = run_cli("audit", "org/tiny", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["errors"] == 0


def test_every_rule_has_a_planted_defect_test() -> None:
    """Each rule id of rules.toml is asserted by name in some audit test module."""
    tests = "".join((REPO_ROOT / "tests" / name).read_text() for name in ("test_audit_integrity.py", "test_audit_declarations.py", "test_audit_names.py",
                                                                          "test_audit_scale_magnitude.py", "test_corpus.py",
                                                                          "test_audit_server_files.py", "test_formats_packed.py"))
    untested = [rule_id for rule_id in rule_table() if f'"{rule_id}"' not in tests]
    assert not untested, untested


def test_plain_audit_runs_without_typer_and_prints_what_typer_does(app, broken: Path) -> None:
    """`fp4forge audit PATH --json` takes the fast path (fp4forge.cli.fast → cli.audit_run): typer,
    click, pydantic and rich stay unloaded, and the document and exit code are the typer
    command's."""
    code = (
        "import json, sys, io, contextlib\nfrom fp4forge.cli import main\n"
        f"sys.argv = ['fp4forge', 'audit', {str(broken)!r}, '--json', '--vllm-version', '0.32']\n"
        "out = io.StringIO()\nexit_code = 0\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n        main()\n    except SystemExit as exc:\n        exit_code = exc.code\n"
        "print(json.dumps({'code': exit_code, 'out': out.getvalue(), 'modules': sorted(sys.modules)}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    fast = json.loads(proc.stdout.splitlines()[-1])
    assert not {m for m in fast["modules"] if m.split(".")[0] in ("typer", "click", "pydantic", "rich")}
    typed = invoke(app, "audit", str(broken), "--json", "--vllm-version", "0.32")
    assert (fast["code"], fast["out"]) == (typed.exit_code, typed.stdout)
    assert fast["code"] == 1  # a deleted shard is an error
