"""Check that every figure the docs cite equals its record under docs/results/.

    python -m scripts.check_figures [--root DIR]

Scanned: README.md, docs/*.md and the comments of config.toml. A doc names the record beside its figures for the
reader, and maps each figure to the record in an HTML comment (invisible when the Markdown is rendered) right after
the paragraph or table that shows them:

    | batch | `plain` tokens/s |
    | 1 | 43 |
    <!-- figures bench_engine_demo_batch_cpu.json
    43 = where(results, batch=1).runs.plain.tok_s
    -->

Each line of a block is ``FIGURE = EXPRESSION``: FIGURE exactly as the doc shows it (``1,489``, ``0.95x``, ``35%``,
``~7,900``), EXPRESSION a Python expression over the record:
- ``a.b`` is a key, ``a["lossless-10%"]`` a key with other characters, ``record["sent-list"]`` such a key at the top;
- ``rows.wall_s`` on a list is the list of each row's ``wall_s``; ``memory[1024]`` reads the key "1024";
- functions: sum, mean, min, max, len, abs, round, ``where(rows, key=value)`` (the first row with those values),
  ``having(rows, key)`` (the rows that have the key);
- ``NAME := EXPRESSION`` names a part of the record for the lines below it;
- a ``.txt`` record is a training log: ``events["LABEL"]`` lists the JSON objects of its lines
  ``[  12.3s] LABEL {...}`` in order.
Figures are rounded half up from the record's value as written in the JSON (0.0895 shows as 0.090).

Checked, each failure printed with its file and line:
- every record a doc or a block names exists under docs/results/, and a block's record is named in the visible text
  of its section;
- every FIGURE appears as a number in the text the block follows (from the previous block or heading to the block;
  blocks one right after another share that text), as often as lines map it, so a number edited in the doc fails;
- EXPRESSION rounded at the precision FIGURE shows equals FIGURE (``~``: at its significant digits), so a record
  measured again fails until the doc follows;
- a record's ``weights_sha256`` (a repository path -> SHA-256 of each weights file it measured) equals the files in
  the repository, so a model trained again fails until its figures are measured again.

Exit status 0 when everything holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

RESULTS = Path("docs/results")
BLOCK = re.compile(r"<!--\s*figures\s+(\S+)\s*\n(.*?)-->", re.S)
HEADING = re.compile(r"^#{1,6} ", re.M)
# A record named in visible text: a file under docs/results/, or a bare name of the records' kinds.
RECORD_NAME = re.compile(
    r"(?:docs/results/([\w.+-]+\.(?:json|txt)))|"
    r"(?<![\w/.-])((?:bench|eval|train|drafter|gpu_check|grades)_[\w.+-]*\.(?:json|txt))"
)
LOG_LINE = re.compile(r"^(?:\[\s*[\d.]+s\]\s*)?([^{]+?)\s*(\{.*\})\s*$")
FIGURE = re.compile(r"^(~?)(-?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(.*)$")


@dataclass
class Problem:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def doc_texts(root: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every scanned doc; config.toml contributes its comments only (same line numbers)."""
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    out = [(str(p.relative_to(root)), p.read_text(encoding="utf-8")) for p in paths if p.is_file()]
    config = root / "config.toml"
    if config.is_file():
        lines = config.read_text(encoding="utf-8").splitlines()
        out.append(("config.toml", "\n".join(re.sub(r"^[^#]*#\s?", "", ln) if "#" in ln else "" for ln in lines)))
    return out


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def mean(values):
    values = list(values)
    return sum(values) / len(values)


def where(rows, **match):
    """The first element of ``rows`` whose keys equal ``match``."""
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    raise KeyError(f"no element with {match}")


def having(rows, key):
    """The elements of ``rows`` that have ``key``."""
    return [row for row in rows if key in row]


FUNCTIONS = {"having": having, "sum": sum, "mean": mean, "min": min, "max": max, "len": len, "abs": abs,
             "round": round, "where": where}
OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
             ast.Div: lambda a, b: a / b, ast.USub: lambda a: -a}


def evaluate(expr: str, record, names: dict):
    """EXPRESSION of a figures line, over the record (a small safe subset of Python: no attribute of Python objects)."""

    def key(value, k):
        if isinstance(value, list) and isinstance(k, str):
            return [key(v, k) for v in value]
        if isinstance(value, dict) and isinstance(k, (int, float)) and not isinstance(k, bool):
            k = str(k)  # JSON keys are strings: memory[1024] reads memory["1024"]
        return value[k]

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in names:
                return names[node.id]
            if node.id == "record":
                return record
            if isinstance(record, dict) and node.id in record:
                return record[node.id]
            raise KeyError(node.id)
        if isinstance(node, ast.Attribute):
            return key(ev(node.value), node.attr)
        if isinstance(node, ast.Subscript):
            return key(ev(node.value), ev(node.slice))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
            return FUNCTIONS[node.func.id](*[ev(a) for a in node.args], **{k.arg: ev(k.value) for k in node.keywords})
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.GeneratorExp) or isinstance(node, ast.ListComp):
            raise ValueError("comprehensions are not supported: map a list with `rows.key`")
        raise ValueError(f"not supported: {ast.dump(node)[:60]}")

    return ev(ast.parse(expr.strip(), mode="eval"))


def matches(figure: str, value) -> bool:
    """Whether ``value`` shown at ``figure``'s precision is ``figure``."""
    m = FIGURE.match(figure.strip())
    if m is None:
        raise ValueError(f"{figure!r} is not a number")
    approx, sign, whole, frac, _ = m.groups()
    shown = Decimal(sign + whole.replace(",", "") + (frac or ""))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the record gives {value!r}, not a number")
    exact = Decimal(repr(value))
    if approx and not frac:
        digits = whole.replace(",", "")
        zeros = len(digits) - len(digits.rstrip("0")) if digits.strip("0") else 0
        step = Decimal(10) ** zeros
        return (exact / step).quantize(Decimal(1), ROUND_HALF_UP) * step == shown
    return exact.quantize(Decimal(1).scaleb(-(len(frac) - 1 if frac else 0)), ROUND_HALF_UP) == shown


def shown_count(figure: str, text: str) -> int:
    """How often ``figure`` appears in ``text`` as a whole number (not inside a longer one)."""
    return len(re.findall(r"(?<![\w.,])(?<![A-Za-z%]-)" + re.escape(figure) + r"(?![\d]|[.,]\d)", text))


@functools.lru_cache(maxsize=None)
def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def log_events(text: str) -> dict[str, list]:
    """A training log's lines ``[  12.3s] LABEL {json}`` (or ``LABEL {json}``) as {LABEL: [each line's JSON]}."""
    events: dict[str, list] = {}
    for line in text.splitlines():
        m = LOG_LINE.match(line)
        if m:
            try:
                events.setdefault(m.group(1), []).append(json.loads(m.group(2)))
            except ValueError:
                continue
    return events


def check_record(root: Path, name: str, checked: dict) -> list[str]:
    """Problems of one record file itself (it exists, is JSON when named .json, its weights are the repository's)."""
    if name in checked:
        return checked[name][1]
    path = root / RESULTS / name
    problems, record = [], None
    if not path.is_file():
        problems.append(f"record {RESULTS / name} does not exist")
    elif name.endswith(".json"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            problems.append(f"record {name} is not JSON: {e}")
        else:
            for weights, digest in (record.get("weights_sha256") or {}).items() if isinstance(record, dict) else ():
                file = root / weights
                if not file.is_file():
                    problems.append(f"record {name} measured {weights}, which is not in the repository")
                elif sha256(file) != digest:
                    problems.append(f"record {name} measured other weights than {weights} holds now")
    elif name.endswith(".txt"):
        record = {"events": log_events(path.read_text(encoding="utf-8"))}
    checked[name] = (record, problems)
    return problems


def check_doc(root: Path, rel: str, text: str, checked: dict) -> list[Problem]:
    problems: list[Problem] = []
    visible = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in RECORD_NAME.finditer(visible):
        name = m.group(1) or m.group(2)
        for what in check_record(root, name, checked):
            problems.append(Problem(rel, line_of(text, m.start()), what))
    headings = [h.start() for h in HEADING.finditer(text)]
    previous_end = shown_start = 0
    mapped: dict[str, int] = {}
    for block in BLOCK.finditer(text):
        name, body = block.group(1), block.group(2)
        start_line = line_of(text, block.start())
        section_start = max([0] + [h for h in headings if h < block.start()])
        if previous_end and previous_end > section_start and not text[previous_end:block.start()].strip():
            span_start = shown_start  # blocks one after another annotate the same text
        else:
            span_start = max(previous_end, section_start)
            mapped = {}  # figure -> lines mapping it, over the blocks that share this text
        shown_start = span_start
        shown = BLOCK.sub(" ", text[span_start:block.start()])
        next_heading = min([h for h in headings if h > block.start()] + [len(text)])
        section = BLOCK.sub(" ", text[section_start:next_heading])
        previous_end = block.end()
        for what in check_record(root, name, checked):
            problems.append(Problem(rel, start_line, what))
        record = checked[name][0]
        if record is None:
            continue
        if name not in section:
            problems.append(Problem(rel, start_line, f"{name} is not named in the text of its section"))
        names: dict = {}
        for offset, raw in enumerate(body.splitlines(), start=1):
            line = raw.strip()
            if not line:
                continue
            at = start_line + offset
            try:
                if ":=" in line:
                    var, expr = (s.strip() for s in line.split(":=", 1))
                    names[var] = evaluate(expr, record, names)
                    continue
                if "=" not in line:
                    raise ValueError("expected FIGURE = EXPRESSION")
                figure, expr = (s.strip() for s in line.split("=", 1))
                mapped[figure] = mapped.get(figure, 0) + 1
                if shown_count(figure, shown) < mapped[figure]:
                    times = "" if mapped[figure] == 1 else f" {mapped[figure]} times"
                    problems.append(Problem(rel, at, f"{figure} is not in the text above the block{times}"))
                    continue
                value = evaluate(expr, record, names)
                if not matches(figure, value):
                    problems.append(Problem(rel, at, f"{figure} shown, {name} gives {value!r} ({expr})"))
            except (KeyError, IndexError, TypeError, ValueError, SyntaxError, ZeroDivisionError) as e:
                problems.append(Problem(rel, at, f"{line!r}: {type(e).__name__}: {e}"))
    return problems


def check(root: Path) -> list[Problem]:
    checked: dict = {}
    problems: list[Problem] = []
    for rel, text in doc_texts(root):
        problems += check_doc(root, rel, text, checked)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    problems = check(args.root)
    for p in problems:
        print(p)
    count = sum(len(BLOCK.findall(text)) for _, text in doc_texts(args.root))
    print(f"figures: {count} blocks, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
