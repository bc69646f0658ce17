"""write_safetensors: files the safetensors library reads back exactly, written into the given
path alone (the library's own writer used a temporary file of its own naming beside it, which
an export killed mid-write left behind for good)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from yeto_learn.safetensors_file import write_safetensors


def test_tensors_and_metadata_read_back_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tensors = {
        "embed.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "blöck.0.bias": rng.standard_normal(7).astype(np.float32),  # UTF-8 names
        "cube": rng.standard_normal((2, 1, 3)).astype(np.float32),
    }
    source = np.arange(20, dtype=np.float32)
    tensors["view"] = source[4:16].reshape(3, 4)  # a view of a larger buffer, as exports are
    path = tmp_path / "out.safetensors"
    write_safetensors(path, tensors, {"global_step": "12", "note": "ünïcode"})
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, want in tensors.items():
        assert loaded[name].dtype == np.float32 and loaded[name].shape == want.shape
        assert loaded[name].tobytes() == want.tobytes()
    with safe_open(str(path), "np") as handle:
        assert handle.metadata() == {"global_step": "12", "note": "ünïcode"}
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert length % 8 == 0  # the header is padded, so the data starts aligned


def test_a_scalar_keeps_its_empty_shape(tmp_path: Path) -> None:
    """A 0-d parameter (a CLIP-style ``logit_scale``) was written with shape [1]."""
    path = tmp_path / "out.safetensors"
    tensors = {"scale": np.array(2.5, np.float32), "weight": np.ones((2, 3), np.float32)}
    write_safetensors(path, tensors, {})
    loaded = load_file(str(path))
    assert loaded["scale"].shape == () and float(loaded["scale"]) == 2.5
    assert loaded["weight"].shape == (2, 3)


def test_the_metadata_key_is_no_tensor_name(tmp_path: Path) -> None:
    path = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match="__metadata__"):
        write_safetensors(path, {"__metadata__": np.zeros(1, np.float32)}, {})
    assert not path.exists()
