"""The diagnosis of a numeric mismatch (minidist/checks/kit/diagnosis.py), one classic mistake per row:
the comparison every lab uses names the worst element and the likely cause."""
import pytest
import torch

from minidist.checks.kit.compare import seeded, tensor_error

SIZES = {"t, the group's size": 2, "N, the world's size": 4, "k": 3}
W = seeded((6, 4), 0, torch.float64) + 0.5          # no zero entries: every ratio is defined
PERM = torch.tensor([2, 0, 1, 5, 3, 4])


def one_row_wrong(x):
    x = x.clone()
    x[4] += 1
    return x


MISTAKES = [
    # (what, the mistake applied to the right answer, words the message must hold)
    ("grad", lambda w: w / 2, ["divided by 2 = t, the group's size", "off by a factor of 2"]),
    ("loss", lambda w: w / 3, ["divided by 3 = k"]),
    ("sum", lambda w: w * 4, ["times 4 = N, the world's size"]),
    ("sum", lambda w: w * 2, ["times 2 = t, the group's size"]),
    ("out", lambda w: -w, ["the sign is flipped"]),
    ("out", lambda w: w[PERM], ["the right rows in the wrong order", "row 0 holds expected row 2",
                                "a permutation applied the wrong way round"]),
    ("x.grad", torch.zeros_like, ["all zeros", "no gradient flowed back", "detached"]),
    ("out", lambda w: w.reshape(-1).flip(0).reshape(6, 4), ["the right values in another order"]),
    ("out", one_row_wrong, ["1 of 6 rows are wrong (row 4)", "the others are right"]),
    ("out", lambda w: w * 1.7, ["every value is 1.7 times the expected one"]),
]


@pytest.mark.parametrize("what, mistake, words", MISTAKES, ids=[m[2][0][:30] for m in MISTAKES])
def test_each_classic_mistake_gets_its_diagnosis(what, mistake, words):
    message = tensor_error(what, mistake(W), W, factors=SIZES)
    assert message.startswith(f"{what} differs from the reference (max |error|"), message
    assert "worst at [" in message and "expected" in message
    for word in words:
        assert word in message, message


def test_a_transposed_matrix_is_named():
    square = seeded((4, 4), 1, torch.float64)
    assert "the transpose of the expected matrix" in tensor_error("weight", square.T.clone(), square)


def test_noise_gets_the_worst_element_and_no_invented_cause():
    noisy = W.clone()
    noisy += seeded(W.shape, 2, torch.float64) * 0.1
    message = tensor_error("out", noisy, W)
    worst = int((noisy - W).abs().argmax())
    assert f"worst at [{worst // 4}, {worst % 4}]: got {float(noisy.reshape(-1)[worst]):.6g}" in message
    assert "likely cause" not in message and "rows are wrong" not in message


def test_within_tolerance_is_right_and_a_reference_that_is_not_one_process_is_named():
    assert tensor_error("out", W + 1e-11, W) is None
    assert "differs from the fp32 run" in tensor_error("out", W * 2, W, against="the fp32 run")
    assert "got nan" in tensor_error("out", torch.full_like(W, float("nan")), W)


def test_a_failure_says_which_group_sizes_pass_when_that_tells_them_apart():
    from minidist.checks.kit.run import by_group_size
    assert "every case with t = 1, t = 4 passes; cases with t = 2 fail" in by_group_size(
        {1: [True], 2: [True, False], 4: [True, True]})
    assert by_group_size({2: [True, False], 4: [False]}) == ""       # every size fails somewhere: nothing to say



# a sum of one input per rank (lab 1's collectives): which inputs each wrong chunk holds
INPUTS = [seeded((8,), r, torch.float64) for r in range(4)]
CHUNKS = [torch.stack(INPUTS).sum(0).tensor_split(4)[c] for c in range(4)]
SUM_MISTAKES = [
    # (the rank's result, its rank, its chunk (None: the whole sum), words the diagnosis must hold)
    (torch.cat([CHUNKS[0], CHUNKS[1], INPUTS[2].tensor_split(4)[2] + INPUTS[3].tensor_split(4)[2], CHUNKS[3]]), 0, None,
     ["chunk 2 holds the sum over ranks 2, 3 only (missing the input of ranks 0, 1)",
      "a received chunk written over the running sum instead of added to it"]),
    (torch.cat([CHUNKS[0], INPUTS[1].tensor_split(4)[1], CHUNKS[2], CHUNKS[3]]), 1, None,
     ["chunk 1 holds this rank's own input only", "the phase that brings the result back"]),
    (CHUNKS[3], 2, 2, ["chunk 2 holds the reduced chunk 3", "a chunk index off by one step"]),
    (INPUTS[0].tensor_split(4)[1] + INPUTS[3].tensor_split(4)[1], 3, 3, ["chunk 3 holds chunk 1 summed over ranks 0, 3 only"]),
]


@pytest.mark.parametrize("got, rank, chunk, words", SUM_MISTAKES, ids=["partial", "own", "moved", "mixed"])
def test_a_sum_missing_terms_names_the_ranks_whose_inputs_it_holds(got, rank, chunk, words):
    from minidist.checks.kit.diagnosis import sum_of_which_inputs
    message = sum_of_which_inputs(got, INPUTS, rank, chunk, lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-12))
    assert message.startswith("likely cause: "), message
    for word in words:
        assert word in message, message


def test_a_sum_that_no_inputs_make_gets_no_invented_cause():
    from minidist.checks.kit.diagnosis import sum_of_which_inputs
    noise = torch.stack(INPUTS).sum(0) + seeded((8,), 9, torch.float64)
    assert sum_of_which_inputs(noise, INPUTS, 0, None, lambda a, b: torch.allclose(a, b)) == ""

@pytest.mark.parametrize("shape", [(7,), (2, 3), (2, 12, 24), (3, 1, 4, 5)])
def test_the_worst_element_is_named_at_torchs_index(shape):
    from minidist.checks.kit.diagnosis import _unravel
    for flat in (0, 1, torch.Size(shape).numel() - 1, torch.Size(shape).numel() // 2):
        assert _unravel(flat, shape) == [int(i) for i in torch.unravel_index(torch.tensor(flat), shape)]


def test_a_diagnosis_imports_nothing_heavy():
    """A failing check diagnoses in every rank of its launch: a diagnosis that imported sympy (as
    torch.unravel_index does on first use) cost most of a second per rank, per failing launch."""
    import subprocess
    import sys
    code = ("import sys, torch\nfrom minidist.checks.kit.diagnosis import diagnose\n"
            "a = torch.arange(12.).reshape(3, 4).double()\nprint(diagnose(a, a.flip(0), 1e-6, {'t': 2}))\n"
            "assert 'sympy' not in sys.modules, 'the diagnosis imported sympy'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "worst at [0, 0]" in out.stdout
