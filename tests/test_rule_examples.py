"""Every PASS/FAIL/WARN example that `plancc rules` prints is run: the rule reports an error
for FAIL, only a warning for WARN, and nothing for PASS."""

from __future__ import annotations

import pytest
import yaml

import plancc
from plancc.checks import RULES, rule_ids
from plancc.checks.example import Example
from plancc.models import load_config

from .conftest import PLANS

CASES = [(rule, example) for rule in RULES for example in rule.EXAMPLES]


def _plan_text(example: Example) -> str:
    data = yaml.safe_load((PLANS / example.plan).read_text())
    for section, key, value in example.edits:
        if key is None and value is not None:
            data[section] = value
        elif key is None:
            data.pop(section)
        elif value is None:
            data[section].pop(key)
        else:
            data.setdefault(section, {})[key] = value
    return yaml.safe_dump(data, sort_keys=False)


@pytest.mark.parametrize("rule,example", CASES,
                         ids=[f"{rule.__name__.rpartition('.')[2]}-{i}" for i, (rule, _) in enumerate(CASES)])
def test_rule_example_holds(rule, example, tmp_path):
    path = tmp_path / example.plan
    path.write_text(_plan_text(example))
    config = load_config(example.model)
    for key, value in example.config.items():
        setattr(config, key, value)
    found = [d for d in plancc.check_plan(plancc.load_plan(path), config, **example.args)
             if d.rule in rule_ids(rule)]
    errors = [d for d in found if d.is_error]
    if example.verdict == "PASS":
        assert found == [], example.text
    elif example.verdict == "WARN":
        assert found and not errors, example.text
    else:
        assert errors, example.text


def test_every_rule_shows_a_passing_and_a_failing_example(cli):
    for rule in RULES:
        verdicts = {e.verdict for e in rule.EXAMPLES}
        assert "PASS" in verdicts and verdicts & {"FAIL", "WARN"}, rule.__name__
    code, out, _ = cli("rules")
    assert code == 0
    for rule in RULES:
        for example in rule.EXAMPLES:
            assert example.render() in out
