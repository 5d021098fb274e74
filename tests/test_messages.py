"""Messages format cheaply: Thespian calls ``str()`` on every message it sends
or receives (for its debug log, on or off), so ``str()`` must not walk the
fields (see :class:`omni_actors.messages.Message`, benchmarks/messages.py)."""

import dataclasses
import inspect

import numpy as np

from omni_actors import messages
from omni_actors.connectors import make_connector
from omni_actors.messages import Message, StageDone, StageTask


def test_every_message_class_has_the_short_str():
    classes = [c for _, c in inspect.getmembers(messages, inspect.isclass)
               if c.__module__ == messages.__name__ and dataclasses.is_dataclass(c)]
    assert len(classes) > 40
    plain = [c.__name__ for c in classes if not issubclass(c, Message)]
    assert plain == [], f"messages without the short str(): {plain}"
    overridden = [c.__name__ for c in classes if c.__str__ is not Message.__str__]
    assert overridden == []


def test_str_names_the_message_and_request_not_the_fields():
    ref = make_connector().put({"token_ids": np.arange(8, dtype=np.int32), "text": "hello " * 10})
    task = StageTask(request_id="req-1", stage_id=1, prompt="a long prompt " * 20, inputs=((0, ref),),
                     sampling_params={"max_tokens": 8}, params={}, final_output_type="audio",
                     needs_output=True, reply_to=None)
    assert str(task) == "StageTask(req-1)"
    assert str(StageDone(request_id="req-1", stage_id=1, replica="talker/0", output=ref, final=ref)) \
        == "StageDone(req-1)"
    assert str(messages.GetStatus()) == "GetStatus"
    # repr() still shows everything, for debugging
    assert "a long prompt" in repr(task) and "token_ids" in repr(task)
