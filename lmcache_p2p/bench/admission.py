"""Admission in ``bench serve --workload mix``: the mesh with and without it, in the same run.

The mesh system runs once per admission setting, each a fresh fleet on the same prompts:

    mesh                      nothing gated (tiers.min_save_tokens 0, tiers.save_after_sightings 1)
    mesh+min<T>               tiers.min_save_tokens T
    mesh+min<T>+seen<N>       and tiers.save_after_sightings N

Per run, beside the hit rate: ``pool_chunks``, the distinct chunks the run added to the mesh (the index
mirror's count, after every agent published); ``unhittable_chunks``, those beyond the workload's shared
prefix chunks (in the mix only the long prompts' prefixes recur: a short prompt's chunk, a long one's
own suffix or a finished tail is never hit); ``pollution``, their share of ``pool_chunks``. It is exact
when every prefix chunk was saved in the run (each prefix recurring more often than ``N`` times per
engine) and a lower bound otherwise.
"""

from __future__ import annotations

from typing import Any

from .workloads import Workload

MESH = "mesh"


def variants(min_tokens: int, sightings: int) -> list[tuple[str, dict[str, int]]]:
    """(system label, ``tiers`` settings) for each admission setting measured, nothing gated first."""
    out = [(MESH, {"min_save_tokens": 0, "save_after_sightings": 1})]
    if min_tokens > 0:
        out.append((f"{MESH}+min{min_tokens}", {"min_save_tokens": min_tokens, "save_after_sightings": 1}))
    if sightings > 1:
        label = f"{MESH}+min{min_tokens}+seen{sightings}" if min_tokens > 0 else f"{MESH}+seen{sightings}"
        out.append((label, {"min_save_tokens": min_tokens, "save_after_sightings": sightings}))
    return out


def pool_row(workload: Workload, before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """A run's pool figures from the agents' counters before and after it (``Fleet.counters``)."""
    added = int(after.get("index_chunks", 0.0) - before.get("index_chunks", 0.0))
    stored = int(after.get("stored_chunks", 0.0) - before.get("stored_chunks", 0.0))
    unhittable = max(0, added - workload.shared_chunks)
    return {"pool_chunks": added, "stored_chunks": stored, "unhittable_chunks": unhittable,
            "pollution": round(unhittable / added, 4) if added else 0.0}


def ratios(systems: dict[str, Any]) -> dict[str, dict[str, list[float | None]]]:
    """Each gated variant's hit rate and pollution over the ungated mesh's, rate by rate."""
    base = systems.get(MESH)
    if not isinstance(base, dict):
        return {}
    out: dict[str, dict[str, list[float | None]]] = {}
    for name, res in systems.items():
        if name == MESH or not name.startswith(MESH + "+") or not isinstance(res, dict):
            continue
        out[name] = {key: [_ratio(r.get(key), b.get(key)) for r, b in zip(res["rows"], base["rows"], strict=True)]
                     for key in ("hit_rate", "pollution", "pool_chunks")}
    return out


def _ratio(ours: float | None, base: float | None) -> float | None:
    if ours is None or not base:
        return None
    return round(ours / base, 3)
