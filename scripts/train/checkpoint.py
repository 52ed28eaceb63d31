# From the PyTorch distributed cookbook: the cells tagged 'script:train/checkpoint.py' in
#   notebooks/06_checkpointing_and_fault_tolerance.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Distributed checkpoints (torch.distributed.checkpoint) with one commit protocol, and the export for inference.

What a checkpoint holds: the model and optimizer (through get_state_dict: every rank writes its own pieces, named
by the model's parameter names), the learning-rate schedule, the data loader's position, and the step. Nothing in
its DCP state depends on the rank, the device or the layout, so it loads at another layout (DCP reshards on load).
Each rank's random-number generators travel beside it, one small file per rank (`rng/rank00001.pt`): restored when
the run resumes at the world size that wrote them (code with dropout then resumes exactly), ignored at another.

The commit protocol: every rank saves into a staging directory named by step and job (`.step_N.JOB.partial`, JOB
torchrun's run id); once the save is complete (DCP's `.metadata`, written last, after every rank's data), rank 0
fsyncs it, renames it to `step_N` (atomic within one file system), fsyncs the parent, and only then deletes all but
the newest `keep`. A reader only ever loads a `step_N` with its `.metadata`, and a committed checkpoint is never
replaced or deleted before a newer one is committed. At start-up rank 0 settles what an earlier attempt of its own
job left (commits a complete save, deletes an incomplete one) and leaves other jobs' saves alone; then it picks the
checkpoint to resume and every rank loads that one. Notebook 09's cluster_ddp.py commits with the same functions.
"""
from __future__ import annotations

import json
import os
import re
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


def job_id() -> str:
    """The job that saves: torchrun's run id (its --rdzv-id; --standalone draws one per launch), the same in every
    restart of that torchrun; else SLURM's job id; else "local". Safe as a file name."""
    raw = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "local"
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[:64]


def staging_dir(root: str | Path, step: int, job: str | None = None) -> Path:
    """Where `job` writes the save of `step`: a dot-directory that `latest` never picks."""
    return Path(root) / f".step_{step:08d}.{job or job_id()}.partial"


def latest(root: str | Path) -> Path | None:
    """The newest committed checkpoint under `root` (a `step_<8 digits>` directory with DCP's `.metadata`)."""
    if not Path(root).is_dir():
        return None
    return max((p for p in Path(root).glob("step_" + "[0-9]" * 8) if (p / ".metadata").exists()), default=None)


def _fsync(path: Path) -> None:
    """Make a file's data, or a directory's entries (a rename, a new file), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(root: str | Path, step: int, keep: int = 2, config: dict | None = None, job: str | None = None) -> Path:
    """Publish a finished save (rank 0 only, after the save returned on it): write the run's configuration (if
    any) beside the data, fsync the staged files and directory, rename it to step_N, fsync the parent so the
    rename survives a power cut, and only then delete all but the newest `keep`. A step committed already stays:
    the same step saved again (a second job, a rerun) is dropped, never swapped in by a delete and a rename that a
    crash could separate."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint just committed), got {keep}")
    staged, final = staging_dir(root, step, job), step_dir(root, step)
    if not (staged / ".metadata").exists():
        raise FileNotFoundError(f"the save of step {step} did not finish: {staged} has no .metadata")
    if (final / ".metadata").exists():
        shutil.rmtree(staged)
        return final
    if config is not None:
        (staged / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        _fsync(staged / CONFIG_FILE)
    _fsync(staged / ".metadata")
    _fsync(staged)
    os.rename(staged, final)
    _fsync(Path(root))
    for old in sorted(p for p in Path(root).glob("step_" + "[0-9]" * 8) if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


def settle_staging(root: str | Path, keep: int = 2, config: dict | None = None, job: str | None = None) -> list:
    """What earlier attempts of this job left in `root` (rank 0, at start-up, before any rank picks a checkpoint or
    saves): a complete save not yet committed (rank 0 died between the save and the rename) is committed, an
    incomplete one deleted. Another job's staging directories are left alone: that job may be saving now. Returns
    them, for the log."""
    job = job or job_id()
    others = []
    for staged in sorted(Path(root).glob(".step_*.partial")):
        match = re.fullmatch(r"\.step_(\d{8})\.(.+)\.partial", staged.name)
        if match is None or match[2] != job:
            others.append(staged)
        elif (staged / ".metadata").exists():
            commit(root, int(match[1]), keep, config, job)
        else:
            shutil.rmtree(staged)
    return others


class CheckpointError(RuntimeError):
    """A checkpoint the ranks cannot all load: every rank raises it, with the same one-line message."""


def agreed_latest(root: str | Path) -> Path | None:
    """The checkpoint to resume from, the same on every rank (collective): rank 0 picks the newest committed one it
    sees and every rank checks that it sees that one too. Each rank picking alone, ranks whose views of the
    directory differ (a network file system's caches, disks that are not shared) would load different steps, or
    some none, then diverge or hang. CheckpointError, on every rank, when some rank cannot see rank 0's pick."""
    pick = [latest(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(pick, src=0)
    if pick[0] is None:
        return None
    path = Path(root) / pick[0].name
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (path / ".metadata").exists())
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        raise CheckpointError(f"rank 0 resumes from {path}, which rank{'s' * (len(blind) > 1)} "
                              f"{', '.join(map(str, blind))} cannot see: --ckpt-dir must be one storage every rank "
                              "reads alike")
    return path


def make_stager(device: torch.device):
    """For a state on GPUs, one stager for the run: its pinned host copy of the state is allocated at the first
    async save and refilled at every later one, at the host link's speed. For CPU state None: async_save's
    default staging (a fresh copy per save; there is no pinned memory to reuse)."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager(cache_staged_state_dict=True) if torch.device(device).type == "cuda" else None


RNG_DIR = "rng"


def save_rng(folder: str | Path) -> None:
    """This rank's random-number generators (the CPU's, and the current GPU's) in a file of its own in the
    checkpoint's folder, fsynced, written before the rank's DCP save (so before `.metadata`). In the DCP state
    they could not go: one key would bring back rank 0's on every rank (section 2), a key per rank would fail to
    load at another world size."""
    state = {"world_size": dist.get_world_size(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    folder = Path(folder) / RNG_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{dist.get_rank():05d}.pt"
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync(folder)


def load_rng(folder: str | Path) -> bool:
    """Restore this rank's generators from a checkpoint written at this world size; False, and nothing changed,
    when it was written at another (rank r's state there belongs to no rank here: the caller reseeds) or holds
    none (a checkpoint of an earlier version)."""
    path = Path(folder) / RNG_DIR / f"rank{dist.get_rank():05d}.pt"
    if not path.exists():
        return False
    state = torch.load(path, weights_only=True)
    if state["world_size"] != dist.get_world_size():
        return False
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True


class Checkpointer:
    """Saves (sync or async) and loads a TrainState under `root` with the commit protocol above."""

    def __init__(self, root: str | Path, keep: int = 2, async_save: bool = False, config: dict | None = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root, self.keep, self.async_save, self.config = Path(root), keep, async_save, config or {}
        self.job = job_id()           # the same on every rank: torchrun's environment
        self.pending = None           # (future, step) of an async save not yet committed
        self.saved_step = None        # the step of the last save (committed, or pending) or load
        self.stager = None            # the async saves' stager, made at the first one (make_stager)
        self.rng_restored, self.others = False, []    # the last load restored the generators; others' saves
        self.group = dist.new_group(backend="gloo") if async_save else None   # never behind training's collectives
        if dist.get_rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            _fsync(self.root.parent)
            self.others = settle_staging(self.root, keep, self.config, self.job)
        dist.barrier()                # settled before any rank picks a checkpoint or stages a save

    def load_latest(self, state: TrainState) -> Path | None:
        """Load rank 0's pick (`agreed_latest`) into `state`, and this rank's generators at the world size that
        saved; None (and `state` untouched) when there is none."""
        path = agreed_latest(self.root)
        if path is not None:
            dcp.load({"train": state}, checkpoint_id=path)
            self.saved_step, self.rng_restored = int(path.name[5:]), load_rng(path)
        return path

    def save(self, state: TrainState) -> None:
        """Save `state` at its step. Sync: written and committed when this returns. Async: the state is copied to
        host memory before this returns, written in the background, committed by `poll()` once written (or by the
        next save or `wait()`)."""
        self.wait()
        self.saved_step = state.step
        staged = staging_dir(self.root, state.step, self.job)
        save_rng(staged)
        if self.async_save:
            if self.stager is None:
                self.stager = make_stager(next(state.model.parameters()).device)
            self.pending = (dcp.async_save({"train": state}, checkpoint_id=staged, process_group=self.group,
                                           async_stager=self.stager), state.step)
        else:
            dcp.save({"train": state}, checkpoint_id=staged)
            if dist.get_rank() == 0:
                commit(self.root, state.step, self.keep, self.config, self.job)

    def poll(self) -> None:
        """Commit an async save as soon as it is written (call once a step), so a crash loses only the steps since.
        Not a collective: rank 0's future is done only once DCP has written `.metadata`, after every rank's."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Finish and commit an async save in flight (call before exiting): the future returns once the whole save
        is written, DCP's `.metadata` included."""
        if self.pending is not None:
            (future, step), self.pending = self.pending, None
            future.result()
            if dist.get_rank() == 0:
                commit(self.root, step, self.keep, self.config, self.job)


def full_model_state(checkpoint: str | Path) -> tuple:
    """(the model's config, its whole state dict on the CPU, the run's saved configuration) of a committed checkpoint
    written at any layout: one process, no process group; DCP assembles each parameter from the ranks' pieces."""
    from config import LlamaArgs
    from model import Llama

    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / CONFIG_FILE).read_text())
    if config.get("args", {}).get("moe_experts"):
        raise ValueError(f"{checkpoint} holds a mixture of experts (train.py --moe-experts): exports and generate.py "
                         "build the dense Llama")
    cfg = LlamaArgs(**config["model"])

    with torch.device("meta"):
        model = Llama(cfg)
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
    from config import LlamaArgs
    from model import Llama

    saved = torch.load(path, map_location=device, weights_only=True)
    model = Llama(LlamaArgs(**saved["config"])).to(device)
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
    one. `LlamaForCausalLM.from_pretrained(out)` opens it (tests/recipe/test_llama_reference.py); so do vLLM and the
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
    if trained_on.get("tokenizer") and Path(trained_on["tokenizer"]).exists():   # a folder, or an older file
        from data import tokenizer_files

        shutil.copy(tokenizer_files(trained_on["tokenizer"])["tokenizer.json"], out / "tokenizer.json")
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
