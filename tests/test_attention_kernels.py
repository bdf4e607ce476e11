"""Which kernel runs each attention block, and the calls around torch's fused CUDA kernels, tested on the CPU.

The CUDA kernels are stood in for by ``cuda_standin.StandInCudaKernels`` (the same contract, computed explicitly,
misuse refused); the kernel choice is checked against torch's constraints (``kernel_rules``), and the ring on the
fused paths against one-process SDPA in fp64. On a GPU the same calls run torch's kernels: scripts/gpu_check.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from cuda_standin import StandInCudaKernels
from mesh3d.domain.attention.collect import AttentionCall, _attend
from mesh3d.domain.attention.backends import BlockKernels, PlannedCudaKernels, use_block_kernels
from mesh3d.domain.attention.kernel_rules import SdpaCall, sdpa_choice
from mesh3d.domain.attention.kernels import block_backward, block_forward, block_kernel
from mesh3d.domain.attention.ring import RingPlan, ring_attention
from mesh3d.domain.attention.score_tiles import MaskRule, Segment
from mesh3d.domain.core.group import DomainComm

ONE = DomainComm(None, (0,), 0)
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
CUDNN_FIRST = ("cudnn", "flash", "efficient", "math")


def _qkv(dtype, heads=4, kv_heads=4, q_rows=8, k_rows=8, width=16, value_width=None):
    q = torch.zeros(1, heads, q_rows, width, dtype=dtype)
    k = torch.zeros(1, kv_heads, k_rows, width, dtype=dtype)
    return q, k, torch.zeros(1, kv_heads, k_rows, value_width or width, dtype=dtype)


BOOL, FLOAT = "bool", "float"
# (dtype, qkv options, mask, causal, want_dmask, math, order) -> the kernel
CASES = [
    (BF16, {}, None, False, False, False, None, "flash"),
    (torch.float16, {}, None, True, False, False, None, "flash"),
    (BF16, {"q_rows": 12, "k_rows": 5}, None, True, False, False, None, "flash"),  # split into square + full calls
    (BF16, {"width": 3}, None, False, False, False, None, "flash"),  # head dims padded to 8
    (BF16, {"heads": 8, "kv_heads": 2}, None, True, False, False, None, "flash"),  # GQA native
    (BF16, {}, BOOL, False, False, False, None, "efficient"),
    (BF16, {}, FLOAT, False, False, False, None, "efficient"),
    (F32, {}, None, True, False, False, None, "efficient"),
    (F32, {"heads": 8, "kv_heads": 2}, FLOAT, False, False, False, None, "efficient"),  # K/V heads expanded
    (F32, {"width": 6}, None, False, False, False, None, "math"),  # no fused kernel takes a head dim of 6 in fp32
    (BF16, {"width": 512}, None, False, False, False, None, "efficient"),  # flash takes at most 256
    (F64, {}, None, False, False, False, None, "math"),
    (F32, {}, FLOAT, False, True, False, None, "math"),  # the mask's gradient is wanted
    (BF16, {}, None, False, False, True, None, "math"),  # kernel="math"
    (BF16, {}, None, True, False, False, CUDNN_FIRST, "cudnn"),
    (BF16, {"heads": 8, "kv_heads": 2}, None, False, False, False, CUDNN_FIRST, "cudnn"),
    # a masked half-precision call torch gives cuDNN: math (memory-efficient with the block's bias was measured wrong
    # there on an H200, docs/benchmarks.md "On a GPU"); fp32 masked calls stay memory-efficient
    (BF16, {}, BOOL, False, False, False, CUDNN_FIRST, "math"),
    (torch.float16, {}, FLOAT, False, False, False, CUDNN_FIRST, "math"),
    (F32, {}, BOOL, False, False, False, CUDNN_FIRST, "efficient"),
    (BF16, {"k_rows": 1}, None, False, False, False, ("cudnn", "math"), "math"),  # cuDNN needs more than one key
    (BF16, {}, None, False, False, False, ("efficient", "flash", "math"), "efficient"),
    (BF16, {}, None, False, False, False, ("math", "flash"), "math"),
]


@pytest.mark.parametrize("dtype, shape, mask, causal, want_dmask, math, order, expected", CASES)
def test_the_kernel_each_cuda_block_runs(dtype, shape, mask, causal, want_dmask, math, order, expected):
    """The kernel choice on CUDA (the table of ``attention/kernels.py``): torch's own choice for the call as mesh3d
    makes it (square causal calls, expanded K/V heads for the kernels that need them), math for what only it does."""
    q, k, v = _qkv(dtype, **shape)
    m = None if mask is None else torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool if mask == BOOL else dtype)
    kernels = StandInCudaKernels(order=order) if order else StandInCudaKernels()
    assert block_kernel(q, k, v, m, causal, want_dmask, math, kernels) == expected


def test_the_kernel_off_cuda_and_in_a_plan():
    """On the CPU torch's fused CPU kernel (fp64 too), the math kernel elsewhere; a plan for CUDA on meta tensors
    chooses as the rules say."""
    q, k, v = _qkv(F64)
    assert block_kernel(q, k, v, None, True, kernels=BlockKernels()) == "cpu_flash"
    assert block_kernel(q, k, v, None, False, math=True, kernels=BlockKernels()) == "math"
    meta = [t.to(device="meta", dtype=BF16) for t in (q, k, v)]
    assert block_kernel(*meta, None, True, kernels=BlockKernels()) == "math"
    assert block_kernel(*meta, None, True, kernels=PlannedCudaKernels()) == "flash"
    assert block_kernel(*[t.float() for t in meta], None, True, kernels=PlannedCudaKernels()) == "efficient"


def test_the_rules_follow_torch_s_order_and_switches():
    call = SdpaCall.of(*_qkv(BF16), None, False)
    assert sdpa_choice(call) == "flash"
    assert sdpa_choice(call, enabled=("efficient", "math")) == "efficient"
    assert sdpa_choice(call, enabled=("cudnn",), order=("flash", "efficient", "math", "cudnn")) == "cudnn"
    assert sdpa_choice(SdpaCall.of(*_qkv(BF16, q_rows=4), None, True), enabled=("flash", "math")) == "math"


def _reference(q, k, v, mask, rule, scale=None):
    qi, ki = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    vis = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    if rule.right is not None:
        vis &= ki <= qi + rule.right
    if rule.left is not None:
        vis &= ki >= qi - rule.left
    if mask is not None:
        vis = (mask & vis) if mask.dtype == torch.bool else mask.masked_fill(~vis, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=vis, enable_gqa=True, scale=scale)


def _order(draw, n: int) -> Segment:
    """Every row of 0..n once, in runs of a shuffled order."""
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3)))) if n > 1 else []
    runs = [(a, b) for a, b in zip([0, *cuts], [*cuts, n]) if b > a]
    return Segment(tuple(draw(st.permutations(runs))))


ORDERS = {"flash": ("flash", "math"), "efficient": ("efficient", "math"), "cudnn": ("cudnn", "efficient", "math")}


@settings(max_examples=30, deadline=None)
@given(data=st.data(), kernel=st.sampled_from(sorted(ORDERS)),
       rule=st.sampled_from([MaskRule(), MaskRule(None, 0), MaskRule(3, 0), MaskRule(2, 5)]),
       gqa=st.booleans(), mask_kind=st.sampled_from([None, "bool", "float"]), width=st.sampled_from([8, 5]))
def test_the_ring_on_each_fused_kernel_equals_sdpa_in_fp64(data, kernel, rule, gqa, mask_kind, width):
    """The ring on one rank with its queries and keys in two different shuffled orders (so the causal diagonal cuts
    blocks with more queries than keys), on each stood-in CUDA kernel: output and gradients of q, k, v equal SDPA
    in fp64 (rows no key is visible to give 0). Masked blocks run memory-efficient (flash takes no mask, cuDNN
    none of mesh3d's)."""
    n = data.draw(st.integers(1, 14))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    heads, kv_heads = 4, (2 if gqa else 4)
    q, k, v = (torch.randn(2, h, n, width, dtype=F64, generator=gen, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(1, heads, n, n, generator=gen) > 0.4
    elif mask_kind == "float":
        mask = torch.randn(2, 1, n, n, dtype=F64, generator=gen)
    rule = MaskRule(rule.left, rule.right, mask is not None)
    ref = _reference(q, k, v, mask, rule)
    cot = torch.randn(ref.shape, dtype=F64, generator=gen)
    want = torch.autograd.grad((ref * cot).sum(), (q, k, v))
    q_order, k_order = _order(data.draw, n), _order(data.draw, n)
    qi, ki = q_order.index(), k_order.index()
    plan = RingPlan(ONE, (q_order,), (k_order,), rule, width ** -0.5, "global" if mask is not None else None)
    kernels = StandInCudaKernels(exact=True, order=ORDERS[kernel])
    with use_block_kernels(kernels):
        out = ring_attention(plan, q[:, :, qi], k[:, :, ki], v[:, :, ki], mask)
        got = torch.autograd.grad((out * cot[:, :, qi]).sum(), (q, k, v))
    assert torch.allclose(out, ref[:, :, qi], rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    ran = {name for name, _ in kernels.calls}  # masked blocks, and cuDNN's blocks of one key, run memory-efficient
    assert ran <= ({"efficient"} if mask is not None else {kernel, "efficient"}), ran
    # NOTE: a window (left bound, or a right bound other than the diagonal) cuts blocks that need a mask: those run
    # memory-efficient where it is enabled, else the math kernel (flash's order here), so only full and causal rules
    # run every block on the kernel (hypothesis seeds 209147585, 5 and 6 drew flash with MaskRule(3, 0), n >= 2)
    windowed = rule.left is not None or rule.right not in (None, 0)
    if mask is None and width == 8 and kernel != "cudnn" and (kernel == "efficient" or not windowed):
        assert ran == {kernel}, ran


@pytest.mark.parametrize("kernel", sorted(ORDERS))
def test_a_block_cut_by_the_diagonal_runs_square_causal_calls(kernel):
    """12 queries against 5 keys, top-left causal: flash and cuDNN align a non-square causal flag bottom-right (the
    stand-in does too), so the block runs as a square causal call and a full one; exact against the math kernel."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 12, 8, dtype=F64, generator=gen)
    k, v = (torch.randn(1, 2, 5, 8, dtype=F64, generator=gen) for _ in range(2))
    kernels = StandInCudaKernels(exact=True, order=ORDERS[kernel])
    out, lse = block_forward(q, k, v, None, True, 0.3, kernels=kernels)
    want_out, want_lse = block_forward(q, k, v, None, True, 0.3, math=True)
    assert torch.allclose(out, want_out, atol=1e-13) and torch.allclose(lse, want_lse, atol=1e-13)
    dout = torch.randn(out.shape, dtype=F64, generator=gen)
    got = block_backward(dout, q, k, v, out, lse, None, True, 0.3, kernels=kernels)[:3]
    want = block_backward(dout, q, k, v, out, lse, None, True, 0.3, math=True)[:3]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)
    assert kernels.calls == [(kernel, "forward")] * 2 + [(kernel, "backward")] * 2


def test_half_precision_blocks_merge_like_sdpa():
    """bf16 through the stood-in flash kernel (bf16 outputs, fp32 log-sum-exp and accumulation): the ring is as close
    to fp64 SDPA as bf16 SDPA itself is, within a factor of 2."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 24, 16, generator=gen) for _ in range(3))
    plan = RingPlan(ONE, (Segment(((0, 10), (10, 24))),), (Segment(((0, 7), (7, 24))),), MaskRule(None, 0), 0.25)
    kernels = StandInCudaKernels()
    with use_block_kernels(kernels):
        out = ring_attention(plan, q.bfloat16(), k.bfloat16(), v.bfloat16())
    exact = F.scaled_dot_product_attention(*(t.bfloat16().double() for t in (q, k, v)), is_causal=True, scale=0.25)
    sdpa = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, scale=0.25)
    assert {name for name, _ in kernels.calls} == {"flash"}
    assert (out.double() - exact).abs().max() <= 2 * (sdpa.double() - exact).abs().max() + 1e-3


class _SdpaCalls(TorchFunctionMode):
    """The SDPA calls made inside, as the rules see them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[SdpaCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            self.calls.append(SdpaCall.of(q, k, v, kwargs.get("attn_mask"), kwargs.get("is_causal", False)))
        return func(*args, **kwargs)


# (dtype, K/V heads, rule, mask, first query row) -> the kernel torch's SDPA runs on CUDA
COLLECT = [
    (BF16, 4, MaskRule(None, 0), None, 0, "flash"),  # D=1 and Ulysses: every row, the causal flag
    (F32, 4, MaskRule(None, 0), None, 0, "efficient"),
    (BF16, 4, MaskRule(None, 0), None, 4, "efficient"),  # gather on a later rank: the causal band as a mask
    (BF16, 4, MaskRule(3, 0), None, 0, "efficient"),  # a sliding window
    (BF16, 2, MaskRule(None, 0), None, 0, "flash"),  # grouped K/V heads: flash groups them itself
    (F32, 2, MaskRule(None, 0), None, 0, "efficient"),  # ... other kernels get them expanded
    (BF16, 2, MaskRule(user=True), "bool", 0, "efficient"),
    (F32, 2, MaskRule(user=True), "float", 4, "efficient"),
    (F64, 2, MaskRule(None, 0), None, 0, "math"),  # no fused CUDA kernel takes fp64: nothing expanded
]


@pytest.mark.parametrize("dtype, kv_heads, rule, mask_kind, first, expected", COLLECT)
def test_gather_and_ulysses_reach_a_fused_kernel_on_cuda(dtype, kv_heads, rule, mask_kind, first, expected):
    """The SDPA call gather, Ulysses and a one-rank domain make (``collect._attend``), with CUDA stood in for: the
    kernel torch's rules give it, and its result equal to one-process SDPA on those rows."""
    gen = torch.Generator().manual_seed(1)
    n, heads = 8, 4
    q, k, v = (torch.randn(1, h, n, 8, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    mask = None if mask_kind is None else torch.rand(1, 1, n, n, generator=gen) > 0.3
    mask = mask.to(dtype).log() if mask_kind == "float" else mask
    call = AttentionCall(ONE, (Segment.run(0, n),), (Segment.run(0, n),), rule, 0.3, kv_heads != heads,
                         None if mask is None else "global")
    seen = _SdpaCalls()
    with use_block_kernels(StandInCudaKernels()), seen:
        out = _attend(call, q[:, :, first:], k, v, mask, Segment.run(first, n), Segment.run(0, n), None)
    assert [sdpa_choice(c) for c in seen.calls] == [expected]
    exact = None if mask is None or mask.dtype == torch.bool else mask.double()
    want = _reference(q.double(), k.double(), v.double(), mask if exact is None else exact, rule, 0.3)[:, :, first:]
    assert torch.allclose(out.double(), want, atol=2e-2 if dtype == BF16 else 1e-5)


def test_torch_s_choice_is_asked_outside_compiled_graphs_only():
    """Dynamo cannot trace torch's own choice (an op returning an int): traced, the rules answer, with no graph break."""
    kernels = BlockKernels()

    @torch.compile(backend="eager", fullgraph=True)
    def kernel_of(q, k, v):
        return q * (2 if kernels.choose(q, k, v, None, True, True) == "flash" else 3)

    q, k, v = _qkv(BF16, heads=4, kv_heads=2)
    q = q + 1
    assert torch.equal(kernel_of(q, k, v), q * 2)
    assert kernels.choose(q, k, v, None, True, True) == "flash"  # eager on the CPU: torch's answer for CPU tensors

