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
        " a b", " x", "finished", " c d"]


class Address:
    """Like Thespian's ActorAddress: compared by value, and not hashable."""

    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, Address) and other.name == self.name

    __hash__ = None

    def __str__(self):
        return f"ActorAddr-{self.name}"


def test_deltas_merge_with_real_unhashable_addresses():
    ra = Address("ra")
    items = [(ra, StageDelta("r1", 0, " a")), (Address("ra"), StageDelta("r1", 0, " b"))]
    assert coalesce_deltas(items) == [(ra, StageDelta("r1", 0, " a b"))]


def test_interleaved_deltas_of_concurrent_requests_merge_per_request():
    items = [("ra1", StageDelta("r1", 0, " a")), ("ra2", StageDelta("r2", 0, " x")),
             ("ra1", StageDelta("r1", 0, " b")), ("ra2", StageDelta("r2", 0, " y"))]
    assert coalesce_deltas(items) == [("ra1", StageDelta("r1", 0, " a b")), ("ra2", StageDelta("r2", 0, " x y"))]


def test_text_never_moves_past_the_end_of_its_own_request():
    from omni_actors.messages import StageDone

    done = StageDone("r1", 0, "t/0", None, None)
    items = [("ra1", StageDelta("r1", 0, " a")), ("ra1", done), ("ra1", StageDelta("r1", 0, " late"))]
    assert coalesce_deltas(items) == items
