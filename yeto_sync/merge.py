"""The syncer's merge math: learner weights, directional correction, avg/rda/iso, outer step.

Plain numpy functions of arrays, pinned by PINNED.md § "Merge and outer step". Every choice
that decides the bits follows the reference syncer, so that both produce the same global model:

- responses merge in ascending ``(learner_id, generation)``; :func:`merged_outer_gradient`
  sorts them itself (:func:`merge_order`), because the order of the f32 accumulation shows in
  the last bits;
- a per-learner coefficient (``w/Σw`` for avg, ``w/Σw/n_m`` for rda) is formed in f64 and
  rounded once to f32; the weighted sum then accumulates in f32, learner by learner, starting
  from +0.0;
- norms and dot products are f64 (their summation order is numpy's: "bit-for-bit-ish");
- the outer step is f32, evaluated as ``buf = μ·buf + Δ`` then ``Θ − lr·(Δ + μ·buf)``.

How, for speed, without changing those bits: a response holds the pushed d (Δ = −d) and sums
subtract ``c·d``; avg's sum, the outer step, its finite checks and ‖Δ‖ run as one pass over
cache-sized blocks split across a few threads, and Δ itself is never stored there.

Iso SVDs go through an :class:`IsoSolver`: :class:`ScalarIsoSolver` in process, or a worker pool
(``yeto_sync.iso``) that also takes a fragment's matrices in one batch (:class:`BatchIsoSolver`).

Nothing here mutates an argument: functions write new arrays (from an ``allocate`` callable when
one is given), and :func:`merge_round` hands the caller the whole new state only after every
check passed (all or nothing).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate
from typing import Final, NamedTuple, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from yeto_proto.constants import U64_MAX, IsoBackend, MergeMode
from yeto_proto.dtypes import BF16_OVERFLOW, all_finite, f32_to_bf16, proven_finite
from yeto_proto.identity import DeltaCorrection, LearnerWeight
from yeto_proto.layout import WireFragment
from yeto_proto.wire_tensor import WireTensor

F32Array = NDArray[np.float32]
F64Array = NDArray[np.float64]
#: A PUSH payload: f32 values, or the bf16/q4 wire bytes they decode from.
Pushed = F32Array | WireTensor
#: Hands out an uninitialized flat f32 array of the given length (a pool, or :func:`_fresh`).
Allocate = Callable[[int], F32Array]
#: Told "the first n values of the outputs are final", n only growing.
Progress = Callable[[int], None]


def _fresh(numel: int) -> F32Array:
    return np.empty(numel, dtype=np.float32)


#: What a merge needs to know about a fragment: merge mode, tensor numels, iso matrix shapes.
FragmentGeometry = WireFragment

# HeLoCo constants (PINNED.md): fixed by the protocol, not configurable.
HELOCO_C_OK: Final = 0.2
HELOCO_K_S: Final = 0.5
HELOCO_K_D: Final = 1.0
HELOCO_BETA_MAX: Final = 0.5
HELOCO_KAPPA: Final = 3.0
HELOCO_EPS: Final = 1e-8
#: Below this mean-direction norm rda falls back to avg.
RDA_DEGENERATE_NORM: Final = 1e-12
#: Where the ledger's counts stop: a u64 in the checkpoint.
LEDGER_MAX: Final = U64_MAX
#: The least f64 that rounds to an infinite f32: halfway between the largest f32 and 2^128.
F32_OVERFLOW: Final = float.fromhex("0x1.ffffffp+127")
#: Iso keeps singular directions with σ > σ_max · max(rows, cols) · 2^-52.
ISO_RELATIVE_CUTOFF: Final = 2.0**-52
#: Elements per pass of the blocked loops: 1 MiB of f32 / 2 MiB of f64 stays in cache.
_BLOCK: Final = 1 << 18
#: Up to this size one einsum call beats widening into a buffer (many small tensors).
_SMALL: Final = 1 << 13
#: Threads of the outer step's blocked pass (memory-bound: a few cores saturate the bus).
_STEP_THREADS: Final = max(1, min(4, os.cpu_count() or 1))
#: Threads of a pass that a broadcast streams behind (``on_progress``): one core fewer. There
#: the slow link sets the pace and the socket writers feeding it are on the critical path; a
#: writer that waits for a core leaves its link idle, and that time never comes back. Measured
#: with a 1 Gbit/s emulated link on 2 cores (benchmarks/RESULTS.md): q4 rounds 348.5 against
#: 353.2 ms, the single-threaded pass still finishing ~200 ms before the link does.
_STREAMED_STEP_THREADS: Final = max(1, min(_STEP_THREADS, (os.cpu_count() or 1) - 1))
#: Below this many values the outer step runs on the calling thread alone.
_THREADED_MIN: Final = 1 << 21
#: The scalar iso solver keeps its f64 work buffers for matrices up to this many elements.
_ISO_REUSE_MAX: Final = 1 << 22


class MergeError(Exception):
    """A round cannot commit (non-finite merged Δ or step result, or a failed iso solve).

    Raised before any caller state changes; the coordinator records it and the round fails.
    """


@dataclass(frozen=True, slots=True, eq=False)
class Response:
    """One learner's accepted contribution to one round.

    ``pushed`` is the PUSH payload d_m = local − anchor of the whole fragment, exactly as the
    learner sent it: flat f32 (for f32 sessions a view of the receive buffer), or for bf16 and
    q4 a :class:`~yeto_proto.wire_tensor.WireTensor` of the received bytes, which the merge
    decodes block by block (an avg round never holds a decoded copy). The outer gradient is
    Δ_m = −d_m; the merge folds that sign into its arithmetic (``x − c·d`` is bit for bit
    ``x + c·(−d)`` in IEEE 754, signed zeros included) instead of negating a 64 MiB copy per
    push. ``pushed`` is read, never written.
    """

    learner_id: int
    generation: int
    c_steps: int
    c_tokens: int
    pushed: Pushed

    def __post_init__(self) -> None:
        if self.learner_id < 0 or self.generation < 1:
            raise ValueError(f"bad member ({self.learner_id}, {self.generation})")
        if self.c_steps < 1 or self.c_tokens < 0:
            raise ValueError(f"bad counters c_steps={self.c_steps} c_tokens={self.c_tokens}")
        values = self.pushed
        if isinstance(values, WireTensor):
            return
        if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.ndim != 1:
            raise ValueError("pushed must be a flat float32 numpy array or a WireTensor")

    @classmethod
    def from_outer_gradient(
        cls, learner_id: int, generation: int, c_steps: int, c_tokens: int, grad: F32Array
    ) -> Response:
        """A response given by its outer gradient Δ (stores d = −Δ, as a learner would push)."""
        pushed: F32Array = np.negative(np.asarray(grad, dtype=np.float32))
        return cls(learner_id, generation, c_steps, c_tokens, pushed)

    def outer_gradient(self, allocate: Allocate | None = None) -> F32Array:
        """Δ_m = −d_m as a new array (from ``allocate`` when given)."""
        grad = (allocate or _fresh)(self.pushed.size)
        pushed = self.pushed
        # A wire tensor is decoded into the result, then negated in place.
        np.negative(pushed.decode(out=grad) if isinstance(pushed, WireTensor) else pushed, out=grad)
        return grad

    def pushed_array(self, allocate: Allocate) -> F32Array:
        """d_m as an f32 array: itself, or decoded into ``allocate(numel)`` from its wire bytes."""
        if isinstance(self.pushed, WireTensor):
            return self.pushed.decode(out=allocate(self.pushed.size))
        return self.pushed

    @property
    def member(self) -> tuple[int, int]:
        return (self.learner_id, self.generation)


@dataclass(frozen=True, slots=True)
class MergeConfig:
    learner_weight: LearnerWeight = LearnerWeight.TOKENS2_OVER_STEPS
    delta_correction: DeltaCorrection = DeltaCorrection.HELOCO
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "learner_weight", LearnerWeight(self.learner_weight))
        object.__setattr__(self, "delta_correction", DeltaCorrection(self.delta_correction))
        if not (math.isfinite(self.outer_lr) and math.isfinite(self.outer_momentum)):
            raise ValueError("outer_lr and outer_momentum must be finite")


class LedgerEntry(NamedTuple):
    """Cumulative per-learner-id counters, as the checkpoint stores them."""

    merges: int
    steps: int
    tokens: int


# -- iso solvers -----------------------------------------------------------------------------
class IsoSolver(Protocol):
    """Turns one averaged matrix G into σ̄ · Σ_kept u_i v_iᵀ (PINNED.md, iso).

    ``matrix`` is the flat row-major rows × cols average (f32 or f64); the result is a new flat
    f32 array of the same length. A zero matrix must come back zero. An implementation that
    cannot solve raises :class:`MergeError`.
    """

    @property
    def backend(self) -> IsoBackend:
        """The id a checkpoint records for results produced by this solver."""
        ...

    def polar_flatten(
        self, matrix: NDArray[np.float32] | NDArray[np.float64], rows: int, cols: int
    ) -> F32Array: ...


@runtime_checkable
class BatchIsoSolver(IsoSolver, Protocol):
    """An iso solver that also takes all of a fragment's matrices at once (a worker pool).

    Results come back in the order given; the first failure raises :class:`MergeError`.
    """

    def polar_flatten_many(
        self, matrices: Sequence[tuple[NDArray[np.float32] | NDArray[np.float64], int, int]]
    ) -> list[F32Array]: ...


class ScalarIsoSolver:
    """In-process exact SVD in f64 (``numpy.linalg.svd``): the ``scalar`` iso backend."""

    def __init__(self) -> None:
        self._held = threading.local()

    def _f64_buffers(self, size: int) -> tuple[F64Array, F64Array]:
        """Two f64 work arrays of ``size``, reused per thread for matrices up to a cap.

        Fresh multi-megabyte buffers per tensor showed up as page faults costing a fifth of the
        SVD time on 4096x256 matrices; above the cap the cubic SVD dwarfs that, and keeping
        such buffers resident would not pay.
        """
        if size > _ISO_REUSE_MAX:
            return np.empty(size, dtype=np.float64), np.empty(size, dtype=np.float64)
        held: tuple[F64Array, F64Array] | None = getattr(self._held, "buffers", None)
        if held is None or held[0].size < size:
            held = (np.empty(size, dtype=np.float64), np.empty(size, dtype=np.float64))
            self._held.buffers = held
        return held[0][:size], held[1][:size]

    @property
    def backend(self) -> IsoBackend:
        return IsoBackend.SCALAR

    def polar_flatten(
        self, matrix: NDArray[np.float32] | NDArray[np.float64], rows: int, cols: int
    ) -> F32Array:
        if rows <= 0 or cols <= 0 or matrix.size != rows * cols:
            raise ValueError(f"iso matrix of {matrix.size} values is not {rows}x{cols}")
        flat = matrix.reshape(rows * cols)
        if not flat.any():
            return np.zeros(rows * cols, dtype=np.float32)
        source, target = self._f64_buffers(rows * cols)
        g = source.reshape(rows, cols)
        np.copyto(g, flat.reshape(rows, cols))
        try:
            u, sigma, vt = np.linalg.svd(g, full_matrices=False)
        except np.linalg.LinAlgError as exc:
            raise MergeError(f"iso SVD of a {rows}x{cols} matrix failed: {exc}") from exc
        sigma_bar = float(sigma.sum()) / min(rows, cols)
        cutoff = float(sigma[0]) * max(rows, cols) * ISO_RELATIVE_CUTOFF
        # numpy returns σ in descending order, so the kept directions are a prefix.
        rank = int(np.count_nonzero(sigma > cutoff))
        # σ̄ goes on the small factor (rank × cols) instead of a pass over the product.
        product = target.reshape(rows, cols)
        np.matmul(u[:, :rank], vt[:rank] * sigma_bar, out=product)
        return target.astype(np.float32)


SCALAR_ISO_SOLVER: Final = ScalarIsoSolver()


# -- small helpers ---------------------------------------------------------------------------
class _BlockBuffers(threading.local):
    """Per-thread block buffers, reused: fresh megabyte buffers cost page faults on every call.

    No helper that holds them calls another helper that uses them.
    """

    def __init__(self) -> None:
        self.narrow = np.empty(_BLOCK, dtype=np.float32)
        self.summed = np.empty(_BLOCK, dtype=np.float32)
        self.wide = (np.empty(_BLOCK, dtype=np.float64), np.empty(_BLOCK, dtype=np.float64))


_BUFFERS = _BlockBuffers()


def _widened(*arrays: NDArray[np.floating]) -> Iterator[tuple[slice, list[F64Array]]]:
    """Walk one or two equal-length flat arrays block by block, widened into f64 buffers.

    f64 arithmetic then runs on cache-resident blocks instead of full-size f64 copies.
    """
    size = arrays[0].size
    buffers = _BUFFERS.wide[: len(arrays)]
    for start in range(0, size, _BLOCK):
        stop = min(start + _BLOCK, size)
        views = [buffer[: stop - start] for buffer in buffers]
        for view, array in zip(views, arrays, strict=True):
            np.copyto(view, array[start:stop])
        yield slice(start, stop), views


def _sum_of_squares(a: NDArray[np.floating]) -> float:
    if a.size <= _SMALL:
        return float(np.einsum("i,i->", a, a, dtype=np.float64))
    total = 0.0
    for _, (x,) in _widened(a):
        np.multiply(x, x, out=x)
        total += float(np.add.reduce(x))
    return total


def _sum_of_squares_and_dot(a: F32Array, b: F32Array) -> tuple[float, float]:
    """(Σa², Σa·b) in f64, in one pass over both arrays."""
    if a.size <= _SMALL:
        return (
            float(np.einsum("i,i->", a, a, dtype=np.float64)),
            float(np.einsum("i,i->", a, b, dtype=np.float64)),
        )
    squares = products = 0.0
    for _, (x, y) in _widened(a, b):
        np.multiply(y, x, out=y)
        products += float(np.add.reduce(y))
        np.multiply(x, x, out=x)
        squares += float(np.add.reduce(x))
    return squares, products


def _norm(a: NDArray[np.floating]) -> float:
    return math.sqrt(_sum_of_squares(a))


def _all_finite(a: NDArray[np.float32]) -> bool:
    """The exact check, for a block whose screen (:func:`proven_finite`) already failed."""
    return bool(np.isfinite(a).all())


def _sequential_sum(values: Iterable[float]) -> float:
    """Left-to-right f64 sum (not pairwise, not compensated), as the reference adds."""
    total = 0.0
    for value in values:
        total += value
    return total


def _tensor_slices(geometry: FragmentGeometry) -> list[slice]:
    ends = list(accumulate(geometry.numels))
    return [slice(end - numel, end) for numel, end in zip(geometry.numels, ends, strict=True)]


class Term(NamedTuple):
    """One learner's contribution to a sum: ``values`` is Δ, or d = −Δ when ``negated``.

    Only a plain sum's terms (:func:`_accumulate_block`) may hold a :class:`WireTensor`.
    """

    values: Pushed
    negated: bool

    @property
    def array(self) -> F32Array:
        """The values of a term that is known to hold an array (corrections, rda, iso)."""
        if isinstance(self.values, WireTensor):
            raise TypeError("a wire-form term reached a whole-tensor step")
        return self.values


def _accumulate_block(
    part: F32Array,
    terms: Sequence[Term],
    factors: Sequence[np.float32],
    start: int,
    stop: int,
    scratch: F32Array,
) -> None:
    """part = Σ f32(coef)·Δ over one block, accumulated in f32 from +0.0 in the given order."""
    part.fill(0.0)
    for term, factor in zip(terms, factors, strict=True):
        values = term.values
        if isinstance(values, WireTensor):
            # Decoded block by block, into the cache-resident scratch (same f32 values).
            values.decode_range(start, stop, scratch)
            np.multiply(scratch, factor, out=scratch)
        else:
            np.multiply(values[start:stop], factor, out=scratch)
        # part − c·d is bit for bit part + c·(−d): subtraction adds the exact negation.
        (np.subtract if term.negated else np.add)(part, scratch, out=part)


def _accumulate_into(
    out: F32Array, terms: Sequence[Term], coefs: Sequence[float], *, norm: bool = False
) -> float:
    """out = Σ f32(coef_m)·Δ_m, accumulated in f32 from +0.0 in the given order.

    Works block by block so the partial sums stay in cache (each element still sees the
    learners in order, so the bits do not depend on the block size). With ``norm`` it also
    returns ‖out‖ in f64, taken while each block is hot; otherwise 0.0.
    """
    factors = [np.float32(coef) for coef in coefs]
    scratch = _BUFFERS.narrow
    wide = _BUFFERS.wide[0] if norm else None
    total = 0.0
    for start in range(0, out.size, _BLOCK):
        stop = min(start + _BLOCK, out.size)
        part = out[start:stop]
        _accumulate_block(part, terms, factors, start, stop, scratch[: stop - start])
        if wide is not None:
            total += _block_squares(part, wide[: stop - start])
    return math.sqrt(total)


def _block_squares(part: F32Array, wide: F64Array) -> float:
    np.copyto(wide, part)
    np.multiply(wide, wide, out=wide)
    return float(np.add.reduce(wide))


# -- weights and order -----------------------------------------------------------------------
def merge_order(responses: Iterable[Response]) -> tuple[Response, ...]:
    """Responses in merge order, ascending ``(learner_id, generation)``; duplicates refused."""
    ordered = tuple(sorted(responses, key=lambda r: r.member))
    for before, after in zip(ordered, ordered[1:], strict=False):
        if before.member == after.member:
            raise ValueError(f"member {before.member} answered twice")
    return ordered


def learner_weights(responses: Sequence[Response], mode: LearnerWeight) -> F64Array:
    """w = c_tokens² / c_steps in f64 (or 1 each with ``equal``), in the order given."""
    if LearnerWeight(mode) is LearnerWeight.EQUAL:
        return np.ones(len(responses), dtype=np.float64)
    tokens = np.array([float(r.c_tokens) for r in responses], dtype=np.float64)
    steps = np.array([float(r.c_steps) for r in responses], dtype=np.float64)
    weights: F64Array = tokens * tokens / steps
    return weights


# -- directional correction ------------------------------------------------------------------
def heloco_correct(delta: F32Array, momentum: F32Array) -> F32Array:
    """HeLoCo correction of one learner's Δ for one tensor, against the pre-commit momentum.

    Returns ``delta`` itself when no branch changes it, else a new f32 array; never writes
    into either argument.
    """
    if delta.shape != momentum.shape:
        raise ValueError(f"delta {delta.shape} and momentum {momentum.shape} differ")
    return _heloco(Term(delta, False), momentum, _norm(momentum)).array


def _heloco(term: Term, momentum: F32Array, momentum_norm: float) -> Term:
    """``term`` itself when no branch changes it, else a new Δ (never negated).

    A negated term (d = −Δ) is corrected without negating a copy first: the dot product and
    the f64 weights flip sign exactly, so the bits equal those of correcting Δ.
    """
    # ‖m‖ is shared by every learner of a tensor: the caller computes it once.
    if momentum_norm < HELOCO_EPS:
        return term
    delta_squares, dot = _sum_of_squares_and_dot(term.array, momentum)
    sign = -1.0 if term.negated else 1.0
    dot *= sign
    delta_norm = math.sqrt(delta_squares)
    if delta_norm < HELOCO_EPS:
        return term
    cosine = dot / (delta_norm * momentum_norm)
    if cosine >= HELOCO_C_OK:
        return term
    confidence = delta_norm / (delta_norm + HELOCO_KAPPA * momentum_norm + HELOCO_EPS)
    if cosine < 0.0:
        beta = min(HELOCO_K_S * (-cosine) * confidence, HELOCO_BETA_MAX)
        # Δ − β·c·‖Δ‖·v̂ with v̂ = m/‖m‖, folded into one f32 coefficient on m.
        coef = np.float32(-beta * cosine * delta_norm / momentum_norm)
        shrunk: F32Array = np.multiply(momentum, coef)
        (np.subtract if term.negated else np.add)(shrunk, term.array, out=shrunk)
        return Term(shrunk, False)
    mix = min(HELOCO_K_D * (1.0 - cosine) * confidence, 1.0)
    # ũ = (1−λ)û + λv̂ in f64, rounded to f32, then scaled back to the original magnitude
    # ‖Δ‖·ũ/max(‖ũ‖, ε) with ‖ũ‖ taken from the f64 values.
    delta_weight, momentum_weight = sign * (1.0 - mix) / delta_norm, mix / momentum_norm
    rotated = np.empty_like(term.array)
    squares = 0.0
    for part, (x, y) in _widened(term.array, momentum):
        np.multiply(x, delta_weight, out=x)
        np.multiply(y, momentum_weight, out=y)
        np.add(x, y, out=x)
        np.copyto(rotated[part], x, casting="same_kind")
        np.multiply(x, x, out=x)
        squares += float(np.add.reduce(x))
    rotated *= np.float32(delta_norm / max(math.sqrt(squares), HELOCO_EPS))
    return Term(rotated, False)


# -- merge -----------------------------------------------------------------------------------
def merged_outer_gradient(
    geometry: FragmentGeometry,
    responses: Iterable[Response],
    momentum: F32Array,
    config: MergeConfig,
    iso_solver: IsoSolver = SCALAR_ISO_SOLVER,
    allocate: Allocate | None = None,
) -> F32Array:
    """The merged Δ of one round: correction per learner and tensor, then the fragment's mode.

    ``momentum`` is the fragment's Nesterov buffer before this commit (read only). The result
    comes from ``allocate`` (default: a new array).
    """
    ordered = merge_order(responses)
    _check_round_inputs(geometry, ordered, momentum)
    alloc = allocate or _fresh
    merged = _merge(geometry, ordered, momentum, config, iso_solver, alloc)
    if isinstance(merged, np.ndarray):
        return merged
    summed = alloc(geometry.numel)
    _accumulate_into(summed, *merged)
    return summed


def _check_round_inputs(
    geometry: FragmentGeometry, ordered: Sequence[Response], momentum: F32Array
) -> None:
    numel = geometry.numel
    if momentum.shape != (numel,) or momentum.dtype != np.float32:
        raise ValueError(f"momentum must be float32 of shape ({numel},)")
    for response in ordered:
        if response.pushed.size != numel:
            raise ValueError(
                f"learner {response.member} sent {response.pushed.size} values, "
                f"fragment has {numel}"
            )


#: A merged Δ that is one weighted sum over the whole fragment: its terms and coefficients.
PlainSum = tuple[list[Term], list[float]]


# Finite pushes near the f32 maximum can overflow a weighting or a correction: the outer step's
# screen refuses the non-finite Δ (MergeError), so numpy's warnings add nothing (and, turned
# into errors, would skip that refusal).
@np.errstate(over="ignore", invalid="ignore")
def _merge(
    geometry: FragmentGeometry,
    ordered: Sequence[Response],
    momentum: F32Array,
    config: MergeConfig,
    iso_solver: IsoSolver,
    allocate: Allocate,
) -> PlainSum | F32Array:
    """The merged Δ in a new array from ``allocate``, or as a :data:`PlainSum` of the pushes.

    avg without a correction that changed anything is element-wise, so the caller may fold
    that sum into a pass of its own (the outer step) and Δ is never stored.
    """
    weights = [float(w) for w in learner_weights(ordered, config.learner_weight)]
    weight_sum = _sequential_sum(weights)
    if not weight_sum > 0.0:
        return [], []
    avg_coefs = [w / weight_sum for w in weights]
    mode = geometry.merge_mode
    heloco = config.delta_correction is DeltaCorrection.HELOCO
    if mode is MergeMode.AVG and not heloco:
        return [Term(r.pushed, True) for r in ordered], avg_coefs
    # Corrections and rda/iso look at whole tensors: wire-form pushes are decoded here.
    pushed = [r.pushed_array(allocate) for r in ordered]
    slices = _tensor_slices(geometry)
    per_tensor = [[Term(d[part], True) for d in pushed] for part in slices]
    corrected = False
    if heloco:
        for part, terms in zip(slices, per_tensor, strict=True):
            tensor_momentum = momentum[part]
            momentum_norm = _norm(tensor_momentum)
            for m, term in enumerate(terms):
                terms[m] = _heloco(term, tensor_momentum, momentum_norm)
                corrected = corrected or terms[m] is not term
    if mode is MergeMode.AVG and not corrected:
        return [Term(d, True) for d in pushed], avg_coefs
    merged = allocate(geometry.numel)
    outs = [merged[part] for part in slices]
    if mode is MergeMode.RDA:
        for out, terms in zip(outs, per_tensor, strict=True):
            _rda_into(out, terms, weights, weight_sum, avg_coefs)
        return merged
    for out, terms in zip(outs, per_tensor, strict=True):
        _accumulate_into(out, terms, avg_coefs)
    if mode is MergeMode.ISO:
        _iso_into(outs, geometry.matrix_shapes, iso_solver)
    return merged


def _rda_into(
    out: F32Array,
    terms: Sequence[Term],
    weights: Sequence[float],
    weight_sum: float,
    avg_coefs: Sequence[float],
) -> None:
    norms = [_norm(t.array) for t in terms]
    radial = _sequential_sum(w * n for w, n in zip(weights, norms, strict=True)) / weight_sum
    moving = [
        _rda_direction_term(t, w / weight_sum / n)
        for t, w, n in zip(terms, weights, norms, strict=True)
        if n > 0.0
    ]
    direction_norm = _accumulate_into(
        out, [t for t, _ in moving], [c for _, c in moving], norm=True
    )
    if direction_norm < RDA_DEGENERATE_NORM:
        # All-zero or cancelling directions: the plain weighted average.
        _accumulate_into(out, terms, avg_coefs)
        return
    out *= np.float32(radial / direction_norm)


def _rda_direction_term(term: Term, coef: float) -> tuple[Term, float]:
    """``term`` and its coefficient f32(w/S/n) in the direction sum. A Δ_m whose norm is
    below (w/S) · 2.94e-39 has a coefficient past the largest f32: rounded first it is
    infinite, and inf · 0 made the commit fail on a finite result. Such a term is scaled in
    f64 and rounded once per element (at most w/S in size), then summed with coefficient 1."""
    if coef < F32_OVERFLOW:
        return term, coef
    scaled = (term.array.astype(np.float64) * coef).astype(np.float32)
    return Term(scaled, term.negated), 1.0


def _iso_into(
    outs: Sequence[F32Array], shapes: Sequence[tuple[int, int]], solver: IsoSolver
) -> None:
    """Replace each averaged tensor in ``outs`` by its flattened spectrum."""
    jobs = list(zip(outs, (r for r, _ in shapes), (c for _, c in shapes), strict=True))
    for out, rows, cols in jobs:
        if not all_finite(out):
            raise MergeError(f"iso input of a {rows}x{cols} tensor is not finite")
    if isinstance(solver, BatchIsoSolver):
        # One batch, so a pool can solve the fragment's tensors in parallel.
        results = solver.polar_flatten_many(jobs)
        if len(results) != len(jobs):
            raise MergeError(f"iso solver answered {len(results)} of {len(jobs)} matrices")
        for (out, rows, cols), flattened in zip(jobs, results, strict=True):
            _take_flattened(out, rows, cols, flattened)
    else:
        for out, rows, cols in jobs:
            _take_flattened(out, rows, cols, solver.polar_flatten(out, rows, cols))


def _take_flattened(out: F32Array, rows: int, cols: int, flattened: F32Array) -> None:
    if flattened.dtype != np.float32 or flattened.size != out.size:
        raise MergeError(f"iso solver returned {flattened.dtype} x {flattened.size}")
    if not all_finite(flattened):
        raise MergeError(f"iso solver returned non-finite values for a {rows}x{cols} tensor")
    np.copyto(out, flattened.reshape(out.shape))


def gnorm(delta: F32Array) -> float:
    """‖Δ‖ in f64, as the event tape reports it."""
    return _norm(delta)


# -- outer step ------------------------------------------------------------------------------
def nesterov_step(
    params: F32Array, momentum: F32Array, delta: F32Array, lr: float, mu: float
) -> tuple[F32Array, F32Array]:
    """f32 Nesterov: ``buf ← μ·buf + Δ; Θ ← Θ − lr·(Δ + μ·buf)``.

    Returns ``(new_params, new_momentum)`` as new arrays; the arguments are never written, so
    a caller commits by replacing its references. Raises :class:`MergeError` if ``delta`` or
    either result is not finite.
    """
    if not (params.shape == momentum.shape == delta.shape) or params.ndim != 1:
        raise ValueError("params, momentum and delta must be flat arrays of one length")
    for name, array in (("params", params), ("momentum", momentum), ("delta", delta)):
        if array.dtype != np.float32:
            raise ValueError(f"{name} must be float32, not {array.dtype}")
    new_params, new_momentum = _fresh(params.size), _fresh(params.size)
    _outer_step(_StepPass(params, momentum, delta, None, lr, mu, new_params, new_momentum))
    return new_params, new_momentum


def _outer_step(step: _StepPass, on_progress: Progress | None = None) -> float:
    """The f32 Nesterov step in one blocked pass, Δ either given or summed block by block.

    Exactly one of ``step.delta`` (the merged Δ) and a plain sum (its terms: each block of Δ
    is formed in a cache-sized scratch buffer and never stored) is given. Every array is read
    or written once, each block while it is in cache; a few threads (numpy releases the GIL)
    claim blocks in ascending order, so the finished part of the outputs grows from the front
    and ``on_progress(n)`` can report "the first n values are final" as it grows (a broadcast
    may stream behind it). The per-block partial sums of ‖Δ‖² are added in block order
    afterwards, so the bits do not depend on the thread count. Returns ‖Δ‖ in f64; raises
    :class:`MergeError` on a non-finite Δ or result (inputs are untouched).
    """
    numel = step.params.size
    blocks = -(-numel // _BLOCK)
    squares = [0.0] * blocks
    front = _FinishedFront(blocks, numel, on_progress)
    most = _STEP_THREADS if on_progress is None else _STREAMED_STEP_THREADS
    threads = min(most if numel >= _THREADED_MIN else 1, blocks)
    claims = itertools.count()  # next() is atomic under the GIL: each block runs once
    failures: list[tuple[int, BaseException]] = []

    def work() -> None:
        while not failures and (index := next(claims)) < blocks:
            try:
                squares[index] = step.block(index)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, in block order
                failures.append((index, exc))
                return
            front.finished(index)

    if threads <= 1:
        work()
    else:
        futures = [_step_executor().submit(work) for _ in range(threads)]
        for future in futures:  # every thread done before raising: none writes after
            future.result()
    if failures:
        # Every block below a failed one was claimed and ran to its end, so the lowest
        # failure is the one a single thread would have met first: the error is the same.
        raise min(failures, key=lambda failure: failure[0])[1]
    if numel <= _SMALL:  # small fragments: the norm exactly as gnorm() takes it (one einsum)
        summed = step.delta
        if summed is None:
            summed = _fresh(numel)
            _accumulate_into(summed, step.terms, step.coefs)
        return gnorm(summed)
    return math.sqrt(_sequential_sum(squares))


class _FinishedFront:
    """Tracks finished blocks and reports the length of the finished prefix as it grows."""

    def __init__(self, blocks: int, numel: int, on_progress: Progress | None) -> None:
        self._done = [False] * blocks
        self._front = 0
        self._numel = numel
        self._on_progress = on_progress
        self._lock = threading.Lock()

    def finished(self, index: int) -> None:
        if self._on_progress is None:
            return
        with self._lock:
            self._done[index] = True
            front = self._front
            while front < len(self._done) and self._done[front]:
                front += 1
            if front == self._front:
                return
            self._front = front
            # Reported under the lock, so the listener sees the values in increasing order.
            self._on_progress(min(front * _BLOCK, self._numel))


class _StepPass:
    """One outer step's arrays and constants; :meth:`block` steps one block."""

    def __init__(
        self,
        params: F32Array,
        momentum: F32Array,
        delta: F32Array | None,
        plain_sum: PlainSum | None,
        lr: float,
        mu: float,
        new_params: F32Array,
        new_momentum: F32Array,
        params_bf16: NDArray[np.uint16] | None = None,
    ) -> None:
        if (delta is None) == (plain_sum is None):
            raise ValueError("give exactly one of delta and plain_sum")
        if params_bf16 is not None and params_bf16.shape != new_params.shape:
            raise ValueError("params_bf16 must hold one bf16 per parameter")
        #: Where the new params' bf16 bit patterns go, block by block (None: not wanted).
        self.params_bf16 = params_bf16
        self.params, self.momentum, self.delta = params, momentum, delta
        self.terms: list[Term] = [] if plain_sum is None else plain_sum[0]
        self.coefs: list[float] = [] if plain_sum is None else plain_sum[1]
        self.factors = [np.float32(c) for c in self.coefs]
        self.lr32, self.mu32 = np.float32(lr), np.float32(mu)
        self.new_params, self.new_momentum = new_params, new_momentum

    def block(self, index: int) -> float:
        """Step block ``index``; its ‖Δ‖² partial sum."""
        start = index * _BLOCK
        stop = min(start + _BLOCK, self.params.size)
        size = stop - start
        buffers = _BUFFERS
        with np.errstate(over="ignore", invalid="ignore"):
            if self.delta is not None:
                d = self.delta[start:stop]
            else:
                d = buffers.summed[:size]
                _accumulate_block(d, self.terms, self.factors, start, stop, buffers.narrow[:size])
            buf = self.new_momentum[start:stop]
            np.multiply(self.momentum[start:stop], self.mu32, out=buf)
            np.add(buf, d, out=buf)
            theta = self.new_params[start:stop]
            np.multiply(buf, self.mu32, out=theta)
            np.add(theta, d, out=theta)
            np.multiply(theta, self.lr32, out=theta)
            np.subtract(self.params[start:stop], theta, out=theta)
            # θ' = θ − lr·(μ·buf' + Δ) is non-finite whenever buf' or Δ is (0·inf is NaN
            # too), so one screen covers all three arrays; the exact checks say which failed.
            # A proven block's squares sum to at most the largest f32, so each |θ'| < 2⁶⁴:
            # only an unproven one can hold a value that the bf16 BCAST makes infinite.
            if not proven_finite(theta):
                if not _all_finite(d):
                    raise MergeError("merged outer gradient is not finite; commit refused")
                if not (_all_finite(buf) and _all_finite(theta)):
                    raise MergeError(
                        "outer step produced non-finite parameters or momentum; commit refused"
                    )
                if self.params_bf16 is not None and np.abs(theta).max() >= BF16_OVERFLOW:
                    raise MergeError(
                        "outer step produced parameters beyond bf16's range (finite, but "
                        "infinite in the bf16 broadcast learners must refuse); commit refused"
                    )
            if self.params_bf16 is not None:  # while the block is in cache
                f32_to_bf16(theta, out=self.params_bf16[start:stop])
            return _block_squares(d, buffers.wide[0][:size])


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _step_executor() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(_STEP_THREADS, thread_name_prefix="yeto-merge")
        return _executor


# -- ledger ----------------------------------------------------------------------------------
def update_ledger(
    ledger: Mapping[int, tuple[int, int, int]], responses: Iterable[Response]
) -> dict[int, LedgerEntry]:
    """A new ledger with each response counted: merges + 1, steps + c_steps, tokens + c_tokens.

    Keyed by learner id across generations; ``ledger`` itself is left as it was. Each count
    stops at 2^64 - 1, its checkpoint field's largest value: two legal PUSHes of c_tokens 2^63
    made one that no checkpoint could hold, and every write of the run failed.
    """
    updated = {learner: LedgerEntry(*entry) for learner, entry in ledger.items()}
    for response in responses:
        merges, steps, tokens = updated.get(response.learner_id, LedgerEntry(0, 0, 0))
        updated[response.learner_id] = LedgerEntry(
            min(merges + 1, LEDGER_MAX),
            min(steps + response.c_steps, LEDGER_MAX),
            min(tokens + response.c_tokens, LEDGER_MAX),
        )
    return updated


# -- one round -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, eq=False)
class RoundMerge:
    """Everything one commit produces; the caller swaps it in only after it was returned."""

    responses: tuple[Response, ...]  # in merge order
    weights: tuple[float, ...]  # aligned with ``responses``
    gnorm: float  # ‖merged Δ‖ (Δ itself is never stored when it is a plain weighted sum)
    params: F32Array
    momentum: F32Array
    ledger: dict[int, LedgerEntry]


def merge_round(
    geometry: FragmentGeometry,
    responses: Iterable[Response],
    params: F32Array,
    momentum: F32Array,
    ledger: Mapping[int, tuple[int, int, int]],
    config: MergeConfig,
    iso_solver: IsoSolver = SCALAR_ISO_SOLVER,
    allocate: Allocate | None = None,
    params_bf16: NDArray[np.uint16] | None = None,
    *,
    new_params: F32Array | None = None,
    on_progress: Progress | None = None,
) -> RoundMerge:
    """Merge, outer step and ledger of one round, all or nothing (:class:`MergeError`).

    The new Δ, params and momentum come from ``allocate`` (a pool that recycles a fragment's
    previous arrays avoids page-faulting fresh memory every round), the new params from
    ``new_params`` instead when given (a broadcast may already refer to it); ``params`` and
    ``momentum`` are only read. ``params_bf16``, when given, receives the new params' bf16 bit
    patterns (a bf16 broadcast's payload), written by the same pass while each block is in
    cache. ``on_progress(n)``: the first n values of the new params (and of ``params_bf16``)
    are final, reported as that prefix grows during the outer step. After a
    :class:`MergeError` the outputs' contents mean nothing.
    """
    ordered = merge_order(responses)
    _check_round_inputs(geometry, ordered, momentum)
    if params.shape != momentum.shape or params.dtype != np.float32:
        raise ValueError("params must be float32 of the momentum's shape")
    alloc = allocate or _fresh
    numel = geometry.numel
    merged = _merge(geometry, ordered, momentum, config, iso_solver, alloc)
    if new_params is None:
        new_params = alloc(numel)
    elif new_params.shape != (numel,) or new_params.dtype != np.float32:
        raise ValueError(f"new_params must be float32 of shape ({numel},)")
    new_momentum = alloc(numel)
    delta, plain_sum = (merged, None) if isinstance(merged, np.ndarray) else (None, merged)
    norm = _outer_step(
        _StepPass(
            params,
            momentum,
            delta,
            plain_sum,
            config.outer_lr,
            config.outer_momentum,
            new_params,
            new_momentum,
            params_bf16,
        ),
        on_progress,
    )
    weights = learner_weights(ordered, config.learner_weight)
    return RoundMerge(
        responses=ordered,
        weights=tuple(float(w) for w in weights),
        gnorm=norm,
        params=new_params,
        momentum=new_momentum,
        ledger=update_ledger(ledger, ordered),
    )
