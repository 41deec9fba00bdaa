"""ZeRO-2 on CPU: ColossalAI's ``LowLevelZeroPlugin`` and ``HybridAdam`` over gloo, with no GPU.

The training path users launch (ZeRO stage 2, bf16 working weights, fp32 master shards, HybridAdam,
sharded optimizer checkpoints) is the ``zero2`` branch of ``train/parallel.py``. ColossalAI 0.5.0
runs that branch on CPU processes over gloo once four CUDA assumptions are lifted; this module
lifts exactly those four and nothing else, so the CPU suite executes the same classes and code
the GPU nodes do:

1. ``LowLevelZeroOptimizer._sanity_checks`` asserts that the accelerator is cuda or npu: on CPU
   it keeps only the check that every parameter has the working dtype.
2. ColossalAI's CPU accelerator refuses ``Stream()``, ``current_stream``, ``stream`` and
   ``synchronize``; the bucket store creates a stream even with overlap off and
   ``load_optimizer`` synchronizes. ``torch.cpu`` has the no-op equivalents.
3. Overlapped communication calls ``record_stream`` on the flat gradients, which CPU tensors do
   not have: the plugin gets ``overlap_communication=False`` (``Parallel.setup``).
4. ``HybridAdam`` updates CPU parameters with its C++ CPU-Adam kernel, which ColossalAI registers
   as a CUDA extension (``CPUAdamLoader``) and cannot build without nvcc. Here the kernel object
   is a pure-torch one that runs ColossalAI's own ``CPUAdam.torch_adam_update`` (the path HybridAdam
   already takes for bf16 gradients), so ``HybridAdam.step`` itself is unchanged.

What this cannot show (docs/TRAIN.md, "ZeRO-2 on CPU"): overlapped communication and stream ordering,
NCCL, HybridAdam's fused CUDA kernel and its build, bf16 GPU numerics, memory.

``enable()`` is called by ``Parallel.setup`` only when the run asks for ``zero2`` and trains on the
CPU (no CUDA device, or ``REELCACHE_DEVICE=cpu``); it patches ColossalAI's CPU accelerator class,
its CPU-Adam loader and the optimizer's sanity check, none of which a CUDA run touches. Idempotent.
"""

from __future__ import annotations

import torch
from colossalai.accelerator.cpu_accelerator import CpuAccelerator
from colossalai.kernel import kernel_loader
from colossalai.nn.optimizer.cpu_adam import CPUAdam
from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

# colossalai at the top: train/parallel.py imports this module only in Parallel.setup, after its
# quiet import of colossalai.

_enabled = False


def enable() -> None:
    """Apply the adaptations 1, 2 and 4 to this process (3 is a plugin argument)."""
    global _enabled
    if _enabled:
        return

    LowLevelZeroOptimizer._sanity_checks = _dtype_checks_only
    CpuAccelerator.Stream = lambda self, *a, **k: torch.cpu.Stream()
    CpuAccelerator.current_stream = lambda self, *a, **k: torch.cpu.current_stream()
    CpuAccelerator.stream = lambda self, stream: torch.cpu.stream(stream)
    CpuAccelerator.synchronize = lambda self, *a, **k: torch.cpu.synchronize()
    kernel_loader.CPUAdamLoader.load = lambda self: _TorchCpuAdamModule
    _enabled = True


def _dtype_checks_only(self) -> None:
    """``LowLevelZeroOptimizer._sanity_checks`` without its accelerator assertion."""
    for group in self.optim.param_groups:
        for p in group["params"]:
            if not getattr(p, "skip_zero_check", False):
                assert p.dtype == self._dtype, f"parameters must all be {self._dtype}, got {p.dtype}"


class _TorchCpuAdam:
    """The interface of ColossalAI's C++ ``CPUAdamOptimizer`` (``step`` with the kernel's argument
    order), computed by ``CPUAdam.torch_adam_update``: AdamW with bias correction, in place."""

    def __init__(self, lr, beta1, beta2, eps, weight_decay, adamw_mode):
        self.adamw_mode = adamw_mode

    def step(
        self, step, lr, beta1, beta2, eps, weight_decay, bias_correction, param, grad, exp_avg, exp_avg_sq, div_scale=-1
    ):
        if div_scale > 0:
            grad = grad / div_scale
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        CPUAdam.torch_adam_update(
            None, param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, bc1, bc2, self.adamw_mode
        )


class _TorchCpuAdamModule:
    """Stands where the built extension module would: ``module.CPUAdamOptimizer(...)``."""

    CPUAdamOptimizer = _TorchCpuAdam
