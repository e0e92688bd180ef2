"""GGML tensor types by id: name, elements per block and bytes per block, as gguf-py 0.19's `GGML_QUANT_SIZES` has
them (tests/test_startup.py checks every entry against the installed gguf-py), so that the header scan every start
makes (`gguf_file.scan`, for the cache key) does not import gguf-py: `import gguf` (its reader, writer, yaml and
vocab modules) was 0.1-0.2 s of a later start that reads no tensor through it. An id missing here (a type a newer
gguf-py added) is asked of gguf-py, so a file is read, and refused, as gguf-py sizes it either way."""

from __future__ import annotations

F32, F16, BF16 = 0, 1, 30

SIZES: dict[int, tuple[str, int, int]] = {0: ('F32', 1, 4), 1: ('F16', 1, 2), 2: ('Q4_0', 32, 18),
    3: ('Q4_1', 32, 20), 6: ('Q5_0', 32, 22), 7: ('Q5_1', 32, 24), 8: ('Q8_0', 32, 34), 9: ('Q8_1', 32, 40),
    10: ('Q2_K', 256, 84), 11: ('Q3_K', 256, 110), 12: ('Q4_K', 256, 144), 13: ('Q5_K', 256, 176),
    14: ('Q6_K', 256, 210), 15: ('Q8_K', 256, 292), 16: ('IQ2_XXS', 256, 66), 17: ('IQ2_XS', 256, 74),
    18: ('IQ3_XXS', 256, 98), 19: ('IQ1_S', 256, 50), 20: ('IQ4_NL', 32, 18), 21: ('IQ3_S', 256, 110),
    22: ('IQ2_S', 256, 82), 23: ('IQ4_XS', 256, 136), 24: ('I8', 1, 1), 25: ('I16', 1, 2), 26: ('I32', 1, 4),
    27: ('I64', 1, 8), 28: ('F64', 1, 8), 29: ('IQ1_M', 256, 56), 30: ('BF16', 1, 2), 34: ('TQ1_0', 256, 54),
    35: ('TQ2_0', 256, 66), 39: ('MXFP4', 32, 17), 40: ('NVFP4', 64, 36), 41: ('Q1_0', 128, 18)}


def known(qtype: int) -> tuple[str, int, int] | None:
    """(name, elements per block, bytes per block) of GGML type `qtype`, or None for an id gguf-py has no size for."""
    if qtype in SIZES:
        return SIZES[qtype]
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES

    if qtype not in T._value2member_map_ or T(qtype) not in GGML_QUANT_SIZES:
        return None
    return (T(qtype).name, *GGML_QUANT_SIZES[T(qtype)])


def name(qtype: int) -> str:
    """The type's name (`Q4_K`), as `GGMLQuantizationType(qtype).name` gives it."""
    got = known(qtype)
    if got is not None:
        return got[0]
    from gguf import GGMLQuantizationType as T

    return T(qtype).name
