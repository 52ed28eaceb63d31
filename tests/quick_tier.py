"""Which tests are in the quick tier: tests/conftest.py marks them `quick`, tests/project/test_suite.py tests the rule.

A module of its own, not tests/conftest.py: `from conftest import` in a test module finds whichever conftest.py pytest
imported last (tests/recipe has one too)."""
from __future__ import annotations

# The quick tier, `./cookbook test --quick` (pytest -m quick): what a developer runs after an edit, meant to take at most
# 3 minutes on 2 cores (about 115 s of CPU in all; its wall time here was 3:30 at a load of 6 to 11 from other work,
# 8 min at 16 to 23); the full suite (`./cookbook test`, CI) runs everything. Unit areas are taken whole, so a
# new test file there is in the tier without a word; from the other areas the files and tests named. NOT_QUICK holds
# what of those costs too much for the tier (a test of 9 s or more here, a file of 30 s or more, the machine shared
# and busy): a test that shows among the slowest `./cookbook test --quick` prints belongs there. Paths below tests/.
QUICK_AREAS = ("launcher/", "plots/", "measure/", "planner/", "project/")  # launcher: its fault suite, its units
QUICK_FILES = (
    "notebooks/test_teaching.py", "notebooks/test_explore.py",  # the teaching checks
    "recipe/test_recipe_data.py",
)
QUICK_TESTS = (
    # the recipe's one-process run and one 2-rank layout (test_train_recipe.py then makes only these)
    "recipe/test_train_recipe.py::test_one_process_trains",
    "recipe/test_train_recipe.py::test_a_layout_of_two_ranks_matches_one_process[fsdp]",
    # the course's order: each script made of its notebook's cells, each recipe module of one notebook's, in order
    "recipe/test_scripts.py::test_every_script_is_made_of_its_notebooks_cells",
    "recipe/test_scripts.py::test_a_recipe_module_is_made_of_several_notebooks_cells_in_notebook_order",
    "recipe/test_scripts.py::test_a_tag_outside_scripts_and_its_recipe_folder_is_refused",
    "recipe/test_scripts.py::test_a_script_imports_only_torch_numpy_and_the_standard_library",
    "recipe/test_train_recipe.py::test_the_recipe_imports_only_torch_numpy_torchdata_the_standard_library_and_itself",
)
NOT_QUICK = (
    "launcher/test_elastic.py",  # torchrun agents, a torch import each
    "launcher/test_torchrun.py",
    "launcher/test_launch.py::test_closures_defined_in_a_cell_work_with_either_start_method[spawn]",
    "launcher/test_launch.py::test_threads_split_the_cores_unless_the_user_says_otherwise[spawn]",
    "launcher/test_launch.py::test_a_server_whose_installation_changed_is_replaced",
    "launcher/test_launch.py::test_a_variable_torch_reads_at_import_restarts_the_server",
    "launcher/test_launch.py::test_a_cells_class_can_be_pickled_by_name_in_the_workers",
    "measure/test_ddp_measure.py",
    "measure/test_foundation_units.py::test_counting_gpus_creates_no_cuda_context",
    "measure/test_foundation_units.py::test_the_digits_file_holds_the_uci_test_set_as_scikit_learn_ships_it",
    "measure/test_fsdp_shards.py::test_formula_matches_a_real_fully_shard",
    "measure/test_tensor_parallel.py::test_graph_counter_counts_each_graph_and_refuses_an_unknown_backend",
    "planner/test_plan.py::test_activation_formula_is_what_a_forward_keeps",
    "planner/test_plan.py::test_llama3_70b_on_256_h100s_prints_layouts_and_a_line_the_recipe_accepts",
    "planner/test_plan.py::test_parameter_count_and_shapes_are_the_models",
    "planner/test_plan.py::test_model_state_and_collectives_match_fsdp2_and_ddp_on_two_ranks",
    "planner/test_plan_cp_moe.py::test_ring_and_experts_keep_and_send_what_the_plan_says_on_two_ranks",
    "planner/test_plan_cp_moe.py::test_moe_activations_are_what_a_forward_keeps",
    "project/test_private_names.py",
    "project/test_packaging.py",
    "project/test_budget_run.py::test_cells_after_an_error_still_run_and_figures_are_kept",
    "project/test_budget_run.py::test_a_hanging_notebook_is_stopped_at_the_budget_and_leaves_nothing_running",
    "project/test_budget_run.py::test_a_notebook_stopped_before_its_first_cell_is_in_the_archive_with_where_it_stopped",
    "project/test_suite.py::test_under_load_busy_processes_run_beside_pytest_and_the_cost_counts_an_orphan",
    "project/test_suite.py::test_ctrl_c_ends_pytest_and_then_the_busy_processes",
    "project/test_suite.py::test_the_plugin_reports_nothing_unless_asked",
)


def is_quick(nodeid: str) -> bool:
    """In the quick tier: `nodeid` (tests/AREA/test_x.py::test_y[param]) is in a unit area or named, and not left out.
    A name without its [param] covers every parametrization; a file, its every test."""
    path = nodeid.removeprefix("tests/")

    def named(names) -> bool:
        return any(path == n or path.startswith(n + ("[" if "::" in n else "::")) for n in names)

    return (path.startswith(QUICK_AREAS) or named(QUICK_FILES) or named(QUICK_TESTS)) and not named(NOT_QUICK)
