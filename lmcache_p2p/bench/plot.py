"""``--plot DIR``: PNG figures of the benches that compare systems, drawn from their result dicts.

    ttft_by_rate        bench serve, bench route: TTFT p50 (solid) and p99 (dashed) by request rate, one
                        colour per system or routing mode
    hit_rate_vs_ideal   bench serve, bench route: the fleet's hit rate by rate against the ideal (one cache
                        of the fleet's capacity); bench mesh: the working set's hit rate of each mesh mode
                        against one agent holding the three pools' sum
    blend_quality       bench blend (continuation: greedy agreement with full prefill and the perplexity
                        change; facts: answers right and answers equal to full prefill's) by recompute
                        fraction, prefix-only and full prefill as lines

matplotlib is optional (the ``dev`` extra): :func:`require` says how to install it before a bench runs.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import progress

Draw = Callable[[dict[str, Any], Path, str], Path]


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plot", metavar="DIR", help="also write the comparison's figures (PNG) to DIR "
                        "(needs matplotlib)")


def write(bench: str, result: dict[str, Any], directory: str | None, figures: list[tuple[Draw, str, str]]) -> None:
    """Each of ``figures`` (draw, file stem, title) as ``DIR/<bench>-<stem>.png``; nothing without ``--plot``."""
    if directory is None:
        return
    for draw, stem, title in figures:
        path = draw(result, Path(directory) / f"{bench}-{stem}.png", f"bench {bench}: {title}")
        progress(bench, f"wrote {path}")


def require() -> None:
    """SystemExit with how to install matplotlib when it is missing (checked before a bench starts)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or the dev extra: "
                         "pip install -e '.[dev]')") from exc


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.2), dpi=110)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _groups(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Rows by system (bench serve) or routing mode (bench route); a system that did not run is left out."""
    found = result.get("systems") or result.get("modes") or {}
    return {name: res["rows"] for name, res in found.items() if isinstance(res, dict) and res.get("rows")}


def _rate_axis(result: dict[str, Any], ax: Any) -> dict[str, int]:
    """Rates as evenly spaced categories (``inf`` among them), labelled; position by the rate's text."""
    rates = [str(r) for r in result.get("rates", [])]
    ax.set_xticks(range(len(rates)), [r if r == "inf" else f"{float(r):g}" for r in rates])
    ax.set_xlabel("request rate (req/s)")
    return {r: i for i, r in enumerate(rates)}


def ttft_by_rate(result: dict[str, Any], path: Path, title: str) -> Path:
    fig, ax = _figure()
    at = _rate_axis(result, ax)
    for i, (name, rows) in enumerate(_groups(result).items()):
        xs = [at[str(r["rate"])] for r in rows]
        colour = f"C{i}"
        ax.plot(xs, [r["ttft_p50_ms"] for r in rows], "o-", color=colour, label=f"{name} p50")
        ax.plot(xs, [r["ttft_p99_ms"] for r in rows], "s--", color=colour, alpha=0.6, label=f"{name} p99")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def hit_rate_vs_ideal(result: dict[str, Any], path: Path, title: str) -> Path:
    fig, ax = _figure()
    if "mesh_hit_rate_single" in result:  # bench mesh: one value per mode
        modes = [k.removeprefix("mesh_hit_rate_") for k in result if k.startswith("mesh_hit_rate_")]
        ax.bar(range(len(modes)), [float(result[f"mesh_hit_rate_{m}"]) for m in modes],
               color=["C7" if m == "single" else "C0" for m in modes])
        ax.set_xticks(range(len(modes)), [("one agent, all pools (ideal)" if m == "single" else m) for m in modes])
        ax.set_ylabel("hit rate (chunks served from the mesh)")
    else:
        at = _rate_axis(result, ax)
        for i, (name, rows) in enumerate(_groups(result).items()):
            ax.plot([at[str(r["rate"])] for r in rows], [r["hit_rate"] for r in rows], "o-", color=f"C{i}",
                    label=name)
        ax.axhline(float(result["ideal_hit_rate"]), color="k", linestyle=":", label="ideal (one cache, same capacity)")
        ax.legend(fontsize=8)
        ax.set_ylabel("hit rate (prompt tokens not computed)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


_FRACTION = re.compile(r"^blend f=([0-9.]+)$")  # the first selection's modes (others carry a suffix)


def _quality(value: Any) -> dict[str, float]:
    """A blend mode's quality figures: the facts task's dict, or the continuation task's ``k=v`` string."""
    if isinstance(value, dict):
        return {"answers right": float(value["accuracy"]), "same answer as full": float(value["same_answer_as_full"])}
    text = str(value)
    agree = re.search(r"greedy_agree=([0-9.]+)", text)
    change = re.search(r"\(([+-][0-9.]+)%\)", text)
    out: dict[str, float] = {}
    if agree:
        out["greedy agreement with full"] = float(agree.group(1))
    if change:
        out["perplexity change (%)"] = float(change.group(1))
    return out


def blend_quality(result: dict[str, Any], path: Path, title: str) -> Path:
    points = sorted((float(m.group(1)), _quality(v)) for k, v in result.items() if (m := _FRACTION.match(k)))
    if not points:
        raise ValueError("blend_quality: the result has no 'blend f=...' modes")
    fig, ax = _figure()
    xs = [f for f, _ in points]
    names = sorted({name for _, q in points for name in q})
    second = ax.twinx() if "perplexity change (%)" in names else None
    for i, name in enumerate(names):
        axis = second if second is not None and name.startswith("perplexity") else ax
        axis.plot(xs, [q.get(name, float("nan")) for _, q in points], "o-", color=f"C{i}", label=name)
        flat = _quality(result.get("prefix-only", "")).get(name)
        if flat is not None:
            axis.axhline(flat, color=f"C{i}", linestyle=":", alpha=0.7, label=f"{name}, prefix-only")
    if isinstance(result.get("full"), dict):
        ax.axhline(float(result["full"]["accuracy"]), color="k", linestyle="--", label="answers right, full prefill")
    ax.set_xlabel("recompute fraction")
    ax.set_ylabel("share")
    handles, labels = ax.get_legend_handles_labels()
    if second is not None:
        second.set_ylabel("perplexity change vs full prefill (%)")
        more = second.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="center right", fontsize=8, framealpha=0.9)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)
