"""The demo ByteModel's trainable parameters as names and shapes, without importing torch.

``yeto launch`` and ``yeto bench`` check ``--fragments`` against them before anything starts
(a tensor is never split, so the model allows only so many fragments); their processes stay
torch-free until the learners run. ``tests/test_demo_shapes.py`` holds them to ByteModel.
"""

from __future__ import annotations

#: Byte values: the model's input alphabet and output classes.
VOCAB = 256


def byte_model_shapes(
    context: int = 16, embed: int = 24, hidden: int = 256
) -> list[tuple[str, tuple[int, ...]]]:
    """``ByteModel(context, embed, hidden)``'s named trainable parameter shapes, in order."""
    return [
        ("embed.weight", (VOCAB, embed)),
        ("fc1.weight", (hidden, context * embed)),
        ("fc1.bias", (hidden,)),
        ("fc2.weight", (hidden, hidden)),
        ("fc2.bias", (hidden,)),
        ("head.weight", (VOCAB, hidden)),
        ("head.bias", (VOCAB,)),
    ]
