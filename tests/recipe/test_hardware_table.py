"""The recipe's datasheet table (scripts/train/hardware.py, made of notebook 05's cells), looked up by the names torch
reports on each device (`torch.cuda.get_device_name`, and where two variants share a name, the memory
`get_device_properties(...).total_memory` reports): each reaches its own row, whose figures are the datasheet's
dense ones. An H100 NVL read as an SXM understates MFU by 16 %; a GB200 read as a B200 (another chip) misstates it."""
from __future__ import annotations

import sys

import pytest

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import hardware  # noqa: E402

GIB = 2 ** 30
# (name torch reports, total_memory it reports or None, dense bf16 TFLOP/s of its datasheet row, words of its source)
DEVICES = [
    ("NVIDIA H100 80GB HBM3", 79.18 * GIB, 989.4, "H100 SXM"),
    ("NVIDIA H100 PCIe", 79.65 * GIB, 756.0, "H100 PCIe"),
    ("NVIDIA H100 NVL", 99_961_274_368, 835.5, "H100 NVL"),
    ("NVIDIA H100", 99_961_274_368, 835.5, "H100 NVL"),        # the bare name with an NVL's 94 GB
    ("NVIDIA H100", 95.04 * GIB, 989.4, "H100 SXM"),           # the bare name on Meta's 96 GB HBM2e SXM boards
    ("NVIDIA H100", None, 989.4, "H100 SXM"),                  # the bare name, memory unknown: the SXM, as before
    ("NVIDIA GH200 480GB", 95.0 * GIB, 989.4, "GH200"),
    ("NVIDIA H200", 139.81 * GIB, 989.4, "H200 SXM"),
    ("NVIDIA H200 NVL", 139.81 * GIB, 835.5, "H200 NVL"),
    ("NVIDIA B200", 178.35 * GIB, 2250.0, "HGX B200"),
    ("AMD Instinct MI300X", 191.98 * GIB, 1307.4, "MI300X"),
    ("AMD Instinct MI300X VF", 191.98 * GIB, 1307.4, "MI300X"),
    ("NVIDIA A100-SXM4-80GB", 79.25 * GIB, 312.0, "A100"),
    ("NVIDIA A100 80GB PCIe", 79.15 * GIB, 312.0, "A100"),
    ("NVIDIA L40S", 44.39 * GIB, 362.05, "L40S"),
    ("NVIDIA L4", 22.03 * GIB, 121.0, "L4"),
]


@pytest.mark.parametrize("name, memory, bf16, source", DEVICES,
                         ids=[f"{name}-{memory and round(memory / GIB)}GiB" for name, memory, _, _ in DEVICES])
def test_each_name_torch_reports_reaches_its_own_row(name, memory, bf16, source):
    peak, named = hardware.datasheet_peak(name, "bf16", memory)
    assert peak == bf16 * 1e12 and source in named, (peak, named)


def test_a_name_of_another_chip_reaches_no_row():
    """GB200's GPUs run faster than HGX B200's (another power limit): no B200 figure for them, and none for a CPU."""
    assert hardware.datasheet_peak("NVIDIA GB200", "bf16") is None
    assert hardware.datasheet_peak("CPU AVX512, 2 threads", "bf16") is None


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
                                  "NVIDIA H200 NVL", "NVIDIA B200", "AMD Instinct MI300X"])
def test_float8_peaks_are_twice_bf16_on_the_chips_whose_float8_units_are(name):
    """Hopper, Blackwell and CDNA 3 do twice the FP8 work of BF16 per cycle: a row whose two figures are not in
    that ratio has one of them misread from its datasheet."""
    (float8, _), (bf16, _) = hardware.datasheet_peak(name, "float8"), hardware.datasheet_peak(name, "bf16")
    assert float8 / bf16 == pytest.approx(2.0, rel=0.005)


def test_a_row_without_a_figure_gives_none_rather_than_another_rows():
    """The A100 has no FP8: its row answers None, never falling through to a later row's figure."""
    assert hardware.datasheet_peak("NVIDIA A100-SXM4-80GB", "float8") is None


def test_every_row_names_its_datasheet_and_gives_dense_bf16():
    for pattern, memory, peaks, source in hardware.DATASHEET_TFLOPS:
        assert "data sheet" in source.lower() or "datasheet" in source.lower(), pattern
        assert {"bf16", "tf32", "fp32"} <= set(peaks), pattern
        assert peaks["bf16"] > peaks["tf32"] > 0, f"{pattern}: BF16 tensor cores outrun TF32's"
