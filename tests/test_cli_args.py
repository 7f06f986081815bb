"""Command-line values that used to be accepted although nothing sensible can come of them."""

from __future__ import annotations

import pytest

from uccl_ep_megatron import cli


@pytest.mark.parametrize("value", ["nan", "0", "-5", "inf", "soon"])
def test_train_timeout_must_be_a_positive_finite_number(capsys, value):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--timeout", value, "--iters", "1"])
    assert exc.value.code == 2
    assert "--timeout" in capsys.readouterr().err
