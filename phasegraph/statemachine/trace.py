"""Transition traces: what ran, when, on how big a batch; exportable as Chrome-trace JSON.

A :class:`Trace` is attached to machines (``Machine(trace=...)``) or registered globally with
:func:`add_listener` (the pytest plugin's ``phase_trace`` fixture does this). Recording is an
append of a small tuple; summaries are computed only when asked.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import attrs


@attrs.frozen
class Transition:
    machine: str
    source: str | None  # phase the machine was in (None = before its first phase)
    target: str  # phase that ran
    start_ns: int  # time.perf_counter_ns() when the phase started
    end_ns: int
    batch_size: int | None
    schema: str  # output schema name (plus dims when the machine validated them)
    note: str = ""  # what the caller said about this run (e.g. the speculation shape it ran)
    # seconds of the phase spent in collectives (tensor-parallel all-reduces) on this process's
    # rank, by the trace's collective clock; None where the trace has none
    collective_s: float | None = None
    graph: str = ""  # the name of the machine's phase graph

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) * 1e-9


Listener = Callable[[Transition], None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    """Receive every transition of every machine in this process."""
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def _notify(t: Transition) -> None:
    for listener in tuple(_listeners):
        listener(t)


def has_listeners() -> bool:
    return bool(_listeners)


@attrs.frozen
class EdgeStats:
    count: int
    mean_s: float
    total_s: float


class Trace:
    """An ordered record of transitions, with queries and exporters.

    ``collective_clock``: seconds spent in collectives so far (cumulative, e.g. a tensor-parallel
    group's all-reduces); a machine records its increase over each phase as the transition's
    ``collective_s``. None: not measured."""

    def __init__(self, transitions: Iterable[Transition] = (),
                 collective_clock: Callable[[], float] | None = None):
        self.transitions: list[Transition] = list(transitions)
        self.collective_clock = collective_clock
        self._t0 = time.perf_counter_ns()

    def record(self, t: Transition) -> None:
        self.transitions.append(t)

    __call__ = record

    def clear(self) -> None:
        self.transitions.clear()

    def __len__(self) -> int:
        return len(self.transitions)

    def __iter__(self) -> Iterator[Transition]:
        return iter(self.transitions)

    # -- queries
    def phases(self, machine: str | None = None) -> list[str]:
        return [t.target for t in self.transitions if machine is None or t.machine == machine]

    def edges(self) -> list[tuple[str | None, str]]:
        return [(t.source, t.target) for t in self.transitions]

    def edge_stats(self) -> dict[tuple[str | None, str], EdgeStats]:
        """Visit count and mean time (of the target phase) for every edge taken."""
        acc: dict[tuple[str | None, str], list[float]] = defaultdict(list)
        for t in self.transitions:
            acc[(t.source, t.target)].append(t.seconds)
        return {
            e: EdgeStats(len(v), sum(v) / len(v), sum(v)) for e, v in acc.items()
        }

    def phase_time(self) -> dict[str, float]:
        """Total seconds spent in each phase."""
        out: dict[str, float] = defaultdict(float)
        for t in self.transitions:
            out[t.target] += t.seconds
        return dict(out)

    def collective_mean(self, phase: str) -> float | None:
        """Mean seconds a run of ``phase`` spent in collectives, over its measured runs (None:
        none measured)."""
        measured = [t.collective_s for t in self.transitions if t.target == phase and t.collective_s is not None]
        return sum(measured) / len(measured) if measured else None

    def notes(self, phase: str) -> list[tuple[str, int]]:
        """The notes of ``phase``'s runs in order, consecutive equal notes as one (note, count):
        e.g. which speculation shape ran when."""
        runs: list[tuple[str, int]] = []
        for t in self.transitions:
            if t.target != phase or not t.note:
                continue
            if runs and runs[-1][0] == t.note:
                runs[-1] = (t.note, runs[-1][1] + 1)
            else:
                runs.append((t.note, 1))
        return runs

    def always_followed_by(self, phase: str, successor: str) -> bool:
        """True when, per machine, every run of ``phase`` was directly followed by ``successor``
        (a trailing ``phase`` with nothing after it counts as not followed)."""
        last: dict[str, str] = {}
        for t in self.transitions:
            prev = last.get(t.machine)
            if prev == phase and t.target != successor:
                return False
            last[t.machine] = t.target
        return all(v != phase for v in last.values())

    # -- export
    def to_chrome(self) -> dict:
        """Chrome-trace (``chrome://tracing``, Perfetto) JSON object: one complete event per phase."""
        events = []
        tids: dict[str, int] = {}
        for t in self.transitions:
            tid = tids.setdefault(t.machine, len(tids) + 1)
            events.append(
                {
                    "name": t.target,
                    "cat": "phase",
                    "ph": "X",
                    "ts": (t.start_ns - self._t0) / 1000.0,
                    "dur": max((t.end_ns - t.start_ns) / 1000.0, 0.001),
                    "pid": os.getpid(),
                    "tid": tid,
                    "args": {
                        "from": t.source,
                        "batch_size": t.batch_size,
                        "schema": t.schema,
                        "machine": t.machine,
                        **({"note": t.note} if t.note else {}),
                        **({"collective_s": t.collective_s} if t.collective_s is not None else {}),
                    },
                }
            )
        meta = [
            {"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid, "args": {"name": m}}
            for m, tid in tids.items()
        ]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms", "phasegraph": 1}

    def save_chrome(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome()))
        return path

    @classmethod
    def load_chrome(cls, path: str | os.PathLike) -> Trace:
        """Read a trace written by :meth:`save_chrome` (for overlays on the drawn graph)."""
        from phasegraph.statemachine.errors import PhaseGraphError, one_line

        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict) or not isinstance(data.get("traceEvents", []), list):
                raise ValueError("expected an object whose 'traceEvents' is a list")
            events = data["traceEvents"]
            transitions = [
                _transition_of_event(i, e)
                for i, e in enumerate(events)
                if not isinstance(e, dict) or e.get("ph") == "X"
            ]
        except FileNotFoundError:
            raise PhaseGraphError(f"trace file {str(path)!r} does not exist") from None
        except IsADirectoryError:
            raise PhaseGraphError(f"trace file {str(path)!r} is a directory, not a file") from None
        except RecursionError:
            raise PhaseGraphError(
                f"{str(path)!r} is not a phasegraph Chrome-trace JSON file (nested too deeply)"
            ) from None
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            why = one_line(f"missing key {exc}" if isinstance(exc, KeyError) else str(exc))
            raise PhaseGraphError(
                f"{str(path)!r} is not a phasegraph Chrome-trace JSON file ({why})"
            ) from None
        trace = cls(transitions)
        trace._t0 = 0
        return trace


# the largest |time| (µs) of a loaded event: its nanoseconds (µs * 1000) must be a finite float
MAX_TRACE_US = sys.float_info.max / 1000


def _number(e: dict, key: str, i: int) -> float:
    x = e[key]
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"event {i}: {key!r} must be a finite number, got {x!r}")
    return x


def _transition_of_event(i: int, e: object) -> Transition:
    """The transition a complete ("X") event written by :meth:`Trace.save_chrome` records;
    ``ValueError`` / ``KeyError`` naming what does not fit."""
    if not isinstance(e, dict):
        raise ValueError(f"event {i} is a {type(e).__name__}, not an object")
    args = e["args"]
    if not isinstance(args, dict):
        raise ValueError(f"event {i}: 'args' must be an object, got {type(args).__name__}")
    ts, dur = _number(e, "ts", i), _number(e, "dur", i)
    if dur < 0:
        raise ValueError(f"event {i}: 'dur' must be >= 0, got {dur!r}")
    if not (math.isfinite(ts * 1000) and math.isfinite((ts + dur) * 1000)):  # int(inf) below
        raise ValueError(f"event {i}: 'ts' {ts!r} + 'dur' {dur!r} is out of range (a trace's times, "
                         f"start and end, are within ±{MAX_TRACE_US:.3g} µs)")
    checks = (
        ("name", e["name"], (str,), False),
        ("args.from", args.get("from"), (str,), True),
        ("args.batch_size", args.get("batch_size"), (int,), True),
        ("args.schema", args.get("schema", ""), (str,), False),
        ("args.note", args.get("note", ""), (str,), False),
        ("args.collective_s", args.get("collective_s"), (int, float), True),
    )
    for label, x, types, optional in checks:
        if not (x is None and optional) and (isinstance(x, bool) or not isinstance(x, types)):
            kind = {(str,): "a string", (int,): "an integer"}.get(types, "a number")
            raise ValueError(f"event {i}: {label!r} must be {kind}{' or null' if optional else ''}, "
                             f"got {x!r}")
    collective = args.get("collective_s")
    if collective is not None and not (math.isfinite(collective) and collective >= 0):
        raise ValueError(f"event {i}: 'args.collective_s' must be a finite number >= 0, got {collective!r}")
    return Transition(
        machine=str(args.get("machine", e.get("tid"))),
        source=args.get("from"),
        target=e["name"],
        start_ns=int(ts * 1000),
        end_ns=int((ts + dur) * 1000),
        batch_size=args.get("batch_size"),
        schema=args.get("schema", ""),
        note=args.get("note", ""),
        collective_s=None if collective is None else float(collective),
    )
