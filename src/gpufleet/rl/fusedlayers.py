"""The training forward's RMSNorm and SwiGLU on CPU, each one C pass forward and one backward.

Hugging Face's ``*RMSNorm`` is six tensor operations (power, mean, add, rsqrt, two products) and its
backward under autograd about ten more; ``act_fn(gate) * up`` is two operations and three backward. On
the CPU each of them is a pass over (batch x tokens x width) floats, a fresh allocation and its page
faults: in the ``small`` benchmark's policy forward + backward the norms took about 8% and the SwiGLU
about 7% of the time, the matmuls around them 68%. Here (``cpu_kernels.c``: ``gpufleet_rms_*``,
``gpufleet_swiglu_*``) each is one pass forward and one backward, saving for backward only its input (the
norm: and one float per row; the SwiGLU: gate and up, not the activation too).

``fused_layers(model)`` swaps the ``forward`` of the supported modules (``NORM_CLASSES``, and the
``MLP_CLASSES`` whose activation is SiLU) for the length of a block, as ``loghead.fused_head`` swaps the
head; ``sequence_logprobs`` uses it around its forward. It applies only where all of this holds: the
model's first parameter is a float32 CPU tensor, the C kernels run here (``cpu_kernels.available``), no
layer is compiled (``train.torch_compile``: the compiled layers trace the modules' own code), no layer
is checkpointed in a forward that keeps gradients (``model.gradient_checkpointing``: its recomputation in
backward runs after the block, with the modules' own code), and ``GPUFLEET_FUSED_LAYERS`` is not 0. Each call checks its own input too (float32, on the CPU) and takes
the module's own forward otherwise.

Results differ from the torch operations by rounding only (the row's sum of squares in another order,
Cephes' ``expf``): forward within 1e-6 relative, gradients within a few 1e-6 (tested; TRL's gradient
equality in ``bench/trl_grad_equal.py``: 1.8e-7 with them, 1.2e-7 without). They do not depend on the thread count; each
row's result does not depend on the other rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gpufleet.rl import cpu_kernels
from gpufleet.rl.switches import FUSED_LAYERS, switched_off

__all__ = ["ENV", "MLP_CLASSES", "NORM_CLASSES", "fused_layers", "rms_norm", "swiglu"]

ENV = FUSED_LAYERS
"""Set to 0 to run the models' own RMSNorm and MLP code in the training forward on CPU."""

NORM_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
        "Phi3RMSNorm",
        "Olmo2RMSNorm",
    }
)
"""Norms computing ``weight * (x * rsqrt(mean(x^2) + variance_epsilon))`` over the last dimension
(transformers 5.23's code; Gemma's ``1 + weight`` is not one of them)."""

MLP_CLASSES = frozenset(
    {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen2MoeMLP", "Qwen3MLP", "Qwen3MoeMLP", "Olmo2MLP"}
)
"""MLPs computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; fused where ``act_fn`` is SiLU."""


_NORM_BLOCK = 32
"""Rows per partial sum of the norm's weight gradient: ``NORM_BLOCK`` in ``cpu_kernels.c``."""


def _threads() -> int:
    return torch.get_num_threads()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        lib = cpu_kernels.library()
        x = x.contiguous()
        n = x.shape[-1]
        rows = x.numel() // n
        out = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32)
        w = weight.detach().contiguous()
        lib.gpufleet_rms_forward(
            x.data_ptr(), w.data_ptr(), eps, rows, n, out.data_ptr(), rstd.data_ptr(), _threads()
        )
        ctx.save_for_backward(x, w, rstd)
        return out

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        lib = cpu_kernels.library()
        x, w, rstd = ctx.saved_tensors
        gy = gy.contiguous()
        n, rows = x.shape[-1], rstd.numel()
        gx = torch.empty_like(x)
        gw = partial = None
        if ctx.needs_input_grad[1]:
            gw = torch.empty(n, dtype=torch.float32)
            partial = torch.empty(-(-rows // _NORM_BLOCK), n, dtype=torch.float32)
        lib.gpufleet_rms_backward(
            x.data_ptr(),
            w.data_ptr(),
            rstd.data_ptr(),
            gy.data_ptr(),
            rows,
            n,
            gx.data_ptr(),
            None if gw is None else gw.data_ptr(),
            None if partial is None else partial.data_ptr(),
            _threads(),
        )
        return gx, gw, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        lib = cpu_kernels.library()
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        lib.gpufleet_swiglu_forward(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr(), _threads())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, gh: torch.Tensor):
        lib = cpu_kernels.library()
        gate, up = ctx.saved_tensors
        gh = gh.contiguous()
        gg, gu = torch.empty_like(gate), torch.empty_like(up)
        lib.gpufleet_swiglu_backward(
            gate.data_ptr(),
            up.data_ptr(),
            gh.data_ptr(),
            gate.numel(),
            gg.data_ptr(),
            gu.data_ptr(),
            _threads(),
        )
        return gg, gu


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module`` (one of ``NORM_CLASSES``) applied to ``x``: fused when both are float32 on the CPU."""
    if _fits(x, module.weight) and x.shape[-1] == module.weight.numel():
        return _RMSNorm.apply(x, module.weight, float(module.variance_epsilon))
    return type(module).forward(module, x)


def swiglu(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module`` (one of ``MLP_CLASSES``) applied to ``x``, its SiLU product fused when float32 on the CPU."""
    gate, up = module.gate_proj(x), module.up_proj(x)
    if _fits(gate, up) and gate.shape == up.shape:
        return module.down_proj(_SwiGLU.apply(gate, up))
    return module.down_proj(module.act_fn(gate) * up)


def _fusible(model: torch.nn.Module) -> bool:
    first = next(model.parameters(), None)
    if first is None or switched_off(ENV) or not _fits(first):
        return False
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            return False
        if getattr(m, "gradient_checkpointing", False) is True and m.training and torch.is_grad_enabled():
            return False  # the layers are recomputed in backward, after the block: as they ran first
    return cpu_kernels.available()


def _swaps(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    from transformers.activations import SiLUActivation

    swaps = []
    for module in model.modules():
        name = type(module).__name__.removeprefix("FSDP")  # fully_shard makes the class FSDP<name>
        if "forward" in module.__dict__:  # someone else's instance forward (a hook library's): left alone
            continue
        if name in NORM_CLASSES and hasattr(module, "variance_epsilon"):
            swaps.append((module, rms_norm))
        elif name in MLP_CLASSES and isinstance(
            getattr(module, "act_fn", None), (torch.nn.SiLU, SiLUActivation)
        ):
            swaps.append((module, swiglu))
    return swaps


@contextlib.contextmanager
def fused_layers(model: torch.nn.Module) -> Iterator[None]:
    """For the length of the block, the supported norms and MLPs of ``model`` run fused (see the module
    docstring); nothing changes where the conditions do not hold. Restored after."""
    swaps = _swaps(model) if _fusible(model) else []
    for module, fused in swaps:
        module.forward = fused.__get__(module)
    try:
        yield
    finally:
        for module, _ in swaps:
            del module.forward
