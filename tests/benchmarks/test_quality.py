"""benchmarks/quality.py judges formats against a baseline: the file's own fp32, or with
--reference another file's (the F16 a K-quant was made from)."""

from __future__ import annotations

import re

from benchmarks import quality
from reliability.model_factory import make_tiny_gguf


def rows(out: str) -> dict[str, tuple[float, float, float]]:
    found = re.findall(r"^(ref fp32|\w+)\s+([\d.]+)\s+([+-][\d.]+)%\s+([\d.]+)%$", out, re.M)
    return {name: (float(p), float(c), float(a)) for name, p, c, a in found}


def test_quality_against_the_file_itself_and_against_a_reference(tmp_path, capsys):
    f32 = make_tiny_gguf(tmp_path / "f32.gguf", "F32", vocab_size=320, hidden=256,
                         intermediate=512, seed=3, max_position=2048).path
    q4k = make_tiny_gguf(tmp_path / "q4k.gguf", "Q4_K", vocab_size=320, hidden=256,
                         intermediate=512, seed=3, max_position=2048).path
    quality.main([str(q4k), "--formats", "fp32,int8"])
    own = rows(capsys.readouterr().out)
    assert set(own) == {"fp32", "int8"} and own["fp32"][1:] == (0.0, 100.0)
    quality.main([str(q4k), "--formats", "fp32,int8", "--reference", str(f32)])
    judged = rows(capsys.readouterr().out)
    assert set(judged) == {"ref fp32", "fp32", "int8"} and judged["ref fp32"][1:] == (0.0, 100.0)
    # The Q4_K file's own fp32 is the same computation in both runs; against the F32 twin it
    # carries the quantization's change (same seed: the weights Q4_K was made from).
    assert judged["fp32"][0] == own["fp32"][0] and judged["fp32"][1] != 0.0
    quality.main([str(f32), "--formats", "fp32", "--reference", str(f32)])
    same = rows(capsys.readouterr().out)
    assert same["fp32"][1:] == (0.0, 100.0)
