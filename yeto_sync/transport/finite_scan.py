"""NaN/inf checks of f32 tensors, as their bytes land.

A PUSH (or INIT) of an f32 session must be refused when its tensor holds NaN or inf, and that is
decided when the message is complete. Checking all 64 MiB then costs the event loop several
milliseconds in the one place nothing else can proceed: the round waits for its last push.
CHUNKs of a striped message arrive over tens of milliseconds in reads of up to a few MiB, so
:class:`FiniteScan` checks the whole values of each read right after it landed
(:meth:`FiniteScan.chunk_progress`), while they are still in the processor's caches rather
than read again from memory later, and keeps the verdict; a CHUNK's completion
(:meth:`FiniteScan.chunk_done`) checks what no read covered, and at the message's completion
only the few values that straddle two CHUNKs are left. An unstriped PUSH or INIT (a session
without data streams) is checked the same way while its payload is read in place. The verdict
travels to the coordinator as :attr:`yeto_sync.events.MessageReceived.tensor_finite`; the
coordinator still decides, at its usual place in its checks, what a non-finite tensor means.

The scan is advisory and never raises: anything it cannot place (a frame type without an f32
tensor, a malformed header, a message cut into more tiny CHUNKs than :data:`MAX_TRACKED`) leaves
the verdict ``None`` and the coordinator checks in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from yeto_proto import AnyMessage, Chunk, InitParams, PushFragment
from yeto_proto.buffers import buffer_address
from yeto_proto.constants import HEADER_SIZE, FrameType
from yeto_proto.dtypes import all_finite
from yeto_proto.schema import PREFIX_STRUCTS

_F32 = np.dtype("<f4")
_VALUE = _F32.itemsize
_TYPE_OFFSET = 4  # magic:u32, then type:u8
#: CHUNKs held back plus boundary values remembered, per message, before the scan gives up
#: (verdict ``None``): ordinary striping needs a few dozen; a peer slicing into tiny CHUNKs must
#: not make the scan's memory grow with them.
MAX_TRACKED = 1024
#: Where the tensor starts inside a reassembled message of each scanned type.
_TENSOR_START = {
    t: HEADER_SIZE + PREFIX_STRUCTS[t].size
    for t in (FrameType.INIT_PARAMS, FrameType.PUSH_FRAGMENT)
}


@dataclass
class _Scan:
    tensor_start: int | None = None
    #: CHUNKs that arrived before the one holding the frame type (which says where values are).
    waiting: list[Chunk] = field(default_factory=list)
    #: Tensor value indices that straddle a CHUNK boundary: checked once the message is whole.
    straddling: list[int] = field(default_factory=list)
    #: CHUNKs still arriving, by offset: the message position their checked values reach.
    checked_to: dict[int, int] = field(default_factory=dict)
    finite: bool = True
    scannable: bool = True

    def tracked(self) -> int:
        return len(self.waiting) + len(self.straddling) + len(self.checked_to)

    def give_up(self) -> None:
        self.scannable = False
        self.waiting.clear()
        self.straddling.clear()
        self.checked_to.clear()


@dataclass
class _FrameScan:
    """An unstriped frame's payload, checked as if it were the one CHUNK of its message."""

    payload: memoryview  # the decoder's view, to know the frame again
    part: Chunk
    scan: _Scan


class FiniteScan:
    """Per-group verdicts on the f32 tensors of messages still arriving.

    Striped messages are followed by ``msg_id``; an unstriped PUSH or INIT (a session without
    data streams) is followed while its payload is read in place (:meth:`frame_progress`).
    """

    def __init__(self) -> None:
        self._scans: dict[int, _Scan] = {}
        self._frame: _FrameScan | None = None

    def frame_progress(self, frame_type: FrameType, payload: memoryview, filled: int) -> None:
        """The first ``filled`` bytes of an unstriped frame's ``payload`` are in."""
        start = _TENSOR_START.get(frame_type)
        if start is None:
            self._frame = None
            return
        frame = self._frame
        if frame is None or frame.payload is not payload:  # another frame: start over
            part = Chunk(0, HEADER_SIZE + len(payload), HEADER_SIZE, payload)
            frame = self._frame = _FrameScan(payload, part, _Scan(tensor_start=start))
        if frame.scan.finite:
            self._check(frame.scan, frame.part, filled, whole=False)

    def frame_verdict(self, message: AnyMessage) -> bool | None:
        """The finiteness of the unstriped ``message``'s tensor, or ``None`` if not followed."""
        frame, self._frame = self._frame, None
        if frame is None or not isinstance(message, PushFragment | InitParams):
            return None
        assert frame.scan.tensor_start is not None
        tensor_at = frame.scan.tensor_start - HEADER_SIZE
        if buffer_address(message.data) != buffer_address(frame.part.data) + tensor_at:
            return None  # not the payload that was followed
        # The payload's last bytes (under the decoder's bulk size) came through a copy.
        self._check(frame.scan, frame.part, len(frame.part.data), whole=True)
        return frame.scan.finite

    def chunk_progress(self, chunk: Chunk, filled: int) -> None:
        """The first ``filled`` bytes of ``chunk.data`` just landed: check their whole values."""
        scan = self._scans.setdefault(chunk.msg_id, _Scan())
        if scan.scannable and scan.finite:
            self._locate_tensor(scan, chunk, filled)
            if scan.tensor_start is not None:
                self._check(scan, chunk, filled, whole=False)
            if scan.tracked() > MAX_TRACKED:
                scan.give_up()

    def chunk_done(self, chunk: Chunk) -> None:
        """``chunk`` was accepted by the reassembler: check its values no read covered."""
        scan = self._scans.setdefault(chunk.msg_id, _Scan())
        if not scan.scannable:
            return
        self._locate_tensor(scan, chunk, len(chunk.data))
        if not scan.scannable:
            return
        if scan.tensor_start is None:
            scan.waiting.append(chunk)
        else:
            self._check(scan, chunk, len(chunk.data), whole=True)
        if scan.tracked() > MAX_TRACKED:
            scan.give_up()

    def verdict(self, msg_id: int, message: AnyMessage) -> bool | None:
        """The finiteness of the completed ``message``'s tensor, or ``None`` if not scanned."""
        scan = self._scans.pop(msg_id, None)
        if scan is None or not scan.scannable or scan.tensor_start is None:
            return None
        if not isinstance(message, PushFragment | InitParams):
            return None
        if not scan.finite:
            return False
        data = message.data
        for index in scan.straddling:
            value = data[index * _VALUE : (index + 1) * _VALUE]
            if len(value) == _VALUE and not np.isfinite(np.frombuffer(value, _F32)[0]):
                return False
        return True

    def _locate_tensor(self, scan: _Scan, chunk: Chunk, filled: int) -> None:
        """Learn where the tensor starts once the frame type byte is in; check the CHUNKs
        that waited for it."""
        if scan.tensor_start is not None or not (
            chunk.offset <= _TYPE_OFFSET < chunk.offset + filled
        ):
            return
        start = _tensor_start(chunk.data[_TYPE_OFFSET - chunk.offset])
        if start is None:
            scan.give_up()
            return
        scan.tensor_start = start
        waiting, scan.waiting = scan.waiting, []
        for earlier in waiting:
            self._check(scan, earlier, len(earlier.data), whole=True)

    @staticmethod
    def _check(scan: _Scan, chunk: Chunk, filled: int, *, whole: bool) -> None:
        """Check the values wholly inside ``chunk.data[:filled]`` that no earlier call did.

        ``whole``: the CHUNK is complete (``filled`` is all of it): a value running on into
        the next CHUNK is remembered for :meth:`verdict`, and the CHUNK's progress is dropped.
        """
        assert scan.tensor_start is not None
        begin = chunk.offset
        checked = scan.checked_to.pop(begin, begin) if whole else scan.checked_to.get(begin, begin)
        end = begin + filled
        start = scan.tensor_start
        if end <= start:
            return
        first = -(-(max(checked, start) - start) // _VALUE)  # the first value wholly inside
        stop = (end - start) // _VALUE  # one past the last value wholly inside
        if whole:
            if (end - start) % _VALUE and end < chunk.total_len:
                scan.straddling.append(stop)
        elif stop > first:
            scan.checked_to[begin] = start + stop * _VALUE
        if stop <= first or not scan.finite:
            return
        values = np.frombuffer(
            chunk.data, _F32, count=stop - first, offset=start + first * _VALUE - begin
        )
        if not all_finite(values):
            scan.finite = False


def _tensor_start(type_byte: int) -> int | None:
    try:
        frame_type = FrameType(type_byte)
    except ValueError:
        return None
    return _TENSOR_START.get(frame_type)
