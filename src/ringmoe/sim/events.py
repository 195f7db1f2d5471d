"""A discrete-event schedule over per-rank resources (compute streams and link queues).

Each task needs one or more resources (a rank's compute, its outgoing link, a
rank's incoming link) for a duration, and may depend on earlier tasks.  Tasks
are queued on their resources in the order they are added (the order the
implementation issues them); a task starts when every dependency has finished
and every resource it needs is free.  Overlap of transfers with compute, and
ranks waiting for stragglers, come out of the schedule rather than a formula.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

__all__ = ["Task", "Timeline"]


@dataclass(frozen=True)
class Task:
    name: str
    kind: str          # "compute" | "transfer"
    rank: int          # the rank the task is charged to (the sender, for transfers)
    resources: tuple
    start: float
    end: float
    nbytes: float = 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    def __init__(self):
        self.free: dict = defaultdict(float)
        self.tasks: list[Task] = []

    def add(self, name: str, kind: str, rank: int, resources: tuple, duration: float, after=(), nbytes: float = 0.0,
            not_before: float = 0.0) -> Task:
        if duration < 0:
            raise ValueError(f"task {name} has a negative duration {duration}")
        start = max([not_before] + [t.end for t in after if t is not None] + [self.free[r] for r in resources])
        task = Task(name, kind, rank, tuple(resources), start, start + duration, nbytes)
        for r in resources:
            self.free[r] = task.end
        self.tasks.append(task)
        return task

    def end(self) -> float:
        return max((t.end for t in self.tasks), default=0.0)

    def busy(self, kind: str, rank: int, prefix: str = "") -> float:
        return sum(t.duration for t in self.tasks if t.kind == kind and t.rank == rank and t.name.startswith(prefix))

    def idle_between(self, tasks: list[Task]) -> float:
        """Gaps between consecutive tasks of one resource (time it waited)."""
        ordered = sorted(tasks, key=lambda t: t.start)
        return sum(max(0.0, b.start - a.end) for a, b in zip(ordered, ordered[1:]))
