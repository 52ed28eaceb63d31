"""Measuring machinery the notebooks share, one topic per module (its docstring says why it exists):

    timing            a step timed honestly (device idle at both ends, ranks together), times summarised by medians
    ceilings          what this machine's memory and loopback network reach at best, measured in the same run
    collectives       collectives timed the nccl-tests way: algbw, busbw, the slowest rank, closed-form checks
    comm_log          the collectives a step issues (kind, dtype, bytes, group), recorded as they are issued
    trace_overlap     how much of a step's communication ran while computation ran, read from a profiler trace
    memory            bytes held per rank, and what ZeRO's arithmetic says they should be
    activations       bytes a training step holds for backward, counted the same way on CPU and GPU
    precision         mixed precision: what the hardware offers, the matmul ceiling, GradScaler's arithmetic
    ddp               DDP from the inside: the buckets it builds, what its comm hooks hand to the wire
    fsdp              FSDP2 held to what it should do: bytes per rank, activations by dtype, its bf16 cost
    tensor_parallel   notebook 07's plumbing: a step's collectives and bytes, a graph-counting compile backend, tables
    pipeline          a pipeline schedule's bubble, from the actions it ran, and the bytes it keeps for backward
    parameter_server  notebook 04's parameter-server records read: rates, speed-ups, bytes per codec, a crash
    disk              a checkpoint's cost against the disk it lands on: fsync'd writes, DCP save, async save, load
    loss_log          the recipe's loss log read back, split into the attempts of a run that resumed
    elastic_log       an elastic run cut into the stretches its workers trained
    planner           notebook 10's runs of the recipe held against the planner's predictions
    published_runs    torchtitan's published performance tables, row by row, beside the planner's predictions
    launch_overhead   what starting N workers costs, measured alike for every launcher
    headline          the few figures a notebook marks for the run summary
    advice            one verdict on a piece of common advice, worded the same everywhere, with its noise
"""
