"""A domain tensor's views answer ``stride()``, ``storage_offset()`` and ``is_contiguous()`` as the one-process views
do, and a ``view`` torch refuses in one process is refused on every rank (issue 64; found by an outside hunt).

Before: a wrapper tensor took its strides from its shard's memory order, which is the one-process answer for a tensor
of its own memory only. ``x[:, :, 1:]`` answered as a new contiguous tensor (offset 0), and where a shard has one row
(or none), a transposed tensor's shard is contiguous where its peers' are not: ``view(-1)``, which raises in one
process, ran on that rank and raised on the others. Now views take the one-process view's strides and offset (torch's
answer on meta tensors of the whole tensors), as do the fresh results of ops on such shards. On slabs of sizes (8,),
(1, 7) and (4, 0, 5), in fp64: metadata, the ``view`` outcome, values and input gradients against one process, and
code that branches on a view's metadata under ``torch.compile`` (before, compiled, every rank took its own branch).

Found on the way: at one rank, ``domain.shard(x)`` of a tensor already sharded (and ``from_local`` of one shard twice)
returned the first domain tensor itself, so two uses' gradients were summed into one ``.grad``.
"""

from __future__ import annotations

import torch
import torch._dynamo

from domain_cases import max_err

D64 = torch.float64

CASES = {
    "slice along the sharded dim": lambda t: t[:, :, 1:],
    "slice of the last dim": lambda t: t[..., 1:],
    "strided slice": lambda t: t[:, :, ::2],
    "select": lambda t: t[:, 1],
    "select then slice": lambda t: t[:, 1][..., 2:],
    "narrow": lambda t: t.narrow(1, 1, 2),
    "permute": lambda t: t.permute(0, 2, 1, 3),
    "transpose": lambda t: t.transpose(2, 3),
    "mT of a slice": lambda t: t[:, :, 1:].mT,
    "expand": lambda t: t[:, :1].expand(2, 3, -1, -1),
    "unbind": lambda t: t.unbind(1)[2],
    "split": lambda t: t.split(2, dim=3)[1],
    "element-wise of a transpose": lambda t: t.transpose(2, 3) * 2,
    "exp of a permute": lambda t: t.permute(0, 2, 1, 3).exp(),
    "difference of slices": lambda t: (t[:, :, 2:] - t[:, :, :-2]) / 2,
    "contiguous of a slice": lambda t: t[:, :, 1:].contiguous(),
    "reshape of a slice": lambda t: t[..., 1:].reshape(2, 3, -1),
}


def _metadata(t):
    return tuple(t.shape), t.stride(), t.storage_offset(), t.is_contiguous()


def _view_outcome(t):
    try:
        return tuple(t.view(-1).shape)
    except RuntimeError as err:
        return f"RuntimeError: {err}"


def _branchy(t):
    """Code that reads a view's metadata: compiled, its answers were the shard's, different on every rank."""
    v = t[:, :, 1:]
    a = v * 2 if v.is_contiguous() else v * 3
    w = t.transpose(2, 3) * 2
    b = w.sum() if w.is_contiguous() else w.sum() * 10
    return (a * a).sum() + b + v.stride()[2] + v.detach().storage_offset()


def _body(sizes):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=len(sizes))
    try:
        x = torch.randn(2, 3, sum(sizes), 6, dtype=D64, generator=torch.Generator().manual_seed(3))
        found = {}
        for name, f in CASES.items():
            ref = x.clone().requires_grad_()
            xs = domain.shard(x, dim=2, sizes=sizes).requires_grad_()
            want, got = f(ref), f(xs)
            found[name] = {"metadata": (_metadata(got), _metadata(want)),
                           "view": (_view_outcome(got), _view_outcome(want))}
            (want * want).sum().backward()
            (got * got).sum().backward()
            found[name]["error"] = max(max_err(got.full_tensor().to_local(), want),
                                       max_err(xs.grad.full_tensor().to_local(), ref.grad))
        # a copy where the shard of the slice is contiguous is still a copy: a write into it leaves x as it was
        xs = domain.shard(x, dim=2, sizes=sizes)
        xs[:, :, 1:].contiguous().mul_(0)
        found["write into the contiguous copy"] = max_err(xs.full_tensor().to_local(), x)
        # writes through views still reach the tensor viewed, and the views' metadata is one process's
        base, bs = x.clone(), domain.shard(x, dim=2, sizes=sizes).clone()
        base[:, :, 1:].mul_(2)
        bs[:, :, 1:].mul_(2)
        view, views = base[:, 1], bs[:, 1]
        view.add_(1)
        views.add_(1)
        found["writes through views"] = max_err(bs.full_tensor().to_local(), base)
        found["written view's metadata"] = (_metadata(views), _metadata(view))
        # one tensor sharded twice (or one shard wrapped twice) is two tensors, as two clones are in one process: at
        # one rank the second was the first, and their gradients were summed into one
        local = domain.shard(x, dim=2, sizes=sizes).to_local()
        for how, make in (("shard", lambda: domain.shard(x, dim=2, sizes=sizes)),
                          ("from_local", lambda: domain.from_local(local, dim=2, sizes=sizes))):
            first, second = make().requires_grad_(), make().requires_grad_()
            first.sum().backward()
            (second * 2).sum().backward()
            found[f"{how} twice"] = (first is second, max_err(first.grad.full_tensor().to_local(), torch.ones_like(x)),
                                     max_err(second.grad.full_tensor().to_local(), torch.full_like(x, 2.0)))
        ref = x.clone().requires_grad_()
        want = _branchy(ref)
        want.backward()
        xs = domain.shard(x, dim=2, sizes=sizes).requires_grad_()
        got = torch.compile(_branchy, backend="aot_eager")(xs)
        got.backward()
        torch._dynamo.reset()
        found["compiled"] = max(abs(float(got.full_tensor().to_local()) - float(want)),
                                max_err(xs.grad.full_tensor().to_local(), ref.grad))
        return found
    finally:
        DistributedManager.shutdown()


def test_views_answer_metadata_and_view_as_one_process(ranks):
    for sizes in ((8,), (1, 7), (4, 0, 5)):
        for rank, found in enumerate(ranks.run(len(sizes), _body, sizes, timeout=120)):
            for name in CASES:
                case = found[name]
                assert case["metadata"][0] == case["metadata"][1], (sizes, rank, name, case["metadata"])
                assert case["view"][0] == case["view"][1], (sizes, rank, name, case["view"])
                assert case["error"] < 1e-12, (sizes, rank, name, case["error"])
            assert found["write into the contiguous copy"] == 0.0, (sizes, rank)
            assert found["writes through views"] < 1e-12, (sizes, rank)
            assert found["written view's metadata"][0] == found["written view's metadata"][1], (sizes, rank)
            assert found["compiled"] < 1e-9, (sizes, rank, found["compiled"])
            for how in ("shard", "from_local"):
                assert found[f"{how} twice"] == (False, 0.0, 0.0), (sizes, rank, how, found[f"{how} twice"])


LAID_OUT = {
    "gradient after a transpose": lambda t: t.transpose(2, 3) * torch.arange(9.0, dtype=D64),
    "softmax of a transpose": lambda t: t.transpose(2, 3).softmax(-1),
    "max pool of channels-last": lambda t: torch.nn.functional.max_pool2d(
        t.contiguous(memory_format=torch.channels_last), 2, ceil_mode=True),
}
WRITES = {  # into an expanded tensor: torch refuses some writes (its elements share memory) and allows others
    "add_": lambda t: t[:, :1].expand(2, 3, 9, 6).add_(1),
    "+=": lambda t: t[:, :1].expand(2, 3, 9, 6).__iadd__(1),
    "x[...] = 1": lambda t: t[:, :1].expand(2, 3, 9, 6).__setitem__(Ellipsis, 1.0),
    "zero_": lambda t: t[:, :1].expand(2, 3, 9, 6).zero_(),
    "x[:, 0] = 1": lambda t: t[:, :1].expand(2, 3, 9, 6).__setitem__((slice(None), 0), 1.0),
}


def _outcome(f, t):
    try:
        f(t)
        return "ran"
    except RuntimeError as err:
        return f"RuntimeError: {err}"


def _fresh_body(sizes):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=len(sizes))
    try:
        x = torch.randn(2, 3, 9, 6, dtype=D64, generator=torch.Generator().manual_seed(4))
        found = {}
        for name, f in LAID_OUT.items():
            ref = x.clone().requires_grad_()
            xs = domain.shard(x, dim=2, sizes=sizes).requires_grad_()
            want, got = f(ref), f(xs)
            (want * want).sum().backward()
            (got * got).sum().backward()
            found[name] = ((_metadata(got), _metadata(xs.grad)), (_metadata(want), _metadata(ref.grad)),
                           max(max_err(got.full_tensor().to_local(), want),
                               max_err(xs.grad.full_tensor().to_local(), ref.grad)))
        for name, f in WRITES.items():
            ref, xs = x.clone(), domain.shard(x, dim=2, sizes=sizes)
            outcomes = (_outcome(f, xs), _outcome(f, ref))
            found[name] = (outcomes, max_err(xs.full_tensor().to_local(), ref))
        return found
    finally:
        DistributedManager.shutdown()


def test_fresh_results_gradients_and_writes_into_shared_memory_answer_as_one_process(ranks):
    """A rule's result and a leaf's ``.grad`` are laid out as one process lays them out (a shard's own layout differed
    between ranks: softmax of a transpose, channels-last pooling, ``.grad`` after a transposed use); a write torch
    refuses into an expanded tensor is refused on every rank (a rank with an empty shard wrote nothing and ran on,
    and its peers then hung in the next exchange)."""
    for sizes in ((9,), (1, 8), (4, 0, 5)):
        for rank, found in enumerate(ranks.run(len(sizes), _fresh_body, sizes, timeout=120)):
            for name in LAID_OUT:
                got, want, err = found[name]
                assert got == want and err < 1e-12, (sizes, rank, name, found[name])
            for name in WRITES:
                (got, want), err = found[name]
                assert got == want and err < 1e-12, (sizes, rank, name, found[name])
            assert found["add_"][0][1].startswith("RuntimeError") and found["zero_"][0][1] == "ran", found
