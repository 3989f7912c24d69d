"""A model and its optimizer held in registers (Registers(model=net), the pattern docs/driver.md recommends)
save to a state file: their states go into the objects the rebuilt program's registers hold."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import flowvm
from flowvm import CALL, REPEAT, Registers
from flowvm.testing import digest
import toy

PROGRAM = textwrap.dedent('''
    import torch
    from flowvm import CALL, REPEAT, Registers

    def step(model, opt, x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        reg = Registers(model=net, opt=opt, x=torch.randn(16, 3), y=torch.randn(16, 1), loss=0.0)
        return REPEAT(20, CALL(step, reg('model'), reg('opt'), reg('x'), reg('y'), store_to=reg('loss')))
''')


def test_a_model_and_optimizer_in_registers_resume_exactly_from_a_state_file(tmp_path):
    (tmp_path / "regmodel.py").write_text(PROGRAM)
    ckpt = tmp_path / "st.safetensors"
    toy.flowvm_cmd("run", tmp_path / "regmodel.py", "--checkpoint", ckpt, "--max-steps", "5", cwd=tmp_path)
    toy.flowvm_cmd("resume", ckpt, cwd=tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        import regmodel

        reference = regmodel.build().start()
        reference.run()
        resumed = flowvm.load_state(ckpt, regmodel.build())
    finally:
        sys.path.remove(str(tmp_path))
    assert resumed.done
    for name in ("model", "opt"):
        assert digest(resumed.registers[name].state_dict()) == digest(reference.registers[name].state_dict())
    # the optimizer's state refers to the rebuilt model's own parameters
    assert resumed.registers["opt"].param_groups[0]["params"][0] is next(resumed.registers["model"].parameters())


def _fit(x):
    torch.manual_seed(1)
    return torch.nn.Linear(x.shape[1], 1)


def test_a_model_the_run_made_in_a_register_is_named_at_load(tmp_path):
    def build():
        reg = Registers(x=torch.zeros(4, 3), model=None)
        return REPEAT(2, CALL(_fit, reg("x"), store_to=reg("model")))

    drv = build().start()
    drv.run(max_steps=1)
    flowvm.save_state(drv, tmp_path / "s.safetensors")
    with pytest.raises(flowvm.CheckpointError, match="registers/model: the saved run has a Linear here; the rebuilt "
                                                     "program has nothing to restore it into"):
        flowvm.load_state(tmp_path / "s.safetensors", build())
