"""Traces: JSONL loading with clear errors, seeded generation, length specs."""

from __future__ import annotations

import pytest

from planner.trace import LengthDist, generate, load, save


def test_load_reads_what_save_wrote(tmp_path):
    trace = generate(5.0, 50, LengthDist.parse("uniform:10:100"), LengthDist.parse("lognormal:50:0.5:1:200"), seed=2)
    save(trace, tmp_path / "t.jsonl")
    assert load(tmp_path / "t.jsonl") == trace


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ("[1, 2, 3]", "expected an object"),
    ('{"arrival_s": 1.0, "prompt_tokens": 5}', "missing output_tokens"),
    ('{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 2}', "arrival_s must be"),
    ('{"arrival_s": 0.5, "prompt_tokens": 5, "output_tokens": 2}', "before the previous"),
    ('{"arrival_s": 2.0, "prompt_tokens": 0, "output_tokens": 2}', "prompt_tokens must be an integer >= 1"),
    ('{"arrival_s": 2.0, "prompt_tokens": 5, "output_tokens": 2.5}', "output_tokens must be"),
    ('{"arrival_s": true, "prompt_tokens": 5, "output_tokens": 2}', "arrival_s must be"),
])
def test_malformed_line_is_refused_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 1.0, "prompt_tokens": 5, "output_tokens": 2}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        load(path)
    assert f"{path}:3:" in str(err.value)


def test_empty_trace_is_refused(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty trace"):
        load(tmp_path / "e.jsonl")


def test_generation_is_seeded_and_poisson():
    a = generate(100.0, 20000, LengthDist.parse("512"), LengthDist.parse("uniform:1:9"), seed=4)
    assert a == generate(100.0, 20000, LengthDist.parse("512"), LengthDist.parse("uniform:1:9"), seed=4)
    assert a != generate(100.0, 20000, LengthDist.parse("512"), LengthDist.parse("uniform:1:9"), seed=5)
    assert all(r.prompt_tokens == 512 and 1 <= r.output_tokens <= 9 for r in a)
    assert a[-1].arrival_s / len(a) == pytest.approx(1 / 100.0, rel=0.03)  # mean gap 1/rate


def test_lognormal_is_clamped_and_centred_on_its_median():
    d = LengthDist.parse("lognormal:200:1.0:16:400")
    trace = generate(1.0, 5001, d, d, seed=1)
    lengths = sorted(r.prompt_tokens for r in trace)
    assert lengths[0] >= 16 and lengths[-1] <= 400
    assert lengths[2500] == pytest.approx(200, rel=0.1)


@pytest.mark.parametrize("spec", ["0", "uniform:9:3", "lognormal:-1:1", "normal:3:4", "uniform:a:b", ""])
def test_bad_length_specs_are_refused(spec):
    with pytest.raises(ValueError):
        LengthDist.parse(spec)
