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
replaced or deleted before a newer one is committed. At start-up rank 0 settles every staged save it finds by one
rule, whatever job left it (a `--standalone` relaunch is a new job): a complete one (`.metadata` and every rank's
files) is committed; an incomplete one is deleted, unless another job changed its files within LEASE_S (10
minutes): a live job's save in progress, left alone. Then it picks the checkpoint to resume and every rank loads
that one. Notebook 09's cluster_ddp.py commits with the same functions.

For inference, a committed checkpoint becomes one torch.save file (`export`) or a Hugging Face folder (`export_hf`:
safetensors shards written file by file, config.json, generation_config.json, the tokenizer's files);
`load_hf` reads such a folder into the model at any layout, each rank reading only the slices its pieces hold.
`export_main` is `python train.py export`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

CONFIG_FILE = "config.json"


class TrainState(Stateful):
    """What a resumed run needs; DCP calls state_dict() when saving and load_state_dict() after loading. With a
    pipeline, `model` is this rank's stages (their parameters keep the whole model's names). The optimizer's state
    is flattened: each parameter's settings under its own name (`param_groups.<name>.lr`). Unflattened, the groups
    are a list keyed by position, the same keys on every pipeline stage; DCP writes such a key once, so the other
    stages would load one stage's groups and lose their own."""

    def __init__(self, model, optimizer, scheduler, loader):
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.step = 0

    def state_dict(self) -> dict:
        model_state, optim_state = get_state_dict(       # DTensor pieces where sharded
            self.model, self.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
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


def write_config(folder: Path, config: dict) -> None:
    """The run's configuration beside a save's data (what `train.py export` and generate.py rebuild it from)."""
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    _fsync(folder / CONFIG_FILE)


def commit(root: str | Path, step: int, keep: int = 2, config: dict | None = None, job: str | None = None) -> Path:
    """Publish a finished save (rank 0 only, after the save returned on it): write the run's configuration (if
    any) beside the data, fsync the staged files and directory, rename it to step_N, fsync the parent so the
    rename survives a power cut, and only then delete all but the newest `keep`. A step committed already stays:
    the same step saved again (a second job, a rerun) is dropped, never swapped in by a delete and a rename that a
    crash could separate. Two committers of one save (its job, and the next launch's `settle_staging`) both
    return the committed folder: the rename happens once."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint just committed), got {keep}")
    staged, final = staging_dir(root, step, job), step_dir(root, step)
    if (final / ".metadata").exists():
        shutil.rmtree(staged, ignore_errors=True)
        return final
    if not (staged / ".metadata").exists():
        raise FileNotFoundError(f"the save of step {step} did not finish: {staged} has no .metadata")
    try:
        if config is not None:
            write_config(staged, config)
        _fsync(staged / ".metadata")
        _fsync(staged)
        os.rename(staged, final)
    except FileNotFoundError:
        if (final / ".metadata").exists():        # the other committer renamed it first
            return final
        raise
    _fsync(Path(root))
    for old in sorted(p for p in Path(root).glob("step_" + "[0-9]" * 8) if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


LEASE_S = 600   # seconds: another job's unfinished save whose files have not changed for this long is abandoned


def is_complete(staged: Path) -> bool:
    """A staged save every rank finished: DCP's `.metadata` (rank 0 writes it last, once every rank has written),
    every file it names with all the bytes it names, and, where the save holds generator files, one per rank."""
    if not (staged / ".metadata").is_file():
        return False
    try:
        metadata = dcp.FileSystemReader(staged).read_metadata()
    except Exception:                     # a .metadata that does not read back is no finished save
        return False
    ends = {}
    for stored in metadata.storage_data.values():
        ends[stored.relative_path] = max(ends.get(stored.relative_path, 0), stored.offset + stored.length)
    if any(not (staged / f).is_file() or (staged / f).stat().st_size < end for f, end in ends.items()):
        return False
    rng = sorted(p.name for p in (staged / RNG_DIR).glob("rank*.pt"))
    if not rng:                           # a save without generator files (notebook 09's cluster_ddp.py)
        return True
    world = torch.load(staged / RNG_DIR / rng[0], weights_only=True)["world_size"]
    return rng == [f"rank{r:05d}.pt" for r in range(world)]


def last_change(folder: Path) -> float:
    """The newest modification time of the folder or anything in it: a save in progress keeps it fresh."""
    times = [folder.stat().st_mtime]
    for path in folder.rglob("*"):
        try:
            times.append(path.stat().st_mtime)
        except FileNotFoundError:         # renamed or deleted as we looked: a save at work
            times.append(time.time())
    return max(times)


def settle_staging(root: str | Path, keep: int = 2, config: dict | None = None, job: str | None = None) -> list:
    """The rule for staged saves found at start-up (rank 0, before any rank picks a checkpoint or saves), whatever
    job left them: a complete one (`is_complete`) is committed, so a relaunch under a new job id (torchrun
    --standalone draws one per launch) keeps the save its predecessor finished but did not rename; an incomplete
    one of this job, or of another job whose files are older than LEASE_S, is deleted; an incomplete one of another
    job with fresher files is left alone, as a live job's save in progress. A save without its own config.json
    (written before the data since this version) gets `config`. Returns those left alone, for the log."""
    job = job or job_id()
    left = []
    for staged in sorted(Path(root).glob(".step_*.partial")):
        match = re.fullmatch(r"\.step_(\d{8})\.(.+)\.partial", staged.name)
        if match is None:
            left.append(staged)
        elif is_complete(staged):
            commit(root, int(match[1]), keep, None if (staged / CONFIG_FILE).exists() else config, match[2])
        elif match[2] != job and time.time() - last_change(staged) < LEASE_S:
            left.append(staged)
        else:
            shutil.rmtree(staged)
    return left


class CheckpointError(RuntimeError):
    """A checkpoint the ranks cannot all load: every rank raises it, with the same one-line message."""


def agreed_latest(root: str | Path) -> Path | None:
    """The checkpoint to resume from, the same on every rank (collective): rank 0 picks the newest committed one it
    sees and every rank checks that it sees that one too. Each rank picking alone, ranks whose views of the
    directory differ (a network file system's caches, disks that are not shared) would load different steps, or
    some none, then diverge or hang. CheckpointError, on every rank, when some rank cannot see rank 0's pick, or
    when the pick keeps the optimizer's groups by position (the recipe's saves before TrainState flattened them:
    one pipeline stage's groups only)."""
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
    if "train.optim.param_groups.0.params" in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
        raise CheckpointError(f"{path} keeps the optimizer's groups by position (an older recipe's save): resume it "
                              "with the recipe that wrote it, or start in a new --ckpt-dir")
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
        if dist.get_rank() == 0:      # the save carries its configuration, whoever commits it (settle_staging)
            write_config(staged, self.config)
        if self.async_save:
            if self.stager is None:
                self.stager = make_stager(next(state.model.parameters()).device)
            self.pending = (dcp.async_save({"train": state}, checkpoint_id=staged, process_group=self.group,
                                           async_stager=self.stager), state.step)
        else:
            dcp.save({"train": state}, checkpoint_id=staged)
            if dist.get_rank() == 0:
                commit(self.root, state.step, self.keep, job=self.job)

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
                commit(self.root, step, self.keep, job=self.job)


def checkpoint_config(checkpoint: str | Path) -> tuple:
    """(the model's shape, the run's saved configuration) of a committed checkpoint; ValueError (one line) for one
    the exports cannot rebuild: no config.json, or a mixture of experts."""
    from config import LlamaArgs

    path = Path(checkpoint) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{checkpoint} has no {CONFIG_FILE}: not a checkpoint of train.py")
    config = json.loads(path.read_text())
    if config.get("args", {}).get("moe_experts"):
        raise ValueError(f"{checkpoint} holds a mixture of experts (train.py --moe-experts): exports and generate.py "
                         "build the dense Llama")
    return LlamaArgs(**config["model"]), config


def load_in_one_process(checkpoint: str | Path, model_state: dict) -> None:
    """Fill `model_state` (any of the model's tensors, whole, in any dtype) from a checkpoint written at any layout:
    one process, no process group; DCP reads each tensor's pieces from the ranks' files, and no other tensor."""
    with warnings.catch_warnings():   # DCP warns that it loads in one process: that is the intent here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"train": {"model": model_state}}, checkpoint_id=checkpoint, no_dist=True)


def full_model_state(checkpoint: str | Path) -> tuple:
    """(the model's config, its whole state dict on the CPU, the run's saved configuration) of a committed checkpoint
    written at any layout: one process, no process group; DCP assembles each parameter from the ranks' pieces."""
    from model import Llama

    cfg, config = checkpoint_config(checkpoint)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    state = model.state_dict()
    load_in_one_process(checkpoint, state)
    return cfg, state, config


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """One torch.save file of the whole model (full tensors, on the CPU) for inference, from a committed
    checkpoint: {"config": the model's config, "model": its state dict}; `load_exported` reads it back."""
    cfg, state, config = full_model_state(checkpoint)
    torch.save({"config": config["model"], "model": state}, out)
    return Path(out)


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


def empty_model(cfg, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The model with room for its weights in `dtype` on `device`, nothing drawn and nothing copied: built on the
    meta device, then given memory (to_empty). The rotary tables stay float32, as training computes the angles;
    whatever loads the weights then calls `init_rope`."""
    from model import Llama

    with torch.device("meta"):
        model = Llama(cfg).to(dtype)
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model.to_empty(device=device)


def load_exported(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The model an `export` file holds, ready for inference, in `dtype` on `device` (the file mapped, not read
    into memory first)."""
    from config import LlamaArgs

    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    model = empty_model(LlamaArgs(**saved["config"]), device, dtype)
    model.load_state_dict(saved["model"])
    model.init_rope()
    return model.eval()


# -------------------------------------------------------------------------------------- Hugging Face checkpoints
HF_WEIGHTS = "model.safetensors"
HF_INDEX = HF_WEIGHTS + ".index.json"
MAX_SHARD_BYTES = 5 * 10 ** 9     # a safetensors file holds at most this much: save_pretrained's "5GB"
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard_files(sizes: dict[str, int], max_bytes: int) -> dict[str, list[str]]:
    """File name -> the tensors it holds (of `sizes`, name -> bytes, in order), each file at most max_bytes unless
    one tensor alone is larger, named as save_pretrained names them: model.safetensors for one file, else
    model-00001-of-00003.safetensors and so on."""
    groups, size = [[]], 0
    for name, n in sizes.items():
        if groups[-1] and size + n > max_bytes:
            groups, size = groups + [[]], 0
        groups[-1].append(name)
        size += n
    if len(groups) == 1:
        return {HF_WEIGHTS: groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": group for i, group in enumerate(groups, 1)}


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
              max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """A Hugging Face Llama folder from a committed checkpoint, in `dtype` (default: the one the run trained in):
    the weights under Hugging Face's names (wq and wk reordered by `to_hf`; a tied output stored once, as Hugging
    Face does) in safetensors files of at most `max_shard_bytes`, with `model.safetensors.index.json` when there are
    several, then config.json and the tokenizer's files (`write_hf_config`). Written file by file in one process:
    DCP reads one file's tensors from the checkpoint, converted to `dtype` as they are copied in, so the memory
    held is one file's, not the model's. `LlamaForCausalLM.from_pretrained(out)` and `AutoTokenizer` open it as
    they open the download it may have started from (tests/recipe/test_checkpoint_hf.py); so do vLLM and the
    evaluation harnesses."""
    from safetensors.torch import save_file

    from model import Llama, hf_name, to_hf

    cfg, config = checkpoint_config(checkpoint)
    dtype = dtype or WEIGHT_DTYPES[config.get("args", {}).get("dtype") or "fp32"]
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Llama(cfg).state_dict().items()
                  if not (cfg.tie_embeddings and name == "output.weight")}
    itemsize = torch.empty((), dtype=dtype).element_size()
    files = shard_files({name: shape.numel() * itemsize for name, shape in shapes.items()}, max_shard_bytes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / HF_INDEX]:     # an earlier export's files would mislead
        old.unlink(missing_ok=True)
    for file, names in files.items():
        tensors = {name: torch.empty(shapes[name], dtype=dtype) for name in names}
        load_in_one_process(checkpoint, tensors)
        save_file(dict(to_hf(name, t, cfg) for name, t in tensors.items()), out / file, metadata={"format": "pt"})
        del tensors                                                    # before the next file's
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(shape.numel() for shape in shapes.values()) * itemsize},
                 "weight_map": {hf_name(name): file for file, names in files.items() for name in names}}
        (out / HF_INDEX).write_text(json.dumps(index, indent=2))
    write_hf_config(out, cfg, config, dtype)
    return out


def write_hf_config(out: Path, cfg, config: dict, dtype: torch.dtype) -> None:
    """config.json (model.py's `hf_config` in `dtype`) and the tokenizer the run trained with (`write_tokenizer`),
    its BOS and EOS ids in config.json as Hugging Face's Llama folders have them; a run on bytes has no tokenizer."""
    from config import hf_config

    hf = hf_config(cfg, str(dtype).removeprefix("torch."))
    tokenizer = write_tokenizer(out, config)
    if tokenizer is not None:
        hf.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    (out / "config.json").write_text(json.dumps(hf, indent=1))


def write_tokenizer(out: Path, config: dict):
    """The tokenizer's files beside the weights, so that AutoTokenizer opens the tokenizer the model trained with
    (not a default one, with a BOS it never saw): the token file's (`data.describe`'s folder, or an older token
    file's tokenizer.json), and for a run started with --init-from FOLDER, the folder's files where the token
    file's lack them (if the folder's vocabulary is the token file's); `data.save_tokenizer` adds a
    tokenizer_config.json and a generation_config.json where none came, this a special_tokens_map.json from
    tokenizer_config.json. Returns what `data.read_tokenizer` reads back, or None: no tokenizer."""
    import tempfile

    from tokenizers import Tokenizer

    from data import TOKENIZER_FILES, read_tokenizer, save_tokenizer, tokenizer_files

    trained, folder = (config.get("data") or {}).get("tokenizer"), config.get("args", {}).get("init_from")
    own = tokenizer_files(trained) if trained and Path(trained).exists() else {}
    theirs = tokenizer_files(folder) if folder and (Path(folder) / "tokenizer.json").is_file() else {}
    vocab = [Tokenizer.from_file(str(files["tokenizer.json"])).get_vocab() for files in (own, theirs) if files]
    files = {**theirs, **own} if len(vocab) < 2 or vocab[0] == vocab[1] else own
    for name in TOKENIZER_FILES:                      # an earlier export's would mislead
        (out / name).unlink(missing_ok=True)
    if not files:
        return None
    with tempfile.TemporaryDirectory(dir=out) as work:
        merged, complete = Path(work) / "merged", Path(work) / "complete"
        merged.mkdir()
        for name, path in files.items():
            shutil.copyfile(path, merged / name)
        save_tokenizer(read_tokenizer(merged), complete)
        for path in complete.iterdir():
            shutil.copyfile(path, out / path.name)
    if not (out / "special_tokens_map.json").exists():
        named = json.loads((out / "tokenizer_config.json").read_text())
        special = {k: named[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if named.get(k)}
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return read_tokenizer(out)


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


def hf_dtype(folder: str | Path) -> torch.dtype:
    """The dtype a Hugging Face folder's config.json names (transformers 5's `dtype`, 4's `torch_dtype`), one of
    WEIGHT_DTYPES; float32 where it names none."""
    config = json.loads((Path(folder) / "config.json").read_text())
    named = config.get("dtype") or config.get("torch_dtype")
    return {str(t).removeprefix("torch."): t for t in WEIGHT_DTYPES.values()}.get(named, torch.float32)


def _hf_tensor_files(folder: Path) -> dict[str, Path]:
    """Hugging Face name -> the .safetensors file holding it (model.safetensors, or the shards an index names)."""
    if (folder / HF_INDEX).is_file():
        return {name: folder / file for name, file in json.loads((folder / HF_INDEX).read_text())["weight_map"].items()}
    if not (folder / HF_WEIGHTS).is_file():
        raise ValueError(f"{folder}: neither {HF_WEIGHTS} nor its index")
    from safetensors import safe_open

    with safe_open(folder / HF_WEIGHTS, framework="pt") as f:
        return {name: folder / HF_WEIGHTS for name in f.keys()}


def read_piece(file, key: str, name: str, offsets: tuple, sizes: tuple, cfg) -> torch.Tensor:
    """Our parameter `name`'s piece at `offsets` with `sizes`, read from Hugging Face's tensor `key` in the open
    safetensors `file`: a slice (get_slice), in the file's dtype, nothing else. wq and wk, whose rows `to_hf`
    reordered within each head, are read by the whole heads the piece's rows fall in, put back in our order
    (`from_hf`), and cut to the piece: at most a head's rows more at each end."""
    from model import from_hf, has_rotary_rows

    box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
    if not has_rotary_rows(name):
        return file.get_slice(key)[box]
    first, last = box[0].start // cfg.head_dim * cfg.head_dim, -(-box[0].stop // cfg.head_dim) * cfg.head_dim
    heads = from_hf(name, file.get_slice(key)[(slice(first, last), *box[1:])], cfg)
    return heads[box[0].start - first:box[0].stop - first]


@torch.no_grad()
def load_hf(model, folder: str | Path) -> None:
    """Hugging Face Llama weights into the model at any layout, after `to_empty` (as `init_weights` would fill it):
    for each parameter it holds a piece of (its pipeline stage's only), each rank reads only that piece
    (`local_piece`, `read_piece`) in the folder's dtype, and converts it to the parameter's dtype and device as it
    copies it in. Ranks that shard a model read it about once between them, not once each
    (tests/recipe/test_checkpoint_hf.py counts the bytes each rank reads)."""
    from safetensors import safe_open

    from model import hf_name, local_piece

    folder = Path(folder)
    where = _hf_tensor_files(folder)
    opened = {}
    try:
        for name, param in model.named_parameters():
            name = name.replace("_orig_mod.", "")        # a compiled block's wrapper
            key = hf_name(name)
            if key not in where:
                raise ValueError(f"{folder} has no {key}" + (": its config says the output is not tied"
                                                              if name == "output.weight" else ""))
            if where[key] not in opened:
                opened[where[key]] = safe_open(where[key], framework="pt")
            shape = tuple(opened[where[key]].get_slice(key).get_shape())
            if shape != tuple(param.shape):
                raise ValueError(f"{folder}: {key} is {shape}, the model's {name} {tuple(param.shape)}")
            offsets, sizes, local = local_piece(param)
            if local.numel():
                local.copy_(read_piece(opened[where[key]], key, name, offsets, sizes, model.cfg))
    finally:
        opened.clear()
    model.init_rope()


def parse_bytes(text: str) -> int:
    """A size as save_pretrained's max_shard_size takes it: "5GB" (10^9 bytes), "500MiB" (2^20), or bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(([KMGT])(i?)B|B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"{text!r} is not a size (5GB, 500MiB, 1000000)")
    power = "KMGT".index(match[3].upper()) + 1 if match[3] else 0
    return int(float(match[1]) * (1024 if match[4] else 1000) ** power)


def export_main(argv: list[str] | None = None) -> None:
    """`python train.py export`: a committed checkpoint, at whatever layout it was written, for inference."""
    parser = argparse.ArgumentParser(
        prog="train.py export", description="The whole model from a committed checkpoint (any layout), for "
        "inference: one torch.save file (--format pt), or a Hugging Face Llama folder (--format hf: config.json, "
        "generation_config.json, the tokenizer's files and safetensors shards with their index) that "
        "LlamaForCausalLM.from_pretrained, AutoTokenizer, vLLM and evaluation harnesses open.")
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")   # one line, status 2
    parser.add_argument("--ckpt-dir", required=True, help="a --ckpt-dir of a training run, or one step_N in it")
    parser.add_argument("--out", required=True, help="the file (pt) or folder (hf) to write")
    parser.add_argument("--format", choices=["pt", "hf"], default="pt")
    parser.add_argument("--dtype", choices=sorted(WEIGHT_DTYPES), help="hf: the weights' dtype (default: the run's)")
    parser.add_argument("--max-shard-size", default="5GB", help="hf: the largest safetensors file (default 5GB, "
                        "as save_pretrained; a tensor larger than this gets a file of its own)")
    args = parser.parse_args(argv)
    path = Path(args.ckpt_dir)
    source = path if (path / ".metadata").exists() else latest(path)
    if source is None:
        parser.error(f"no committed checkpoint in {path}")
    try:
        if args.format == "hf":
            export_hf(source, args.out, WEIGHT_DTYPES.get(args.dtype), parse_bytes(args.max_shard_size))
        else:
            export(source, args.out)
    except (ValueError, OSError) as e:     # a checkpoint these exports cannot read, a folder they cannot write
        parser.error(str(e))
    print(f"exported {source} to {args.out} ({args.format})", flush=True)
