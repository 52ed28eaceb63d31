"""helpers.measure.ddp_claims: each claim's verdict from measurements whose outcome is known by construction."""
from helpers.measure import ddp_claims


def _sweep(step, no_sync, caps=(0.01, None, 25, 100)):
    return {(cap, mode): {"times": list(t)} for cap in caps for mode, t in (("step", step[cap]), ("no_sync", no_sync))}


def test_fp16_volume_is_within_the_claim_when_half_the_bytes_go_out(capsys):
    assert ddp_claims.fp16_volume(50, 100).startswith("within")
    assert ddp_claims.fp16_volume(75, 100).startswith("below")
    assert "seed 001" in capsys.readouterr().out


def test_buckets_judges_tensor_fusion_from_the_step_times_and_spots_identical_plans():
    step = {0.01: [2.0, 2.1, 2.05, 1.95, 2.0], None: [1.0, 1.05, 0.95, 1.0, 1.02], 25: [1.0] * 5, 100: [1.0] * 5}
    plans = {0.01: [1, 1, 1], None: [2, 1], 25: [3], 100: [3]}
    seed000, seed001, seed003 = ddp_claims.buckets(_sweep(step, [0.5] * 5), plans, 0.01, "here")
    assert seed000.startswith("not comparable") and seed001.startswith("not comparable")
    assert seed003.startswith("within")  # the unfused step is slower: fusion speeds it up
    plans[100] = plans[None]
    assert "the same 2 buckets" in ddp_claims.buckets(_sweep(step, [0.5] * 5), plans, 0.01, "here")[1]


def test_scaling_is_comparable_only_at_the_claims_world_size_on_gpus():
    rows = [{"world_size": 1, "samples_per_s": 100.0, "efficiency": 1.0, "rates": [100.0] * 5},
            {"world_size": 8, "samples_per_s": 600.0, "efficiency": 0.75, "rates": [600.0] * 5}]
    eight, thirty_two, data_parallel = ddp_claims.scaling(rows, gpus=8, cores=64)
    assert eight.startswith("within") and thirty_two.startswith("not comparable")
    assert data_parallel.startswith("not comparable")
    assert ddp_claims.scaling(rows, gpus=0, cores=2)[0].startswith("not comparable")


def test_zero2_formula_at_32_gpus_cuts_more_than_43_percent():
    formula, whole_job = ddp_claims.zero2("2 CPU ranks")
    assert formula.startswith("above") and whole_job.startswith("not comparable")


def test_overhead_target_is_met_missed_or_inconclusive_by_the_noise(capsys):
    plain = [1.0, 1.01, 0.99, 1.0, 1.0]
    assert abs(ddp_claims.overhead([1.02, 1.03, 1.01, 1.02, 1.02], plain, 5, "x") - 2.0) < 1e-9
    assert capsys.readouterr().out.rstrip().endswith("met")
    ddp_claims.overhead([1.5, 1.52, 1.48, 1.5, 1.5], plain, 5, "x")
    assert capsys.readouterr().out.rstrip().endswith("missed")
    ddp_claims.overhead([1.0, 1.3, 0.9, 1.05, 1.2], plain, 5, "x")
    assert "inconclusive" in capsys.readouterr().out
