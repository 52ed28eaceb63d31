"""The recipe's job spec (scripts/train/job.py, notebook 09): one statement of each rule, count and flag, used by both
the recipe (train.py) and its planner (plan.py).

- Every rule in `job.RULES` (and the floors of `job.at_least`) has a refused configuration here; train.py refuses it
  with the rule's line, and where the planner can be asked the same question it refuses with the same line.
- Every rule runs when train.py reads its flags and when the planner plans a layout: both call the spec's rules
  (`Job.check`), not copies of them.
- No other module of the recipe defines a name the spec defines, writes one of its refusals, spells out a list of
  its flags, or declares one of its flags on train.py's or plan.py's command line.
- Both command lines are the table: train.py's flags and plan.py's are FLAGS' rows for each, and a line the
  planner prints is one train.py reads back to the plan's job.
"""
from __future__ import annotations

import ast
import json
import sys

import pytest

from helpers.paths import SCRIPTS

RECIPE = SCRIPTS / "train"
sys.path.insert(0, str(RECIPE))
import job  # noqa: E402
import plan  # noqa: E402
from config import MESH_DIMS, Layout, preset  # noqa: E402

RULES = list(job.RULES)

TINY = preset("tiny", vocab_size=256)          # train.py's model with no flags on a CPU: the bytes' vocabulary
SHORT = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
# rule: (train.py's flags, world size, the line it refuses them with, the planner asked the same: plan.py's flags,
# or a (Training, Layout) the planner checks, or None where plan.py has no such flag)
REFUSED = {
    "at_least": (["--cp", "0"], 1, "--cp must be at least 1, got 0", ["--model", "tiny", "--gpus", "1", "--cp", "0"]),
    "mesh_fits_model": (["--tp", "3"], 3, "tp 3 must divide the 4 query and 2 key/value heads (each rank takes whole "
                        "heads)", ["--model", "tiny", "--gpus", "3", "--tp", "3"]),
    "sequence_fits_model": (["--init-from", "{short}", "--seq-len", "64"], 1, "--seq-len 64 exceeds the model's "
                            "max_seq_len 32 ({short}'s max_position_embeddings)",
                            ["--init-from", "{short}", "--seq-len", "64", "--gpus", "1"]),
    "schedule_can_run": (["--pp", "2", "--accum", "1"], 2, "the 1f1b schedule needs --accum (micro-batches) >= --pp 2, "
                         "got 1", (dict(grad_accum=1), Layout(pp=2))),
    "context_parallel_fits": (["--cp", "2", "--tp", "2"], 4, "--cp with --tp or --pp: not built in this recipe "
                              "(context parallel over data parallel only)", (dict(cp=2), Layout(dp_shard=2, tp=2))),
    "experts_fit": (["--moe-experts", "6", "--ep", "4"], 4, "--ep 4 ranks come out of --dp-shard 4 and share out 6 "
                    "experts: it must divide both",
                    ["--model", "tiny", "--gpus", "4", "--moe-experts", "6", "--ep", "4"]),
    "batch_splits": (["--batch", "3"], 2, "--batch 3 must be a multiple of data-parallel ranks 2 x --accum 1", None),
    "float8_fits": (["--float8", "rowwise", "--seq-len", "24", "--batch", "2"], 2, "--float8: a rank multiplies 24 "
                    "tokens per micro-batch, not a multiple of 16 (the weight gradient's float8 matmul sums over "
                    "them)", None),
    "export_gathers_whole_model": (["--pp", "2", "--accum", "2", "--export", "m.pt"], 2, "--export with --pp needs "
                                   "--ckpt-dir: no rank holds the whole model, the checkpoint does", None),
    "profile_window_is_steps": (["--profile-steps", "3:1"], 1, "--profile-steps 3:1: expected 1 <= A <= B", None),
}


@pytest.fixture
def short_llama(tmp_path):
    """A Hugging Face Llama folder (its config.json) whose sequences are shorter than the flags ask for."""
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "config.json").write_text(json.dumps(SHORT))
    return str(tmp_path / "short")


def _train_refuses(argv, world, monkeypatch, capsys) -> str:
    import train

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(train, "uses_gpu", lambda: False)       # the CPU's defaults on any machine
    with pytest.raises(SystemExit) as refused:
        train.parse_args(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("train.py: error: "), lines
    return lines[0].removeprefix("train.py: error: ")


def _planner_refuses(question, capsys) -> str:
    if isinstance(question, list):
        with pytest.raises(SystemExit) as refused:
            plan.main(question)
        lines = capsys.readouterr().err.strip().splitlines()
        assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("plan.py: error: "), lines
        return lines[0].removeprefix("plan.py: error: ")
    settings, layout = question
    with pytest.raises(ValueError) as refused:
        plan.check_layout(TINY, plan.Training(seq_len=TINY.max_seq_len, **settings), layout)
    return str(refused.value)


def test_every_rule_has_a_refused_configuration_here():
    assert sorted(REFUSED) == sorted(["at_least", *(rule.__name__ for rule in job.RULES)])


@pytest.mark.parametrize("rule", sorted(REFUSED))
def test_train_py_and_the_planner_refuse_alike_in_the_rules_words(rule, short_llama, monkeypatch, capsys):
    argv, world, line, question = REFUSED[rule]
    argv, line = [a.replace("{short}", short_llama) for a in argv], line.replace("{short}", short_llama)
    if isinstance(question, list):
        question = [a.replace("{short}", short_llama) for a in question]
    assert _train_refuses(argv, world, monkeypatch, capsys) == line
    if question is not None:
        assert _planner_refuses(question, capsys) == line, "the planner states the recipe's rule, in its words"


def test_train_py_and_the_planner_run_every_rule_of_the_spec(monkeypatch):
    """Each rule is wrapped where the spec keeps it (job.RULES): a copy in train.py or plan.py would not be seen."""
    import train

    ran, who = {"train": [], "plan": []}, ["train"]

    def recorded(rule):
        def run(*args):
            ran[who[0]].append(rule.__name__)
            return rule(*args)
        return run

    monkeypatch.setattr(job, "RULES", [recorded(rule) for rule in job.RULES])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train, "uses_gpu", lambda: False)
    train.parse_args(["--tp", "2"])
    who[0] = "plan"
    plan.plan(TINY, plan.Training(seq_len=128), Layout(dp_shard=2))
    names = [rule.__name__ for rule in RULES]
    assert ran["train"] == ran["plan"] == names, ran


def _definitions(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _refusals(tree: ast.AST) -> list[str]:
    """The literal text of every `raise ValueError(...)` message: its constant pieces of 20 characters or more."""
    pieces = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            pieces += [c.value for c in ast.walk(node.exc.args[0])
                       if isinstance(c, ast.Constant) and isinstance(c.value, str) and len(c.value) >= 20]
    return pieces


OTHERS = sorted(p for p in RECIPE.glob("*.py") if p.name != "job.py") + [SCRIPTS.parent / "benchmarks" /
                                                                          "train_bench.py"]


@pytest.mark.parametrize("path", OTHERS, ids=lambda p: p.name)
def test_no_rule_count_or_flag_of_the_spec_is_written_again(path):
    spec = ast.parse((RECIPE / "job.py").read_text())
    tree, text = ast.parse(path.read_text()), path.read_text()
    again = _definitions(tree) & _definitions(spec)
    assert not again, f"{path.name} defines what job.py defines: {sorted(again)}"
    restated = [piece for piece in _refusals(spec) if piece in text]
    assert not restated, f"{path.name} writes job.py's refusals again: {restated}"
    flags = {f.name for f in job.FLAGS}
    lists = [names for node in ast.walk(tree) if isinstance(node, (ast.Tuple, ast.List, ast.Set))
             and len(node.elts) >= 3 and all(isinstance(c, ast.Constant) and c.value in flags for c in node.elts)
             for names in [[c.value for c in node.elts]] if names != list(MESH_DIMS)]   # the mesh's own names
    assert not lists, f"{path.name} lists job.py's flags by name (FLAGS says which are which): {lists}"


@pytest.mark.parametrize("name", ["train.py", "plan.py"])
def test_the_command_lines_declare_none_of_the_tables_flags_themselves(name):
    """Their flags come from job.FLAGS (`job.parser`); train.py's `export` subcommand is a command line of its own."""
    flags = {"--" + f.name.replace("_", "-") for f in job.FLAGS}
    tree = ast.parse((RECIPE / name).read_text())
    declared = [(fn.name, arg.value) for fn in tree.body if isinstance(fn, ast.FunctionDef) and fn.name != "export_main"
                for call in ast.walk(fn) if isinstance(call, ast.Call) and getattr(call.func, "attr", "") ==
                "add_argument" for arg in call.args if isinstance(arg, ast.Constant) and arg.value in flags]
    assert not declared, declared


def test_each_command_line_is_its_rows_of_the_table():
    import train

    for command, p in (("train", train.build_parser()), ("plan", job.parser("plan", "", {"gpu": ["H100-80GB"]}))):
        made = {a.dest for a in p._actions} - {"help"}
        assert made == {f.name for f in job.FLAGS if command in f.commands}, command


def test_a_line_the_planner_prints_is_the_job_it_planned(monkeypatch):
    """The planner's torchrun line, read back by train.py's own argument check, is the plan's job: its degrees, its
    batch, its model, the rules it was checked by."""
    import train

    cfg = preset("llama3-8b", max_seq_len=4096)
    fits = plan.fitting_layouts(cfg, 16, "H100-80GB", seq_len=4096, global_batch=32, checkpointing=("full",))
    best = fits[0]
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setattr(train, "uses_gpu", lambda: True)
    read = train.parse_args(best.command().split("scripts/train/train.py", 1)[1].split())
    layout = best.layout
    assert (read.dp_replicate, read.dp_shard, read.tp, read.pp) == (layout.dp_replicate, layout.dp_shard, layout.tp,
                                                                   layout.pp)
    assert read.model_config == cfg and read.batch == 32 and read.accum == best.train.grad_accum
