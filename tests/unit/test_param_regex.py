"""Issue 34, the param regex guard: every pattern whose backtracking could take more than
linear time is refused at config load (agent/jobs/paramregex.py), what the project ships
and its tests use stays accepted, and the run-time recheck of a job's params remembers
its verdict."""

from __future__ import annotations

import os
import re

import pytest
import yaml

from agent.config import ConfigError, Template, parse_config
from agent.jobs import document
from agent.jobs.envelope import JobRejected
from agent.jobs.paramregex import EMPTY_BODY, EXPONENTIAL, POLYNOMIAL, TOO_LARGE, regex_risk
from tests.support.cloudkit import TEMPLATES as CLOUD_TEMPLATES
from tests.support.jobs import templates as recording_templates

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_two_patterns_of_the_issue_are_refused():
    assert regex_risk(r"(a|a)*b") == EXPONENTIAL      # 2^n steps on "a" * n
    assert regex_risk(r"\w*\w*\w*\w*!") == POLYNOMIAL  # n^4 steps on "a" * n


# Known catastrophic patterns: textbook shapes, the OWASP ReDoS list, published outages.
EXPONENTIAL_CASES = [
    r"(a+)+", r"^(a+)+$", r"(a|aa)+", r"([a-zA-Z]+)*", r"(x+x+)+y", r"^(\d+)*$", r"(.*,)*z",
    r"(a|b|ab)*c", r"(ab?|b)*c", r"((a?|b?)x)+", r"(\w|\d)+$", r"(?i)(A|a)*b", r"(a|a){1,30}", r"(\w+\s?)*$",
    r"^(([a-z])+.)+[A-Z]([a-z])+$",                                           # OWASP: Java class name
    r"^([a-zA-Z0-9])(([\-.]|[_]+)?([a-zA-Z0-9]+))*(@){1}[a-z0-9]+[.]{1}"   # OWASP: e-mail
    r"(([a-z]{2,3})|([a-z]{2,3}[.]{1}[a-z]{2,3}))$",
    r"(.*a){12}", r"(?:a|[ab])+c", r"(?:[0-9]|\d)+x", r"(?:\d{1,3}){1,4}x",
]
POLYNOMIAL_CASES = [
    r"\w*\w*", r"\d+\.?\d*", r".*x.*", r"\s*\s+$", r"[a-z]+[a-z0-9]*x", r"^.*?,.*?,.*?$",
    r".*(?:.*=.*)",                                        # the Cloudflare outage of July 2019
    r"^[\s\S]*\s*$", r"a*(?:b?)a*c",
]
EMPTY_CASES = [r"(a?)*", r"(a|)+", r"(a|a?)+b", r"(?:)*", r"(a*)*", r"^(\w*x?)*$", r"((ab)*)+", r"(\b)+"]


@pytest.mark.parametrize("rx", EXPONENTIAL_CASES)
def test_ambiguity_under_a_repeat_is_refused(rx):
    re.compile(rx, re.ASCII)
    assert regex_risk(rx) == EXPONENTIAL


@pytest.mark.parametrize("rx", POLYNOMIAL_CASES)
def test_repeats_that_can_match_the_same_text_one_after_another_are_refused(rx):
    re.compile(rx, re.ASCII)
    assert regex_risk(rx) == POLYNOMIAL


@pytest.mark.parametrize("rx", EMPTY_CASES)
def test_a_repeat_of_something_that_can_match_empty_is_refused(rx):
    re.compile(rx, re.ASCII)
    assert regex_risk(rx) == EMPTY_BODY


@pytest.mark.parametrize("rx,what", [
    (r"(a)\1", "a backreference"), (r"(?P<x>a)(?P=x)", "a backreference (?P=name)"),
    (r"(?=a)a", "a lookaround"), (r"(?<!a)b", "a lookaround"), (r"(a)?(?(1)b|c)", "a conditional group"),
    (r"(?x) a b", "verbose mode"), (r"\N{DIGIT ONE}", "a named character escape"),
])
def test_constructs_the_check_cannot_model_are_refused_by_name(rx, what):
    re.compile(rx, re.ASCII)
    why = regex_risk(rx)
    assert why is not None and what in why and "cannot analyse" in why, why


@pytest.mark.parametrize("rx,why", [(r"[0-9]{4}[0-9]{2}", POLYNOMIAL), (r"\d{1,3}\d{1,3}x", POLYNOMIAL),
                                    (r"(?:a{2})+", EXPONENTIAL), (r"^(?:\.(?:25[0-5]|2[0-4]\d|1?\d?\d)){3}$", EXPONENTIAL)])
def test_bounded_repeats_are_modelled_as_unbounded_ones(rx, why):
    r"""The price of having no false negatives: a{m,n} is checked as a+, so these patterns,
    whose cost their bounds keep finite, are refused: write [0-9]{6}, \d{2,6}x, (?:aa)+,
    and an octet that reads "11" one way only (1\d\d|[1-9]?\d, not 1?\d?\d)."""
    assert regex_risk(rx) == why
    assert all(regex_risk(ok) is None for ok in (r"[0-9]{6}", r"\d{2,6}x", r"(?:aa)+",
                                                 r"^(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}$"))


def test_a_pattern_too_large_to_check_is_refused():
    rx = "|".join(f"x{i:04d}" for i in range(100))   # 500 character occurrences
    assert regex_risk(rx) == TOO_LARGE
    # fewer occurrences, but a loop of 360 states whose pairs exceed the work budget
    rx = "(?:" + "|".join(f"x{i:03d}" for i in range(90)) + ")+"
    assert regex_risk(rx) == TOO_LARGE


# Linear-time patterns: what real templates look like, including an unambiguous nested
# repeat (dotted names) that a blanket "no repeat in a repeat" rule would refuse.
LINEAR_CASES = [
    r"^[0-9]{1,2}$", r"fast|slow", r"^/[A-Za-z0-9/._-]+$", r"(?:ab){3}", r"^(a|b)c+$", r"^[a-z]+(-[a-z]{2})?$",
    r"(?s).*", r"^\d+$", r"^\d+(\.\d+)?$", r"^-?\d+$", r"^v[0-9]+\.[0-9]+\.[0-9]+$", r"^[^/]+$", r"^\S+$",
    r"^[\w.+-]+@[\w-]+\.[\w.-]+$", r"(?i)^[a-f0-9]{64}$", r"^[A-Z]{2}[0-9]{4}$", r"^(on|off|auto)$",
    r"^[a-z0-9]+(\.[a-z0-9]+)*$", r"([a-z]+-)+[a-z]+", r"(a|ab)*c", r"^(?:[01]?\d|2[0-3]):[0-5]\d$",
    r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$", r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    r"a{}b{}", r"[]a]+", r"\[[0-9]+\]", r"^\x41+$", r"(?#a comment)^[0-9]+$", r"(?i:ab)+c",
    r"^\d{1,3}(?:\.\d{1,3}){3}$", r"^(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}$",
    r"^([0-9A-Fa-f]{2}:){5}[0-9A-Fa-f]{2}$", r"^(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,}$",
    r"^/(?:[A-Za-z0-9._-]+/)*[A-Za-z0-9._-]+$", r"[\x00-\U0010FFFF]+x", r"(?i)[^a]+b",
]


@pytest.mark.parametrize("rx", LINEAR_CASES)
def test_linear_patterns_are_accepted(rx):
    re.compile(rx, re.ASCII)
    assert regex_risk(rx) is None


def shipped_and_tested_params() -> dict[str, str]:
    """Every param regex of the templates the project ships (configs/) and its test
    helpers use."""
    out = {}
    for path in ("configs/demo/agent.yaml",):
        with open(os.path.join(ROOT, path)) as fh:
            for name, t in yaml.safe_load(fh)["templates"].items():
                out.update({f"{path}:{name}.{p}": rx for p, rx in t.get("params", {}).items()})
    for name, t in {**CLOUD_TEMPLATES, **recording_templates("/tmp/out")}.items():
        out.update({f"tests/support:{name}.{p}": rx for p, rx in t.get("params", {}).items()})
    out["README/configs/agent.yaml: line"] = "^[0-9]{1,2}$"
    out["tests: sleep"] = r"^[0-9.]+$"
    out["tests: fail_until"] = r"^[0-9]$"
    return out


def test_every_template_the_project_ships_and_tests_use_is_accepted():
    params = shipped_and_tested_params()
    assert len(params) >= 10
    assert {k: regex_risk(rx) for k, rx in params.items() if regex_risk(rx)} == {}


def test_braces_are_read_as_re_reads_them():
    assert regex_risk("x{,}x{,}") == POLYNOMIAL   # {,} is a repeat (x*x*)
    assert regex_risk("x{}x{}") is None           # {} is two literal characters
    assert regex_risk("x{2,x") is None            # not a repeat either


def test_a_refused_pattern_is_a_config_error_naming_the_param():
    text = yaml.safe_dump({"etcd": {"insecure": True},
                           "templates": {"t": {"argv": ["/bin/echo", "{a}"], "params": {"a": r"\w*\w*!"}}}})
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "agent.yaml")
    assert ei.value.problems == [f"agent.yaml: templates.t.params.a: {POLYNOMIAL}"]


def test_the_run_time_recheck_remembers_its_verdict():
    t = Template(argv=["/bin/echo", "{a}"], params={"a": r"^[0-9]{1,2}$"})
    document._remembered_verdict.cache_clear()
    document.check_params({"a": "12"}, t, "t")
    document.check_params({"a": "12"}, t, "t")
    assert document._remembered_verdict.cache_info().hits == 1
    for _ in range(2):   # a refusal is remembered and raised again, the same
        with pytest.raises(JobRejected) as ei:
            document.check_params({"a": "123"}, t, "t")
        assert (ei.value.reason, ei.value.field) == ("bad_param", "params.a")
        assert ei.value.detail == "params.a: '123' does not match ^[0-9]{1,2}$"
    assert document._remembered_verdict.cache_info().hits == 2
    # a changed template is a new verdict
    t2 = Template(argv=["/bin/echo", "{a}"], params={"a": r"^[0-9]{1,3}$"})
    document.check_params({"a": "123"}, t2, "t")
    with pytest.raises(JobRejected) as ei:   # an unhashable value is checked, not remembered
        document.check_params({"a": ["1"]}, t, "t")
    assert ei.value.field == "params.a"
