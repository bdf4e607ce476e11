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

import torch

from mesh3d.domain.collectives import reduce_to_replicated
from mesh3d.domain.registry import register
from mesh3d.domain.rows import Span
from mesh3d.domain.step import Entering, Layout, Rows, Step
from mesh3d.domain.tensor import DomainSpec, DomainTensor

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
                reqs.append(o if o.spec.sizes == spec.sizes else Layout(o, spec.sizes))
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
    return Step(lambda *ts: reduce_to_replicated(local_einsum(*ts), spec.comm), tuple(reqs),
                out=DomainSpec(None, None, spec.comm))
