"""``torch.einsum`` on domain tensors, for every subscript pattern, as a sharding strategy over its letters.

Usage: automatic, through torch::

    attn = torch.einsum("bhxd,bhyd->bhxy", q, k)   # q, k sharded along the sequence: keys gathered, rows kept
    out = torch.einsum("bhxy,bhyd->bhxd", attn, v) # values gathered, rows kept
    energy = torch.einsum("bchw,bchw->b", x, x)    # contracted over the sharded dim: summed over the domain

The strategy (as DTensor's ``_einsum_strategy``, with uneven shards): each operand's sharded dim names a
letter. The *kept* letter is the first sharded letter that appears in the output (else the first sharded
letter). Operands sharded along it are brought to one layout; plain operands holding it at its global
length contribute this rank's rows; operands sharded along any other letter are gathered whole. The local
einsum then gives this rank's rows of the output when the kept letter is in the output, or this rank's
partial sum when it is contracted, which one all-reduce over the domain completes (a replicated result).
"""

from __future__ import annotations

import string
from typing import Any

import torch

from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.core.split import offsets_of, split_sizes
from mesh3d.domain.layouts.tokens import token_rows
from mesh3d.domain.dispatch.registry import BLOCK_RULES, TOKEN_RULES, register
from mesh3d.domain.comm.rows import Span
from mesh3d.domain.dispatch.executor import resolved
from mesh3d.domain.dispatch.step import Combining, Entering, Partial, Resplit, Rows, Step
from mesh3d.domain.core.specs import DomainSpec, Layout, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap

__all__ = ["explicit_equation"]


def explicit_equation(equation: str, ndims: list[int]) -> tuple[list[str], str]:
    """Operand subscripts and output subscripts with ``...`` spelled out and an implicit output made explicit.

    Usage: ``explicit_equation("...ij,jk", [3, 2])  # (['Aij', 'jk'], 'Aik')``
    """
    equation = equation.replace(" ", "")
    lhs, arrow, out = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise RuntimeError(f"einsum(): {len(terms)} subscripts for {len(ndims)} operands in {equation!r}")
    spare = [c for c in string.ascii_letters if c not in equation]
    widest = max((n - len(t.replace("...", "")) for t, n in zip(terms, ndims) if "..." in t), default=0)
    ellipsis = "".join(spare[:widest])
    full = []
    for term, n in zip(terms, ndims):
        if "..." in term:
            k = n - len(term.replace("...", ""))
            term = term.replace("...", ellipsis[widest - k:])
        if len(term) != n:
            raise RuntimeError(f"einsum(): subscript {term!r} has {len(term)} letters for an operand of {n} dims")
        full.append(term)
    if arrow:
        output = out.replace("...", ellipsis)
    else:
        letters = "".join(full)
        output = ellipsis + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ellipsis))
    return full, output


def _everything(spec: DomainSpec) -> tuple:
    return tuple((Span.rows(0, sum(spec.sizes)),) for _ in spec.sizes)


@register(torch.einsum)
def _einsum(equation, *operands):
    operands = tuple(operands[0]) if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    terms, output = explicit_equation(equation, [o.ndim for o in operands])
    sharded = [(i, terms[i][o.spec.dim]) for i, o in enumerate(operands)
               if isinstance(o, DomainTensor) and o.spec.dim is not None]
    in_output = [(i, letter) for i, letter in sharded if letter in output]
    ref_index, kept = (in_output or sharded)[0]
    ref = operands[ref_index]
    spec, length = ref.spec, sum(ref.spec.sizes)
    mine = (spec.offset, spec.sizes[spec.comm.index])
    reqs, narrow = [], []  # narrow[i]: dims of operand i (after its requirement) to cut to my rows of the kept letter
    for o, term in zip(operands, terms):
        kept_dims = [d for d, c in enumerate(term) if c == kept]
        if isinstance(o, DomainTensor) and o.spec.dim is not None:
            if term[o.spec.dim] == kept:
                reqs.append(o if o.spec.sizes == spec.sizes else Resplit(o, spec.sizes))
                narrow.append([d for d in kept_dims if d != o.spec.dim])
            else:  # sharded along another letter: gathered whole (then cut to my rows where it holds the kept one)
                reqs.append(Rows(o, _everything(o.spec)))
                narrow.append(kept_dims)
        elif isinstance(o, torch.Tensor):
            cut = [d for d in kept_dims if o.shape[d] == length != 1]
            reqs.append(Entering(o) if isinstance(o, DomainTensor) else o)  # replicated: its grad summed over domain
            narrow.append(cut)
        else:
            reqs.append(o)
            narrow.append([])
    local_equation = ",".join(terms) + "->" + output

    def local_einsum(*ts):
        cut = []
        for t, dims in zip(ts, narrow):
            for d in dims:
                t = t.narrow(d, *mine)
            cut.append(t)
        return torch.einsum(local_equation, *cut)

    if kept in output:
        return Step(local_einsum, tuple(reqs), out=spec.with_sizes(spec.sizes, dim=output.index(kept)),
                    keep=tuple(o for o in operands if isinstance(o, torch.Tensor) and not isinstance(o, DomainTensor)))
    return Step(local_einsum, tuple(reqs), out=DomainSpec.replicated(spec.comm), partial=Partial("sum"))


@register(torch.tensordot)
def _tensordot(a, b, dims=2, out=None, einsum=None):
    """``torch.tensordot`` as the einsum it is (so it shards as einsum does)."""
    if out is not None:
        raise NotImplementedError("torch.tensordot(out=...) on a domain tensor is not supported")
    if isinstance(dims, int):
        dims_a, dims_b = list(range(a.ndim - dims, a.ndim)), list(range(dims))
    elif isinstance(dims, torch.Tensor):
        dims_a, dims_b = [int(d) for d in dims[0]], [int(d) for d in dims[1]]
    else:
        dims_a, dims_b = [list(d) if isinstance(d, (list, tuple)) else [d] for d in dims]
    dims_a, dims_b = [d % a.ndim for d in dims_a], [d % b.ndim for d in dims_b]
    letters = iter(string.ascii_letters)
    sa = [next(letters) for _ in range(a.ndim)]
    sb = [next(letters) for _ in range(b.ndim)]
    for i, j in zip(dims_a, dims_b):
        sb[j] = sa[i]
    out_letters = [c for i, c in enumerate(sa) if i not in dims_a] + [c for j, c in enumerate(sb) if j not in dims_b]
    return (einsum or _einsum)(f"{''.join(sa)},{''.join(sb)}->{''.join(out_letters)}", a, b)


# ----------------------------------------------------------------------------- blocks and token grids
def _grid_einsum(equation, *operands):
    """``einsum`` on blocks (every block letter kept, or every one contracted: one all-reduce, or some of each: pencils,
    ``_pencil``) and on token grids
    (the token letter kept, or the two products of attention, ``q k^T`` and ``scores v``, which the token grid's
    matmul rule runs with the keys gathered in order)."""
    operands = tuple(operands[0]) if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    terms, output = explicit_equation(equation, [o.ndim for o in operands])
    grids = [(o, t) for o, t in zip(operands, terms) if isinstance(o, DomainTensor) and sharded_dims(o._spec)]
    spec: Any = grids[0][0]._spec  # a BlockSpec or a TokenSpec
    token_letters = {t[o._spec.token_dim] for o, t in grids} if spec.layout is Layout.TOKENS else set()  # type: ignore[attr-defined]
    if len(token_letters) == 2 and len(grids) == len(operands) == 2:  # queries' tokens against keys' tokens
        product = _attention_product(operands, terms, output)
        if product is not None:
            return product
    axes = tuple(grids[0][1][d] for d in sharded_dims(spec))  # the letter of each grid axis
    letters = set(axes)
    if any(_layout(o._spec) != _layout(spec) or tuple(t[d] for d in sharded_dims(o._spec)) != axes for o, t in grids):
        raise NotImplementedError(f"torch.einsum({equation!r}) on operands laid out differently over the domain grid; "
                                  "bring them to one layout (domain.redistribute) or call .full_tensor() first")
    kept = letters <= set(output)
    pencil = not kept and bool(letters & set(output))
    if pencil and spec.layout is not Layout.BLOCKS:
        raise NotImplementedError(f"torch.einsum({equation!r}) contracts some of the grid's sharded letters and keeps "
                                  "others; call .full_tensor() first")
    ref_term = next(t for o, t in grids if o is grids[0][0])
    dim_of = {ref_term[d]: d for d in sharded_dims(spec)}
    local = []
    for o, t in zip(operands, terms):
        if isinstance(o, DomainTensor) and sharded_dims(o._spec):
            local.append(unwrap(o))
        elif isinstance(o, torch.Tensor):
            local.append(_grid_rows(o, t, spec, dim_of))
        else:
            local.append(o)
    local_equation = ",".join(terms) + "->" + output
    if not kept and not pencil:  # every grid letter contracted: each rank's part of the sum
        return Step(lambda *ts: torch.einsum(local_equation, *ts), tuple(local), out=DomainSpec.replicated(spec.comm),
                    partial=Partial("sum"))
    if pencil:
        return _pencil(equation, local_equation, local, output, spec, [ref_term[d] for d in spec.dims])
    out = torch.einsum(local_equation, *local)
    if spec.layout is Layout.TOKENS:
        return adopt(out, spec.with_token_dim(output.index(ref_term[spec.token_dim])))
    return adopt(out, BlockSpec(tuple(output.index(ref_term[d]) for d in spec.dims), spec.sizes, spec.lines, spec.comm))


def _pencil(equation: str, local_equation: str, local: list, output: str, spec: BlockSpec,
            axes: list[str]) -> DomainTensor | Step:
    """Blocks whose einsum contracts some grid letters and keeps others (a Legendre transform: latitudes summed,
    longitude modes kept): each contracted grid line sums its partial products and splits a new letter of the output
    among its ranks (a reduce-scatter: the longest letter the operands do not shard, the last of equals), as Makani's
    distributed SHT moves to pencils. The backward gathers the gradient along that letter (the all-reduce's adjoint
    of the padded slices). One contracted grid line: a partial result the executor combines over that line."""
    length: dict[str, int] = {}  # each letter's length in the local product (the largest: size-1 dims broadcast)
    for term, t in zip(local_equation.split("->")[0].split(","), local):
        for i, c in enumerate(term if isinstance(t, torch.Tensor) else ""):
            length[c] = max(length.get(c, 0), t.shape[i])
    free = [c for c in output if c not in axes]
    dims, sizes, moves = [], [], []
    for k, letter in enumerate(axes):
        if letter in output:
            dims.append(output.index(letter))
            sizes.append(spec.sizes[k])
            continue
        if not free:
            raise NotImplementedError(f"torch.einsum({equation!r}) contracts the grid letter {letter!r} and keeps "
                                      "others, and its output has no other letter to split over that grid line; "
                                      "call .full_tensor() first")
        carry = max(reversed(free), key=lambda c: length[c])
        free.remove(carry)
        d, line = output.index(carry), spec.lines[k]
        shares = split_sizes(length[carry], line.size)
        moves.append((d, line, offsets_of(shares)[line.index], shares[line.index]))
        dims.append(d)
        sizes.append(shares)
    out_spec = BlockSpec(tuple(dims), tuple(sizes), spec.lines, spec.comm)
    if len(moves) == 1:
        d, line, start, share = moves[0]
        return Step(lambda *ts: torch.einsum(local_equation, *ts), tuple(local), out=out_spec,
                    partial=Partial("sum", lambda o: o.narrow(d, start, share), for_shards=True, over=line))
    n, cuts = len(local), tuple((d, start, share) for d, _, start, share in moves)

    def contract(*args):
        out = torch.einsum(local_equation, *args[:n])
        for combine, (d, start, share) in zip(args[n:], cuts):  # NOTE: each line sums what the previous one left
            out = combine(out, for_shards=True).narrow(d, start, share)
        return out
    return Step(contract, (*local, *(Combining(line) for _, line, _, _ in moves)), out=out_spec)


def _layout(spec) -> tuple:
    """What must agree between two operands laid out over the grid (where their sharded dims sit may differ)."""
    return (spec.sizes, spec.lines, spec.comm, getattr(spec, "prefix", 0), getattr(spec, "keys", None))


def _grid_rows(o: torch.Tensor, term: str, spec, dim_of: dict[str, int]) -> torch.Tensor:
    """A plain (or replicated) operand's rows for this rank: each sharded letter it holds at the global length cut to
    this rank's block (or, on a token grid, its tokens in order)."""
    plain = resolved(Entering(o)) if isinstance(o, DomainTensor) else o  # a replicated one: its gradient summed
    for position, letter in enumerate(term):
        if letter not in dim_of or plain.shape[position] == 1:
            continue
        if spec.layout is Layout.TOKENS:
            plain = token_rows(plain, position, spec, "torch.einsum")
        else:
            k = spec.dims.index(dim_of[letter])
            plain = plain.narrow(position, spec.offsets[k], spec.local_sizes[k])
    return plain


def _attention_product(operands, terms, output):
    """``...xd,...yd->...xy`` (scores) and ``...xy,...yd->...xd`` (scores times values) as ``torch.matmul``."""
    if len(operands) != 2:
        return None
    (a, b), (ta, tb) = operands, terms
    lead = ta[:-2]
    if tb[:-2] != lead or output[:-2] != lead:
        return None
    x, d = ta[-2:]
    if tb[-2:] == output[-1] + d and output[-2:] == x + tb[-2] and d not in output:
        return torch.matmul(a, b.transpose(-1, -2))
    y = ta[-1]
    if tb[-2] == y and output[-2:] == x + tb[-1] and y not in output:
        return torch.matmul(a, b)
    return None


for _f in (torch.einsum,):
    BLOCK_RULES.register(_f, _grid_einsum)
    TOKEN_RULES.register(_f, _grid_einsum)
BLOCK_RULES.register(torch.tensordot, lambda a, b, dims=2, out=None: _tensordot(a, b, dims, out, einsum=_grid_einsum))
TOKEN_RULES.register(torch.tensordot, lambda a, b, dims=2, out=None: _tensordot(a, b, dims, out, einsum=_grid_einsum))
