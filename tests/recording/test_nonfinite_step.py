"""The optimizer-step check's finiteness flags (mpdiag.recording.nonfinite_step), per tensor, against
``torch.isfinite`` on each tensor: sums of magnitudes that overflow from finite values are no finding, and one
NaN or inf anywhere, in any dtype, is; counted by numba's pass over bit patterns and by torch. The single flag
before a step (GradScaler's multi-tensor pass on a GPU) against the same truth, leaving every value's bits as they
were. The check keeps the loss's value, not the loss."""

import gc
import weakref

import pytest
import torch
from conftest import DEVICES

from mpdiag import Recorder, Store
from mpdiag.recording import nonfinite_step
from mpdiag.recording.nonfinite_step import EVERY_STEP, AnyNonfinite, NonfiniteFlags


def _tensors(device):
    g = torch.Generator().manual_seed(0)
    made = [torch.randn(n, generator=g) for n in (1, 7, 300, 4096)]
    made += [torch.randn(64, generator=g).half(), torch.randn(64, generator=g).bfloat16(), torch.tensor(2.5),
             torch.randn(5, generator=g).double()]
    return [t.to(device) for t in made]


@pytest.fixture(params=["numba", "torch"])
def counted_by(request, monkeypatch):
    """Both ways of counting: the numba kernel over bit patterns (CPU) and the foreach norms (any device; on the
    CPU where numba is missing)."""
    if request.param == "torch":
        monkeypatch.setattr(nonfinite_step, "NUMBA_AVAILABLE", False)
    else:  # numba is a requirement: the kernel counts CPU tensors
        assert nonfinite_step._nonfinite_on_cpu([torch.zeros(1)]).tolist() == [0]
    return request.param


def _flags(values) -> list[bool]:
    return NonfiniteFlags(values).numpy().tolist()


def _truth(values) -> list[bool]:
    return [not bool(torch.isfinite(v).all()) for v in values]


@pytest.mark.parametrize("device", DEVICES)
def test_finite_values_whose_magnitudes_sum_past_fp32_are_finite(device, counted_by):
    huge = torch.full((8,), 3e38, device=device)  # each finite; their sum of magnitudes is inf in fp32
    big_half = torch.full((100_000,), 65504.0, device=device).half()  # sums past fp16's range, not fp32's
    values = [*_tensors(device), huge, big_half]
    assert _truth(values) == [False] * len(values)
    assert _flags(values) == _truth(values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, "middle", -1])
def test_one_nonfinite_value_in_any_tensor_and_dtype_is_found(device, bad, where, counted_by):
    for index in range(8):
        values = _tensors(device)
        flat = values[index].view(-1)
        flat[flat.numel() // 2 if where == "middle" else where] = bad
        assert _flags(values) == _truth(values) == [i == index for i in range(8)], (index, values[index].dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_each_tensor_is_flagged_on_its_own(device, counted_by):
    """Several tensors broken at once, NaN among large values and inf among NaN: each tensor's flag is its own."""
    values = _tensors(device)
    values[1][3] = float("nan")
    values[3][100:200] = 1e30
    values[3][150] = float("nan")
    values[5][10], values[5][20] = float("nan"), float("inf")
    assert _flags(values) == _truth(values) == [False, True, False, True, False, True, False, False]
    assert _flags([]) == []


@pytest.fixture(params=["per-tensor flags", "one pass"])
def any_by(request, monkeypatch):
    """Both ways of asking whether any value is non-finite: any of the per-tensor flags (the CPU's), and
    GradScaler's multi-tensor pass, which runs where every tensor is on one CUDA device (forced here for CPU
    tensors too, whose kernel of that op is the same contract)."""
    if request.param == "one pass":
        monkeypatch.setattr(nonfinite_step, "_on_one_cuda_device", lambda shards: True)
    return request.param


def _bits(values) -> list[torch.Tensor]:
    """Each tensor's bit patterns, copied, with every NaN's as -1: a NaN may come back as another NaN (the pass
    writes bfloat16's canonical one), as GradScaler's unscaling leaves the gradients; any other value keeps its bits."""
    widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return [v.detach().view(widths[v.element_size()]).masked_fill(v.isnan(), -1) for v in values]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_any_nonfinite_value_is_found_and_no_value_changes(device, bad, any_by):
    """A NaN or inf in any one tensor of mixed dtypes (first, middle or last value) raises the one flag, finite
    values whose sums overflow do not, and every value stays as it was: the pass writes back what it read."""
    places = [0, "middle", -1] if bad is not None else [None]
    for index in range(8):
        for where in places:
            values = [*_tensors(device), torch.full((8,), 3e38, device=device)]
            if where is not None:
                flat = values[index].view(-1)
                flat[flat.numel() // 2 if where == "middle" else where] = bad
            before = _bits(values)
            assert AnyNonfinite(values).any() == (bad is not None) == any(_truth(values)), (index, where)
            assert all(torch.equal(a, b) for a, b in zip(_bits(values), before, strict=True)), (index, where)
        if bad is None:
            break


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_any_nonfinite_of_one_dtype(device, dtype, any_by):
    """The usual list, every tensor of one dtype (one call of the pass, or BF16's per-tensor flags)."""
    values = [torch.randn(n, device=device).to(dtype) for n in (1, 64, 4096, 3)]
    assert not AnyNonfinite(values).any()
    values[2][4000] = float("inf")
    assert AnyNonfinite(values).any()


@pytest.mark.parametrize("device", DEVICES)
def test_any_nonfinite_reads_fp8_and_empty_lists_too(device, any_by):
    """FP8 state (a dtype GradScaler's kernel is not dispatched for) is read by the per-tensor flags instead."""
    fp8 = torch.tensor([1.0, 2.0, 448.0], device=device).to(torch.float8_e4m3fn)
    assert not AnyNonfinite([*_tensors(device), fp8]).any()
    fp8[1] = float("nan")
    assert AnyNonfinite([*_tensors(device), fp8]).any()
    assert not AnyNonfinite([]).any()


def test_the_checked_loss_is_not_kept_alive(tmp_path):
    """The check needs the loss's value before the optimizer step, not the loss: the Recorder held the tensor (and
    through it the step's autograd graph) until the next record, past the loop's own last reference."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt, check_optimizer_step=EVERY_STEP)
    loss = model(torch.randn(16, 4)).square().mean()
    loss.backward()
    rec.record(loss)
    recorded = weakref.ref(loss)
    del loss
    gc.collect()
    assert recorded() is None
    opt.step()  # the check runs on the value it kept (tests/analysis/test_optimizer_step_finding.py: it still finds)
    rec.close()


def _breaking_loop(tmp_path, monkeypatch, steps: int, device: str = "cpu", arrive_late: bool = True):
    """An SGD step whose learning rate overflows the update: the weights are finite before step 0 and not after
    it. ``arrive_late``: the flags arrive only once ``arrived`` says so (as a GPU's copies may, a step later)."""
    arrived = {"now": False}
    if arrive_late:
        monkeypatch.setattr(NonfiniteFlags, "ready", lambda self: arrived["now"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=3e38)
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt, check_optimizer_step=EVERY_STEP)
    seen = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.ones(8, 4, device=device)).sum()
        loss.backward()
        rec.record(loss)
        finite_before = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        opt.step()
        seen.append((finite_before, all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                     rec.optimizer_step_nonfinite))
    return rec, seen, arrived


def test_flags_that_arrive_later_report_the_step_that_broke(tmp_path, monkeypatch):
    rec, seen, arrived = _breaking_loop(tmp_path, monkeypatch, steps=1)
    assert seen == [(True, False, None)]  # broke at step 0; its flags have not arrived: nothing reported yet
    arrived["now"] = True
    rec.record(torch.tensor(0.0))  # the next record settles what has arrived
    assert rec.optimizer_step_nonfinite["step"] == 0
    assert rec.optimizer_step_nonfinite["tensors"] == ["weight", "bias"]
    rec.close()


def test_flags_still_on_their_way_at_the_end_are_waited_for(tmp_path, monkeypatch):
    rec, seen, _ = _breaking_loop(tmp_path, monkeypatch, steps=3)
    assert [s[:2] for s in seen] == [(True, False), (False, False), (False, False)] and seen[-1][2] is None
    rec.close()
    found = Store(tmp_path / "runs.db").run(rec.run_id)["config"]["optimizer_step_nonfinite"]
    assert (found["step"], found["tensors"]) == (0, ["weight", "bias"])  # the step that broke (the later ones began non-finite)


@pytest.mark.parametrize("device", DEVICES)
def test_what_broke_is_named_as_the_step_left_it_when_its_flags_arrive_later(tmp_path, monkeypatch, device):
    """The flags after a step are one bit; the values a broken step left non-finite are named from the tensors,
    which the next step changes: step 0 overflows the weight alone (its learning rate), step 1 then the bias too
    (the loss is inf). With step 0's flags arriving only at the end, the finding still names the weight alone.
    Truth: torch's isfinite after each step."""
    arrived = {"now": False}
    monkeypatch.setattr(NonfiniteFlags, "ready", lambda self: arrived["now"])
    monkeypatch.setattr(AnyNonfinite, "ready", lambda self: arrived["now"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.SGD([{"params": [model.weight], "lr": 3e38}, {"params": [model.bias], "lr": 1e-3}])
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt, check_optimizer_step=EVERY_STEP)
    finite_after = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.ones(8, 4, device=device)).square().sum()
        loss.backward()
        rec.record(loss)
        opt.step()
        finite_after.append([bool(torch.isfinite(p).all()) for p in (model.weight, model.bias)])
    assert finite_after == [[False, True], [False, False], [False, False]] and rec.optimizer_step_nonfinite is None
    arrived["now"] = True
    rec.close()
    found = Store(tmp_path / "runs.db").run(rec.run_id)["config"]["optimizer_step_nonfinite"]
    assert (found["step"], found["tensors"]) == (0, ["weight"])


@pytest.mark.parametrize("device", DEVICES)
def test_the_step_that_broke_is_found_on_each_device(tmp_path, monkeypatch, device, any_by):
    """As the flags really arrive: at once on the CPU, by the device's own copies on a GPU; the flag before the
    step by either way."""
    rec, seen, _ = _breaking_loop(tmp_path, monkeypatch, steps=3, device=device, arrive_late=False)
    assert [s[:2] for s in seen] == [(True, False), (False, False), (False, False)]
    if device == "cpu" and any_by == "per-tensor flags":  # counted inside the step
        assert seen[0][2]["step"] == 0
    rec.close()
    found = Store(tmp_path / "runs.db").run(rec.run_id)["config"]["optimizer_step_nonfinite"]
    assert (found["step"], found["tensors"], found["values"]) == (0, ["weight", "bias"], ["weight", "bias"])


def test_a_step_given_a_closure_that_records_is_checked(tmp_path):
    """``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) runs its pre-hook before the
    closure's backward and ``record``: the check's flags before the step were the previous step's (at step 0 none:
    the step that broke the weights went unchecked). Truth: torch's isfinite around each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=3e38)  # the update overflows: inf weights after step 0
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(8, 4)).sum()
        loss.backward()
        rec.record(loss)
        return loss

    finite = []
    for _ in range(3):
        before = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        opt.step(closure)
        finite.append((before, all(bool(torch.isfinite(p).all()) for p in model.parameters())))
    rec.close()
    assert finite == [(True, False), (False, False), (False, False)]
    found = Store(tmp_path / "runs.db").run(rec.run_id)["config"]["optimizer_step_nonfinite"]
    assert (found["step"], found["tensors"]) == (0, ["weight", "bias"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_low_bit_optimizer_states_are_read_through_their_parts(tmp_path, name):
    """torchao's low-bit optimizers keep their state in tensor subclasses whose own storage is no values (the numba
    pass read address 0 and the process died; torch's norm raised): their flags are their codes' and scales', and
    equal ``isfinite`` of the state dequantized, before and after a scale turns inf; a loop runs checked. The
    state's format is said by its class, not its dtype (float32)."""
    optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = getattr(optim, name)(model.parameters(), lr=1e-3)
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt, check_optimizer_step=EVERY_STEP)
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(8, 256)).square().mean()
        loss.backward()
        rec.record(loss)
        opt.step()
    rec.close()
    assert rec.optimizer_step_nonfinite is None
    state = opt.state[model[0].weight]["exp_avg"]
    # its dtype says float32; the small tensors' state (the biases, the 256-value head) stays plain float32
    assert nonfinite_step.optimizer_state_dtype(opt) == f"{type(state).__name__}, float32"
    assert torch.utils._python_dispatch.is_traceable_wrapper_subclass(state)
    values = [model[0].weight, state, opt.state[model[0].weight]["exp_avg_sq"]]
    for by in (NonfiniteFlags, AnyNonfinite):
        assert not (by(values).any() if by is AnyNonfinite else by(values).numpy().any())
    state.scale.view(-1)[3] = float("inf")
    truth = [not bool(torch.isfinite(v.dequantize() if v is not values[0] else v).all()) for v in values]
    assert truth == [False, True, False]
    assert NonfiniteFlags(values).numpy().tolist() == truth
    assert AnyNonfinite(values).any()


def test_a_compiled_optimizer_step_is_checked_and_recorded(tmp_path):
    """``opt.step = torch.compile(opt.step)`` (torch's "compiling the optimizer" recipe) runs the step hooks inside
    the traced frame; Dynamo tracing the check's numba kernel raised a ValueError out of the training loop. The
    step is checked and recorded as an eager one is: the finding at the step whose update the loop itself sees turn
    the weights inf (its tensor learning rate raised to overflow them), each norm ``clip_grad_norm_``'s."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    opt.step = torch.compile(opt.step, backend="eager")
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt, check_optimizer_step=EVERY_STEP)
    norms, broke_at = [], None
    for step in range(4):
        if step == 2:
            opt.param_groups[0]["lr"].fill_(3e38)
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).sum()
        loss.backward()
        rec.record(loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        if broke_at is None and not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            broke_at = step
    rec.close()
    assert broke_at == 2
    assert rec.optimizer_step_nonfinite["step"] == broke_at
    steps = Store(tmp_path / "runs.db").steps(rec.run_id)
    assert steps["skipped"].tolist() == [0, 0, 0, 0]
    assert steps["grad_norm"].tolist()[:3] == norms[:3]  # step 3's gradients are NaN (stored NULL)
