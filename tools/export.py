"""Standalone torchrun scripts written from the notebooks' own cells: `./cookbook export`.

Why the cells and not a second copy: a reader copies either the notebook's cells or the script into a project, and
both must be the code the notebook just ran. So the script is *made of* the cells: a code cell tagged
`script:NAME.py` belongs to `scripts/NAME.py`, and the tagged cells of one script, in notebook order, are its whole
body (the first one opens with the module docstring and the imports). The notebook defines `main()` (argparse, the
process group, one summary line) in a tagged cell without calling it, because a kernel's `__name__` is also
"__main__"; the export adds only a header comment and the `if __name__ == "__main__": main()` block.

The training recipe is a folder of modules, `scripts/train/`: a cell tagged `script:train/NAME.py` belongs to
`scripts/train/NAME.py`. A recipe module may be made of the cells of several notebooks, in notebook order (each
part of `parallelize.py` is taught where its parallelism is: FSDP2 in 03, activation checkpointing in 05, tensor
parallel in 07, the pipeline split in 08); its first cell holds the module docstring and the imports, a later
notebook's cell imports what its own part needs. A recipe module is imported, so it needs no `main()`; it gets
the `__main__` block only where it defines one.

`python -m tools.export --check` (and tests/recipe/test_scripts.py) fails when a script and its notebook drift apart,
and when a file in scripts/ is written by no notebook.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from helpers.paths import NOTEBOOKS, REPO_ROOT, SCRIPTS

TAG_PREFIX = "script:"
HEADER = ("# From the PyTorch distributed cookbook: notebooks/{notebook}, the cells tagged '{tag}'.\n"
          "# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.\n"
          "# Copied into your project, it is yours to edit.\n"
          "# Run: torchrun --standalone --nproc-per-node=2 {name} --help\n")
MODULE_HEADER = ("# From the PyTorch distributed cookbook: the cells tagged '{tag}' in\n"
                 "{notebooks}"
                 "# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.\n"
                 "# Copied into your project, it is yours to edit.\n")
RECIPE = "train"   # the recipe's folder under scripts/
FOOTER = '\n\nif __name__ == "__main__":\n    main()\n'


def _tagged_cells(notebook: Path) -> dict[str, list[str]]:
    """Script name (relative to scripts/: `train_ddp.py`, `train/model.py`) -> the sources of its cells, in
    notebook order."""
    cells: dict[str, list[str]] = {}
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for tag in cell.get("metadata", {}).get("tags", []):
            if tag.startswith(TAG_PREFIX):
                name = tag[len(TAG_PREFIX):]
                folder, _, file = name.rpartition("/")
                if not file.endswith(".py") or folder not in ("", RECIPE):
                    raise ValueError(f"{notebook.name}: tag {tag!r} must name a file like 'script:train_ddp.py' "
                                     f"or 'script:{RECIPE}/model.py'")
                cells.setdefault(name, []).append("".join(cell["source"]).strip("\n"))
    return cells


def script_text(notebook: Path, name: str, sources: list[str]) -> str:
    """The text of scripts/NAME: header, the cells separated as top-level code is (two blank lines), footer."""
    body = "\n\n\n".join(sources)
    if "def main(" not in body:
        raise ValueError(f"{notebook.name}: the cells tagged '{TAG_PREFIX}{name}' define no main()")
    return HEADER.format(notebook=notebook.name, tag=TAG_PREFIX + name, name=name) + body + FOOTER


def module_text(name: str, parts: list[tuple[str, list[str]]]) -> str:
    """The text of a recipe module, scripts/train/NAME: the cells of every notebook that tags it, in notebook order;
    the `__main__` block only where the module defines main()."""
    body = "\n\n\n".join(source for _, sources in parts for source in sources)
    notebooks = "".join(f"#   notebooks/{notebook}\n" for notebook, _ in parts)
    footer = FOOTER if "\ndef main(" in "\n" + body else "\n"
    return MODULE_HEADER.format(tag=TAG_PREFIX + name, notebooks=notebooks) + body + footer


def exported_scripts(notebooks_dir: Path = NOTEBOOKS) -> dict[str, str]:
    """Every script the notebooks define: path relative to scripts/ -> text. Two notebooks may not write one
    script; the recipe's modules may be made of several notebooks' cells."""
    scripts: dict[str, str] = {}
    owner: dict[str, str] = {}
    modules: dict[str, list[tuple[str, list[str]]]] = {}
    for notebook in sorted(notebooks_dir.glob("[0-9]*.ipynb")):
        for name, sources in _tagged_cells(notebook).items():
            if "/" in name:
                modules.setdefault(name, []).append((notebook.name, sources))
                continue
            if name in scripts:
                raise ValueError(f"scripts/{name} is tagged in both {owner[name]} and {notebook.name}")
            scripts[name], owner[name] = script_text(notebook, name, sources), notebook.name
    for name, parts in modules.items():
        scripts[name] = module_text(name, parts)
    return scripts


def _present(scripts_dir: Path) -> dict[str, str]:
    """The Python files in scripts/ and in its recipe folder, by their path relative to scripts/."""
    if not scripts_dir.exists():
        return {}
    files = list(scripts_dir.glob("*.py")) + list((scripts_dir / RECIPE).glob("*.py"))
    return {p.relative_to(scripts_dir).as_posix(): p.read_text() for p in files}


def drift(scripts_dir: Path = SCRIPTS, notebooks_dir: Path = NOTEBOOKS) -> list[str]:
    """What differs between scripts/ and the notebooks' cells, one line each; empty when they agree."""
    wanted = exported_scripts(notebooks_dir)
    present = _present(scripts_dir)
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
        path.parent.mkdir(exist_ok=True)
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
