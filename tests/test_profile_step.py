"""scripts/profile_step.py's op table (--by-op): each torch op's own time, with the source line that launched it."""
import torch
from torch.profiler import ProfilerActivity, profile

import profile_step


def _scaled(x):
    return x * 3.0


def _product(x):
    return x @ x


def test_op_table_names_the_line_that_ran_each_op(capsys):
    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True) as prof:
        for _ in range(4):
            _product(x)
            _scaled(x)
    rows = profile_step.op_table(prof, 4, 10, own="self_cpu_time_total")
    by_op = {r["op"]: r for r in rows}
    assert "_product" in by_op["aten::mm"]["source"] and "test_profile_step.py" in by_op["aten::mm"]["source"]
    assert "_scaled" in by_op["aten::mul"]["source"]
    assert by_op["aten::mm"]["calls_per_step"] == 1.0
    assert by_op["aten::mm"]["shapes"] == "[256, 256] [256, 256]"
    assert rows == sorted(rows, key=lambda r: -r["us_per_step"])
    assert "aten::mm" in capsys.readouterr().out


def test_op_frame_falls_back_to_the_outer_op():
    class Event:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent, self.stack = name, parent, []

    inner = Event("aten::copy_", Event("aten::_to_copy", Event("aten::to", Event("torch/nn/modules/x.py(3): f"))))
    assert profile_step.op_frame(inner) == "under aten::to"
    assert profile_step.op_frame(Event("aten::mm")) == "-"
