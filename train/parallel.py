"""Parallelism, in one place: process group, ColossalAI booster, optimizer, collectives, EMA shards.

On CUDA the model is boosted with ColossalAI's ``LowLevelZeroPlugin`` (ZeRO stage 2: bf16 working
weights on every rank, fp32 master weights and Adam moments sharded 1/R per rank, gradients
reduce-scattered) and optimized by ``HybridAdam`` in AdamW mode. On CPU the default (the demo) is
``TorchDDPPlugin`` over gloo with ``torch.optim.AdamW`` in fp32; ``parallel.plugin = "zero2"`` on CPU runs
the same ZeRO-2 branch over gloo, with the few CUDA assumptions of ColossalAI lifted by
``train/zero_cpu.py`` (the tests run the users' path this way). The training loop sees only the
``Parallel`` object: backward, a global gradient norm, step, sums over ranks, and the fp32
master values that feed the EMA.

EMA sharding follows ZeRO's own layout: every parameter is flattened, zero-padded to a multiple
of R and cut into R equal chunks; rank r keeps chunk r of the fp32 EMA. Under ZeRO that chunk is
exactly the master shard the optimizer holds, so the update ema = d*ema + (1-d)*master needs no
communication. Saving gathers the chunks on rank 0.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from reelcache.log import quiet_libraries

if TYPE_CHECKING:  # train/sections.py builds these lazily: annotations only, no import cycle
    from reelcache.train.sections import OptimConfig, ParallelConfig

# colossalai is imported when the booster is first needed (Parallel._booster: the optimizer or the boost,
# after every check of a start has passed), first through colossalai_classes() (quietly: its import prints
# notices about optional CUDA kernels), and so is train/zero_cpu.py, which imports it at its top; what
# else uses this module (setup, free_port, the optimizer files for the checkpoint writer) needs none.


@dataclass
class Parallel:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    dtype: torch.dtype  # working dtype of the boosted model
    plugin_name: str
    booster: object = None
    cfg: ParallelConfig | None = None  # [parallel]: what it was set up with (its grad_clip clips here)

    @classmethod
    def setup(cls, cfg: ParallelConfig) -> Parallel:
        """Join the process group that torchrun / ``colossalai run`` describe (or a 1-process one), with
        [parallel]'s plugin, working dtype and gradient clipping (``ParallelConfig.build``); the booster
        comes with the first optimizer or boost."""
        plugin, dtype = cfg.plugin, cfg.dtype
        cuda = torch.cuda.is_available() and os.environ.get("REELCACHE_DEVICE", "") != "cpu"
        name = ("zero2" if cuda else "ddp") if plugin == "auto" else plugin
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
        local_rank = int(os.environ["LOCAL_RANK"])
        if cuda:
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            # Collectives that wait longer than this are a hang, not a slow step: fail with a trace.
            dist.init_process_group(
                "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=collective_timeout_s())
            )
        wdtype = torch.bfloat16 if (name == "zero2" and dtype == "bf16") else torch.float32
        return cls(
            dist.get_rank(),
            dist.get_world_size(),
            local_rank,
            torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
            wdtype,
            name,
            None,
            cfg,
        )

    def _booster(self):
        """ColossalAI's booster with [parallel]'s plugin, made on first use: ColossalAI's import costs a
        process about 5 CPU-s (peft, transformers, bitsandbytes' torch.compile), which a start that a
        check refuses (the run lease, the checkpoint, the manifests) never pays."""
        if self.booster is not None:
            return self.booster
        cfg, cuda = self.cfg, self.device.type == "cuda"
        Booster, LowLevelZeroPlugin, TorchDDPPlugin = colossalai_classes()
        if not cuda:  # else ColossalAI finds the GPU itself and moves the model there
            from colossalai.accelerator import set_accelerator

            set_accelerator("cpu")
        if self.zero:
            if not cuda:
                from reelcache.train import zero_cpu

                zero_cpu.enable()
            # overlap_communication records the flat gradients on a CUDA stream: CUDA only.
            plug = LowLevelZeroPlugin(
                stage=2,
                precision="bf16" if cfg.dtype == "bf16" else "fp32",
                initial_scale=2**16,
                max_norm=cfg.grad_clip,
                reduce_bucket_size_in_m=20,
                overlap_communication=cuda,
            )
        else:
            plug = TorchDDPPlugin()
        self.booster = Booster(plugin=plug)
        return self.booster

    @property
    def zero(self) -> bool:
        return self.plugin_name == "zero2"

    def optimizer(self, cfg: OptimConfig, *, params) -> torch.optim.Optimizer:
        """[optim]'s AdamW over ``params`` (``OptimConfig.build``): HybridAdam under ZeRO, torch's under DDP."""
        if self.zero:
            self._booster()  # HybridAdam after the accelerator and the CPU ZeRO mode are set
            from colossalai.nn.optimizer import HybridAdam

            return HybridAdam(params, lr=cfg.lr, **cfg.hyper(), adamw_mode=True)
        return torch.optim.AdamW(params, lr=cfg.lr, **cfg.hyper())

    def boost(self, model, optimizer):
        with warnings.catch_warnings():  # torch's notice about DDP's broadcast_buffers, set by the plugin
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*")
            model, optimizer, *_ = self._booster().boost(model, optimizer)
        return model, optimizer

    def backward(self, loss, optimizer) -> None:
        self._booster().backward(loss, optimizer)

    def grad_norm(self, model, optimizer) -> torch.Tensor:
        """The global L2 gradient norm, before the step; clips to [parallel]'s grad_clip where the step will not.

        DDP: gradients are already averaged on every rank, so the local norm is global; clipping
        happens here. ZeRO: each rank holds a shard; the norm is reduced over the data-parallel
        group and the optimizer clips inside its own step (the plugin's max_norm).
        """
        if self.zero:  # the boosted optimizer is ColossalAI's LowLevelZeroOptimizer
            total = 0.0
            for gid in range(optimizer.num_param_groups):
                for store in optimizer.pg_to_grad_store.values():
                    grads = store.get_working_grads_by_group_id(gid)
                    total += optimizer._compute_grad_norm(dp_pg=store.torch_pg, gradients=grads) ** 2
            return torch.tensor(total**0.5)
        params = [p for p in model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm).detach().float().cpu()
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).cpu()

    def sum(self, values: list[float] | torch.Tensor) -> torch.Tensor:
        """Sum over ranks of a small float64 vector (one collective for all of them)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float] | torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over ranks of a small float64 vector."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def _all_reduce(self, values, op) -> torch.Tensor:
        t = torch.as_tensor(values, dtype=torch.float64).to(self.device)
        if self.world > 1:
            dist.all_reduce(t, op=op)
        return t.cpu()

    def gather_objects(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # -- EMA shards --------------------------------------------------------------------------
    def chunk(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a flattened tensor, zero-padded to a multiple of R (ZeRO's layout)."""
        n = flat.numel()
        pad = (self.world - n % self.world) % self.world
        if pad:
            flat = torch.nn.functional.pad(flat, [0, pad])
        return flat.view(self.world, -1)[self.rank]

    def master_chunks(self, model, optimizer) -> dict[str, torch.Tensor]:
        """name -> fp32 master values of this rank's chunk, for every trainable parameter."""
        inner = model.unwrap()
        out = {}
        if self.zero:
            masters = optimizer.get_working_to_master_map()
            for name, p in inner.named_parameters():
                if p.requires_grad:
                    out[name] = masters[id(p)]
        else:
            for name, p in inner.named_parameters():
                if p.requires_grad:
                    out[name] = self.chunk(p.detach().reshape(-1)).float()
        return out

    def gather_full(self, chunks: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
        """Full tensors from every rank's chunks (a collective), in host memory on rank 0 only ({} elsewhere)."""
        full = {}
        for name, c in chunks.items():
            parts = [torch.empty_like(c) for _ in range(self.world)]
            if self.world > 1:
                dist.all_gather(parts, c.contiguous())
            else:
                parts = [c]
            if self.rank == 0:
                n = shapes[name].numel()
                full[name] = torch.cat(parts)[:n].view(shapes[name]).cpu()
        return full

    # -- optimizer state ---------------------------------------------------------------------
    # One format for both plugins, so a checkpoint moves between them and between world sizes:
    # every parameter's full (gathered) Adam moments as safetensors keyed "<name>::<key>", the
    # step counts and hyper-parameters as JSON. Under ZeRO, ColossalAI gathers the shards
    # (``state_dict_shard``) and re-partitions them for this world size on load (``load_state_dict``).
    def optimizer_state(self, optimizer, model) -> tuple[dict, dict] | None:
        """The full optimizer state in host memory, copies (the next step may not change them), on
        rank 0; None elsewhere. A collective under ZeRO: every rank calls it."""
        if self.zero:
            state = {}
            for block, _ in optimizer.state_dict_shard(max_shard_size=1024, only_on_master=True):
                state.update(block)
        else:
            state = optimizer.state_dict()["state"]
        if self.rank != 0:
            return None
        names = _param_names(model, optimizer)
        tensors, scalars = {}, {}
        for idx, st in state.items():
            for k, v in st.items():
                if k == "step":  # a tensor in torch's AdamW, an int in HybridAdam
                    scalars.setdefault(names[idx], {})[k] = int(float(v))
                elif torch.is_tensor(v):
                    tensors[f"{names[idx]}::{k}"] = v.detach().to("cpu", copy=True).contiguous()
                else:
                    scalars.setdefault(names[idx], {})[k] = v
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return tensors, {
            "format": 2,
            "optimizer": type(_inner(optimizer)).__name__,
            "param_groups": groups,
            "scalars": scalars,
        }

    def load_optimizer(self, optimizer, model, path: str) -> None:
        """Load a state written by ``write_optimizer`` (by either plugin, at any world size). The
        hyper-parameters stay this optimizer's (the trainer sets them from the config)."""
        tensors, meta = read_optimizer(path)
        names = _param_names(model, optimizer)
        index = {n: i for i, n in names.items()}
        saved = {key.rsplit("::", 1)[0] for key in tensors} | set(meta["scalars"])
        if missing := sorted(saved - index.keys()):
            raise ValueError(f"optimizer state for parameters this model lacks: {missing[:5]}")
        if absent := sorted(n for n in index if n not in saved):
            raise ValueError(f"optimizer state lacks parameters of this model: {absent[:5]}")
        state: dict[int, dict] = {}
        for key, v in tensors.items():
            name, k = key.rsplit("::", 1)
            state.setdefault(index[name], {})[k] = v
        for name, sc in meta["scalars"].items():
            for k, v in sc.items():  # torch's AdamW wants a tensor step; HybridAdam makes it an int
                state.setdefault(index[name], {})[k] = torch.tensor(float(v)) if k == "step" else v
        groups, i = [], 0
        for g in optimizer.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + n))})
            i += n
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _param_names(model, optimizer) -> dict[int, str]:
    """Optimizer state index -> parameter name (torch numbers parameters across groups in order).
    ZeRO's optimizer holds fp32 master shards: each is named after the working parameter it updates."""
    by_id = {id(p): n for n, p in model.unwrap().named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if hasattr(optimizer, "get_master_to_working_map"):
        working = optimizer.get_master_to_working_map()
        params = [working[id(p)] for p in params]
    return {i: by_id[id(p)] for i, p in enumerate(params)}


def _inner(optimizer):
    """The torch optimizer under ColossalAI's wrappers (HybridAdam, AdamW)."""
    while hasattr(optimizer, "optim"):
        optimizer = optimizer.optim
    return optimizer


def write_optimizer(path, tensors: dict, meta: dict) -> None:
    """``optimizer/``: state.safetensors (the moments by parameter name) + optimizer.json."""
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "state.safetensors"))
    with open(os.path.join(path, "optimizer.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)


def read_optimizer(path) -> tuple[dict, dict]:
    with open(os.path.join(path, "optimizer.json")) as f:
        meta = json.load(f)
    return load_file(os.path.join(path, "state.safetensors")), meta


def colossalai_classes():
    """ColossalAI's booster and plugins, without the import-time noise about optional CUDA kernels."""
    quiet_libraries()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from colossalai.booster import Booster
        from colossalai.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin
    return Booster, LowLevelZeroPlugin, TorchDDPPlugin


def collective_timeout_s() -> float:
    """How long a collective may wait for a peer before it fails: ``REELCACHE_COLLECTIVE_TIMEOUT_S``,
    default 1800 (torch's own). A node that goes silent (its link cut, its processes frozen: no
    closed socket to notice) holds every other rank in its collective this long; ``watchdog.limit_s``
    ends such a step earlier, naming the ranks that stopped answering. On GPUs it is NCCL's timeout,
    enforced by its watchdog thread (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default since torch 2.2)."""
    from reelcache.settings import env_seconds

    return env_seconds("REELCACHE_COLLECTIVE_TIMEOUT_S", 1800, gt=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
