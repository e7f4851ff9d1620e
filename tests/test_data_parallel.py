"""Data parallelism: N ranks train exactly like one process on the full batch.

Many cases run per launch (a launch costs more than the tiny model). SGD with momentum
is used for the equality cases because Adam is invariant to the gradient's scale and
would not notice a forgotten average; the "local" control (no communication) shows the
tolerance is tight enough to catch a missing sync.
"""
import time

import pytest
import torch.distributed as dist
import torch.nn.functional as F

import minidist
from minidist.data_parallel import BucketedDDP, NaiveDDP, ParameterServer, make_buckets
from minidist.harness.data_parallel import reference_parameters, train_cases, train_variant
from minidist.models import TINY_MLP_VARIANTS, TinyMLP, mlp_batch
from minidist.trace import trace

TOL = 1e-5
DDP_VARIANTS = ("naive_ddp", "bucketed_ddp", "parameter_server")


def _cases():
    cases = []
    for v in DDP_VARIANTS:
        for name, kw in TINY_MLP_VARIANTS.items():
            cases.append(dict(variant=v, model_kwargs=kw, optimizer="sgd"))
        cases.append(dict(variant=v, accum=2, optimizer="sgd"))                       # no_sync
        cases.append(dict(variant=v, accum=2, use_no_sync=False, optimizer="sgd"))    # sync every micro-step
        cases.append(dict(variant=v, model_kwargs={"tied": True, "unused": True, "frozen": True}))  # adam
    cases.append(dict(variant="local", optimizer="sgd"))
    return cases


CASES = _cases()


@pytest.fixture(scope="module", params=[2, 3, 4])
def results(request):
    n = request.param
    return n, minidist.launch(train_cases, n, CASES, timeout=120)


def _reference(case):
    return reference_parameters(case.get("model_kwargs"), optimizer=case.get("optimizer", "adam"))


def test_every_variant_equals_single_process_training(results):
    n, out = results
    for i, case in enumerate(CASES):
        if case["variant"] == "local":
            continue
        ref = _reference(case)
        for rank in range(n):
            err = (out[rank][i]["params"] - ref).abs().max().item()
            assert err < TOL, f"N={n} rank {rank} {case}: max |Δ| = {err:.2e}"


def test_the_tolerance_catches_training_without_sync(results):
    n, out = results
    i = next(i for i, c in enumerate(CASES) if c["variant"] == "local")
    ref = _reference(CASES[i])
    assert (out[0][i]["params"] - ref).abs().max().item() > 100 * TOL


def test_ddp_moves_two_n_minus_one_over_n_psi_per_rank(results):
    n, out = results
    for i, case in enumerate(CASES):
        if case["variant"] not in ("naive_ddp", "bucketed_ddp") or case.get("accum", 1) != 1:
            continue
        for rank in range(n):
            r = out[rank][i]
            psi_bytes = 4 * r["numel"]
            assert r["traced"] == {"all_reduce": psi_bytes}, case      # one payload of Ψ, nothing else
            assert r["wire_bytes"] == pytest.approx(2 * (n - 1) / n * psi_bytes)


def test_gradient_accumulation_communicates_once_per_step_under_no_sync(results):
    n, out = results
    for i, case in enumerate(CASES):
        if case["variant"] == "bucketed_ddp" and case.get("accum") == 2:
            traced = out[0][i]["traced"]["all_reduce"]
            expected = 4 * out[0][i]["numel"] * (1 if case.get("use_no_sync", True) else 2)
            assert traced == expected, case


def test_parameter_server_traffic_is_lopsided(results):
    n, out = results
    i = CASES.index(dict(variant="parameter_server", model_kwargs={}, optimizer="sgd"))
    psi_bytes = 4 * out[0][i]["numel"]
    assert out[0][i]["traced"] == {"irecv": (n - 1) * psi_bytes, "isend": (n - 1) * psi_bytes}
    for rank in range(1, n):
        assert out[rank][i]["traced"] == {"send": psi_bytes, "recv": psi_bytes}


# ----------------------------------------------------------------------------- overlap
def _overlap_probe(bucket_cap_bytes):
    model = TinyMLP(hidden=64, n_hidden=4)
    ddp = BucketedDDP(model, bucket_cap_bytes=bucket_cap_bytes)
    marks = {}

    def last_grad(p):           # the input layer's weight is the last gradient backward produces
        marks["last_grad"] = time.perf_counter()

    model.inp.weight.register_post_accumulate_grad_hook(last_grad)
    x, y = mlp_batch(0, 32, 6, 5)
    with trace() as t:
        F.mse_loss(ddp(x), y).backward()
        returned = time.perf_counter()
    starts = sorted(e.start for e in t.comm() if e.op == "all_reduce")
    ends = [e.end for e in t.comm() if e.op == "all_reduce"]
    return {"starts": starts, "last_grad": marks["last_grad"], "returned": returned, "ends": ends,
            "buckets": len(ddp.buckets)}


def test_bucket_all_reduces_start_before_backward_ends_and_finish_before_it_returns():
    for r in minidist.launch(_overlap_probe, 2, 4096):
        assert r["buckets"] == len(r["starts"]) > 2
        assert r["starts"][0] < r["last_grad"], "no all-reduce overlapped backward"
        assert max(r["ends"]) <= r["returned"], "backward returned before the all-reduces were waited for"


# ----------------------------------------------------------------------------- sub-groups
def _in_subgroups(cases):
    a, b = dist.new_group([0, 1]), dist.new_group([2, 3])
    group = a if dist.get_rank() < 2 else b
    return train_cases(cases, group=group)


def test_variants_work_inside_a_sub_group():
    cases = [dict(variant=v, optimizer="sgd") for v in DDP_VARIANTS]
    out = minidist.launch(_in_subgroups, 4, cases, timeout=120)
    for i, case in enumerate(cases):
        ref = _reference(case)
        for rank in range(4):
            assert (out[rank][i]["params"] - ref).abs().max().item() < TOL, (rank, case)
            # groups of 2: ring 2(N-1)/N·Ψ = Ψ, and a PS worker/server also send Ψ
            assert out[rank][i]["wire_bytes"] == pytest.approx(4 * out[rank][i]["numel"]), case


# ----------------------------------------------------------------------------- bad input
def test_buckets_are_reverse_order_and_capped():
    model = TinyMLP()
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = make_buckets(params, 256)
    assert [p for b in buckets for p in b] == params[::-1]
    assert all(sum(p.numel() * 4 for p in b) <= 256 or len(b) == 1 for b in buckets)
    with pytest.raises(ValueError, match="bucket_cap_bytes"):
        make_buckets(params, 0)


def test_wrappers_outside_a_process_group_say_so():
    with pytest.raises(RuntimeError, match="not initialised"):
        BucketedDDP(TinyMLP())


def _bad_inputs():
    errors = {}
    frozen = TinyMLP().requires_grad_(False)
    for name, make in [("no_trainable", lambda: NaiveDDP(frozen)),
                       ("not_a_module", lambda: BucketedDDP(lambda x: x)),
                       ("bucket_cap", lambda: BucketedDDP(TinyMLP(), bucket_cap_bytes=-1)),
                       ("server", lambda: ParameterServer(TinyMLP(), lambda ps: None, server=7)),
                       ("batch", lambda: train_variant("bucketed_ddp", batch=25))]:
        with trace() as t:
            try:
                make()
                errors[name] = None
            except (ValueError, TypeError) as err:
                errors[name] = (type(err).__name__, str(err), len(t.comm()))
    return errors


def test_bad_input_raises_a_clear_error_before_any_collective():
    errors = minidist.launch(_bad_inputs, 2)[0]
    assert errors["no_trainable"][0] == "ValueError" and "requires_grad" in errors["no_trainable"][1]
    assert errors["not_a_module"][0] == "TypeError"
    assert "bucket_cap_bytes" in errors["bucket_cap"][1]
    assert "server" in errors["server"][1]
    assert "split evenly" in errors["batch"][1]
    assert all(e[2] == 0 for e in errors.values()), "a collective ran before the error"
