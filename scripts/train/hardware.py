# From the PyTorch distributed cookbook: the cells tagged 'script:train/hardware.py' in
#   notebooks/05_mixed_precision.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""What a step's FLOPs are measured against: the accelerator's datasheet peak in the training dtype, and the matmul
rate this device reaches here and now.

MFU (model FLOPs utilisation) = tokens/s x FLOPs per token (model.py's `flops_per_token`) / the peak of all ranks.
Against the datasheet's dense peak, as torchtitan, nanoGPT and papers report it, the figure compares with theirs;
against the measured matmul rate it says how close the step comes to what this device does at its best. A CPU has
no datasheet row: its MFU is against the measured rate, and says so.
"""
import re
import time

# Dense (no 2:4 sparsity) peak TFLOP/s per dtype, from each vendor's datasheet ("bf16" = BF16/FP16 tensor cores,
# "tf32" = TF32 tensor cores, "fp32" = FP32 without tensor cores, "float8" = FP8 tensor cores where a GPU has them).
# Datasheets print the sparse figure for tensor cores: half of it is the dense one. A device name matches the first
# pattern found in it.
DATASHEET_TFLOPS = [
    (r"H100.*PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2, "float8": 1513.0},
     "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column (1,513 / 756 TFLOPS with sparsity; FP8 3,026)"),
    (r"H100|GH200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9, "float8": 1978.9},
     "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (1,979 / 989 TFLOPS with sparsity; FP8 3,958)"),
    (r"H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9, "float8": 1978.9},
     "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (1,979 / 989 TFLOPS with sparsity; FP8 3,958)"),
    (r"A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
     "NVIDIA A100 Tensor Core GPU datasheet (624 / 312 TFLOPS with sparsity)"),
    (r"L40S", {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6, "float8": 733.0},
     "NVIDIA L40S datasheet (733 / 366 TFLOPS with sparsity; FP8 1,466)"),
    (r"\bL4\b", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3, "float8": 242.5},
     "NVIDIA L4 Tensor Core GPU datasheet (242 / 120 TFLOPS with sparsity; FP8 485)"),
    (r"MI300X", {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4, "float8": 2614.9},
     "AMD Instinct MI300X data sheet (peak dense BF16, TF32, FP32, FP8 matrix)"),
]


def datasheet_peak(device_name: str, dtype: str) -> tuple[float, str] | None:
    """(peak FLOP/s, its source) of one device of this name in `dtype` ("bf16", "tf32", "fp32", "float8"), or None
    where the table has no row (a CPU, an unlisted GPU)."""
    for pattern, peaks, source in DATASHEET_TFLOPS:
        if re.search(pattern, device_name) and dtype in peaks:
            return peaks[dtype] * 1e12, source
    return None


def matmul_dtype_name(dtype) -> str:
    """The datasheet column a training dtype computes in: bf16, or fp32 (tf32 where torch allows it for float32
    matmuls: `torch.backends.cuda.matmul.fp32_precision`/`set_float32_matmul_precision`)."""
    import torch

    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def measured_matmul_peak(device, dtype) -> float:
    """FLOP/s of large square matmuls on this device in `dtype`, the best of a few timings (about a second on a
    GPU, a fraction on a CPU): what this rank reaches here and now (on a shared CPU, with its peers running)."""
    import torch

    sizes = (4096, 8192) if device.type == "cuda" else (512,)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        reps = max(2, int(4e12 // (2 * n ** 3))) if device.type == "cuda" else 3
        a @ b
        for _ in range(4 if device.type == "cuda" else 8):
            sync()
            start = time.perf_counter()
            for _ in range(reps):
                a @ b
            sync()
            best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - start))
        del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)     # the probe's matrices are no part of training's peak
    return best
