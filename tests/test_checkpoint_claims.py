"""helpers.measure.checkpoint_claims: the seed's checkpoint code run as written, and the verdicts notebook 06 prints
from made-up measurements (nothing here times anything)."""
from __future__ import annotations

from helpers.measure import checkpoint_claims


def test_the_articles_save_state_dict_call_fails_and_the_old_name_warns(tmp_path):
    category, call = checkpoint_claims.save_state_dict_as_written(tmp_path / "probe")
    assert issubclass(category, (FutureWarning, DeprecationWarning))
    assert call.startswith("TypeError") and "checkpoint_id" in call


def test_a_snippet_is_run_as_written_and_its_error_reported():
    assert checkpoint_claims.elastic_agent_as_written() != "ran"
    assert checkpoint_claims.elastic_agent_as_written("x = 1") == "ran"
    assert checkpoint_claims.elastic_agent_as_written("import no_such_module_here").startswith("ModuleNotFoundError")


def test_debugging_tools_quotes_the_launch_deprecation():
    text = checkpoint_claims.debugging_tools()
    assert "torchrun" in text and "deprecated" in text and "memory_profiler" in text


def _summary(save_vs_disk, blocking):
    return {"ratios": {"save_vs_disk": {"median": save_vs_disk[1], "interval": (save_vs_disk[0], save_vs_disk[2])},
                       "blocking_share": {"median": blocking[1], "interval": (blocking[0], blocking[2])}}}


def test_save_rates_carry_the_noise_and_the_setting():
    noisy = checkpoint_claims.save_rates(_summary((0.3, 0.7, 1.0), (0.1, 0.15, 0.3)), on_gpu=True)
    assert "0.70x" in noisy and noisy.count("inconclusive") == 2
    assert "bootstrap interval of the median 0.30-1.00x" in noisy, "the spread printed beside the median"
    clear = checkpoint_claims.save_rates(_summary((0.6, 0.8, 0.9), (0.05, 0.1, 0.15)), on_gpu=True)
    assert "inconclusive" not in clear and clear.count("within") == 2
    slow = checkpoint_claims.save_rates(_summary((0.1, 0.2, 0.3), (0.05, 0.1, 0.15)), on_gpu=False)
    assert "below the claimed 0.5x or more" in slow and "not comparable here: the target is for CUDA tensors" in slow


def test_claims_made_for_clusters_are_not_comparable_on_one_machine():
    assert "not comparable here" in checkpoint_claims.new_node_within_seconds(3.4)
    assert "in 3.4 s" in checkpoint_claims.new_node_within_seconds(3.4)
    assert "not comparable here: one machine (2 cores)" in checkpoint_claims.ntp_across_nodes(2)
