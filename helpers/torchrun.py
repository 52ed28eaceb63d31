"""'Take it to your project': the same worker function as a script, run under torchrun from the notebook.

Why the function's own source: the script a reader copies must be the code the notebook just ran, not a second
copy that drifts. `write_script` takes the function's text (inspect.getsource, which works for notebook cells too)
and adds only the imports and a `__main__` block; `run_torchrun` runs it as `torchrun` would be typed.
"""
from __future__ import annotations

import inspect
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path


def write_script(fn, path, imports: str, main: str | None = None) -> Path:
    """Write `imports`, the source of `fn` and a __main__ block (default: print what fn returns) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    main = main or f"print({fn.__name__}())"
    body = textwrap.dedent(inspect.getsource(fn))
    text = (f'"""{fn.__name__}, as run by the cookbook notebook; launch with torchrun."""\n'
            f"{textwrap.dedent(imports).strip()}\n\n\n{body.rstrip()}\n\n\n"
            f'if __name__ == "__main__":\n{textwrap.indent(textwrap.dedent(main).strip(), "    ")}\n')
    path.write_text(text)
    return path


def torchrun_command(script, nproc: int, *extra: str, standalone: bool = True) -> list[str]:
    """The command torchrun runs (python -m torch.distributed.run is torchrun, without relying on PATH)."""
    base = [sys.executable, "-m", "torch.distributed.run"]
    if standalone:
        base.append("--standalone")
    return base + [f"--nproc-per-node={nproc}", *extra, str(script)]


def torchrun_lines(script: str, nproc: str = "gpu", nodes: int = 2, endpoint: str = "HOST_OF_NODE_0:29500") -> str:
    """What to type on one machine and on each of several, as text for the reader."""
    return (f"# one machine, one process per GPU (or --nproc-per-node=N CPU processes):\n"
            f"torchrun --standalone --nproc-per-node={nproc} {script}\n\n"
            f"# {nodes} machines: run on every node, with --node-rank 0 .. {nodes - 1}\n"
            f"torchrun --nnodes={nodes} --nproc-per-node={nproc} --node-rank=$NODE_RANK "
            f"--rdzv-backend=c10d --rdzv-endpoint={endpoint} --rdzv-id=cookbook {script}\n"
            f"# (torchrun replaced `python -m torch.distributed.launch`, which the articles use: it sets RANK and\n"
            f"#  LOCAL_RANK in the environment instead of passing --local_rank, and restarts failed workers.)")


def run_torchrun(script, nproc: int = 2, *extra: str, timeout: float = 300, standalone: bool = True,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the script under torchrun, print the command and its output, return the finished process."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        # --tee=3 makes torchrun prefix every line with its rank ([default0]:), as helpers.launch does.
        cmd = torchrun_command(script, nproc, "--tee=3", f"--log-dir={logs}", *extra, standalone=standalone)
        shown = [c for c in cmd[3:] if not c.startswith("--log-dir")]
        print("$ " + " ".join(shlex.quote(c) for c in ["torchrun", *shown]))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    print(done.stdout.rstrip())
    if done.stderr.strip():
        print(done.stderr.rstrip(), file=sys.stderr)
    print(f"(exit code {done.returncode})")
    return done
