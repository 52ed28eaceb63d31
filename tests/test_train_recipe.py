"""scripts/train/, the training recipe, run as a project would: copied whole into an empty directory where
`helpers` cannot be imported, its tokenizer trained and its token file made by its own `prepare` step (a byte-level
BPE of TOKENIZER_VOCAB tokens), every layout a torchrun command line on CPU ranks (gloo; the GPUs hidden, so the
runs are the same on any machine).

What is proved, each from runs made once and shared between the asserts (a module-scoped fixture runs them all,
a few at a time):
- every layout (DDP, FSDP2, HSDP, TP, FSDP x TP, pipeline, pipeline x TP) gives the one-process run's losses, step by step, and
  its evaluation loss, within LOSS_RTOL; with the options a layout's run also carries (torch.compile and full
  activation checkpointing with DDP, selective checkpointing and flags from --config with TP, every other block
  checkpointed in the pipeline, async saves with FSDP2), which must not change what is computed;
- a run killed (SIGKILL, as a lost node) after step 2 and run again resumes from its checkpoint and then matches
  the uninterrupted run bit for bit, losses and final weights; so does one stopped by SIGTERM (which saves and
  exits with status 0);
- a checkpoint written by FSDP2 on 2 ranks, loaded by a 2-stage pipeline, trains on to the same losses and the
  same evaluation loss (within LOSS_RTOL): weights, optimizer state, schedule and data position all carried over;
- the checkpoint exported to Hugging Face's format opens with `LlamaForCausalLM.from_pretrained` and gives the
  recipe's logits; `--init-from` that folder at another layout (tensor parallel) starts from exactly those weights;
  generate.py writes text from the checkpoint and from the folder alike, with and without its key/value cache;
- a bad flag, an impossible layout, a token file larger than the model's vocabulary or a Hugging Face folder that
  is not a Llama is one line on stderr and exit status 2.
The 4-process runs are marked `four_ranks` (deselect with -m 'not four_ranks').
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.paths import SCRIPTS

RECIPE = SCRIPTS / "train"
# Same weights (init_weights draws each parameter whole from (seed, name)), same windows per step (the sampler cuts
# one permutation into global batches): the layouts differ only in the order of float32 sums (all-reduce against
# local sums, matmuls over sharded dimensions), a few ulps (float32's is 1.2e-7) of a loss near 5.5, grown a little
# by 4 Adam steps. Measured here: at most 1e-7 relative. A layout that is wrong (a missed reduction, a rank on the
# wrong windows, a misplaced shard, a resume off by one batch) moves the loss in the second or third digit.
LOSS_RTOL = 1e-5
TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--seq-len", "16", "--batch", "8",
        "--steps", "4",
        "--log-every", "2", "--eval-windows", "32", "--dtype", "fp32", "--no-compile"]
PARALLEL = 3          # torchrun jobs at once: their start (importing torch) waits on I/O as much as on the cores
RUN_TIMEOUT_S = 400
ALLOWED_THIRD_PARTY = {"torch", "numpy", "torchdata", "safetensors", "tokenizers"}
TOKENIZER_VOCAB = 512
PROMPT = "The with statement"


@dataclass
class Job:
    """One command in the workspace: torchrun with `nproc` ranks (None: plain python), after the jobs in `after`;
    `before` runs first (in the test process: copying a checkpoint)."""
    name: str
    args: list[str]
    nproc: int | None = 1
    after: tuple[str, ...] = ()
    before: object = None
    env: dict = field(default_factory=dict)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    metrics: list[dict]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def losses(self) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in self.metrics if "loss" in m}

    def final_eval(self) -> float:
        return next(m["eval_loss"] for m in self.metrics if m.get("final"))


def _run_all(workspace: Path, env: dict, jobs: list[Job]) -> dict[str, Result]:
    """Run `jobs` (PARALLEL at a time, each after its dependencies) and return their results by name."""
    done: dict[str, threading.Event] = {job.name: threading.Event() for job in jobs}
    results: dict[str, Result] = {}

    def run(job: Job) -> None:
        try:
            for name in job.after:
                done[name].wait()
            if job.before:
                job.before(workspace)
            metrics = workspace / f"{job.name}.jsonl"
            if job.nproc is None:
                command = [sys.executable, *(job.args if job.args[0].endswith(".py") else ["train.py", *job.args])]
            else:
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={job.nproc}", "train.py", "--data", "tokens.bin", *TINY,
                           "--metrics", str(metrics), *job.args]
            proc = subprocess.run(command, cwd=workspace, env=env | job.env, capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            results[job.name] = Result(proc.returncode, proc.stdout, proc.stderr, [json.loads(x) for x in lines])
        finally:
            done[job.name].set()

    with ThreadPoolExecutor(PARALLEL) as pool:
        # jobs are submitted in order and wait only on earlier ones, so PARALLEL threads never all wait
        for future in [pool.submit(run, job) for job in jobs]:
            future.result()
    return results


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, dict]:
    """An empty project with scripts/train/ copied in and its token file prepared by `train.py prepare`."""
    root = tmp_path_factory.mktemp("project")
    for source in RECIPE.glob("*.py"):
        shutil.copy(source, root / source.name)
    blocker = root / "no_helpers"
    blocker.mkdir()
    (blocker / "helpers.py").write_text("raise ImportError('the recipe must not import helpers')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COOKBOOK_", "PYTHON"))}
    env |= {"PYTHONPATH": str(blocker), "CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(root / "cache")}
    from pydoc_data.topics import topics

    (root / "tp.json").write_text(json.dumps({"tp": 2, "ac": "selective"}))   # flags from a file
    (root / "corpus.txt").write_text("\n\n".join(topics[key] for key in sorted(topics)), encoding="utf-8")
    (root / "not_llama").mkdir()
    (root / "not_llama" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    for out, tokenizer in (("tokens.bin", ["--train-tokenizer", str(TOKENIZER_VOCAB)]), ("bytes.bin", [])):
        prepared = subprocess.run([sys.executable, "train.py", "prepare", "--text", "corpus.txt", "--out", out,
                                   *tokenizer], cwd=root, env=env, capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S)
        assert prepared.returncode == 0, prepared.stderr
    return root, env


def _copy_step(source: str, step: int, target: str):
    def copy(root: Path) -> None:
        shutil.copytree(root / source / f"step_{step:08d}", root / target / f"step_{step:08d}")
    return copy


@pytest.fixture(scope="module")
def runs(workspace) -> dict[str, Result]:
    """Every run of 1 or 2 ranks the tests below read, each made once."""
    root, env = workspace
    ckpt = ["--save-every", "2"]
    return _run_all(root, env, [
        Job("one", [], 1),
        Job("fsdp", ["--ckpt-dir", "ck_fsdp", *ckpt, "--eval-every", "2", "--async-save", "--export", "live.pt"], 2),
        Job("crash", ["--ckpt-dir", "ck_crash", *ckpt, "--crash-at", "2"], 2),
        Job("ddp", ["--dp-replicate", "2", "--dp-shard", "1", "--compile", "--ac", "full"], 2),
        Job("tp", ["--config", "tp.json"], 2),
        Job("pp", ["--pp", "2", "--accum", "2", "--ac", "alternate"], 2),
        Job("term", ["--ckpt-dir", "ck_term", "--save-every", "3", "--crash-at", "2", "--crash-signal", "TERM"], 1),
        Job("resumed", ["--ckpt-dir", "ck_crash", *ckpt], 2, after=("crash",)),
        Job("term_resumed", ["--ckpt-dir", "ck_term"], 1, after=("term",)),
        Job("resharded", ["--ckpt-dir", "ck_reshard", "--pp", "2", "--accum", "2"], 2, after=("fsdp",),
            before=_copy_step("ck_fsdp", 2, "ck_reshard")),
        Job("export_fsdp", ["export", "--ckpt-dir", "ck_fsdp", "--out", "fsdp.pt"], None, after=("fsdp",)),
        Job("export_resumed", ["export", "--ckpt-dir", "ck_crash", "--out", "resumed.pt"], None,
            after=("resumed",)),
        Job("export_hf", ["export", "--ckpt-dir", "ck_fsdp", "--format", "hf", "--out", "hf_llama"], None,
            after=("fsdp",)),
        Job("init_from", ["--init-from", "hf_llama", "--tp", "2", "--lr", "0", "--steps", "1"], 2, after=("export_hf",)),
        Job("generate_ckpt", ["generate.py", "--model", "ck_fsdp", "--prompt", PROMPT, "--max-new-tokens", "12"],
            None, after=("fsdp",)),
        Job("generate_hf", ["generate.py", "--model", "hf_llama", "--prompt", PROMPT, "--max-new-tokens", "12"],
            None, after=("export_hf",)),
        *[Job(f"sample{suffix}", ["generate.py", "--model", "ck_fsdp", "--prompt", PROMPT, "--max-new-tokens", "12",
                                  "--temperature", "0.9", "--top-k", "20", "--seed", "3", *flags], None, after=("fsdp",))
          for suffix, flags in (("", []), ("_no_cache", ["--no-cache"]))],
        Job("bad_flag", ["--no-such-flag"], None),
        Job("bad_layout", ["--tp", "3"], None, env={"WORLD_SIZE": "4"}),
        Job("bad_kv_heads", ["--n-heads", "4", "--n-kv-heads", "3"], None),
        Job("bad_tp_kv_heads", ["--tp", "2", "--n-kv-heads", "1", "--data", "tokens.bin"], None,
            env={"WORLD_SIZE": "2"}),
        Job("bad_vocab", ["--data", "tokens.bin", "--vocab-size", "256"], None),
        Job("bad_hf", ["--init-from", "not_llama"], None),
    ])


@pytest.fixture(scope="module")
def runs4(workspace) -> dict[str, Result]:
    """The runs of 4 ranks (4 processes on this machine's cores: slow, and grouped)."""
    root, env = workspace
    return _run_all(root, env, [
        Job("fsdp4", [], 4),
        Job("hsdp", ["--dp-replicate", "2", "--dp-shard", "2"], 4),
        Job("fsdp_tp", ["--tp", "2"], 4),
        Job("pp_tp", ["--pp", "2", "--tp", "2", "--accum", "2"], 4),
    ])


def _assert_clean(result: Result, name: str) -> None:
    assert result.returncode == 0, f"{name} failed:\n{result.output[-4000:]}"
    assert "terminate called" not in result.output, f"{name} aborted at exit:\n{result.output[-4000:]}"


def _assert_same_losses(result: Result, reference: Result, name: str) -> None:
    import math

    got, want = result.losses(), reference.losses()
    assert sorted(got) == sorted(want) == [1, 2, 3, 4], f"{name}: steps {sorted(got)}"
    far = {step: (got[step], want[step]) for step in want
           if not math.isclose(got[step], want[step], rel_tol=LOSS_RTOL)}
    assert not far, f"{name}: losses differ from one process's beyond {LOSS_RTOL} (step: got, one process): {far}"
    assert math.isclose(result.final_eval(), reference.final_eval(), rel_tol=LOSS_RTOL), \
        f"{name}: eval loss {result.final_eval()} against one process's {reference.final_eval()}"


def test_under_xdist_the_recipes_runs_are_made_on_one_worker(request):
    """The runs above are module-scoped fixtures: tests/conftest.py puts this module's tests in one xdist group, so
    one worker makes them once. Without the group each worker that gets a test makes every run again (in 2026 a
    pytest release silently dropped the groups: the suite took 3 minutes longer)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None or not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run by pytest-xdist with --dist loadgroup")
    assert request.node.nodeid.endswith("@recipe"), f"{request.node.nodeid} is in no xdist group"


def test_prepare_writes_the_texts_bytes_with_a_held_out_tail(workspace):
    import numpy as np

    root, _ = workspace
    text = (root / "corpus.txt").read_bytes()
    meta = json.loads((root / "bytes.bin.json").read_text())
    tokens = np.memmap(root / "bytes.bin", dtype=np.uint8, mode="r")
    assert bytes(tokens) == text
    assert meta["tokens"] == len(text) and 0 < meta["eval_start"] < len(text) and meta["vocab_size"] == 256


def test_prepare_trains_a_bpe_tokenizer_whose_tokens_decode_to_the_text(workspace):
    import numpy as np
    from tokenizers import Tokenizer

    root, _ = workspace
    meta = json.loads((root / "tokens.bin.json").read_text())
    tokenizer = Tokenizer.from_file(str(root / meta["tokenizer"]))
    tokens = np.memmap(root / "tokens.bin", dtype=np.uint16, mode="r")
    assert meta["vocab_size"] == tokenizer.get_vocab_size() == TOKENIZER_VOCAB and meta["dtype"] == "uint16"
    assert tokens[-1] == meta["eot_id"] == tokenizer.token_to_id("<|endoftext|>"), "the document ends with its token"
    assert tokenizer.decode(tokens[:-1].tolist()) == (root / "corpus.txt").read_text(encoding="utf-8")
    assert len(tokens) < 0.6 * len((root / "corpus.txt").read_bytes()), "BPE merges bytes: fewer tokens than bytes"


def test_one_process_trains(runs):
    _assert_clean(runs["one"], "one process")
    losses = runs["one"].losses()
    assert losses[4] < losses[1], losses
    first_line = runs["one"].stdout.splitlines()[0]
    assert "steps 1 to 4" in first_line and "time left" in first_line, first_line


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp", "pp"])
def test_a_layout_of_two_ranks_matches_one_process(runs, layout):
    _assert_clean(runs[layout], layout)
    _assert_same_losses(runs[layout], runs["one"], layout)


@pytest.mark.four_ranks
@pytest.mark.parametrize("layout", ["fsdp4", "hsdp", "fsdp_tp", "pp_tp"])
def test_a_layout_of_four_ranks_matches_one_process(runs, runs4, layout):
    _assert_clean(runs4[layout], layout)
    _assert_same_losses(runs4[layout], runs["one"], layout)


def test_a_run_killed_by_sigkill_resumes_bit_for_bit(runs, workspace):
    import torch

    root, _ = workspace
    crash, resumed, uninterrupted = runs["crash"], runs["resumed"], runs["fsdp"]
    assert crash.returncode != 0 and sorted(crash.losses()) == [1, 2], crash.output[-3000:]
    _assert_clean(resumed, "resumed")
    assert "resumed from ck_crash/step_00000002" in resumed.stdout, resumed.stdout
    assert resumed.losses() == {s: uninterrupted.losses()[s] for s in (3, 4)}
    assert resumed.final_eval() == uninterrupted.final_eval()
    for name in ("export_fsdp", "export_resumed"):
        _assert_clean(runs[name], name)
    mine, theirs, live = (torch.load(root / f, weights_only=True) for f in ("resumed.pt", "fsdp.pt", "live.pt"))
    assert mine["config"] == theirs["config"] == live["config"]
    torch.testing.assert_close(mine["model"], theirs["model"], rtol=0, atol=0)
    # the export the training processes wrote at the end (gathered by get_model_state_dict) is the same model
    torch.testing.assert_close(live["model"], theirs["model"], rtol=0, atol=0)


def test_sigterm_saves_exits_cleanly_and_resumes_bit_for_bit(runs):
    term, resumed = runs["term"], runs["term_resumed"]
    _assert_clean(term, "term")
    assert "stopping on signal 15" in term.stdout and sorted(term.losses()) == [1, 2], term.stdout
    assert json.loads(term.stdout.split("summary: ")[1])["checkpoint"].endswith("step_00000002")
    _assert_clean(resumed, "term_resumed")
    assert resumed.losses() == {s: runs["one"].losses()[s] for s in (3, 4)}
    assert resumed.final_eval() == runs["one"].final_eval()


def test_a_checkpoint_of_fsdp_loads_into_a_pipeline_and_trains_on_alike(runs):
    import math

    resharded, source = runs["resharded"], runs["fsdp"]
    _assert_clean(resharded, "resharded")
    assert "resumed from ck_reshard/step_00000002" in resharded.stdout, resharded.stdout
    assert sorted(resharded.losses()) == [3, 4]
    for step in (3, 4):
        assert math.isclose(resharded.losses()[step], source.losses()[step], rel_tol=LOSS_RTOL)
    assert math.isclose(resharded.final_eval(), source.final_eval(), rel_tol=LOSS_RTOL)


@pytest.mark.parametrize("name, message", [
    ("bad_flag", "unrecognized arguments: --no-such-flag"),
    ("bad_layout", "= 3, but the world size is 4"),
    ("bad_kv_heads", "n_kv_heads 3 must divide n_heads 4"),
    ("bad_tp_kv_heads", "tp 2 must divide the 4 query and 1 key/value heads"),
    ("bad_vocab", f"the token file's vocabulary ({TOKENIZER_VOCAB}) exceeds the model's (256)"),
    ("bad_hf", "not_llama is not a Llama this recipe can load: model_type 'gpt2' is not 'llama'")])
def test_a_bad_flag_is_one_line_and_status_2(runs, name, message):
    result = runs[name]
    assert result.returncode == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:") and message in lines[0], result.stderr


@pytest.mark.parametrize("module", sorted(p.name for p in RECIPE.glob("*.py")))
def test_the_recipe_imports_only_torch_numpy_torchdata_the_standard_library_and_itself(module):
    tree = ast.parse((RECIPE / module).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    own = {p.stem for p in RECIPE.glob("*.py")}
    foreign = sorted(m for m in imported if m not in sys.stdlib_module_names | ALLOWED_THIRD_PARTY | own)
    assert foreign == [], f"{module} imports {foreign}"


def test_an_hf_export_opens_in_transformers_and_gives_the_recipes_logits(runs, workspace):
    """export --format hf, then `LlamaForCausalLM.from_pretrained`: the logits of the checkpoint's model within
    1e-5 (both fp32 on the CPU; measured about 1e-7), on a batch of the held-out tokens."""
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    root, _ = workspace
    _assert_clean(runs["export_hf"], "export_hf")
    assert {p.name for p in (root / "hf_llama").iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    sys.path.insert(0, str(root))
    try:
        import generate
        ours, _, _ = generate.load(root / "ck_fsdp")
    finally:
        sys.path.remove(str(root))
    theirs = LlamaForCausalLM.from_pretrained(root / "hf_llama").eval()
    tokens = torch.from_numpy(np.memmap(root / "tokens.bin", dtype=np.uint16, mode="r")[-64:].astype(np.int64))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens.view(4, 16)).logits, ours(tokens.view(4, 16)), rtol=0, atol=1e-5)


def test_init_from_an_hf_folder_starts_from_its_weights_at_another_layout(runs):
    """The folder exported from the FSDP2 run, loaded into tensor parallel 2 and not moved (--lr 0): the same
    held-out loss as the run that wrote it."""
    import math

    _assert_clean(runs["init_from"], "init_from")
    assert "weights of hf_llama" in runs["init_from"].stdout and "as TP 2" in runs["init_from"].stdout
    assert math.isclose(runs["init_from"].final_eval(), runs["fsdp"].final_eval(), rel_tol=LOSS_RTOL)


def test_generate_writes_text_from_a_checkpoint_and_its_export_alike_with_or_without_a_cache(runs):
    outputs = {name: runs[name] for name in ("generate_ckpt", "generate_hf", "sample", "sample_no_cache")}
    for name, result in outputs.items():
        _assert_clean(result, name)
        assert result.stdout.startswith(PROMPT) and len(result.stdout) > len(PROMPT) + 4, result.output
    assert outputs["generate_ckpt"].stdout == outputs["generate_hf"].stdout, "the same weights, the same text"
    assert outputs["sample"].stdout == outputs["sample_no_cache"].stdout, "the key/value cache changes no token"
