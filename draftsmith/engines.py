"""Which training engine a run uses (one process, DDP, FSDP2, DeepSpeed ZeRO) and the few places they differ.

`accelerate launch --config_file recipes/accelerate/<engine>.yaml` picks the engine through environment variables;
`make_accelerator(train_args)` builds the matching Accelerator with the recipe's values filled in. Two things
accelerate 1.x does not do on a machine without a GPU, done here:

- FSDP: accelerate turns FSDP on only for GPU-like devices; on CPUs its launcher starts the processes but each
  one then trains ALONE (distributed_type NO, no gradient sync). torch's FSDP2 (`fully_shard`) itself runs on CPU
  over gloo, so on CPU we start accelerate's multi-CPU (gloo) state and switch it to FSDP with the launch config's
  plugin. On a GPU nothing is changed.
- DDP: accelerate's own MULTI_CPU launch type starts ONE process (several need mpirun); a MULTI_GPU launch
  config with `use_cpu: true` starts them through torchrun, and here they connect over gloo.
- DeepSpeed: its CPU accelerator falls back to gloo when oneCCL is absent; accelerate needs the backend named
  (`InitProcessGroupKwargs(backend="gloo")`) or it leaves the run undistributed.

Sharded engines (FSDP, ZeRO-3) hold a slice of each parameter per process: `full_params` gathers them the
engine's way for evaluation and for writing final/.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from draftsmith.errors import DraftsmithError

if TYPE_CHECKING:
    from draftsmith.trainer import TrainArgs


def resolve_mixed_precision(mode: str) -> str:
    """ "no", "bf16" or "fp16" for train.mixed_precision (auto decided by the hardware)."""
    if mode == "auto":  # bf16 autocast where bf16 is native (models.default_dtype)
        from draftsmith.models import default_device, default_dtype

        return "bf16" if default_dtype(default_device()) == torch.bfloat16 else "no"
    return mode


def launched_engine() -> str:
    """The engine the launch environment asks for: "deepspeed", "fsdp", "ddp" (several processes) or "single"."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    return "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"


def engine_name(accelerator) -> str:
    """ "single", "ddp", "fsdp" or "zero<stage>" for a built Accelerator (what RESULTS.md and logs call it); an
    engine object that is not an Accelerator (draftsmith.lightning_engine) names itself in `engine_name`."""
    from accelerate.utils import DistributedType

    named = getattr(accelerator, "engine_name", None)
    if isinstance(named, str):
        return named
    t = accelerator.distributed_type
    if t == DistributedType.FSDP:
        return "fsdp"
    if t == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    return "ddp" if accelerator.num_processes > 1 else "single"


def params_sharded(accelerator) -> bool:
    """True when no process holds whole parameters between steps (FSDP, ZeRO-3)."""
    return engine_name(accelerator) in ("fsdp", "zero3")


def deepspeed_plugin_for(args: TrainArgs):
    """The launch config's DeepSpeed plugin with the recipe's numbers in place of "auto" (recipe -> DeepSpeed
    config). A launch config that fixes a number the recipe also sets must agree with it."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()  # zero stage, offload, clipping etc. from the launch config's environment
    ours = {"gradient_accumulation_steps": args.grad_accum, "gradient_clipping": args.max_grad_norm}
    for key, value in ours.items():
        theirs = getattr(plugin, key)
        if theirs not in (None, "auto") and float(theirs) != float(value):
            raise DraftsmithError(
                f"the accelerate config sets {key}={theirs} but the recipe says {value}; set it to auto in the "
                "accelerate config (the recipe's train section decides)"
            )
        setattr(plugin, key, value)
    ds = plugin.deepspeed_config
    ds["gradient_accumulation_steps"] = args.grad_accum
    ds["gradient_clipping"] = args.max_grad_norm
    # accelerate fills this from a prepared DataLoader; draftsmith deals batches itself
    ds["train_micro_batch_size_per_gpu"] = args.batch_size
    return plugin


def make_accelerator(args: TrainArgs, cpu: bool | None = None):
    """An Accelerator for the launched engine, configured from `args` (grad accumulation, mixed precision,
    clipping for DeepSpeed). `cpu=True` forces one CPU process set-up (tests); env/launch config still apply."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

    engine = launched_engine()
    mp = resolve_mixed_precision(args.mixed_precision)
    # passed as a plugin so a launch config's "auto" (or a stray env value) does not override the recipe
    kw: dict = {
        "gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=args.grad_accum),
        "mixed_precision": mp,
    }
    no_gpu = not torch.cuda.is_available()
    if engine == "deepspeed":
        kw["deepspeed_plugin"] = deepspeed_plugin_for(args)
        if no_gpu:
            kw["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
        return Accelerator(**kw)
    if engine == "fsdp" and no_gpu and cpu is not False:
        return _fsdp_on_cpu(kw)
    if engine == "ddp" and no_gpu and cpu is None:
        cpu = True  # accelerate connects CPU processes (gloo) only when told they are CPU processes
    return Accelerator(**kw) if cpu is None else Accelerator(cpu=cpu, **kw)


def _fsdp_on_cpu(kw: dict):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the launch config's FSDP_* environment
    if plugin.fsdp_version != 2:
        raise DraftsmithError(
            "FSDP on a CPU needs fsdp_version: 2 in the accelerate config (torch's FSDP1 does not run on CPU)"
        )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, **kw)
    # what accelerate does for FSDP on a GPU: bf16/fp16 compute, fp32 masters
    if kw["mixed_precision"] != "no":
        plugin.set_mixed_precision(kw["mixed_precision"])
    if accelerator.num_processes > 1:  # one process: nothing to shard, plain training is the same thing
        # both singletons carry distributed_type; accelerate reads it from either
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["fsdp_plugin"] = plugin
    return accelerator


def check_distributed(accelerator) -> None:
    """Refuse a launch whose processes would each train alone (several launched, the Accelerator sees one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and accelerator.num_processes != world:
        raise DraftsmithError(
            f"accelerate launched {world} processes but they are not connected (engine {launched_engine()} "
            "on this device); use recipes/accelerate/cpu_2proc.yaml on a CPU or fix the accelerate config"
        )


@contextlib.contextmanager
def full_params(accelerator, model: torch.nn.Module) -> Iterator[None]:
    """Inside the block every process holds `model`'s whole parameters (call on ALL processes: it communicates).

    FSDP2: unshard every FSDP module and keep it unsharded across forwards; ZeRO-3: DeepSpeed's
    GatheredParameters. Other engines: nothing to do."""
    name = engine_name(accelerator)
    if name == "fsdp":
        from torch.distributed.fsdp import FSDPModule

        mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
        reshard = bool(accelerator.state.fsdp_plugin.reshard_after_forward)
        for m in mods:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in mods:
                m.reshard()
                m.set_reshard_after_forward(reshard, recurse=False)
    elif name == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            yield
    else:
        yield


def unshard_for_good(accelerator, model: torch.nn.Module) -> None:
    """After the last step under FSDP2: give every process a plain module with whole parameters (call on ALL
    processes). FSDP2 shards in place and renames classes (`FSDPLlamaForCausalLM`); both are undone so
    save_pretrained writes the original architecture and plain tensors. Tied weights stay tied."""
    if engine_name(accelerator) != "fsdp":
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    full: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():  # same order on every process: the all-gathers pair up
        for name, p in list(module._parameters.items()):
            if isinstance(p, DTensor) or isinstance(getattr(p, "data", None), DTensor):
                if id(p) not in full:
                    full[id(p)] = torch.nn.Parameter(
                        p.full_tensor().detach().clone(), requires_grad=p.requires_grad
                    )
                module._parameters[name] = full[id(p)]
        if isinstance(module, FSDPModule):
            module.__class__ = type(module).__bases__[1]


@contextlib.contextmanager
def plain_model_init(accelerator) -> Iterator[None]:
    """Load/build models inside as ordinary modules. Under ZeRO-3 accelerate registers its DeepSpeed config with
    transformers, whose from_pretrained then partitions every model it loads (zero.Init) — the frozen target
    included, which no engine ever gathers. The trained model is partitioned when accelerator.prepare wraps it."""
    if engine_name(accelerator) != "zero3":
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()
