"""State checkpoints (flowvm.save_state / flowvm.load_state): exact resume in fresh processes from files that
hold no code, what the files hold, damaged, mismatched and crafted files, refusals and signatures."""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import flowvm
from flowvm import CALL, REPEAT, SEQ, WEAVE, CheckpointError, Registers
from flowvm.persist.state import read_state_header, structure
from flowvm.testing import diff, outcome, same

import state_programs as sp
from state_programs import rewrite
import toy

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent

# every bundled program, small: (module, options, whether step counts are fixed)
BUNDLED = {
    "pca": ("flowvm.programs.pca", dict(samples=60, batches=3), True),
    "kmeans": ("flowvm.programs.kmeans", dict(samples=300, restarts=2), True),
    "rbm": ("flowvm.programs.rbm", dict(samples=200, epochs=2), True),
    "mlp": ("flowvm.programs.mlp", dict(samples=600, epochs=2, hidden=16), True),
    "mlp_sgd": ("flowvm.programs.mlp", dict(samples=600, epochs=2, hidden=16, optimizer="sgd"), True),
    "lbfgs": ("flowvm.programs.lbfgs", dict(max_iter=40), True),
    "lbfgs_lsq": ("flowvm.programs.lbfgs", dict(problem="least_squares", max_iter=30), True),
    "event_loop_example": ("flowvm.programs.event_loop_example", dict(steps=60), True),
    "sweep": ("flowvm.programs.sweep", dict(trials=2, epochs=1, samples=300), False),
}


def straight(build, **options) -> dict:
    drv = build(**options).start()
    drv.run()
    return outcome(drv)


def problems(want: dict, got: dict, steps: bool = True) -> list:
    return diff(sp.comparable(want), sp.comparable(got), steps=steps)


def cut_and_save(build, options: dict, cut: int, path) -> None:
    drv = build(**options).start()
    drv.run(max_steps=cut)
    flowvm.save_state(drv, path)


def in_child(jobs: list, tmp_path, audit: bool = False, warm: dict | None = None) -> list:
    """Run state_child.py on jobs in a fresh interpreter; its results."""
    spec, out = tmp_path / "spec.json", tmp_path / "out.pickle"
    spec.write_text(json.dumps({"jobs": jobs, "audit": audit, "warm": warm}))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(TESTS), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(HERE / "state_child.py"), str(spec), str(out)], env=env,
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def _import(module: str):
    import importlib

    return importlib.import_module(module)


# ------------------------------------------------------------------ exact resume in a fresh process
def test_every_bundled_program_resumes_bit_for_bit_in_a_fresh_process(tmp_path):
    """Stop each bundled program at random steps, save_state, finish in a fresh process from build() and
    load_state: the registers, result and step count are those of the straight run, bit for bit."""
    jobs, expected = [], []
    rng = random.Random(20240611)
    for name, (module, options, fixed) in BUNDLED.items():
        build = _import(module).build
        want = straight(build, **options)
        cuts = [3] if name == "sweep" else sorted({rng.randint(1, want["steps"] - 1) for _ in range(2)})
        for cut in cuts:
            path = tmp_path / f"{name}-{cut}.safetensors"
            cut_and_save(build, options, cut, path)
            jobs.append({"file": str(path), "build": f"{module}:build", "options": options})
            expected.append((name, cut, want, fixed))
    results = in_child(jobs, tmp_path)
    for (name, cut, want, fixed), got in zip(expected, results):
        assert "error" not in got, f"{name} cut at {cut}: {got.get('trace')}"
        found = problems(want, got["outcome"], steps=fixed)
        assert not found, f"{name} resumed after step {cut}: " + "; ".join(found)


def test_generated_programs_with_every_kind_of_register_resume_bit_for_bit_in_a_fresh_process(tmp_path):
    jobs, expected = [], []
    for seed in range(8):
        want = straight(sp.build_random, seed=seed)
        cut = random.Random(seed).randint(0, want["steps"])
        path = tmp_path / f"gen-{seed}.safetensors"
        cut_and_save(sp.build_random, {"seed": seed}, cut, path)
        jobs.append({"file": str(path), "build": "state_programs:build_random", "options": {"seed": seed}})
        expected.append((seed, cut, want))
    for (seed, cut, want), got in zip(expected, in_child(jobs, tmp_path)):
        assert "error" not in got, got.get("trace")
        assert not problems(want, got["outcome"]), f"seed {seed} cut {cut}: {problems(want, got['outcome'])}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10 ** 6), where=st.floats(0, 1))
def test_generated_programs_resume_bit_for_bit(seed, where, tmp_path):
    want = straight(sp.build_random, seed=seed)
    cut = int(where * want["steps"])
    path = tmp_path / f"h{seed}.safetensors"
    cut_and_save(sp.build_random, {"seed": seed}, cut, path)
    toy.seed_all(12345)  # the process moves on: the loaded run sets its own random states
    drv = flowvm.load_state(path, sp.build_random(seed))
    assert drv.steps == cut
    drv.run()
    assert not problems(want, outcome(drv))


def test_every_kind_of_value_round_trips_exactly(tmp_path):
    reg = Registers(z=sp.zoo(3, cyclic=True))
    prog = SEQ([CALL(toy.const, reg("z"), store_to=reg("copy")), CALL(toy.const, 1)])
    drv = prog.start()
    drv.run(max_steps=1)
    flowvm.save_state(drv, tmp_path / "zoo.safetensors")
    a = drv.registers["z"]
    loaded = flowvm.load_state(tmp_path / "zoo.safetensors", SEQ([CALL(toy.const, (reg2 := Registers(z=0))("z"),
                                                                       store_to=reg2("copy")), CALL(toy.const, 1)]))
    b = loaded.registers["z"]
    assert loaded.registers["copy"] is b  # one object in two registers stays one
    assert b["log"] is b["alias"] and b["cyclic"][1] is b["cyclic"]
    for k in a:
        if k in ("cyclic", "gen", "py_random", "nan", "odd_nan"):
            continue
        assert same(a[k], b[k]), k
        assert type(a[k]) is type(b[k]), k
    assert math.isnan(b["nan"]) and b["odd_nan"].hex() == a["odd_nan"].hex() or \
        np.float64(b["odd_nan"]).tobytes() == np.float64(a["odd_nan"]).tobytes()
    assert math.copysign(1, b["-0"]) == -1 and b["big"] == 2 ** 70 + 3
    assert b["aF"].flags.f_contiguous and b["a_be"].dtype == np.dtype(">i4") and b["a_dates"].dtype == a["a_dates"].dtype
    assert type(b["param"]) is torch.nn.Parameter and torch.equal(b["param"].grad, a["param"].grad)
    assert b["t_bf16"].dtype == torch.bfloat16 and b["t_c128"].dtype == torch.complex128
    assert b["gen"].random() == a["gen"].random() and b["py_random"].random() == a["py_random"].random()
    assert list(b["keys"]) == list(a["keys"])


def test_a_file_is_read_by_safetensors_alone_and_its_tensors_are_the_registers(tmp_path):
    reg = Registers(w=torch.randn(3, 4), a=np.arange(6.0).reshape(2, 3), pair=(torch.ones(2), np.zeros(1)), n=3)
    drv = SEQ([CALL(toy.const, 1), CALL(toy.const, 2)]).start()
    drv.registers.update(reg)
    drv.run(max_steps=1)
    path = tmp_path / "run.safetensors"
    flowvm.save_state(drv, path)

    def strict(text):
        raise ValueError(f"not strict JSON: {text}")

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        parsed = {k: json.loads(v, parse_constant=strict) for k, v in meta.items() if k.startswith("flowvm.")
                  and k not in ("flowvm.sha256", "flowvm.xxh3", "flowvm.hmac")}
        assert torch.equal(f.get_tensor("registers/w"), reg["w"])
        assert np.array_equal(f.get_tensor("registers/a").numpy(), reg["a"])
        assert torch.equal(f.get_tensor("registers/pair/0"), reg["pair"][0])
    with safe_open(str(path), framework="np") as f:
        assert np.array_equal(f.get_tensor("registers/a"), reg["a"])
    assert parsed["flowvm.header"]["steps"] == 1 and parsed["flowvm.format"] == 3
    assert len(meta["flowvm.xxh3"]) == 32 and "flowvm.sha256" not in meta  # XXH3-128, unsigned
    assert dict(parsed["flowvm.registers"])["n"] == 3
    assert parsed["flowvm.program"]["elements"][0] == ["", "SEQ", 2]
    assert parsed["flowvm.tensors"]["registers/w"] == {"kind": "torch", "dtype": "float32", "shape": [3, 4]}
    assert dict(parsed["flowvm.registers"])["w"] == {"tensor": "registers/w", "device": "cpu"}


def _by_number(chain: list) -> None:
    """chain (frames as a state file saves them) with its slots by number, as formats 1 and 2 saved them."""
    from flowvm.machine.layouts import LAYOUTS

    kinds = {cls.__name__: layout.slots for cls, layout in LAYOUTS.items()}
    for fr in chain:
        slots = fr["slots"]
        listed = [slots[name] for name in kinds.get(fr["kind"], ()) if name in slots] + (
            [slots["failed"]] if "failed" in slots else [])
        if fr["kind"] == "WEAVE" and listed:
            for seg in listed[1]:
                if seg is not None:
                    _by_number(seg)
        fr["slots"] = listed


def _woven(seed: int):
    """A generated program (tests/progen.py) woven with a counter: frames of every kind, a WEAVE's paused ones."""
    program = sp.random_program(seed, 3)
    reg = sp.program_registers(program)
    reg["k"] = 0
    return WEAVE(-1, [program, REPEAT(5, CALL(lambda k: k + 1, reg("k"), store_to=reg("k")))], weights=[1, 0.5])


@pytest.mark.parametrize("seed", [3, 13, 14])
def test_frames_are_saved_by_slot_name_and_files_with_slots_by_number_still_load(tmp_path, seed):
    from flowvm.machine.layouts import LAYOUTS

    drv = _woven(seed).start()
    drv.run(max_steps=17)
    path = flowvm.save_state(drv, tmp_path / "named.safetensors")
    with safe_open(str(path), framework="np") as f:
        run = json.loads(f.metadata()["flowvm.run"])
    kinds = {cls.__name__: layout.slots for cls, layout in LAYOUTS.items()}
    frames = run["stack"]
    assert frames and frames[0]["kind"] == "WEAVE"
    for fr in frames:
        assert type(fr["slots"]) is dict
        assert not fr["slots"] or list(fr["slots"]) == list(kinds[fr["kind"]]), fr
    assert set(frames[0]["slots"]) == {"active", "segments", "finished", "values", "credits", "n_finished",
                                       "rotate_due"}

    def old_format(meta):
        run = json.loads(meta["flowvm.run"])
        _by_number(run["stack"])
        meta["flowvm.run"] = json.dumps(run)
        meta["flowvm.format"] = "2"

    old = rewrite(path, tmp_path / "numbered.safetensors", old_format)
    with safe_open(str(old), framework="np") as f:
        assert type(json.loads(f.metadata()["flowvm.run"])["stack"][0]["slots"]) is list
    finished = []
    for file in (path, old):
        later = flowvm.load_state(file, _woven(seed))
        later.run()
        finished.append(outcome(later))
    drv.run()
    assert not diff(outcome(drv), finished[0]) and not diff(outcome(drv), finished[1])


# ------------------------------------------------------------------ damaged, foreign, mismatched
def small_file(tmp_path, name="s.safetensors", **options) -> Path:
    from flowvm.programs import pca

    drv = pca.build(samples=20, batches=2).start()
    drv.run(max_steps=30)
    path = tmp_path / name
    flowvm.save_state(drv, path, **options)
    return path


def test_truncated_files_are_refused_with_the_reason(tmp_path):
    data = small_file(tmp_path).read_bytes()
    for n in (0, 4, 8, 9, 100, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.safetensors").write_bytes(data[:n])
        with pytest.raises(CheckpointError) as err:
            read_state_header(tmp_path / "cut.safetensors")
        assert err.value.reason.startswith(("truncated", "empty file")), err.value.reason


def test_every_flipped_bit_is_refused(tmp_path):
    from flowvm.programs import pca

    data = small_file(tmp_path).read_bytes()
    rng = random.Random(7)
    positions = sorted(set(range(0, len(data), 11)) | {rng.randrange(len(data)) for _ in range(200)}
                       | set(range(len(data) - 1200, len(data))))  # the tensors' bytes end the file
    reasons = set()
    for i in positions:
        damaged = bytearray(data)
        damaged[i] ^= 1 << rng.randrange(8)
        (tmp_path / "bad.safetensors").write_bytes(damaged)
        with pytest.raises(CheckpointError) as err:
            flowvm.load_state(tmp_path / "bad.safetensors", pca.build(samples=20, batches=2))
        reasons.add(err.value.reason.split(" (")[0][:40])
    assert "corrupted: checksum mismatch" in reasons


def test_foreign_and_newer_files_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="not a flowvm state checkpoint"):
        read_state_header(tmp_path / "model.safetensors")
    drv = REPEAT(3, CALL(toy.inc, Registers(x=0)("x"))).start()
    flowvm.save(drv, tmp_path / "pickle.safetensors")
    with pytest.raises(CheckpointError, match="not a safetensors file flowvm reads"):
        read_state_header(tmp_path / "pickle.safetensors")
    newer = rewrite(small_file(tmp_path), tmp_path / "newer.safetensors", lambda m: m.update({"flowvm.format": "9"}))
    with pytest.raises(CheckpointError, match="upgrade flowvm"):
        read_state_header(newer)


@pytest.mark.parametrize("change, where", [
    (lambda: SEQ([REPEAT(2, SEQ([CALL(toy.inc, 1)]))]), "'<root>'"),  # another kind at the root
    (lambda: sp.build_constant(n=8).with_children([SEQ([CALL(sp.add, Registers(total=0)("total"), 1)])]), "'0'"),
])
def test_a_program_of_another_structure_is_refused_naming_the_first_difference(tmp_path, change, where):
    drv = sp.build_constant().start()
    drv.run(max_steps=3)
    flowvm.save_state(drv, tmp_path / "c.safetensors")
    with pytest.raises(CheckpointError, match=f"differs from the saved run's at path {where}"):
        flowvm.load_state(tmp_path / "c.safetensors", change())


def test_another_number_of_children_or_other_registers_are_refused(tmp_path):
    reg = Registers(x=0)
    drv = SEQ([CALL(toy.inc, reg("x"), store_to=reg("x")), REPEAT(3, CALL(toy.inc, reg("x"), store_to=reg("x")))]).start()
    drv.run(max_steps=2)
    flowvm.save_state(drv, tmp_path / "s.safetensors")
    r2 = Registers(x=0)
    with pytest.raises(CheckpointError, match=r"at path '<root>': the saved run has a SEQ with 2 children there, "
                                              r"this program a SEQ with 3"):
        flowvm.load_state(tmp_path / "s.safetensors", SEQ([CALL(toy.inc, r2("x")), CALL(toy.inc, r2("x")),
                                                           REPEAT(3, CALL(toy.inc, r2("x")))]))
    r3 = Registers(y=0)
    with pytest.raises(CheckpointError, match=r"other registers.*'x', which it does not.*'y'"):
        flowvm.load_state(tmp_path / "s.safetensors", SEQ([CALL(toy.inc, r3("y"), store_to=r3("y")),
                                                           REPEAT(3, CALL(toy.inc, r3("y"), store_to=r3("y")))]))


def test_changed_constants_load_and_take_effect(tmp_path):
    drv = sp.build_constant(step=0.5).start()
    drv.run(max_steps=3)
    flowvm.save_state(drv, tmp_path / "c.safetensors")
    resumed = flowvm.load_state(tmp_path / "c.safetensors", sp.build_constant(step=2.0))
    resumed.run()
    assert resumed.registers["total"] == 3 * 0.5 + 5 * 2.0


# ------------------------------------------------------------------ crafted files run nothing
def payloads(marker: Path, module_file: Path) -> list:
    trap = base64.b64encode(pickle.dumps(toy.Trap(marker))).decode()
    return [
        {"__reduce__": ["toy", "touch", [str(marker)]]},
        {"py/reduce": [{"py/function": "toy.touch"}, {"py/tuple": [str(marker)]}]},
        {"bytes": trap},                                   # a pickle, as bytes: stays bytes
        f"pickle:{trap}",                                  # a pickle in a string: stays a string
        "toy:touch", str(module_file),                     # import paths: stay strings
        {"global_generator": "os.system"},
        {"torch_dtype": "__import__('os').system('touch x')"},
        {"numpy_scalar": "O", "hex": "00" * 8},
        {"numpy_generator": {"dict": []}, "bit_generator": "toy.Trap"},
        {"state_dict": {"dict": []}, "type": "toy.Trap"},
        {"attributes": [["path", str(marker)]], "type": "toy.Trap"},
        {"ndarray": "registers/x", "dtype": "O"},
        {"ref": 10 ** 9},
    ]


def crafted_files(tmp_path, marker: Path, module_file: Path) -> list[Path]:
    good = small_file(tmp_path, "good.safetensors")
    files = []
    for i, payload in enumerate(payloads(marker, module_file)):
        def edit(meta, payload=payload):
            regs = json.loads(meta["flowvm.registers"])
            regs.append(["crafted", payload])
            meta["flowvm.registers"] = json.dumps(regs)
            head = json.loads(meta["flowvm.header"])
            head["meta"] = {"target": str(module_file), "module": "toy"}
            meta["flowvm.header"] = json.dumps(head)
        files.append(rewrite(good, tmp_path / f"crafted{i}.safetensors", edit))
    # an object whose saved type names a class of the tests, and an array whose dtype is Python objects
    files.append(rewrite(good, tmp_path / "crafted_type.safetensors", lambda m: m.update(
        {"flowvm.objects": m["flowvm.objects"].replace('"type":"StreamingPCA"', '"type":"toy.Trap"')})))
    files.append(rewrite(good, tmp_path / "crafted_dtype.safetensors", lambda m: m.update(
        {"flowvm.tensors": m["flowvm.tensors"].replace('"dtype":"<f8"', '"dtype":"|O","raw":true', 1)})))
    return files


def test_crafted_files_name_code_that_never_runs(tmp_path):
    """Files whose metadata names modules, classes and functions (reduce-style payloads, import paths, a
    pickle in a string) load as data or are refused; in a fresh process under an audit hook, loading them
    unpickles nothing, imports nothing new, compiles and runs no code, and the marker files never appear."""
    marker = tmp_path / "marker"
    module_file = tmp_path / "evil.py"
    module_file.write_text(f"open({str(tmp_path / 'imported')!r}, 'w').write('imported')\n")
    files = crafted_files(tmp_path, marker, module_file)
    good = tmp_path / "good.safetensors"
    job = {"build": "flowvm.programs.pca:build", "options": {"samples": 20, "batches": 2}}
    control = {**job, "file": str(good), "control": True}
    *results, seen = in_child([{**job, "file": str(f)} for f in files] + [control], tmp_path, audit=True,
                              warm={**job, "file": str(good)})
    assert {e for e, _ in seen["loaded_events"]} >= {"pickle.find_class", "exec"}  # the hook does see them
    assert not marker.exists() and not (tmp_path / "imported").exists()
    loaded = 0
    for path, got in zip(files, results):
        assert got["loaded_events"] == [], f"{path.name}: {got['loaded_events']}"
        if "error" in got:
            assert got["error"].startswith("CheckpointError"), f"{path.name}: {got['trace']}"
        else:
            loaded += 1
            crafted = got["outcome"]["registers"]["crafted"]
            assert isinstance(crafted, (str, bytes, dict, np.ndarray)), crafted
    assert loaded >= 4  # the strings and bytes are plain data
    with pytest.raises(CheckpointError):  # also in this process
        flowvm.load_state(files[-2], _import("flowvm.programs.pca").build(samples=20, batches=2))
    assert not marker.exists()


def test_values_nested_too_deeply_are_refused(tmp_path):
    from flowvm.programs import pca

    good = small_file(tmp_path)
    deep = rewrite(good, tmp_path / "deep.safetensors", lambda m: m.update(
        {"flowvm.registers": '[["deep",' + '{"tuple":[' * 3000 + "1" + "]}" * 3000 + "]]"}))
    with pytest.raises(CheckpointError, match="cannot be read"):
        flowvm.load_state(deep, pca.build(samples=20, batches=2))


def test_a_device_this_machine_lacks_loads_on_the_cpu_with_a_warning(tmp_path):
    reg = Registers(w=torch.ones(3))
    prog = lambda: SEQ([CALL(toy.const, reg("w"), store_to=reg("w")), CALL(toy.const, 1)])  # noqa: E731
    drv = prog().start()
    drv.run(max_steps=1)
    flowvm.save_state(drv, tmp_path / "d.safetensors")
    moved = rewrite(tmp_path / "d.safetensors", tmp_path / "cuda.safetensors", lambda m: m.update(
        {"flowvm.registers": m["flowvm.registers"].replace('"device":"cpu"', '"device":"cuda:7"')}))
    with pytest.warns(flowvm.CopyWarning, match="cuda:7"):
        loaded = flowvm.load_state(moved, prog())
    assert loaded.registers["w"].device.type == "cpu" and torch.equal(loaded.registers["w"], torch.ones(3))


# ------------------------------------------------------------------ signing
def test_signed_files_need_their_key(tmp_path):
    from flowvm.programs import pca

    path = small_file(tmp_path, key="secret")
    assert read_state_header(path)["signed"]
    flowvm.load_state(path, pca.build(samples=20, batches=2), key="secret")
    with pytest.raises(CheckpointError, match="refused: the file is signed"):
        flowvm.load_state(path, pca.build(samples=20, batches=2))
    with pytest.raises(CheckpointError, match="signature does not match"):
        flowvm.load_state(path, pca.build(samples=20, batches=2), key="wrong")
    flowvm.load_state(path, pca.build(samples=20, batches=2), verify=False)
    tampered = rewrite(path, tmp_path / "tampered.safetensors",
                       lambda m: m.update({"flowvm.run": m["flowvm.run"].replace('"steps":30', '"steps":31')}))
    with pytest.raises(CheckpointError, match="signature does not match"):
        flowvm.load_state(tampered, pca.build(samples=20, batches=2), key="secret")
    unsigned = small_file(tmp_path, "unsigned.safetensors")
    with pytest.raises(CheckpointError, match="not signed, but a key was given"):
        read_state_header(unsigned, key="secret")


# ------------------------------------------------------------------ refusals and objects
def test_what_a_state_file_cannot_hold_is_refused_naming_it(tmp_path):
    reg = Registers(f=lambda x: x)
    drv = SEQ([CALL(toy.const, 1), CALL(toy.const, 2)]).start()
    drv.registers.update(reg)
    with pytest.raises(CheckpointError, match=r"registers/f holds a function \(.*<lambda>\): a state file "
                                              r"holds no code: .*state_dict"):
        flowvm.save_state(drv, tmp_path / "f.safetensors")
    with open(tmp_path / "handle.txt", "w") as handle:
        drv = SEQ([CALL(toy.const, handle), CALL(toy.const, 2)]).start()
        with pytest.raises(CheckpointError, match=r"objects/0:args.0 holds a file handle \(_io.TextIOWrapper\)"):
            flowvm.save_state(drv, tmp_path / "h.safetensors")

    class Holder:
        def __init__(self):
            self.lock = threading.Lock()
            self.n = 0

        def bump(self):
            self.n += 1

    drv = SEQ([CALL(Holder().bump), CALL(toy.const, 2)]).start()
    with pytest.raises(CheckpointError, match=r"objects/0:fn.self/lock holds an object without attributes "
                                              r"\(_thread.lock\): give its class state_dict"):
        flowvm.save_state(drv, tmp_path / "l.safetensors")
    model = torch.nn.Linear(2, 2)
    drv = SEQ([CALL(toy.const, 1), CALL(toy.const, 2)]).start()
    drv.registers["model"] = [model]  # a register's own value saves (test_state_registers.py); one inside it not
    with pytest.raises(CheckpointError, match=r"registers/model/0 holds a torch.nn.modules.linear.Linear: .* a "
                                              r"register's own value .* reached by a CALL"):
        flowvm.save_state(drv, tmp_path / "m.safetensors")
    assert not list(tmp_path.glob("*.safetensors"))


def test_a_result_object_in_a_register_is_made_again_only_of_a_class_the_caller_names(tmp_path):
    drv = sp.build_result().start()
    drv.run()
    flowvm.save_state(drv, tmp_path / "fit.safetensors")
    with pytest.raises(CheckpointError, match=r"registers/fit: the saved run holds a Fit here.*classes=\[Fit\]"):
        flowvm.load_state(tmp_path / "fit.safetensors", sp.build_result())
    loaded = flowvm.load_state(tmp_path / "fit.safetensors", sp.build_result(), classes=[sp.Fit])
    fit = loaded.registers["fit"]
    assert type(fit) is sp.Fit and np.array_equal(fit.coef_, np.full(3, 4.5)) and fit.info_["history"] == [4.5]
    assert loaded.result is fit  # the program's value is the same object
    with pytest.raises(CheckpointError, match="holds a Fit here"):  # another class of that name is not it
        flowvm.load_state(tmp_path / "fit.safetensors", sp.build_result(), classes=[type("Fat", (), {})])


def test_an_object_two_calls_share_is_saved_once_and_restored_as_one(tmp_path):
    want = straight(sp.build_shared)
    drv = sp.build_shared().start()
    drv.run(max_steps=5)
    path = tmp_path / "shared.safetensors"
    flowvm.save_state(drv, path)
    with safe_open(str(path), framework="pt") as f:
        weights = [k for k in f.keys() if k.endswith("state_dict/0.weight")]
        objects = json.loads(f.metadata()["flowvm.objects"])
    assert len(weights) == 1  # the model's weights, once (the optimizer's moments are other tensors)
    assert [loc for loc, node in objects if "ref" in node] == ["0.1:args.0"]
    toy.seed_all(1)
    resumed = flowvm.load_state(path, sp.build_shared())
    resumed.run()
    assert not diff(want, outcome(resumed))
    with pytest.raises(CheckpointError, match="one object here and at an earlier location"):
        flowvm.load_state(path, sp.build_shared(separate=True))


def test_a_cut_between_backward_and_step_keeps_the_gradients(tmp_path):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        reg = Registers(x=torch.randn(8, 3), y=torch.randn(8, 1))

        def backward(m, x, y):
            torch.nn.functional.mse_loss(m(x), y).backward()

        return REPEAT(4, SEQ([CALL(opt.zero_grad), CALL(backward, model, reg("x"), reg("y")), CALL(opt.step),
                              CALL(lambda m: m.weight.detach().clone(), model, store_to=reg("w"))]))

    want = straight(build)
    drv = build().start()
    drv.run(max_steps=6)  # after the second backward(), before its step()
    flowvm.save_state(drv, tmp_path / "g.safetensors")
    resumed = flowvm.load_state(tmp_path / "g.safetensors", build())
    resumed.run()
    assert not diff(want, outcome(resumed))


def test_fused_steps_resume_in_their_eager_form(tmp_path):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        reg = Registers(x=torch.randn(16, 4), y=torch.randint(0, 3, (16,)))
        return flowvm.optimize(REPEAT(6, SEQ([
            CALL(opt.zero_grad), CALL(model, reg("x"), store_to=reg("logits")),
            CALL(torch.nn.functional.cross_entropy, reg("logits"), reg("y"), store_to=reg("loss")),
            CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)])), options={"fuse-torch": {"form": "eager"}})

    assert "FUSED" in str(build())
    want = straight(build)
    drv = build().start()
    drv.run(max_steps=4)
    flowvm.save_state(drv, tmp_path / "fused.safetensors")  # the loss's graph is spent: backward() ran in the step
    resumed = flowvm.load_state(tmp_path / "fused.safetensors", build())
    resumed.run()
    assert not diff(want, outcome(resumed))


def test_a_tensor_with_a_live_autograd_graph_is_refused_and_a_spent_one_saved(tmp_path):
    w = torch.ones(2, requires_grad=True)
    drv = SEQ([CALL(toy.const, 1), CALL(toy.const, 2)]).start()
    drv.registers["loss"] = (w * w).sum()
    with pytest.raises(flowvm.CopyError, match="registers/loss holds a tensor whose autograd graph"):
        flowvm.save_state(drv, tmp_path / "g.safetensors")
    assert not (tmp_path / "g.safetensors").exists()
    drv.registers["loss"].backward()  # frees the graph: a backward through the copy fails as through the original
    flowvm.save_state(drv, tmp_path / "g.safetensors")
    assert flowvm.load_state(tmp_path / "g.safetensors", drv.program).registers["loss"].item() == 2.0


def test_the_header_and_the_random_states(tmp_path):
    drv = REPEAT(10, CALL(toy.draw_global_random, store_to=Registers(r=0)("r"))).start()
    random.seed(4)
    drv.run(max_steps=4)
    flowvm.save_state(drv, tmp_path / "r.safetensors", meta={"experiment": 1})
    expected = [random.random() for _ in range(6)][-1]
    head = read_state_header(tmp_path / "r.safetensors")
    assert head["steps"] == 4 and not head["done"] and head["meta"] == {"experiment": 1}
    assert head["position"] == "0" and head["fingerprint"] and head["python"] and head["flowvm"] == flowvm.__version__
    random.seed(99)
    resumed = flowvm.load_state(tmp_path / "r.safetensors",
                                REPEAT(10, CALL(toy.draw_global_random, store_to=Registers(r=0)("r"))))
    resumed.run()
    assert resumed.registers["r"] == expected
    kept = flowvm.load_state(tmp_path / "r.safetensors",
                             REPEAT(10, CALL(toy.draw_global_random, store_to=Registers(r=0)("r"))),
                             restore_random=False)
    random.seed(99)
    kept.run()
    random.seed(99)
    assert kept.registers["r"] == [random.random() for _ in range(6)][-1]


def test_structure_excludes_constants():
    assert structure(sp.build_constant(step=1.0, n=3)) == structure(sp.build_constant(step=7.0, n=9))


def test_saves_are_atomic_keep_permissions_and_clear_what_killed_saves_left(tmp_path):
    drv = sp.build_constant().start()
    drv.run(max_steps=2)
    path = tmp_path / "a.safetensors"
    flowvm.save_state(drv, path)
    os.chmod(path, 0o600)
    orphan = tmp_path / ".a.safetensors.999999999-0a1b.tmp"  # a save's directory whose process is gone
    orphan.mkdir()
    (orphan / "state.safetensors").write_bytes(b"partial")
    drv.run(max_steps=1)
    assert flowvm.save_state(drv, path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]
    assert (path.stat().st_mode & 0o777) == 0o600 and read_state_header(path)["steps"] == 3
    with pytest.raises(CheckpointError, match="no directory"):
        flowvm.save_state(drv, tmp_path / "missing" / "a.safetensors")


def test_a_url_target(tmp_path):
    pytest.importorskip("fsspec")
    drv = sp.build_constant().start()
    drv.run(max_steps=5)
    assert flowvm.save_state(drv, "memory://state/run.safetensors") == "memory://state/run.safetensors"
    assert read_state_header("memory://state/run.safetensors")["steps"] == 5
    resumed = flowvm.load_state("memory://state/run.safetensors", sp.build_constant())
    resumed.run()
    assert resumed.registers["total"] == 4.0


@pytest.mark.parametrize("positional", [True, False])
def test_tensors_of_many_pieces_load_exactly_with_and_without_positional_reads(tmp_path, monkeypatch, positional):
    from flowvm.persist import statefile, statetensors

    if not positional:
        monkeypatch.setattr(statetensors, "_preadv", None)  # as where os.preadv is missing
    reg = Registers(big=torch.randn(3_000_001), arr=np.random.default_rng(1).standard_normal((1000, 1500)), n=0)
    prog = REPEAT(3, CALL(lambda n: n + 1, reg("n"), store_to=reg("n")))
    drv = prog.start()
    drv.step()
    flowvm.save_state(drv, tmp_path / "big.safetensors")
    assert os.path.getsize(tmp_path / "big.safetensors") > 3 * statefile.PIECE
    big, arr = reg["big"].clone(), reg["arr"].copy()  # (the loaded run shares the program's register file)
    reg["big"], reg["arr"] = torch.zeros(1), None
    again = flowvm.load_state(tmp_path / "big.safetensors", prog)
    assert torch.equal(again.registers["big"], big) and np.array_equal(again.registers["arr"], arr)
    data = bytearray((tmp_path / "big.safetensors").read_bytes())
    data[-5_000_000] ^= 0x10  # a flipped bit deep inside a tensor's pieces
    (tmp_path / "flipped.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        flowvm.load_state(tmp_path / "flipped.safetensors", prog)
