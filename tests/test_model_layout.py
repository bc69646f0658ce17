"""Layout derivation from named parameters, and the session contract."""

from __future__ import annotations

import pytest

from yeto_learn.model_layout import (
    FragmentPattern,
    build_layout,
    most_fragments,
    normalize_name,
    session_contract,
)
from yeto_proto import MergeMode, WireDtype

SHAPES = [
    ("embed.weight", (100, 16)),
    ("layers.0.attn.weight", (16, 16)),
    ("layers.0.norm.bias", (16,)),
    ("layers.1.attn.weight", (16, 16)),
    ("layers.1.norm.bias", (16,)),
    ("head.weight", (10, 16)),
    ("head.bias", (10,)),
]


def _names(layout):  # type: ignore[no-untyped-def]
    return [[t.name for t in f.tensors] for f in layout.fragments]


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("module.layers.0.w", "layers.0.w"),
        ("_orig_mod.module.head.bias", "head.bias"),
        ("_fsdp_wrapped_module.layers._checkpoint_wrapped_module.1.w", "layers.1.w"),
        ("plain", "plain"),
    ],
)
def test_wrapper_prefixes_are_dropped(raw: str, normalized: str) -> None:
    assert normalize_name(raw) == normalized


def test_wrapped_model_has_the_same_fingerprint() -> None:
    wrapped = [(f"module._orig_mod.{n}", s) for n, s in SHAPES]
    assert (
        build_layout(wrapped, fragments=3).fingerprint()
        == build_layout(SHAPES, fragments=3).fingerprint()
    )


def test_balanced_packing_covers_every_tensor_once_and_balances() -> None:
    layout = build_layout(SHAPES, fragments=3)
    names = sorted(n for group in _names(layout) for n in group)
    assert names == sorted(n for n, _ in SHAPES)
    loads = [f.numel for f in layout.fragments]
    # Largest first into the lightest bin: 1600 | 256+160 | 256+16+16+10.
    assert sorted(loads) == [298, 416, 1600]


def test_strided_deals_whole_layers_round_robin() -> None:
    layout = build_layout(SHAPES, fragments=2, pattern=FragmentPattern.STRIDED)
    groups = _names(layout)
    assert "layers.0.attn.weight" in groups[1] and "layers.0.norm.bias" in groups[1]
    assert "layers.1.attn.weight" in groups[0] and "layers.1.norm.bias" in groups[0]


def test_matrix_merge_separates_matrices_from_the_rest() -> None:
    layout = build_layout(SHAPES, fragments=3, matrix_merge=MergeMode.ISO)
    modes = [f.merge_mode for f in layout.fragments]
    assert modes.count(MergeMode.AVG) == 1
    for fragment in layout.fragments:
        is_matrix = [len(t.shape) >= 2 for t in fragment.tensors]
        assert all(is_matrix) == (fragment.merge_mode is MergeMode.ISO)
    wire = layout.wire()
    iso = [f for f in wire.fragments if f.merge_mode is MergeMode.ISO]
    assert all(len(f.matrix_shapes) == len(f.numels) for f in iso)


def test_more_fragments_than_tensors_are_refused_not_quietly_fewer() -> None:
    # A tensor is never split; a schedule planned for 8 fragments would be wrong for 2.
    assert most_fragments(SHAPES[:2]) == 2
    assert len(build_layout(SHAPES[:2], fragments=2).fragments) == 2
    with pytest.raises(ValueError, match="at most 2"):
        build_layout(SHAPES[:2], fragments=8)


def test_rda_and_iso_need_a_fragment_for_the_non_matrix_parameters() -> None:
    shapes = [("w", (3, 4)), ("b", (4,)), ("v", (4, 4))]
    assert most_fragments(shapes, MergeMode.RDA) == 3
    with pytest.raises(ValueError, match="fragments >= 2"):
        build_layout(shapes, fragments=1, matrix_merge=MergeMode.RDA)  # used to become avg
    with pytest.raises(ValueError, match="at most 3"):
        build_layout(shapes, fragments=4, matrix_merge=MergeMode.ISO)
    modes = [
        f.merge_mode
        for f in build_layout(shapes, fragments=2, matrix_merge=MergeMode.RDA).fragments
    ]
    assert sorted(m.name for m in modes) == ["AVG", "RDA"]


def test_duplicate_normalized_names_are_refused() -> None:
    with pytest.raises(ValueError, match="same name"):
        build_layout([("module.a", (2,)), ("a", (2,))], fragments=1)


def test_contract_changes_with_run_id_and_is_stable_otherwise() -> None:
    layout = build_layout(SHAPES, fragments=2)
    one = session_contract(layout, WireDtype.Q4, run_id="r1", experiment={"lr": 0.1})
    assert one == session_contract(layout, WireDtype.Q4, run_id="r1", experiment={"lr": 0.1})
    assert one != session_contract(layout, WireDtype.Q4, run_id="r2", experiment={"lr": 0.1})
    assert one != session_contract(layout, WireDtype.F32, run_id="r1", experiment={"lr": 0.1})
    assert len(one) == 32


def test_the_strided_pattern_never_splits_a_layer_so_it_allows_fewer_fragments() -> None:
    shapes = [
        ("layers.0.w", (4, 4)),
        ("layers.0.b", (4,)),
        ("layers.0.g", (4,)),
        ("layers.1.w", (4, 4)),
    ]
    assert most_fragments(shapes) == 4
    assert most_fragments(shapes, pattern=FragmentPattern.STRIDED) == 2
    assert len(build_layout(shapes, fragments=2, pattern=FragmentPattern.STRIDED).fragments) == 2
    with pytest.raises(ValueError, match="at most 2 .*nor a layer"):
        build_layout(shapes, fragments=3, pattern=FragmentPattern.STRIDED)  # built 2 silently
