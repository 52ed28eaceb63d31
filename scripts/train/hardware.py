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
# "float8" = FP8 tensor cores, "tf32" = TF32 tensor cores, "fp32" = FP32 without tensor cores). NVIDIA's datasheets
# print the tensor cores' figures with sparsity: half of one is the dense figure. A row is (a pattern of the name
# torch reports, the memory in GiB it reports (low, high) where names collide or None, the peaks, the source); the
# first row that matches wins, so a variant's row comes before its family's.
H100_SXM = {"bf16": 989.4, "float8": 1979.0, "tf32": 494.7, "fp32": 66.9}
HOPPER_NVL = {"bf16": 835.5, "float8": 1670.5, "tf32": 417.5, "fp32": 60.0}
H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet"
DATASHEET_TFLOPS = [
    (r"H100.*NVL", None, HOPPER_NVL, f"{H100_SHEET}, H100 NVL column (1,671 BF16 / 3,341 FP8 TFLOPS with sparsity)"),
    (r"H100.*PCIe", None, {"bf16": 756.0, "float8": 1513.0, "tf32": 378.0, "fp32": 51.2},
     f"{H100_SHEET}, H100 PCIe column (1,513 BF16 / 3,026 FP8 TFLOPS with sparsity)"),
    # torch sometimes reports a bare "NVIDIA H100": 94 GB (93 GiB as torch counts it) is the NVL; SXM boards have 80
    # or, Meta's HBM2e ones, 96 GB (79 and 95 GiB)
    (r"^NVIDIA H100$", (92.0, 94.5), HOPPER_NVL, f"{H100_SHEET}, H100 NVL column (94 GB, the bare name's memory)"),
    (r"H100|GH200", None, H100_SXM, f"{H100_SHEET}, H100 SXM column (1,979 BF16 / 3,958 FP8 TFLOPS with sparsity); "
     "GH200 Grace Hopper Superchip datasheet: its GPU's figures are the same"),
    (r"H200.*(NVL|PCIe)", None, HOPPER_NVL, "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column (1,671 BF16 / "
     "3,341 FP8 TFLOPS with sparsity; NVIDIA's vGPU tables name it H200 PCIe)"),
    (r"H200", None, H100_SXM, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (1,979 BF16 / 3,958 FP8 TFLOPS "
     "with sparsity)"),
    (r"\bB200\b", None, {"bf16": 2250.0, "float8": 4500.0, "tf32": 1100.0, "fp32": 75.0},
     "NVIDIA Blackwell datasheet (DGX B200, HGX B200, GB200 NVL72), HGX B200 per GPU: 4.5 PFLOPS BF16, 9 PFLOPS FP8, "
     "2.2 PFLOPS TF32 with sparsity, 75 TFLOPS FP32"),
    (r"A100", None, {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
     "NVIDIA A100 Tensor Core GPU datasheet (624 / 312 TFLOPS with sparsity; no FP8)"),
    (r"L40S", None, {"bf16": 362.05, "float8": 733.0, "tf32": 183.0, "fp32": 91.6},
     "NVIDIA L40S datasheet (733 BF16 / 1,466 FP8 TFLOPS with sparsity)"),
    (r"\bL4\b", None, {"bf16": 121.0, "float8": 242.5, "tf32": 60.0, "fp32": 30.3},
     "NVIDIA L4 Tensor Core GPU datasheet (242 BF16 / 485 FP8 TFLOPS with sparsity)"),
    (r"MI300X", None, {"bf16": 1307.4, "float8": 2614.9, "tf32": 653.7, "fp32": 163.4},
     "AMD Instinct MI300X data sheet (peak dense BF16, FP8, TF32 and FP32 matrix)"),
]


def datasheet_peak(device_name: str, dtype: str, memory_bytes: int | None = None) -> tuple[float, str] | None:
    """(peak FLOP/s, its source) of one device of this name, as torch reports it (`torch.cuda.get_device_name`), in
    `dtype` ("bf16", "float8", "tf32", "fp32"), or None where the table has no row (a CPU, an unlisted GPU) or its row
    no such figure (an A100 has no FP8). A row that tells a variant by memory needs `memory_bytes`
    (`torch.cuda.get_device_properties(...).total_memory`); without it the name alone decides."""
    for pattern, memory_gib, peaks, source in DATASHEET_TFLOPS:
        if memory_gib is not None and (memory_bytes is None or
                                       not memory_gib[0] <= memory_bytes / 2 ** 30 < memory_gib[1]):
            continue
        if re.search(pattern, device_name):
            return (peaks[dtype] * 1e12, source) if dtype in peaks else None
    return None


def matmul_dtype_name(dtype) -> str:
    """The datasheet column a training dtype computes in: bf16, float8, or fp32 (tf32 where torch allows it for
    float32 matmuls: `torch.backends.cuda.matmul.fp32_precision`/`set_float32_matmul_precision`)."""
    import torch

    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "float8"
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
