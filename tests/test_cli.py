"""The autopar command line, run as users run it."""

import math
import re
import subprocess
import sys
import textwrap

import pytest


def _autopar(*args, cwd=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "autopar.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


def test_plan_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    done = _autopar("plan", "mlp", "--mesh", "4", "--axes", "tp", "--json", str(out), "--graph")
    assert done.returncode == 0, done.stderr
    assert "ShardingPlan for Mesh(tp=4) on 'h100'" in done.stdout
    assert "Collectives" in done.stdout and out.exists()
    shown = _autopar("explain", str(out))
    assert shown.returncode == 0 and "ShardingPlan for Mesh(tp=4)" in shown.stdout


def test_plan_takes_pins_and_a_memory_budget():
    done = _autopar(
        "plan",
        "mlp",
        "--mesh",
        "2x2",
        "--pin",
        "layers.0.weight=R,S(0)",
        "--pin",
        "x=S(0),R",
        "--memory-budget",
        "64MiB",
    )
    assert done.returncode == 0, done.stderr
    assert "(pinned: layers.0.weight, x)" in done.stdout
    assert "layers.0.weight  (R, S(0))" in done.stdout and "budget 64.0 MiB" in done.stdout


def test_plan_takes_the_solver_gap_and_time_limit_and_refuses_a_gap_above_one():
    done = _autopar("plan", "mlp", "--mesh", "4", "--solver-gap", "0.01", "--time-limit", "30")
    assert done.returncode == 0, done.stderr
    assert "solver: OPTIMAL" in done.stdout
    bad = _autopar("plan", "mlp", "--mesh", "4", "--solver-gap", "2")
    assert bad.returncode != 0 and "solver_gap=2.0 is not a fraction in [0, 1)" in bad.stderr


def test_bad_input_prints_its_message_alone_and_the_traceback_is_behind_verbose(tmp_path):
    pin = _autopar("plan", "mlp", "--mesh", "4", "--pin", "x=S0")
    assert pin.returncode != 0 and "Traceback" not in pin.stderr, pin.stderr
    assert "autopar plan: cannot read placement 'S0': write 'S(<dim>)', 'R' or 'P'" in pin.stderr
    missing = _autopar("explain", str(tmp_path / "none.json"))
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert missing.stderr.startswith("autopar explain: ") and "none.json" in missing.stderr
    verbose = _autopar("-v", "plan", "mlp", "--mesh", "4", "--pin", "x=S0")
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr and "ValueError" in verbose.stderr


def test_plan_can_share_repeated_layers():
    shared = _autopar("plan", "gpt", "--mesh", "4", "--share-layers", "on")
    assert shared.returncode == 0, shared.stderr
    assert "repeated layers in 1 class share their first layer's" in shared.stdout
    alone = _autopar("plan", "gpt", "--mesh", "4", "--share-layers", "off")
    assert alone.returncode == 0 and "repeated layers" not in alone.stdout


def test_plan_recomputes_layers_when_asked():
    done = _autopar("plan", "gpt", "--mesh", "4", "--recompute", "layers")
    assert done.returncode == 0, done.stderr
    rows = dict(re.findall(r"^(blocks\.\d)\s+\S+ \S+\s+(\S+ \S+)", done.stdout, re.M))
    assert set(rows) == {"blocks.0", "blocks.1"} and all(v != "0 B" for v in rows.values()), done.stdout
    assert "recompute " in done.stdout.splitlines()[1]  # the step's recompute time
    wrong = _autopar("plan", "gpt", "--recompute", "all")
    assert wrong.returncode != 0 and "invalid choice: 'all'" in wrong.stderr


def test_plan_reads_a_model_file(tmp_path):
    (tmp_path / "net.py").write_text(
        textwrap.dedent("""
        import torch
        from autopar.examples.mlp import MLP

        def make_model():
            return MLP(8, 16), (torch.randn(4, 8), torch.randn(4, 8))
    """)
    )
    done = _autopar("plan", str(tmp_path / "net.py"), "--mesh", "2")
    assert done.returncode == 0, done.stderr
    assert "layers.0.weight" in done.stdout


@pytest.mark.slow
def test_run_launches_ranks_that_compile_and_train(tmp_path):
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""
        import torch, torch.distributed as dist
        import autopar
        from autopar.examples.mlp import MLP

        torch.manual_seed(0)
        model = autopar.compile(MLP(8, 16), autopar.Mesh((2,), ("dp",)), hardware="cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        for _ in range(2):
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
        print(f"rank {dist.get_rank()} loss {float(loss.detach()):.6f}")
    """)
    )
    done = _autopar("run", "-n", "2", str(tmp_path / "train.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = dict(re.findall(r"rank (\d) loss (\d+\.\d{6})", done.stdout))  # the ranks' lines may interleave
    assert sorted(losses) == ["0", "1"] and losses["0"] == losses["1"]


@pytest.mark.slow
def test_run_timeout_fails_the_ranks_that_wait_for_one_that_hangs(tmp_path):
    (tmp_path / "hang.py").write_text(
        textwrap.dedent("""
        import time
        import torch, torch.distributed as dist
        import autopar
        from autopar.examples.mlp import MLP

        mesh = autopar.Mesh((2,), ("dp",))
        pins = {"x": "S(0)", "target": "S(0)"}  # data parallel: the gradients are reduced
        batch = (torch.randn(4, 8), torch.randn(4, 8))
        model = autopar.compile(MLP(8, 16), mesh, batch, hardware="cpu", pins=pins)
        x, y = (model.rank_part(name, t) for name, t in zip(("x", "target"), batch))  # each rank passes its part
        for step in range(3):
            if step == 1 and dist.get_rank() == 1:
                time.sleep(30)
            model(x, y).backward()
        print("no error")
    """)
    )
    done = _autopar("run", "-n", "2", "--timeout", "5", str(tmp_path / "hang.py"), cwd=tmp_path)
    assert done.returncode == 1 and "no error" not in done.stdout, done.stdout[-3000:]
    assert "did not join it within the timeout of 5 s" in done.stderr, done.stderr[-3000:]


def test_run_refuses_a_timeout_that_is_not_positive(tmp_path):
    done = _autopar("run", "-n", "2", "--timeout", "0", "train.py", cwd=tmp_path)
    assert done.returncode != 0 and "--timeout 0: give the seconds a collective may wait" in done.stderr


@pytest.mark.slow
def test_demo_trains_on_four_ranks_and_matches_one_device():
    done = _autopar("demo")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "ShardingPlan for Mesh(dp=2 x tp=2)" in done.stdout
    assert "MATCH: the parallel run reproduces single-device training" in done.stdout


@pytest.mark.slow
def test_calibrate_writes_a_profile_that_plans_use(tmp_path):
    out = tmp_path / "cpu.json"
    done = _autopar("calibrate", "-n", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "all_to_all" in done.stdout and out.exists()
    from autopar.cost_model.hardware import load_profile

    profile = load_profile(out)
    fitted = profile.fitted
    # Measured figures depend on the host's speed and load; the fits themselves are checked
    # against a known clock in test_calibrate.py. Here each must have been measured: positive, finite.
    measured = [profile.flops_per_s, profile.memory_bytes_per_s, fitted.op_overhead_s, fitted.step_scale]
    measured.append(fitted.collective_scale)  # a training step of the calibration model ran and was compared
    assert all(0 < x < math.inf for x in measured), measured
    assert fitted.timed_ops and fitted.contention >= 1.0  # plans made with it time their ops on this host
    overheads = [fitted.node_overhead_s, fitted.step_overhead_s, fitted.param_overhead_s]
    assert all(0 <= x < math.inf for x in overheads), overheads
    kinds = {kind for kind, _, _ in profile.intra_host.per_kind}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    planned = _autopar("plan", "mlp", "--mesh", "2", "--hardware", str(out))
    assert planned.returncode == 0, planned.stderr
    assert f"on '{profile.name}'" in planned.stdout
