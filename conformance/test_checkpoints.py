"""Checkpoint and final-marker conformance: the golden files in ``checkpoints/`` against yeto_proto.

Each ``<id>.bin`` has a ``<id>.json`` sidecar (``checkpoints/vector.schema.json``): a valid file
lists the fields a reader must return, an invalid one the error code and section it must raise.
The streaming reader and the construct declaration of the whole file must both agree with every
sidecar, and ``generate.py`` must reproduce every committed byte.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import numpy as np
import pytest

from yeto_proto.checkpoint import (
    Checkpoint,
    CheckpointFormat,
    FragmentState,
    LedgerEntry,
    TrailerKind,
    parse_final_marker,
    read_checkpoint,
    resume_decision,
    write_checkpoint,
)
from yeto_proto.checkpoint.schema import parse_checkpoint_file
from yeto_proto.constants import IsoBackend
from yeto_proto.errors import CheckpointError, ErrorCode
from yeto_proto.layout import MergeMode, WireFragment, WireLayout

VECTORS = Path(__file__).resolve().parent / "checkpoints"
BACKENDS = {"scalar": IsoBackend.SCALAR, "torch-svd": IsoBackend.TORCH_SVD}


def _load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


SIDECARS = {
    p.stem: _load(p)
    for p in sorted(VECTORS.glob("*.json"))
    if not p.name.endswith(".schema.json") and p.name not in ("markers.json", "resume.json")
}
VALID = sorted(k for k, v in SIDECARS.items() if v["result"] == "valid")
INVALID = sorted(k for k, v in SIDECARS.items() if v["result"] == "invalid")
MARKERS = _load(VECTORS / "markers.json")
RESUME = _load(VECTORS / "resume.json")


def _bits(array: np.ndarray[Any, Any]) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def _expected_checkpoint(decoded: dict[str, Any]) -> Checkpoint:
    """The sidecar's fields as the typed value (arrays from their exact f32 bytes)."""
    fragments = tuple(
        FragmentState(
            version=f["version"],
            params=np.frombuffer(bytes.fromhex(f["params_f32le"]), dtype="<f4").copy(),
            momentum=np.frombuffer(bytes.fromhex(f["momentum_f32le"]), dtype="<f4").copy(),
        )
        for f in decoded["fragments"]
    )
    return Checkpoint(
        format=CheckpointFormat[decoded["format"]],
        iso_backend=BACKENDS[decoded["iso_backend"]] if decoded["iso_backend"] else None,
        fingerprint=bytes.fromhex(decoded["fingerprint"]) if decoded["fingerprint"] else None,
        global_step=decoded["global_step"],
        fragments=fragments,
        ledger=tuple(LedgerEntry(**entry) for entry in decoded["ledger"]),
        contract=bytes.fromhex(decoded["contract"]) if decoded["contract"] else None,
        trailer=TrailerKind(decoded["trailer_bytes"]),
    )


def _assert_same(actual: Checkpoint, expected: Checkpoint) -> None:
    assert actual.format is expected.format
    assert actual.iso_backend is expected.iso_backend
    assert actual.fingerprint == expected.fingerprint
    assert actual.global_step == expected.global_step
    assert actual.ledger == expected.ledger
    assert actual.contract == expected.contract
    assert actual.trailer is expected.trailer
    assert actual.versions == expected.versions
    assert actual.numels == expected.numels
    for have, want in zip(actual.fragments, expected.fragments, strict=True):
        assert have.params.dtype == np.dtype("<f4") and have.momentum.dtype == np.dtype("<f4")
        assert _bits(have.params) == _bits(want.params)
        assert _bits(have.momentum) == _bits(want.momentum)


# -- the files themselves ------------------------------------------------------------------------
def test_every_binary_has_a_sidecar_and_both_kinds_exist() -> None:
    assert {p.stem for p in VECTORS.glob("*.bin")} == set(SIDECARS)
    assert VALID and INVALID


@pytest.mark.parametrize("ident", sorted(SIDECARS))
def test_sidecar_follows_its_schema_and_describes_its_file(ident: str) -> None:
    sidecar = SIDECARS[ident]
    jsonschema.validate(sidecar, _load(VECTORS / "vector.schema.json"))
    data = (VECTORS / sidecar["file"]).read_bytes()
    assert sidecar["id"] == ident
    assert len(data) == sidecar["size"]
    assert hashlib.sha256(data).hexdigest() == sidecar["sha256"]


def test_generator_reproduces_every_committed_byte(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(VECTORS / "generate.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    generated = {p.name for p in tmp_path.iterdir()}
    committed = {
        p.name
        for p in VECTORS.iterdir()
        if p.suffix in (".bin", ".json") and not p.name.endswith(".schema.json")
    }
    assert generated == committed
    for name in sorted(generated):
        assert (tmp_path / name).read_bytes() == (VECTORS / name).read_bytes(), name


# -- valid files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mapped", [False, True], ids=["loaded", "mapped"])
@pytest.mark.parametrize("ident", VALID)
def test_valid_file_reads_as_its_sidecar_says(ident: str, mapped: bool) -> None:
    checkpoint = read_checkpoint(VECTORS / f"{ident}.bin", mapped=mapped)
    _assert_same(checkpoint, _expected_checkpoint(SIDECARS[ident]["decoded"]))
    assert all(f.params.flags.writeable is not mapped for f in checkpoint.fragments)


@pytest.mark.parametrize("ident", VALID)
def test_construct_declaration_parses_valid_file_alike(ident: str) -> None:
    decoded = SIDECARS[ident]["decoded"]
    parsed = parse_checkpoint_file((VECTORS / f"{ident}.bin").read_bytes())
    assert f"0x{parsed.magic:08X}" == decoded["magic"]
    assert parsed.prefix.global_step == decoded["global_step"]
    assert [(f.version, f.numel) for f in parsed.fragments] == [
        (f["version"], f["numel"]) for f in decoded["fragments"]
    ]
    assert [bytes(f.params).hex() for f in parsed.fragments] == [
        f["params_f32le"] for f in decoded["fragments"]
    ]
    assert [bytes(f.momentum).hex() for f in parsed.fragments] == [
        f["momentum_f32le"] for f in decoded["fragments"]
    ]
    assert [dict(learner_id=e.learner_id, merges=e.merges, steps=e.steps, tokens=e.tokens)
            for e in parsed.ledger] == decoded["ledger"]  # fmt: skip
    assert parsed.trailer_len == decoded["trailer_bytes"]
    contract = parsed.contract_trailer.contract.hex() if parsed.contract_trailer else None
    assert contract == decoded["contract"]


@pytest.mark.parametrize("ident", VALID)
def test_a_trailing_byte_makes_a_bad_trailer(ident: str, tmp_path: Path) -> None:
    path = tmp_path / "extra.bin"
    path.write_bytes((VECTORS / f"{ident}.bin").read_bytes() + b"\x00")
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path)
    assert caught.value.code is ErrorCode.CKPT_BAD_TRAILER
    assert caught.value.section == "trailer"


@pytest.mark.parametrize("ident", VALID)
def test_every_truncation_fails_cleanly_or_drops_a_whole_trailer(
    ident: str, tmp_path: Path
) -> None:
    data = (VECTORS / f"{ident}.bin").read_bytes()
    whole = _expected_checkpoint(SIDECARS[ident]["decoded"])
    ledger_end = len(data) - whole.trailer.value
    path = tmp_path / "cut.bin"
    for length in range(len(data)):
        path.write_bytes(data[:length])
        try:
            shorter = read_checkpoint(path)
        except CheckpointError as exc:
            assert exc.code in (ErrorCode.CKPT_TRUNCATED, ErrorCode.CKPT_BAD_TRAILER), length
            continue
        # Only cutting a trailer back to 32 or 0 bytes leaves a valid file.
        assert length - ledger_end in (0, 32), length
        assert shorter.trailer.value == length - ledger_end
        assert shorter.versions == whole.versions and shorter.ledger == whole.ledger


@pytest.mark.parametrize(
    "ident",
    [
        k
        for k in VALID
        if SIDECARS[k]["decoded"]["format"] == "V3"
        and SIDECARS[k]["decoded"]["trailer_bytes"] == 68
    ],
)
def test_writer_reproduces_v3_file_byte_for_byte(ident: str, tmp_path: Path) -> None:
    path = tmp_path / "written.bin"
    write_checkpoint(path, _expected_checkpoint(SIDECARS[ident]["decoded"]))
    assert path.read_bytes() == (VECTORS / f"{ident}.bin").read_bytes()


# -- invalid files -------------------------------------------------------------------------------
@pytest.mark.parametrize("mapped", [False, True], ids=["loaded", "mapped"])
@pytest.mark.parametrize("ident", INVALID)
def test_invalid_file_fails_with_its_code_and_section(ident: str, mapped: bool) -> None:
    expected = SIDECARS[ident]["error"]
    path = VECTORS / f"{ident}.bin"
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path, mapped=mapped)
    assert caught.value.code is ErrorCode(expected["code"])
    assert caught.value.section == expected["section"]
    message = str(caught.value)
    assert str(path) in message and expected["section"] in message and "\n" not in message


@pytest.mark.parametrize("ident", INVALID)
def test_construct_declaration_rejects_invalid_file_alike(ident: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        parse_checkpoint_file((VECTORS / f"{ident}.bin").read_bytes())
    assert caught.value.code is ErrorCode(SIDECARS[ident]["error"]["code"])


# -- final markers -------------------------------------------------------------------------------
def test_marker_cases_follow_their_schema() -> None:
    jsonschema.validate(MARKERS, _load(VECTORS / "markers.schema.json"))


@pytest.mark.parametrize("case", MARKERS["tests"], ids=lambda c: f"tc{c['tcId']}")
def test_final_marker_case(case: dict[str, Any]) -> None:
    data = bytes.fromhex(case["hex"])
    if case["result"] == "valid":
        assert parse_final_marker(data) == case["global_step"]
    else:
        with pytest.raises(CheckpointError) as caught:
            parse_final_marker(data)
        assert caught.value.code is ErrorCode(case["error"])


# -- resume decisions ----------------------------------------------------------------------------
def test_resume_cases_follow_their_schema_and_name_valid_files() -> None:
    jsonschema.validate(RESUME, _load(VECTORS / "resume.schema.json"))
    for case in RESUME["tests"]:
        assert SIDECARS[case["checkpoint"].removesuffix(".bin")]["result"] == "valid"


@pytest.mark.parametrize("case", RESUME["tests"], ids=lambda c: f"tc{c['tcId']}")
def test_resume_decision_case(case: dict[str, Any]) -> None:
    hello = case["hello"]
    decision = resume_decision(
        read_checkpoint(VECTORS / case["checkpoint"]),
        iso_backend=BACKENDS[case["iso_backend"]],
        fingerprint=bytes.fromhex(hello["layout_fingerprint"]),
        # The merge mode plays no part in resuming; the grouping of tensors does (V2).
        wire_layout=WireLayout(
            tuple(WireFragment(MergeMode.AVG, tuple(f)) for f in hello["fragments"])
        ),
        session_contract=bytes.fromhex(hello["session_contract"]),
    )
    assert decision.eligible is (case["result"] == "valid"), decision.reason
    assert decision.check == case.get("check"), decision.reason
