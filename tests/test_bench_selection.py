"""``lmcache-p2p bench selection`` takes the modes (selection, fraction, lead-in) it is asked for."""

from __future__ import annotations

import pytest

from lmcache_p2p.bench import selection


def test_bench_selection_modes_name_a_selection_and_a_fraction(capsys) -> None:
    assert selection._mode("question-heads:0.35") == (0.35, "question-heads", None)
    assert selection._mode("deviation:1:self") == (1.0, "deviation", "self")
    for bad, why in (("heads:0.3", "the selection is one of"), ("deviation:x", "the fraction is a number"),
                     ("0.3", "the selection is one of"), ("deviation:0.3:sheet", "the lead-in is one of"),
                     ("deviation:0.3:self:self", "the lead-in is one of")):
        with pytest.raises(SystemExit):
            selection.main(["--modes", bad])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        selection.main(["--modes", "deviation:1.5"])
    assert "every fraction (--fractions, --modes) must be in [0, 1]" in capsys.readouterr().err
