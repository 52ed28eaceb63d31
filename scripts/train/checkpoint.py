# From the PyTorch distributed cookbook: the cells tagged 'script:train/checkpoint.py' in
#   notebooks/06_checkpointing_and_fault_tolerance.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Distributed checkpoints (torch.distributed.checkpoint) with one commit protocol, and the export for inference.

What a checkpoint holds: the model and optimizer (through get_state_dict: every rank writes its own pieces, named
by the model's parameter names), the learning-rate schedule, the data loader's position, and the step. Nothing in
it depends on the rank, the device or the layout, so it loads at another layout (DCP reshards on load). There is
no random-number state in it: nothing in training draws random numbers except through generators seeded from
(seed, step) or (seed, epoch), which a resumed run recomputes.

The commit protocol: every rank saves into a staging directory `.step_N.partial`; once the save is complete
(DCP's `.metadata`, written last by the coordinator, after every rank's data), rank 0 renames it to `step_N`
(atomic within one file system), fsyncs the parent, and deletes all but the newest `keep`. A reader only ever
loads a `step_N` with its `.metadata`: a crash during a save leaves a staging directory, never a half checkpoint
under a committed name. Notebook 09's cluster_ddp.py commits with the same functions.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

CONFIG_FILE = "config.json"


class TrainState(Stateful):
    """What a resumed run needs; DCP calls state_dict() when saving and load_state_dict() after loading. With a
    pipeline, `model` is this rank's stage (its parameters keep the whole model's names)."""

    def __init__(self, model, optimizer, scheduler, loader):
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.step = 0

    def state_dict(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)   # DTensor pieces where sharded
        return {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict(),
                "loader": json.dumps(self.loader.state_dict()), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(json.loads(state["loader"]))
        self.step = state["step"]


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def staging_dir(root: str | Path, step: int) -> Path:
    """Where the save of `step` is written: a dot-directory that `latest` never picks."""
    return Path(root) / f".step_{step:08d}.partial"


def latest(root: str | Path) -> Path | None:
    """The newest committed checkpoint under `root` (a `step_<8 digits>` directory with DCP's `.metadata`)."""
    if not Path(root).is_dir():
        return None
    return max((p for p in Path(root).glob("step_" + "[0-9]" * 8) if (p / ".metadata").exists()), default=None)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(root: str | Path, step: int, keep: int = 2, config: dict | None = None) -> Path:
    """Publish a finished save (rank 0 only, after the save returned on it): write the run's configuration (if
    any) beside the data, rename the staging directory to step_N, fsync the parent so the rename survives a power
    cut, delete all but the newest `keep`."""
    staged, final = staging_dir(root, step), step_dir(root, step)
    if not (staged / ".metadata").exists():
        raise FileNotFoundError(f"the save of step {step} did not finish: {staged} has no .metadata")
    if config is not None:
        (staged / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    if final.exists():            # the same step saved again (a rerun of a finished run): the new one wins
        shutil.rmtree(final)
    os.rename(staged, final)
    _fsync_dir(Path(root))
    for old in sorted(Path(root).glob("step_" + "[0-9]" * 8))[:-keep]:
        shutil.rmtree(old)
    return final


def clear_staging(root: str | Path) -> None:
    """Delete the staging directories of saves that never finished (one rank, before any rank saves again)."""
    for debris in Path(root).glob(".step_*.partial"):
        shutil.rmtree(debris)


def make_stager(device: torch.device):
    """For a state on GPUs, one stager for the run: its pinned host copy of the state is allocated at the first
    async save and refilled at every later one, at the host link's speed. For CPU state None: async_save's
    default staging (a fresh copy per save; there is no pinned memory to reuse)."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager(cache_staged_state_dict=True) if torch.device(device).type == "cuda" else None


class Checkpointer:
    """Saves (sync or async) and loads a TrainState under `root` with the commit protocol above."""

    def __init__(self, root: str | Path, keep: int = 2, async_save: bool = False, config: dict | None = None):
        self.root, self.keep, self.async_save, self.config = Path(root), keep, async_save, config or {}
        self.pending = None           # (future, step) of an async save not yet committed
        self.saved_step = None        # the step of the last save (committed, or pending)
        self.stager = None            # the async saves' stager, made at the first one (make_stager)
        # async saves talk on a gloo group of their own, so they never queue behind the training's collectives
        self.group = dist.new_group(backend="gloo") if async_save else None
        if dist.get_rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            clear_staging(self.root)
        dist.barrier()                # the debris is gone before any rank stages a save

    def load_latest(self, state: TrainState) -> Path | None:
        """Load the newest committed checkpoint into `state`; None (and `state` untouched) when there is none."""
        path = latest(self.root)
        if path is not None:
            dcp.load({"train": state}, checkpoint_id=path)
        return path

    def save(self, state: TrainState) -> None:
        """Save `state` at its step. Sync: written and committed when this returns. Async: the state is copied to
        host memory before this returns, written in the background, committed by `poll()` once written (or by the
        next save or `wait()`)."""
        self.wait()
        self.saved_step = state.step
        staged = staging_dir(self.root, state.step)
        if self.async_save:
            if self.stager is None:
                self.stager = make_stager(next(state.model.parameters()).device)
            future = dcp.async_save({"train": state}, checkpoint_id=staged, process_group=self.group,
                                    async_stager=self.stager)
            self.pending = (future, state.step)
        else:
            dcp.save({"train": state}, checkpoint_id=staged)
            if dist.get_rank() == 0:
                commit(self.root, state.step, self.keep, self.config)

    def poll(self) -> None:
        """Commit an async save as soon as it is written (call once a step): a crash between two saves then loses
        only the steps since the last one. Not a collective: rank 0's future is done only when DCP has written
        `.metadata`, after every rank's writes; another rank just drops its finished future."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Finish and commit an async save in flight (call before exiting): the future returns once the whole save
        is written, DCP's `.metadata` included."""
        if self.pending is not None:
            future, step = self.pending
            self.pending = None
            future.result()
            if dist.get_rank() == 0:
                commit(self.root, step, self.keep, self.config)


def full_model_state(checkpoint: str | Path) -> tuple:
    """(the model's config, its whole state dict on the CPU, the run's saved configuration) of a committed checkpoint
    written at any layout: one process, no process group; DCP assembles each parameter from the ranks' pieces."""
    from config import GPTConfig
    from model import GPT

    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / CONFIG_FILE).read_text())
    cfg = GPTConfig(**config["model"])
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    state = model.state_dict()
    with warnings.catch_warnings():   # DCP warns that it loads in one process: that is the intent here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"train": {"model": state}}, checkpoint_id=checkpoint)
    return cfg, state, config


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """One torch.save file of the whole model (full tensors, on the CPU) for inference, from a committed
    checkpoint: {"config": the model's config, "model": its state dict}; `load_exported` reads it back."""
    cfg, state, config = full_model_state(checkpoint)
    torch.save({"config": config["model"], "model": state}, out)
    return Path(out)


def load_exported(path: str | Path, device: str | torch.device = "cpu"):
    """The model an `export` file holds, ready for inference."""
    from config import GPTConfig
    from model import GPT

    saved = torch.load(path, map_location=device, weights_only=True)
    model = GPT(GPTConfig(**saved["config"])).to(device)
    model.load_state_dict(saved["model"])
    return model.eval()


def export_full_state_dict(model, cfg, out: str | Path) -> None:
    """The same file as `export`, written from the training processes at the end of a run: every rank takes part
    in gathering each parameter whole (get_model_state_dict with full_state_dict), and rank 0 alone receives it,
    on the CPU (cpu_offload), and writes it. For a model sharded over the whole world (FSDP2, HSDP, TP, DDP); a
    pipeline stage holds only its own blocks, so a pipelined run exports from its checkpoint instead."""
    from dataclasses import asdict

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"config": asdict(cfg), "model": state}, out)


# -------------------------------------------------------------------------------------- Hugging Face checkpoints
HF_WEIGHTS = "model.safetensors"


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """A Hugging Face Llama folder from a committed checkpoint: config.json (model.py's `hf_config`, with the
    training data's end-of-text token as eos_token_id), model.safetensors (the weights under Hugging Face's names, wq and wk reordered by
    `to_hf`; a tied output stored once, as Hugging Face does) and the training data's tokenizer.json where it had
    one. `LlamaForCausalLM.from_pretrained(out)` opens it (tests/test_llama_reference.py); so do vLLM and the
    evaluation harnesses."""
    from safetensors.torch import save_file

    from config import hf_config
    from model import to_hf

    cfg, state, config = full_model_state(checkpoint)
    tensors = dict(to_hf(name, t.to(dtype).contiguous(), cfg) for name, t in state.items()
                   if not (cfg.tie_embeddings and name == "output.weight"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / HF_WEIGHTS, metadata={"format": "pt"})
    hf = hf_config(cfg, str(dtype).removeprefix("torch."))
    trained_on = config.get("data") or {}
    if trained_on.get("tokenizer") and Path(trained_on["tokenizer"]).exists():
        shutil.copy(trained_on["tokenizer"], out / "tokenizer.json")
    if trained_on.get("eot_id") is not None:
        hf["eos_token_id"] = trained_on["eot_id"]
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    return out


def hf_model_config(folder: str | Path):
    """model.py's config of the Hugging Face Llama in `folder`; ValueError (one line) for a folder that holds none."""
    from config import config_from_hf

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        return config_from_hf(json.loads(path.read_text()))
    except (KeyError, ValueError) as e:
        raise ValueError(f"{folder} is not a Llama this recipe can load: {e}") from None


def _hf_tensor_files(folder: Path) -> dict[str, Path]:
    """Hugging Face name -> the .safetensors file holding it (model.safetensors, or the shards an index names)."""
    index = folder / (HF_WEIGHTS + ".index.json")
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    if not (folder / HF_WEIGHTS).is_file():
        raise ValueError(f"{folder}: neither {HF_WEIGHTS} nor its index")
    from safetensors import safe_open

    with safe_open(folder / HF_WEIGHTS, framework="pt") as f:
        return {name: folder / HF_WEIGHTS for name in f.keys()}


@torch.no_grad()
def load_hf(model, folder: str | Path) -> None:
    """Hugging Face Llama weights into the model at any layout, after `to_empty` (as `init_weights` would fill it):
    each rank reads, for each parameter it holds a piece of (its pipeline stage's only), the whole tensor from the
    safetensors file, puts it back in our layout (`from_hf`) and keeps its piece (`copy_full_into`)."""
    from safetensors import safe_open

    from model import copy_full_into, from_hf, hf_name

    folder = Path(folder)
    where = _hf_tensor_files(folder)
    opened = {}
    try:
        for name, param in model.named_parameters():
            name = name.replace("_orig_mod.", "")        # a compiled block's wrapper
            key = hf_name(name)
            if key not in where and name == "output.weight":
                raise ValueError(f"{folder} has no {key}: its config says the output is not tied")
            file = where[key]
            if file not in opened:
                opened[file] = safe_open(file, framework="pt")
            tensor = opened[file].get_tensor(key).to(torch.float32)
            copy_full_into(param, from_hf(name, tensor, model.cfg))
    finally:
        opened.clear()
    model.init_rope()
