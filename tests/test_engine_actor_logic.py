"""Pure logic of the EngineActor's outbox (no actor system)."""

from omni_actors.actors.engine import coalesce_deltas
from omni_actors.messages import StageDelta, TaskFinished


def test_consecutive_deltas_of_one_task_merge_in_order():
    items = [("ra", StageDelta("r1", 0, " a")), ("ra", StageDelta("r1", 0, " b")),
             ("ra", StageDelta("r1", 0, " c"))]
    assert coalesce_deltas(items) == [("ra", StageDelta("r1", 0, " a b c"))]


def test_deltas_of_other_requests_or_targets_stay_apart():
    items = [("ra1", StageDelta("r1", 0, " a")), ("ra2", StageDelta("r2", 0, " x")),
             ("ra1", StageDelta("r1", 0, " b")), ("pool", TaskFinished("t/0", "r1", 0, True)),
             ("ra1", StageDelta("r1", 0, " c")), ("ra1", StageDelta("r1", 0, " d"))]
    out = coalesce_deltas(items)
    assert [m.text if isinstance(m, StageDelta) else "finished" for _, m in out] == [
        " a", " x", " b", "finished", " c d"]
