"""What the advice says: the fix for each kind, shared by the rank's log line and the doctor."""

from __future__ import annotations

REDUCTION_ERROR = "Expected to have finished reduction in the prior iteration"
"""DDP's error at the forward after a step in which parameters got no gradient (without
find_unused_parameters): the rank adds their names to it, the doctor names them its cause."""

FIX: dict[str, str] = {
    "same_data": (
        "give the DataLoader a DistributedSampler (sampler=DistributedSampler(dataset), shuffle only "
        "in the sampler) or shard the data by rank yourself; each rank must see its own part"
    ),
    "set_epoch_missing": (
        "call sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader; "
        "without it DistributedSampler shuffles in the same order every epoch"
    ),
    "replicas_diverged": (
        "train only through the DDP model (model(x), not model.module(x)); initialise before wrapping "
        "(DDP broadcasts rank 0's parameters at construction) or seed every rank alike; keep "
        "broadcast_buffers=True or synchronise buffers (SyncBatchNorm)"
    ),
    "inner_module_forward": (
        "call the DDP model itself for training steps (ddp_model(x)); ddp_model.module(x) skips "
        "DDP's gradient all-reduce, so replicas drift apart. Under torch.no_grad() (evaluation) "
        "it is fine"
    ),
    "nonfinite_gradients": (
        "look at the origin rank's batch and loss in that step (bad sample, overflow, division by "
        "zero, a too-high learning rate); torch.autograd.set_detect_anomaly(True) on that rank "
        "names the operation; skipping a step needs every rank to agree (all-reduce a flag)"
    ),
    "device_mismatch": (
        "call torch.cuda.set_device(local_rank) first thing, and place the model and the batches "
        "on torch.device('cuda', local_rank), with LOCAL_RANK from the environment (not RANK)"
    ),
    "shared_gpu": (
        "one rank per GPU: torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before "
        "init_process_group, and no more ranks per node than GPUs (torchrun --nproc-per-node)"
    ),
    "rank_as_device": (
        "the global rank is no device index on a second node: use LOCAL_RANK "
        "(torch.device('cuda', int(os.environ['LOCAL_RANK']))) and torch.cuda.set_device(local_rank)"
    ),
    "accumulation_without_no_sync": (
        "wrap every micro-batch but the last of an optimizer step in `with ddp_model.no_sync():`; "
        "without it every backward all-reduces the gradients"
    ),
    "needless_find_unused_parameters": (
        "pass find_unused_parameters=False (or static_graph=True) when no rank has unused "
        "parameters"
    ),
    "static_graph": (
        "pass static_graph=True to DistributedDataParallel: the same parameters are used every "
        "step, and DDP can then skip the search for unused parameters"
    ),
}
