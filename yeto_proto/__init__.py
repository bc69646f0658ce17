"""yeto_proto: the YETO v4 wire protocol as a standalone, typed, sans-IO library.

It knows bytes and nothing else: no sockets, clocks, torch or anyio. Third-party clients
import it alone. See ``spec/`` for the normative text and ``conformance/`` for golden vectors.
"""

from . import checkpoint, dtypes
from .chunks import ChunkSlicer, Reassembler, StripedFrame, decode_inner_frame
from .constants import (
    CHUNK_SLICE_SIZE,
    FIRST_FRAME_LIMIT,
    FRAME_MAGIC,
    PROTOCOL_VERSION,
    FrameType,
    IsoBackend,
    MergeMode,
    Role,
    WireDtype,
)
from .decoder import CLOSED, NEED_DATA, DecoderState, FrameDecoder
from .dtypes import decode_tensor, encode_tensor, tensor_nbytes
from .errors import (
    CheckpointError,
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    Severity,
)
from .frames import Buffers, decode_payload, encode, encode_bytes
from .identity import (
    DeltaCorrection,
    LearnerWeight,
    SyncerProfile,
    hello_key_of_file,
    hello_mac,
    sign_hello,
    verify_hello,
)
from .layout import FragmentSpec, Layout, TensorSpec, WireFragment, WireLayout, layout_fingerprint
from .limits import Limits
from .messages import (
    AnyMessage,
    BcastFragment,
    BudgetDone,
    Chunk,
    DataHello,
    ErrorMessage,
    FinalAck,
    FinalFragment,
    FinalManifest,
    Heartbeat,
    Hello,
    InitParams,
    Message,
    PullReq,
    PushFragment,
    Shutdown,
)

__all__ = [
    "AnyMessage",
    "BcastFragment",
    "Buffers",
    "BudgetDone",
    "CHUNK_SLICE_SIZE",
    "CLOSED",
    "CheckpointError",
    "Chunk",
    "ChunkSlicer",
    "DataHello",
    "DecoderState",
    "DeltaCorrection",
    "ErrorCode",
    "ErrorMessage",
    "FIRST_FRAME_LIMIT",
    "FRAME_MAGIC",
    "FinalAck",
    "FinalFragment",
    "FinalManifest",
    "FragmentSpec",
    "FrameDecoder",
    "FrameType",
    "Heartbeat",
    "Hello",
    "InitParams",
    "IsoBackend",
    "Layout",
    "LearnerWeight",
    "Limits",
    "LocalProtocolError",
    "MergeMode",
    "Message",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "PullReq",
    "PushFragment",
    "Reassembler",
    "RemoteProtocolError",
    "Role",
    "Severity",
    "Shutdown",
    "StripedFrame",
    "SyncerProfile",
    "TensorSpec",
    "WireDtype",
    "WireFragment",
    "WireLayout",
    "checkpoint",
    "decode_inner_frame",
    "decode_tensor",
    "dtypes",
    "encode_tensor",
    "tensor_nbytes",
    "decode_payload",
    "encode",
    "encode_bytes",
    "hello_key_of_file",
    "hello_mac",
    "layout_fingerprint",
    "sign_hello",
    "verify_hello",
]
