"""How much of each notebook teaches in its own cells: the figures that replaced a line cap, and the two checks
tests/notebooks/test_teaching.py runs.

Per notebook it reports the functions the notebook launches on worker processes that come from `helpers` (a
worker should be plain PyTorch the reader sees: defined in the notebook's cells or in `scripts/`), the share of
code lines that are plain torch rather than calls into `helpers`, the markdown word count and the longest code
cell; and it flags the core notebooks (every one but the appendix) that miss a target: no launched function from
`helpers`, at most about 1,500 words of markdown, no code cell over 60 lines.

The same module holds the checks the tests run, in one copy:
- `launched_functions(cells)`: every function a notebook launches (`launch`, `Workers(...).run`, `w.run`,
  `pools[n].run`, `functools.partial` of one, keyword arguments, a runner's body such as
  `launch(run_distributed, body, ...)`, and the script `torchrun` starts), each with where it is defined.
- `helper_arguments(cells)`: every argument of those launches, besides the launched function, that comes from
  `helpers` (what a worker is handed from the measuring machinery), and `unnamed_plumbing(notebook)`, the ones
  the notebook's markdown does not name as plumbing: a worker's central step must be in the cells, and what it is
  handed from helpers must be plumbing that the reader is told is plumbing.
- `unfailable_asserts(cells)`: asserts that cannot fail: an expression compared with itself, fields of one record
  that bound each other by construction (its low, median and high; a part against the min of its wholes), a value
  read back from what was just written (`f(g(x)).a == x.a`), or a length or membership that a constructor
  guarantees (a comprehension's size against what it ran over; a count its maker took from its input).
- `forbidden_text(text)`: wording the project must not carry (references to source material the reader does not
  have, issue numbers, CJK text).

Usage, from the repository root: python tools/teaching_stats.py [--json]
"""
from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SCRIPTS = ROOT / "scripts"
APPENDIX = "11_common_advice_measured"
TARGETS = {"md_words": 1500, "longest_cell": 60, "sentence_words": 40}

LAUNCHERS = {"launch", "run"}                 # helpers.launch(fn, ...), Workers(...).run(fn, ...), pool.run(fn)
FUNCTION_KEYWORDS = ("fn", "function", "body", "target", "worker")
LAUNCH_OPTIONS = ("env", "world_size", "timeout", "threads", "backend", "start_method", "quiet")  # the launcher's
TORCHRUN_CALLS = {"run_torchrun", "start_agent"}

# Written so that this file does not match its own patterns.
FORBIDDEN = {
    "a numbered source article": re.compile(r"\bs[e]ed\s+0\d\d", re.IGNORECASE),
    "the source-article folder": re.compile(r"shared/s[e]eds", re.IGNORECASE),
    "a reference to source articles": re.compile(r"\bthe\s+a[r]ticles\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bi[s]sue\s+#?\d+", re.IGNORECASE),
    "CJK text": re.compile("[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]"),
}
CHECKED_TEXT = ("notebooks/*.ipynb", "scripts/**/*.py", "helpers/**/*.py", "tools/**/*.py", "docs/**/*.md",
                "README.md")


# ------------------------------------------------------------------------------------------ reading notebooks

def code_cells(notebook: dict) -> list[str]:
    """Each code cell's Python: IPython lines (`%`, `!`) left out, a `%%distributed` cell's body kept, a cell that
    writes a file (`%%writefile`) or runs another language left out."""
    out = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        if lines and lines[0].startswith("%%") and not lines[0].startswith("%%distributed"):
            continue
        out.append("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!"))))
    return out


def written_files(notebook: dict) -> set[str]:
    """Names of the files a notebook writes with %%writefile (a script run with torchrun may be one of them)."""
    names = set()
    for cell in notebook["cells"]:
        first = "".join(cell["source"]).split("\n", 1)[0]
        if cell["cell_type"] == "code" and first.startswith("%%writefile"):
            names.add(Path(first.split()[-1]).name)
    return names


def parse(cells: list[str]) -> ast.Module:
    """The cells as one module, in order; a cell that does not parse alone is left out rather than losing all."""
    body = []
    for source in cells:
        try:
            body += ast.parse(source).body
        except SyntaxError:
            continue
    return ast.Module(body=body, type_ignores=[])


# ------------------------------------------------------------------------------------------ where names come from

def script_modules(scripts: Path = SCRIPTS) -> set[str]:
    return {p.stem for p in scripts.glob("*.py")}


def runner_names(scripts: Path = SCRIPTS) -> set[str]:
    """Functions of scripts/ that run a body they are given as first parameter (run_distributed and the like):
    `launch(runner, body, ...)` launches the body too."""
    names = set()
    for path in scripts.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.args.args and node.args.args[0].arg == "body":
                names.add(node.name)
    return names


def module_origin(module: str, scripts: set[str]) -> str:
    top = module.split(".")[0]
    if top == "helpers":
        return "helpers"
    if top == "scripts" or top in scripts:
        return "scripts"
    return f"library {top}"


@dataclass
class Bindings:
    """What each top-level name of a notebook is bound to: a def in its cells, an import, or another name."""
    defined: set = field(default_factory=set)
    imported: dict = field(default_factory=dict)    # name -> module it comes from
    aliases: dict = field(default_factory=dict)     # name -> expression it was assigned


def bindings(tree: ast.Module) -> Bindings:
    b = Bindings()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            b.defined.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                b.imported[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                b.imported[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            b.aliases[node.targets[0].id] = node.value
    return b


def unwrap(expr: ast.expr) -> ast.expr:
    """functools.partial(f, ...) and partial(f, ...) -> f."""
    while isinstance(expr, ast.Call) and _name(expr.func) == "partial" and expr.args:
        expr = expr.args[0]
    return expr


def _name(expr) -> str | None:
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Name):
        return expr.id
    return None


def _root(expr) -> str | None:
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    if isinstance(expr, ast.Subscript):
        return _root(expr.value)
    return expr.id if isinstance(expr, ast.Name) else None


def origin(expr: ast.expr, b: Bindings, scripts: set[str], seen: frozenset = frozenset()) -> str:
    """'notebook', 'scripts', 'helpers', 'library <name>' or 'unknown' for a launched function's expression."""
    expr = unwrap(expr)
    if isinstance(expr, ast.Lambda):
        return "notebook"
    root = _root(expr)
    if root is None or root in seen:
        return "unknown"
    if isinstance(expr, ast.Name) and root in b.defined:
        return "notebook"
    if root in b.imported:
        module = b.imported[root]
        if isinstance(expr, ast.Attribute):  # module.function: the module's own origin
            return module_origin(module, scripts)
        return module_origin(module.rsplit(".", 1)[0] if "." in module else module, scripts)
    if root in b.aliases:
        return origin(b.aliases[root], b, scripts, seen | {root})
    if root in b.defined:
        return "notebook"
    return "unknown"


# ------------------------------------------------------------------------------------------ launches

@dataclass
class Launch:
    function: str   # the expression, as written
    origin: str     # notebook, scripts, helpers, library ..., unknown
    how: str        # launch, run, torchrun


def _launched_args(call: ast.Call) -> list[ast.expr]:
    keywords = [k.value for k in call.keywords if k.arg in FUNCTION_KEYWORDS]
    return ([call.args[0]] if call.args else []) + keywords


def _is_function_reference(expr: ast.expr) -> bool:
    expr = unwrap(expr)
    return isinstance(expr, (ast.Name, ast.Attribute, ast.Lambda))


def launched_functions(cells: list[str], written: set[str] = frozenset(), scripts_dir: Path = SCRIPTS) -> list[Launch]:
    """Every function the cells launch on workers, with where it is defined."""
    tree = parse(cells)
    b, scripts, runners = bindings(tree), script_modules(scripts_dir), runner_names(scripts_dir)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if isinstance(node.func, ast.Name) and name in b.defined:
            continue  # the cells' own function that happens to be called run or launch: a plain call
        if ast.unparse(node.func).startswith(("subprocess.", "asyncio.")):
            continue  # subprocess.run(command): a program started, not a function launched on workers
        if name in LAUNCHERS:
            for arg in _launched_args(node):
                if not _is_function_reference(arg):
                    continue  # subprocess.run([...]), asyncio.run(main()): not a launch of a function
                fn = unwrap(arg)
                found.append(Launch(ast.unparse(fn), origin(fn, b, scripts), name))
                if _name(fn) in runners and len(node.args) > 1 and _is_function_reference(node.args[1]):
                    body = unwrap(node.args[1])
                    found.append(Launch(ast.unparse(body), origin(body, b, scripts), f"{name} (body)"))
        elif name in TORCHRUN_CALLS or (name == "run" and _mentions_torchrun(node)):
            target = node.args[1] if name == "start_agent" and len(node.args) > 1 else (node.args[0] if node.args else None)
            if target is not None:
                found.append(Launch(ast.unparse(target), _script_origin(target, b, written), "torchrun"))
    return found


@dataclass
class HelperArgument:
    function: str   # the launched function, as written
    argument: str   # the argument from helpers, as written
    name: str = ""  # the helper's own name, as the notebook's markdown names it (`partial(helper, ...)`: helper)


def helper_arguments(cells: list[str], scripts_dir: Path = SCRIPTS) -> list[HelperArgument]:
    """Each argument of a launch (besides the launched function, and a runner's body) that comes from `helpers`."""
    tree = parse(cells)
    b, scripts, runners = bindings(tree), script_modules(scripts_dir), runner_names(scripts_dir)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or _name(node.func) not in LAUNCHERS or not node.args:
            continue
        if isinstance(node.func, ast.Name) and node.func.id in b.defined:
            continue
        fn = unwrap(node.args[0])
        if not _is_function_reference(fn):
            continue
        skip = 2 if _name(fn) in runners and len(node.args) > 1 else 1
        launched = ast.unparse(unwrap(node.args[skip - 1]))
        handed = list(node.args[skip:]) + [k.value for k in node.keywords
                                           if k.arg not in FUNCTION_KEYWORDS + LAUNCH_OPTIONS]
        if isinstance(node.args[0], ast.Call):  # functools.partial(fn, arguments...)
            handed += list(node.args[0].args[1:]) + [k.value for k in node.args[0].keywords]
        for arg in handed:
            if _is_function_reference(arg) and origin(arg, b, scripts) == "helpers":
                found.append(HelperArgument(launched, ast.unparse(arg), _name(unwrap(arg)) or ast.unparse(arg)))
    return found


def named_as_plumbing(notebook: dict) -> str:
    """The markdown of the cells that call something plumbing: where a notebook names what it is handed."""
    return "\n".join("".join(c["source"]) for c in notebook["cells"]
                     if c["cell_type"] == "markdown" and re.search(r"\bplumbing\b", "".join(c["source"]), re.I))


def unnamed_plumbing(notebook: dict, scripts_dir: Path = SCRIPTS) -> list[str]:
    """'function: argument' for each helper argument whose name no markdown cell that speaks of plumbing mentions."""
    text = named_as_plumbing(notebook)
    return sorted({f"{a.function}: {a.argument}" for a in helper_arguments(code_cells(notebook), scripts_dir)
                   if not re.search(rf"\b{re.escape(a.name or a.argument.split('.')[-1])}\b", text)})


# ------------------------------------------------------------------------------------------ asserts

STATISTIC_KEYS = {"low", "median", "high", "min", "max", "q1", "q3", "lo", "hi"}


def _record_field(expr: ast.expr) -> tuple[str, str] | None:
    """(the record, the key) for `record["key"]`, else None."""
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and isinstance(expr.slice.value, str):
        return ast.unparse(expr.value), expr.slice.value
    return None


def _unfailable(test: ast.expr) -> str | None:
    for node in ast.walk(test):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for a, b in zip(operands, operands[1:]):
            if ast.dump(a) == ast.dump(b):
                return f"compares {ast.unparse(a)} with itself"
        fields = [_record_field(o) for o in operands]
        if len(operands) >= 3 and all(fields) and len({r for r, _ in fields}) == 1 and \
                {k for _, k in fields} <= STATISTIC_KEYS:
            return f"orders {fields[0][0]}'s own statistics, which its maker ordered"
        for a, b in zip(operands, operands[1:]):
            for part, whole in ((a, b), (b, a)):
                if isinstance(whole, ast.Call) and _name(whole.func) in ("min", "max") and _record_field(part) and \
                        all(_record_field(x) and _record_field(x)[0] == _record_field(part)[0] for x in whole.args):
                    return f"bounds {ast.unparse(part)} by {ast.unparse(whole)}, fields of the record that made it"
    return None


EQUALITY_CALLS = {"equal", "allclose", "isclose", "array_equal", "assert_close"}   # torch.equal(a, b) and the like
COUNT_KEYS = {"n", "count", "length", "len", "size"}   # a record's field that counts something


def _chain(expr: ast.expr) -> tuple[ast.expr, tuple]:
    """`x.a["b"]` -> (x, ('a', <dump of "b">)): the expression under a trailing chain of attributes and subscripts."""
    chain = []
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        chain.append(expr.attr if isinstance(expr, ast.Attribute) else ast.dump(expr.slice))
        expr = expr.value
    return expr, tuple(reversed(chain))


def _read_back(a: ast.expr, b: ast.expr) -> str | None:
    """`f(g(x)).attr` against `x.attr` (or `f(..., g(..., x, ...)[i], ...)` against `x`): what the writer g just
    wrote, read back by f. Calls by plain name only, the project's own pair (a library's, `json.loads(json.dumps(x))`
    or a tokenizer's decode of its encode, states a property of that library)."""
    outer, suffix = _chain(a)
    other, other_suffix = _chain(b)
    if not (isinstance(outer, ast.Call) and isinstance(outer.func, ast.Name)) or suffix != other_suffix:
        return None
    for arg in outer.args:
        inner, _ = _chain(arg)
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and \
                any(ast.dump(x) == ast.dump(other) for x in inner.args):
            return f"reads back through {outer.func.id} what {inner.func.id} just wrote from {ast.unparse(other)}"
    return None


def _comprehension(value: ast.expr | None) -> ast.comprehension | None:
    """The one unfiltered `for` of a comprehension (`list(...)` of one included), else None."""
    if isinstance(value, ast.Call) and _name(value.func) in ("list", "set", "dict", "tuple") and len(value.args) == 1:
        value = value.args[0]
    if isinstance(value, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) and len(value.generators) == 1 \
            and not value.generators[0].ifs:
        return value.generators[0]
    return None


def _len_of(expr: ast.expr) -> ast.expr | None:
    return expr.args[0] if isinstance(expr, ast.Call) and _name(expr.func) == "len" and len(expr.args) == 1 else None


def _same(a: ast.expr, b: ast.expr) -> bool:
    return ast.dump(a) == ast.dump(b)


def _by_construction(a: ast.expr, b: ast.expr, assigned: dict) -> str | None:
    """A length or membership that what made it guarantees: len(A) against len(B) or N where A is a comprehension
    over B or range(N); set(A) (sorted(A)) against set(B) where A is {k: ... for k in B}; record[count] against
    len(X) (give or take a constant) where the record was made by a call handed X."""
    sized = _len_of(a)
    if isinstance(sized, ast.Name) and (loop := _comprehension(assigned.get(sized.id))) is not None:
        over, other = loop.iter, _len_of(b)
        if (other is not None and _same(over, other)) or (isinstance(over, ast.Call) and _name(over.func) == "range"
                                                          and len(over.args) == 1 and _same(over.args[0], b)):
            return f"len({sized.id}) is what the comprehension that made it ran over"
    if isinstance(a, ast.Call) and isinstance(b, ast.Call) and _name(a.func) == _name(b.func) in ("set", "sorted") \
            and len(a.args) == len(b.args) == 1 and isinstance(a.args[0], ast.Name):
        made = assigned.get(a.args[0].id)
        loop = _comprehension(made)
        key = made.key if isinstance(made, ast.DictComp) else getattr(made, "elt", None)
        if loop is not None and _same(loop.iter, b.args[0]) and isinstance(key, ast.Name) and \
                isinstance(loop.target, ast.Name) and key.id == loop.target.id:
            return f"{a.args[0].id}'s keys are what the comprehension that made it ran over"
    field_of = _record_field(a)
    count = b.left if isinstance(b, ast.BinOp) and isinstance(b.right, ast.Constant) else b
    counted = _len_of(count)
    if field_of and field_of[1] in COUNT_KEYS and counted is not None and _root(counted) is not None:
        maker = assigned.get(field_of[0])
        if isinstance(maker, ast.Call) and _root(counted) in {_root(x) for x in maker.args}:
            return f"{ast.unparse(a)} is a count its maker took from {ast.unparse(counted)}"
    return None


def _held_by_construction(test: ast.expr, assigned: dict) -> str | None:
    for node in ast.walk(test):
        pairs = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            pairs = [(a, b) for op, a, b in zip(node.ops, operands, operands[1:]) if isinstance(op, (ast.Eq, ast.Is))]
        elif isinstance(node, ast.Call) and _name(node.func) in EQUALITY_CALLS and len(node.args) >= 2:
            pairs = [tuple(node.args[:2])]
        for a, b in pairs:
            for x, y in ((a, b), (b, a)):
                if why := _read_back(x, y) or _by_construction(x, y, assigned):
                    return why
    return None


def unfailable_asserts(cells: list[str]) -> list[str]:
    """'<the assert>: <why it cannot fail>' for each assert in the cells that holds by construction. The cells are
    read in order, so an assert is judged against what its names were last assigned (a comprehension, a call)."""
    found, assigned = [], {}

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned[target.id] = node.value
                elif isinstance(target, ast.Tuple):   # a, b = ...: each name now holds something unknown
                    assigned.update({t.id: None for t in target.elts if isinstance(t, ast.Name)})
        if isinstance(node, ast.Assert) and (why := _unfailable(node.test) or
                                             _held_by_construction(node.test, assigned)):
            found.append(f"{ast.unparse(node.test)[:100]}: {why}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(parse(cells))
    return found


def _mentions_torchrun(call: ast.Call) -> bool:
    return bool(call.args) and "torchrun" in ast.unparse(call.args[0])


def _script_origin(target: ast.expr, b: Bindings, written: set[str], depth: int = 0) -> str:
    """Where a script run with torchrun lives: scripts/, a file the notebook wrote, or helpers (a module run with
    -m, or a path into the package). A name is followed to what it was assigned."""
    if isinstance(target, ast.Name) and target.id in b.aliases and depth < 5:
        return _script_origin(b.aliases[target.id], b, written, depth + 1)
    text = ast.unparse(target)
    if re.search(r"\bSCRIPTS\b|scripts/|\bscripts\b", text):
        return "scripts"
    if "helpers" in text:
        return "helpers"
    if any(name in text for name in written):
        return "notebook"
    return "unknown"


def launch_problems(launches: list[Launch]) -> list[Launch]:
    """Launches of a function defined in helpers, or of one whose definition cannot be found in the notebook's
    cells, scripts/ or a library (torch, the standard library)."""
    return [launch for launch in launches if launch.origin in ("helpers", "unknown")]


# ------------------------------------------------------------------------------------------ wording

def forbidden_text(text: str) -> list[str]:
    """'<what>: <the match>' for each forbidden phrase in `text`."""
    return [f"{what}: {m.group(0)!r}" for what, pattern in FORBIDDEN.items() for m in pattern.finditer(text)]


def checked_text(path: Path) -> str:
    """A notebook's cell sources (not outputs); any other file whole."""
    if path.suffix == ".ipynb":
        return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    return path.read_text(errors="replace")


def forbidden_in_project(root: Path = ROOT) -> dict[str, list[str]]:
    """{relative path: findings} over the notebooks, scripts, helpers, tools, docs and README."""
    out = {}
    for pattern in CHECKED_TEXT:
        for path in sorted(root.glob(pattern)):
            found = forbidden_text(checked_text(path))
            if found:
                out[str(path.relative_to(root))] = found
    return out


# ------------------------------------------------------------------------------------------ sentences

_FENCE = re.compile(r"```.*?```", re.DOTALL)
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")           # [text](target): the reader reads the text
# A sentence ends at . ! or ? (a closing bracket, quote or emphasis may follow) before a space and a letter, a digit,
# a backquote, a bracket, a quote or emphasis; "e.g.", "i.e.", "al." ("et al. 2019"), "vs." and "cf." do not end one.
_END = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<!\bal\.)(?<!vs\.)(?<!cf\.)"
                  r"(?:(?<=[.!?])|(?<=[.!?][)\"])|(?<=[.!?]\*\*))\s+(?=[A-Za-z0-9`(\"*])")


def sentences(markdown: str) -> list[str]:
    """The sentences a reader meets in a markdown cell: fenced code left out, a link read as its text, a line that
    opens a heading, an item or a table row taken alone, the rest joined across line breaks and cut at each end of
    a sentence."""
    text = _LINK.sub(r"\1", _FENCE.sub(" ", markdown))
    blocks, current = [], []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):                   # a heading: alone
            blocks += [" ".join(current), stripped]
            current = []
        elif not stripped or re.match(r"([-*+]\s|\d+\.\s|\|)", stripped):
            blocks.append(" ".join(current))
            current = [stripped] if stripped else []
        else:
            current.append(stripped)
    blocks.append(" ".join(current))
    return [s.strip() for block in blocks for s in _END.split(block) if s.strip()]


def long_sentences(notebook: dict, limit: int = TARGETS["sentence_words"]) -> list[str]:
    """The markdown sentences of `notebook` over `limit` words (a learner reads a sentence once: past about 40
    words the start is gone by its end), each as '<words> words: <its first words> ...'."""
    found = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for sentence in sentences("".join(cell["source"])):
            words = sentence.split()
            if len(words) > limit and not sentence.startswith("|"):
                found.append(f"{len(words)} words: {' '.join(words[:12])} ...")
    return found


# ------------------------------------------------------------------------------------------ figures

def notebook_stats(path: Path) -> dict:
    notebook = json.loads(path.read_text())
    cells = code_cells(notebook)
    tree = parse(cells)
    b = bindings(tree)
    helper_names = {name for name, module in b.imported.items() if module.split(".")[0] == "helpers"}
    lines = [line for source in cells for line in source.splitlines()
             if line.strip() and not line.strip().startswith("#") and not re.match(r"\s*(from|import)\s", line)]
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(helper_names))) + r")\b") if helper_names else None
    helper_lines = [line for line in lines if pattern and pattern.search(line)]
    markdown = " ".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    launches = launched_functions(cells, written_files(notebook))
    return {"notebook": path.stem, "core": path.stem != APPENDIX,
            "helper_launches": sorted({launch.function for launch in launches if launch.origin == "helpers"}),
            "other_launches": sorted({f"{launch.function} ({launch.origin})" for launch in launch_problems(launches)
                                      if launch.origin != "helpers"}),
            "unnamed_plumbing": unnamed_plumbing(notebook), "unfailable_asserts": unfailable_asserts(cells),
            "plain_share": round(1 - len(helper_lines) / max(1, len(lines)), 3), "code_lines": len(lines),
            "md_words": len(markdown.split()), "long_sentences": long_sentences(notebook),
            "longest_cell": max((len([line for line in c.splitlines() if line.strip()]) for c in cells), default=0)}


def missed_targets(row: dict) -> list[str]:
    """What a core notebook misses of the targets (the appendix has none; the planner, 10, keeps to short
    sentences too)."""
    if not row["core"]:
        return []
    missed = []
    if row["helper_launches"]:
        missed.append(f"launches {len(row['helper_launches'])} function(s) from helpers")
    if row.get("unnamed_plumbing"):
        missed.append(f"hands {len(row['unnamed_plumbing'])} helper(s) to workers without naming them as plumbing")
    if row.get("unfailable_asserts"):
        missed.append(f"{len(row['unfailable_asserts'])} assert(s) that cannot fail")
    if row["md_words"] > TARGETS["md_words"]:
        missed.append(f"{row['md_words']} words of markdown (target {TARGETS['md_words']})")
    if row.get("long_sentences"):
        missed.append(f"{len(row['long_sentences'])} sentence(s) over {TARGETS['sentence_words']} words")
    if row["longest_cell"] > TARGETS["longest_cell"]:
        missed.append(f"a {row['longest_cell']}-line cell (target {TARGETS['longest_cell']})")
    return missed


def main(argv: list[str]) -> int:
    rows = [notebook_stats(p) for p in sorted(NOTEBOOKS.glob("*.ipynb"))]
    for row in rows:
        row["missed"] = missed_targets(row)
    if "--json" in argv:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'notebook':<36} {'plain':>5} {'code':>5} {'md words':>8} {'longest':>7}  launched from helpers")
    for r in rows:
        print(f"{r['notebook'][:36]:<36} {r['plain_share']:5.2f} {r['code_lines']:5} {r['md_words']:8} "
              f"{r['longest_cell']:7}  {len(r['helper_launches'])} {', '.join(r['helper_launches'])}")
    print("\ncore notebooks that miss a target (no launched helper function, <= "
          f"{TARGETS['md_words']} markdown words, no cell over {TARGETS['longest_cell']} lines):")
    missing = [r for r in rows if r["missed"]]
    for r in missing:
        print(f"  {r['notebook']}: {'; '.join(r['missed'])}")
    if not missing:
        print("  none")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
