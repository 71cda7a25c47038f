"""``--plot DIR``: each plot function draws a PNG from a bench's result dict (the shapes the benches return;
no engine runs here)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from lmcache_p2p.bench import plot  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def rows(*figures: tuple[object, float, float, float]) -> list[dict[str, object]]:
    return [{"rate": rate, "ttft_p50_ms": p50, "ttft_p99_ms": p99, "hit_rate": hit} for rate, p50, p99, hit in figures]


SERVE = {  # bench serve: by system; a rate of "inf" is a string (strict JSON); a system that did not run
    "rates": [0.5, 2.0, "inf"], "ideal_hit_rate": 0.62,
    "systems": {"mesh": {"goodput_rps": 2.0, "rows": rows((0.5, 90.0, 300.0, 0.6), (2.0, 120.0, 900.0, 0.58),
                                                           ("inf", 400.0, 2500.0, 0.55))},
                "vllm": {"goodput_rps": 0.5, "rows": rows((0.5, 200.0, 700.0, 0.2), (2.0, 380.0, 2100.0, 0.2),
                                                           ("inf", 900.0, 5000.0, 0.19))},
                "lmcache": "not installed (run scripts/install_lmcache.sh)"},
}
ROUTE = {"rates": [0.5, 1.0], "ideal_hit_rate": 0.7,  # bench route: by routing mode
         "modes": {"round_robin": {"rows": rows((0.5, 150.0, 600.0, 0.4), (1.0, 210.0, 900.0, 0.41))},
                   "score_load": {"rows": rows((0.5, 80.0, 300.0, 0.66), (1.0, 95.0, 420.0, 0.65))}}}
MESH = {"mesh_hit_rate_single": 0.71, "mesh_hit_rate_no_handoff": 0.42, "mesh_hit_rate_handoff": 0.63,
        "no_handoff_vs_single": 0.592, "handoff_vs_single": 0.887}
BLEND = {  # bench blend --task continuation: each mode a k=v string
    "full_prefill": "ttft_ms=300.0 continuation_ppl=12.00",
    "blend f=0.15": "reused=0.8 ttft_ms=90.0 vs_full=3.33x vs_prefix_only=2.00x ppl=12.30 (+2.50%) "
                    "greedy_agree=0.940 max_dlogprob=0.400",
    "blend f=0.15 deviation": "reused=0.8 ttft_ms=95.0 vs_full=3.16x vs_prefix_only=1.89x ppl=12.10 (+0.83%) "
                              "greedy_agree=0.960 max_dlogprob=0.300",
    "blend f=0": "reused=0.9 ttft_ms=70.0 vs_full=4.29x vs_prefix_only=2.57x ppl=14.40 (+20.00%) "
                 "greedy_agree=0.700 max_dlogprob=2.100",
    "blend f=1": "reused=0.1 ttft_ms=280.0 vs_full=1.07x vs_prefix_only=0.64x ppl=12.00 (+0.00%) "
                 "greedy_agree=1.000 max_dlogprob=0.001",
    "prefix-only": "reused=0.2 ttft_ms=180.0 vs_full=1.67x vs_prefix_only=1.00x ppl=12.00 (+0.00%) "
                   "greedy_agree=1.000 max_dlogprob=0.001",
}
FACTS = {"full": {"accuracy": 0.9, "same_answer_as_full": 1.0},  # bench blend --task facts: dicts
         "blend f=0.15": {"accuracy": 0.85, "same_answer_as_full": 0.8},
         "blend f=0": {"accuracy": 0.5, "same_answer_as_full": 0.4},
         "blend f=1": {"accuracy": 0.9, "same_answer_as_full": 1.0},
         "prefix-only": {"accuracy": 0.9, "same_answer_as_full": 1.0}}


def drawn(path: Path) -> None:
    """A PNG with something drawn on it (not one flat colour)."""
    import matplotlib.image

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000, (path, len(data))
    pixels = matplotlib.image.imread(str(path))
    assert pixels.shape[0] > 200 and pixels.shape[1] > 300 and pixels.std() > 0.01, pixels.shape


@pytest.mark.parametrize(("draw", "result"), [
    (plot.ttft_by_rate, SERVE), (plot.ttft_by_rate, ROUTE),
    (plot.hit_rate_vs_ideal, SERVE), (plot.hit_rate_vs_ideal, ROUTE), (plot.hit_rate_vs_ideal, MESH),
    (plot.blend_quality, BLEND), (plot.blend_quality, FACTS),
])
def test_each_plot_writes_a_png_from_a_result(tmp_path: Path, draw, result) -> None:
    path = draw(result, tmp_path / "out" / "figure.png", "a title")
    assert path == tmp_path / "out" / "figure.png"  # its directory made
    drawn(path)


def test_blend_quality_reads_both_tasks_figures() -> None:
    assert plot._quality(BLEND["blend f=0"]) == {"greedy agreement with full": 0.7, "perplexity change (%)": 20.0}
    assert plot._quality(FACTS["blend f=0"]) == {"answers right": 0.5, "same answer as full": 0.4}


def test_a_result_without_blend_modes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="blend f="):
        plot.blend_quality({"prefix-only": "reused=0.2"}, tmp_path / "x.png", "t")
