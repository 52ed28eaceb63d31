"""Build a static site of the executed notebooks (`./cookbook site`): their figures, tables and verdicts, to read
before running anything.

Why: the notebooks are committed without outputs, so on the repository a reader sees none of what they measure.
`./cookbook notebooks` (SMOKE=1 for the quick version) writes executed copies to outputs/; this program renders
those copies as they are, never executing a cell, one page each, with MkDocs, mkdocs-jupyter and the Material
theme. The index page is README.md's table of notebooks, read from README.md at each build; a notebook that the
folder lacks is listed there as not yet executed. Each page opens with when it ran, with which torch and on what
machine, read from the executed file: papermill's record (else nbclient's cell timings, else the file's time) and
the output of the notebook's `describe_machine` cell. Outputs a lent GPU produced (`--executed` the folder of a
`tools.budget_run` archive, whose copies are named NAME.full.ipynb or NAME.smoke.ipynb) are shown as they are.

Nothing on a page is fetched from elsewhere, when building or when reading. Material's web fonts are off and its
search (lunr, in a web worker) ships with the theme; the worker reads the index over HTTP, so search needs the
pages served (`--serve`), while every page and link also works from file://. MathJax is not loaded: no notebook
has math, and mkdocs-jupyter's default would load it from a CDN. ipywidgets views are dropped, since their renderer
would come from a CDN; what they showed is kept: the per-rank tabs' text is also in the cell's own output, and a
cell left with nothing (an explorer) says to run the notebook in JupyterLab.

The site goes to outputs/site/ (ignored by git); the pages' sources are made in a temporary folder, so nothing is
written into notebooks/ or next to the executed copies. A link of a built page that names no file of the site (a
notebook's link to a file of the repository, say) is listed on stderr, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import datetime
import functools
import html
import http.server
import json
import re
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

from helpers.paths import NOTEBOOKS, OUTPUTS, REPO_ROOT
from tools.run_notebooks import notebook_paths

SITE = OUTPUTS / "site"
README = REPO_ROOT / "README.md"
# The executed copy of notebook NAME: ./cookbook notebooks' name first, then tools.budget_run's.
EXECUTED_NAMES = ("{}.ipynb", "{}.full.ipynb", "{}.smoke.ipynb")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
EXECUTED_ID = "executed-on"  # the id of the box each page opens with
WIDGET_NOTE = ("An interactive widget is here when the notebook runs in JupyterLab (`./cookbook lab`); "
               "a static page cannot run it.")
# Material's page is 61rem wide; a notebook's code lines and printed tables run to 120 characters.
SITE_CSS = """.md-grid { max-width: 100rem; }
.md-typeset table:not([class]) td:first-child code { white-space: nowrap; }
"""


class Parser(argparse.ArgumentParser):
    """Bad input: one line on stderr, exit status 2 (argparse's own error prints the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


@dataclasses.dataclass(frozen=True)
class Execution:
    """When, how and where one executed notebook ran, as its file records it."""

    finished: str  # "2026-11-28 18:16 UTC"
    clock: str  # whose record `finished` is: "papermill", "cell timings" or "file time"
    seconds: float | None  # papermill's duration
    smoke: bool | None  # the SMOKE parameter papermill set; None where papermill set none
    errors: bool  # an error output, or papermill stopped at one
    machine: dict[str, str]  # describe_machine's table: torch, platform, gpus, gpu_names, cores, ...

    def torch(self) -> str:
        return f"torch {self.machine['torch']}" if "torch" in self.machine else "torch not recorded"

    def devices(self) -> str:
        """'2 CPU cores (AVX512), no GPU' or '8 x NVIDIA H200 (CUDA 12.8), 16 CPU cores (AVX512)'."""
        m = self.machine
        if not m:
            return "a machine not recorded"
        cores = f"{m.get('cores', '?')} CPU cores" + (f" ({m['cpu_capability']})" if m.get("cpu_capability") else "")
        gpus = int(m.get("gpus") or 0)
        if not gpus:
            return f"{cores}, no GPU"
        try:
            names = sorted(set(ast.literal_eval(m.get("gpu_names", "[]"))))
        except (ValueError, SyntaxError):
            names = []
        cuda = f" (CUDA {m['cuda_build']})" if m.get("cuda_build") not in (None, "", "None") else ""
        return f"{gpus} x {' / '.join(names) or 'GPU'}{cuda}, {cores}"

    def mode(self) -> str:
        return {True: "smoke mode", False: "full size", None: "size not recorded"}[self.smoke]

    def summary(self) -> str:
        """One cell of the index's table."""
        errors = ", with errors" if self.errors else ""
        return f"{self.finished[:10]}, {self.torch()}, {self.devices()}, {self.mode()}{errors}"


def machine_of(nb: dict) -> dict[str, str]:
    """describe_machine's printed table ("key  value" lines, up to the first other line) from the cell calling it."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code" or "describe_machine(" not in "".join(cell.get("source", "")):
            continue
        text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])
                       if o.get("output_type") == "stream" and o.get("name") == "stdout")
        table = {}
        for line in text.splitlines():
            row = re.fullmatch(r"(\w+) {2,}(\S.*)", line.rstrip())
            if not row:
                break
            table[row.group(1)] = row.group(2)
        return table
    return {}


def execution_of(nb: dict, path: Path) -> Execution:
    """What the executed file records of its run."""
    papermill = nb.get("metadata", {}).get("papermill") or {}
    replies = [t for c in nb.get("cells", []) if (t := c.get("metadata", {}).get("execution", {})
                                                  .get("shell.execute_reply"))]
    if papermill.get("end_time"):
        clock, finished = "papermill", datetime.datetime.fromisoformat(papermill["end_time"])
    elif replies:  # nbclient's record_timing, as tools.budget_run executes
        clock, finished = "cell timings", max(datetime.datetime.fromisoformat(t.replace("Z", "+00:00"))
                                              for t in replies)
    else:
        clock, finished = "file time", datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
    smoke = (papermill.get("parameters") or {}).get("SMOKE")
    errors = bool(papermill.get("exception")) or any(o.get("output_type") == "error" for c in nb.get("cells", [])
                                                     for o in c.get("outputs", []))
    return Execution(finished=finished.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     clock=clock, seconds=papermill.get("duration"), smoke=smoke if isinstance(smoke, bool) else None,
                     errors=errors, machine=machine_of(nb))


def executed_box(run: Execution) -> str:
    """The box a page opens with, under its title: HTML in a Markdown cell, in Material's admonition classes."""
    clock = {"papermill": "by papermill", "cell timings": "(its last cell's time)",
             "file time": "(the file's time)"}[run.clock]
    took = f" in {run.seconds:.0f} s" if run.seconds is not None else ""
    mode = {True: ", smoke mode (work shrunk, every check kept)", False: ", full size", None: ""}[run.smoke]
    platform = f"; {run.machine['platform']}" if "platform" in run.machine else ""
    errors = " It has error outputs, shown where they happened." if run.errors else ""
    return (f'<div class="admonition info" id="{EXECUTED_ID}">\n'
            f'<p class="admonition-title">Executed {run.finished} {clock}{took}{mode}</p>\n'
            f"<p>{run.torch()} on {run.devices()}{platform}. These are that run's outputs: run the notebook to "
            f"measure your own machine.{errors}</p>\n</div>")


def page_url(stem: str) -> str:
    return f"{stem}.html"  # use_directory_urls is off, so pages and links work from file:// too


def code_tags_in_headings(markdown: str) -> str:
    """Headings' `code` spans as <code> tags, which look the same. mkdocs-jupyter's table of contents leaves the
    backtick spans out of a heading's anchor while the page's heading keeps them, so the two ids would differ.
    Lines in fenced code blocks are left as they are."""
    lines, fenced = markdown.split("\n"), False
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            lines[i] = re.sub(r"`([^`]+)`", lambda m: f"<code>{html.escape(m.group(1))}</code>", line)
    return "\n".join(lines)


def site_notebook(nb: dict, run: Execution, executed: set[str]) -> dict:
    """A copy of an executed notebook for its page: the executed box under the title, widget views dropped (a cell
    left with no output gets WIDGET_NOTE), links to other notebooks pointed at their pages, or at the index for one
    not executed. Every other output is as executed."""
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).pop("widgets", None)  # its presence makes nbconvert load the widget renderer from a CDN

    def to_page(link: re.Match) -> str:
        stem, anchor = link.group(1), link.group(2) or ""
        return f"]({page_url(stem)}{anchor})" if stem in executed else "](index.html)"

    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            source = re.sub(r"\]\((\w+)\.ipynb(#[\w-]+)?\)", to_page, "".join(cell["source"]))
            cell["source"] = code_tags_in_headings(source)
        elif cell["cell_type"] == "code" and cell.get("outputs"):
            kept = [o for o in cell["outputs"] if WIDGET_VIEW not in o.get("data", {})]
            cell["outputs"] = kept or [{"output_type": "display_data", "metadata": {},
                                        "data": {"text/markdown": WIDGET_NOTE}}]
    title = next((i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"), -1)
    nb["cells"].insert(title + 1, {"cell_type": "markdown", "id": "cookbook-site-executed", "metadata": {},
                                   "source": executed_box(run)})
    return nb


@dataclasses.dataclass(frozen=True)
class Readme:
    """What the index takes from README.md: its title, first paragraph and table of notebooks."""

    title: str
    intro: str
    header: list[str]
    rows: list[list[str]]  # Markdown cells; the first is the notebook's name in backticks

    @classmethod
    def parse(cls, text: str) -> Readme:
        lines = text.splitlines()
        at = next((i for i, line in enumerate(lines) if line.startswith("# ")), None)
        table = next((i for i, line in enumerate(lines) if re.match(r"\|\s*notebook\s*\|", line)), None)
        if at is None or table is None:
            raise ValueError("README.md needs a '# ' title and a table of notebooks (a row starting '| notebook |')")
        intro = []
        for line in lines[at + 1:]:
            if line.strip():
                intro.append(line)
            elif intro:
                break
        cells = []
        for line in lines[table:]:
            if not line.startswith("|"):
                break
            cells.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        return cls(lines[at][2:].strip(), " ".join(intro), cells[0], cells[2:])


def index_markdown(readme: Readme, runs: dict[str, Execution], names: list[str]) -> str:
    """The index page: README's title, first paragraph and table of notebooks, each row linked to its page with
    when and where it was executed, or said not to be."""
    listed = {row[0].strip("`") for row in readme.rows}
    rows = readme.rows + [[f"`{n}`"] + [""] * (len(readme.header) - 1) for n in names if n not in listed]
    lines = [f"# {readme.title}", "", readme.intro, "",
             f"Each page shows a notebook as it was executed, with its figures, tables and verdicts. {len(runs)} of "
             f"{len(rows)} notebooks are executed in this build. `./cookbook notebooks` executes them (`SMOKE=1` "
             f"for the quick version), then `./cookbook site` builds these pages again.", "",
             "| " + " | ".join(readme.header + ["executed"]) + " |", "|" + "---|" * (len(readme.header) + 1)]
    for row in rows:
        stem = row[0].strip("`")
        if stem in runs:  # MkDocs turns the link to the notebook into one to its page
            row = [f"[{row[0]}]({stem}.ipynb)", *row[1:], runs[stem].summary()]
        else:
            row = [*row, "not yet executed"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def mkdocs_config(title: str, docs: Path, site: Path, notebooks: list[str]) -> dict:
    return {
        "site_name": title,
        "docs_dir": str(docs),
        "site_dir": str(site),
        "use_directory_urls": False,
        "theme": {"name": "material", "font": False, "features": ["search.highlight"]},
        "extra_css": ["cookbook.css"],
        "plugins": [
            "search",
            {"mkdocs-jupyter": {"include": ["*.ipynb"], "execute": False, "cache": False, "toc_depth": 2,
                                "include_requirejs": False,
                                # no MathJax: an empty script, inline (the default URL is a CDN's)
                                "custom_mathjax_url": "data:text/javascript,"}},
        ],
        "nav": [{"Notebooks": "index.md"}] + notebooks,
    }


def executed_copy(folder: Path, name: str) -> Path | None:
    return next((p for pattern in EXECUTED_NAMES if (p := folder / pattern.format(name)).is_file()), None)


def build_site(executed: Path = OUTPUTS, site: Path = SITE, readme: Path = README) -> dict[str, Execution]:
    """Build the site from the executed copies in `executed`; returns {notebook name: Execution} of those it has
    pages for (names as in notebooks/, without .ipynb)."""
    site = site.resolve()
    for kept in (REPO_ROOT, NOTEBOOKS, executed.resolve()):  # mkdocs empties the site's folder first
        if site == kept or site in kept.parents or (kept == NOTEBOOKS and kept in site.parents):
            raise ValueError(f"the site may not be built into {site}: it holds or is in {kept}")
    names = [p.stem for p in notebook_paths()]
    notebooks = {name: (path, json.loads(path.read_text(encoding="utf-8")))
                 for name in names if (path := executed_copy(executed, name))}
    runs = {name: execution_of(nb, path) for name, (path, nb) in notebooks.items()}
    about = Readme.parse(readme.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory(prefix="cookbook-site-") as tmp:
        docs = Path(tmp) / "docs"
        docs.mkdir()
        (docs / "cookbook.css").write_text(SITE_CSS, encoding="utf-8")
        (docs / "index.md").write_text(index_markdown(about, runs, names), encoding="utf-8")
        for name, (_, nb) in notebooks.items():
            page = site_notebook(nb, runs[name], set(runs))
            (docs / f"{name}.ipynb").write_text(json.dumps(page, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        config = Path(tmp) / "mkdocs.yml"  # JSON is YAML
        config.write_text(json.dumps(mkdocs_config(about.title, docs, site, [f"{n}.ipynb" for n in notebooks])))
        # --strict: a link that resolves to no page fails the build
        done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--clean",
                               "--config-file", str(config)], cwd=tmp, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"mkdocs build exited with {done.returncode}:\n{done.stdout}{done.stderr}")
    return runs


def broken_links(site: Path) -> list[str]:
    """'page -> target' for each link or source of a built page that names no file of the site. MkDocs checks the
    index's links (--strict) but not those inside a notebook's page, e.g. one to a file of the repository."""
    broken = []
    for page in sorted(site.glob("*.html")):
        for target in re.findall(r'<(?:a|link)\b[^>]*\bhref="([^"#]+)|<(?:img|script)\b[^>]*\bsrc="([^"]+)"',
                                 page.read_text(encoding="utf-8")):
            path = urllib.parse.unquote(urllib.parse.urlsplit("".join(target)).path)
            if re.match(r"[a-z][\w+.-]*:", "".join(target)) or not path:
                continue  # another host, data:, mailto:
            if not (site / path.lstrip("/") if path.startswith("/") else page.parent / path).is_file():
                broken.append(f"{page.name} -> {''.join(target)}")
    return broken


class SiteServer(http.server.ThreadingHTTPServer):
    """The built site on 127.0.0.1. A browser that leaves a page while it loads resets its connection: not an error."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def serve(site: Path, port: int = 0) -> SiteServer:
    """A server of the built site on 127.0.0.1 (port 0: a free one); the caller runs serve_forever()."""
    return SiteServer(("127.0.0.1", port), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site)))


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="./cookbook site", description=__doc__.split("\n\n")[0])
    parser.add_argument("--executed", type=Path, default=OUTPUTS, metavar="DIR",
                        help="the executed notebooks (default: outputs/, where ./cookbook notebooks writes them)")
    parser.add_argument("--out", type=Path, default=SITE, metavar="DIR", help="where the site goes (outputs/site/)")
    parser.add_argument("--serve", type=int, nargs="?", const=8000, metavar="PORT",
                        help="then serve it on 127.0.0.1:PORT (8000 when no PORT) until Ctrl-C; search needs this")
    args = parser.parse_args(argv)
    if args.executed != OUTPUTS and not args.executed.is_dir():
        parser.error(f"--executed {args.executed}: no such folder")
    try:
        runs = build_site(args.executed, args.out)
    except ValueError as exc:
        parser.error(str(exc))
    except RuntimeError as exc:
        print(f"./cookbook site: {exc}", file=sys.stderr)
        return 1
    missing = [p.stem for p in notebook_paths() if p.stem not in runs]
    print(f"site: {len(runs)} executed notebooks as pages; not yet executed: {', '.join(missing) or 'none'}")
    print(f"built into {args.out.resolve()}: open index.html in a browser (search needs --serve)")
    broken = broken_links(args.out)
    if broken:
        print("./cookbook site: links to no file of the site:\n  " + "\n  ".join(broken), file=sys.stderr)
        return 1
    if args.serve is not None:
        server = serve(args.out, args.serve)
        print(f"serving http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
