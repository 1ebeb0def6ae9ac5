"""The checks at a layout given by sizes, with why the sizes do not fit as ``mesh-sizes``
diagnostics beside the other rules' problems: the path ``plancc validate --tp ...`` takes
(``Layout.diagnose``, then ``checks.rule_runner.check_at``)."""

from plancc import Layout
from plancc.checks.rule_runner import check_at


def check_at_sizes(plan, model_or_config, *, seq_len=None, **sizes):
    layout, problems = Layout.diagnose(loc=plan.loc, **sizes)
    return check_at(plan, model_or_config, layout, problems, seq_len=seq_len)
