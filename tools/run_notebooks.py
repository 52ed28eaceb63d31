"""Execute every notebook headless with papermill and print what each measured.

Why here and not in a shell loop: the summary reads the executed notebooks back (their headline outputs, see
`helpers.headline`) and the test suite executes notebooks the same way, through `execute_notebook` below.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from helpers.paths import NOTEBOOKS, OUTPUTS


def notebook_paths() -> list[Path]:
    return sorted(p for p in NOTEBOOKS.glob("[0-9]*.ipynb"))


def execute_notebook(path: Path, smoke: bool, out_dir: Path = OUTPUTS, cell_timeout: int = 600,
                     parameters: dict | None = None) -> tuple[Path, float]:
    """Run one notebook in a fresh kernel of this interpreter; returns (executed copy, wall seconds)."""
    import papermill as pm

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / path.name
    params = {"SMOKE": smoke, **(parameters or {})}
    start = time.perf_counter()
    pm.execute_notebook(str(path), str(out), parameters=params, kernel_name="python3", cwd=str(NOTEBOOKS),
                        execution_timeout=cell_timeout, progress_bar=sys.stderr.isatty(), log_output=False)
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    from helpers.measure.headline import headlines_of

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help="substrings of notebook names to run (default: all)")
    parser.add_argument("--smoke", action="store_true", default=os.environ.get("SMOKE", "") not in ("", "0"),
                        help="shrink every notebook's work (also SMOKE=1)")
    args = parser.parse_args(argv)
    paths = [p for p in notebook_paths() if not args.names or any(n in p.name for n in args.names)]
    rows, failed = [], 0
    for path in paths:
        print(f"running {path.name} ({'smoke' if args.smoke else 'full size'}) ...", flush=True)
        start = time.perf_counter()
        try:
            out, seconds = execute_notebook(path, args.smoke)
            figures = headlines_of(json.loads(out.read_text()))
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - one failing notebook must not hide the others
            seconds, figures, status = time.perf_counter() - start, [], f"FAILED: {type(exc).__name__}"
            failed += 1
            print(str(exc)[-3000:], file=sys.stderr)
        rows.append((path.name, status, seconds, figures))
    print()
    print(f"{'notebook':<42} {'status':<10} {'wall s':>7}  headline figures")
    for name, status, seconds, figures in rows:
        shown = "; ".join(f"{f['name']} = {f['value']:.4g} {f['unit']}".rstrip() for f in figures[:4])
        print(f"{name:<42} {status:<10} {seconds:>7.1f}  {shown}")
        for f in figures[4:]:
            print(f"{'':<62}{f['name']} = {f['value']:.4g} {f['unit']}".rstrip())
    print(f"\nexecuted notebooks are in {OUTPUTS}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
