"""A redraw's cost beside a step's: DeepXDE's Burgers and Poisson_Lshape examples trained by SGN
as ``deepxde_examples.py`` trains them for 20 CPU s, then 5 more SGN steps, each followed by a
``ResidualPoints().redraw()``; the medians of their process CPU seconds. One example a process
(``deepxde_examples.run`` patches DeepXDE's ``Model`` for its run); each adds its entry to
``redraw_cost.json``.

    cd benchmarks/results/2026-12-02_cpu_residual_points
    python redraw_cost.py DEEPXDE/examples Burgers
    python redraw_cost.py DEEPXDE/examples Poisson_Lshape
"""

import json
import statistics
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "pinns"))
sys.path.insert(0, str(HERE.parents[1]))
import deepxde_examples  # noqa: E402
import measuring  # noqa: E402
import torch  # noqa: E402

import torch_sgn.deepxde  # noqa: E402


def measure(model) -> dict:
    callback = torch_sgn.deepxde.ResidualPoints()
    callback.set_model(model)
    steps, redraws = [], []
    for _ in range(5):
        state = model.train_state
        start = time.process_time()
        model.train_step(state.X_train, state.y_train, state.train_aux_vars)  # one SGN step
        steps.append(time.process_time() - start)
        start = time.process_time()
        callback.redraw()
        redraws.append(time.process_time() - start)
        state.set_data_train(*model.data.train_next_batch(model.batch_size))
    step, redraw = statistics.median(steps), statistics.median(redraws)
    return {"step_s": step, "redraw_s": redraw, "redraw_in_steps": redraw / step}


def main() -> None:
    torch.set_num_threads(1)
    args = types.SimpleNamespace(examples=sys.argv[1], budget=20.0, seed=0, float32=False)
    path = HERE / "redraw_cost.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    out["environment"] = measuring.environment()
    example = sys.argv[2]
    r = deepxde_examples.run(example, "sgn", args, extra=measure)
    out[example] = {k: r[k] for k in ("step_s", "redraw_s", "redraw_in_steps")}
    print(example, out[example], flush=True)
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
