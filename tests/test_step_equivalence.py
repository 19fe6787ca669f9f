"""scripts/step_equivalence.py: a record compares identical with itself, a changed bit in the
parameters, a step's info or the final state is found, and fields only one record has (a record
made before they existed) are named rather than counted as differences."""

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "step_equivalence.py"
CASE = "linear_auto_switch"  # nn.Linear(13, 1): 20 steps in well under a second


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("step_equivalence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recorded(script, tmp_path_factory):
    path = tmp_path_factory.mktemp("records") / "before.pt"
    script.record(str(path), [CASE])
    return path


def _compare(script, recorded, tmp_path, capsys, change):
    records = torch.load(recorded, weights_only=False)
    change(records[CASE])
    torch.save(records, tmp_path / "after.pt")
    capsys.readouterr()
    code = script.compare(str(recorded), str(tmp_path / "after.pt"))
    return code, capsys.readouterr().out


def _nudge(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its first entry one floating-point step up."""
    y = x.clone()
    y.view(-1)[0] = torch.nextafter(y.view(-1)[0], torch.tensor(math.inf, dtype=y.dtype))
    return y


def test_a_record_is_identical_to_itself(script, recorded, tmp_path, capsys):
    code, out = _compare(script, recorded, tmp_path, capsys, lambda r: None)
    assert code == 0
    assert f"{CASE}: identical" in out and "1 of 1 common cases bit for bit identical" in out
    assert "only in" not in out


def _params(r):
    r["params"][5][0] = _nudge(r["params"][5][0])


def _info(r):
    r["infos"][7]["loss"] = math.nextafter(r["infos"][7]["loss"], math.inf)


def _option(r):
    r["state"]["param_groups"][0]["lr"] = 0.5


def _state(r):
    r["state"]["state"][0]["damping"] *= 2


@pytest.mark.parametrize(
    "change,where",
    [
        (_params, "step 5 params"),
        (_info, "step 7 info loss"),
        (_option, "final state_dict option lr"),
        (_state, "final state_dict parameter 0 state damping"),
    ],
    ids=["params", "info", "option", "state"],
)
def test_one_changed_value_is_found(script, recorded, tmp_path, capsys, change, where):
    code, out = _compare(script, recorded, tmp_path, capsys, change)
    assert code == 1
    assert f"{CASE}: DIFFERS at {where}\n" in out
    assert "0 of 1 common cases bit for bit identical" in out


def test_fields_only_one_record_has_are_named_not_counted(script, recorded, tmp_path, capsys):
    def older(r):  # as recorded before these fields and this option existed
        for info in r["infos"]:
            info["cg_iters"] = info.pop("iterations")  # the former name: still compared
            del info["taken"], info["penalty"]
        del r["state"]["param_groups"][0]["reject_uphill"]
        r["state"]["state"][0]["former"] = 1.0

    records = torch.load(recorded, weights_only=False)
    old = copy.deepcopy(records)
    older(old[CASE])
    torch.save(old, tmp_path / "old.pt")
    capsys.readouterr()
    assert script.compare(str(tmp_path / "old.pt"), str(recorded)) == 0
    out = capsys.readouterr().out
    assert f"{CASE}: identical" in out
    assert "fields only in before (not compared): state former" in out
    assert (
        "fields only in after (not compared): info penalty, info taken, option reject_uphill" in out
    )

    old[CASE]["infos"][3]["cg_iters"] += 1  # a renamed field is compared under its new name
    torch.save(old, tmp_path / "old.pt")
    assert script.compare(str(tmp_path / "old.pt"), str(recorded)) == 1
    assert f"{CASE}: DIFFERS at step 3 info iterations" in capsys.readouterr().out


def test_a_case_only_one_record_has_fails(script, recorded, tmp_path, capsys):
    records = torch.load(recorded, weights_only=False)
    records["extra"] = records[CASE]
    torch.save(records, tmp_path / "more.pt")
    capsys.readouterr()
    assert script.compare(str(recorded), str(tmp_path / "more.pt")) == 1
    out = capsys.readouterr().out
    assert "cases only in after: ['extra']" in out and f"{CASE}: identical" in out
