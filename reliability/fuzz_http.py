"""Schemathesis campaigns against a running coordinator's /openapi.json (reliability/fuzz.py's
`--target http --url URL`; tests/reliability/test_fuzz_http.py runs the CI-sized one).

For each operation and each of schemathesis's modes (positive: bodies the schema allows;
negative: bodies it does not), `examples` generated requests, each checked for:
- no 5xx but the documented ones (503: no live worker or overloaded; 501: no model store);
- a content type the schema documents for the status;
- negative mode: the body the schema refuses is refused (the schema is no looser than the
  parsers);
- no Python traceback text in the body.
Needs the test extras (schemathesis, hypothesis); imported only when used.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

DOCUMENTED_5XX = (501, 503)
TRACEBACK_MARKERS = ("Traceback (most recent call last)", '.py", line ')


@dataclass
class HttpReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)  # "METHOD path status" -> count
    failures: list[str] = field(default_factory=list)  # schemathesis's report of each
    labels: Counter = field(default_factory=Counter)  # operation label -> requests


def _checks(negative: bool) -> list:
    import schemathesis

    @schemathesis.check
    def no_server_fault(ctx, response, case) -> None:
        if response.status_code >= 500 and response.status_code not in DOCUMENTED_5XX:
            raise AssertionError(f"server error {response.status_code}: {response.text[:300]}")

    @schemathesis.check
    def no_traceback(ctx, response, case) -> None:
        if any(marker in response.text for marker in TRACEBACK_MARKERS):
            raise AssertionError(f"the body shows a traceback: {response.text[:300]}")

    checks = [no_server_fault, no_traceback, schemathesis.checks.content_type_conformance]
    if negative:
        checks.append(schemathesis.checks.negative_data_rejection)
    return checks


def fuzz_http(url: str, examples: int, modes: tuple[str, ...] = ("positive", "negative"),
              timeout_s: float = 20.0) -> HttpReport:
    """Run the campaign against the coordinator at `url` (e.g. http://127.0.0.1:11434).

    Positive bodies name the served model in three requests of four: a random model name is
    a 404 before anything else is read, so without it few requests would reach the parsers
    of the other fields, the tokenizer, admission and the workers."""
    import httpx
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=timeout_s)
    served = httpx.get(f"{url}/api/tags", timeout=timeout_s).json()["models"][0]["name"]
    operations = [result.ok() for result in schema.get_all_operations()]
    report = HttpReport()
    for mode in (GenerationMode(m) for m in modes):
        checks = _checks(mode is GenerationMode.NEGATIVE)
        for operation in operations:
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            @hypothesis.settings(max_examples=examples, derandomize=True, database=None,
                                 deadline=None, suppress_health_check=list(HealthCheck),
                                 phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
            def call(case) -> None:
                if (mode is GenerationMode.POSITIVE and isinstance(case.body, dict)
                        and "model" in case.body and report.requests % 4):
                    case.body["model"] = served
                report.requests += 1
                report.labels[operation.label] += 1
                response = case.call(base_url=url, timeout=timeout_s)
                report.statuses[f"{operation.label} {response.status_code}"] += 1
                case.validate_response(response, checks=checks)

            try:
                call()
            except hypothesis.errors.Unsatisfiable:
                pass  # negative mode: nothing in an operation without parameters to break
            except Exception as exc:  # a failing example (or a group of them): the finding
                report.failures.append(f"{mode.value} {operation.label}: "
                                       f"{type(exc).__name__}: {exc}"[:2000])
    return report
