"""A numpy-only run saved where torch was imported loads and resumes without importing torch (torch's
generator state rides along as bytes, set only where the run imports torch)."""

from __future__ import annotations

import os
import subprocess
import sys

import toy

WRITE = """
import pickle, sys, torch, flowvm
from flowvm import CALL, REPEAT, Registers
import numpy as np
reg = Registers(x=0.0)
drv = REPEAT(5, CALL(np.add, reg('x'), 1.0, store_to=reg('x'))).start()
drv.run(max_steps=2)
flowvm.save(drv, sys.argv[1])
open(sys.argv[1] + '.pickle', 'wb').write(pickle.dumps(drv))
"""

READ = """
import pickle, sys, flowvm
drv = flowvm.load(sys.argv[1])
drv.run()
copy = pickle.loads(open(sys.argv[1] + '.pickle', 'rb').read())
copy.run()
assert drv.registers['x'] == copy.registers['x'] == 5.0
print('torch' in sys.modules)
"""

USES_TORCH = """
import sys, torch, flowvm
from flowvm import CALL, REPEAT, Registers
torch.manual_seed(3)
reg = Registers(draws=[])
drv = REPEAT(4, CALL(lambda d: d + [torch.rand(1).item()], reg('draws'), store_to=reg('draws'))).start()
drv.run(max_steps=2)
flowvm.save(drv, sys.argv[1])
drv.run()
print(drv.registers['draws'])
"""

RESUME_TORCH = """
import sys, flowvm
drv = flowvm.load(sys.argv[1])
drv.run()
print(drv.registers['draws'])
"""


def _python(code: str, *args) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(toy.TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_numpy_only_run_saved_beside_torch_resumes_without_importing_torch(tmp_path):
    path = tmp_path / "run.ckpt"
    _python(WRITE, path)
    assert _python(READ, path) == "False"


def test_a_run_that_uses_torch_still_gets_torchs_generator_back(tmp_path):
    path = tmp_path / "torch.ckpt"
    straight = _python(USES_TORCH, path)
    assert _python(RESUME_TORCH, path) == straight  # the draws after the cut, bit for bit

