"""The course goes forward only, for the modules a notebook imports and for the programs it runs.

A learner reads the notebooks in order. What a cell uses must be code they have already seen: a module of
`scripts/` (each written by the notebook whose cells are tagged `script:NAME.py` or `script:train/NAME.py`), or a
program of `scripts/` started from a cell. Three rules, one line per violation:

- imports go forward only: a cell imports no module that only a later notebook writes (`import model`,
  `from tp import apply_tp`, inside a function too, and `importlib.import_module("tp")` with a literal name);
- each exported file has one writing notebook;
- programs go forward only: a cell that runs a script of `scripts/` runs one written by its own notebook or an earlier
  one, and every module that script imports, followed from module to module through their cells, is written by
  that notebook or an earlier one too. A cell runs a script when a launcher is handed a path naming a file of
  `scripts/`: `run_torchrun` and `start_agent` (helpers.cluster), `subprocess.*`, `os.system`, `os.exec*`,
  `runpy.run_path`, a function of the notebook's own cells that calls one of these, or a `!python`/`!torchrun`/`%run`
  line. A path is a string (`"../scripts/x.py"`), `SCRIPTS / "train" / "train.py"` (with `helpers.paths.SCRIPTS`
  or any folder joined with "scripts"), or a name the notebook assigned one of these to.

It reads only the notebooks' cells, so a notebook planted in another folder is checked the same way
(tests/notebooks/test_course_order.py). Usage, from the repository root:
    python -m tools.course_order [NOTEBOOK_FOLDER]      (./cookbook order)
exit status 0 with one summary line, 1 with one line per violation, 2 for a folder that holds no notebook.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

SCRIPT_TAG = re.compile(r"script:((?:[\w-]+/)*[\w-]+\.py)$")
SCRIPT_PATH = re.compile(r"(?:^|[\s/'\"=])scripts/((?:[\w.-]+/)*[\w-]+\.py)\b")   # in a string or a ! line
LAUNCHER_NAMES = {"run_torchrun", "start_agent", "run_path", "system", "popen"}
LAUNCHER_MODULES = ("subprocess.", "asyncio.create_subprocess")
LAUNCHER_PREFIXES = ("os.exec", "os.spawn", "os.posix_spawn")


@dataclass(frozen=True)
class Cell:
    notebook: str   # file name, e.g. 06_checkpointing_and_fault_tolerance.ipynb
    index: int      # position among the notebook's cells
    id: str
    source: str
    writes: str | None = None   # the file of scripts/ its tag exports it to ("train/model.py"), if any

    def where(self) -> str:
        return f"{self.notebook} cell {self.index} ({self.id})"


@dataclass
class Course:
    """The notebooks in reading order, their code cells, and who writes which file of scripts/."""
    order: dict[str, int]                            # notebook -> position in the course
    cells: list[Cell]
    writers: dict[str, list[str]] = field(default_factory=dict)   # "train/model.py" -> notebooks that tag cells so

    def writer(self, script: str) -> str | None:
        """The first notebook that writes `script` (a path under scripts/), or None."""
        ws = self.writers.get(script)
        return min(ws, key=self.order.get) if ws else None

    def ahead(self, script: str, notebook: str) -> str | None:
        """The notebook that writes `script` when it comes after `notebook`, else None."""
        w = self.writer(script)
        return w if w is not None and self.order[w] > self.order[notebook] else None


def read_course(folder: Path = NOTEBOOKS) -> Course:
    paths = sorted(folder.glob("*.ipynb"))
    course = Course({p.name: i for i, p in enumerate(paths)}, [])
    for path in paths:
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            tags = cell.get("metadata", {}).get("tags", [])
            writes = next((m[1] for t in tags if (m := SCRIPT_TAG.match(t))), None)
            course.cells.append(Cell(path.name, index, cell.get("id", "?"), "".join(cell["source"]), writes))
            if writes and path.name not in course.writers.setdefault(writes, []):
                course.writers[writes].append(path.name)
    return course


# ------------------------------------------------------------------------------------------ reading a cell

def python_tree(source: str) -> ast.Module | None:
    """The cell's Python (IPython's `%` and `!` lines left out, a `%%distributed` cell's body kept); None for another
    cell magic or a cell that does not parse."""
    if source.lstrip().startswith("%%") and not source.lstrip().startswith("%%distributed"):
        return None
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def imported_modules(tree: ast.Module) -> set[str]:
    """The top-level names of every module the code imports, wherever the import stands, and the literal names
    handed to importlib.import_module or __import__ (a dynamic import is an import too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and _dotted(node.func).endswith(("import_module", "__import__")) and \
                node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.add(node.args[0].value.split(".")[0])
    return found


def _dotted(expr: ast.expr) -> str:
    """`os.path.join` for the expression os.path.join; '' for anything but names and attributes."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value)
        return f"{inner}.{expr.attr}" if inner else expr.attr
    return ""


def assignments(trees: list[ast.Module]) -> dict[str, ast.expr]:
    """name -> the expression last assigned to it at the top of any cell (`RECIPE = SCRIPTS / "train" / ...`)."""
    bound = {}
    for tree in trees:
        for node in tree.body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        bound[target.id] = node.value
    return bound


def script_path(expr: ast.expr, bound: dict[str, ast.expr], depth: int = 0) -> str | None:
    """The path under scripts/ that `expr` names ("" for the scripts folder itself), or None. Follows names the
    notebook assigned, `/` joins, `str(...)` and `Path(...)`."""
    if depth > 8:
        return None
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        text = expr.value.replace("\\", "/")
        m = SCRIPT_PATH.search(" " + text)
        if m:
            return m[1]
        return "" if re.fullmatch(r"(?:.*/)?scripts/?", text) else None
    if isinstance(expr, (ast.Name, ast.Attribute)):
        if _dotted(expr).split(".")[-1] == "SCRIPTS":
            return ""
        if isinstance(expr, ast.Name) and expr.id in bound:
            return script_path(bound[expr.id], bound, depth + 1)
        return None
    if isinstance(expr, ast.Call) and _dotted(expr.func).split(".")[-1] in ("str", "Path", "PurePath", "fspath") \
            and expr.args:
        return script_path(expr.args[0], bound, depth + 1)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Div):
        left = script_path(expr.left, bound, depth + 1)
        right = expr.right.value if isinstance(expr.right, ast.Constant) and isinstance(expr.right.value, str) \
            else None
        if left is None:
            return "" if right is not None and right.rstrip("/").split("/")[-1] == "scripts" else None
        if right is None:
            return None
        return str(PurePosixPath(left, right)) if left else right.strip("/")
    return None


def _is_launcher(call: ast.Call, own: set[str]) -> bool:
    """A launcher of helpers or the standard library, or a function of the cells (called by its bare name) that
    calls one."""
    name = _dotted(call.func)
    return name.split(".")[-1] in LAUNCHER_NAMES or name.startswith(LAUNCHER_MODULES + LAUNCHER_PREFIXES) or \
        (isinstance(call.func, ast.Name) and name in own)


def _handed(call: ast.Call):
    """Every expression a call is handed, the items of a list or tuple argument included."""
    for arg in [*call.args, *(k.value for k in call.keywords)]:
        inner = arg.value if isinstance(arg, ast.Starred) else arg
        yield from (inner.elts if isinstance(inner, (ast.List, ast.Tuple)) else [inner])


def own_launchers(trees: list[ast.Module]) -> set[str]:
    """Functions defined in the notebook's cells that call a launcher (or one of these), found to a fixed point:
    `def run_recipe(*flags): return run_torchrun(RECIPE, *flags)` runs a program as surely as its body does."""
    defs = {node.name: node for tree in trees for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own: set[str] = set()
    while True:
        more = {name for name, node in defs.items() if name not in own and any(
            isinstance(n, ast.Call) and _is_launcher(n, own) for n in ast.walk(node))}
        if not more:
            return own
        own |= more


def programs_run(source: str, tree: ast.Module | None, bound: dict[str, ast.expr], own: set[str]) -> set[str]:
    """The files of scripts/ the cell runs: paths handed to a launcher, and those a `!` or `%run` line names."""
    found = {m[1] for line in source.splitlines() if line.lstrip().startswith(("!", "%run"))
             for m in SCRIPT_PATH.finditer(line)}
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Call) and _is_launcher(node, own):
            found.update(p for arg in _handed(node) if (p := script_path(arg, bound)) and p.endswith(".py"))
    return found


# ------------------------------------------------------------------------------------------ the three rules

def module_files(course: Course) -> dict[str, list[str]]:
    """module name -> the exported files of that name ("model" -> ["train/model.py"])."""
    out: dict[str, list[str]] = {}
    for script in course.writers:
        out.setdefault(PurePosixPath(script).stem, []).append(script)
    return out


def resolve(module: str, importer: str | None, files: dict[str, list[str]]) -> str | None:
    """The exported file an import of `module` means: the one in the importing script's folder where there is
    one (the scripts put their own folder on the path first), else the only one of that name."""
    candidates = files.get(module, [])
    if importer is not None:
        beside = [f for f in candidates if PurePosixPath(f).parent == PurePosixPath(importer).parent]
        if beside:
            return beside[0]
    return candidates[0] if len(candidates) == 1 else None


def script_imports(course: Course, trees: dict[Cell, ast.Module | None]) -> dict[str, set[str]]:
    """exported file -> the exported files its cells import."""
    files, out = module_files(course), {}
    for cell, tree in trees.items():
        if cell.writes and tree is not None:
            out.setdefault(cell.writes, set()).update(
                f for m in imported_modules(tree) if (f := resolve(m, cell.writes, files)) and f != cell.writes)
    return out


def closure(script: str, imports: dict[str, set[str]]) -> set[str]:
    """`script` and every exported file it imports, directly or through another."""
    seen, todo = set(), [script]
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(imports.get(f, ()))
    return seen


def program_ahead(course: Course, script: str, notebook: str, imports: dict[str, set[str]]) -> str | None:
    """What reaches ahead of `notebook` when it runs `script` (the script itself, the modules it imports), said in
    a few words; None when nothing does."""
    short = lambda nb: nb.split("_")[0]  # noqa: E731  (06_checkpointing_and_fault_tolerance.ipynb -> 06)
    late = sorted((course.order[w], f"{f} ({short(w)})") for f in closure(script, imports) - {script}
                  if (w := course.ahead(f, notebook)))
    modules = ", ".join(name for _, name in late)
    if w := course.ahead(script, notebook):
        return f"{script}, which {w} writes" + (f"; it imports {modules}" if late else "")
    return f"{script}, which imports {modules}, written after {short(notebook)}" if late else None


def violations(course: Course) -> list[str]:
    out = [f"scripts/{script} is written by several notebooks: {', '.join(sorted(ws, key=course.order.get))}"
           for script, ws in sorted(course.writers.items()) if len(ws) > 1]
    trees = {cell: python_tree(cell.source) for cell in course.cells}
    files, imports = module_files(course), script_imports(course, trees)
    for notebook in course.order:
        cells = [c for c in course.cells if c.notebook == notebook]
        parsed = [trees[c] for c in cells if trees[c] is not None]
        bound, own = assignments(parsed), own_launchers(parsed)
        for cell in cells:
            tree = trees[cell]
            for module in sorted(imported_modules(tree)) if tree else ():
                target = resolve(module, cell.writes, files)
                if target and (w := course.ahead(target, notebook)):
                    out.append(f"{cell.where()}: imports {module} (scripts/{target}), which {w} writes")
            for script in sorted(programs_run(cell.source, tree, bound, own)):
                if course.writer(script) is None:
                    out.append(f"{cell.where()}: runs scripts/{script}, which no notebook writes")
                elif problem := program_ahead(course, script, notebook, imports):
                    out.append(f"{cell.where()}: runs scripts/{problem}")
    return out


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else NOTEBOOKS
    course = read_course(folder)
    if not course.order:
        print(f"course-order: no notebooks in {folder}", file=sys.stderr)
        return 2
    found = violations(course)
    for line in found:
        print(f"course-order: {line}")
    if found:
        return 1
    print(f"course-order: {len(course.order)} notebooks go forward only: every module they import and every program "
          f"they run is written by the same notebook or an earlier one; each of {len(course.writers)} files of "
          f"scripts/ has one writer")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
