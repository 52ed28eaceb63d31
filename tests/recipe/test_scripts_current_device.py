"""A recipe that saves with DCP on NCCL must make its GPU the current device, not only pass `device_id`.

Why a static test: the failure needs two GPUs. `init_process_group(device_id=...)` binds the NCCL communicator to
the rank's GPU but does not set the current device (torch 2.11 and 2.13); DCP's save and load exchange plans with
object collectives (`gather_object`, `broadcast_object_list`), which put their tensors on the *current* CUDA device,
cuda:0 on every rank unless `torch.cuda.set_device` was called, and NCCL then refuses ("Attempt to perform
collective on tensor not on device passed to init_process_group"). scripts/cluster_ddp.py had only `device_id`.
"""
from __future__ import annotations

import ast

import pytest

from helpers.paths import SCRIPTS

# where the scripts that may run NCCL join their group: the recipe's one init_distributed (train/distributed.py,
# which train/train.py, train_ddp.py and ddp_bench.py import; the recipes that save or load with DCP, notebooks 06 and
# 09, and run DTensor and pipeline stages, 07 and 08), cluster_ddp.py's own, and the first scripts (00, 01)
RECIPES = ["cluster_ddp.py", "train/distributed.py", "hello_distributed.py", "collectives.py"]


def _calls(tree: ast.AST) -> list[str]:
    """Dotted names of every call, in source order (`torch.cuda.set_device`, `dist.init_process_group`)."""
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                calls.append((node.lineno, ".".join([f.id, *reversed(parts)])))
    return [name for _, name in sorted(calls)]


@pytest.mark.parametrize("name", RECIPES)
def test_an_nccl_recipe_sets_the_current_device_before_its_process_group(name):
    source = (SCRIPTS / name).read_text()
    assert "nccl" in source
    calls = _calls(ast.parse(source))
    assert "torch.cuda.set_device" in calls, f"{name}: device_id alone leaves every rank's current device cuda:0"
    assert calls.index("torch.cuda.set_device") < calls.index("dist.init_process_group")


@pytest.mark.parametrize("name", ["train/train.py", "train_ddp.py"])
def test_the_recipes_join_through_the_one_init_distributed(name):
    """They call no init_process_group of their own: distributed.py's, checked above, is theirs."""
    tree = ast.parse((SCRIPTS / name).read_text())
    assert "dist.init_process_group" not in _calls(tree)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "distributed" for alias in node.names}
    assert "run_distributed" in imported
