"""Standalone torchrun scripts written from the notebooks' own cells: `./cookbook export`.

Why the cells and not a second copy: a reader copies either the notebook's cells or the script into a project, and
both must be the code the notebook just ran. So the script is *made of* the cells: a code cell tagged
`script:NAME.py` belongs to `scripts/NAME.py`, and the tagged cells of one script, in notebook order, are its whole
body (the first one opens with the module docstring and the imports). The notebook defines `main()` (argparse, the
process group, one summary line) in a tagged cell without calling it, because a kernel's `__name__` is also
"__main__"; the export adds only a header comment and the `if __name__ == "__main__": main()` block.

`python -m tools.export --check` (and tests/test_scripts.py) fails when a script and its notebook drift apart,
and when a file in scripts/ is written by no notebook.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from helpers.paths import NOTEBOOKS, REPO_ROOT, SCRIPTS

TAG_PREFIX = "script:"
HEADER = ("# Written by `./cookbook export` from notebooks/{notebook}, cells tagged '{tag}'.\n"
          "# Edit those cells, not this file. Run: torchrun --standalone --nproc-per-node=2 {name} --help\n")
FOOTER = '\n\nif __name__ == "__main__":\n    main()\n'


def _tagged_cells(notebook: Path) -> dict[str, list[str]]:
    """Script name -> the sources of its cells, in notebook order."""
    cells: dict[str, list[str]] = {}
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for tag in cell.get("metadata", {}).get("tags", []):
            if tag.startswith(TAG_PREFIX):
                name = tag[len(TAG_PREFIX):]
                if not name.endswith(".py") or "/" in name:
                    raise ValueError(f"{notebook.name}: tag {tag!r} must name a file like 'script:train_ddp.py'")
                cells.setdefault(name, []).append("".join(cell["source"]).strip("\n"))
    return cells


def script_text(notebook: Path, name: str, sources: list[str]) -> str:
    """The text of scripts/NAME: header, the cells separated as top-level code is (two blank lines), footer."""
    body = "\n\n\n".join(sources)
    if "def main(" not in body:
        raise ValueError(f"{notebook.name}: the cells tagged '{TAG_PREFIX}{name}' define no main()")
    return HEADER.format(notebook=notebook.name, tag=TAG_PREFIX + name, name=name) + body + FOOTER


def exported_scripts(notebooks_dir: Path = NOTEBOOKS) -> dict[str, str]:
    """Every script the notebooks define: file name -> text. Two notebooks may not write one script."""
    scripts: dict[str, str] = {}
    owner: dict[str, str] = {}
    for notebook in sorted(notebooks_dir.glob("[0-9]*.ipynb")):
        for name, sources in _tagged_cells(notebook).items():
            if name in scripts:
                raise ValueError(f"scripts/{name} is tagged in both {owner[name]} and {notebook.name}")
            scripts[name], owner[name] = script_text(notebook, name, sources), notebook.name
    return scripts


def drift(scripts_dir: Path = SCRIPTS, notebooks_dir: Path = NOTEBOOKS) -> list[str]:
    """What differs between scripts/ and the notebooks' cells, one line each; empty when they agree."""
    wanted = exported_scripts(notebooks_dir)
    present = {p.name: p.read_text() for p in scripts_dir.glob("*.py")} if scripts_dir.exists() else {}
    problems = [f"scripts/{name} is missing: run ./cookbook export" for name in sorted(set(wanted) - set(present))]
    problems += [f"scripts/{name} differs from its notebook's cells: edit the cells, then ./cookbook export"
                 for name in sorted(set(wanted) & set(present)) if wanted[name] != present[name]]
    problems += [f"scripts/{name} is written by no notebook cell (tag a cell '{TAG_PREFIX}{name}')"
                 for name in sorted(set(present) - set(wanted))]
    return problems


def export(scripts_dir: Path = SCRIPTS, notebooks_dir: Path = NOTEBOOKS) -> list[Path]:
    """Write every script; returns the paths whose text changed."""
    scripts_dir.mkdir(exist_ok=True)
    changed = []
    for name, text in exported_scripts(notebooks_dir).items():
        path = scripts_dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write scripts/ from the notebooks' cells tagged 'script:NAME.py'.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if scripts/ has drifted")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift()
        print("\n".join(problems) or "scripts/ matches the notebooks' cells")
        return 1 if problems else 0
    for path in export():
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    stale = [p for p in drift() if "written by no notebook" in p]
    print("\n".join(stale), file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
