"""Throughput of the wire dtype codecs (yeto_proto.dtypes) against numpy copy, in one run.

Baseline: ``numpy.copyto`` of a 256 MiB f32 array into a preallocated one (GB/s = bytes copied
per second). Rows: q4 encode / decode of 64 Mi values (M values/s), bf16 encode / decode (GB/s of
the f32 side), the finiteness check, and whole PUSH frames (encode + FrameDecoder + tensor
decode) of a 64 MiB f32 delta. "× copy" is the row's f32-side GB/s over the baseline's GB/s.
Targets: q4 encode >= 500 M values/s, q4 decode >= 1,100 M values/s, bf16 encode >= 0.5x copy.

Every operation writes into buffers allocated once, as a long-lived syncer would; the "fresh"
rows show the cost of a new 256 MiB output (page faults) for comparison. Baseline and
candidates run interleaved; a row reports the best of its repetitions (other jobs on the
machine only ever add time) and, for reference, the median. Only the finite screen calls BLAS
(a dot product); everything else is elementwise numpy.

    .venv/bin/python benchmarks/bench_codecs.py            # full run, writes RESULTS.md section
    .venv/bin/python benchmarks/bench_codecs.py --quick    # 4 Mi values, prints only
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from results_md import RESULTS, replace_section  # noqa: E402

from yeto_proto import dtypes  # noqa: E402
from yeto_proto.constants import WireDtype  # noqa: E402

HEADING = "## Codecs (bench_codecs.py)"
MI = 1 << 20
#: One read's worth of values as the syncer's check sees them (1 MiB: fits this CPU's L2).
CACHED_BLOCK_VALUES = 1 << 18


@dataclass(frozen=True)
class Row:
    what: str
    values: int  # f32 values processed per repetition
    best_s: float
    median_s: float
    unit: str  # "Mv/s" or "GB/s": the figure the target is stated in
    target: float | None  # minimum, in ``unit`` ("x copy" when unit is "x")
    baseline_gbs: float

    @property
    def f32_gbs(self) -> float:
        return 4 * self.values / self.best_s / 1e9

    @property
    def mvalues(self) -> float:
        return self.values / self.best_s / 1e6

    @property
    def ratio(self) -> float:
        return self.f32_gbs / self.baseline_gbs

    def measured(self) -> float:
        return {"Mv/s": self.mvalues, "x": self.ratio}.get(self.unit, self.f32_gbs)

    def result(self) -> str:
        if self.target is None:
            return "info"
        return "PASS" if self.measured() >= self.target else "FAIL"

    def target_text(self) -> str:
        if self.target is None:
            return ""
        return (
            f"≥ {self.target:,.0f} M values/s" if self.unit == "Mv/s" else f"≥ {self.target}x copy"
        )

    def markdown(self) -> str:
        return (
            f"| {self.what} | {self.values / MI:,.0f} Mi | {self.best_s * 1e3:,.1f} | "
            f"{self.median_s * 1e3:,.1f} | {self.mvalues:,.0f} | {self.f32_gbs:,.2f} | "
            f"{self.ratio:.2f}x | {self.target_text()} | {self.result()} |"
        )


def timings(action: Callable[[], object], repeats: int) -> list[float]:
    action()  # warm-up: first touch of outputs, lazily built tables
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return samples


class Bench:
    def __init__(self, numel: int, repeats: int) -> None:
        self.numel = numel
        self.repeats = repeats
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal(numel, dtype=np.float32)
        self.copy_dest = np.empty_like(self.x)
        self.copy_samples: list[float] = []
        self.rows: list[Row] = []

    def copy_once(self) -> None:
        self.copy_samples += timings(lambda: np.copyto(self.copy_dest, self.x), 1)

    @property
    def baseline_gbs(self) -> float:
        return self.x.nbytes / min(self.copy_samples) / 1e9

    def measure(
        self,
        what: str,
        action: Callable[[], object],
        *,
        values: int | None = None,
        unit: str = "GB/s",
        target: float | None = None,
    ) -> None:
        self.copy_once()  # interleave the baseline with the candidates
        samples = timings(action, self.repeats)
        self.copy_once()
        self.rows.append(
            Row(
                what,
                self.numel if values is None else values,
                min(samples),
                statistics.median(samples),
                unit,
                target,
                float("nan"),  # filled in once every baseline sample is in
            )
        )

    def finished_rows(self) -> list[Row]:
        base = self.baseline_gbs
        baseline = Row(
            f"numpy copy {4 * self.numel / MI:,.0f} MiB f32 (baseline, "
            f"{len(self.copy_samples)} interleaved samples)",
            self.numel,
            min(self.copy_samples),
            statistics.median(self.copy_samples),
            "GB/s",
            None,
            base,
        )
        return [baseline] + [Row(**{**row.__dict__, "baseline_gbs": base}) for row in self.rows]


def finite_screen_rows(bench: Bench) -> None:
    """The NaN/inf screen as the syncer runs it: on a block that just landed, still in cache."""
    block = bench.x[:CACHED_BLOCK_VALUES]
    calls = bench.numel // CACHED_BLOCK_VALUES

    def screen_each(screen: Callable[[np.ndarray], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                screen(block)

        return run

    size = f"{CACHED_BLOCK_VALUES * 4 / MI:g} MiB block in cache, {calls:,} times"
    bench.measure(f"finite screen `proven_finite` (dot), {size}", screen_each(dtypes.proven_finite))
    bench.measure(
        f"finite screen `np.add.reduce` (for comparison), {size}", screen_each(np.add.reduce)
    )


def push_frame_rows(bench: Bench) -> str | None:
    """PUSH frames through yeto_proto.encode and FrameDecoder; None when that layer is missing."""
    try:
        from yeto_proto import FrameDecoder, Limits, PushFragment, Role, encode
    except ImportError as exc:
        return f"PUSH frame rows skipped: yeto_proto frames layer not importable yet ({exc})"
    numel = min(16 * MI, bench.numel)  # 64 MiB of f32 deltas
    delta = bench.x[:numel]
    out = np.empty(numel, np.float32)

    def round_trip(dtype: WireDtype, decoder: FrameDecoder) -> None:
        data = dtypes.encode_tensor(delta, dtype, push=True)
        push = PushFragment(
            learner_id=0,
            fragment_id=0,
            global_step=1,
            round_attempt=1,
            base_version=0,
            local_step=10,
            c_steps=10,
            c_tokens=1000,
            data=data.data,
        )
        for buffer in encode(push):
            decoder.feed(buffer)
        message = decoder.next_frame()
        assert isinstance(message, PushFragment)
        if dtype is WireDtype.F32:  # f32 decodes to a view of the received frame: no copy
            decoded = dtypes.decode_tensor(message.data, dtype, numel, push=True)
            assert decoded.shape == (numel,)
        else:
            decoded = dtypes.decode_tensor(message.data, dtype, numel, push=True, out=out)
            assert decoded is out

    for dtype in (WireDtype.F32, WireDtype.Q4):
        # One decoder for the whole run, as on a connection: its buffer pool is warm.
        decoder = FrameDecoder(
            Role.SYNCER, limits=Limits(dtype, (numel,)), enforce_first_frame=False
        )
        bench.measure(
            f"PUSH frame encode+decode, {numel * 4 / MI:,.0f} MiB of f32 delta as "
            f"{dtype.name.lower()}",
            functools.partial(round_trip, dtype, decoder),
            values=numel,
            unit="x" if dtype is WireDtype.F32 else "GB/s",
            target=0.5 if dtype is WireDtype.F32 else None,
        )
    return None


def run(numel: int, repeats: int) -> tuple[list[Row], list[str]]:
    bench = Bench(numel, repeats)
    x = bench.x
    notes = [f"bf16 encoder backend: {dtypes.bf16_backend()}"]

    q4 = dtypes.q4_encode(x)
    q4_out = np.empty(dtypes.q4_nbytes(numel), np.uint8)
    f32_out = np.empty(numel, np.float32)
    bf16_out = np.empty(numel, np.uint16)
    bench.measure("q4 encode", lambda: dtypes.q4_encode(x, out=q4_out), unit="Mv/s", target=500)
    bench.measure(
        "q4 decode", lambda: dtypes.q4_decode(q4, numel, out=f32_out), unit="Mv/s", target=1100
    )
    bench.measure("q4 decode, fresh output array", lambda: dtypes.q4_decode(q4, numel))
    bench.measure(
        f"bf16 encode ({dtypes.bf16_backend()})",
        lambda: dtypes.f32_to_bf16(x, out=bf16_out),
        unit="x",
        target=0.5,
    )
    if dtypes.bf16_backend() != "numpy":
        saved = dtypes._ML_BFLOAT16
        dtypes._ML_BFLOAT16 = None
        try:
            bench.measure(
                "bf16 encode (pure-numpy fallback)", lambda: dtypes.f32_to_bf16(x, out=bf16_out)
            )
        finally:
            dtypes._ML_BFLOAT16 = saved
    bench.measure("bf16 decode", lambda: dtypes.bf16_to_f32(bf16_out, out=f32_out))
    bench.measure("bf16 decode, fresh output array", lambda: dtypes.bf16_to_f32(bf16_out))
    bench.measure("all_finite", lambda: dtypes.all_finite(x))
    finite_screen_rows(bench)
    bench.measure("numpy copy, fresh output array (x.copy())", x.copy)
    skipped = push_frame_rows(bench)
    if skipped:
        print(skipped)
        notes.append(skipped)
    return bench.finished_rows(), notes


def table(rows: list[Row], numel: int, repeats: int, notes: list[str]) -> str:
    base = rows[0].baseline_gbs
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [
        f"{datetime.date.today()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"numpy {np.__version__}; {numel / MI:,.0f} Mi standard-normal f32 values "
        f"({4 * numel / MI:,.0f} MiB); best of {repeats} (median beside it); load average at "
        f"the end {load}. {'; '.join(notes)}.",
        "",
        f"Baseline: numpy copy of {4 * numel / MI:,.0f} MiB f32 into a preallocated array, "
        f"**{base:.2f} GB/s** (first row).",
        "",
        "| operation | values | best ms | median ms | M values/s | f32 GB/s | × copy | target "
        "| result |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    lines += [row.markdown() for row in rows]
    lines += [
        "",
        "Targets are checked on the rows that write into reused buffers (a syncer's steady "
        'state); the "fresh output array" rows add the first touch of a new array. The PUSH '
        "rows time `encode_tensor` → `PushFragment` → `encode` → `FrameDecoder.feed` (the one "
        "copy, into the decoder's pooled frame buffer) → `next_frame` → `decode_tensor` (a view "
        "for f32; into a reused array for q4). The finite screen rows check one cached 1 MiB "
        "block over and over, as the syncer checks each read that just landed; only they call "
        "BLAS (`proven_finite` is a dot product).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 Mi values; print, don't write")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    numel = 4 * MI if args.quick else 64 * MI
    rows, notes = run(numel, args.repeats)
    text = table(rows, numel, args.repeats, notes)
    print(text)
    failed = [row.what for row in rows if row.result() == "FAIL"]
    if args.quick:
        print("quick run: the targets are read at full size only; not judged", file=sys.stderr)
        return 0
    replace_section(HEADING, text)
    print(f"written to {RESULTS} under {HEADING!r}")
    if failed:
        print("FAIL:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
