"""What ``mesh3d.domain`` changes in torch for the process (issue 66, item 4): nothing on import; ``Function.apply``
routed, AOTAutograd's custom-op aliasing check off and checkpoint recomputation patched from the first domain comm
made to the last one collected, a Function's rule found however often that happened; and no cache of mesh3d keeps a
mesh's comms once its manager is shut down (so the last one does go). Also: the kind of domain tensor a process makes,
read from its environment (the wrapper by default).

The process-wide state is read from torch itself, in a fresh interpreter (this one has made domain tensors already),
on both kinds of domain tensor; the multi-rank part runs in the rank pool.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from launch_helpers import clean_env

_FRESH = r"""
import gc, json
import torch
import torch._functorch.config
import torch.nn.functional as F
from torch.utils.checkpoint import _CheckpointFrame, checkpoint


def state():
    return [torch.autograd.Function.apply.__func__, torch._functorch.config.check_custom_op_aliasing,
            _CheckpointFrame.save_inputs, _CheckpointFrame.get_inputs]


def unchanged(own):
    return [a is b or a == b for a, b in zip(state(), own)]


torch_own = state()

import mesh3d.checkpoint  # noqa: E402,F401  (imports mesh3d.domain through checkpoint/nodes.py)
from mesh3d import DistributedManager, domain  # noqa: E402
from mesh3d.domain.core.group import LIVE_COMMS  # noqa: E402


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


class Ruled(Cube):  # ruled before any domain tensor exists (torch unchanged then), used in both lives below
    pass


domain.register(Ruled, rule=domain.elementwise())


def cube_grad_error():
    x = torch.linspace(-1, 1, 7, dtype=torch.float64, requires_grad=True)
    Cube.apply(x).sum().backward()
    return float((x.grad - 3 * x.detach() ** 2).abs().max())


def refusal(t):
    try:
        Cube.apply(t)
    except NotImplementedError as err:
        return str(err)
    return None


torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.GroupNorm(2, 4), torch.nn.GELU(),
                          torch.nn.MaxPool2d(2), torch.nn.Upsample(scale_factor=2)).double()
x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
want = F.mse_loss(checkpoint(net, x, use_reentrant=False), x[:, :1].expand(2, 4, 8, 8))
out = {"import": unchanged(torch_own), "plain_function": cube_grad_error(), "comms": [LIVE_COMMS.count]}
for life in range(2):
    DistributedManager.initialize(batch=1, domain=1)
    xs = domain.shard(x, dim=2)
    out[f"alive{life}"] = unchanged(torch_own)
    out[f"refused{life}"] = refusal(xs)
    out[f"ruled{life}"] = float((Ruled.apply(xs).full_tensor().to_local() - x ** 3).abs().max())
    # checkpoint recomputation, nested: the inner region's input is rebuilt as a domain tensor
    inner = lambda t: checkpoint(net, t, use_reentrant=False)
    got = F.mse_loss(checkpoint(inner, xs, use_reentrant=False), domain.shard(x[:, :1].expand(2, 4, 8, 8), dim=2))
    got.backward()
    out[f"loss{life}"] = abs(float(got) - float(want))
    del xs, got
    DistributedManager.shutdown()
    gc.collect()
    out[f"gone{life}"] = unchanged(torch_own)
    out["comms"].append(LIVE_COMMS.count)
out["plain_function_after"] = cube_grad_error()
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", ["storage", "wrapper"])
def test_torch_is_changed_only_while_a_domain_tensor_can_exist(kind):
    env = clean_env(MESH3D_DOMAIN_WRAPPER="1" if kind == "wrapper" else "0")
    proc = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    everything = [True] * 4  # Function.apply, the aliasing check, checkpoint's save_inputs and get_inputs
    assert out["import"] == everything, out  # import mesh3d.checkpoint / mesh3d.domain: torch as it was
    assert out["plain_function"] < 1e-12 and out["plain_function_after"] < 1e-12, out
    for life in range(2):  # made, used, gone; then made again
        assert out[f"alive{life}"] == [False] * 4, (life, out)
        assert "Cube.apply (a torch.autograd.Function) has no domain rule" in out[f"refused{life}"], out
        assert out[f"loss{life}"] < 1e-12 and out[f"ruled{life}"] < 1e-12, out
        assert out[f"gone{life}"] == everything, (life, out)
    assert out["comms"] == [0, 0, 0], out


_KIND = r"""
import torch
from mesh3d import domain
print(type(domain.shard(torch.zeros(1, 2, 4, 4), dim=2)).__name__)
"""


@pytest.mark.parametrize(("value", "made"), [(None, "WrappedDomainTensor"), ("1", "WrappedDomainTensor"),
                                              ("0", "DomainTensor"), ("yes", None)])
def test_the_kind_of_domain_tensor_a_process_makes_is_read_from_its_environment(value, made):
    env = clean_env() if value is None else clean_env(MESH3D_DOMAIN_WRAPPER=value)
    if value is None:  # NOTE: the default, whatever the run around this test sets
        env.pop("MESH3D_DOMAIN_WRAPPER", None)
    proc = subprocess.run([sys.executable, "-c", _KIND], env=env, capture_output=True, text=True, timeout=120)
    if made is None:  # NOTE: refused on import, naming what it read and the two values it takes
        assert proc.returncode != 0 and "MESH3D_DOMAIN_WRAPPER must be 1" in proc.stderr, proc.stderr[-2000:]
        assert "or 0 (the storage subclass), not 'yes'" in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.split() == [made], proc.stdout


def _mesh_let_go_body(seed):
    import gc

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from graph_models import MGNBlock, uneven_partition
    from mesh3d import DistributedManager, domain, graphs
    from mesh3d.domain.core.group import DomainComm

    d = dist.get_world_size()
    dm = DistributedManager.initialize(batch=1, domain=d)
    epoch = dm.epoch
    g = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.GroupNorm(1, 3), torch.nn.GELU(),
                              torch.nn.AvgPool2d(2), torch.nn.Upsample(scale_factor=2)).double()
    x = torch.randn(1, 2, 4 * d + 2, 6, dtype=torch.float64, generator=g)
    sizes = tuple([4] * (d - 1) + [6]) if d < 3 else (6, 0, 4 * d - 4)
    y = checkpoint(net, domain.shard(x, dim=2, sizes=sizes), use_reentrant=False)
    (y * y).mean().backward()
    mesh = graphs.channel_mesh(5, 4)
    part = uneven_partition(mesh.num_nodes, d, seed, empty=d - 1 if d > 2 else None)
    gr = graphs.Graph(torch.from_numpy(mesh.edges), part)
    block = MGNBlock(3).double()
    h, e = block(domain.shard_nodes(torch.randn(mesh.num_nodes, 3, dtype=torch.float64, generator=g), part),
                 domain.shard_edges(torch.randn(mesh.edges.shape[1], 3, dtype=torch.float64, generator=g), gr),
                 domain.edge_index(gr))
    (h.sum() + F.mse_loss(e, e.detach() * 0)).backward()
    alive_before = sum(isinstance(o, DomainComm) and o.mesh_epoch == epoch for o in gc.get_objects())
    del y, h, e, gr, block, net
    DistributedManager.shutdown()
    gc.collect()
    left = [o for o in gc.get_objects() if isinstance(o, DomainComm) and o.mesh_epoch == epoch]
    return alive_before, len(left)


def test_no_cache_keeps_a_meshs_comms_after_shutdown(ranks):
    for world in (2, 3):
        for rank, (before, left) in enumerate(ranks.run(world, _mesh_let_go_body, 60 + world)):
            assert before > 0, (world, rank)  # the count sees the comms the run made
            assert left == 0, (world, rank, left)
