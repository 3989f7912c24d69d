"""flowvm.optimize(program, explain=True) and `flowvm optimize --explain`: for each SEQ, which CALLs were fused
into one step and why the others were not."""

from __future__ import annotations

import torch

import flowvm
from flowvm import CALL, REPEAT, SEQ, WEAVE, Registers
from flowvm.passes.explain import explain_fusion
import toy


def loss_of(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)


def whole_step(net, opt, x, y):
    opt.zero_grad()
    loss = loss_of(net, x, y)
    loss.backward()
    opt.step()
    return loss.item()


def _parts():
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    reg = Registers(x=torch.ones(4, 3), y=torch.zeros(4, 1))
    return net, opt, reg


def test_each_call_of_a_seq_is_explained(capsys):
    net, opt, reg = _parts()
    prog = REPEAT(2, SEQ([
        CALL(opt.zero_grad),
        CALL(net, reg("x"), store_to=reg("out")),
        CALL(torch.nn.functional.mse_loss, reg("out"), reg("y"), store_to=reg("loss")),
        CALL(torch.Tensor.backward, reg("loss")),
        CALL(torch.Tensor.item, reg("loss"), store_to=reg("value")),
        CALL(loss_of, net, reg("x"), reg("y"), store_to=reg("other")),
        CALL(opt.step),
    ]))
    fast = flowvm.optimize(prog, explain=True)
    text = capsys.readouterr().out
    assert "FUSED 3 calls" in str(fast)
    lines = text.splitlines()
    assert lines[0] == "SEQ at 0: 1 fused step from 7 children"
    assert "0.0 SGD.zero_grad(): an optimizer's method" in lines[1]
    assert lines[2].startswith("  0.1 out = Linear(x): fused: calls 0.1 to 0.3 run as one step")
    assert "(the backward pass joins the step, eagerly)" in lines[4]
    assert "0.4 value = Tensor.item(loss): never fused: Tensor.item leaves torch's graph" in lines[5]
    assert "0.5 other = loss_of(Linear, x, y): a function of yours (loss_of): mark it @flowvm.fusable" in lines[6]
    assert text == explain_fusion(prog) + "\n"


def test_a_whole_step_in_one_call_and_a_seq_under_a_weave_say_why_nothing_fuses():
    net, opt, reg = _parts()
    text = explain_fusion(REPEAT(3, CALL(whole_step, net, opt, reg("x"), reg("y"), store_to=reg("loss"))))
    assert text.startswith("CALL at 0 loss = whole_step(") and ": a function of yours holding a whole step in one " \
        "CALL" in text and "Write the step as CALLs of torch modules" in text and len(text.splitlines()) == 1
    text = explain_fusion(WEAVE(1, [SEQ([CALL(net, reg("x"), store_to=reg("a")), CALL(torch.sin, reg("a"))]),
                                    REPEAT(2, CALL(toy.const, 1))]))
    assert "SEQ at 0: not fused: it runs under a WEAVE, whose schedule counts steps" in text


def test_the_command_prints_the_optimized_program_and_why(tmp_path):
    out = toy.flowvm_cmd("optimize", "mlp", "--explain")
    assert "# why (fuse-torch):" in out.stdout and "SEQ at 0.0.0.0: not fused: it runs under a WEAVE" in out.stdout
