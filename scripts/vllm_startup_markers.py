"""Write (or check) the evidence behind the log doctor's start-up markers: for every regex of
src/fp4forge/serve/doctor_startup.toml, the vLLM releases whose own source prints it, read from
each release's source distribution on PyPI, and the serving libraries that print the rest
(uvicorn, torch, in the installed vLLM environment). Written to
src/fp4forge/serve/_vllm_startup_markers.json.

    python scripts/vllm_startup_markers.py                       # print the table
    python scripts/vllm_startup_markers.py --write               # and write the data file
    python scripts/vllm_startup_markers.py --releases 0.32.0     # only these releases

A marker's evidence is its longest literal run (the regex's characters outside classes,
groups and repeats, spaces trimmed) found inside a string constant of a release's Python files:
a log call's format string, an f-string's literal part, or a constant it is built from.
Sdists are downloaded once into $FP4FORGE_CACHE_DIR/vllm-sdists (or ~/.cache/fp4forge/...) and
checked against the sha256 PyPI publishes. Run it with any Python 3.11+; the library column
needs the vLLM environment (`--libraries .venv-vllm`).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import os
import re
import re._constants as sre_constants
import re._parser as sre_parse
import sys
import tarfile
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "src/fp4forge/serve/doctor_startup.toml"
PATTERNS = ROOT / "src/fp4forge/serve/doctor_patterns.toml"
DATA = ROOT / "src/fp4forge/serve/_vllm_startup_markers.json"
SIMPLE = "https://pypi.org/simple/vllm/"
# One release per minor line the doctor corpus spans, and the newest ones.
RELEASES = ("0.5.4", "0.6.3", "0.6.6.post1", "0.7.3", "0.8.5", "0.9.2", "0.10.2", "0.11.2", "0.13.0",
            "0.16.0", "0.19.1", "0.22.1", "0.25.1", "0.28.0", "0.30.0", "0.32.0", "0.34.0")
# Libraries a vLLM server's log also carries lines of (the API server, torch's device warnings).
LIBRARIES = ("uvicorn", "starlette", "torch/cuda", "torch/distributed", "torch/_dynamo", "torch/_inductor", "tqdm")
PLUGIN = ROOT / "plugins"  # the fp4forge-vllm plugin's own lines


def literal_runs(parsed: sre_parse.SubPattern) -> list[str]:
    """Runs of plain characters a parsed regex matches; of an alternation, each branch's runs."""
    runs, run = [], ""
    for op, arg in parsed:
        if op is sre_constants.LITERAL:
            run += chr(arg)
            continue
        runs.append(run)
        run = ""
        if op is sre_constants.SUBPATTERN:
            runs += literal_runs(arg[-1])
        elif op is sre_constants.BRANCH:
            runs += [r for branch in arg[1] for r in literal_runs(branch)]
    return runs + [run]


def longest_literal(regex: str) -> str:
    """The longest run of plain characters the regex matches (of one branch, for an alternation),
    spaces at its ends trimmed."""
    return max((r.strip() for r in literal_runs(sre_parse.parse(regex))), key=len)


def branch_literals(regex: str) -> list[str]:
    """One literal per alternative when the whole regex is an alternation (``(?:A|B)`` or ``A|B``,
    each printed by other releases), else its longest literal."""
    parsed = sre_parse.parse(regex)
    items = list(parsed)
    if len(items) == 1 and items[0][0] is sre_constants.SUBPATTERN:
        items = list(items[0][1][-1])
    if len(items) == 1 and items[0][0] is sre_constants.BRANCH:
        return [max((r.strip() for r in literal_runs(branch)), key=len) for branch in items[0][1][1]]
    return [longest_literal(regex)]


PLACEHOLDER = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdrfig]|\{[^{}]*\}")
TEMPLATE_MARK = "\x00"  # ends the literal head of a format string: what comes after it is rendered


def string_constants(source: str) -> set[str]:
    """Every string constant of a module; a format string (``%s``, ``{}``, an f-string) also as its
    literal head followed by TEMPLATE_MARK, so a marker that runs into a rendered value
    ("args: Namespace(" from ``"args: %s"``) is found by the head the source prints."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            pieces = PLACEHOLDER.split(node.value)
            out.update(pieces)  # the literal parts of a format string, as printed
            if len(pieces) > 1:
                out.add(pieces[0] + TEMPLATE_MARK)
        elif isinstance(node, ast.JoinedStr) and len(node.values) > 1:  # its parts are Constants too
            first, second = node.values[0], node.values[1]
            if isinstance(first, ast.Constant) and isinstance(second, ast.FormattedValue):
                out.add(str(first.value) + TEMPLATE_MARK)
    return out


def cache_dir() -> Path:
    base = os.environ.get("FP4FORGE_CACHE_DIR") or str(Path.home() / ".cache" / "fp4forge")
    path = Path(base) / "vllm-sdists"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sdist_index() -> dict[str, tuple[str, str]]:
    request = urllib.request.Request(SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    return {f["filename"][len("vllm-"):-len(".tar.gz")]: (f["url"], f["hashes"]["sha256"])
            for f in files if f["filename"].endswith(".tar.gz")}


def sdist_bytes(release: str, index: dict[str, tuple[str, str]] | None) -> tuple[bytes, str]:
    path = cache_dir() / f"vllm-{release}.tar.gz"
    if not path.exists():
        if index is None:
            index = sdist_index()
        with urllib.request.urlopen(index[release][0], timeout=300) as response:
            path.write_bytes(response.read())
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if index is not None and index[release][1] != digest:
        raise SystemExit(f"vllm-{release}.tar.gz: sha256 {digest} is not PyPI's {index[release][1]}")
    return data, digest


def release_constants(data: bytes) -> set[str]:
    constants: set[str] = set()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in archive:
            if member.isfile() and member.name.endswith(".py") and "/vllm/" in member.name and "/tests/" not in member.name:
                handle = archive.extractfile(member)
                if handle is not None:
                    constants |= string_constants(handle.read().decode("utf-8", errors="replace"))
    return constants


def library_constants(venv: Path) -> dict[str, Searchable]:
    site = next((venv / "lib").glob("python3.*/site-packages"), None)
    if site is None:
        raise SystemExit(f"no site-packages under {venv}")
    out: dict[str, Searchable] = {}
    for name in LIBRARIES:
        constants: set[str] = set()
        for path in sorted((site / name).rglob("*.py")):
            constants |= string_constants(path.read_text(encoding="utf-8", errors="replace"))
        out[name] = searchable(constants)
    plugin: set[str] = set()
    for path in sorted(PLUGIN.rglob("*.py")):
        plugin |= string_constants(path.read_text(encoding="utf-8"))
    out["fp4forge-vllm"] = searchable(plugin)
    return out


def table_markers() -> list[tuple[str, str]]:
    """(where, regex) of every line pattern of the start-up table and of the explained lines."""
    table = tomllib.loads(TABLE.read_text(encoding="utf-8"))
    out = [(f"{phase['id']}.{key}", regex) for phase in table["phase"] for key in ("markers", "done") for regex in phase.get(key, [])]
    life = table.get("life", {})
    out += [(f"life.{key}", regex) for key in ("stopping", "failed", "died") for regex in life.get(key, [])]
    patterns = tomllib.loads(PATTERNS.read_text(encoding="utf-8"))["pattern"]
    return out + [(f"pattern.{p['id']}", p["regex"]) for p in patterns]


def printed_overrides() -> dict[str, list[str]]:
    """Patterns whose line is composed from rendered values (a dict's repr, a message built from
    parts): `printed` in doctor_patterns.toml names the text the source holds instead."""
    patterns = tomllib.loads(PATTERNS.read_text(encoding="utf-8"))["pattern"]
    return {f"pattern.{p['id']}": [p["printed"]] for p in patterns if p.get("printed")}


MIN_HEAD = 12  # a shorter printed head ("Using %s") would evidence almost any marker


Searchable = tuple[frozenset[str], str]  # format-string heads, and every other constant joined


def searchable(constants: set[str]) -> Searchable:
    heads = frozenset(c[:-1].strip() for c in constants if c.endswith(TEMPLATE_MARK))
    return heads, "\n".join(c for c in constants if not c.endswith(TEMPLATE_MARK))


def found_in(literal: str, source: Searchable) -> bool:
    """The literal inside a constant, or a format string's printed head that the literal begins with."""
    heads, text = source
    if not literal:
        return False
    prefixes = (literal[:k].strip() for k in range(MIN_HEAD, len(literal) + 1))
    return any(len(p) >= MIN_HEAD and p in heads for p in prefixes) or literal in text


def evidence(releases: dict[str, Searchable], libraries: dict[str, Searchable]) -> list[dict[str, object]]:
    """Per regex: the releases and libraries printing it (any alternative of an alternation)."""
    rows, printed = [], printed_overrides()
    for where, regex in table_markers():
        literals = printed.get(where) or branch_literals(regex)
        rows.append({
            "where": where, "regex": regex, "literals": literals,
            "vllm": [r for r, source in releases.items() if any(found_in(lit, source) for lit in literals)],
            "libraries": [name for name, source in libraries.items() if any(found_in(lit, source) for lit in literals)],
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--releases", nargs="*", default=list(RELEASES))
    parser.add_argument("--libraries", type=Path, default=ROOT / ".venv-vllm", help="the vLLM environment")
    args = parser.parse_args(argv)
    missing = [r for r in args.releases if not (cache_dir() / f"vllm-{r}.tar.gz").exists()]
    index = sdist_index() if missing or args.write else None
    releases, digests = {}, {}
    for release in args.releases:
        data, digests[release] = sdist_bytes(release, index)
        constants = release_constants(data)
        releases[release] = searchable(constants)
        print(f"vllm {release}: {len(constants)} string constants", file=sys.stderr)
    rows = evidence(releases, library_constants(args.libraries))
    doc = {"releases": args.releases, "sdist_sha256": digests, "libraries": [*LIBRARIES, "fp4forge-vllm"], "markers": rows}
    text = json.dumps(doc, indent=1) + "\n"
    if args.write:
        DATA.write_text(text, encoding="utf-8")
    for row in rows:
        seen = row["vllm"] or row["libraries"] or ["-"]
        print(f"{row['where']:<22} {' | '.join(row['literals'])[:44]:<44} {seen[0]}..{seen[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
