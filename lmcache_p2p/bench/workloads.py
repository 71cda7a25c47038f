"""What ``bench serve`` sends: vLLM's own datasets, the client arguments for each, the ideal hit rate.

    prefix   vLLM's ``prefix_repetition``: N prefixes of P tokens, each with suffixes of S tokens
    trace    a Mooncake-format trace (``timed_trace``): a window of rows rewritten to fit the model
             (each hash id becomes one 256-token chunk, at most ``max_chunks`` of them; outputs capped),
             timestamps replayed at a speed-up factor
    random   vLLM's ``random``: prompts sharing nothing (the no-reuse control)
    mix      short and long prompts in a ratio (``mix``, short:long), replayed as a timed trace at Poisson
             arrivals: a short prompt is ``short_len`` tokens of its own; a long one is one of N prefixes
             of P tokens (P a whole number of chunks) then S tokens of its own. Only the prefixes can ever
             be hit: every other chunk a node saves pollutes its pool (the admission measurement)

Every run of a sweep gets its own prompts (``--seed`` / ``PYTHONHASHSEED``: the trace's expansion uses
Python's ``hash()``), so a run never hits what an earlier rate left cached; systems at the same rate get
the same prompts. The ideal hit rate is that of one LRU cache of the fleet's total capacity in chunks:
for the trace computed from its hash ids (a request hits the longest run of leading ids held), for
``prefix`` the prefixes' repeats, for ``random`` zero.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK_TOKENS = 256
MAX_MODEL_LEN = 8192  # the engines' (testing/vllm_server.py)
KINDS = ("prefix", "trace", "random", "mix")


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str  # prefix | trace | random
    num_prompts: int
    output_len: int
    prefix_len: int = 2048
    suffix_len: int = 64
    num_prefixes: int = 8
    input_len: int = 2048  # random
    trace: Path | None = None
    trace_start: int = 0
    max_chunks: int = 24
    mix: tuple[int, int] = (1, 1)  # mix: short prompts to long ones
    short_len: int = 24  # mix: tokens of a short prompt

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload: unknown kind {self.kind!r} ({', '.join(KINDS)})")
        if self.kind == "trace" and self.trace is None:
            raise ValueError("trace: a Mooncake-format JSONL file is needed (--trace PATH)")
        if self.num_prompts <= 0 or self.output_len <= 0:
            raise ValueError("num_prompts and output_len must be > 0")
        if self.kind == "mix":
            self._check_mix()
        longest = {"prefix": self.prefix_len + self.suffix_len + 1, "random": self.input_len,
                   "trace": self.max_chunks * CHUNK_TOKENS, "mix": self.prefix_len + self.suffix_len}[self.kind]
        if longest + self.output_len > MAX_MODEL_LEN:
            raise ValueError(f"{self.kind}: prompts of up to {longest} tokens and {self.output_len} output tokens "
                             f"exceed the engines' max_model_len {MAX_MODEL_LEN}")
        if self.kind == "prefix" and self.num_prompts < self.num_prefixes:
            raise ValueError(f"num_prompts ({self.num_prompts}) must be >= num_prefixes ({self.num_prefixes})")

    def _check_mix(self) -> None:
        short, long = self.mix
        if short < 0 or long < 0 or short + long == 0:
            raise ValueError(f"mix: short:long must be counts, not both 0 (got {short}:{long})")
        if not 0 < self.short_len < CHUNK_TOKENS:
            raise ValueError(f"mix: short_len must be 1..{CHUNK_TOKENS - 1} tokens (a partial chunk)")
        if self.prefix_len <= 0 or self.prefix_len % CHUNK_TOKENS or self.suffix_len <= 0:
            raise ValueError(f"mix: prefix_len must be a positive multiple of {CHUNK_TOKENS} and suffix_len > 0")

    @property
    def shared_chunks(self) -> int:
        """mix: the chunks any prompt can hit (the long prompts' prefixes); 0 for the other kinds."""
        return self.num_prefixes * self.prefix_len // CHUNK_TOKENS if self.kind == "mix" else 0

    def mix_rows(self, run: int) -> list[dict[str, Any]]:
        """mix: ``num_prompts`` trace rows, short and long in the ratio ``mix`` (shuffled), Poisson
        arrivals of 1 per second (timestamps in ms); hash ids: 0.. for the prefixes' chunks, unique
        ones above for everything of a prompt's own."""
        rng = random.Random(run)
        short, long = self.mix
        kinds = ["short" if i % (short + long) < short else "long" for i in range(self.num_prompts)]
        rng.shuffle(kinds)
        per = self.prefix_len // CHUNK_TOKENS
        own = iter(range(self.shared_chunks, 10**9))
        rows, t, longs = [], 0.0, 0
        for kind in kinds:
            if kind == "short":
                ids, length = [next(own)], self.short_len
            else:
                first = (longs % self.num_prefixes) * per
                longs += 1
                ids = list(range(first, first + per)) + [next(own) for _ in range(-(-self.suffix_len // CHUNK_TOKENS))]
                length = self.prefix_len + self.suffix_len
            rows.append({"timestamp": round(t, 3), "input_length": length, "output_length": self.output_len,
                         "hash_ids": ids})
            t += rng.expovariate(1.0) * 1000
        return rows

    def client_args(self, rate: float, run: int, work: Path) -> tuple[list[str], dict[str, str]]:
        """vLLM bench serve arguments for one run at ``rate`` (requests/s; the trace: its speed-up), and
        the client's environment."""
        env = {"PYTHONHASHSEED": str(run)}
        if self.kind == "prefix":
            return ["--dataset-name", "prefix_repetition", "--seed", str(run), "--num-prompts", str(self.num_prompts),
                    "--prefix-repetition-prefix-len", str(self.prefix_len),
                    "--prefix-repetition-suffix-len", str(self.suffix_len),
                    "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                    "--prefix-repetition-output-len", str(self.output_len), "--ignore-eos",
                    "--request-rate", f"{rate:g}"], env
        if self.kind == "random":
            return ["--dataset-name", "random", "--seed", str(run), "--num-prompts", str(self.num_prompts),
                    "--random-input-len", str(self.input_len), "--random-output-len", str(self.output_len),
                    "--random-range-ratio", "0", "--request-rate", f"{rate:g}"], env
        path = self.trace_window(work, run)
        return ["--dataset-name", "timed_trace", "--dataset-path", str(path), "--num-prompts", str(self.num_prompts),
                "--timed-trace-chunk-hash-size", str(CHUNK_TOKENS),
                "--timed-trace-sec-multiplier", f"{0.001 / rate:g}"], env

    def trace_rows(self) -> list[dict[str, Any]]:
        """The window of the trace replayed: ``num_prompts`` rows from ``trace_start``, rewritten."""
        assert self.trace is not None
        rows: list[dict[str, Any]] = []
        with open(self.trace) as f:
            for i, line in enumerate(f):
                if i < self.trace_start:
                    continue
                if len(rows) == self.num_prompts:
                    break
                row = json.loads(line)
                if row.get("hash_ids"):  # a row without ids would be an empty prompt
                    rows.append(row)
        if len(rows) < self.num_prompts:
            raise ValueError(f"trace: {self.trace} has {len(rows)} rows from row {self.trace_start}, "
                             f"{self.num_prompts} asked for")
        t0 = float(rows[0]["timestamp"])
        out = []
        for row in rows:
            ids = list(row["hash_ids"])[: self.max_chunks]
            out.append({"timestamp": float(row["timestamp"]) - t0,
                        "input_length": len(ids) * CHUNK_TOKENS,
                        "output_length": max(1, min(int(row["output_length"]), self.output_len)),
                        "hash_ids": ids})
        return out

    def trace_window(self, work: Path, run: int = 0) -> Path:
        """The rewritten window (mix: the run's rows), written anew for each run (a kept work dir may hold
        another's)."""
        path = work / "trace-window.jsonl"
        rows = self.mix_rows(run) if self.kind == "mix" else self.trace_rows()
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    def ideal_hit_rate(self, capacity_chunks: int) -> float:
        """Prompt tokens one LRU cache of ``capacity_chunks`` chunks could have served, over all prompt tokens."""
        if self.kind == "random":
            return 0.0
        if self.kind == "prefix":  # every prefix held once computed, as long as they all fit
            count = self.num_prefixes * (self.num_prompts // self.num_prefixes)
            held = min(1.0, capacity_chunks * CHUNK_TOKENS / (self.num_prefixes * self.prefix_len))
            hits = (count - self.num_prefixes) * self.prefix_len * held
            return round(hits / (count * (self.prefix_len + self.suffix_len)), 4)
        cache: OrderedDict[int, None] = OrderedDict()
        hit = total = 0
        for row in self.mix_rows(0) if self.kind == "mix" else self.trace_rows():
            ids = list(row["hash_ids"])
            total += min(len(ids) * CHUNK_TOKENS, int(row["input_length"]))
            for i, h in enumerate(ids):
                if h not in cache:
                    break
                hit += min(CHUNK_TOKENS, int(row["input_length"]) - i * CHUNK_TOKENS)
            for h in ids:
                cache[h] = None
                cache.move_to_end(h)
            while len(cache) > capacity_chunks:
                cache.popitem(last=False)
        return round(hit / total, 4) if total else 0.0
