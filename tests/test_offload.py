"""Offload to host memory chosen by the solver with recomputation, under one memory budget: in what
order a tightening budget takes keep, recompute and offload, what the per-rank program does with
an offloaded activation (copies back prefetched a layer ahead or made at the first read), that
such a program compiled by Inductor trains as one device, and that a plan whose hardware has no
host link never offloads."""

import collections
import copy
import dataclasses
import json
import os
import re

import pytest
import torch
from autopar.examples.gpt import GPT, GPTConfig
from autopar.passes.analysis.capture import capture
from autopar.passes.lower.liveness import plan_liveness
from autopar.passes.lower.partition import partition
from autopar.passes.lower.rewrite import rewrite
from autopar.runtime.offload import HostOptimizer
from torch._inductor.utils import run_and_get_code

import autopar
from autopar import Mesh
from autopar.core.explain import format_bytes
from autopar.core.mesh import Link
from tests.harness import run_ranks
from tests.runtime.test_memory_budget import _model as _small_gpt
from tests.runtime.test_memory_budget import _reference

ONE_DEVICE = Mesh((1,), ("x",))
NO_HOST = autopar.SyntheticProfile(s_per_flop=1e-12, s_per_byte=1e-12, latency_s=1e-6)
WITH_HOST = autopar.SyntheticProfile(
    s_per_flop=1e-12, s_per_byte=1e-12, latency_s=1e-6, host_link=Link(1e-6, 1e-11), host_s_per_byte_memory=1e-11
)
"""A device whose host copies (10 ps per byte) are ten times slower than its memory: recomputing
a pointwise op is cheaper than copying its output, copying a matmul's output cheaper than
recomputing it."""


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=32, dim=128, num_heads=4, num_layers=2)
    return GPT(cfg), (torch.randint(0, 64, (8, 32)), torch.randint(0, 64, (8, 32)))


def _plan(gpt, hardware=WITH_HOST, **options):
    model, batch = gpt
    return autopar.plan(model, ONE_DEVICE, batch, hardware=hardware, **options)


def _chosen(plan, activation: str) -> collections.Counter:
    return collections.Counter(
        n.op.split(".")[1] for n in plan.nodes if n.activation == activation and n.activation_bytes
    )


@pytest.fixture(scope="module")
def sweep(gpt):
    """Plans under 100% (no budget), 95%, 80% and 60% of the unbudgeted plan's peak."""
    free = _plan(gpt)
    return [free] + [_plan(gpt, memory_budget=int(free.peak_memory_bytes * f)) for f in (0.95, 0.8, 0.6)]


@pytest.fixture(scope="module")
def deeper():
    """A 4-layer GPT and its plans under 80% and 60% of its unbudgeted peak. The backward of a
    layer after the first one it reaches holds less (the layers before have freed their
    activations), so copying a layer's offloaded values back ahead, beside the layer before,
    costs no memory at the peak."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=32, dim=128, num_heads=4, num_layers=4)
    gpt = GPT(cfg), (torch.randint(0, 64, (8, 32)), torch.randint(0, 64, (8, 32)))
    free = _plan(gpt)
    return gpt, [_plan(gpt, memory_budget=int(free.peak_memory_bytes * f)) for f in (0.8, 0.6)]


def test_without_a_budget_nothing_goes_to_the_host(sweep):
    free = sweep[0]
    assert not _chosen(free, "offload") and not free.host_optimizer
    assert free.offload_s == 0 and free.memory.host_bytes == 0


def test_tightening_the_budget_takes_the_cheapest_time_per_byte_first(sweep):
    free, slightly, tighter, tightest = sweep
    assert _chosen(slightly, "recompute")["gelu"] and not slightly.host_optimizer
    assert not _chosen(tighter, "recompute") & collections.Counter({"mm": 1, "addmm": 1})  # matmuls: offloaded instead
    assert _chosen(tighter, "offload") & collections.Counter({"mm": 1, "addmm": 1})
    assert tightest.host_params and set(tightest.host_params) <= set(tightest.host_optimizer)
    assert len(tightest.host_optimizer) > len(tighter.host_optimizer)
    for plan, fraction in zip(sweep[1:], (0.95, 0.8, 0.6)):
        assert plan.peak_memory_bytes <= free.peak_memory_bytes * fraction
    # each tightening pays more per byte saved than the one before
    per_byte = [
        (b.predicted_step_s - a.predicted_step_s) / (a.peak_memory_bytes - b.peak_memory_bytes)
        for a, b in zip(sweep, sweep[1:])
    ]
    assert per_byte == sorted(per_byte) and per_byte[0] >= 0
    offloaded = sum(n.activation_bytes for n in tighter.nodes if n.activation == "offload")
    assert tighter.offload_s > 0 and offloaded > 0 and tighter.memory.host_bytes >= offloaded
    assert tightest.memory.host_bytes > tighter.memory.host_bytes


def test_without_a_host_link_the_budget_only_recomputes(gpt, sweep):
    plan = _plan(gpt, hardware=NO_HOST, memory_budget=int(sweep[0].peak_memory_bytes * 0.9))
    assert _chosen(plan, "recompute") and not _chosen(plan, "offload") and not plan.host_optimizer


def test_what_a_device_offloads_stays_within_its_share_of_host_memory(gpt, sweep):
    offloading = sweep[2]  # under 80% of the unbudgeted peak
    capacity = offloading.memory.host_bytes // 2
    assert capacity > 0
    small_host = dataclasses.replace(WITH_HOST, host_memory_bytes=capacity)
    plan = _plan(gpt, hardware=small_host, memory_budget=offloading.memory_budget_bytes)
    assert plan.memory.host_bytes <= capacity == plan.memory.host_capacity_bytes
    assert plan.peak_memory_bytes <= offloading.memory_budget_bytes
    if plan.memory.host_bytes:
        assert f"of the {format_bytes(capacity)} it may fill" in str(plan)


def test_an_h100_host_lends_each_of_its_eight_devices_a_quarter_terabyte():
    from autopar.cost_model.hardware import H100

    assert H100.host_memory_bytes == 2 * 10**12 and H100.host_bytes_per_device() == 2.5 * 10**11


def test_recompute_none_keeps_every_activation_on_the_device(gpt, sweep):
    plan = _plan(gpt, memory_budget=int(sweep[0].peak_memory_bytes * 0.95), recompute="none")
    assert not _chosen(plan, "recompute") and not _chosen(plan, "offload")
    assert (
        plan.host_optimizer and plan.peak_memory_bytes <= sweep[0].peak_memory_bytes * 0.95
    )  # optimizer state moved instead


def test_the_plan_table_and_json_carry_the_offload(deeper):
    plan = deeper[1][1]
    text = str(plan)
    assert "offloaded" in text and "copy time" in text and "in host memory" in text and "optimizer state" in text
    assert "ahead" in text
    again = autopar.ShardingPlan.from_json(plan.to_json())
    assert again == plan and again.host_optimizer == plan.host_optimizer and again.offload_s == plan.offload_s
    assert again.prefetched == plan.prefetched
    assert again.memory.host_bytes == plan.memory.host_bytes


def _parts(gpt, plan):
    model, batch = gpt
    captured = capture(model, batch)
    joint = rewrite(captured, plan, coordinate=(0,), group_names=["offload-test"])
    return partition(
        joint,
        [k.kind == "tangent" for k in captured.inputs],
        [None if k is None else k.kind == "grad" for k in captured.outputs],
    )


def _count(gm, op) -> int:
    return sum(n.target is op for n in gm.graph.nodes)


def test_offloaded_values_leave_in_the_forward_and_come_back_in_the_backward(gpt, sweep):
    """Activations go out in the forward and come back in the backward; parameters in host
    memory come in for each, and their gradients go out."""
    plan = sweep[3]
    parts = _parts(gpt, plan)
    offload, reload = torch.ops.autopar.offload.default, torch.ops.autopar.reload.default
    host_params = len(plan.host_params)
    copied_out = _count(parts.forward, offload)  # the activations, as they are made
    assert copied_out > 0 and host_params > 0
    assert _count(parts.forward, reload) == host_params  # each parameter in host memory, in for the forward
    assert _count(parts.backward, offload) == host_params  # their gradients, out
    assert (
        copied_out <= _count(parts.backward, reload) <= copied_out + host_params
    )  # activations and parameters back in
    saved = {n.name for n in parts.forward.graph.output_node().args[0] if n is not None}
    assert {n.name for n in parts.forward.graph.nodes if n.target is offload} <= saved  # the host copy is what is saved
    for gm in (parts.forward, parts.backward):
        assert _count(gm, torch.ops.autopar.reload_wait.default) == _count(gm, reload)  # every copy back is waited for


def _work_before_wait(gm) -> list[int]:
    """Per copy back, the number of other ops the program runs between issuing it and waiting
    for it."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    position = {n: i for i, n in enumerate(nodes)}
    return [
        position[w] - position[r] - 1
        for r in nodes
        if r.target is torch.ops.autopar.reload.default
        for w in r.users
        if w.target is torch.ops.autopar.reload_wait.default
    ]


def test_prefetched_reloads_run_beside_the_backward_of_the_layer_before(deeper):
    """The plan prefetches the copies back of some layers: they are issued a layer ahead, with
    that layer's backward ops between the copy and its wait, and hold no less memory than
    copies made at the first read."""
    gpt, (plan, _) = deeper
    assert plan.prefetched and plan.offload_s > 0
    ahead, at_read = plan, dataclasses.replace(plan, prefetched=())
    gaps_ahead, gaps_at_read = (
        _work_before_wait(_parts(gpt, ahead).backward),
        _work_before_wait(_parts(gpt, at_read).backward),
    )
    assert len(gaps_ahead) == len(gaps_at_read) > 0
    assert max(gaps_at_read) == 0 and max(gaps_ahead) > 0
    model, batch = gpt
    captured = capture(model, batch)
    assert plan_liveness(captured, ahead).backward_bytes >= plan_liveness(captured, at_read).backward_bytes


def test_the_host_optimizer_steps_as_the_plain_one():
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    host = HostOptimizer(list(model.parameters()), {id(model.weight)}, torch.optim.AdamW, lr=0.1)
    plain = torch.optim.AdamW(twin.parameters(), lr=0.1)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (host, plain)]
    for _ in range(3):
        x = torch.randn(5, 8)
        for m, opt in ((model, host), (twin, plain)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
        for s in schedules:
            s.step()
    assert torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)
    assert host.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
    assert len(host.host_params) == 1 and set(host.state) == {host.host_params[0], model.bias}


def train_offloading_with_inductor() -> dict:
    """On one rank, a plan that offloads with prefetched copies back and keeps parameters in
    host memory, compiled by Inductor (the copy ops are opaque kernels to it), trained for three
    steps against one device."""
    model, batches = _small_gpt(num_layers=4)
    ref_losses, _ = _reference(model, batches)
    unbudgeted = autopar.plan(model, ONE_DEVICE, batches[0], hardware=WITH_HOST).peak_memory_bytes
    pmodel = autopar.compile(
        model, ONE_DEVICE, batches[0], hardware=WITH_HOST, memory_budget=int(unbudgeted * 0.4), backend="inductor"
    )
    opt = pmodel.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

    def step(batch) -> float:
        opt.zero_grad()
        loss = pmodel(*batch)
        loss.backward()
        opt.step()
        return float(loss)

    first, codes = run_and_get_code(step, batches[0])  # no memory tracking: its dispatch mode would stop torch.compile
    losses = [first] + [step(batch) for batch in batches[1:]]
    plan = pmodel.plan
    return {
        "losses": losses,
        "reference": ref_losses,
        "prefetched": plan.prefetched,
        "host_params": plan.host_params,
        "offloaded": sum(n.activation == "offload" for n in plan.nodes),
        "graphs": len(codes),
        "copies": sum(len(_copied_buffers(code)) for code in codes),
        "overwritten": [line for code in codes for line in _overwrites_of_copied_buffers(code)],
        "first_copy_out_at": _first_copy_at(codes[0]),
    }


def _first_copy_at(code: str) -> float:
    """The share of a compiled graph's kernels that its generated code launches before its first
    copy to the host."""
    lines = code[code.index("def call(") :].splitlines()
    kernels = [i for i, line in enumerate(lines) if re.search(r"cpp_fused|extern_kernels\.|torch\.ops\.aten\.", line)]
    first = next(i for i, line in enumerate(lines) if "autopar.offload.default" in line)
    return sum(k < first for k in kernels) / len(kernels)


def _copied_buffers(code: str) -> list[str]:
    return re.findall(r"torch\.ops\.autopar\.offload\.default\((\w+)\)", code)


def _overwrites_of_copied_buffers(code: str) -> list[str]:
    """Lines of Inductor's generated code that write into a buffer after it was passed to
    ``autopar::offload``: a reuse of its memory for another buffer, or an in-place kernel."""
    lines = code.splitlines()
    found = []
    for i, line in enumerate(lines):
        for buf in _copied_buffers(line):
            found += [
                later.strip()
                for later in lines[i + 1 :]
                if re.search(rf"\b{buf}\b.*# reuse|in_out_ptr.*\b{buf}\b", later)
            ]
    return found


@pytest.mark.slow
def test_an_offloading_plan_compiled_by_inductor_trains_as_one_device():
    (r,) = run_ranks(1, train_offloading_with_inductor)
    assert r["prefetched"] and r["offloaded"] > 0 and r["host_params"]
    assert r["graphs"] > 2 and r["copies"] >= r["offloaded"]  # the backward is compiled layer by layer
    assert r["overwritten"] == [], "Inductor writes into a buffer that a copy to the host may still read on CUDA"
    # the forward's first copy out is issued in its first layer (of 4), not moved behind the compute after
    # it, which would hold every offloaded value on the device at once (after 57% of the kernels, reordered)
    assert r["first_copy_out_at"] < 0.25, r["first_copy_out_at"]
    assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["reference"])) <= 1e-5


def _allocated_peak(fn, tmp_dir: str) -> int:
    """The peak of the bytes allocated on the CPU while ``fn`` runs, above those at its start,
    from the memory events of the profiler's trace (a profiler, unlike MemTracker, leaves
    torch.compile be)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = os.path.join(tmp_dir, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    allocated = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        allocated += event["args"]["Bytes"]
        peak = max(peak, allocated)
    return peak


def backward_peaks_by_backend(tmp_dir: str) -> dict:
    """On one rank, the peak memory of the backward of a plan that recomputes most of each
    layer, run eagerly and compiled by Inductor."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=128, dim=128, num_heads=4, num_layers=4))
    batch = (torch.randint(0, 512, (8, 128)), torch.randint(0, 512, (8, 128)))
    unbudgeted = autopar.plan(model, ONE_DEVICE, batch, hardware=NO_HOST).peak_memory_bytes
    peaks = {}
    for backend in ("eager", "inductor"):
        pmodel = autopar.compile(
            copy.deepcopy(model),
            ONE_DEVICE,
            batch,
            hardware=NO_HOST,
            backend=backend,
            memory_budget=int(unbudgeted * 0.65),
        )
        for _ in range(2):
            pmodel(*batch).backward()
        loss = pmodel(*batch)
        peaks[backend] = _allocated_peak(loss.backward, tmp_dir)
        recomputed = sum(n.activation_bytes for n in pmodel.plan.nodes if n.activation == "recompute")
    return {**peaks, "recomputed": recomputed}


@pytest.mark.slow
def test_inductor_recomputes_each_layer_in_its_own_backward(tmp_path):
    """Inductor, free to order a whole backward graph, ran every layer's recomputation at the
    start of the backward (twice eager's peak here, the whole unbudgeted peak on an H100);
    compiled layer by layer, it stays near the eager run's peak. (Eager frees each activation
    after its last read, Inductor's layer graphs only once the layer is done: 1.3 times eager's
    peak here.)"""
    (r,) = run_ranks(1, backward_peaks_by_backend, str(tmp_path))
    assert r["recomputed"] > r["eager"] > 0
    assert r["inductor"] <= 1.5 * r["eager"], r


def test_the_host_optimizer_refuses_a_grad_scaler_instead_of_stepping_scaled_gradients():
    model = torch.nn.Linear(4, 4)
    host = HostOptimizer(list(model.parameters()), {id(model.weight)}, torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    with pytest.raises(RuntimeError, match="GradScaler cannot step an optimizer whose state"):
        scaler.step(host)


def clipped_with_parameters_in_host_memory(backend: str) -> dict:
    """On one CUDA rank (NCCL), a GPT planned to keep parameters in host memory, trained with
    global-norm clipping against the same model trained eagerly on the GPU."""
    device = torch.device("cuda", torch.cuda.current_device())
    model, batches = _small_gpt(num_layers=4)
    model = model.to(device)
    batches = [tuple(t.to(device) for t in batch) for batch in batches]
    unbudgeted = autopar.plan(model, ONE_DEVICE, batches[0], hardware=WITH_HOST).peak_memory_bytes
    reference = copy.deepcopy(model)
    pmodel = autopar.compile(
        model, ONE_DEVICE, batches[0], hardware=WITH_HOST, memory_budget=int(unbudgeted * 0.4), backend=backend
    )
    runs = []
    for m, opt in (
        (pmodel, pmodel.optimizer(torch.optim.AdamW, lr=1e-2)),
        (reference, torch.optim.AdamW(reference.parameters(), lr=1e-2)),
    ):
        losses, norms = [], []
        for batch in batches:
            opt.zero_grad()
            loss = m(*batch)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            opt.step()
            losses.append(float(loss))
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        runs.append((losses, norms))
    whole, expected = pmodel.full_state_dict(), reference.state_dict()
    return {
        "host_params": [str(pmodel.module.get_parameter(n).to_local().device) for n in pmodel.plan.host_params],
        "runs": runs,
        "difference": max(float((whole[k] - expected[k]).abs().max()) for k in expected),
        "devices": {str(v.device) for v in whole.values()},
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="parameters in host memory differ from the device on CUDA")
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_parameters_in_host_memory_clip_and_gather_on_cuda(backend):
    """Their pieces stay in host memory (DTensor's from_local would move them to the mesh's
    device, and the program's copy in then failed); clipping and the whole state dict read them
    with the device's."""
    (r,) = run_ranks(1, clipped_with_parameters_in_host_memory, backend, backend="nccl")
    assert r["host_params"] and set(r["host_params"]) == {"cpu"}
    (losses, norms), (ref_losses, ref_norms) = r["runs"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < 1e-5
    assert r["difference"] < 1e-4 and r["devices"] == {"cuda:0"}
