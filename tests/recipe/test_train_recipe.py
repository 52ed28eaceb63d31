"""scripts/train/, the training recipe, run as a project would: copied whole into an empty directory where
`helpers` cannot be imported, its tokenizer trained and its token file made by its own `prepare` step (a byte-level
BPE of TOKENIZER_VOCAB tokens), every layout a torchrun command line on CPU ranks (gloo; the GPUs hidden, so the
runs are the same on any machine).

The recipe's own `selftest.py` runs first, from the copy, as a copier would run it after an edit: every layout of
2 processes (FSDP2, TP, pipeline) gives one process's losses, a run killed by SIGKILL after step 3 resumes from its
step-2 checkpoint bit for bit with each step once in its metrics file, the model gathered at the end is the
checkpoint's, and FSDP2's checkpoint trains on in a pipeline. Its runs (kept in `st/`) are this module's too:
nothing runs twice. What else is proved, each from runs made once and shared between the asserts (a module-scoped
fixture runs them all, a few at a time, with selftest's runner):
- DDP (with torch.compile and full activation checkpointing, and the TensorBoard, profiler and memory-snapshot
  flags, which must not change what is computed), context parallel (each sequence split over 2 ranks), the
  4-rank layouts (HSDP, FSDP x TP, pipeline x TP) and two pipeline stages per rank (interleaved 1F1B, interleaved
  zero bubble; against a one-process run of 4 layers) give the one-process run's losses within LOSS_RTOL;
- a model with dropout (a wrapper adds it) stopped by SIGTERM, with the ranks agreeing every 2 steps, saves within
  one interval and exits 0; resumed, it matches the uninterrupted run bit for bit: each rank's generator travels
  with the checkpoint;
- an interleaved pipeline under FSDP2 (4 ranks), resumed from its step-2 checkpoint, takes steps 3 and 4 bit for bit
  as the run that went on: its checkpoint holds every stage's optimizer groups;
- the checkpoint exported to Hugging Face's format opens with `LlamaForCausalLM.from_pretrained` and gives the
  recipe's logits; `--init-from` that folder at another layout (tensor parallel) starts from exactly those weights;
  generate.py writes text from the checkpoint and from the folder alike, with and without its key/value cache;
- a bad flag, an impossible layout, a token file larger than the model's vocabulary or a Hugging Face folder that
  is not a Llama is one line on stderr and exit status 2.
The 4-process runs are marked `four_ranks` (deselect with -m 'not four_ranks').
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import SCRIPTS

RECIPE = SCRIPTS / "train"
# Same weights (init_weights draws each parameter from (seed, name), the same numbers at every layout), same windows
# per step (the sampler cuts one permutation into global batches): the layouts differ only in the order of float32
# sums (all-reduce against local sums, matmuls over sharded dimensions), a few ulps (float32's is 1.2e-7) of a loss
# near 5.5, grown a little by 4 Adam steps. Measured here: at most 1e-7 relative. A layout that is wrong (a missed
# reduction, a rank on the wrong windows, a misplaced shard, a resume off by one batch) moves the loss in the
# second or third digit.
LOSS_RTOL = 1e-5
PARALLEL = 3          # torchrun jobs at once: their start (importing torch) waits on I/O as much as on the cores
SELFTEST_PARALLEL = 2
ALLOWED_THIRD_PARTY = {"torch", "numpy", "torchdata", "safetensors", "tokenizers", "jinja2"}   # jinja2: torch needs it
OPTIONAL_THIRD_PARTY = {"torchao": "float8.py"}    # imported inside that module's functions, for --float8 only
TOKENIZER_VOCAB = 512
PROMPT = "The with statement"
LLAMA3 = "Llama-3.2-download"     # tests/recipe/user_folders.py's Llama 3.2 folder, in the project
LAYERS4 = ["--n-layers", "4", "--accum", "4"]   # 4 stages of one block each for the two-stages-per-rank schedules
MOE = ["--moe-experts", "4", "--moe-top-k", "2"]
PP_FSDP = [*LAYERS4, "--pp", "2", "--dp-shard", "2", "--pp-schedule", "interleaved"]     # 4 ranks
# What a user's edit might add: dropout after each block's feed-forward (train.py run through this wrapper)
DROPOUT = """import torch.nn.functional as F
import model
feed_forward = model.FeedForward.forward
model.FeedForward.forward = lambda self, x: F.dropout(feed_forward(self, x), 0.2, self.training)
import train
train.main()
"""
# TensorBoard is not installed here: a stand-in torch.utils.tensorboard whose SummaryWriter keeps the scalars
OBSERVE = """import json, os, sys, types
class SummaryWriter:
    def __init__(self, folder):
        os.makedirs(folder, exist_ok=True)
        self.file = open(os.path.join(folder, "scalars.jsonl"), "a")
    def add_scalar(self, name, value, step):
        print(json.dumps({"name": name, "value": value, "step": step}), file=self.file, flush=True)
    def close(self):
        self.file.close()
sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(SummaryWriter=SummaryWriter)
import train
train.main()
"""


def _selftest():
    """The recipe's selftest.py as a module: its Run, Result and runner serve this file's runs too."""
    sys.path.insert(0, str(RECIPE))           # it imports the recipe's modules by name
    spec = importlib.util.spec_from_file_location("recipe_selftest", RECIPE / "selftest.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # a dataclass looks its module up
    spec.loader.exec_module(module)
    return module


selftest = _selftest()
Run, Result = selftest.Run, selftest.Result
# One run here is selftest.py itself (seven torchrun runs, two at a time): the copied recipe's 600 s for one run is not
# room for seven. Every run of this module took 347 s in all on a loaded 2-core machine; the first test that reads
# them waits for all of them.
selftest.RUN_TIMEOUT_S = 3600
pytestmark = pytest.mark.timeout(3600)


def _only_the_quick_tier(request) -> bool:
    """The tests of this module that run are all of the quick tier (tests/quick_tier.py): the one-process run and 2-rank
    FSDP2, and checks that read no run. The fixtures below then make only what those read."""
    return all(item.get_closest_marker("quick") for item in request.session.items if item.module is request.module)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, request) -> tuple[Path, dict]:
    """An empty project with scripts/train/ copied in and its token files prepared by `train.py prepare` (a BPE
    trained here; for the full module also bytes, and a Llama 3.2 download's tokenizer: that folder copied in as
    `LLAMA3`)."""
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
    (root / "dropout.py").write_text(DROPOUT)
    (root / "observe.py").write_text(OBSERVE)
    (root / "corpus.txt").write_text("\n\n".join(topics[key] for key in sorted(topics)), encoding="utf-8")
    (root / "not_llama").mkdir()
    (root / "not_llama" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    prepares = [("tokens.bin", ["--train-tokenizer", str(TOKENIZER_VOCAB)])]
    if not _only_the_quick_tier(request):
        shutil.copytree(request.getfixturevalue("downloads").llama3, root / LLAMA3)
        prepares += [("bytes.bin", []), ("l3.bin", ["--tokenizer", LLAMA3])]
    for out, tokenizer in prepares:
        prepared = subprocess.run([sys.executable, "train.py", "prepare", "--text", "corpus.txt", "--out", out,
                                   *tokenizer], cwd=root, env=env, capture_output=True, text=True,
                                  timeout=selftest.RUN_TIMEOUT_S)
        assert prepared.returncode == 0, prepared.stderr
    return root, env


@pytest.fixture(scope="module")
def runs(workspace, request) -> dict[str, Result]:
    """Every run of 1 or 2 ranks the tests below read, each made once: selftest.py's (in st/) and this file's; for the
    quick tier, only selftest's two runs it reads."""
    root, env = workspace
    if _only_the_quick_tier(request):
        return selftest.run_jobs(root, env, [job for job in selftest.jobs() if job.name in ("one", "fsdp")], PARALLEL,
                                 ["tokens.bin"])
    st = ["--ckpt-dir", "st/ck_fsdp"]
    results = selftest.run_jobs(root, env, [
        Run("selftest", ["selftest.py", "--keep", "st", "--data", "tokens.bin", "--parallel",
                         str(SELFTEST_PARALLEL)], None),
        Run("ddp", ["observe.py", "--dp-replicate", "2", "--dp-shard", "1", "--compile", "--ac", "full",
                    "--tensorboard", "tb", "--profile-steps", "2:3", "--profile-dir", "prof",
                    "--memory-snapshot", "snap"], 2),
        Run("dropout", ["dropout.py"], 2),
        Run("term", ["dropout.py", "--ckpt-dir", "ck_term", "--save-every", "3", "--stop-check-every", "2",
                     "--crash-at", "1", "--crash-signal", "TERM"], 2),
        Run("term_resumed", ["dropout.py", "--ckpt-dir", "ck_term"], 2, after=("term",), metrics="term"),
        Run("export_fsdp", ["export", *st, "--out", "fsdp.pt"], None, after=("selftest",)),
        Run("export_resumed", ["export", "--ckpt-dir", "st/ck_crash", "--out", "resumed.pt"], None,
            after=("selftest",)),
        Run("export_hf", ["export", *st, "--format", "hf", "--out", "hf_llama"], None, after=("selftest",)),
        Run("init_from", ["--init-from", "hf_llama", "--tp", "2", "--lr", "0", "--steps", "1",
                          "--tensorboard", "tb_missing"], 2, after=("export_hf",)),
        Run("generate_ckpt", ["generate.py", "--model", "st/ck_fsdp", "--prompt", PROMPT, "--max-new-tokens", "12"],
            None, after=("selftest",)),
        Run("generate_hf", ["generate.py", "--model", "hf_llama", "--prompt", PROMPT, "--max-new-tokens", "12"],
            None, after=("export_hf",)),
        *[Run(f"sample{suffix}", ["generate.py", "--model", "st/ck_fsdp", "--prompt", PROMPT, "--max-new-tokens",
                                  "12", "--temperature", "0.9", "--top-k", "20", "--seed", "3", *flags], None,
              after=("selftest",))
          for suffix, flags in (("", []), ("_no_cache", ["--no-cache"]))],
        Run("bad_flag", ["--no-such-flag"], None),
        # fine-tuning a download: its weights, its tokenizer's tokens; exported in files of 100 kB, and generated from
        Run("l3_init", ["--init-from", LLAMA3, "--dim", "64", "--data", "l3.bin", "--steps", "2", "--ckpt-dir",
                        "ck_l3"], 2),
        Run("l3_export", ["export", "--ckpt-dir", "ck_l3", "--format", "hf", "--out", "hf_l3", "--max-shard-size",
                          "100kB"], None, after=("l3_init",)),
        Run("l3_generate", ["generate.py", "--model", "hf_l3", "--prompt", PROMPT, "--max-new-tokens", "12"], None,
            after=("l3_export",)),
        # two stages per rank need twice the layers: a one-process run of that model, then the schedules
        Run("one4", [*LAYERS4, "--ckpt-dir", "ck_one4"], 1),
        Run("pp_interleaved", [*LAYERS4, "--pp", "2", "--pp-schedule", "interleaved"], 2),
        Run("pp_zero_bubble", [*LAYERS4, "--pp", "2", "--pp-schedule", "interleaved-zb", "--ckpt-dir", "ck_zb"], 2),
        # each sequence split over the 2 ranks: ring attention (cp.py), under selective checkpointing, whose policy
        # recomputes the ring (its ops run with autograd off) rather than keep its score blocks
        Run("cp", ["--cp", "2", "--ac", "selective"], 2),
        # experts: 2 ranks, each holding half of them, 2 micro-batches each, against one process whose 4
        # micro-batches are theirs (the balancing loss is taken over each quarter of the batch in both); experts held
        # by several ranks: tests/recipe/test_expert_grads.py
        Run("moe_one", [*MOE, "--accum", "4", "--ckpt-dir", "ck_moe_one"], 1),
        Run("moe_ep", [*MOE, "--ep", "2", "--accum", "2", "--ac", "alternate", "--ckpt-dir", "ck_moe_ep"], 2),
    ], PARALLEL, ["tokens.bin"])
    saved = root / "st" / "results.json"
    for name, fields in (json.loads(saved.read_text()) if saved.exists() else {}).items():
        results[name] = Result(**fields)
    return results


@pytest.fixture(scope="module")
def runs4(workspace) -> dict[str, Result]:
    """The runs of 4 ranks (4 processes on this machine's cores: slow, and grouped)."""
    root, env = workspace
    return selftest.run_jobs(root, env, [
        Run("hsdp", ["--dp-replicate", "2", "--dp-shard", "2"], 4),
        Run("fsdp_tp", ["--tp", "2"], 4),
        Run("pp_tp", ["--pp", "2", "--tp", "2", "--accum", "2"], 4),
        # two stages per rank, each sharded by FSDP2: saved at step 2 and on to 4; resumed from a copy of step 2
        Run("pp_fsdp", [*PP_FSDP, "--ckpt-dir", "ck_pp_fsdp", "--save-every", "2"], 4),
        Run("pp_fsdp_resumed", [*PP_FSDP, "--ckpt-dir", "ck_pp_fsdp_resumed"], 4, after=("pp_fsdp",),
            before=selftest.copy_checkpoint("ck_pp_fsdp", 2, "ck_pp_fsdp_resumed")),
    ], PARALLEL, ["tokens.bin"])


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
    tokenizer = Tokenizer.from_file(str(root / meta["tokenizer"] / "tokenizer.json"))
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


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp", "pp", "cp"])
def test_a_layout_of_two_ranks_matches_one_process(runs, layout):
    _assert_clean(runs[layout], layout)
    _assert_same_losses(runs[layout], runs["one"], layout)


@pytest.mark.four_ranks
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp", "pp_tp"])
def test_a_layout_of_four_ranks_matches_one_process(runs, runs4, layout):
    _assert_clean(runs4[layout], layout)
    _assert_same_losses(runs4[layout], runs["one"], layout)


@pytest.mark.four_ranks
def test_an_interleaved_pipeline_with_fsdp2_resumes_bit_for_bit(runs4):
    """Each rank's two stages, sharded by FSDP2, save one checkpoint: every stage's optimizer groups are in it
    under their parameters' names, so the run resumed from step 2 takes steps 3 and 4 exactly as the run that went
    on (loaded, a stage's groups went missing: AdamW's step failed on their lost hyperparameters)."""
    saved, resumed = runs4["pp_fsdp"], runs4["pp_fsdp_resumed"]
    _assert_clean(saved, "pp_fsdp")
    _assert_clean(resumed, "pp_fsdp_resumed")
    assert "resumed from ck_pp_fsdp_resumed/step_00000002" in resumed.stdout, resumed.stdout
    assert sorted(saved.losses()) == [1, 2, 3, 4] and sorted(resumed.losses()) == [3, 4], resumed.metrics
    assert resumed.losses() == {step: saved.losses()[step] for step in (3, 4)}
    assert resumed.final_eval() == saved.final_eval()


@pytest.mark.parametrize("layout", ["pp_interleaved", "pp_zero_bubble"])
def test_two_pipeline_stages_per_rank_match_one_process(runs, layout):
    """Interleaved 1F1B and interleaved zero bubble (ScheduleInterleavedZeroBubble: the weight gradients fill the
    bubble): 4 stages over 2 ranks, each rank two models (pipeline.py's StagesView shows them as one to the
    optimizer, the gradient norm and the checkpoint)."""
    _assert_clean(runs["one4"], "one4")
    _assert_clean(runs[layout], layout)
    _assert_same_losses(runs[layout], runs["one4"], layout)


def test_experts_shared_out_over_two_ranks_match_one_process(runs, workspace):
    """--moe-experts 4 --ep 2: each rank holds 2 experts (FSDP2 leaves them alone), tokens travel by all-to-all, and
    each expert's gradient is summed over the ranks and divided by them; every other block checkpointed (--ac
    alternate: its backward recomputes the routing and the all-to-alls, which must change nothing), 2 micro-batches
    each. One process with --accum 4 computes the same step: its micro-batches are the ranks' quarters of the batch,
    the load-balancing loss taken over each. Losses and gradient norms agree (AdamW forgives a gradient's scale: the norm, and the clipping it drives, does not), and the
    checkpoint holds every expert whole under the one-process run's names, with its weights."""
    import torch
    import torch.distributed.checkpoint as dcp

    from config import LlamaArgs
    from model import Llama
    from moe import apply_moe

    for name in ("moe_one", "moe_ep"):
        _assert_clean(runs[name], name)
    _assert_same_losses(runs["moe_ep"], runs["moe_one"], "moe_ep")
    one, ep = ({m["step"]: m["grad_norm"] for m in runs[name].metrics if "grad_norm" in m}
               for name in ("moe_one", "moe_ep"))
    assert sorted(one) == sorted(ep) == [1, 2, 3, 4] and all(abs(ep[s] - one[s]) <= 1e-4 * one[s] for s in one), \
        (ep, one)
    assert "4 experts a block, top 2" in runs["moe_ep"].stdout.splitlines()[0]
    root, _ = workspace
    states = []
    for folder in ("ck_moe_one", "ck_moe_ep"):
        step = root / folder / "step_00000004"
        config = json.loads((step / "config.json").read_text())
        with torch.device("meta"):
            model = Llama(LlamaArgs(**config["model"]))
            apply_moe(model, config["args"]["moe_experts"], config["args"]["moe_top_k"])
        model.to_empty(device="cpu")
        state = model.state_dict()
        dcp.load({"train": {"model": state}}, checkpoint_id=step)
        states.append(state)
    assert states[0].keys() == states[1].keys() and "layers.0.feed_forward.experts.w1.weight" in states[0]
    # Adam divides each gradient element by its own scale, so where a gradient is near zero the reordered float sums
    # of the all-to-all show in the weight at the step size's scale: 1e-4, a hundredth of what 4 steps of lr 3e-3
    # move a weight, and far below a misplaced expert (off by the weights' own size)
    for key, want in states[0].items():
        torch.testing.assert_close(states[1][key], want, rtol=0, atol=1e-4, msg=key)


def test_a_checkpoint_of_experts_is_refused_by_the_dense_exports_in_one_line(workspace, runs, capsys):
    import checkpoint

    root, _ = workspace
    for form in ("pt", "hf"):
        with pytest.raises(SystemExit) as refused:
            checkpoint.export_main(["--ckpt-dir", str(root / "ck_moe_ep"), "--format", form, "--out", str(root / "x")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert refused.value.code == 2 and len(lines) == 1 and "holds a mixture of experts" in lines[0], lines


def test_two_stages_per_rank_save_the_whole_models_checkpoint(runs, workspace):
    """Their checkpoint holds the whole model under its own names: one process loads it as it loads one process's
    own, and the weights are that run's (4 AdamW steps on the same gradients, up to the order of float sums)."""
    import torch

    from checkpoint import full_model_state   # the recipe's (scripts/train/ is on the path, as for train below)

    root, _ = workspace
    _assert_clean(runs["pp_zero_bubble"], "pp_zero_bubble")
    _, staged, _ = full_model_state(root / "ck_zb" / "step_00000004")
    _, whole, _ = full_model_state(root / "ck_one4" / "step_00000004")
    assert staged.keys() == whole.keys()
    torch.testing.assert_close(staged, whole, rtol=1e-5, atol=1e-6)


def test_the_recipes_selftest_passes_from_a_copy_of_the_folder(runs, workspace):
    """selftest.py, run from the copy as a copier runs it: every check it makes holds (its runs are read below), and
    it printed one line for each check its `checks` makes of those runs."""
    root, _ = workspace
    result = runs["selftest"]
    _assert_clean(result, "selftest.py")
    checks = [line for line in result.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    made = selftest.checks({job.name: runs[job.name] for job in selftest.jobs()}, root / "st")
    assert len(checks) == len(made) and all(line.startswith("ok") for line in checks), result.stdout
    assert "checks hold" in result.stdout.splitlines()[-1]


def test_a_run_killed_by_sigkill_resumes_bit_for_bit_and_logs_each_step_once(runs, workspace):
    import torch

    root, _ = workspace
    crash, resumed, uninterrupted = runs["crash"], runs["resumed"], runs["fsdp"]
    assert crash.returncode != 0 and sorted(crash.losses()) == [1, 2, 3], crash.output[-3000:]
    _assert_clean(resumed, "resumed")
    assert "resumed from ck_crash/step_00000002" in resumed.stdout, resumed.stdout
    # the killed attempt logged step 3 after its last checkpoint; the resumed one dropped that line and logged it anew
    assert [m["step"] for m in resumed.metrics if "loss" in m] == [1, 2, 3, 4]
    assert resumed.losses() == uninterrupted.losses()
    assert resumed.final_eval() == uninterrupted.final_eval()
    for name in ("export_fsdp", "export_resumed"):
        _assert_clean(runs[name], name)
    mine, theirs, live = (torch.load(root / f, weights_only=True) for f in ("resumed.pt", "fsdp.pt", "st/live.pt"))
    assert mine["config"] == theirs["config"] == live["config"]
    torch.testing.assert_close(mine["model"], theirs["model"], rtol=0, atol=0)
    # the export the training processes wrote at the end (gathered by get_model_state_dict) is the same model
    torch.testing.assert_close(live["model"], theirs["model"], rtol=0, atol=0)


def test_dropout_stopped_by_sigterm_saves_within_a_check_and_resumes_bit_for_bit(runs):
    """Rank 1 gets SIGTERM after step 1; the ranks agree every 2 steps (no collective in between), so both stop
    after step 2, save it and exit 0. With dropout in the model (a user's edit), the resumed run matches the
    uninterrupted one bit for bit: each rank's generator was saved with the checkpoint and restored."""
    term, resumed, uninterrupted = runs["term"], runs["term_resumed"], runs["dropout"]
    for name in ("term", "term_resumed", "dropout"):
        _assert_clean(runs[name], name)
    assert "stopping on signal" in term.stdout and sorted(term.losses()) == [1, 2], term.stdout
    summary = json.loads(term.stdout.split("summary: ")[1].splitlines()[0])
    assert summary["stopped"] and summary["checkpoint"].endswith("step_00000002"), summary
    assert uninterrupted.losses()[2] != runs["fsdp"].losses()[2], "dropout changes what is computed"
    assert "resumed from ck_term/step_00000002" in resumed.stdout, resumed.stdout
    assert [m["step"] for m in resumed.metrics if "loss" in m] == [1, 2, 3, 4]
    assert resumed.losses() == uninterrupted.losses()
    assert resumed.final_eval() == uninterrupted.final_eval()


def test_tensorboard_profiler_and_memory_snapshot_flags(runs, workspace):
    """Through a stand-in TensorBoard writer (the package is not installed here): rank 0's log line as scalars;
    each rank's profiler trace of steps 2 and 3; on CPU ranks the memory snapshot says in one line that it has
    nothing to record. Without the package --tensorboard is one line and the run goes on."""
    root, _ = workspace
    _assert_clean(runs["ddp"], "ddp")
    scalars = [json.loads(line) for line in (root / "tb" / "scalars.jsonl").read_text().splitlines()]
    assert {(s["name"], s["step"]) for s in scalars} >= {("loss", 1), ("loss", 4), ("tokens_per_s", 2),
                                                         ("eval_loss", 4)}
    assert [s["value"] for s in scalars if s["name"] == "loss"] == [runs["ddp"].losses()[s] for s in (1, 2, 4)]
    for rank in (0, 1):
        trace = json.loads((root / "prof" / f"trace_rank{rank}_steps2-3.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"train step 2", "train step 3"} <= names and any(n.startswith("aten::") for n in names), names
    assert runs["ddp"].stdout.count("--memory-snapshot: it records the CUDA allocator") == 1
    assert not list(root.glob("snap*"))
    _assert_clean(runs["init_from"], "init_from")
    assert runs["init_from"].stdout.count("--tensorboard: the tensorboard package is not installed") == 1


def test_a_checkpoint_of_fsdp_loads_into_a_pipeline_and_trains_on_alike(runs):
    import math

    resharded, source = runs["resharded"], runs["fsdp"]
    _assert_clean(resharded, "resharded")
    assert "resumed from ck_reshard/step_00000002" in resharded.stdout, resharded.stdout
    assert sorted(resharded.losses()) == [3, 4]
    for step in (3, 4):
        assert math.isclose(resharded.losses()[step], source.losses()[step], rel_tol=LOSS_RTOL)
    assert math.isclose(resharded.final_eval(), source.final_eval(), rel_tol=LOSS_RTOL)


def test_flags_from_a_config_file_under_the_command_lines(workspace, monkeypatch):
    """--config FILE: its values (tp.json: tp 2, selective checkpointing), with the command line's flags above them."""
    root, _ = workspace
    monkeypatch.chdir(root)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    import train

    args = train.parse_args(["--config", "tp.json", "--ac", "full"])
    assert (args.tp, args.ac, args.dp_shard) == (2, "full", 1)
    assert train.parse_args(["--config", "tp.json"]).ac == "selective"


def test_a_bad_flag_is_one_line_and_status_2(runs):
    """The program itself: torchrun's workers would each print the error; train.py's own argparse prints one line."""
    result = runs["bad_flag"]
    assert result.returncode == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == "train.py: error: unrecognized arguments: --no-such-flag", result.stderr


@pytest.mark.parametrize("argv, world, message", [
    (["--tp", "3"], 4, "= 3, but the world size is 4"),
    (["--n-heads", "4", "--n-kv-heads", "3"], 1, "n_kv_heads 3 must divide n_heads 4"),
    (["--tp", "2", "--n-kv-heads", "1", "--data", "tokens.bin"], 2, "tp 2 must divide the 4 query and 1 key/value heads"),
    (["--data", "tokens.bin", "--vocab-size", "256"], 1,
     f"the token file's vocabulary ({TOKENIZER_VOCAB}) exceeds the model's (256)"),
    (["--init-from", "not_llama"], 1, "not_llama is not a Llama this recipe can load: model_type 'gpt2' is not 'llama'"),
    (["--keep", "0"], 1, "--keep must be at least 1, got 0"),
    (["--pp", "2", "--accum", "4", "--n-layers", "3", "--pp-schedule", "interleaved"], 2,
     "the interleaved schedule places 4 stages (2 per rank): it needs as many layers, not 3"),
    (["--pp", "2", "--accum", "5", "--batch", "10", "--n-layers", "4", "--pp-schedule", "interleaved"], 2,
     "--accum 5 is not a multiple of its 2 rounds"),
    (["--pp", "2", "--accum", "4", "--n-layers", "4", "--pp-schedule", "zbv"], 2, "the zbv schedule cannot evaluate"),
    (["--pp", "2", "--accum", "4", "--n-layers", "4", "--pp-schedule", "interleaved-zb", "--compile"], 2,
     "add --no-compile"),
    (["--cp", "3"], 2, "--cp 3 ranks are taken out of --dp-shard 2: it must divide it"),
    (["--cp", "2", "--tp", "2"], 4, "--cp with --tp or --pp: not built in this recipe"),
    (["--cp", "3", "--seq-len", "16"], 3, "--cp 3 cuts each sequence into 6 equal chunks: --seq-len 16 does not divide"),
    (["--cp", "2", "--compile"], 2, "torch.compile does not compile the ring's point-to-point sends"),
    (["--ep", "2"], 2, "--ep 2 shares out experts: it needs --moe-experts > 0"),
    ([*MOE, "--moe-top-k", "5"], 1, "--moe-top-k 5 must be between 1 and --moe-experts 4"),
    ([*MOE, "--tp", "2"], 2, "--moe-experts with --tp, --pp or --cp: not built in this recipe"),
    (["--moe-experts", "6", "--ep", "4"], 4, "--ep 4 ranks come out of --dp-shard 4 and share out 6 experts"),
    ([*MOE, "--compile"], 1, "router's data-dependent row counts"),
    ([*MOE, "--export", "m.pt"], 1, "--moe-experts with --export: those read and write the dense Llama")],
    ids=["layout", "kv_heads", "tp_kv_heads", "vocab", "not_a_llama", "keep", "stages", "rounds", "zbv",
         "zero_bubble_compiled", "cp_of_dp_shard", "cp_with_tp", "cp_seq_len", "cp_compiled", "ep_without_experts",
         "moe_top_k", "moe_with_tp", "ep_of_experts", "moe_compiled", "moe_export"])
def test_a_bad_input_is_one_line_and_status_2_before_any_process_group(workspace, monkeypatch, capsys, argv, world,
                                                                       message):
    """train.py's argument check, called in this process as its main() calls it, on the workspace's files (the program
    itself refuses alike: test_a_bad_flag_is_one_line_and_status_2; starting it per case cost a torch import each)."""
    root, _ = workspace
    monkeypatch.chdir(root)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    import train    # scripts/train/, on the path since selftest was loaded: the files the workspace copied

    with pytest.raises(SystemExit) as refused:
        train.parse_args(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("train.py: error:"), lines
    assert message in lines[0], lines


@pytest.mark.parametrize("module", sorted(p.name for p in RECIPE.glob("*.py")))
def test_the_recipe_imports_only_torch_numpy_torchdata_the_standard_library_and_itself(module):
    tree = ast.parse((RECIPE / module).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    own = {p.stem for p in RECIPE.glob("*.py")}
    optional = {m for m, home in OPTIONAL_THIRD_PARTY.items() if home == module}
    foreign = sorted(m for m in imported if m not in sys.stdlib_module_names | ALLOWED_THIRD_PARTY | own | optional)
    assert foreign == [], f"{module} imports {foreign}"
    at_top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    at_top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert not at_top & optional, f"{module} imports {sorted(at_top & optional)} at the top: a run without it fails"


def _recipe_model(root: Path, checkpoint: str):
    """The recipe's model of a checkpoint of the workspace's runs, loaded by the copy's generate.py."""
    sys.path.insert(0, str(root))
    try:
        import generate
        return generate.load(root / checkpoint)[0]
    finally:
        sys.path.remove(str(root))


def test_an_hf_export_opens_in_transformers_and_gives_the_recipes_logits(runs, workspace):
    """export --format hf, then `LlamaForCausalLM.from_pretrained`: the logits of the checkpoint's model within
    1e-5 (both fp32 on the CPU; measured about 1e-7), on a batch of the held-out tokens; `AutoTokenizer` opens the
    BPE trained here with the ids of the token file and its end-of-text token, not a default tokenizer's."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, LlamaForCausalLM

    root, _ = workspace
    _assert_clean(runs["export_hf"], "export_hf")
    assert {p.name for p in (root / "hf_llama").iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "generation_config.json"}
    ours = _recipe_model(root, "st/ck_fsdp")
    theirs = LlamaForCausalLM.from_pretrained(root / "hf_llama").eval()
    tokens = torch.from_numpy(np.memmap(root / "tokens.bin", dtype=np.uint16, mode="r")[-64:].astype(np.int64))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens.view(4, 16)).logits, ours(tokens.view(4, 16)), rtol=0, atol=1e-5)
    meta = json.loads((root / "tokens.bin.json").read_text())
    trained, opened = Tokenizer.from_file(str(root / meta["tokenizer"] / "tokenizer.json")), \
        AutoTokenizer.from_pretrained(root / "hf_llama")
    assert opened(PROMPT).input_ids == trained.encode(PROMPT).ids and opened.eos_token_id == meta["eot_id"]


def test_a_run_from_a_llama_download_exports_what_transformers_opens_as_the_download(runs, workspace):
    """--init-from a Llama 3.2 download (2 ranks), its data prepared with the download's tokenizer; exported past
    --max-shard-size 100kB: shards and their index that LlamaForCausalLM opens with the recipe's logits, the
    download's tokenizer (its ids, BOS included, and chat template) and its three end-of-text ids; generate.py
    writes text from the export."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    root, _ = workspace
    for name in ("l3_init", "l3_export", "l3_generate"):
        _assert_clean(runs[name], name)
    out = root / "hf_l3"
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(root / LLAMA3)
    assert ours(PROMPT).input_ids == theirs(PROMPT).input_ids and ours.chat_template == theirs.chat_template
    listed = GenerationConfig.from_pretrained(root / LLAMA3).eos_token_id
    assert GenerationConfig.from_pretrained(out).eos_token_id == listed and len(listed) == 3
    model = _recipe_model(root, "ck_l3")
    tokens = torch.tensor([ours(PROMPT + " is a compound statement").input_ids])
    with torch.no_grad():
        logits = LlamaForCausalLM.from_pretrained(out).eval()(tokens).logits
        torch.testing.assert_close(logits, model(tokens), rtol=0, atol=1e-5)
    assert runs["l3_generate"].stdout.startswith(PROMPT), runs["l3_generate"].output


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
